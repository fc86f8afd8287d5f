"""The attack mix of `hypafilter bench rate --attack syn|udp` (issue #24, docs/results.md "Attack mix"): a blocklist of
networks dropped ahead of the policy, attack frames from spoofed sources and from the blocklist, and real connections
the policy accepts, run through each path while the attack frames flood it.

**Blocklist.** `networks` disjoint IPv4 networks (/16 to /32, drawn as published blocklists are: mostly /24s and single
addresses), each in a /16 of its own that holds no address the bench uses otherwise (the attackers, the legitimate
connections' ends, 10/8). Expressed `as_`:
- "ipset": one rule `-m set --match-set SET src -j DROP` ahead of the policy's rules and a hash:net set created with
  `ipset restore` in the firewall's and the oracle's namespaces (the nft path: an interval set and `ip saddr @set
  drop` ahead of the policy's chains);
- "rules": one rule `-s NET -j DROP` per network ahead of the policy's rules (on every path).

**Legitimate connections.** A client and a server address (taken from the trace's or verify's headers), a protocol and
a port that the policy accepts as a new flow in the forward direction with its replies accepted (TCP if the policy
accepts a new TCP connection there, else UDP flows whose datagrams the server echoes: the ClassBench imports accept
only UDP), and per connection a source port the policy accepts too. Chosen from the policy's analysis; whether they
complete is measured (real sockets, on the hybrid path and on the policy alone in iptables, each under the same
flood), never derived. The two addresses are added to the lab's sender and receiver interfaces of the path while its
connections run, then removed.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import random
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from hypafilter import netns
from hypafilter.config import Config
from hypafilter.errors import HypafilterError
from hypafilter.ir import Policy

BLOCKLIST_AS = ("ipset", "rules")
MAX_BLOCKLIST = 40000
DEFAULT_BLOCKLIST = 10000  # networks in --attack's blocklist unless --blocklist says otherwise
BLOCKLIST_SET = "hfrate-block"  # the ipset in the lab's firewall and plain namespaces (and the nft set's name)
NFT_SET = "block"
# Prefix lengths of the blocklist's networks and their weights (published lists: mostly /24s and single addresses).
PREFIXES = ((32, 45), (24, 35), (22, 8), (20, 7), (16, 5))
LEGIT_BYTES = 4096  # payload bytes each way per legitimate connection
UDP_CHUNK = 512
LEGIT_TIMEOUT = 5.0  # seconds a connect, a read or a quiet UDP socket may take (a lost SYN is retried after 1 s)
PARALLEL = 16
UDP_RETRY = 0.5  # seconds before a UDP flow first sends its unanswered datagrams again (then backing off)
UDP_RETRY_MAX = 4.0  # the backed-off resend interval's cap
# The flood's queue ahead of a paced fast path (the emulated NIC) while the legitimate connections run, in seconds of
# its measured rate (rate.rate: the correctness pass's frames per second), at least LEGIT_WINDOW_MIN frames. A NIC's
# receive ring holds microseconds of its line rate; the emulator moves 300-40,000 frames/s, where --window's 2,048
# frames were up to 7 s of queue ahead of every legitimate datagram (issue #24).
LEGIT_QUEUE_S = 0.25
LEGIT_WINDOW_MIN = 64


def _ok_unicast(a: int) -> bool:
    """An address a spoofing or legitimate sender may use: not 0/8, 10/8, 127/8 or class D/E."""
    return (a >> 24) not in (0, 10, 127) and a < 0xE0000000


def blocklist_networks(count: int, seed: int, avoid: set[int] = frozenset()) -> list[tuple[int, int]]:
    """`count` disjoint networks (address, prefix length), each in a /16 of its own holding none of the addresses
    `avoid` (their /16s are skipped) and outside 0/8, 10/8, 127/8 and class D/E."""
    if count < 0 or count > MAX_BLOCKLIST:
        raise HypafilterError(f"--blocklist takes 0 to {MAX_BLOCKLIST} networks")
    rng = random.Random(seed ^ 0xB10C)
    taken = {a >> 16 for a in avoid}
    lengths = [p for p, _ in PREFIXES]
    weights = [w for _, w in PREFIXES]
    out = []
    while len(out) < count:
        block = rng.randint(0x0100, 0xDFFF)
        if block in taken or not _ok_unicast(block << 16):
            continue
        taken.add(block)
        plen = rng.choices(lengths, weights)[0]
        addr = (block << 16) | (rng.getrandbits(16) & ~((1 << (32 - plen)) - 1) & 0xFFFF)
        out.append((addr, plen))
    return out


def net_text(net: tuple[int, int]) -> str:
    return f"{ipaddress.IPv4Address(net[0])}/{net[1]}"


def address_in(net: tuple[int, int], rng: random.Random) -> int:
    """A random address of the network (its first and last too: a spoofed source needs no host part)."""
    a, plen = net
    return a | (rng.getrandbits(32 - plen) if plen < 32 else 0)


def ipset_restore(networks: list[tuple[int, int]], name: str = BLOCKLIST_SET) -> str:
    """`ipset restore` input that creates the set `name` holding the blocklist's networks."""
    # maxelem: ipset's default (what fail2ban's, firewalld's and Docker's sets use), above MAX_BLOCKLIST and within
    # every target's set slot (the emulated NIC's holds 65,536; a larger maxelem makes the set match complex there)
    lines = [f"create {name} hash:net family inet hashsize 16384 maxelem 65536"]
    lines += [f"add {name} {net_text(n)}" for n in networks]
    return "\n".join(lines) + "\n"


def create_ipset(namespaces: list[str], networks: list[tuple[int, int]]) -> None:
    """The blocklist set, exactly these networks, in each namespace. A set of that name made as ipset_restore makes
    it is emptied and refilled in place (one `ipset restore`: the same set, so a fast path following the kernel's
    sets sees element changes); any other is replaced: filled under a scratch name, swapped in (rules may reference
    it) or renamed to it."""
    scratch = BLOCKLIST_SET + "-new"
    header = ipset_restore([], BLOCKLIST_SET).split()  # ipset save adds bucketsize and initval to it
    adds = ipset_restore(networks).split("\n", 1)[1]
    for ns in namespaces:
        try:
            saved = netns.run(["ipset", "save", BLOCKLIST_SET], ns, check=False).splitlines()
            if saved and saved[0].split()[: len(header)] == header:
                # ipset save lists a /32 without its length, in its hash's order
                have = {ln.removesuffix("/32") for ln in saved[1:] if ln.strip()}
                if have != {ln.removesuffix("/32") for ln in adds.splitlines()}:
                    netns.run(["ipset", "restore"], ns, input=f"flush {BLOCKLIST_SET}\n" + adds)
                continue
            netns.run(["ipset", "destroy", scratch], ns, check=False)
            netns.run(["ipset", "restore"], ns, input=ipset_restore(networks, scratch))
            if saved:
                netns.run(["ipset", "swap", scratch, BLOCKLIST_SET], ns)
                netns.run(["ipset", "destroy", scratch], ns)
            else:
                netns.run(["ipset", "rename", scratch, BLOCKLIST_SET], ns)
        except netns.CommandError as e:
            raise HypafilterError(f"creating the blocklist ipset {BLOCKLIST_SET} in {ns} failed: {e}") from e


@contextlib.contextmanager
def host_set_for_check() -> Iterator[None]:
    """The blocklist set, empty, in the host's namespace while the body runs, unless it is there already: deploy's
    kernel check (iptables/kernel.py) loads the policy into a scratch namespace with the host's sets' `create` lines
    (the lab's firewall namespace holds the filled set). Removed afterwards if this made it."""
    made = False
    probe = subprocess.run(["ipset", "list", "-n", BLOCKLIST_SET], capture_output=True)
    if probe.returncode != 0:
        netns.run(["ipset", "create", BLOCKLIST_SET, "hash:net", "family", "inet"])
        made = True
    try:
        yield
    finally:
        if made:
            netns.run(["ipset", "destroy", BLOCKLIST_SET], check=False)


def blocklist_rules(networks: list[tuple[int, int]], as_: str, chain: str) -> list[str]:
    """The iptables rules (restore lines) that drop the blocklist's sources ahead of the policy."""
    if as_ == "ipset":
        return [f"-A {chain} -m set --match-set {BLOCKLIST_SET} src -j DROP"] if networks else []
    if as_ == "rules":
        return [f"-A {chain} -s {net_text(n)} -j DROP" for n in networks]
    raise HypafilterError(f"--blocklist-as is one of {', '.join(BLOCKLIST_AS)} (got '{as_}')")


def with_blocklist(
    policy: Policy,
    config: Config,
    networks: list[tuple[int, int]],
    as_: str,
    sets_ns: str | None = None,
    target: str = "",
) -> Policy:
    """The policy with the blocklist's rules first in its base chain (parsed again from the oracle's text, so that
    every path loads the same rules). `sets_ns`: the namespace whose live sets the set match reads (the lab's
    firewall, where create_ipset made the blocklist), for `target`'s set slots."""
    from hypafilter.iptables.document import parse_policy
    from hypafilter.iptables.writer import policy_restore

    extra = blocklist_rules(networks, as_, policy.base_chain)
    if not extra:
        return policy
    lines = policy_restore(policy, config.table).splitlines()
    at = next(
        (i for i, ln in enumerate(lines) if ln.startswith(f"-A {policy.base_chain} ") or ln == "COMMIT"),
        len(lines),
    )
    text = "\n".join(lines[:at] + extra + lines[at:]) + "\n"
    sets = None
    if as_ == "ipset" and sets_ns:
        from hypafilter.iptables.sets import SetEnv
        from hypafilter.netfilter import ipset
        from hypafilter.targets import set_capability

        slots, capacity = set_capability(target or config.target)
        saved = ipset.save_text(sets_ns)
        found = ipset.parse_save(saved, f"ipset save ({sets_ns})")
        sets = SetEnv(found, slots, capacity, target or config.target, f"live sets of {sets_ns}", text=saved)
    return parse_policy(text, filename=f"{policy.source} + blocklist ({len(networks)} networks as {as_})",
                        base_chain=policy.base_chain, config=config, sets=sets)  # fmt: skip


def nft_blocklist(networks: list[tuple[int, int]]) -> tuple[str, str]:
    """(the nft set's declaration inside the bench's table, the rule ahead of the policy's chains) for "ipset"."""
    elems = ", ".join(net_text(n) for n in networks)
    decl = f"\tset {NFT_SET} {{\n\t\ttype ipv4_addr; flags interval;\n\t\telements = {{ {elems} }}\n\t}}\n"
    return decl, f"ip saddr @{NFT_SET} drop"


# ---- legitimate connections ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LegitFlow:
    """Connections from `client` to `server`:`port` over `proto` ("tcp"/"udp"), one per source port in `sports`."""

    proto: str
    client: int
    server: int
    port: int
    sports: tuple[int, ...]

    def summary(self) -> dict:
        return {
            "proto": self.proto,
            "client": str(ipaddress.IPv4Address(self.client)),
            "server": str(ipaddress.IPv4Address(self.server)),
            "port": self.port,
            "connections": len(self.sports),
        }


def _accepts(plan, proto: int, src: int, dst: int, sport: int, dport: int) -> bool:
    """The policy accepts a new flow src:sport -> dst:dport, its later frames and its replies (ct: no entry, then
    an entry seen from either side)."""
    from hypafilter.analysis.decision import decision
    from hypafilter.ir import ACTION_ACCEPT, PROTO_TCP, Header
    from hypafilter.ir.box import CT_NONE, CT_ORIGINAL, CT_REPLY

    tcp = proto == PROTO_TCP
    frames = (
        (src, dst, sport, dport, 0x02 if tcp else 0, CT_NONE),
        (src, dst, sport, dport, 0x10 if tcp else 0, CT_ORIGINAL),
        (dst, src, dport, sport, 0x12 if tcp else 0, CT_REPLY),
        (dst, src, dport, sport, 0x10 if tcp else 0, CT_REPLY),
    )
    return all(
        decision(plan, Header(s, d, proto, sp, dp, 0, 0, 0, fl, ct))[2] == ACTION_ACCEPT
        for s, d, sp, dp, fl, ct in frames
    )


def legit_flow(
    policy: Policy,
    config: Config,
    headers: list[dict],
    count: int,
    seed: int,
    force: tuple[str, int] | None = None,
    avoid: set[int] = frozenset(),
) -> LegitFlow:
    """`count` connections the policy accepts (see the module text), from the first header that gives them (TCP
    first); `force` (proto, port): that protocol and port whatever the policy says (addresses from the first usable
    header, source ports from 40000 on). `avoid`: addresses that may not be an end (the attackers)."""
    from hypafilter.analysis.plan import build_plan
    from hypafilter.ir import PROTO_TCP, PROTO_UDP

    if count < 1:
        raise HypafilterError("--legit-connections must be at least 1")
    rng = random.Random(seed ^ 0x1E617)
    usable = [
        h
        for h in headers
        if _ok_unicast(h["src"]) and _ok_unicast(h["dst"]) and h["src"] >> 16 != h["dst"] >> 16
        and h["src"] not in avoid and h["dst"] not in avoid
    ]  # fmt: skip
    if not usable:
        raise HypafilterError("bench rate: no header gives a client and a server address for legitimate connections")
    if force:
        proto, port = force
        h = usable[0]
        return LegitFlow(proto, h["src"], h["dst"], port, tuple(range(40000, 40000 + count)))
    plan = build_plan(policy, config)
    for name, proto in (("tcp", PROTO_TCP), ("udp", PROTO_UDP)):
        for h in usable[:2000]:
            if not 1 <= h["dport"] <= 65535 or not _accepts(plan, proto, h["src"], h["dst"], h["sport"], h["dport"]):
                continue
            sports = {h["sport"]} if 1024 <= h["sport"] <= 65535 else set()
            for _ in range(50 * count):
                if len(sports) >= count:
                    break
                sp = rng.randint(1024, 65535)
                if sp not in sports and _accepts(plan, proto, h["src"], h["dst"], sp, h["dport"]):
                    sports.add(sp)
            if len(sports) >= count:
                return LegitFlow(name, h["src"], h["dst"], h["dport"], tuple(sorted(sports)[:count]))
    raise HypafilterError(
        "bench rate: the policy accepts no new TCP or UDP flow (with its replies) of the headers drawn: no legitimate"
        " connections to run; name one with --legit PROTO:PORT"
    )


def parse_legit(text: str | None) -> tuple[str, int] | None:
    """--legit PROTO:PORT."""
    if not text:
        return None
    proto, _, port = text.partition(":")
    if proto not in ("tcp", "udp") or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise HypafilterError(f"--legit takes tcp:PORT or udp:PORT (got '{text}')")
    return proto, int(port)


def _payload(n: int, salt: int) -> bytes:
    return bytes((salt + i * 13) & 0xFF for i in range(n))


@dataclass(frozen=True)
class Legit:
    """How one legitimate connection went: completed, its seconds, and (UDP) the datagrams it sent (resends
    included) and how many it needed."""

    ok: bool
    seconds: float
    sent: int = 0
    needed: int = 0


def _tcp(ns: str, flow: LegitFlow, sport: int, timeout: float) -> Legit:
    """One TCP connection: LEGIT_BYTES up, the server's answer (the same bytes reversed) down, all intact."""
    dst = str(ipaddress.IPv4Address(flow.server))
    msg = _payload(LEGIT_BYTES, sport)
    with netns.inside(ns):
        c = socket.socket()
    c.settimeout(timeout)
    t0 = time.monotonic()
    ok = False
    try:
        c.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        c.bind((str(ipaddress.IPv4Address(flow.client)), sport))
        c.connect((dst, flow.port))
        c.sendall(msg)
        c.shutdown(socket.SHUT_WR)
        out = b""
        while chunk := c.recv(65536):
            out += chunk
        ok = out == msg[::-1]
    except OSError:
        pass
    finally:
        c.close()
    return Legit(ok, time.monotonic() - t0)


def _udp(ns: str, flow: LegitFlow, sport: int, timeout: float) -> Legit:
    """One UDP flow: LEGIT_BYTES in datagrams, each echoed back (its 2-byte number, then the rest reversed); the
    datagrams not yet answered are sent again after UDP_RETRY seconds, the interval doubling (up to UDP_RETRY_MAX)
    while no answer comes, the backoff RFC 8085 (section 3.1) asks of a UDP application that retransmits; until every
    one came back intact or nothing came for `timeout` seconds. (A fixed 0.5 s resend, as before, multiplied the
    flows' datagrams once the path's queue held more than 0.5 s: 16 flows' 8 datagrams each, again every 0.5 s, were
    most of what the 11,100-entry core's emulator moves in a second, issue #24.)"""
    dst = (str(ipaddress.IPv4Address(flow.server)), flow.port)
    grams = [k.to_bytes(2, "big") + _payload(UDP_CHUNK, sport + k) for k in range(max(1, LEGIT_BYTES // UDP_CHUNK))]
    with netns.inside(ns):
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    back: set[int] = set()
    sent, retry, t0 = 0, UDP_RETRY, time.monotonic()
    try:
        s.bind((str(ipaddress.IPv4Address(flow.client)), sport))
        last = time.monotonic()
        while len(back) < len(grams) and time.monotonic() - last < timeout:
            for k, g in enumerate(grams):
                if k not in back:
                    s.sendto(g, dst)
                    sent += 1
            resend, answered = time.monotonic() + retry, len(back)
            while len(back) < len(grams) and (left := resend - time.monotonic()) > 0:
                s.settimeout(left)
                try:
                    g = s.recv(65536)
                except TimeoutError:
                    break
                k = int.from_bytes(g[:2], "big")
                if k < len(grams) and g[2:] == grams[k][2:][::-1]:
                    back.add(k)
                    last = time.monotonic()
            retry = UDP_RETRY if len(back) > answered else min(2 * retry, UDP_RETRY_MAX)
        return Legit(len(back) == len(grams), time.monotonic() - t0, sent, len(grams))
    except OSError:
        return Legit(False, time.monotonic() - t0, sent, len(grams))
    finally:
        s.close()


class _Servers:
    """The flow's server in the receiver namespace: a TCP listener answering each connection with what came,
    reversed, or a UDP socket echoing each datagram (number kept, the rest reversed)."""

    def __init__(self, ns: str, flow: LegitFlow, timeout: float):
        self.flow, self.timeout = flow, timeout
        self._stop = threading.Event()
        with netns.inside(ns):
            kind = socket.SOCK_STREAM if flow.proto == "tcp" else socket.SOCK_DGRAM
            self.sock = socket.socket(socket.AF_INET, kind)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("0.0.0.0", flow.port))
        if flow.proto == "tcp":
            self.sock.listen(256)
        self.sock.settimeout(0.1)
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._handlers: list[threading.Thread] = []

    def __enter__(self) -> _Servers:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        for t in self._handlers:
            t.join()
        self.sock.close()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                if self.flow.proto == "udp":
                    data, peer = self.sock.recvfrom(65536)
                    self.sock.sendto(data[:2] + data[2:][::-1], peer)
                    continue
                c, _ = self.sock.accept()
            except OSError:
                continue
            t = threading.Thread(target=self._handle, args=(c,), daemon=True)
            self._handlers.append(t)
            t.start()

    def _handle(self, c: socket.socket) -> None:
        with c:
            c.settimeout(self.timeout)
            data = b""
            try:
                while chunk := c.recv(65536):
                    data += chunk
                c.sendall(data[::-1])
            except OSError:
                pass


def legit_window(window: int, frames: int, seconds: float, queue_s: float = LEGIT_QUEUE_S) -> int:
    """The flood's frames ahead of a paced fast path while the legitimate connections run: `queue_s` seconds of the
    rate it showed (`frames` decided in `seconds`), within LEGIT_WINDOW_MIN..`window` (`window` itself with queue_s
    0 or no rate). The emulator stays busy with any of them: the flood tops the queue up every millisecond or so."""
    if queue_s <= 0 or seconds <= 0 or frames <= 0:
        return window
    return max(min(LEGIT_WINDOW_MIN, window), min(window, int(frames / seconds * queue_s)))


def _flood(ns, ifname, sender, frames_file, cpu, stop: threading.Event, decided, window, out: dict) -> None:
    """Send the attack frames (every frame once per run, runs one after the other) until `stop`; with `decided` (the
    fast path's decided counter) never more than `window` frames ahead of it. out: frames sent, seconds, error."""
    sent, t0 = 0, time.perf_counter()
    try:
        while not stop.is_set():
            argv = sender.argv(ifname, frames_file, "once", cpu if cpu is not None and cpu >= 0 else None)
            proc = netns.popen(argv, ns, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True)  # fmt: skip
            try:
                if proc.stdout.readline().strip() != "start":
                    raise HypafilterError(f"the flood's sender did not start: {proc.stderr.read()[-500:]}")
                if decided:
                    base = decided()
                    while proc.poll() is None:
                        try:
                            proc.stdin.write(f"{decided() - base + window}\n")
                            proc.stdin.flush()
                        except BrokenPipeError:
                            break
                        time.sleep(0.001)
                else:
                    proc.stdin.close()
                proc.wait()
                if proc.returncode != 0:
                    raise HypafilterError(f"the flood's sender failed: {proc.stderr.read()[-500:]}")
                sent += json.loads(proc.stdout.read())["sent"]
            finally:
                netns.reap(proc)
    except Exception as e:  # reported by the caller
        out["error"] = str(e)
    out["sent"], out["seconds"] = sent, time.perf_counter() - t0


def legit_under_flood(
    lab,
    path: str,
    flow: LegitFlow,
    sender,
    frames_file: Path,
    cpu: int | None,
    decided: Callable[[], int] | None = None,
    window: int = 2048,
    timeout: float = LEGIT_TIMEOUT,
    warmup: float = 0.2,
) -> dict:
    """The flow's connections on `path` ("hyb": the hybrid path, "plain": the policy alone) while the attack frames
    of `frames_file` flood it from the same sender interface: {connections, completed, flood_frames, flood_pps,
    seconds}."""
    ifname = {"hyb": "hyb0", "plain": "plain0"}[path]
    client, server = (str(ipaddress.IPv4Address(a)) for a in (flow.client, flow.server))
    ends = ((lab.ns_send, client, server), (lab.ns_recv, server, client))
    for ns, own, peer in ends:
        netns.run(["ip", "-n", ns, "addr", "add", f"{own}/32", "dev", ifname])
        netns.run(["ip", "-n", ns, "route", "add", f"{peer}/32", "dev", ifname, "src", own])
    stop, flood = threading.Event(), {}
    t = threading.Thread(
        target=_flood, args=(lab.ns_send, ifname, sender, frames_file, cpu, stop, decided, window, flood), daemon=True
    )
    try:
        with _Servers(lab.ns_recv, flow, timeout):
            t.start()
            time.sleep(warmup)
            t0 = time.perf_counter()
            one = _tcp if flow.proto == "tcp" else _udp
            with ThreadPoolExecutor(PARALLEL) as pool:
                done = list(pool.map(lambda sp: one(lab.ns_send, flow, sp, timeout), flow.sports))
            seconds = time.perf_counter() - t0
            stop.set()
            t.join()
    finally:
        stop.set()
        if t.is_alive():
            t.join()
        for ns, own, peer in ends:
            netns.run(["ip", "-n", ns, "route", "del", f"{peer}/32", "dev", ifname], check=False)
            netns.run(["ip", "-n", ns, "addr", "del", f"{own}/32", "dev", ifname], check=False)
            netns.run(["ip", "-n", ns, "neigh", "del", peer, "dev", ifname], check=False)
    if "error" in flood:
        raise HypafilterError(f"legitimate connections on the {path} path: {flood['error']}")
    times = sorted(d.seconds for d in done)
    return {
        "connections": len(flow.sports),
        "completed": sum(d.ok for d in done),
        "seconds": round(seconds, 3),
        # each connection's own time (median, longest) and, for UDP flows, the datagrams they sent (resends
        # included) against the datagrams they needed
        "connection_s": [round(times[len(times) // 2], 3), round(times[-1], 3)] if times else None,
        "datagrams": [sum(d.sent for d in done), sum(d.needed for d in done)] if flow.proto == "udp" else None,
        "window": window if decided else None,
        "flood_frames": flood["sent"],
        "flood_pps": round(flood["sent"] / flood["seconds"], 1) if flood["seconds"] > 0 else 0.0,
    }
