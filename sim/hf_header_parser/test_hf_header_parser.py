"""Testbench of hf_header_parser: every parsed header (or unparsed flag) equals hwmodel.parse_frame, and the
unfilterable flag hwmodel.unfilterable, at 256 and 512."""

from __future__ import annotations

import random

import cocotb
import pytest
from cocotb.clock import Clock
from cocotb.triggers import ClockCycles, ReadOnly, RisingEdge
from hypafilter.hw import model as hwmodel
from hypafilter.hw.vhdl import HwPlan
from hypafilter.ir import Header

from sim.hftb import SIM_BUILD, WIRE, AxisSource, Free, Ports, header_frame, hw, load_obj, run_ghdl, save_obj, tuser_for
from sim.hftraffic import frames_for, kernel_apart, malformed, random_header, truncated_l4


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
                    h = (h, int(d.h_l4_ok.value))
                self.out.append((h, int(d.h_unfilterable.value)))


def l4_lengths(rng: random.Random) -> tuple[bytes, int]:
    """A TCP or UDP frame with the data offset (TCP) or the length field (UDP) drawn around conntrack's limits
    (h_l4_ok: tcp_error/udp_error), with IP options, a VLAN tag and Ethernet padding at times."""
    h = random_header(rng)
    proto = rng.choice((6, 17))
    h = Header(h.src, h.dst, proto, h.sport, h.dport, 0, 0, h.iport, h.tcp_flags if proto == 6 else 0)
    vlans, options = rng.choice((0, 0, 1)), rng.choice((0, 0, 1, 10))
    f = bytearray(header_frame(h, rng, vlans=vlans, options=options, pad=rng.randrange(30), ad_share=0.0))
    l3 = 14 + 4 * vlans
    l4 = l3 + (f[l3] & 0xF) * 4
    room = (f[l3 + 2] << 8 | f[l3 + 3]) - (l4 - l3)
    if proto == 6:
        f[l4 + 12] = rng.choice((rng.randrange(16), 4, 5, room // 4, room // 4 + 1)) % 16 << 4 | f[l4 + 12] & 0xF
    else:
        ulen = rng.choice((rng.randrange(0x10000), 7, 8, room, room + 1, room - 1))
        f[l4 + 4 : l4 + 6] = ulen.to_bytes(2, "big")
    return bytes(f), rng.choice(WIRE)


def _stream(dut) -> Ports:
    """The parser's bare stream ports under the s_axis_* names AxisSource drives (it watches beats: always ready)."""
    return Ports(
        dut,
        s_axis_tvalid="beat_valid",
        s_axis_tdata="tdata",
        s_axis_tkeep="tkeep",
        s_axis_tlast="tlast",
        s_axis_tuser="tuser",
        s_axis_tready=Free(1),
    )


@cocotb.test()
async def parser_matches_model(dut):
    frames = load_obj("HF_TB_CFG")
    tb = TB(dut, 1)
    dut.rst.value = 1
    src = AxisSource(_stream(dut), dut.clk, tb.width, tb.rng, idle=0.3)
    await ClockCycles(dut.clk, 3)
    dut.rst.value = 0
    cocotb.start_soon(tb.monitor())
    await src.send(frames)
    await ClockCycles(dut.clk, 20)
    assert len(tb.out) == len(frames), "one header per frame, none left in flight"
    for k, ((f, tuser), got) in enumerate(zip(frames, tb.out, strict=True)):
        h = hwmodel.parse_frame(f, (tuser >> 16) & 0xFF)
        want = (h if h is None else (h, int(hwmodel.l4_ok(f))), int(hwmodel.unfilterable(f)))
        assert got == want, f"frame {k} ({f.hex()}): {got} != {want}"


@pytest.mark.sim
@pytest.mark.parametrize("width", [256, 512])
def test_header_parser(width):
    rng = random.Random(width)
    frames = frames_for(HwPlan([], [0], [1], "0" * 64), rng, 500)
    frames += [(f, tuser_for(f, p)) for f, p in (malformed(rng) for _ in range(300))]
    # L4 headers around the kernel's hotdrop minimum: parsed only from 20 (TCP) / 8 (UDP, ICMP) bytes on
    frames += [(f, tuser_for(f, p)) for f, p in (truncated_l4(rng) for _ in range(200))]
    # what the kernel treats apart: unfilterable VLAN stacks, link-local groups, bad checksums, fragments
    frames += [(f, tuser_for(f, p)) for f, p in (kernel_apart(rng) for _ in range(300))]
    # TCP data offsets and UDP length fields around what conntrack calls INVALID (h_l4_ok)
    frames += [(f, tuser_for(f, p)) for f, p in (l4_lengths(rng) for _ in range(300))]
    rng.shuffle(frames)
    tag = f"w{width}"
    cfg = save_obj(frames, SIM_BUILD / "hf_header_parser" / tag / "cfg.pkl")
    sources = hw("hf_pkg.vhd", "hf_header_parser.vhd")
    run_ghdl("hf_header_parser", sources, tag, {"DATA_WIDTH": width}, env={"HF_TB_CFG": str(cfg)})
