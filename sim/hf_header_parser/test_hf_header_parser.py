"""Testbench of hf_header_parser: every parsed header (or unparsed flag) equals hwmodel.parse_frame, at 256 and 512."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hftb import SIM_BUILD, AxisSource, load_obj, run_ghdl, save_obj  # noqa: E402
from hypafilter.hw import model as hwmodel  # noqa: E402

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]

try:
    import cocotb
    from cocotb.clock import Clock
    from cocotb.triggers import ClockCycles, ReadOnly, RisingEdge
except ImportError:
    cocotb = None


class TB:
    def __init__(self, dut, seed):
        self.dut = dut
        self.width = len(dut.tdata)
        cocotb.start_soon(Clock(dut.clk, 4, units="ns").start())
        self.rng = random.Random(seed)
        self.out: list = []

    async def monitor(self):
        d = self.dut
        while True:
            await RisingEdge(d.clk)
            await ReadOnly()
            if int(d.h_valid.value):
                h = None
                if not int(d.h_unparsed.value):
                    h = hwmodel.Header(
                        *(
                            int(getattr(d, s).value)
                            for s in (
                                "h_src",
                                "h_dst",
                                "h_proto",
                                "h_sport",
                                "h_dport",
                                "h_icmp_type",
                                "h_icmp_code",
                                "h_iport",
                                "h_flags",
                            )
                        )
                    )
                self.out.append(h)


class _Shim:
    """Maps the parser's bare stream ports onto the s_axis_* names AxisSource drives (tready always 1)."""

    def __init__(self, dut):
        self.s_axis_tvalid, self.s_axis_tdata, self.s_axis_tkeep = dut.beat_valid, dut.tdata, dut.tkeep
        self.s_axis_tlast, self.s_axis_tuser = dut.tlast, dut.tuser
        self.s_axis_tready = _One()


class _One:
    value = 1


if cocotb is not None:

    @cocotb.test()
    async def parser_matches_model(dut):
        frames = load_obj("HF_TB_CFG")
        tb = TB(dut, 1)
        dut.rst.value = 1
        src = AxisSource(_Shim(dut), dut.clk, tb.width, tb.rng, idle=0.3)
        await ClockCycles(dut.clk, 3)
        dut.rst.value = 0
        cocotb.start_soon(tb.monitor())
        await src.send(frames)
        await ClockCycles(dut.clk, 20)
        assert len(tb.out) == len(frames), "one header per frame, none left in flight"
        for k, ((f, tuser), got) in enumerate(zip(frames, tb.out, strict=True)):
            want = hwmodel.parse_frame(f, (tuser >> 16) & 0xFF)
            assert got == want, f"frame {k} ({f.hex()}): {got} != {want}"


@pytest.mark.sim
@pytest.mark.parametrize("width", [256, 512])
def test_header_parser(width):
    from conftest import need_tool  # noqa: PLC0415

    need_tool("ghdl")
    from hftb import tuser_for  # noqa: PLC0415
    from hftraffic import frames_for, malformed, truncated_l4  # noqa: PLC0415
    from hypafilter.hw.vhdl import HwPlan  # noqa: PLC0415

    rng = random.Random(width)
    frames = frames_for(HwPlan([], [0], [1], "0" * 64), rng, 500)
    frames += [(f, tuser_for(f, p)) for f, p in (malformed(rng) for _ in range(300))]
    # L4 headers around the kernel's hotdrop minimum: parsed only from 20 (TCP) / 8 (UDP, ICMP) bytes on
    frames += [(f, tuser_for(f, p)) for f, p in (truncated_l4(rng) for _ in range(200))]
    rng.shuffle(frames)
    tag = f"w{width}"
    cfg = save_obj(frames, SIM_BUILD / "hf_header_parser" / tag / "cfg.pkl")
    run_ghdl(
        "hf_header_parser",
        [ROOT / "hw" / "hf_pkg.vhd", ROOT / "hw" / "hf_header_parser.vhd"],
        "test_hf_header_parser",
        tag,
        {"DATA_WIDTH": width},
        env={"HF_TB_CFG": str(cfg)},
        test_dir=HERE,
    )
