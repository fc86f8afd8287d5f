"""NicClient protocol framing against a small fake control-socket server (behaviour is tested on the real emulator)."""

from __future__ import annotations

import socket
import threading
from pathlib import Path

import pytest
from hypafilter import regmap
from hypafilter.nic import CORE_ID, EmuTransport, NicClient, NicError, pack_shunt


class FakeNic:
    """Answers R/W/T lines from a dict of registers, logging every request in order."""

    def __init__(self, path: Path, regs: dict[int, int] | None = None):
        self.path = str(path)
        self.regs = dict(regs or {})
        self.tables: dict[tuple[int, int], int] = {}
        self.log: list[str] = []
        self.srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.srv.bind(self.path)
        self.srv.listen(1)
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _answer(self, line: str) -> str:
        self.log.append(line)
        w = line.split()
        if w[0] == "R":
            return f"OK 0x{self.regs.get(int(w[1], 0), 0):08x}"
        if w[0] == "W":
            self.regs[int(w[1], 0)] = int(w[2], 0)
            return "OK"
        if w[:2] == ["T", "W"]:
            self.tables[(int(w[2]), int(w[3]))] = int(w[4], 0)
            return "OK"
        if w[:2] == ["T", "R"]:
            return f"OK {self.tables.get((int(w[2]), int(w[3])), 0)}"
        return f"ERR unknown request '{line}'"

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.srv.accept()
            except OSError:
                return
            with conn:
                self._session(conn)

    def _session(self, conn: socket.socket) -> None:
        buf = b""
        while True:
            data = conn.recv(4096)
            if not data:
                return
            buf += data
            out = b""
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                out += (self._answer(line.decode()) + "\n").encode()
            conn.sendall(out)


@pytest.fixture
def fake(tmp_path):
    f = FakeNic(tmp_path / "nic.sock", {regmap.REG_ID: CORE_ID, regmap.REG_NUM_ENTRIES: 40})
    yield f
    f.srv.close()


def test_register_lines_and_replies(fake):
    with NicClient(EmuTransport(fake.path)) as c:
        c.write("DEBUG", 0xDEADBEEF)
        assert c.read("DEBUG") == 0xDEADBEEF
        assert c.read(regmap.REG_ID) == CORE_ID
        c.write_table("ACTION", 3, 0x12)  # masked to the table's 4-bit width
    assert fake.log[0] == f"W 0x{regmap.REG_DEBUG:x} 0xdeadbeef"
    assert fake.log[-1] == f"T W {regmap.TABLE_ACTION} 3 0x2"


def test_pipelined_batches_keep_order(fake):
    with NicClient(EmuTransport(fake.path)) as c:
        c.write_table_many("SHUNT", 0, list(range(1000)))
        assert c.read_table("SHUNT", 999) == 999
    writes = [x for x in fake.log if x.startswith("T W")]
    assert [int(x.split()[3]) for x in writes] == list(range(1000))


def test_err_reply_raises(fake):
    t = EmuTransport(fake.path)
    with pytest.raises(NicError, match="unknown request"):
        t.request("FROB")
    t.close()


def test_info_refuses_a_foreign_core(fake):
    fake.regs[regmap.REG_ID] = 0x12345678
    with NicClient(EmuTransport(fake.path)) as c, pytest.raises(NicError, match="not a hypafilter core"):
        c.info()


def test_table_bounds_and_read_only(fake):
    with NicClient(EmuTransport(fake.path)) as c:
        with pytest.raises(NicError, match="read-only"):
            c.write_table("HITS", 0, 1)
        with pytest.raises(NicError, match="out of range"):
            c.read_table("SHUNT", 1 << 20)
        with pytest.raises(NicError, match="unknown register"):
            c.read("NOPE")
    assert fake.log == []


def test_program_order_and_checks(fake):
    class P:
        entries = [object()] * 40
        shunt = [1 if i in (0, 33, 40) else 0 for i in range(41)]
        actions = [1] * 40 + [2]
        policy_hash = "ab" * 28 + "cafef00d"

    fake.regs[regmap.REG_POLICY_HASH] = 0xCAFEF00D
    with NicClient(EmuTransport(fake.path)) as c:
        c.program(P, 0x10007)
    assert fake.tables[(regmap.TABLE_SHUNT, 0)] == 1
    assert fake.tables[(regmap.TABLE_SHUNT, 1)] == (1 << 1) | (1 << 8)
    assert fake.tables[(regmap.TABLE_ACTION, 40)] == 2
    assert fake.regs[regmap.REG_GENERATION] == 0x0007
    assert fake.log[-1].startswith(f"W 0x{regmap.REG_GENERATION:x}")  # generation last: tables first
    fake.regs[regmap.REG_POLICY_HASH] = 1
    with NicClient(EmuTransport(fake.path)) as c, pytest.raises(NicError, match="POLICY_HASH"):
        c.program(P, 1)


def test_pack_shunt():
    assert pack_shunt([1, 0, 1]) == [5]
    assert pack_shunt([0] * 32 + [1]) == [0, 1]


def test_connect_error_names_the_socket(tmp_path):
    with pytest.raises(NicError, match="nothing.sock"):
        EmuTransport(tmp_path / "nothing.sock")
