"""Testbench of hf_tables: SHUNT / ACTION / HITS against a Python model of the tables, through the indirect port
(reads, writes, out-of-range indices), lookups by match index every cycle, hit counting and its clear, the
restore sweep at power-on and after reset."""

from __future__ import annotations

import random

import cocotb
import pytest
from cocotb.clock import Clock
from cocotb.triggers import ClockCycles, ReadOnly, RisingEdge
from hypafilter.hw import regmap, updatebuffer, vhdl
from hypafilter.ir import ACTION_ACCEPT, ACTION_DROP

from sim.hftb import SIM_BUILD, hw, load_obj, run_ghdl, save_obj

UNKNOWN_TABLE = max(t.id for t in regmap.MAP.tables) + 1


class TB:
    """Clock, the indirect-access master, a lookup checker and a hit generator of one hf_tables, with the model."""

    def __init__(self, dut, plan, seed: int):
        self.dut, self.rng = dut, random.Random(seed)
        self.plan = plan
        self.ne = updatebuffer.rows(plan)  # entries, the policy entry, the update buffer's slots
        self.words = (self.ne + 31) // 32
        self.restore()
        self.writing = False  # an indirect write is under way: lookups of this window are not checked
        self.hitting = 0.0  # chance of a hit per cycle
        self.lookups = 0
        cocotb.start_soon(Clock(dut.clk, 4, units="ns").start())
        for s in ("rst", "ind_req", "ind_write", "hit_v", "hits_clear", "lk_idx", "hit_idx", "ind_addr", "ind_wdata"):
            getattr(dut, s).value = 0

    def restore(self) -> None:
        """The model after a reset: the plan's tables, hit counters zero."""
        self.shunt = [0] * (32 * self.words)
        # the slots' rows after the policy entry power on shunted, with no action
        slots = self.ne - len(self.plan.shunt)
        self.shunt[: self.ne] = [int(b) for b in self.plan.shunt] + [1] * slots
        self.actions = [int(a) & 0xF for a in self.plan.actions] + [0] * slots
        self.hits = [0] * self.ne

    def word(self, w: int) -> int:
        return sum(b << j for j, b in enumerate(self.shunt[32 * w : 32 * w + 32]))

    async def access(self, table: int, index: int, value: int | None = None) -> int:
        """One indirect access as hf_regs makes it: a request pulse, address and data held until ind_done."""
        d = self.dut
        d.ind_addr.value = regmap.ind_address(table, index)
        d.ind_wdata.value = value or 0
        d.ind_write.value = int(value is not None)
        d.ind_req.value = 1
        self.writing = value is not None
        await RisingEdge(d.clk)
        d.ind_req.value = 0
        for _ in range(4 * self.ne + 1000):
            await ReadOnly()
            if int(d.ind_done.value):
                reply = int(d.ind_rdata.value)
                break
            await RisingEdge(d.clk)
        else:
            raise AssertionError("indirect access never completed")
        if value is not None:
            if table == regmap.TABLE_SHUNT and index < self.words:
                self.shunt[32 * index : 32 * index + 32] = [(value >> j) & 1 for j in range(32)]
            elif table == regmap.TABLE_ACTION and index < self.ne:
                self.actions[index] = value & 0xF
        await RisingEdge(d.clk)
        await RisingEdge(d.clk)  # a lookup sampled from here on reads the written memory
        self.writing = False
        return reply

    async def check_tables(self) -> None:
        for w in range(self.words):
            assert await self.access(regmap.TABLE_SHUNT, w) == self.word(w), f"SHUNT[{w}]"
        for i in range(self.ne):
            assert await self.access(regmap.TABLE_ACTION, i) == self.actions[i], f"ACTION[{i}]"

    async def check_hits(self) -> None:
        for i in range(self.ne):
            assert await self.access(regmap.TABLE_HITS, i) == self.hits[i], f"HITS[{i}]"

    async def lookup_checker(self) -> None:
        """A new match index every cycle; shunt bit and action one cycle later equal the model's."""
        d = self.dut
        prev, checkable = 0, False
        while True:
            await RisingEdge(d.clk)  # the outputs now answer for `prev`, sampled at this edge
            idx = self.rng.randrange(self.ne)
            d.lk_idx.value = idx
            await ReadOnly()
            stable = not self.writing and bool(int(d.ready.value))
            if checkable and stable:
                self.lookups += 1
                assert int(d.lk_shunt.value) == self.shunt[prev], f"lk_shunt of entry {prev}"
                assert int(d.lk_action.value) == self.actions[prev], f"lk_action of entry {prev}"
            prev, checkable = idx, stable

    async def hit_driver(self) -> None:
        """Hits at rate `hitting`, often on the same few entries back to back (the forwarding path)."""
        d = self.dut
        hot = [self.rng.randrange(self.ne) for _ in range(3)]
        while True:
            h = self.rng.random() < self.hitting
            idx = self.rng.choice(hot) if self.rng.random() < 0.6 else self.rng.randrange(self.ne)
            d.hit_v.value, d.hit_idx.value = int(h), idx
            await RisingEdge(d.clk)
            if h:
                self.hits[idx] += 1


@cocotb.test()
async def tables_follow_the_model(dut):
    plan = load_obj("HF_TB_CFG")
    tb = TB(dut, plan, len(plan.entries))
    rng, ne, words = tb.rng, tb.ne, tb.words
    # power-on, no reset pulse: a read made during the restore sweep waits for it and sees the plan
    await ClockCycles(dut.clk, 2)  # the clock's first edge at time 0 is no edge for the DUT
    assert await tb.access(regmap.TABLE_ACTION, ne - 1) == tb.actions[ne - 1]
    assert int(dut.ready.value)
    await tb.check_tables()
    await tb.check_hits()
    cocotb.start_soon(tb.lookup_checker())
    cocotb.start_soon(tb.hit_driver())
    tb.hitting = 0.7
    for _ in range(150):
        op = rng.randrange(6)
        if op == 0:  # out-of-range indices included: ignored by writes, 0 on reads
            w = rng.randrange(words + 2)
            await tb.access(regmap.TABLE_SHUNT, w, rng.getrandbits(32))
            assert await tb.access(regmap.TABLE_SHUNT, w) == (tb.word(w) if w < words else 0), f"SHUNT[{w}]"
        elif op == 1:
            i = rng.randrange(ne + 2)
            await tb.access(regmap.TABLE_ACTION, i, rng.choice((ACTION_ACCEPT, ACTION_DROP, 0, 0xF)))
            assert await tb.access(regmap.TABLE_ACTION, i) == (tb.actions[i] if i < ne else 0), f"ACTION[{i}]"
        elif op == 2:  # while hits arrive a read may miss the one or two still in the pipeline
            i = rng.randrange(ne)
            before = tb.hits[i]
            got = await tb.access(regmap.TABLE_HITS, i)
            assert before - 2 <= got <= tb.hits[i], f"HITS[{i}] = {got}, model {before}..{tb.hits[i]}"
        elif op == 3:  # HITS is read-only, an unknown table reads 0
            await tb.access(regmap.TABLE_HITS, rng.randrange(ne), 12345)
            assert await tb.access(UNKNOWN_TABLE, rng.randrange(ne)) == 0
        elif op == 4:
            assert await tb.access(regmap.TABLE_HITS, ne + rng.randrange(3)) == 0
        else:
            await ClockCycles(dut.clk, rng.randrange(1, 20))
    tb.hitting = 0.0
    await ClockCycles(dut.clk, 5)
    await tb.check_hits()
    await tb.check_tables()
    assert sum(tb.hits) > 100 and tb.lookups > 500
    # clear: every counter zero after N_ENTRIES + 1 cycles
    dut.hits_clear.value = 1
    await RisingEdge(dut.clk)
    dut.hits_clear.value = 0
    await ClockCycles(dut.clk, ne + 5)
    tb.hits = [0] * ne
    await tb.check_hits()
    # reset: the plan's tables come back by the sweep, counters zero, lookups wait for `ready`
    tb.hitting = 0.5
    await ClockCycles(dut.clk, 50)
    tb.hitting = 0.0
    await ClockCycles(dut.clk, 3)
    dut.rst.value = 1
    await RisingEdge(dut.clk)
    dut.rst.value = 0
    tb.restore()
    await ReadOnly()
    assert not int(dut.ready.value), "ready during the restore sweep"
    await RisingEdge(dut.clk)
    await tb.check_tables()
    await tb.check_hits()
    # nothing left in flight: no reply pending, no hit in the pipeline
    await ClockCycles(dut.clk, 5)
    await ReadOnly()
    assert not int(dut.ind_done.value) and int(dut.ready.value)


def _plan(n: int, seed: int, depth: int) -> vhdl.HwPlan:
    """n entries with random shunt bits and actions, and `depth` update buffer slots (their rows follow the policy
    entry; the matcher and the buffer are not part of this entity)."""
    rng = random.Random(seed)
    shunt = [rng.randrange(2) for _ in range(n + 1)]
    actions = [rng.choice((ACTION_ACCEPT, ACTION_DROP, 0)) for _ in range(n + 1)]
    return vhdl.HwPlan([vhdl.HwEntry(()) for _ in range(n)], shunt, actions, f"{seed:064x}", buffer_depth=depth)


@pytest.mark.sim
@pytest.mark.parametrize(("n", "depth"), [(0, 0), (5, 16), (70, 3)])
def test_tables(n, depth):
    tag = f"n{n}_d{depth}"
    out = SIM_BUILD / "hf_tables" / tag
    plan = _plan(n, n + 1, depth)
    gen = out / "gen"
    vhdl.render(plan, gen)
    cfg = save_obj(plan, out / "cfg.pkl")
    sources = [gen / "hf_regs_pkg.vhd", gen / "hf_policy_pkg.vhd", *hw("hf_pkg.vhd", "hf_ram.vhd", "hf_tables.vhd")]
    run_ghdl("hf_tables", sources, tag, {}, env={"HF_TB_CFG": str(cfg)})
