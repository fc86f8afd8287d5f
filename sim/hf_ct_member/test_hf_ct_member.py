"""Testbench of hf_ct_member, the conntrack membership structure: every lookup result (one header per cycle, with egress
records of host frames mixed in) equals the Python reference hypafilter.hw.ctmember.CtMember, exactly: inserts and
deletes (counting: a key inserted twice stays after one delete; both tuples of a NAT entry), a delete of a key never
inserted refused (nothing changes), saturated counters sticky, a small filter driven full (false positives, never a
lost member), egress stamps recent until the window has passed (the tick input), a clear's sweep (every lookup a
member meanwhile), the counters (members, saturated, refused)."""

from __future__ import annotations

import random
from collections import deque

import cocotb
import pytest
from cocotb.clock import Clock
from cocotb.triggers import ClockCycles, ReadOnly, RisingEdge
from hypafilter.hw import ctmember as cm
from hypafilter.hw.flowcache import Flow

from sim.hftb import handshake, hw, run_ghdl

LK = ("lk_src_ip", "lk_dst_ip", "lk_proto", "lk_sport", "lk_dport")
HOST = ("h_src_ip", "h_dst_ip", "h_proto", "h_sport", "h_dport")


def rand_flow(rng: random.Random) -> Flow:
    return Flow(
        0x0A000000 | rng.getrandbits(24),
        0xC0A80000 | rng.getrandbits(16),
        rng.choice((6, 17)),
        rng.randrange(1024, 65536),
        rng.choice((80, 443, 53, 8080)),
    )


class TB:
    def __init__(self, dut, seed: int):
        self.dut, self.rng = dut, random.Random(seed)
        self.m = cm.CtMember(int(dut.LOG2.value), int(dut.EGRESS_LOG2.value))
        self.now = 0
        cocotb.start_soon(Clock(dut.clk, 4, units="ns").start())
        for s in ("rst", "lk_valid", "eg_valid", "h_valid", "h_op", "ticks", *LK, *HOST):
            getattr(dut, s).value = 0
        dut.window.value = self.m.window
        self.pending: deque = deque()
        self.flows: list[Flow] = []  # looked up (members or not)
        self.rate, self.egress_rate = 0.0, 0.0
        self.unsure: set[int] = set()  # keys a command is changing (a result may be old or new)
        self.sweeping = False
        self.counts = {"member": 0, "absent": 0, "egress": 0, "unsure": 0}

    async def reset(self) -> None:
        d = self.dut
        d.rst.value = 1
        await ClockCycles(d.clk, 2)
        d.rst.value = 0
        self.m = cm.CtMember(self.m.log2, self.m.egress_log2, window=self.m.window)
        self.now = 0
        await self.idle()

    async def idle(self, limit: int = 1 << 18) -> None:
        for _ in range(limit):
            await RisingEdge(self.dut.clk)
            await ReadOnly()
            if int(self.dut.h_ready.value):
                await RisingEdge(self.dut.clk)
                return
        raise AssertionError("the structure never became ready")

    async def traffic(self) -> None:
        d = self.dut
        while True:
            await RisingEdge(d.clk)
            r = self.rng.random()
            lk = bool(self.flows) and r < self.rate
            eg = bool(self.flows) and not lk and r < self.rate + self.egress_rate
            f = self.rng.choice(self.flows) if lk or eg else Flow(0, 0, 0)
            if self.rng.random() < 0.5:
                f = f.reply()
            d.lk_valid.value, d.eg_valid.value = int(lk), int(eg)
            for p, v in zip(LK, (f.src, f.dst, f.proto, f.sport, f.dport), strict=True):
                getattr(d, p).value = v
            key = cm.key_of(f)
            want = self.m.possible(key, self.now) if lk else None
            unsure = lk and (self.sweeping or key in self.unsure)
            if eg:
                self.m.egress(key, self.now)
            await ReadOnly()
            self.pending.append((lk, want, unsure, f))
            if len(self.pending) > cm.LATENCY:
                self.check(*self.pending.popleft())

    def check(self, lk: bool, want: bool | None, unsure: bool, f: Flow) -> None:
        d = self.dut
        assert int(d.res_valid.value) == int(lk), "a result not LATENCY cycles after its lookup"
        if not lk:
            return
        got = bool(int(d.res_member.value))
        if unsure:
            self.counts["unsure"] += 1
            return
        assert got == want, f"lookup {f}: member {got}, model {want} (now {self.now})"
        self.counts["member" if got else "absent"] += 1
        if got and int(d.res_egress.value):
            self.counts["egress"] += 1

    async def command(self, op: int, flow: Flow | None = None) -> None:
        d = self.dut
        f = flow or Flow(0, 0, 0)
        key = cm.key_of(f)
        related = {
            k
            for k in map(cm.key_of, self.flows)
            if set(cm.bank_indices(k, self.m.log2)) & set(cm.bank_indices(key, self.m.log2))
        }
        self.unsure |= related | {key}
        self.sweeping = op == cm.OP_CLEAR
        d.h_op.value = op
        for p, v in zip(HOST, (f.src, f.dst, f.proto, f.sport, f.dport), strict=True):
            getattr(d, p).value = v
        d.h_valid.value = 1
        await handshake(d.clk, d.h_ready)
        d.h_valid.value = 0
        if op == cm.OP_INSERT:
            self.m.insert(key)
        elif op == cm.OP_DELETE:
            self.m.delete(key)
        else:
            self.m.clear()
        await self.idle()
        await ClockCycles(d.clk, cm.LATENCY + 1)
        self.unsure.clear()
        self.sweeping = False

    async def advance(self, ticks: int) -> None:
        """Let `ticks` ms pass, with no lookup in flight (the model's time then matches the stamps exactly)."""
        rate, egr = self.rate, self.egress_rate
        self.rate = self.egress_rate = 0.0
        await ClockCycles(self.dut.clk, cm.LATENCY + 2)
        self.dut.ticks.value = ticks
        await RisingEdge(self.dut.clk)
        self.dut.ticks.value = 0
        self.now = (self.now + ticks) & 0xFFFFFFFF
        await ClockCycles(self.dut.clk, 2)
        self.rate, self.egress_rate = rate, egr

    async def counters(self) -> None:
        d = self.dut
        await ReadOnly()
        assert int(d.members.value) == self.m.members & 0xFFFFFFFF, "members"
        assert int(d.saturated.value) == self.m.saturated, "saturated"
        assert int(d.refused.value) == self.m.refused, "refused"
        await RisingEdge(d.clk)


@cocotb.test()
async def membership_follows_the_model(dut):
    tb = TB(dut, 7)
    await tb.reset()
    cocotb.start_soon(tb.traffic())
    rng = tb.rng
    # right after reset every stamp reads 0: each key is "recent" for a window (a false positive only)
    await tb.advance(tb.m.window + 1)
    members = [rand_flow(rng) for _ in range(40)]
    strangers = [rand_flow(rng) for _ in range(40)]
    tb.flows = members + strangers
    tb.rate = 0.7
    await ClockCycles(dut.clk, 50)
    assert tb.counts["member"] == 0 and tb.counts["absent"] > 0
    # inserts (a NAT entry: its reply tuple as another key), with lookups all through
    for f in members:
        await tb.command(cm.OP_INSERT, f)
    nat = Flow(0x0A0A0A0A, 0xC0A80101, 6, 40000, 80)
    nat_reply = Flow(0xC0A80101, 0x64400001, 6, 80, 61000)
    await tb.command(cm.OP_INSERT, nat)
    await tb.command(cm.OP_INSERT, nat_reply)
    tb.flows += [nat, nat_reply]
    await ClockCycles(dut.clk, 300)
    # counting: inserted twice, deleted once, still there; twice, gone
    twice = members[0]
    await tb.command(cm.OP_INSERT, twice)
    await tb.command(cm.OP_DELETE, twice)
    assert tb.m.member(cm.key_of(twice))
    await tb.command(cm.OP_DELETE, twice)
    # a delete of a key never inserted: refused, nothing changes
    await tb.command(cm.OP_DELETE, strangers[0])
    assert tb.m.refused >= 1
    # saturation: 16 inserts make the counters sticky; 16 deletes leave the key a member
    sticky = members[1]
    for _ in range(cm.COUNTER_MAX + 1):
        await tb.command(cm.OP_INSERT, sticky)
    for _ in range(cm.COUNTER_MAX + 2):
        await tb.command(cm.OP_DELETE, sticky)
    assert tb.m.saturated >= cm.BANKS and tb.m.member(cm.key_of(sticky))
    await ClockCycles(dut.clk, 300)
    await tb.counters()
    # egress: host frames of strangers make them members until the window has passed
    tb.egress_rate = 0.2
    await ClockCycles(dut.clk, 400)
    tb.egress_rate = 0.0
    await ClockCycles(dut.clk, 200)
    assert tb.counts["egress"] > 0
    await tb.advance(tb.m.window - 1)
    await ClockCycles(dut.clk, 200)
    await tb.advance(2)
    await ClockCycles(dut.clk, 200)
    # deletes of the rest: every one of them absent afterwards unless another key shares all its counters
    for f in members[2:]:
        await tb.command(cm.OP_DELETE, f)
    await ClockCycles(dut.clk, 300)
    await tb.counters()
    # clear: lookups during the sweep answer "member"; after it nothing is
    tb.flows = members + strangers
    await tb.command(cm.OP_CLEAR)
    await ClockCycles(dut.clk, 200)
    await tb.counters()
    assert not any(tb.m.member(cm.key_of(f)) for f in tb.flows)
    dut._log.info("checked %s", tb.counts)
    assert tb.counts["unsure"] > 0 and tb.counts["absent"] > 100 and tb.counts["member"] > 100


@cocotb.test()
async def full_filter_never_loses_a_member(dut):
    """Many more keys than counters: the model and the hardware agree on every false positive, and no inserted key
    is ever absent."""
    tb = TB(dut, 11)
    await tb.reset()
    await tb.advance(tb.m.window + 1)
    rng = tb.rng
    keys = [rand_flow(rng) for _ in range(3 << tb.m.log2 >> 2)]
    cocotb.start_soon(tb.traffic())
    for f in keys:
        await tb.command(cm.OP_INSERT, f)
    others = [rand_flow(rng) for _ in range(200)]
    tb.flows = keys[:200] + others
    tb.rate = 0.9
    await ClockCycles(dut.clk, 1000)
    assert all(tb.m.member(cm.key_of(f)) for f in keys)
    fp = sum(tb.m.member(cm.key_of(f)) for f in others)
    dut._log.info("false positives %d of %d, checked %s", fp, len(others), tb.counts)
    assert fp > 0, "a full filter without false positives: not full"
    await tb.counters()


# ---------------------------------------------------------------- the pytest side


@pytest.mark.sim
@pytest.mark.parametrize("log2, egress_log2", [(8, 4), (10, 6)])
def test_ct_member(log2, egress_log2):
    run_ghdl(
        "hf_ct_member",
        hw("hf_pkg.vhd", "hf_ram.vhd", "hf_ct_member.vhd"),
        f"l{log2}_e{egress_log2}",
        {"LOG2": log2, "EGRESS_LOG2": egress_log2},
    )
