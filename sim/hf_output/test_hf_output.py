"""Testbench of hf_output: each frame leaves with its decision (DROP, FORWARD, SHUNT) as hwmodel.decide takes it,
under idle packet and decision streams and m_axis back-pressure; events one per frame, in order."""

from __future__ import annotations

import random
import re

import cocotb
import pytest
from cocotb.clock import Clock
from cocotb.triggers import ClockCycles, ReadOnly, RisingEdge
from hypafilter.hw import model as hwmodel
from hypafilter.hw.vhdl import minimal_plan
from hypafilter.ir import Box, Policy, Rule

from sim.hftb import SIM_BUILD, AxisSink, AxisSource, Free, Ports, handshake, hw, load_obj, run_ghdl, save_obj
from sim.hftraffic import frames_for

EV_W = int(re.search(r"constant EV_W\s*: natural := (\d+);", hw("hf_pkg.vhd")[0].read_text())[1])  # event bits

PERIOD_NS = 4


class TB:
    """Clock, reset, packet-FIFO source, decision source, m_axis sink and event monitor of one hf_output."""

    def __init__(self, dut, seed: int, idle: float, ready: float):
        self.dut = dut
        self.rng = random.Random(seed)
        self.idle = idle
        width = len(dut.p_data)
        cocotb.start_soon(Clock(dut.clk, PERIOD_NS, units="ns").start())
        packets = Ports(
            dut,
            s_axis_tvalid="p_valid",
            s_axis_tdata="p_data",
            s_axis_tkeep="p_keep",
            s_axis_tlast="p_last",
            s_axis_tready="p_ready",
            s_axis_tuser=Free(),
        )
        self.src = AxisSource(packets, dut.clk, width, self.rng, idle)
        self.sink = AxisSink(dut, dut.clk, width, self.rng, ready)
        self.events: list[tuple[int, int]] = []
        dut.d_valid.value = 0
        dut.d_drop.value = 0
        dut.d_tuser.value = 0
        dut.d_events.value = 0

    async def reset(self) -> None:
        self.dut.rst.value = 1
        cocotb.start_soon(self._monitor())  # watching from before the first cycle a decision could be taken in
        await ClockCycles(self.dut.clk, 3)
        self.dut.rst.value = 0
        cocotb.start_soon(self.sink.run())

    async def decisions(self, items) -> None:
        """Drive the decision stream (drop, tuser, events) with its own idle cycles: it leads or lags the frames."""
        d = self.dut
        for drop, tuser, events in items:
            while self.rng.random() < self.idle:
                d.d_valid.value = 0
                await RisingEdge(d.clk)
            d.d_drop.value, d.d_tuser.value, d.d_events.value = drop, tuser, events
            d.d_valid.value = 1
            await handshake(d.clk, d.d_ready)
        d.d_valid.value = 0

    async def _monitor(self) -> None:
        d = self.dut
        while True:
            await RisingEdge(d.clk)
            await ReadOnly()
            if int(d.ev_valid.value):
                self.events.append((int(d.ev_bits.value), int(d.ev_sent.value)))

    async def run(self, cases) -> None:
        """Send every case; wait until each frame's decision is taken and nothing is left inside."""
        cocotb.start_soon(self.decisions([(c["drop"], c["tuser"], c["events"]) for c in cases]))
        await self.src.send([(c["frame"], 0) for c in cases])
        for _ in range(50 * len(cases) + 200):
            if len(self.events) == len(cases):
                break
            await RisingEdge(self.dut.clk)
        await ClockCycles(self.dut.clk, 50)
        await ReadOnly()
        assert len(self.events) == len(cases), f"{len(self.events)} of {len(cases)} decisions taken"
        assert not int(self.dut.m_axis_tvalid.value) and not self.sink.mid_frame, "a frame is still in flight"
        assert not int(self.dut.d_ready.value) and not int(self.dut.p_ready.value)
        await RisingEdge(self.dut.clk)


def check(cases, tb: TB) -> None:
    sent = [c for c in cases if not c["drop"]]
    assert len(tb.sink.frames) == len(sent), f"{len(tb.sink.frames)} frames out, {len(sent)} expected"
    for k, (c, (data, tuser, _)) in enumerate(zip(sent, tb.sink.frames, strict=True)):
        assert data == c["frame"], f"frame {k}: data differs"
        assert tuser == c["tuser"], f"frame {k} ({c['kind']}): tuser {tuser:#x} != {c['tuser']:#x}"
        assert (tuser >> 24) & 0xFF == c["dst_port"], f"frame {k}: dst_port"
        if c["kind"] in (hwmodel.Kind.SHUNT, hwmodel.Kind.MIRROR):
            assert tuser >> 64 == c["meta"], f"frame {k}: metadata M"
    assert tb.events == [(c["events"], int(not c["drop"])) for c in cases], "events differ"


@cocotb.test()
async def output_follows_decisions(dut):
    """Mixed frames and decisions, idle cycles on both inputs, random m_axis_tready."""
    cases = load_obj("HF_TB_CFG")
    tb = TB(dut, 1, idle=0.3, ready=0.6)
    await tb.reset()
    await tb.run(cases)
    check(cases, tb)


@cocotb.test()
async def drops_never_wait_for_tready(dut):
    """With m_axis_tready held low, dropped frames still drain at one beat per cycle and nothing comes out."""
    cases = [c for c in load_obj("HF_TB_CFG") if c["drop"]]
    tb = TB(dut, 2, idle=0.0, ready=0.0)
    await tb.reset()
    t0 = tb.sink.cycles
    await tb.run(cases)
    beats = sum(-(-len(c["frame"]) // (len(dut.p_data) // 8)) for c in cases)
    assert tb.sink.cycles - t0 <= beats + 50 * len(cases) + 200
    check(cases, tb)


def _policy(rng: random.Random) -> Policy:
    """Rules on destination ports with every verdict kind the decision can give (ACCEPT, DROP, complex)."""
    rules = []
    for i in range(12):
        lo = rng.choice((53, 80, 443, rng.randrange(65536)))
        box = Box.full().with_field("dport", lo, min(65535, lo + rng.randrange(2000)))
        rules.append(Rule((box,), ("ACCEPT", "DROP", "LOG")[i % 3]))
    return Policy(rules, "DROP", original_rules=[("hf_output",)])


def make_cases(seed: int, count: int) -> list[dict]:
    """Frames (wire, host, malformed, a port of no datapath) with hwmodel's decision under varied registers."""
    rng = random.Random(seed)
    plan = minimal_plan(_policy(rng))
    # every other entry mirrored (ACTION bit 3), entry 2 decided by the hardware (its shunt bit cleared): Kind.MIRROR,
    # one output frame with M and two dst_port bits (the traffic rarely reaches entries 0 and 1)
    plan.mirror = [i % 2 == 0 for i in range(len(plan.actions))]
    plan.shunt[2] = 0
    cases = []
    for frame, tuser in frames_for(plan, rng, count):
        if rng.random() < 0.05:
            tuser = (tuser & ~(0xFF << 16)) | (rng.choice((0x00, 0x03, 0x41)) << 16)
        regs = hwmodel.Regs.from_plan(plan)
        regs.control = rng.choice((1, 1, 1, 3, 0, 5))  # 5: unfilterable frames passed (shunted)
        regs.generation = rng.getrandbits(32)
        tuser |= rng.getrandbits(32) << 32 | rng.getrandbits(64) << 64  # bits the output must keep (or replace)
        d = hwmodel.decide(plan, frame, (tuser >> 16) & 0xFF, regs)
        cases.append(
            {
                "frame": frame,
                "kind": d.kind,
                "drop": int(d.kind == hwmodel.Kind.DROP),
                "tuser": hwmodel.out_tuser(tuser, d),
                "dst_port": d.dst_port,
                "meta": d.meta,
                "events": rng.getrandbits(EV_W),
            }
        )
    assert {c["kind"] for c in cases} == set(hwmodel.Kind), "the traffic must reach every decision kind"
    return cases


@pytest.mark.sim
@pytest.mark.parametrize("width", [256, 512])
def test_output(width):
    tag = f"w{width}"
    cfg = save_obj(make_cases(width, 400), SIM_BUILD / "hf_output" / tag / "cfg.pkl")
    generics = {"DATA_WIDTH": width, "TUSER_WIDTH": 128}
    run_ghdl("hf_output", hw("hf_pkg.vhd", "hf_output.vhd"), tag, generics, env={"HF_TB_CFG": str(cfg)})
