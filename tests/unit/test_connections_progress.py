"""ops.connections' TCP client fails a connection after TIMEOUT without progress, not after TIMEOUT in all: a peer
that takes the request slowly (acknowledging it over several timeouts, as through the emulated NIC under load)
and then answers completes; one that stops taking it fails. Before, socket.sendall's timeout bounded the whole send
and the answer's wait began at the client's shutdown, while its own bytes were still crossing: both failed."""

from __future__ import annotations

import socket
import threading
import time

from hypafilter.ops.connections import _tcp_client

TIMEOUT = 0.3
MESSAGE = bytes(range(256)) * 400  # 100 KB


def _server(slow: bool) -> tuple[socket.socket, threading.Thread]:
    """A listener on loopback whose connection reads 2 KB every 20 ms (about 1 s for MESSAGE, through a small
    receive window) and then answers with what came, or (slow=False) never reads at all."""
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # inherited by the accepted socket: a small window
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)

    def serve() -> None:
        c, _ = srv.accept()
        with c:
            if not slow:
                time.sleep(3 * TIMEOUT)
                return
            data = b""
            while chunk := c.recv(2048):
                data += chunk
                time.sleep(0.02)
            c.sendall(data)

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    return srv, t


def _connect(slow: bool) -> tuple[bytes, bool, float]:
    """(what the client read, whether it completed, seconds it took) against a slow or a stalled peer."""
    srv, t = _server(slow=slow)
    with srv:
        start = time.monotonic()
        out, ok = _tcp_client(None, "127.0.0.1", srv.getsockname()[1], MESSAGE, TIMEOUT, None)
        took = time.monotonic() - start
        t.join()
    return out, ok, took


def test_slow_peer_completes():
    out, ok, took = _connect(slow=True)
    assert ok and out == MESSAGE
    assert took > 2 * TIMEOUT  # it did go on for longer than one timeout


def test_stalled_peer_fails():
    out, ok, took = _connect(slow=False)
    assert not ok and out == b""
    assert took < 3 * TIMEOUT
