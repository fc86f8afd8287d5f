"""Real connections between the lab's sender and receiver namespaces, TCP with payload both ways and UDP datagrams
echoed back, on the hybrid path and on the plain one, so that the two are compared on what applications see
(`hypafilter verify --connections`, and the system tests).

Servers run in the receiver namespace, bound to 0.0.0.0, so one set serves both paths (the paths have their own
addresses, ops/lab.py); clients run in the sender namespace. Connection i leaves from the same source port on both
paths, so a policy's port matches see the same headers. A TCP client sends its payload, shuts its side, and reads
to the end; the server reads to the end and answers with what came, reversed (`repeat` times), then closes.
"""

from __future__ import annotations

import contextlib
import fcntl
import select
import socket
import struct
import termios
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from hypafilter.errors import HypafilterError
from hypafilter.ir import FIELD_INDEX, PROTO_TCP, PROTO_UDP, Policy
from hypafilter.netns import inside

REPLY_REPEAT = 50  # tcp_talk's default: the reversed request this many times, several segments back
TIMEOUT = 2.0  # seconds a connect, read, send or quiet UDP socket may go without progress before the connection fails
UDP_CHUNK = 1024  # payload bytes per datagram, under every lab MTU
SEQ = struct.Struct("!I")  # the sequence number that opens every datagram of a UDP connection
SPORT_BASE = 40000  # connection i leaves from SPORT_BASE + i
MAX_CONNECTIONS = 20000
KINDS = ("tcp", "udp")  # connection kinds, in the order verify runs them in turn
MAX_BYTES = 1 << 20
PARALLEL = 32  # connections in flight per path: a blocked one costs one TIMEOUT, not one each
UNNAMED_PORT = 47999  # a port no fixed rule of a typical policy names, so some connections meet the chain policy
AF = {4: socket.AF_INET, 6: socket.AF_INET6}
ANY = {4: "0.0.0.0", 6: "::"}


class TcpServers:
    """Listening sockets in `ns`, one per port (see the module text). `received`: bytes each connection delivered,
    by (client address, client port, server port)."""

    def __init__(
        self, ns: str, ports: Sequence[int], repeat: int = REPLY_REPEAT, timeout: float = TIMEOUT, family: int = 4
    ):
        self.repeat, self.timeout = repeat, timeout
        self.received: dict[tuple[str, int, int], int] = {}
        self._stop = threading.Event()
        self._handlers: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._socks = []
        with inside(ns):
            for port in sorted(set(ports)):
                s = socket.socket(AF[family])
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                if family == 6:
                    s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                s.bind((ANY[family], port))
                s.listen(128)
                s.settimeout(0.2)
                self._socks.append(s)
        self._threads = [threading.Thread(target=self._serve, args=(s,), daemon=True) for s in self._socks]

    def __enter__(self) -> TcpServers:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for t in self._threads:
            t.join()
        self.settle()
        for s in self._socks:
            s.close()

    def _serve(self, srv: socket.socket) -> None:
        while not self._stop.is_set():
            try:
                c, peer = srv.accept()
            except OSError:
                continue
            t = threading.Thread(target=self._handle, args=(c, peer, srv.getsockname()[1]), daemon=True)
            with self._lock:  # started under the lock: settle() never sees a listed thread it cannot join yet
                t.start()
                self._handlers.append(t)

    def _handle(self, c: socket.socket, peer: tuple[str, int], port: int) -> None:
        data = b""
        with c:
            c.settimeout(self.timeout)
            try:
                while chunk := c.recv(65536):
                    data += chunk
            except OSError:
                pass
            self.received[(peer[0], peer[1], port)] = len(data)
            try:
                send_all(c, data[::-1] * self.repeat)
            except OSError:
                pass

    def settle(self) -> None:
        """Wait until every accepted connection has been answered (or timed out)."""
        with self._lock:
            handlers = list(self._handlers)
        for t in handlers:
            t.join()


class UdpServers:
    """Bound UDP sockets in `ns`, one per port; `got` lists (client address, client port, server port, payload) in
    arrival order. With `echo`, each datagram goes back to its sender: its 4-byte sequence number, then the rest
    reversed."""

    def __init__(self, ns: str, ports: Sequence[int], echo: bool = False, family: int = 4):
        self.echo = echo
        self.got: list[tuple[str, int, int, bytes]] = []
        self.last = time.monotonic()
        self._stop = threading.Event()
        with inside(ns):
            self._socks = {}
            for port in sorted(set(ports)):
                s = socket.socket(AF[family], socket.SOCK_DGRAM)
                if family == 6:
                    s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                s.bind((ANY[family], port))
                s.setblocking(False)
                self._socks[s.fileno()] = (s, port)
        self._thread = threading.Thread(target=self._serve, daemon=True)

    def __enter__(self) -> UdpServers:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        for s, _ in self._socks.values():
            s.close()

    def _serve(self) -> None:
        socks = [s for s, _ in self._socks.values()]
        while not self._stop.is_set():
            ready, _, _ = select.select(socks, [], [], 0.05)
            for s in ready:
                port = self._socks[s.fileno()][1]
                while True:
                    try:
                        data, peer = s.recvfrom(65536)
                    except OSError:
                        break
                    self.got.append((peer[0], peer[1], port, data))
                    self.last = time.monotonic()
                    if self.echo:
                        try:
                            s.sendto(data[: SEQ.size] + data[SEQ.size :][::-1], peer)
                        except OSError:
                            pass

    def quiet(self, wait: float) -> None:
        """Return once no datagram has arrived for `wait` seconds."""
        self.last = time.monotonic()
        while (left := self.last + wait - time.monotonic()) > 0:
            time.sleep(left)


def send_all(c: socket.socket, data: bytes) -> None:
    """All of `data` into `c`'s send queue, failing after `c`'s timeout without progress (each send waits that long
    for room). socket.sendall's timeout bounds the whole call (Python 3.5+): 200 KB on a slow path (the emulated NIC
    under load) failed a connection that never stalled."""
    view = memoryview(data)
    while view:
        view = view[c.send(view) :]


def _unacked(c: socket.socket) -> int:
    """Bytes `c` has sent or queued that its peer has not acknowledged (SIOCOUTQ, = TIOCOUTQ)."""
    return struct.unpack("i", fcntl.ioctl(c.fileno(), termios.TIOCOUTQ, b"\0\0\0\0"))[0]


def recv_waiting(c: socket.socket) -> bytes:
    """The next bytes from `c`; while none come, waits on as long as the peer still acknowledges `c`'s own bytes
    (a server answers once it has them all, and they may still be crossing a slow path): fails after `c`'s timeout
    in which neither happened."""
    left = _unacked(c)
    while True:
        try:
            return c.recv(65536)
        except TimeoutError:
            now = _unacked(c)
            if now >= left:  # nothing acknowledged in the timeout (all acknowledged earlier: left = 0)
                raise
            left = now


def _tcp_client(
    ns: str,
    dst: str,
    port: int,
    message: bytes,
    timeout: float,
    sport: int | None,
    want: int | None = None,
    src: str = "0.0.0.0",
) -> tuple[bytes, bool]:
    """Connect from `ns` (from address `src`), send `message`, shut the sending side, read to the end (or until
    `want` bytes came): (what came back, whether it all went without an error)."""
    with inside(ns):
        c = socket.socket(AF[6] if ":" in dst else AF[4])
    c.settimeout(timeout)
    out = b""
    try:
        if sport is not None:
            c.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            c.bind((src, sport))
        c.connect((dst, port))
        send_all(c, message)
        c.shutdown(socket.SHUT_WR)
        while want is None or len(out) < want:
            chunk = recv_waiting(c)
            if not chunk:
                break
            out += chunk
        return out, True
    except OSError:
        return out, False
    finally:
        c.close()


def tcp_talk(
    ns: str,
    dst: str,
    port: int,
    message: bytes = b"hello hypafilter",
    timeout: float = 3.0,
    sport: int | None = None,
) -> bytes | None:
    """Connect from `ns` (from source port `sport` if given) to a TcpServers port, send `message`, read the whole
    answer; None when the connection does not complete."""
    out, ok = _tcp_client(ns, dst, port, message, timeout, sport, want=len(message) * REPLY_REPEAT)
    return out if ok else None


def udp_delivered(
    ns_send: str,
    ns_recv: str,
    dst: str,
    sends: Sequence[tuple[int, bytes]],
    wait: float = 1.0,
    sport: int | None = None,
) -> list:
    """Send each (port, payload) datagram from `ns_send` (from source port `sport` if given) to `dst`, in order;
    the (port, payload) pairs that reached sockets bound in `ns_recv`."""
    with UdpServers(ns_recv, [p for p, _ in sends]) as srv:
        with inside(ns_send):
            tx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            if sport is not None:
                tx.bind(("0.0.0.0", sport))
            for p, payload in sends:
                tx.sendto(payload, (dst, p))
            srv.quiet(wait)
        finally:
            tx.close()
    return sorted((port, data) for _, _, port, data in srv.got)


# ---- a set of connections on both paths ---------------------------------------------------------------------------

DIRECTIONS = ("in", "out")  # host mode: to the host (servers in the firewall), from it (servers at the sender)


@dataclass(frozen=True)
class Conn:
    """One connection: "tcp" or "udp", the server port, the client's source port; `direction` in host mode ("in":
    the sender connects to the host, "out": the host connects to the sender), "" in bridge mode (sender to
    receiver, through the firewall)."""

    proto: str
    port: int
    sport: int
    direction: str = ""
    family: int = 4  # 6: over IPv6, between the lab's IPv6 addresses (docs/ipv6.md)

    @property
    def name(self) -> str:
        v6 = " (IPv6)" if self.family == 6 else ""
        return f"{self.proto}/{self.sport}->{self.port}" + (f" ({self.direction})" if self.direction else "") + v6


@dataclass(frozen=True)
class ConnectionSpec:
    """`verify --connections N --connection-bytes B --connection-kinds K`: N connections of the kinds K in turn
    (default TCP and UDP, so half each), B payload bytes each way."""

    connections: int = 10
    nbytes: int = 4096
    kinds: tuple[str, ...] = KINDS

    def __post_init__(self) -> None:
        if not 1 <= self.connections <= MAX_CONNECTIONS:
            raise HypafilterError(f"--connections must be between 1 and {MAX_CONNECTIONS}")
        if not 1 <= self.nbytes <= MAX_BYTES:
            raise HypafilterError(f"--connection-bytes must be between 1 and {MAX_BYTES}")
        if not self.kinds or any(k not in KINDS for k in self.kinds) or len(set(self.kinds)) != len(self.kinds):
            raise HypafilterError(
                f"--connection-kinds takes {' and/or '.join(KINDS)}, each once (got {','.join(self.kinds) or 'none'})"
            )

    def conns(self, policy: Policy, host: bool = False) -> list[Conn]:
        """The kinds in turn, each cycling through the ports the policy's rules name (policy_ports); `host`: the
        directions in turn too, every kind into the host, then every kind out of it."""
        ports = policy_ports(policy)
        out = []
        for i in range(self.connections):
            proto = self.kinds[i % len(self.kinds)]
            direction = DIRECTIONS[(i // len(self.kinds)) % 2] if host else ""
            out.append(Conn(proto, ports[proto][(i // 2) % len(ports[proto])], SPORT_BASE + i, direction))
        return out


def policy_ports(policy: Policy) -> dict[str, list[int]]:
    """Per protocol, the destination ports the policy's rules name (each range's ends), and UNNAMED_PORT."""
    ip, ilo = FIELD_INDEX["proto"], FIELD_INDEX["dport"]
    out: dict[str, set[int]] = {"tcp": {UNNAMED_PORT}, "udp": {UNNAMED_PORT}}
    for r in policy.rules:
        for b in r.boxes:
            lo, hi = b.lo[ilo], b.hi[ilo]
            if lo == 0 and hi == 0xFFFF:
                continue
            for proto, num in (("tcp", PROTO_TCP), ("udp", PROTO_UDP)):
                if b.lo[ip] <= num <= b.hi[ip]:
                    out[proto].update(p for p in (lo, hi) if p)
    return {k: sorted(v) for k, v in out.items()}


def _payload(n: int, salt: int) -> bytes:
    return bytes((salt + i * 7) & 0xFF for i in range(n))


def _datagrams(n: int) -> list[bytes]:
    return [SEQ.pack(k) + _payload(min(UDP_CHUNK, n - at), k) for k, at in enumerate(range(0, n, UDP_CHUNK))]


@dataclass(frozen=True)
class Ends:
    """Where a connection of one path and direction runs: its client in `client_ns` connects to `dst`, its server
    listens in `server_ns` and sees the client as `src`."""

    client_ns: str
    server_ns: str
    dst: str
    src: str


# Host mode: the host's address on each path, in the sender's subnet of that path (lab.ADDRS, lab.ADDRS6), so the
# sender reaches it on-link (host_connections gives both ends static neighbours and the host a route back).
HOST_ADDRESS = {"hyb": "10.0.254.1", "plain": "10.1.254.1"}
HOST_ADDRESS6 = {"hyb": "fd48:4600::fe:1", "plain": "fd48:4601::fe:1"}
HOST_ROLE = {"hyb": "fw", "plain": "plain"}


def ends(lab, path: str, direction: str, family: int = 4) -> Ends:
    """The ends of a connection of `direction` ("" bridge mode, "in", "out": host mode) on `path`; `family` 6: over
    the lab's IPv6 addresses (HOST_ADDRESS6 for the host)."""
    if family == 6:
        sender, host = lab.ip6("send", path), HOST_ADDRESS6[path]
    else:
        sender, host = lab.ip("send", path), HOST_ADDRESS[path]
    if direction == "in":
        return Ends(lab.ns_send, lab.ns(HOST_ROLE[path]), host, sender)
    if direction == "out":
        return Ends(lab.ns(HOST_ROLE[path]), lab.ns_send, sender, host)
    if family == 6:
        return Ends(lab.ns_send, lab.ns_recv, lab.ip6("recv", path), sender)
    return Ends(lab.ns_send, lab.ns_recv, lab.ip("recv", path), sender)


@contextlib.contextmanager
def host_connections(lab, ipv6: bool = False):
    """Host mode (Lab.host_mode on): the host (the firewall, and the plain namespace for the oracle) reachable at
    HOST_ADDRESS[path] from the sender, and able to answer it, while the connections run: static neighbours both
    ways (no ARP, which the host's bridges would answer for every address), a /32 route to the sender in the
    host's local table (where `local 0.0.0.0/0` would take the sender's address for the host's own), and the host's
    own traffic to the sender let out of hf_host's quiet chain (which keeps the host silent while verify's frames
    run). `ipv6` (Lab.host_mode(on, ipv6=True)): the same at HOST_ADDRESS6 (static neighbours: no neighbour
    discovery, which the host, without an address, would not answer; a /128 route beside `local ::/0`), and the
    host's address on its bridge (/128, no duplicate address detection, nothing sent: the quiet chain), which an IPv6
    socket needs to bind to it (the local route alone lets the host receive for it, not leave from it). All taken
    back afterwards."""
    from hypafilter.ops.lab import BRIDGES, HOST_MAC, HOST_TABLE

    undo: list[tuple[str, list[str]]] = []

    def do(ns: str, argv: list[str], back: list[str]) -> None:
        lab.exec_in(ns, argv)
        undo.append((ns, back))

    try:
        for path, role in HOST_ROLE.items():
            ns, br = lab.ns(role), BRIDGES[role][0]
            sender_if, sender_mac = f"{path}0", lab.mac("send", path)
            families = [("-4", "ip", lab.ip("send", path), HOST_ADDRESS[path], 32)]
            if ipv6:
                families.append(("-6", "ip6", lab.ip6("send", path), HOST_ADDRESS6[path], 128))
            for fam, nft_fam, sender, host, plen in families:
                if fam == "-6":  # before the route, whose source it is
                    addr = [f"{host}/128", "dev", br]
                    do(
                        ns,
                        ["ip", fam, "addr", "replace", *addr, "nodad", "noprefixroute"],
                        ["ip", fam, "addr", "del", *addr],
                    )
                neigh = [host, "lladdr", HOST_MAC, "dev", sender_if, "nud", "permanent"]
                do(
                    lab.ns_send,
                    ["ip", fam, "neigh", "replace", *neigh],
                    ["ip", fam, "neigh", "del", host, "dev", sender_if],
                )
                neigh = [sender, "lladdr", sender_mac, "dev", br, "nud", "permanent"]
                do(ns, ["ip", fam, "neigh", "replace", *neigh], ["ip", fam, "neigh", "del", sender, "dev", br])
                route = [f"{sender}/{plen}", "dev", br, "table", "local", "src", host]
                do(ns, ["ip", fam, "route", "replace", *route], ["ip", fam, "route", "del", *route])
                rule = ["nft", "insert", "rule", "inet", HOST_TABLE, "quiet", nft_fam, "daddr", sender, "accept"]
                do(ns, rule, ["nft", "flush", "chain", "inet", HOST_TABLE, "quiet"])  # has no rules of its own
        yield
    finally:
        for ns, argv in reversed(undo):
            lab.exec_in(ns, argv, check=False)


def run_path(
    lab,
    path: str,
    conns: Sequence[Conn],
    nbytes: int,
    tcp: dict[tuple[str, int], TcpServers],
    udp: dict[tuple[str, int], UdpServers],
) -> list[dict]:
    """Run `conns` on one path ("hyb" or "plain") against running servers (`tcp`, `udp`: by namespace and family); per
    connection its outcome: completed, what arrived up (client to server) and down (TCP: bytes; UDP: the sequence
    numbers of the datagrams) and whether what came back was what was sent, reversed."""

    def one(c: Conn) -> dict:
        e = ends(lab, path, c.direction, c.family)
        if c.proto == "tcp":
            message = _payload(nbytes, c.sport)
            out, ok = _tcp_client(e.client_ns, e.dst, c.port, message, TIMEOUT, c.sport, src=e.src)
            return {"completed": ok, "down": len(out), "intact": out == message[::-1][: len(out)]}
        grams = _datagrams(nbytes)
        with inside(e.client_ns):
            s = socket.socket(AF[c.family], socket.SOCK_DGRAM)
        back, intact = set(), True
        try:
            s.bind((e.src, c.sport))  # the path's own address: the other path's client has the same port
            s.settimeout(TIMEOUT / 2)
            for g in grams:
                s.sendto(g, (e.dst, c.port))
            while len(back) < len(grams):
                g = s.recv(65536)
                k = SEQ.unpack_from(g)[0] if len(g) >= SEQ.size else -1
                intact &= 0 <= k < len(grams) and g[SEQ.size :] == grams[k][SEQ.size :][::-1]
                back.add(k)
        except OSError:
            pass
        finally:
            s.close()
        return {"completed": len(back) == len(grams), "down": sorted(back), "intact": intact}

    with ThreadPoolExecutor(PARALLEL) as pool:
        results = list(pool.map(one, conns))
    for srv in tcp.values():
        srv.settle()
    for srv in udp.values():
        srv.quiet(0.2)
    for c, r in zip(conns, results, strict=True):
        e = ends(lab, path, c.direction, c.family)
        key = (e.server_ns, c.family)
        if c.proto == "tcp":
            r["up"] = tcp[key].received.get((e.src, c.sport, c.port), 0)
            r["completed"] &= r["up"] == nbytes and r["down"] == nbytes
        else:
            up = [d for a, sp, p, d in udp[key].got if (a, sp, p) == (e.src, c.sport, c.port)]
            r["up"] = sorted(SEQ.unpack_from(d)[0] for d in up if len(d) >= SEQ.size)
            r["completed"] &= len(r["up"]) == len(_datagrams(nbytes))
    return results


def run_both(lab, conns: Sequence[Conn], nbytes: int, repeat: int = 1) -> dict[str, list[dict]]:
    """Outcomes of the same connections on the hybrid path and on the plain one (see run_path), the two paths side
    by side: they share no namespace but the sender's and the receiver's (whose servers tell them apart by the
    client's address), so a blocked connection costs its timeout once, not once per path."""
    with contextlib.ExitStack() as stack:
        tcp: dict[tuple[str, int], TcpServers] = {}
        udp: dict[tuple[str, int], UdpServers] = {}
        where: dict[tuple[str, int], dict[str, set[int]]] = {}
        for path in ("hyb", "plain"):
            for c in conns:
                key = (ends(lab, path, c.direction, c.family).server_ns, c.family)
                where.setdefault(key, {"tcp": set(), "udp": set()})[c.proto].add(c.port)
        for key, ports in where.items():
            ns, fam = key
            tcp[key] = stack.enter_context(TcpServers(ns, sorted(ports["tcp"]), repeat, family=fam))
            udp[key] = stack.enter_context(UdpServers(ns, sorted(ports["udp"]), echo=True, family=fam))
        with ThreadPoolExecutor(2) as pool:
            runs = {path: pool.submit(run_path, lab, path, conns, nbytes, tcp, udp) for path in ("hyb", "plain")}
            return {path: f.result() for path, f in runs.items()}


def compare(conns: Sequence[Conn], got: dict[str, list[dict]], nbytes: int) -> dict:
    """Per kind (and in host mode per direction too): connections, completed on the plain path, mismatches; a
    mismatch is any difference between the two paths' outcomes (first 10 as examples)."""
    by_kind: dict[str, dict[str, int]] = {}
    by_direction: dict[str, dict[str, int]] = {}
    examples = []
    for c, h, o in zip(conns, got["hyb"], got["plain"], strict=True):
        groups = [by_kind.setdefault(c.proto, {"connections": 0, "completed": 0, "mismatches": 0})]
        if c.direction:
            groups.append(by_direction.setdefault(c.direction, {"connections": 0, "completed": 0, "mismatches": 0}))
        for k in groups:
            k["connections"] += 1
            k["completed"] += o["completed"]
            k["mismatches"] += h != o
        if h != o:
            examples.append({"connection": c.name, "hybrid": h, "oracle": o})
    extra = {"by_direction": by_direction} if by_direction else {}
    return {
        "connections": len(conns),
        "bytes": nbytes,
        "completed_oracle": sum(o["completed"] for o in got["plain"]),
        "completed_hybrid": sum(h["completed"] for h in got["hyb"]),
        "mismatches": len(examples),
        "by_kind": by_kind,
        **extra,
        "examples": examples[:10],
    }


def connections_completed(
    lab, tcp_ports: Sequence[int], udp_ports: Sequence[int], sport: int, nbytes: int = 64
) -> dict[str, list[str]]:
    """Per path ("hyb", "plain"), which of the same connections complete: a TCP connection per port and a UDP
    exchange per port, each from its own fixed source port (`sport` + its position)."""
    conns = [Conn("tcp", p, sport + i) for i, p in enumerate(tcp_ports)]
    conns += [Conn("udp", p, sport + len(conns) + i) for i, p in enumerate(udp_ports)]
    got = run_both(lab, conns, nbytes)
    return {
        path: [f"{c.proto}/{c.port}" for c, r in zip(conns, outcomes, strict=True) if r["completed"]]
        for path, outcomes in got.items()
    }
