"""Test helpers: real TCP connections and UDP datagrams between the lab's sender and receiver namespaces, so that
the hybrid path and the plain (kernel-only) path are compared on what applications see."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator, Sequence

from hypafilter.netns import inside

REPLY_REPEAT = 50  # the server answers with the reversed request this many times: several segments back


@contextlib.contextmanager
def tcp_servers(ns: str, ports: Sequence[int]) -> Iterator[None]:
    """Listening sockets in `ns` that answer each connection's first message with it reversed, REPLY_REPEAT times."""
    stop = threading.Event()
    servers = []
    with inside(ns):
        for port in ports:
            s = socket.socket()
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("0.0.0.0", port))
            s.listen(16)
            s.settimeout(0.2)
            servers.append(s)

    def serve(srv: socket.socket) -> None:
        while not stop.is_set():
            try:
                c, _ = srv.accept()
            except OSError:
                continue
            with c:
                c.settimeout(3)
                try:
                    data = c.recv(4096)
                    c.sendall(data[::-1] * REPLY_REPEAT)
                except OSError:
                    pass

    threads = [threading.Thread(target=serve, args=(s,), daemon=True) for s in servers]
    for t in threads:
        t.start()
    try:
        yield
    finally:
        stop.set()
        for t in threads:
            t.join()
        for s in servers:
            s.close()


def tcp_talk(
    ns: str,
    dst: str,
    port: int,
    message: bytes = b"hello hypafilter",
    timeout: float = 3.0,
    sport: int | None = None,
) -> bytes | None:
    """Connect from `ns` (from source port `sport` if given), send `message`, read the whole answer; None when the
    connection does not complete."""
    with inside(ns):
        c = socket.socket()
    c.settimeout(timeout)
    try:
        if sport is not None:
            c.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            c.bind(("0.0.0.0", sport))
        c.connect((dst, port))
        c.sendall(message)
        out = b""
        while len(out) < len(message) * REPLY_REPEAT:
            chunk = c.recv(65536)
            if not chunk:
                break
            out += chunk
        return out
    except OSError:
        return None
    finally:
        c.close()


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
    ports = sorted({p for p, _ in sends})
    with inside(ns_recv):
        socks = {}
        for p in ports:
            s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            s.bind(("0.0.0.0", p))
            s.settimeout(wait)
            socks[p] = s
    with inside(ns_send):
        tx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    if sport is not None:
        tx.bind(("0.0.0.0", sport))
    got = []
    try:
        for p, payload in sends:
            tx.sendto(payload, (dst, p))
        for p, s in socks.items():
            while True:
                try:
                    got.append((p, s.recv(65536)))
                except OSError:
                    break
    finally:
        tx.close()
        for s in socks.values():
            s.close()
    return sorted(got)


def connections_completed(
    lab, tcp_ports: Sequence[int], udp_ports: Sequence[int], sport: int, timeout: float = 1.5
) -> dict[str, list[str]]:
    """Per path ("hyb", "plain"), which of the same connections complete between the lab's sender and receiver:
    a TCP connection per port (answered in full) and a UDP datagram per port (received), every one from a fixed
    source port (`sport` + its position), so that a policy's port matches see the same on both paths. The TCP
    connections run in parallel, so blocked ones cost one `timeout`, not one each."""
    out: dict[str, list[str]] = {}
    with tcp_servers(lab.ns_recv, tcp_ports):
        for path in ("hyb", "plain"):
            dst = lab.ip("recv", path)
            results: dict[int, bytes | None] = {}

            def talk(i: int, port: int, dst: str = dst, results: dict = results) -> None:
                results[port] = tcp_talk(lab.ns_send, dst, port, timeout=timeout, sport=sport + i)

            threads = [threading.Thread(target=talk, args=(i, p)) for i, p in enumerate(tcp_ports)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            done = [f"tcp/{p}" for p in tcp_ports if results[p] == b"retlifapyh olleh" * REPLY_REPEAT]
            sends = [(p, b"udp %d" % p) for p in udp_ports]
            got = udp_delivered(lab.ns_send, lab.ns_recv, dst, sends, wait=0.3, sport=sport + len(tcp_ports))
            out[path] = done + [f"udp/{p}" for p, _ in got]
    return out
