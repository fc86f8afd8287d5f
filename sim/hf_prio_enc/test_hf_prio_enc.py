"""Testbench of hf_prio_enc: a new vector every cycle; the index of the lowest set bit comes out STAGES later."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hftb import run_ghdl  # noqa: E402

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]

try:
    import cocotb
    from cocotb.clock import Clock
    from cocotb.triggers import FallingEdge, ReadOnly, RisingEdge
except ImportError:
    cocotb = None


def stages(n: int, f: int) -> int:
    s, w = 1, f
    while w < n:
        w, s = w * f, s + 1
    return s


if cocotb is not None:

    @cocotb.test()
    async def encoder_every_cycle(dut):
        n, f = len(dut.vec), int(dut.FANIN.value)
        lat = stages(n, f)
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
@pytest.mark.parametrize("n_in, fanin", [(1, 2), (7, 8), (64, 8), (100, 4), (1100, 8)])
def test_prio_enc(n_in, fanin):
    from conftest import need_tool  # noqa: PLC0415

    need_tool("ghdl")
    idx_w = max(1, (n_in - 1).bit_length())
    run_ghdl(
        "hf_prio_enc",
        [ROOT / "hw" / "hf_pkg.vhd", ROOT / "hw" / "hf_prio_enc.vhd"],
        "test_hf_prio_enc",
        f"n{n_in}_f{fanin}",
        {"N_IN": n_in, "FANIN": fanin, "IDX_W": idx_w},
        test_dir=HERE,
    )
