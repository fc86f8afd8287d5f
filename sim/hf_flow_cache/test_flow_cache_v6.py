"""Testbench of hf_flow_cache with IPv6 tuples (generic V6, a dual-stack core's cache; docs/ipv6.md "## emu"):
insert, hits in both directions, misses of tuples one address bit away (every byte of both addresses), the IPv4
flow a.b.c.d beside the IPv6 flow ::a.b.c.d (the family byte keeps them apart), delete, stored words and sets as
hypafilter.hw.flowcache computes them with `wide`; and an IPv4-only cache (V6 false) refusing an IPv6 command."""

from __future__ import annotations

import os
import random

import cocotb
import pytest
from cocotb.clock import Clock
from cocotb.triggers import ClockCycles, ReadOnly, RisingEdge
from hypafilter.hw import flowcache as fc
from hypafilter.hw.flowcache import Flow, Flow6

from sim.hftb import handshake, hw, run_ghdl

LOG2_SETS = 10
M32 = 0xFFFFFFFF


def _addr_ports(prefix: str, flow) -> dict:
    """The port values of a flow: low 32 address bits, the upper 96 and the family bit."""
    v6 = fc.is_v6(flow)
    return {
        f"{prefix}_src_ip": flow.src & M32,
        f"{prefix}_dst_ip": flow.dst & M32,
        f"{prefix}_src_hi": flow.src >> 32 if v6 else 0,
        f"{prefix}_dst_hi": flow.dst >> 32 if v6 else 0,
        f"{prefix}_v6": int(v6),
        f"{prefix}_proto": flow.proto,
        f"{prefix}_sport": flow.sport,
        f"{prefix}_dport": flow.dport,
    }


class TB:
    def __init__(self, dut):
        self.d = dut
        cocotb.start_soon(Clock(dut.clk, 4, units="ns").start())
        for p in ("rst", "lk_valid", "h_valid", "cnt_clear", "lk_tcp_flags", "h_op", "h_slot"):
            getattr(dut, p).value = 0
        dut.lk_l4_ok.value = 1
        for k, v in {**_addr_ports("lk", Flow(0, 0, 0)), **_addr_ports("h", Flow(0, 0, 0))}.items():
            getattr(dut, k).value = v

    async def reset(self) -> None:
        d = self.d
        d.rst.value = 1
        await ClockCycles(d.clk, 2)
        d.rst.value = 0
        for _ in range((1 << LOG2_SETS) + 20):
            await RisingEdge(d.clk)
            await ReadOnly()
            if int(d.ready.value):
                break
        else:
            raise AssertionError("the sweep never ended")
        await RisingEdge(d.clk)

    async def command(self, op: int, flow=None, slot: int = 0) -> tuple[int, int, int]:
        """(status, slot, word) of one host command."""
        d = self.d
        for k, v in _addr_ports("h", flow or Flow(0, 0, 0)).items():
            getattr(d, k).value = v
        d.h_op.value, d.h_slot.value, d.h_valid.value = op, slot, 1
        await handshake(d.clk, d.h_ready)
        d.h_valid.value = 0
        for _ in range(200):
            await ReadOnly()
            if int(d.r_valid.value):
                break
            await RisingEdge(d.clk)
        else:
            raise AssertionError(f"command {op} never completed")
        got = int(d.r_status.value), int(d.r_slot.value), int(d.r_word.value)
        await RisingEdge(d.clk)
        return got

    async def lookup(self, flow, flags: int = 0x10) -> tuple[int, int, int, int]:
        """(hit, bypass, dir, slot) of one lookup, LATENCY cycles after it."""
        d = self.d
        for k, v in _addr_ports("lk", flow).items():
            getattr(d, k).value = v
        d.lk_tcp_flags.value, d.lk_valid.value = flags, 1
        await RisingEdge(d.clk)
        d.lk_valid.value = 0
        for _ in range(fc.LATENCY - 1):
            await RisingEdge(d.clk)
        await ReadOnly()
        assert int(d.res_valid.value), "no result LATENCY cycles after the lookup"
        got = tuple(int(getattr(d, p).value) for p in ("res_hit", "res_bypass", "res_dir", "res_slot"))
        await RisingEdge(d.clk)
        return got


def flip(flow, field: str, bit: int):
    """The flow with one bit of one address flipped."""
    return type(flow)(**{**flow.__dict__, field: getattr(flow, field) ^ (1 << bit)})


@cocotb.test()
async def ipv6_keys(dut):
    if os.environ["HF_FC_V6"] != "1":
        return
    tb = TB(dut)
    await tb.reset()
    rng = random.Random(25)
    a6 = Flow6(0x20010DB8000000000000000000000001, 0x20010DB8000000000000000000000002, fc.PROTO_TCP, 40000, 443)
    u6 = Flow6(rng.getrandbits(128), rng.getrandbits(128), fc.PROTO_UDP, 5353, 53)
    v4 = Flow(0x0A000001, 0x0A000002, fc.PROTO_TCP, 40000, 443)
    v4c = Flow6(0x0A000001, 0x0A000002, fc.PROTO_TCP, 40000, 443)  # ::10.0.0.1 -> ::10.0.0.2: another flow
    slots = {}
    for f in (a6, u6, v4):
        st, slot, word = await tb.command(fc.OP_INSERT, f)
        key, swap = fc.canonical(f, wide=True)
        assert st == fc.ST_OK, f"insert {f}: status {st}"
        assert fc.way_set(slot, LOG2_SETS)[1] == fc.set_index(key, LOG2_SETS, wide=True), f"set of {f}"
        e = fc.decode_word(word, wide=True)
        assert (e.valid, e.orient, e.key) == (True, swap, key) and e.flow == f, f"stored word of {f}: {word:#x}"
        # the register view round-trips (FLOW_KEY and FLOW_KEY6)
        w6 = fc.flow_key6_words(word) if fc.is_v6(f) else (0,) * 6
        assert fc.words_to_entry(fc.flow_key_words(word, False, wide=True), w6)[0].flow == f
        slots[f] = slot
    assert (await tb.command(fc.OP_INSERT, a6.reply()))[:2] == (fc.ST_EXISTS, slots[a6]), "the reply is the flow"
    for f in (a6, u6, v4):
        assert await tb.lookup(f) == (1, 0, 0, slots[f]), f"original direction of {f}"
        assert await tb.lookup(f.reply()) == (1, 0, 1, slots[f]), f"reply direction of {f}"
    assert (await tb.lookup(v4c))[0] == 0, "the IPv6 flow ::a.b.c.d hit the IPv4 flow a.b.c.d"
    assert (await tb.command(fc.OP_FIND, v4c))[0] == fc.ST_NOT_FOUND
    # one address bit away: a miss, in every byte of both addresses, both directions
    for field in ("src", "dst"):
        for bit in [*range(0, 128, 8), 127, 31, 32, 95, 96]:
            g = flip(a6, field, bit)
            assert (await tb.lookup(g))[0] == 0 and (await tb.lookup(g.reply()))[0] == 0, f"{field} bit {bit}"
    assert (await tb.lookup(Flow6(a6.src, a6.dst, a6.proto, a6.sport, a6.dport ^ 1)))[0] == 0
    assert (await tb.lookup(Flow6(a6.src, a6.dst, fc.PROTO_UDP, a6.sport, a6.dport)))[0] == 0
    # bypass as IPv4's: a SYN of a cached IPv6 flow misses
    assert (await tb.lookup(a6, 0x12))[:2] == (0, 1)
    # delete (by its reply), then a miss; the others stay
    st, slot, _ = await tb.command(fc.OP_DELETE, a6.reply())
    assert (st, slot) == (fc.ST_OK, slots[a6])
    assert (await tb.lookup(a6))[0] == 0 and (await tb.lookup(a6.reply()))[0] == 0
    assert (await tb.lookup(u6))[:3] == (1, 0, 0) and (await tb.lookup(v4.reply()))[:3] == (1, 0, 1)
    assert (await tb.command(fc.OP_DELETE, a6))[0] == fc.ST_NOT_FOUND
    # read slot of the IPv6 entry: its word
    st, _, word = await tb.command(fc.OP_READ, slot=slots[u6])
    assert st == fc.ST_OK and fc.decode_word(word, wide=True).flow == u6
    assert int(dut.occupancy.value) == 2


@cocotb.test()
async def ipv4_only_cache_refuses_ipv6(dut):
    if os.environ["HF_FC_V6"] == "1":
        return
    tb = TB(dut)
    await tb.reset()
    f6 = Flow6(1 << 100 | 5, 7, fc.PROTO_TCP, 1, 2)
    assert (await tb.command(fc.OP_INSERT, f6))[0] == fc.ST_BAD
    v4 = Flow(5, 7, fc.PROTO_TCP, 1, 2)
    st, slot, word = await tb.command(fc.OP_INSERT, v4)
    assert st == fc.ST_OK and fc.decode_word(word).flow == v4
    assert await tb.lookup(v4) == (1, 0, 0, slot)
    # an IPv6 frame whose low address bits equal the IPv4 flow's: no hit (a bypass)
    assert (await tb.lookup(f6))[:2] == (0, 1)


@pytest.mark.sim
@pytest.mark.parametrize("v6", [True, False])
def test_flow_cache_v6(v6):
    params = {"LOG2_SETS": LOG2_SETS, "WAYS": 4, "TS_W": 32, "TICK_CYCLES": 3, "V6": v6}
    run_ghdl(
        "hf_flow_cache",
        hw("hf_pkg.vhd", "hf_ram.vhd", "hf_flow_cache.vhd"),
        f"v6_{int(v6)}",
        params,
        env={"HF_FC_V6": str(int(v6))},
        test_module="test_flow_cache_v6",
    )
