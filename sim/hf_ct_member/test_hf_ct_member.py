"""Testbench of hf_ct_member, the conntrack membership structure: every lookup result (one header per cycle, with egress
records of host frames mixed in) equals the Python reference hypafilter.hw.ctmember.CtMember, exactly: inserts and
deletes (counting: a key inserted twice stays after one delete; both tuples of a NAT entry), a delete of a key never
inserted refused (nothing changes), saturated counters sticky, a small filter driven full (false positives, never a
lost member), egress stamps recent until the window has passed (the tick input), a clear's sweep (every lookup a
member meanwhile), the counters (members, saturated, refused). With IPv6 keys (generic V6, a dual-stack core's
structure): IPv6 tuples beside IPv4 ones through the same checks, an IPv6 tuple whose folded addresses are an IPv4
member's not a member, and an IPv6 host frame with unknown ports making every IPv6 lookup between its two addresses
(no other IPv6 one, no IPv4 one) a member for a window."""

from __future__ import annotations

import os
import random
from collections import deque

import cocotb
import pytest
from cocotb.clock import Clock
from cocotb.triggers import ClockCycles, ReadOnly, RisingEdge
from hypafilter.hw import ctmember as cm
from hypafilter.hw.flowcache import Flow, Flow6

from sim.hftb import handshake, hw, run_ghdl

LK = ("lk_src_ip", "lk_dst_ip", "lk_proto", "lk_sport", "lk_dport")
LK6 = ("lk_v6", "lk_src_hi", "lk_dst_hi")
HOST = ("h_src_ip", "h_dst_ip", "h_proto", "h_sport", "h_dport")
V6 = os.environ.get("HF_CTM_V6") == "1"
M32 = 0xFFFFFFFF


def rand_flow(rng: random.Random) -> Flow:
    return Flow(
        0x0A000000 | rng.getrandbits(24),
        0xC0A80000 | rng.getrandbits(16),
        rng.choice((6, 17)),
        rng.randrange(1024, 65536),
        rng.choice((80, 443, 53, 8080)),
    )


def rand_flow6(rng: random.Random) -> Flow6:
    return Flow6(
        0xFD484600 << 96 | rng.getrandbits(64),
        0x20010DB8 << 96 | rng.getrandbits(16) << 64 | rng.getrandbits(16),
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
        for s in (
            "rst",
            "lk_valid",
            "eg_valid",
            "h_valid",
            "h_op",
            "ticks",
            "eg_u6",
            "h_v6",
            "sh_valid",
            "sh_idx",
            "ck_idx",
            *LK,
            *LK6,
            *HOST,
        ):
            getattr(dut, s).value = 0
        dut.window.value = self.m.window
        self.pending: deque = deque()
        self.flows: list[Flow] = []  # looked up (members or not)
        self.rate, self.egress_rate = 0.0, 0.0
        self.unknown6_rate = 0.0  # IPv6 host frames whose ports are unknown (eg_u6), of the tuples in u6_flows
        self.u6_flows: list[Flow6] = []
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
            u6 = not lk and not eg and self.rng.random() < self.unknown6_rate
            f = self.rng.choice(self.u6_flows if u6 else self.flows) if lk or eg or u6 else Flow(0, 0, 0)
            if self.rng.random() < 0.5:
                f = f.reply()
            d.lk_valid.value, d.eg_valid.value, d.eg_u6.value = int(lk), int(eg), int(u6)
            for p, v in zip(LK, (f.src & M32, f.dst & M32, f.proto, f.sport, f.dport), strict=True):
                getattr(d, p).value = v
            # a u6 frame's addresses as the core gives them: the IPv6 ones, lk_v6 '0' (the walk refused the frame)
            for p, v in zip(LK6, (isinstance(f, Flow6) and not u6, f.src >> 32, f.dst >> 32), strict=True):
                getattr(d, p).value = int(v)
            key = cm.key_of(f)
            want = self.m.possible(key, self.now) if lk else None
            unsure = lk and (self.sweeping or key in self.unsure)
            if eg:
                self.m.egress(key, self.now)
            if u6 and V6:
                self.m.egress_unknown6(f.src, f.dst, self.now)
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
        # the lookup's stamp index, which the core carries to the decision (its shunt stamp)
        assert int(d.res_eidx.value) == cm.egress_index(cm.key_of(f), self.m.egress_log2), f"res_eidx of {f}"
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
        w = cm.cmd_words(op, f)  # an IPv6 tuple's with its folded addresses and the family bit
        for p, v in zip(HOST, (w[0], w[1], w[3] & 0xFF, w[2] >> 16, w[2] & 0xFFFF), strict=True):
            getattr(d, p).value = v
        d.h_v6.value = int(bool(w[3] & cm.CMD_V6))
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
        rate, egr, u6 = self.rate, self.egress_rate, self.unknown6_rate
        self.rate = self.egress_rate = self.unknown6_rate = 0.0
        await ClockCycles(self.dut.clk, cm.LATENCY + 2)
        self.dut.ticks.value = ticks
        await RisingEdge(self.dut.clk)
        self.dut.ticks.value = 0
        self.now = (self.now + ticks) & 0xFFFFFFFF
        await ClockCycles(self.dut.clk, 2)
        self.rate, self.egress_rate, self.unknown6_rate = rate, egr, u6

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


@cocotb.test()
async def ipv6_tuples_beside_ipv4_ones(dut):
    """IPv6 keys (V6): inserts (both directions one key), deletes, refused deletes, egress stamps and lookups of IPv6
    tuples mixed with IPv4 ones, every result the model's; an IPv6 tuple whose folded addresses and ports are an IPv4
    member's is not a member (the family byte in its hashes); an IPv6 host frame with unknown ports makes every IPv6
    lookup between its two addresses a member for a window, no other IPv6 one and no IPv4 one. An IPv4-only structure (V6 false) ignores lk_v6/h_v6: skipped there."""
    if not V6:
        return
    tb = TB(dut, 23)
    await tb.reset()
    await tb.advance(tb.m.window + 1)
    rng = tb.rng
    m4 = [rand_flow(rng) for _ in range(20)]
    m6 = [rand_flow6(rng) for _ in range(30)]
    s6 = [rand_flow6(rng) for _ in range(30)]
    # the IPv4 member's twin: an IPv6 tuple whose addresses fold to the IPv4 tuple's (::a.b.c.d), its address with
    # one bit of a high word flipped (another fold), and an IPv6 member's tuple with one bit flipped
    twin = Flow6(m4[0].src, m4[0].dst, m4[0].proto, m4[0].sport, m4[0].dport)
    flipped = Flow6(m6[0].src ^ 1 << 77, m6[0].dst, m6[0].proto, m6[0].sport, m6[0].dport)
    tb.flows = m4 + m6 + s6 + [twin, flipped]
    cocotb.start_soon(tb.traffic())
    tb.rate = 0.7
    for f in m4 + m6:
        await tb.command(cm.OP_INSERT, f)
    await ClockCycles(dut.clk, 400)
    assert cm.key_of(twin) != cm.key_of(m4[0]) and not tb.m.possible(cm.key_of(twin), tb.now)
    assert not tb.m.possible(cm.key_of(flipped), tb.now)
    assert all(tb.m.member(cm.key_of(f)) and tb.m.member(cm.key_of(f.reply())) for f in m6)
    absent6 = tb.counts["absent"]
    # deletes: an IPv6 member out, an IPv6 stranger refused, an IPv4 member out
    await tb.command(cm.OP_DELETE, m6[1])
    await tb.command(cm.OP_DELETE, s6[0])
    await tb.command(cm.OP_DELETE, m4[1])
    assert tb.m.refused == 1 and tb.m.members == len(m4) + len(m6) - 2
    await ClockCycles(dut.clk, 300)
    await tb.counters()
    # egress stamps of IPv6 host frames: their tuples (both directions) members until the window has passed
    tb.egress_rate = 0.2
    await ClockCycles(dut.clk, 300)
    tb.egress_rate = 0.0
    await ClockCycles(dut.clk, 200)
    await tb.advance(tb.m.window + 1)
    await ClockCycles(dut.clk, 200)
    # IPv6 host frames with unknown ports, between the addresses of s6[2:6]: every IPv6 lookup between the same two
    # addresses (either direction, any ports) a member for a window; other IPv6 lookups and IPv4 ones as they were
    before = dict(tb.counts)
    same = [Flow6(f.dst, f.src, 17, 1 + f.dport, 7) for f in s6[2:6]]  # the same addresses, other ports
    tb.flows += same
    tb.u6_flows = s6[2:6]
    tb.unknown6_rate = 0.3
    await ClockCycles(dut.clk, 300)
    tb.unknown6_rate = 0.0
    assert all(tb.m.possible(cm.key_of(f), tb.now) for f in s6[2:6] + same)
    stamped = {cm.unknown6_index(cm.fold(f.src), cm.fold(f.dst)) for f in s6[2:6]}
    others = [f for f in s6[6:] if cm.unknown6_index(cm.fold(f.src), cm.fold(f.dst)) not in stamped]
    assert len(others) > 10 and not any(tb.m.possible(cm.key_of(f), tb.now) for f in others)
    assert not tb.m.possible(cm.key_of(m4[1]), tb.now)
    absent_u6 = tb.counts["absent"]
    await ClockCycles(dut.clk, 200)
    await tb.advance(tb.m.window + 1)
    await ClockCycles(dut.clk, 300)
    assert not any(tb.m.possible(cm.key_of(f), tb.now) for f in s6[2:6] + same)
    await tb.counters()
    dut._log.info("checked %s", tb.counts)
    assert tb.counts["absent"] > absent_u6 > absent6 and tb.counts["member"] > before["member"]
    assert tb.counts["egress"] > 0


@cocotb.test()
async def shunt_stamps_follow_the_model(dut):
    """The decision's shunt stamps: in every cycle a write (sh_valid, sh_idx: a key handed to the host) and a read
    (ck_idx), whose ck_recent the next cycle is CtMember.shunted, the write of the read's own cycle included (the RAM
    gives the old word then: the bypass); a window minus one tick later every stamp still recent, one tick more none."""
    tb = TB(dut, 21)
    await tb.reset()
    d, rng = tb.dut, tb.rng
    await tb.advance(tb.m.window + 1)  # right after reset every stamp reads 0: recent for a window
    flows = [rand_flow(rng) for _ in range(24)]
    idx = {f: cm.egress_index(cm.key_of(f), tb.m.egress_log2) for f in flows}
    seen = {"recent": 0, "not": 0, "bypass": 0}

    async def cycles(n: int, write_rate: float) -> None:
        pending = None
        for _ in range(n + 1):
            await RisingEdge(d.clk)
            w = rng.random() < write_rate and _ < n
            fw = rng.choice(flows)
            fr = fw if w and rng.random() < 0.5 else rng.choice(flows)  # often the key written in the same cycle
            d.sh_valid.value, d.sh_idx.value, d.ck_idx.value = int(w), idx[fw], idx[fr]
            old = tb.m.shunted(cm.key_of(fr), tb.now)
            if w:
                tb.m.shunt(cm.key_of(fw), tb.now)
            want = tb.m.shunted(cm.key_of(fr), tb.now)
            await ReadOnly()
            if pending is not None:
                got = bool(int(d.ck_recent.value))
                assert got == pending[0], f"ck_recent of {pending[1]}: {got}, model {pending[0]} (now {tb.now})"
                seen["recent" if got else "not"] += 1
            pending = (want, fr) if _ < n else None
            seen["bypass"] += want and not old and w and idx[fw] == idx[fr]
        await RisingEdge(d.clk)
        d.sh_valid.value = 0

    await cycles(600, 0.1)
    await tb.advance(tb.m.window - 1)
    await cycles(200, 0.0)
    assert seen["recent"] > 0 and seen["not"] > 0 and seen["bypass"] > 0, seen
    await tb.advance(1)
    n = seen["recent"]
    await cycles(200, 0.0)
    assert seen["recent"] == n, "a stamp recent at the window's end"
    b = seen["bypass"]
    await cycles(200, 0.2)  # every stamp aged: the first write of each key again, read in its own cycle
    assert seen["bypass"] > b, seen
    dut._log.info("shunt stamps: %s", seen)


# ---------------------------------------------------------------- the pytest side


@pytest.mark.sim
@pytest.mark.parametrize("log2, egress_log2, v6", [(8, 4, False), (10, 6, False), (8, 4, True)])
def test_ct_member(log2, egress_log2, v6):
    run_ghdl(
        "hf_ct_member",
        hw("hf_pkg.vhd", "hf_ram.vhd", "hf_ct_member.vhd"),
        f"l{log2}_e{egress_log2}" + ("_v6" if v6 else ""),
        {"LOG2": log2, "EGRESS_LOG2": egress_log2, "V6": v6},
        env={"HF_CTM_V6": str(int(v6))},
    )
