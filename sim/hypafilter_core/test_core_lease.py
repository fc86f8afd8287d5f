"""Testbench of the policy sync lease in hypafilter_core, while frames stream: disarmed (the default) and armed the core
decides as always; run down it judges no wire frame (every one shunted as unparsed, hw.model with lease_expired);
written again it re-arms, written 0 it disarms. Ticks come from the lease_ticks input (LEASE_TICK_CYCLES = 0, the
emulator's build: one per cycle, or a burst of many in one cycle as the harness gives after idle time) or from the
core's own divider (LEASE_TICK_CYCLES > 0, the board's build).

Frames that stream across a change may be decided either way; the test aligns the output with the input frame by
frame (each frame's output, or its absence, must be one of the two decisions), and the side taken may change only
once, in the direction of the change. Frames sent while nothing changes are checked exactly, and so is every
counter at the end."""

from __future__ import annotations

import dataclasses
import random

import cocotb
import pytest
from cocotb.triggers import ClockCycles, RisingEdge
from hypafilter.hw import model as hwmodel
from hypafilter.hw import regmap as R
from hypafilter.hw import vhdl
from hypafilter.shared import unpack_meta

from conftest import TEST_FULL
from sim.hftb import fresh_build, load_obj, run_ghdl, save_obj
from sim.hftraffic import frames_for
from sim.hypafilter_core.test_hypafilter_core import TB, random_policy

DIVIDER = 8  # LEASE_TICK_CYCLES of the divider build
M64 = (1 << 64) - 1  # M: TUSER[127:64] of a shunted frame's first beat


class Ticks:
    """Drives lease_ticks (external ticks only): `rate` ticks per cycle, or `burst` once in the next cycle."""

    def __init__(self, dut, external: bool):
        self.dut, self.external, self.rate, self.burst = dut, external, 0, 0

    async def run(self) -> None:
        while True:
            t = self.burst or self.rate
            self.burst = 0
            self.dut.lease_ticks.value = t if self.external else 0
            await RisingEdge(self.dut.axis_aclk)


def _fits(d, other, f: bytes, tuser: int, outs: list, pos: int) -> bool:
    """Whether decision `d` of frame f explains the outputs from `pos`: its output is next, or it drops the frame and
    the next output is not the frame as the other decision would send it."""
    nxt = outs[pos] if pos < len(outs) else None
    if d.kind == hwmodel.Kind.DROP:
        return other.kind == hwmodel.Kind.DROP or not (
            nxt is not None and nxt[0] == f and nxt[1] == hwmodel.out_tuser(tuser, other)
        )
    return nxt is not None and nxt[0] == f and nxt[1] == hwmodel.out_tuser(tuser, d)


def align(plan, regs, frames, outs: list, pos: int, sides: tuple[bool, bool], counters) -> tuple[int, list[bool]]:
    """Match `frames` against the outputs from `pos`: each frame decided with lease_expired sides[0] or, once the
    change reached the core, sides[1] (never back). Returns the next output position and the side of each frame
    whose two decisions differ."""
    taken: list[bool] = []
    side = sides[0]
    for f, tuser in frames:
        sp = (tuser >> 16) & 0xFF
        dec = {e: hwmodel.decide(plan, f, sp, dataclasses.replace(regs, lease_expired=e)) for e in (False, True)}

        choice = None
        for e in (side,) if side == sides[1] else (sides[0], sides[1]):
            if _fits(dec[e], dec[not e], f, tuser, outs, pos):
                choice = e
                break
        assert choice is not None, f"frame {len(taken)} after output {pos}: neither decision came out"
        d = dec[choice]
        counters.add(d, sp)
        if d.kind != hwmodel.Kind.DROP:
            pos += 1
        if (dec[False].kind, dec[False].meta, dec[False].dst_port) != (
            dec[True].kind,
            dec[True].meta,
            dec[True].dst_port,
        ):
            taken.append(choice)
            side = choice
    return pos, taken


@cocotb.test()
async def core_lease(dut):
    cfg = load_obj("HF_TB_CFG")
    plan, div = cfg["plan"], cfg["divider"]
    n = len(plan.entries)
    rng = random.Random(cfg["seed"])
    tb = TB(dut, cfg["seed"], idle=0.2, ready=0.8)
    await tb.reset(n)
    ax = tb.axil
    ticks = Ticks(dut, external=not div)
    cocotb.start_soon(ticks.run())
    regs = hwmodel.Regs.from_plan(plan)
    if regs.control != 1:
        await ax.write(R.REG_CONTROL, regs.control)
    counters = hwmodel.Counters(n)
    pos = 0
    cycles_per_tick = div or 1

    async def stream(k: int, sides: tuple[bool, bool], during=None) -> list[bool]:
        """Send k frames; `during` (a coroutine function) runs once a third of them are in."""
        nonlocal pos
        sent0 = len(tb.src.accepted_first)
        frames = frames_for(plan, rng, k)
        sender = cocotb.start_soon(tb.src.send(frames))
        if during is not None:
            while len(tb.src.accepted_first) < sent0 + k // 3:
                await RisingEdge(dut.axis_aclk)
            await during()
        await sender
        await ClockCycles(dut.axis_aclk, 400)  # everything out (the sink may hold back a little)
        pos, taken = align(plan, regs, frames, tb.sink.frames, pos, sides, counters)
        assert pos == len(tb.sink.frames), f"{len(tb.sink.frames) - pos} frames out that no decision explains"
        return taken

    async def status() -> dict:
        return hwmodel.lease_status(await ax.read(R.REG_LEASE_STATUS))

    # disarmed (after reset): the core decides, whatever the ticks; what it calls unparsed keeps the index n
    ticks.rate = 1
    assert set(await stream(60, (False, False))) <= {False}
    out = [unpack_meta((o[1] >> 64) & M64) for o in tb.sink.frames[:pos]]
    unp = [m for m in out if m["magic"] == 0x4846 and m["reason"] == 2]
    assert unp and all(m["index"] == n for m in unp), out[:3]
    assert await status() == {"armed": False, "expired": False, "expiries": 0}
    # armed with a long lease: still decides, the counter runs
    await ax.write(R.REG_LEASE, 1_000_000)
    assert set(await stream(60, (False, False))) <= {False}
    left = await ax.read(R.REG_LEASE)
    assert 0 < left < 1_000_000
    assert (await status())["armed"]

    # a short lease runs out while frames stream: decided, then shunted as unparsed
    async def short():
        await ax.write(R.REG_LEASE, max(1, 150 // cycles_per_tick))

    taken = await stream(240, (False, True), short)
    assert taken and taken[0] is False and taken[-1] is True, f"no expiry seen while streaming: {taken}"
    assert await status() == {"armed": True, "expired": True, "expiries": 1}
    assert await ax.read(R.REG_LEASE) == 0
    # expired: every wire frame unparsed, and with no index (M[23:0] = 0xFFFFFF, reason 2), unlike a frame the core
    # judged unparsed (M[23:0] = n): the shim marks only those for the live K0 tree (docs/shim.md)
    first = pos
    assert set(await stream(60, (True, True))) <= {True}
    got = [m for m in (unpack_meta((o[1] >> 64) & M64) for o in tb.sink.frames[first:pos]) if m["magic"] == 0x4846]
    assert len(got) > 30 and all(m["reason"] == 2 and m["index"] == hwmodel.NO_INDEX for m in got), got[:3]

    # re-armed while frames stream: shunted, then decided again
    async def rearm():
        await ax.write(R.REG_LEASE, 1_000_000)

    taken = await stream(150, (True, False), rearm)
    assert taken and taken[0] is True and taken[-1] is False, f"the re-arm did not show: {taken}"
    assert (await status())["expired"] is False

    if not div:
        # the harness's burst after idle wall time: many ticks in one cycle end the lease at once
        async def burst():
            ticks.burst = 0xFFFFFFFF

        taken = await stream(150, (False, True), burst)
        assert taken and taken[-1] is True, taken
    else:
        await ax.write(R.REG_LEASE, 2)
        await ClockCycles(dut.axis_aclk, 4 * div)
    assert await status() == {"armed": True, "expired": True, "expiries": 2}

    # disarmed (0) while expired and streaming: decided again, for good
    async def disarm():
        await ax.write(R.REG_LEASE, 0)

    taken = await stream(150, (True, False), disarm)
    assert taken and taken[-1] is False, taken
    assert await status() == {"armed": False, "expired": False, "expiries": 2}

    # how long a lease of L ticks lasts: L ticks of the time base (the divider's cycles, or one tick per cycle here)
    ticks.rate = 1
    L = 12
    await ax.write(R.REG_LEASE, L)
    t0 = tb.sink.cycles
    while not (await status())["expired"]:
        assert tb.sink.cycles - t0 < L * cycles_per_tick + 200, "the lease did not run out"
    took = tb.sink.cycles - t0
    assert (L - 1) * cycles_per_tick <= took <= L * cycles_per_tick + 30, f"a lease of {L} ticks lasted {took} cycles"
    await ax.write(R.REG_LEASE, 0)

    # every counter as the decisions taken say (the unparsed ones are CNT_SHUNT_UNPARSED)
    want = counters.regs
    assert want.get("CNT_SHUNT_UNPARSED", 0) > 0 and want.get("CNT_FORWARDED", 0) + want.get("CNT_DROPPED", 0) > 0
    for name in [r.name for r in R.MAP.registers if r.name.startswith("CNT_")] + ["PKTIN", "PKTOUT"]:
        assert await ax.read(getattr(R, f"REG_{name}")) == want.get(name, 0), name
    dut._log.info("core_lease: %d frames out, counters %s", pos, want)


@pytest.mark.sim
@pytest.mark.parametrize("divider", [0, pytest.param(DIVIDER, marks=TEST_FULL)])
def test_core_lease(divider):
    tag = f"lease_d{divider}"
    out = fresh_build("hypafilter_core", tag)
    plan = vhdl.minimal_plan(random_policy(random.Random(5), 30))
    cfg = save_obj({"plan": plan, "seed": 5, "divider": divider}, out / "cfg.pkl")
    vhdl.render(plan, out / "gen", tdata_width=256)
    run_ghdl(
        "hypafilter_core",
        vhdl.sources(out / "gen"),
        tag,
        {"C_S_AXIS_DATA_WIDTH": 256, "C_FIFO_DEPTH_BYTES": 4096, "LEASE_TICK_CYCLES": divider},
        env={"HF_TB_CFG": str(cfg)},
        testcase="core_lease",
        test_module="test_core_lease",
    )
