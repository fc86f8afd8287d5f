"""Testbench of hf_update_buffer6 (the IPv6 update buffer's slots with raw 128-bit bounds, docs/ipv6.md "## emu"): slots
written from analysis.overlay.align6's overlay of two ranked IPv6 plans (a /128 ban ahead of everything inside a /48
of the static policy, a /64 UDP DROP in the middle, a deleted entry), headers in each slot's range, one address past
each edge (and across each 32-bit chunk boundary of a range that spans one), with every static index, for a
parsed IPv6 frame and one that is not (h_on '0'); the hardware index every cycle against the SFL decision
(analysis.overlay.hw_indices' rule), the valid mask, every word read back, and a reset."""

from __future__ import annotations

import os
import random

import cocotb
import pytest
from cocotb.clock import Clock
from cocotb.triggers import FallingEdge, ReadOnly
from hypafilter.analysis.overlay import Overlay, Slot, align6
from hypafilter.hw import vhdl
from hypafilter.ir import FIELDS, MAXV, Box

from sim.hftb import SIM_BUILD, hw, run_ghdl

SOURCES = ("hf_pkg.vhd", "hf_ram.vhd", "hf_prio_enc.vhd", "hf_update_buffer_shell.vhd", "hf_update_buffer6.vhd")
HDR = ("h_src", "h_dst", "h_proto", "h_sport", "h_dport", "h_icmp_type", "h_icmp_code", "h_iport", "h_ct")  # ir.FIELDS
T_BUF, T_VALID = 12, 13
WORDS, USED, W_CONTROL = 32, 23, 21
TOP = (1 << 128) - 1
WIDE = (0x20010DB8000000000000FFFFFFFFFFF0, 0x20010DB8000000000001000000000010)  # spans 32-bit chunk boundaries


def plans():
    """The static and new ranked plans, as test_xdp_v6's (tests/xdp_v6.ranked_plan: the front end's plans)."""
    from tests.xdp_v6 import Rule6, ranked_plan

    static = [
        Rule6(src="2001:db8:1::/48", proto="tcp", dport=(80, 88)),
        Rule6(dst="2001:db8:2::/48", proto="udp", dport=(53, 53)),
        Rule6(proto="icmpv6", icmp6=128),
        Rule6(src="::/0", dst="2001:db8:5::/48"),
    ]
    new = [
        Rule6(src="2001:db8:1:5::66/128", target="DROP"),
        static[0],
        Rule6(dst="2001:db8:2:7::/64", proto="udp", target="DROP"),
        static[1],
        static[3],
    ]
    return ranked_plan(static, "DROP")[1], ranked_plan(new, "DROP")[1]


def slot_words(box, pos: int, enable: bool = True) -> list[int]:
    """BUF6's 23 words of one slot (hf_update_buffer6's layout)."""
    lo, hi = box.lo, box.hi
    out = []
    for v in (lo[0], hi[0], lo[1], hi[1]):
        out += [(v >> s) & 0xFFFFFFFF for s in (96, 64, 32, 0)]
    f = {n: i for i, n in enumerate(FIELDS)}
    out.append(lo[f["sport"]] | hi[f["sport"]] << 16)
    out.append(lo[f["dport"]] | hi[f["dport"]] << 16)
    out.append(lo[f["proto"]] | hi[f["proto"]] << 8 | lo[f["icmp_type"]] << 16 | hi[f["icmp_type"]] << 24)
    out.append(
        lo[f["icmp_code"]]
        | hi[f["icmp_code"]] << 8
        | lo[f["iport"]] << 16
        | hi[f["iport"]] << 18
        | lo[f["ct"]] << 20
        | hi[f["ct"]] << 22
    )
    out.append(box.flags_mask | box.flags_value << 8)
    out.append((1 << 31 if enable else 0) | pos)
    out.append(box.sets_mask | box.sets_value << 8)
    return out


def holds(box, h: tuple, flags: int) -> bool:
    return all(box.lo[i] <= h[i] <= box.hi[i] for i in range(len(FIELDS))) and flags & box.flags_mask == box.flags_value


def chunk_steps(v: int) -> list[int]:
    """Addresses next to `v` chunk by chunk: its 32-bit chunk k one lower with every lower chunk all ones, and one
    higher with every lower chunk zero (each chunk's comparison decides, the higher ones equal)."""
    out = []
    for k in range(4):
        shift = 96 - 32 * k
        c = (v >> shift) & 0xFFFFFFFF
        high = v >> (shift + 32) << (shift + 32)
        if c:
            out.append(high | (c - 1) << shift | ((1 << shift) - 1))
        if c < 0xFFFFFFFF:
            out.append(high | (c + 1) << shift)
    return out


def headers_for(slots, rng: random.Random) -> list[tuple[tuple, int]]:
    """Headers inside each slot's box and one step past each bound of each field (addresses: lo - 1, hi + 1, and each
    32-bit chunk boundary inside the range)."""
    out = []
    for s in slots:
        b = s.box
        inside = [rng.randint(lo, hi) for lo, hi in zip(b.lo, b.hi, strict=True)]
        out.append((tuple(inside), b.flags_value))
        for i in range(len(FIELDS)):
            top = TOP if i < 2 else MAXV[i]
            vals = [b.lo[i], b.hi[i], b.lo[i] - 1, b.hi[i] + 1]
            if i < 2:
                vals += [(b.lo[i] | m) + d for m in (0xFFFFFFFF, (1 << 64) - 1) for d in (0, 1)]
                vals += [v for bound in (b.lo[i], b.hi[i]) for v in chunk_steps(bound)]
            for v in vals:
                if 0 <= v <= top:
                    h = list(inside)
                    h[i] = v
                    out.append((tuple(h), b.flags_value))
    return out


@cocotb.test()
async def slots_match_128_bit_ranges(dut):
    given = os.environ.get("HF_UB6_GENERICS")  # a synthesised netlist has no generics left: the test names them
    if given:
        n, depth, i_delay, fanin = (int(x) for x in given.split(","))
    else:
        n, depth = int(dut.N_STATIC.value), int(dut.DEPTH.value)
        i_delay, fanin = int(dut.I_DELAY.value), int(dut.FANIN.value)
    lat = vhdl.buffer_latency(depth, fanin)
    rng = random.Random(6)
    static6, new6 = plans()
    ov = align6(static6, new6, depth).overlay
    assert ov.n_static == n and len(ov.slots) == 2 and not ov.valid.all(), ov
    # and an `iprange` whose bounds lie in other 32-bit chunks than each other (WIDE), placed before entry 1
    lo, hi = [0] * len(FIELDS), [TOP, TOP, *MAXV[2:]]
    lo[0], hi[0] = WIDE
    slots = sorted([*ov.slots, Slot(Box(tuple(lo), tuple(hi)), 1, -1)], key=lambda s: s.pos)
    ov = Overlay(n, depth, ov.valid, tuple(slots))
    cocotb.start_soon(Clock(dut.clk, 4, units="ns").start())
    for s in ("rst", "ind_req", "ind_write", "ind_addr", "ind_wdata", "st_idx", *HDR, "h_flags", "h_on"):
        getattr(dut, s).value = 0
    dut.rst.value = 1
    for _ in range(3):
        await FallingEdge(dut.clk)
    dut.rst.value = 0
    sweep = max(1 << (depth * WORDS - 1).bit_length(), 2)

    async def access(table: int, index: int, value: int | None) -> int:
        await FallingEdge(dut.clk)
        dut.ind_req.value = 1
        dut.ind_addr.value = (table << 24) | index
        dut.ind_write.value = int(value is not None)
        dut.ind_wdata.value = value or 0
        await FallingEdge(dut.clk)
        dut.ind_req.value = 0
        for _ in range(sweep + 8):
            await ReadOnly()
            if int(dut.ind_done.value):
                return int(dut.ind_rdata.value)
            await FallingEdge(dut.clk)
        raise AssertionError(f"no answer to table {table} index {index}")

    # the slots (control word last), then the valid mask
    written = {}
    for b, s in enumerate(ov.slots):
        words = slot_words(s.box, s.pos)
        for w in [*range(USED)][:W_CONTROL] + [W_CONTROL + 1, W_CONTROL]:
            await access(T_BUF, b * WORDS + w, words[w])
            written[b * WORDS + w] = words[w]
    vword = sum(1 << j for j in range(n) if ov.valid[j])
    await access(T_VALID, 0, vword)
    for index, value in written.items():
        assert await access(T_BUF, index, None) == value, f"BUF6 word {index}"
    assert await access(T_BUF, 25, None) == 0  # beyond a slot's 23 words
    assert await access(T_VALID, 0, None) == vword

    # headers every cycle, st_idx I_DELAY cycles later, idx 'lat' cycles after that
    heads = headers_for(ov.slots, rng)
    runs = [(h, f, st, on) for h, f in heads for st in range(n + 1) for on in (1, 1, 1, 0)]
    rng.shuffle(runs)
    got = []
    total = len(runs) + i_delay + lat + 2
    for x in range(total):
        await FallingEdge(dut.clk)
        if x < len(runs):
            h, f, _, on = runs[x]
            for name, v in zip(HDR, h, strict=True):
                getattr(dut, name).value = v
            dut.h_flags.value = f
            dut.h_on.value = on
        dut.st_idx.value = runs[x - i_delay][2] if 0 <= x - i_delay < len(runs) else 0
        await ReadOnly()
        got.append(int(dut.idx.value))
        assert int(dut.valid.value) == vword
    wins = edges = 0
    for k, (h, f, st, on) in enumerate(runs):
        want = st
        for b, s in enumerate(ov.slots):
            if on and s.pos <= st and holds(s.box, h, f):
                want = n + 1 + b
                break
        have = got[k + i_delay + lat]
        assert have == want, f"header {k} {[hex(v) for v in h[:2]]} st {st} on {on}: index {have}, want {want}"
        wins += want > n
        edges += want == st and on and any(holds(s.box, h, f) for s in ov.slots)
    assert wins > 50 and edges > 20, (wins, edges)

    # a reset disables every slot and makes every entry valid
    await FallingEdge(dut.clk)
    dut.rst.value = 1
    await FallingEdge(dut.clk)
    dut.rst.value = 0
    assert await access(T_BUF, W_CONTROL, None) == 0
    await ReadOnly()
    assert int(dut.valid.value) == (1 << n) - 1
    dut._log.info("checked %d headers, %d slot wins, %d static wins inside a slot's box", len(runs), wins, edges)


N, DEPTH, I_DELAY, FANIN = 4, 4, 3, 8


def generics(n: int, depth: int, i_delay: int, fanin: int) -> dict[str, int]:
    return {
        "N_STATIC": n,
        "DEPTH": depth,
        "IDX_W": vhdl.idx_width(n, depth),
        "I_DELAY": i_delay,
        "FANIN": fanin,
        "STAGES": vhdl.buffer_stages(depth, fanin),
        "T_BUF": T_BUF,
    }


@pytest.mark.sim
def test_update_buffer6():
    tag = f"n{N}_d{DEPTH}"
    SIM_BUILD.joinpath("hf_update_buffer6", tag).mkdir(parents=True, exist_ok=True)
    run_ghdl("hf_update_buffer6", [*hw(*SOURCES)], tag, generics(N, DEPTH, I_DELAY, FANIN))


@pytest.mark.sim
@pytest.mark.optin("HF_SIM_POSTSYNTH6")  # HF_SIM_POSTSYNTH6=1 pytest -q sim/hf_update_buffer6
def test_update_buffer6_postsynth():
    """The GHDL-synthesised VHDL netlist under the same test (GHDL's synthesis traps: docs/hardware.md)."""
    from hypafilter import netns

    from conftest import need_tool
    from sim.hftb import fresh_build

    need_tool("ghdl")
    tag = f"postsynth_n{N}_d{DEPTH}"
    work = fresh_build("hf_update_buffer6", tag) / "synth"
    work.mkdir()
    gargs = [f"-g{k}={v}" for k, v in generics(N, DEPTH, I_DELAY, FANIN).items()]
    argv = ["ghdl", "--synth", "--std=08", f"--workdir={work}", *gargs, "--out=vhdl", *map(str, hw(*SOURCES))]
    netlist = work / "update_buffer6_synth.vhd"
    netlist.write_text(netns.run([*argv, "-e", "hf_update_buffer6"], cwd=work, timeout=None))
    run_ghdl(
        "hf_update_buffer6",
        [*hw("hf_pkg.vhd"), netlist],
        tag,
        {},
        env={"HF_UB6_GENERICS": f"{N},{DEPTH},{I_DELAY},{FANIN}"},
        test_module="test_hf_update_buffer6",
        build_args=["-O0"],
    )
