"""Testbench of hf_fifo: words come out in order under random valid/ready, full flags back-pressure, none is lost."""

from __future__ import annotations

import random

import cocotb
import pytest
from cocotb.clock import Clock
from cocotb.triggers import ClockCycles, FallingEdge, ReadOnly, RisingEdge

from sim.hftb import hw, run_ghdl


@cocotb.test()
async def fifo_order_and_backpressure(dut):
    w, depth = len(dut.in_data), int(dut.DEPTH.value)
    rng = random.Random(w + depth)
    cocotb.start_soon(Clock(dut.clk, 4, units="ns").start())
    dut.rst.value = 1
    dut.in_valid.value = 0
    dut.out_ready.value = 0
    await ClockCycles(dut.clk, 3)
    words = [rng.getrandbits(w) for _ in range(600)]
    got: list[int] = []
    i = 0
    full_seen = False
    for cycle in range(5000):
        await FallingEdge(dut.clk)
        dut.rst.value = 0
        # phases: fill (no reads), then random, then drain at full rate
        p_in = 0.9 if cycle < 2000 else 0.0
        p_out = 0.0 if cycle < 150 else 0.5 if cycle < 2000 else 1.0
        v = int(i < len(words) and rng.random() < p_in)
        dut.in_valid.value = v
        dut.in_data.value = words[i] if i < len(words) else 0
        dut.out_ready.value = r = int(rng.random() < p_out)
        await ReadOnly()
        if v and int(dut.in_ready.value):
            i += 1
        if not int(dut.in_ready.value):
            full_seen = True
        if r and int(dut.out_valid.value):
            got.append(int(dut.out_data.value))
        await RisingEdge(dut.clk)
    assert full_seen, "the fill phase should reach full"
    assert got == words[:i] and i == len(words), "order or loss"
    assert int(dut.out_valid.value) == 0, "nothing left in flight"


@pytest.mark.sim
@pytest.mark.parametrize("width, depth", [(8, 4), (37, 16), (300, 64)])
def test_fifo(width, depth):
    run_ghdl(
        "hf_fifo", hw("hf_pkg.vhd", "hf_ram.vhd", "hf_fifo.vhd"), f"w{width}_d{depth}", {"WIDTH": width, "DEPTH": depth}
    )
