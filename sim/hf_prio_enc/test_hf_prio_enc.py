"""Testbench of hf_prio_enc: a new vector every cycle; the index of the lowest set bit comes out STAGES later."""

from __future__ import annotations

import random

import cocotb
import pytest
from cocotb.clock import Clock
from cocotb.triggers import FallingEdge, ReadOnly, RisingEdge
from hypafilter import netns
from hypafilter.hw.vhdl import enc_stages, encoder_generics

from conftest import need_tool
from sim.hftb import hw, run_ghdl

SOURCES = ("hf_pkg.vhd", "hf_prio_enc.vhd")


@cocotb.test()
async def encoder_every_cycle(dut):
    n, f = len(dut.vec), int(dut.FANIN.value)
    lat = enc_stages(n, f)  # the latency the core's delay line is built for, from the one computation of it
    rng = random.Random(n * f)
    cocotb.start_soon(Clock(dut.clk, 4, units="ns").start())
    sent: list[int] = []
    for cycle in range(400):
        await FallingEdge(dut.clk)
        kind = rng.randrange(4)
        v = 0 if kind == 0 else 1 << rng.randrange(n) if kind == 1 else rng.getrandbits(n)
        if kind == 3:
            v &= ~((1 << rng.randrange(n)) - 1)  # sparse low bits: the far end of the vector wins
        dut.vec.value = v
        sent.append(v)
        await RisingEdge(dut.clk)
        await ReadOnly()
        k = len(sent) - lat
        if k >= 0:
            want = sent[k]
            assert int(dut.any.value) == int(want != 0), f"cycle {cycle}"
            if want:
                assert int(dut.idx.value) == (want & -want).bit_length() - 1, f"cycle {cycle}"


@pytest.mark.sim
@pytest.mark.parametrize("n_in, fanin", [(1, 2), (7, 8), (64, 8), (65, 8), (100, 4), (1100, 8)])
def test_prio_enc(n_in, fanin):
    idx_w = max(1, (n_in - 1).bit_length())
    run_ghdl("hf_prio_enc", hw(*SOURCES), f"n{n_in}_f{fanin}", encoder_generics(n_in, fanin, idx_w))


@pytest.mark.sim
@pytest.mark.parametrize("n_in, fanin, wrong", [(64, 8, 3), (65, 8, 2), (1, 2, 2)])
def test_prio_enc_refuses_a_wrong_stage_count(tmp_path, n_in, fanin, wrong):
    """STAGES comes from Python; one that does not fit N_IN and FANIN stops elaboration instead of mis-timing."""
    need_tool("ghdl")
    generics = {**encoder_generics(n_in, fanin, 7), "STAGES": wrong}
    netns.run(["ghdl", "-a", "--std=08", *map(str, hw(*SOURCES))], cwd=tmp_path, timeout=None)
    elab = ["ghdl", "--elab-run", "--std=08", "hf_prio_enc", *(f"-g{k}={v}" for k, v in generics.items())]
    with pytest.raises(netns.CommandError) as refused:
        netns.run([*elab, "--stop-time=1ns"], cwd=tmp_path, timeout=None)
    r = refused.value
    assert r.returncode and "STAGES is not the least" in r.stdout + r.stderr, r.stdout + r.stderr
