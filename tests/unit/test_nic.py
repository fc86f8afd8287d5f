"""NicClient protocol framing against a small fake control-socket server (behaviour is tested on the real emulator)."""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

import pytest
from hypafilter import targets
from hypafilter.analysis.plan import build_plan
from hypafilter.config import Config
from hypafilter.errors import HypafilterError
from hypafilter.hw import regmap
from hypafilter.ops import deploy
from hypafilter.targets.emu import EmuTarget
from hypafilter.targets.nic import (
    CORE_ID,
    FC_STATUS_READS,
    EmuTransport,
    NicClient,
    NicError,
    RegRequest,
    pack_shunt,
)
from hypafilter.targets.sume import SumeTarget

from conftest import need
from tests.irbuild import listing1


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
        if w[:2] == ["T", "WS"]:
            for k, v in enumerate(w[4:]):
                self.tables[(int(w[2]), int(w[3]) + k)] = int(v, 0)
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


BUF_CONFIG = 16 | 16 << 16 | 11 << 24  # a core of 16 update buffer slots (Config.update_buffer's default)


@pytest.fixture
def fake(tmp_path):
    """A core of 40 entries as after reset: every entry valid (VALID), every slot disabled."""
    f = FakeNic(tmp_path / "nic.sock", {regmap.REG_ID: CORE_ID, regmap.REG_NUM_ENTRIES: 40})
    f.regs[regmap.REG_BUF_CONFIG] = BUF_CONFIG
    f.tables[(regmap.TABLE_VALID, 0)], f.tables[(regmap.TABLE_VALID, 1)] = 0xFFFFFFFF, 0xFF
    yield f
    f.srv.close()


def test_register_lines_and_replies(fake):
    with NicClient(EmuTransport(fake.path)) as c:
        c.write("DEBUG", 0xDEADBEEF)
        assert c.read("DEBUG") == 0xDEADBEEF
        assert c.read(regmap.REG_ID) == CORE_ID
        c.write_table("ACTION", 3, 0x12)  # masked to the table's 4-bit width
    assert fake.log[0] == f"W 0x{regmap.REG_DEBUG:x} 0xdeadbeef"
    assert fake.log[-1] == f"T WS {regmap.TABLE_ACTION} 3 0x2"


def test_pipelined_batches_keep_order(fake):
    with NicClient(EmuTransport(fake.path)) as c:
        c.write_table_many("SHUNT", 0, list(range(1000)))
        assert c.read_table("SHUNT", 999) == 999
    writes = [x.split() for x in fake.log if x.startswith("T WS")]
    assert [int(w[3]) for w in writes] == [0, 512]  # stream requests of at most 512 words, the core counts
    assert [int(v, 0) for w in writes for v in w[4:]] == list(range(1000))
    assert [fake.tables[(regmap.TABLE_SHUNT, i)] for i in range(1000)] == list(range(1000))


def test_a_stream_write_waits_for_its_words(fake, monkeypatch):
    """The emulated NIC answers a read of its socket once it ran all of it: a stream of many table words (an
    11,100-entry core's table 1 took 37 s under load) may take longer than the reply timeout, which grows with the
    words a chunk streams; a register read keeps the plain timeout."""
    from hypafilter.targets import nic as nicmod

    answer = fake._answer
    fake._answer = lambda line: (time.sleep(0.4) if line.startswith("T WS") else None) or answer(line)
    monkeypatch.setattr(nicmod, "STREAM_WORD_SECONDS", 0.5)
    with NicClient(EmuTransport(fake.path, timeout=0.2)) as c:
        c.write_table_many("SHUNT", 0, [1, 2, 3])
        assert c.read_table("SHUNT", 2) == 3
    monkeypatch.setattr(nicmod, "STREAM_WORD_SECONDS", 0.0)
    with NicClient(EmuTransport(fake.path, timeout=0.2)) as c, pytest.raises(NicError, match="no reply"):
        c.write_table_many("SHUNT", 0, [1, 2, 3])


def test_bulk_reads_are_pipelined_in_order(fake):
    """The HITS table in bulk: one request line per entry, sent PIPELINE at a time, replies in index order."""
    for i in range(41):
        fake.tables[(regmap.TABLE_HITS, i)] = 1000 + i
    with NicClient(EmuTransport(fake.path)) as c:
        assert c.read_table_many("HITS", 0, 41) == [1000 + i for i in range(41)]
        assert c.read_table_many("HITS", 39, 2) == [1039, 1040]
        counters = c.counters(hits=True)
        with pytest.raises(NicError, match="out of range"):
            c.read_table_many("HITS", (1 << 20) - 1, 2)
    assert counters["HITS"] == {i: 1000 + i for i in range(41)} and counters["CNT_FORWARDED"] == 0
    reads = [x for x in fake.log if x.startswith("T R")]
    assert reads[:41] == [f"T R {regmap.TABLE_HITS} {i}" for i in range(41)]


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


def _plan(shunt_on=(0, 33, 40), drop=(40,), first_port=1):
    from hypafilter.hw.vhdl import HwEntry
    from hypafilter.ir import Box

    class P:
        entries = [HwEntry((Box.full().with_field("dport", first_port + i, first_port + i),)) for i in range(40)]
        shunt = [1 if i in shunt_on else 0 for i in range(41)]
        actions = [2 if i in drop else 1 for i in range(41)]
        policy_hash = "ab" * 32

    return P


def test_program_order_and_checks(fake):
    from hypafilter.hw.vhdl import matcher_hash

    plan = _plan()
    fake.regs[regmap.REG_NUM_ENTRIES] = 40
    fake.regs[regmap.REG_MATCHER_HASH] = int(matcher_hash(plan)[-8:], 16)
    with NicClient(EmuTransport(fake.path)) as c:
        written = c.program(plan, 0x10007)
    assert fake.tables[(regmap.TABLE_SHUNT, 0)] == 1
    # entries 33 and 40 (the policy entry), then the rows of the 16 buffer slots: shunted, no action
    assert fake.tables[(regmap.TABLE_SHUNT, 1)] == (1 << 1) | (1 << 8) | 0xFFFF << 9
    assert fake.tables[(regmap.TABLE_ACTION, 40)] == 2 and fake.tables[(regmap.TABLE_ACTION, 41)] == 0
    assert (regmap.TABLE_ACTION, 57) not in fake.tables
    assert fake.regs[regmap.REG_GENERATION] == 0x0007
    assert fake.log[-1].startswith(f"W 0x{regmap.REG_GENERATION:x}")  # generation last: tables first
    # an empty buffer on a core whose buffer is empty: nothing written to VALID or BUF, no bracket
    assert not [ln for ln in fake.log if ln.startswith(("T WS 6", "T WS 7"))]
    assert written["writes"] == 2 + 57 + 1 and written["generation"] == 7
    fake.regs[regmap.REG_MATCHER_HASH] = 1
    with NicClient(EmuTransport(fake.path)) as c, pytest.raises(NicError, match="MATCHER_HASH"):
        c.program(plan, 1)
    fake.regs[regmap.REG_NUM_ENTRIES] = 39
    with NicClient(EmuTransport(fake.path)) as c, pytest.raises(NicError, match="39 hardware entries"):
        c.program(plan, 1)


def test_matcher_hash_ignores_runtime_state():
    from hypafilter.hw.vhdl import matcher_hash

    assert matcher_hash(_plan()) == matcher_hash(_plan(shunt_on=(), drop=(1, 2, 3)))
    assert matcher_hash(_plan()) != matcher_hash(_plan(first_port=2))


def test_program_writes_only_what_changed(fake):
    from hypafilter.hw.vhdl import matcher_hash

    a, b = _plan(), _plan(shunt_on=(0, 33, 34, 40), drop=(5, 6, 40))
    fake.regs[regmap.REG_NUM_ENTRIES] = 40
    fake.regs[regmap.REG_MATCHER_HASH] = int(matcher_hash(a)[-8:], 16)
    with NicClient(EmuTransport(fake.path)) as c:
        known = c.program(a, 3)
        fake.log.clear()
        got = c.program(b, 4, known=known)
    table_writes = [ln for ln in fake.log if ln.startswith("T W")]
    # SHUNT word 1 (entries 32-63) and ACTION 5, 6 (one run of two, one stream request): nothing else
    assert table_writes == [
        f"T WS {regmap.TABLE_SHUNT} 1 0x{(1 << 1) | (1 << 2) | (1 << 8) | 0xFFFF << 9:x}",
        f"T WS {regmap.TABLE_ACTION} 5 0x2 0x2",
    ]
    assert got["writes"] == 4 and fake.regs[regmap.REG_GENERATION] == 4
    assert fake.tables[(regmap.TABLE_SHUNT, 0)] == 1 and fake.tables[(regmap.TABLE_ACTION, 40)] == 2
    # Not trusted once GENERATION moved on behind our back (another writer): everything is written again.
    fake.regs[regmap.REG_GENERATION] = 99
    fake.log.clear()
    with NicClient(EmuTransport(fake.path)) as c:
        c.program(a, 5, known=got)
    assert sum(len(ln.split()) - 4 for ln in fake.log if ln.startswith("T WS")) == 2 + 57


def test_program_sets_the_unfilterable_bit_and_keeps_the_others(fake):
    from hypafilter.hw.vhdl import matcher_hash

    plan = _plan()
    ctl = regmap.REG_CONTROL
    fake.regs[regmap.REG_MATCHER_HASH] = int(matcher_hash(plan)[-8:], 16)
    fake.regs[ctl] = 0x3  # enabled, shunting everything (an update in progress)
    with NicClient(EmuTransport(fake.path)) as c:
        passed = c.program(plan, 1, unfilterable="pass")
        assert fake.regs[ctl] == 0x7 and passed["unfilterable"] == "pass" and passed["writes"] == 2 + 57 + 2
        fake.log.clear()
        c.write_tables(passed, 2, known=passed)  # nothing changed: CONTROL read, not written
        assert [ln for ln in fake.log if ln.startswith("W")] == [f"W 0x{regmap.REG_GENERATION:x} 0x2"]
        c.set_shunt_all(False)
        assert fake.regs[ctl] == 0x5
        dropped = c.program(plan, 3)
        assert fake.regs[ctl] == 0x1 and dropped["unfilterable"] == "drop"
        c.write_tables({"shunt": dropped["shunt"], "actions": dropped["actions"]}, 4)  # tables of an older state
        assert fake.regs[ctl] == 0x1
        with pytest.raises(NicError, match="drop or pass"):
            c.program(plan, 5, unfilterable="forward")


def test_program_writes_the_miss_forcing_bits(fake):
    """CONTROL bits 4/5 follow Plan.miss_shunt (accept, drop); a plan without the field clears them."""
    from hypafilter.hw.vhdl import matcher_hash

    plan = _plan()

    def forcing(accept: bool, drop: bool):
        return type("PlanWithMissShunt", (plan,), {"miss_shunt": (accept, drop)})

    ctl = regmap.REG_CONTROL
    fake.regs[regmap.REG_MATCHER_HASH] = int(matcher_hash(plan)[-8:], 16)
    fake.regs[ctl] = 0x1
    with NicClient(EmuTransport(fake.path)) as c:
        bridge = c.program(forcing(True, True), 1)
        assert fake.regs[ctl] == 0x31 and bridge["miss_shunt"] == [True, True]
        c.program(forcing(False, True), 2, nic_mode="host")
        assert fake.regs[ctl] == 0x29
        c.program(plan, 3)
        assert fake.regs[ctl] == 0x1


def test_config_unfilterable_setting(tmp_path):
    assert Config().unfilterable == "drop"
    good = tmp_path / "good.toml"
    good.write_text('unfilterable = "pass"\n')
    assert Config.load(good).unfilterable == "pass"
    bad = tmp_path / "bad.toml"
    bad.write_text('unfilterable = "forward"\n')
    with pytest.raises(HypafilterError, match="unfilterable must be drop or pass"):
        Config.load(bad)


def test_config_flow_cache_setting(tmp_path):
    from hypafilter.targets.emu.build import EMU_CTM_EGRESS_LOG2, EMU_CTM_LOG2, EMU_TICK_CYCLES, core_generics

    assert Config().flow_cache_geometry() == (10, 4)
    lease = {"LEASE_TICK_CYCLES": 0}  # the lease's ticks come from the harness (wall time), not a clock divider
    ctm = {"CTM_LOG2": EMU_CTM_LOG2, "CTM_EGRESS_LOG2": EMU_CTM_EGRESS_LOG2}  # the conntrack membership structure
    assert core_generics(Config()) == {
        "FC_LOG2_SETS": 10,
        "FC_WAYS": 4,
        "FC_TICK_CYCLES": EMU_TICK_CYCLES,
        **lease,
        **ctm,
    }
    good = tmp_path / "good.toml"
    good.write_text('flow_cache = "14:4"\n')
    assert Config.load(good).flow_cache_geometry() == (14, 4)
    good.write_text('flow_cache = "none"\n')
    assert core_generics(Config.load(good)) == {"FC_LOG2_SETS": 0, **lease}
    bad = tmp_path / "bad.toml"
    for text in ("10", "11:4:1", "9:4", "15:4", "8:32", "a:b"):
        bad.write_text(f'flow_cache = "{text}"\n')
        with pytest.raises(HypafilterError, match="bad.toml: flow_cache"):
            Config.load(bad)


def test_pack_shunt():
    assert pack_shunt([1, 0, 1]) == [5]
    assert pack_shunt([0] * 32 + [1]) == [0, 1]


def test_connect_error_names_the_socket(tmp_path):
    with pytest.raises(NicError, match="nothing.sock"):
        EmuTransport(tmp_path / "nothing.sock")


def test_targets_by_name():
    assert isinstance(targets.get("emu", Config()), EmuTarget)
    assert isinstance(targets.get("sume", Config()), SumeTarget)
    with pytest.raises(HypafilterError, match="unknown target 'fpga'.*emu, sume"):
        targets.get("fpga", Config())


def test_emu_target_registers_through_its_socket(fake):
    tgt, info = EmuTarget(Config()), {"socket": fake.path}
    tgt.shunt_all(info, True)
    assert fake.regs[regmap.MAP.reg("CONTROL").offset] & 2
    assert "CNT_FORWARDED" in tgt.counters(info)


def test_counter_source_keeps_the_timeout_it_is_given(fake):
    """Target.counter_source passes its timeout to the target's transport (the dashboard reads with 5 s)."""
    tgt, info = EmuTarget(Config()), {"socket": fake.path}
    for timeout in (5.0, 30.0):
        source = tgt.counter_source(info, timeout=timeout)
        try:
            assert source.t.sock.gettimeout() == timeout
            assert "CNT_FORWARDED" in source.counters()
        finally:
            source.close()


def test_sume_without_board_is_refused_and_never_pretends(tmp_path):
    # Only a machine with a SUME driver loaded skips this (outside CI); CI machines have none, and there it must run.
    need(not Path("/sys/module/sume_riffa").exists(), "a SUME driver is loaded here: the no-board case cannot be shown")
    tgt = SumeTarget(Config(), build_root=tmp_path)
    assert tgt.missing() == "no board is present"
    with pytest.raises(HypafilterError, match=r"target 'sume' is not available here \(only 'emu'; no board"):
        deploy.deploy(listing1(), Config(), target="sume")
    tcl = Path(tgt.build(build_plan(listing1(), Config())))
    assert tcl.is_file() and tcl.is_relative_to(tmp_path / "sume") and "@PART@" not in tcl.read_text()
    for step in (lambda: tgt.start(str(tcl), 1), lambda: tgt.standby({}), lambda: tgt.stop({})):
        with pytest.raises(HypafilterError, match="target sume: .*bitstream"):
            step()


# ---- the flow cache API (framing and decoding here; its behaviour on the real core: tests/system/test_flow_api.py)


def test_flow_api_without_a_flow_cache_refuses_and_writes_nothing(fake):
    from hypafilter.hw.flowcache import Flow

    with NicClient(EmuTransport(fake.path)) as c:
        assert c.flow_config() is None
        for call in (c.flow_insert, c.flow_delete, c.flow_find):
            with pytest.raises(NicError, match="no flow cache"):
                call(Flow(1, 2, 6, 3, 4))
        with pytest.raises(NicError, match="no flow cache"):
            c.flow_entries()
    assert not [x for x in fake.log if x.startswith("W")]


def test_flow_command_registers_and_status(fake):
    from hypafilter.hw import flowcache as fc
    from hypafilter.hw.flowcache import Flow

    fake.regs[regmap.REG_FC_CONFIG] = fc.fc_config(10, 4, 32)
    fake.regs[regmap.REG_FC_STATUS] = fc.ST_EXISTS << 24 | 0x1234
    flow = Flow(0x0A000001, 0xC0A80102, 17, 5353, 53)
    with NicClient(EmuTransport(fake.path)) as c:
        cfg = c.flow_config()
        assert (cfg.log2_sets, cfg.ways, cfg.ts_w, cfg.entries) == (10, 4, 32, 4096)
        assert c.flow_insert(flow) == (fc.ST_EXISTS, 0x1234)
        with pytest.raises(NicError, match="sport"):
            c.flow_find(Flow(1, 2, 6, 70000, 4))
        # One batch: keys, status, command, status (one round trip); the status read just before FC_CMD, so a
        # busy reading refers to another client's command, which the core's FC_CMD-while-busy rule keeps running:
        # refused.
        n = len(fake.log)
        assert c.flow_find(flow) == (fc.ST_EXISTS, 0x1234)
        status, cmd = f"R 0x{regmap.REG_FC_STATUS:x}", f"W 0x{regmap.REG_FC_CMD:x} 0x{fc.OP_FIND:x}"
        reads = [status] * FC_STATUS_READS
        assert fake.log[n:][-2 - len(reads) :] == [status, cmd, *reads] and len(fake.log) - n == 7 + len(reads)
        fake.regs[regmap.REG_FC_STATUS] = 1 << 31  # busy
        with pytest.raises(NicError, match="busy"):
            c.flow_delete(flow)
    writes = [x for x in fake.log[:n] if x.startswith("W")]
    assert writes == [
        f"W 0x{regmap.REG_FC_KEY0:x} 0xa000001",
        f"W 0x{regmap.REG_FC_KEY1:x} 0xc0a80102",
        f"W 0x{regmap.REG_FC_KEY2:x} 0x{5353 << 16 | 53:x}",
        f"W 0x{regmap.REG_FC_KEY3:x} 0x11",
        f"W 0x{regmap.REG_FC_SLOT:x} 0x0",
        f"W 0x{regmap.REG_FC_CMD:x} 0x{fc.OP_INSERT:x}",
    ]


def test_flow_entries_decodes_the_tables(fake):
    from hypafilter.hw import flowcache as fc
    from hypafilter.hw.flowcache import Flow

    fake.regs[regmap.REG_FC_CONFIG] = fc.fc_config(10, 4, 32)
    flows = {7: (Flow(0xC0A80001, 0x0A000001, 6, 443, 1234), True), 4000: (Flow(1, 2, 17, 9, 8), False)}
    for slot, (flow, counted) in flows.items():
        key, swap = fc.canonical(flow)
        for w, v in enumerate(fc.flow_key_words(fc.key_word(key, swap), counted)):
            fake.tables[(regmap.TABLE_FLOW_KEY, 4 * slot + w)] = v
        fake.tables[(regmap.TABLE_FLOW_SEEN, slot)] = 99 if counted else 0
        fake.tables[(regmap.TABLE_FLOW_HITS, slot)] = 5 if counted else 0
    for r, v in zip(("FC_NOW", "FC_OCCUPANCY", "FC_INSERTS", "FC_DELETES", "FC_FULL"), (100, 2, 3, 1, 0), strict=True):
        fake.regs[regmap.MAP.reg(r).offset] = v
    with NicClient(EmuTransport(fake.path)) as c:
        got = c.flow_entries()
        assert c.flow_counters() == {"now": 100, "occupancy": 2, "inserts": 3, "deletes": 1, "full": 0}
        # some slots (the flow sync service's poll): only theirs are read
        n = len(fake.log)
        assert [r.slot for r in c.flow_entries([4000, *range(512), 7])] == [7, 4000]
        assert len(fake.log) - n == 513 + 2 * 5 and c.flow_entries(range(8, 100)) == []
        with pytest.raises(NicError, match="out of range"):
            c.flow_entries([4000, 4096])
    assert [(r.slot, r.flow, r.counted, r.seen, r.hits) for r in got] == [
        (7, flows[7][0], True, 99, 5),
        (4000, flows[4000][0], False, 0, 0),
    ]


def test_ipv6_flows_on_a_core_whose_cache_holds_them(fake):
    """A dual-stack core's cache (FC_CONFIG bit 24): families IPv4 and IPv6, an IPv6 flow's command writes its
    addresses' upper bits (FC_KEY4..9) and FC_KEY3 bit 8, its set is the wide key's, and flow_entries reads an IPv6
    entry's FLOW_KEY6 words (only those of IPv6 entries). An IPv4-only cache refuses an IPv6 flow, writing nothing."""
    from hypafilter.hw import flowcache as fc
    from hypafilter.hw.flowcache import Flow, Flow6

    f6 = Flow6(0xFD484600000000000000000000000077, 0x20010DB8000200000000000000000010, 6, 41000, 80)
    v4 = Flow(0x0A000001, 0x0A000002, 17, 9, 8)
    fake.regs[regmap.REG_FC_CONFIG] = fc.fc_config(10, 4, 32)
    with NicClient(EmuTransport(fake.path)) as c:
        assert c.families == (socket.AF_INET,)
        n = len(fake.log)
        with pytest.raises(NicError, match="no IPv6 tuples"):
            c.flow_insert(f6)
        assert not [x for x in fake.log[n:] if x.startswith("W")]
    fake.regs[regmap.REG_FC_CONFIG] = fc.fc_config(10, 4, 32, wide=True)
    for slot, (flow, counted) in {9: (f6, True), 300: (v4, False)}.items():
        key, swap = fc.canonical(flow, wide=True)
        word = fc.key_word(key, swap, wide=True)
        for w, v in enumerate(fc.flow_key_words(word, counted, wide=True)):
            fake.tables[(regmap.TABLE_FLOW_KEY, 4 * slot + w)] = v
        for w, v in enumerate(fc.flow_key6_words(word)):
            fake.tables[(regmap.TABLE_FLOW_KEY6, fc.FLOW_KEY6_STRIDE * slot + w)] = v
    with NicClient(EmuTransport(fake.path)) as c:
        assert c.families == (socket.AF_INET, socket.AF_INET6)
        assert c.flow_set(f6) == fc.set_index(fc.canonical(f6, wide=True)[0], 10, wide=True)
        assert c.flow_set(v4) == fc.set_index(fc.canonical(v4, wide=True)[0], 10, wide=True)
        n = len(fake.log)
        c.flow_insert(f6)
        writes = [x for x in fake.log[n:] if x.startswith("W")]
        regs = dict(zip((f"FC_KEY{i}" for i in range(4, 10)), fc.fc_key6_regs(f6), strict=True))
        regs.update(FC_KEY0=0x77, FC_KEY1=0x10, FC_KEY2=41000 << 16 | 80, FC_KEY3=0x106)
        for name, v in regs.items():
            assert f"W 0x{regmap.MAP.reg(name).offset:x} 0x{v:x}" in writes, (name, writes)
        n = len(fake.log)
        assert [r.flow for r in c.flow_entries()] == [f6, v4]
        # FLOW_KEY6 is read for the IPv6 entry only: its 6 words
        k6 = [x for x in fake.log[n:] if x.startswith(f"T R {regmap.TABLE_FLOW_KEY6} ")]
        assert len(k6) == 6 and all(9 * fc.FLOW_KEY6_STRIDE <= int(x.split()[3], 0) < 80 for x in k6), k6


class SlowFlowCache(FakeNic):
    """A flow cache whose commands take `cycles` requests (each request one step of the core's clock): FC_STATUS
    reads busy until then, and FC_CMD is ignored while busy, as in hw/hf_flow_cache.vhd. Inserts and deletes by
    key in a dict (slot = order of insertion)."""

    def __init__(self, path, cycles):
        super().__init__(path, {regmap.REG_ID: CORE_ID})
        from hypafilter.hw import flowcache as fc

        self.fc, self.cycles, self.busy_until, self.now, self.result = fc, cycles, 0, 0, 0
        self.flows: dict[tuple, int] = {}
        self.next_slot = 1
        self.regs[regmap.REG_FC_CONFIG] = fc.fc_config(10, 4, 32)

    def _answer(self, line):
        self.now += 1
        w = line.split()
        busy = self.now < self.busy_until
        if w[0] == "R" and int(w[1], 0) == regmap.REG_FC_STATUS:
            self.log.append(line)
            return f"OK 0x{(1 << 31 if busy else 0) | self.result:08x}"
        if w[0] == "W" and int(w[1], 0) == regmap.REG_FC_CMD:
            self.log.append(line)
            if not busy:
                self.busy_until = self.now + self.cycles
                self.result = self._run(int(w[2], 0))
            return "OK"
        return super()._answer(line)

    def _run(self, op):
        fc, r = self.fc, self.regs
        key = tuple(r.get(getattr(regmap, f"REG_FC_KEY{i}"), 0) for i in range(4))
        if op == fc.OP_INSERT:
            if key in self.flows:
                return fc.ST_EXISTS << 24 | self.flows[key]
            self.flows[key] = self.next_slot
            self.next_slot += 1
            return fc.ST_OK << 24 | self.flows[key]
        if op == fc.OP_DELETE:
            slot = self.flows.pop(key, None)
            return fc.ST_NOT_FOUND << 24 if slot is None else fc.ST_OK << 24 | slot
        return fc.ST_BAD << 24


@pytest.mark.parametrize("cycles", [1, 4, 9, 14, 15, 30])
def test_flow_command_batches_are_exact_however_long_a_command_runs(tmp_path, cycles):
    """A batch's results are each command's own, whether the status read after its FC_CMD already shows it done
    (short commands), the next command's read before its FC_CMD does, or a later FC_CMD met it still running
    and was ignored (long commands: run again once the cache is idle, so every flow ends in the table)."""
    from hypafilter.hw import flowcache as fc
    from hypafilter.hw.flowcache import Flow

    nic = SlowFlowCache(tmp_path / "nic.sock", cycles)
    flows = [Flow(0x0A000001, 0x0A000002, 6, 40000 + i, 80) for i in range(20)]
    try:
        with NicClient(EmuTransport(nic.path)) as c:
            got = c.flow_commands([(fc.OP_INSERT, f) for f in flows])
            assert len(nic.flows) == 20
            slots = {f: nic.flows[tuple(fc.fc_key_regs(f))] for f in flows}
            # (a command is 4 keys, slot, status, FC_CMD, FC_STATUS_READS statuses: the next FC_CMD comes 14 later)
            if cycles <= 14:  # done by a read after its FC_CMD, or by the next command's read before its own
                assert got == [(fc.ST_OK, slots[f]) for f in flows]
            else:  # a later FC_CMD was ignored: run again; those that ran twice answer EXISTS with their slot
                assert [slot for _, slot in got] == [slots[f] for f in flows]
                assert {st for st, _ in got} <= {fc.ST_OK, fc.ST_EXISTS} and got[0][0] == fc.ST_EXISTS
            # deletes and inserts of the same flows in one batch, in order
            mixed = [(fc.OP_DELETE, flows[0]), (fc.OP_DELETE, flows[1]), (fc.OP_INSERT, flows[0])]
            got = c.flow_commands(mixed)
            assert tuple(fc.fc_key_regs(flows[1])) not in nic.flows
            assert tuple(fc.fc_key_regs(flows[0])) in nic.flows
            assert got[2][0] in (fc.ST_OK, fc.ST_EXISTS) and got[1][0] in (fc.ST_OK, fc.ST_NOT_FOUND)
            if cycles <= 14:
                assert [st for st, _ in got] == [fc.ST_OK] * 3
    finally:
        nic.srv.close()


def test_sume_request_many_runs_the_register_requests_in_order():
    """SumeTransport.request_many (no board here: its register accesses are stubbed) runs the structured register
    requests one after the other and answers as EmuTransport does (the value read, None for a write)."""
    from hypafilter.targets.sume import SumeTransport

    class Stub(SumeTransport):
        def __init__(self):
            self.log = []

        def read(self, addr):
            self.log.append(("R", addr))
            return 5

        def write(self, addr, value):
            self.log.append(("W", addr, value))

    t = Stub()
    got = t.request_many([RegRequest("read", 0x7C), RegRequest("write", 0x78, 1), RegRequest("read", 0x10)])
    assert got == [5, None, 5]
    assert t.log == [("R", 0x7C), ("W", 0x78, 1), ("R", 0x10)]


def test_emu_request_many_renders_the_socket_lines(fake):
    """EmuTransport.request_many renders the structured requests as the control socket's R and W lines, in order,
    and answers per request the value read (None for a write); an unknown op is refused before anything is sent."""
    fake.regs[regmap.REG_DEBUG] = 0x1234
    t = EmuTransport(fake.path)
    try:
        got = t.request_many([RegRequest("write", regmap.REG_GENERATION, 0xAB), RegRequest("read", regmap.REG_DEBUG)])
        assert got == [None, 0x1234]
        with pytest.raises(NicError, match="not a register request"):
            t.request_many([RegRequest("frob", 0)])
    finally:
        t.close()
    assert fake.log == [f"W 0x{regmap.REG_GENERATION:x} 0xab", f"R 0x{regmap.REG_DEBUG:x}"]


def test_config_policysync_lease(tmp_path):
    """policysync_lease_ms: 1000 by default, 0 (no lease) or 500..3,600,000; anything else refused, naming the file."""
    assert Config().policysync_lease_ms == 1000
    good = tmp_path / "good.toml"
    for v in (0, 500, 3_600_000):
        good.write_text(f"policysync_lease_ms = {v}\n")
        assert Config.load(good).policysync_lease_ms == v
    for v in ("-1", "1", "499", "3600001", "true", '"1000"', "1.5"):
        good.write_text(f"policysync_lease_ms = {v}\n")
        with pytest.raises(HypafilterError, match="good.toml: policysync_lease_ms must be 0"):
            Config.load(good)


def test_first_lease_covers_the_service_start():
    """deploy arms the lease for the service's start (its first act renews it to the configured length); a
    deployment without a lease disarms it."""
    from hypafilter.ops import deploy
    from hypafilter.ops.daemon import READY_TIMEOUT

    assert deploy.first_lease_ms(Config()) == 1000 + int(READY_TIMEOUT * 1000)
    assert deploy.first_lease_ms(Config(policysync_lease_ms=0)) == 0


def test_lease_drift_wording():
    from hypafilter.ops.deploy import lease_drift

    st = {"lease_ms": 1000}
    assert lease_drift({"armed": True, "expired": False}, st) == []
    (expired,) = lease_drift({"armed": True, "expired": True}, st)
    assert expired.startswith("policysync: the fast path shunts everything: policy sync lease expired")
    (unarmed,) = lease_drift({"armed": False, "expired": False}, st)
    assert "not armed" in unarmed
    assert lease_drift({"armed": False, "expired": False}, {"lease_ms": 0}) == []
