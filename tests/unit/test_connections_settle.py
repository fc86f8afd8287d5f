"""ops.connections.TcpServers.settle against a handler thread that its accept loop has listed but not started yet:
settle must wait for it, not fail (`RuntimeError: cannot join thread before it is started` ended a fuzz run's
connection check on a loaded machine, in verify's run_both)."""

from __future__ import annotations

import socket
import threading
import time

from hypafilter.ops import connections
from hypafilter.ops.connections import TcpServers


def test_settle_waits_for_a_handler_not_started_yet(monkeypatch):
    srv = TcpServers(None, [0], repeat=1, timeout=1.0)  # this namespace, an ephemeral port on every address
    port = srv._socks[0].getsockname()[1]
    listed = threading.Event()
    real = threading.Thread

    class SlowStart(real):
        """A handler thread whose start comes late, as on a loaded machine (others start at once)."""

        def start(self):
            if getattr(self, "_target", None) == srv._handle:
                listed.set()
                time.sleep(0.5)
            super().start()

    with srv:
        monkeypatch.setattr(connections.threading, "Thread", SlowStart)
        with socket.create_connection(("127.0.0.1", port), timeout=2) as c:
            c.sendall(b"ping")
            c.shutdown(socket.SHUT_WR)
            assert listed.wait(2)
            srv.settle()  # the handler is listed, its start still to come
            assert srv.received[("127.0.0.1", c.getsockname()[1], port)] == 4
            assert c.recv(16) == b"gnip"
        monkeypatch.setattr(connections.threading, "Thread", real)
