"""The attack mix of `hypafilter bench rate --attack syn|udp` (issue #24, docs/results.md "Attack mix"): a blocklist of
networks dropped ahead of the policy, attack frames from spoofed sources and from the blocklist, and real connections
the policy accepts, run through each path while the attack frames flood it.

**Blocklist.** `networks` disjoint IPv4 networks (/16 to /32, drawn as published blocklists are: mostly /24s and single
addresses), each in a /16 of its own that holds no address the bench uses otherwise (the attackers, the legitimate
connections' ends, 10/8); with IPv6 (`bench rate -6 --attack`, family 6) each network is in the /48 that the
ClassBench mapping (tools.classbench6) makes of such a /16, 2001:db8:BLOCK::/48, as a /48 to /128. Expressed `as_`:
- "ipset": one rule `-m set --match-set SET src -j DROP` ahead of the policy's rules and a hash:net set created with
  `ipset restore` in the firewall's and the oracle's namespaces (the nft path: an interval set and `ip saddr @set
  drop` ahead of the policy's chains); IPv6: an `ip6tables` rule over a `family inet6` set of its own name
  (BLOCKLIST_SET6), the nft path's set in its `ip6` table;
- "rules": one rule `-s NET -j DROP` per network ahead of the policy's rules (on every path).

**Legitimate connections.** A client and a server address (taken from the trace's or verify's headers), a protocol and
a port that the policy accepts as a new flow in the forward direction with its replies accepted (TCP if the policy
accepts a new TCP connection there, else UDP flows whose datagrams the server echoes: the ClassBench imports accept
only UDP), and per connection a source port the policy accepts too. Chosen from the policy's analysis; whether they
complete is measured (real sockets, on the hybrid path and on the policy alone in iptables, each under the same
flood), never derived. The two addresses are added to the lab's sender and receiver interfaces of the path while its
connections run, then removed. IPv6 connections (an IPv6 policy's flow) get static neighbours too: neighbour
discovery is ICMPv6, which the policy under test filters (ARP passes the bridges' iptables unfiltered).
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
BLOCKLIST_SET6 = "hfrate-block6"  # the IPv6 blocklist's (family inet6: a set of its own, never swapped for the other)
NFT_SET = "block"
# Prefix lengths of the blocklist's networks and their weights (published lists: mostly /24s and single addresses).
PREFIXES = ((32, 45), (24, 35), (22, 8), (20, 7), (16, 5))
# IPv6 (family 6): single addresses, /64 subnets, /56 and /48 sites, as IPv6 lists ban them
PREFIXES6 = ((128, 45), (64, 35), (56, 8), (52, 7), (48, 5))
AF = {4: socket.AF_INET, 6: socket.AF_INET6}
V6_BASE = 0x20010DB8 << 96  # 2001:db8::/32, where tools.classbench6 maps the IPv4 space (a/len -> /(32 + len))
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
    """An address a spoofing or legitimate sender may use: not 0/8, 10/8, 127/8 or class D/E; IPv6: global unicast
    (2000::/3)."""
    if a >> 32:
        return a >> 125 == 1
    return (a >> 24) not in (0, 10, 127) and a < 0xE0000000


def family_of(a: int) -> int:
    """The family of one of the mix's addresses: IPv6 above 32 bits (they are all global unicast, never ::/96)."""
    return 6 if a >> 32 else 4


def _ip(a: int) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    return ipaddress.IPv6Address(a) if family_of(a) == 6 else ipaddress.IPv4Address(a)


def _site(a: int) -> int:
    """The /16 of an IPv4 address, the /48 of an IPv6 one (the mapping of a /16 under V6_BASE): the blocklist's unit."""
    return a >> (80 if family_of(a) == 6 else 16)


def set_name(family: int = 4) -> str:
    return BLOCKLIST_SET6 if family == 6 else BLOCKLIST_SET


def blocklist_networks(count: int, seed: int, avoid: set[int] = frozenset(), family: int = 4) -> list[tuple[int, int]]:
    """`count` disjoint networks (address, prefix length), each in a /16 of its own holding none of the addresses
    `avoid` (their /16s are skipped) and outside 0/8, 10/8, 127/8 and class D/E. `family` 6: the same /16s drawn,
    each network in the /48 the ClassBench mapping makes of it (2001:db8:BLOCK::/48), of PREFIXES6's lengths."""
    if count < 0 or count > MAX_BLOCKLIST:
        raise HypafilterError(f"--blocklist takes 0 to {MAX_BLOCKLIST} networks")
    rng = random.Random(seed ^ 0xB10C)
    bits, top, prefixes = (128, V6_BASE, PREFIXES6) if family == 6 else (32, 0, PREFIXES)
    low = bits - 48 if family == 6 else 16  # the bits below the /16 (IPv4) or its /48 (IPv6)
    taken = {_site(a) for a in avoid}
    lengths = [p for p, _ in prefixes]
    weights = [w for _, w in prefixes]
    out = []
    while len(out) < count:
        block = rng.randint(0x0100, 0xDFFF)
        site = top | (block << low)
        if _site(site) in taken or not _ok_unicast(block << 16):
            continue
        taken.add(_site(site))
        plen = rng.choices(lengths, weights)[0]
        addr = site | (rng.getrandbits(low) & ~((1 << (bits - plen)) - 1) & ((1 << low) - 1))
        out.append((addr, plen))
    return out


def net_text(net: tuple[int, int]) -> str:
    return f"{_ip(net[0])}/{net[1]}"


def address_in(net: tuple[int, int], rng: random.Random) -> int:
    """A random address of the network (its first and last too: a spoofed source needs no host part)."""
    a, plen = net
    bits = 128 if family_of(a) == 6 else 32
    return a | (rng.getrandbits(bits - plen) if plen < bits else 0)


def ipset_restore(networks: list[tuple[int, int]], name: str = BLOCKLIST_SET, family: int = 4) -> str:
    """`ipset restore` input that creates the set `name` holding the blocklist's networks (`family` 6: inet6)."""
    # maxelem: ipset's default (what fail2ban's, firewalld's and Docker's sets use), above MAX_BLOCKLIST and within
    # every target's set slot (the emulated NIC's holds 65,536; a larger maxelem makes the set match complex there)
    inet = "inet6" if family == 6 else "inet"
    lines = [f"create {name} hash:net family {inet} hashsize 16384 maxelem 65536"]
    lines += [f"add {name} {net_text(n)}" for n in networks]
    return "\n".join(lines) + "\n"


def create_ipset(namespaces: list[str], networks: list[tuple[int, int]], family: int = 4) -> None:
    """The blocklist set (set_name(family)), exactly these networks, in each namespace. A set of that name made as
    ipset_restore makes it is emptied and refilled in place (one `ipset restore`: the same set, so a fast path
    following the kernel's sets sees element changes); any other is replaced: filled under a scratch name, swapped in
    (rules may reference it) or renamed to it."""
    name = set_name(family)
    scratch = name + "-new"
    header = ipset_restore([], name, family).split()  # ipset save adds bucketsize and initval to it
    adds = ipset_restore(networks, name, family).split("\n", 1)[1]

    def host(ln: str) -> str:  # ipset save lists a /32 (/128) without its length, in its hash's order
        return ln.removesuffix("/128" if family == 6 else "/32")

    for ns in namespaces:
        try:
            saved = netns.run(["ipset", "save", name], ns, check=False).splitlines()
            if saved and saved[0].split()[: len(header)] == header:
                have = {host(ln) for ln in saved[1:] if ln.strip()}
                if have != {host(ln) for ln in adds.splitlines()}:
                    netns.run(["ipset", "restore"], ns, input=f"flush {name}\n" + adds)
                continue
            netns.run(["ipset", "destroy", scratch], ns, check=False)
            netns.run(["ipset", "restore"], ns, input=ipset_restore(networks, scratch, family))
            if saved:
                netns.run(["ipset", "swap", scratch, name], ns)
                netns.run(["ipset", "destroy", scratch], ns)
            else:
                netns.run(["ipset", "rename", scratch, name], ns)
        except netns.CommandError as e:
            raise HypafilterError(f"creating the blocklist ipset {name} in {ns} failed: {e}") from e


@contextlib.contextmanager
def host_set_for_check() -> Iterator[None]:
    """The blocklist set, empty, in the host's namespace while the body runs, unless it is there already: deploy's
    kernel check (iptables/kernel.py) loads the policy into a scratch namespace with the host's sets' `create` lines
    (the lab's firewall namespace holds the filled set). Removed afterwards if this made it. (IPv4: the IPv6 side's
    check, netfilter.ip6.check, creates the sets of its own `sets_text`.)"""
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


def blocklist_rules(networks: list[tuple[int, int]], as_: str, chain: str, family: int = 4) -> list[str]:
    """The iptables (`family` 6: ip6tables) rules, restore lines, that drop the blocklist's sources ahead of the
    policy."""
    if as_ == "ipset":
        return [f"-A {chain} -m set --match-set {set_name(family)} src -j DROP"] if networks else []
    if as_ == "rules":
        return [f"-A {chain} -s {net_text(n)} -j DROP" for n in networks]
    raise HypafilterError(f"--blocklist-as is one of {', '.join(BLOCKLIST_AS)} (got '{as_}')")


def with_blocklist(policy, config: Config, networks: list[tuple[int, int]], as_: str, sets_ns: str | None = None,
                   target: str = ""):  # fmt: skip
    """The policy with the blocklist's rules first in its base chain (parsed again from the oracle's text, so that
    every path loads the same rules). `sets_ns`: the namespace whose live sets the set match reads (the lab's
    firewall, where create_ipset made the blocklist), for `target`'s set slots. `policy`: an ir.Policy (IPv4), or
    the IPv6 side (netfilter.ip6.V6Policy: its text, its front end's reading `ir` and the kernel's check of it made
    again, as bench rate -6 reads the file)."""
    from hypafilter.iptables.document import parse_policy

    six = getattr(policy, "kind", None) is not None  # a V6Policy ("policy"; the IR Policy has no kind)
    extra = blocklist_rules(networks, as_, policy.base_chain, 6 if six else 4)
    if not extra:
        return policy
    if six:
        lines = policy.text.splitlines()
    else:
        from hypafilter.iptables.writer import policy_restore

        lines = policy_restore(policy, config.table).splitlines()
    start = next((i for i, ln in enumerate(lines) if ln.strip() == "*filter"), 0)  # (an IPv6 file's other tables)
    at = next(
        (i for i, ln in enumerate(lines[start:], start) if ln.startswith(f"-A {policy.base_chain} ") or ln == "COMMIT"),
        len(lines),
    )
    text = "\n".join(lines[:at] + extra + lines[at:]) + "\n"
    source = f"{policy.source} + blocklist ({len(networks)} networks as {as_})"
    sets = None
    if as_ == "ipset" and sets_ns:
        from hypafilter.iptables.sets import SetEnv
        from hypafilter.netfilter import ipset
        from hypafilter.targets import set_capability, set_capability6

        tgt = target or config.target
        slots, capacity = set_capability(tgt)
        saved = ipset.save_text(sets_ns)
        found = ipset.parse_save(saved, f"ipset save ({sets_ns})")
        sets = SetEnv(found, slots, capacity, tgt, f"live sets of {sets_ns}", text=saved,
                      v6_slots=set_capability6(tgt))  # fmt: skip
    if not six:
        return parse_policy(text, filename=source, base_chain=policy.base_chain, config=config, sets=sets)
    import dataclasses

    from hypafilter.netfilter import ip6

    ir = parse_policy(text, filename=source, base_chain=policy.base_chain, config=config, allow_empty=True, family=6,
                      sets=sets)  # fmt: skip
    v6 = ip6.parse(text, source, policy.base_chain, sets_text=sets.text if sets is not None else "")
    return dataclasses.replace(v6, ir=ir)


def nft_blocklist(networks: list[tuple[int, int]], family: int = 4) -> tuple[str, str]:
    """(the nft set's declaration inside the bench's table, the rule ahead of the policy's chains) for "ipset"; its
    `family` 6 form goes into the bench's ip6 table."""
    elems = ", ".join(net_text(n) for n in networks)
    kind, word = ("ipv6_addr", "ip6") if family == 6 else ("ipv4_addr", "ip")
    decl = f"\tset {NFT_SET} {{\n\t\ttype {kind}; flags interval;\n\t\telements = {{ {elems} }}\n\t}}\n"
    return decl, f"{word} saddr @{NFT_SET} drop"


# ---- legitimate connections ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LegitFlow:
    """Connections from `client` to `server`:`port` over `proto` ("tcp"/"udp"), one per source port in `sports`."""

    proto: str
    client: int
    server: int
    port: int
    sports: tuple[int, ...]

    @property
    def family(self) -> int:
        return family_of(self.client)

    def summary(self) -> dict:
        return {
            "proto": self.proto,
            "client": str(_ip(self.client)),
            "server": str(_ip(self.server)),
            "port": self.port,
            "connections": len(self.sports),
        }


def _accepts(plan, proto: int, src: int, dst: int, sport: int, dport: int) -> bool:
    """The policy accepts a new flow src:sport -> dst:dport, its later frames and its replies (ct: no entry, then
    an entry seen from either side). An IPv6 plan's addresses are its ranks (ir.family)."""
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
    ranks = plan.addr_map.header if getattr(plan, "addr_map", None) is not None else (lambda h: h)
    return all(
        decision(plan, ranks(Header(s, d, proto, sp, dp, 0, 0, 0, fl, ct)))[2] == ACTION_ACCEPT
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
    header, source ports from 40000 on). `avoid`: addresses that may not be an end (the attackers). An IPv6 policy
    (family 6) with headers of 128-bit addresses: an IPv6 flow."""
    from hypafilter.analysis.plan import build_plan
    from hypafilter.ir import PROTO_TCP, PROTO_UDP

    if count < 1:
        raise HypafilterError("--legit-connections must be at least 1")
    rng = random.Random(seed ^ 0x1E617)
    usable = [
        h
        for h in headers
        if _ok_unicast(h["src"]) and _ok_unicast(h["dst"]) and _site(h["src"]) != _site(h["dst"])
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
    dst = str(_ip(flow.server))
    msg = _payload(LEGIT_BYTES, sport)
    with netns.inside(ns):
        c = socket.socket(AF[flow.family])
    c.settimeout(timeout)
    t0 = time.monotonic()
    ok = False
    try:
        c.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        c.bind((str(_ip(flow.client)), sport))
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
    dst = (str(_ip(flow.server)), flow.port)
    grams = [k.to_bytes(2, "big") + _payload(UDP_CHUNK, sport + k) for k in range(max(1, LEGIT_BYTES // UDP_CHUNK))]
    with netns.inside(ns):
        s = socket.socket(AF[flow.family], socket.SOCK_DGRAM)
    back: set[int] = set()
    sent, retry, t0 = 0, UDP_RETRY, time.monotonic()
    try:
        s.bind((str(_ip(flow.client)), sport))
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
            self.sock = socket.socket(AF[flow.family], kind)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if flow.family == 6:
            self.sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        self.sock.bind(("::" if flow.family == 6 else "0.0.0.0", flow.port))
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
    client, server = (str(_ip(a)) for a in (flow.client, flow.server))
    ends = ((lab.ns_send, client, server, "recv"), (lab.ns_recv, server, client, "send"))
    host = "/128" if flow.family == 6 else "/32"
    for ns, own, peer, role in ends:
        netns.run(["ip", "-n", ns, "addr", "add", own + host, "dev", ifname, *(["nodad"] if flow.family == 6 else [])])
        netns.run(["ip", "-n", ns, "route", "add", peer + host, "dev", ifname, "src", own])
        if flow.family == 6:  # neighbour discovery is ICMPv6: the policy under test would filter it
            mac = lab.mac(role, path)
            netns.run(["ip", "-n", ns, "neigh", "replace", peer, "lladdr", mac, "dev", ifname, "nud", "permanent"])
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
        for ns, own, peer, _ in ends:
            netns.run(["ip", "-n", ns, "route", "del", peer + host, "dev", ifname], check=False)
            netns.run(["ip", "-n", ns, "addr", "del", own + host, "dev", ifname], check=False)
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
