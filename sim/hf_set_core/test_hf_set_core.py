"""The core with set membership tables (issue #24): a generated core whose entries test two set slots, a hash:net
blocklist by source (nested prefixes, a nomatch element) and a hash:ip,port service set by destination, checked frame
by frame against hw.model: before the host loads the tables (every lookup uncertain: shunted with reason 3 and no
index), after it loads them, after run-time inserts, deletes and an element turned uncertain, and with an update
buffer slot that tests a set bit (BUF word w10). Counters, SET_CONFIG, SET_INFO and read-back are checked too."""

from __future__ import annotations

import random

import cocotb
import numpy as np
import pytest
from hypafilter.analysis.overlay import Overlay, Slot
from hypafilter.hw import model as hwmodel
from hypafilter.hw import regmap, settable, updatebuffer, vhdl
from hypafilter.hw.settable import Elem, Geometry, SlotState
from hypafilter.ir import Box, Header
from hypafilter.ir.sets import SetSlot

from sim.hftb import SIM_BUILD, fresh_build, header_frame, load_obj, run_ghdl, save_obj, tuser_for
from sim.hypafilter_core.test_hypafilter_core import TB, check_outputs

R = regmap
GEOM = Geometry(banks=6, log2_buckets=4, ways=2)
SLOTS = (SetSlot("blocklist", "hash:net", ("src",)), SetSlot("svc", "hash:ip,port", ("dst", "dst")))
DEPTH = 2


def ip(s: str) -> int:
    a, b, c, d = (int(x) for x in s.split("."))
    return a << 24 | b << 16 | c << 8 | d


BLOCK = [
    Elem(ip("10.0.0.0"), 8),
    Elem(ip("10.1.0.0"), 16, nomatch=True),
    Elem(ip("10.1.2.0"), 24),
    Elem(ip("192.0.2.7"), 32),
    Elem(ip("198.51.100.0"), 24),
]
SVC = [
    Elem(ip("203.0.113.5"), 32, 6, 22),
    Elem(ip("203.0.113.6"), 32, 6, 22),
    Elem(ip("203.0.113.5"), 32, 17, 53),
    Elem(ip("203.0.113.9"), 32, 6, 443),
]
SOURCES = ("10.9.9.9", "10.1.7.7", "10.1.2.3", "192.0.2.7", "198.51.100.77", "172.20.1.1", "8.8.8.8", "10.1.2.200")
DESTS = ("203.0.113.5", "203.0.113.6", "203.0.113.7", "203.0.113.9", "1.2.3.4")


def plan() -> vhdl.HwPlan:
    """-m set --match-set blocklist src -j DROP; -p tcp -m set --match-set svc dst,dst -j ACCEPT; -p tcp -m set !
    --match-set svc dst,dst -j DROP; -p udp -m set ! --match-set blocklist src -j ACCEPT; policy DROP."""
    full = Box.full()
    tcp, udp = full.with_field("proto", 6, 6), full.with_field("proto", 17, 17)
    boxes = [full.with_sets(1, 1), tcp.with_sets(2, 2), tcp.with_sets(2, 0), udp.with_sets(1, 0)]
    entries = [vhdl.HwEntry((b,)) for b in boxes]
    return vhdl.HwPlan(entries, [0] * 5, [2, 1, 2, 1, 2], "sets-core", buffer_depth=DEPTH, set_slots=SLOTS,
                       set_geometry=GEOM)  # fmt: skip


def frames(rng: random.Random, n: int):
    out = []
    for _ in range(n):
        proto = rng.choice((6, 6, 17, 17, 1))
        dport = rng.choice((22, 53, 443, rng.randrange(1, 65536)))
        h = Header(src=ip(rng.choice(SOURCES)), dst=ip(rng.choice(DESTS)), proto=proto,
                   sport=rng.randrange(1024, 65536) if proto != 1 else 0, dport=dport if proto != 1 else 0,
                   icmp_type=8 if proto == 1 else 0)  # fmt: skip
        f = header_frame(h, rng)
        out.append((f, tuser_for(f, rng.choice((0x01, 0x04)))))
    return out


class Tables:
    """The host side: one settable.Image per slot, and the model's view of them."""

    def __init__(self):
        self.img = [settable.Image(i, s.settype, GEOM) for i, s in enumerate(SLOTS)]
        self.ctl = [True, True]

    def states(self):
        return tuple(SlotState(s.settype, s.dirs, tuple(self.img[i].elems()), self.ctl[i]) for i, s in enumerate(SLOTS))


async def apply(ax, writes) -> None:
    for table, index, word in writes:
        await ax.table_access(R, table, index, word)


@cocotb.test()
async def core_sets(dut):
    cfg = load_obj("HF_TB_CFG")
    p = cfg["plan"]
    n = len(p.entries)
    tb = TB(dut, 5, idle=0.2, ready=0.8)
    await tb.reset(1 << GEOM.log2_buckets)
    ax = tb.axil
    assert await ax.read(R.REG_SET_CONFIG) == len(SLOTS) | settable.LATENCY << 8
    for i, s in enumerate(SLOTS):
        info = await ax.table_access(R, R.TABLE_SET_INFO, i << settable.SLOT_SHIFT)
        g = settable.slot_generics(s.settype, s.dirs, GEOM)
        assert info == g["SETTYPE"] | g["ADDR_DIR"] << 4 | g["PORT_DIR"] << 5 | GEOM.banks << 8 | \
            GEOM.log2_buckets << 16 | GEOM.ways << 24, f"SET_INFO of slot {i}: {info:#x}"  # fmt: skip
        assert await ax.table_access(R, R.TABLE_SET_CTL, i << settable.SLOT_SHIFT) == 1  # uncertain after reset
    # a slot without a table answers 0
    assert await ax.table_access(R, R.TABLE_SET_INFO, 5 << settable.SLOT_SHIFT) == 0

    t = Tables()
    regs = hwmodel.Regs.from_plan(p)
    counters = hwmodel.Counters(n, DEPTH)
    expected: list = []
    rng = random.Random(cfg["seed"])

    async def phase(count: int) -> None:
        regs.sets = t.states()
        batch = frames(rng, count)
        for f, tu in batch:
            sp = (tu >> 16) & 0xFF
            d = hwmodel.decide(p, f, sp, regs)
            counters.add(d, sp)
            if d.kind != hwmodel.Kind.DROP:
                expected.append((f, hwmodel.out_tuser(tu, d), d))
        await tb.src.send(batch)
        await tb.wait_out(len(expected))

    # 1: the tables are not loaded yet: every parsed frame is uncertain
    await phase(20)
    assert all(d.reason == hwmodel.REASON_STATE for _, _, d in expected)
    # 2: loaded, then SET_CTL bit 0 cleared
    for i, elems in enumerate((BLOCK, SVC)):
        for e in elems:
            await apply(ax, t.img[i].insert(e))
        await ax.table_access(R, R.TABLE_SET_CTL, i << settable.SLOT_SHIFT, 0)
        t.ctl[i] = False
    e = t.img[0].normal(BLOCK[1])
    b, bkt, way = t.img[0].where[e.ident]
    i0 = settable.elem_index(0, b, bkt, way, GEOM.ways, 0)
    assert await ax.table_access(R, R.TABLE_SET_ELEM, i0) == e.addr
    assert await ax.table_access(R, R.TABLE_SET_ELEM, i0 | 1) == settable.W1_VALID | settable.W1_NOMATCH
    await phase(120)
    # 3: run-time changes, as `ipset add/del` reach the tables
    await apply(ax, t.img[0].delete(Elem(ip("10.1.2.0"), 24)))
    await apply(ax, t.img[0].insert(Elem(ip("172.16.0.0"), 12)))
    await apply(ax, t.img[0].insert(Elem(ip("198.51.100.0"), 24, uncertain=True)))  # near its timeout
    await apply(ax, t.img[1].insert(Elem(ip("203.0.113.7"), 32, 6, 22)))
    await apply(ax, t.img[1].delete(Elem(ip("203.0.113.6"), 32, 6, 22)))
    await phase(120)
    # 4: an update buffer slot before every static entry: UDP from a blocklisted source is accepted (w10 tests bit 0)
    slot = Slot(Box.full().with_field("proto", 17, 17).with_sets(1, 1), 0, -1)
    ov = Overlay(n, DEPTH, np.ones(n, dtype=bool), (slot,))
    img = updatebuffer.image(ov)
    row = n + 1
    regs.actions[row] = 1  # its row stays shunted (as after reset): the frames it wins carry its index
    await ax.table_access(R, R.TABLE_ACTION, row, 1)
    for name, start, words in updatebuffer.writes(updatebuffer.pristine(n, DEPTH), img):
        for k, w in enumerate(words):
            await ax.table_access(R, getattr(R, f"TABLE_{name}"), start + k, w)
    regs.buffer = img
    assert await ax.table_access(R, R.TABLE_BUF, updatebuffer.W_SETS) == 1 | 1 << 8
    await phase(120)
    await check_outputs(tb, ax, expected, counters.regs)
    for i in range(n + 1 + DEPTH):
        assert await ax.table_access(R, R.TABLE_HITS, i) == counters.hits[i], f"HITS[{i}]"
    reasons = [d.reason for _, _, d in expected]
    assert counters.regs.get("CNT_SET_UNCERTAIN", 0) > 20, counters.regs
    assert counters.regs.get("CNT_DROPPED", 0) > 20 and counters.regs.get("CNT_FORWARDED", 0) > 20, counters.regs
    assert any(d.match_index == row for _, _, d in expected), "the buffer slot never won"
    dut._log.info("core_sets: %d frames out, reasons %s, counters %s", len(expected), set(reasons), counters.regs)


@pytest.mark.sim
def test_core_sets():
    out = fresh_build("hypafilter_core", "sets_w256")
    gen = out / "gen"
    p = plan()
    vhdl.render(p, gen, tdata_width=256)
    cfg = save_obj({"plan": p, "seed": 3}, out / "cfg.pkl")
    run_ghdl(
        "hypafilter_core",
        vhdl.sources(gen),
        "sets_w256",
        {"C_S_AXIS_DATA_WIDTH": 256, "C_FIFO_DEPTH_BYTES": 4096},
        env={"HF_TB_CFG": str(cfg)},
        testcase="core_sets",
        test_module="sim.hf_set_core.test_hf_set_core",
    )
    assert SIM_BUILD.exists()
