"""Testbench of hypafilter_core built with the conntrack membership structure (CTM_LOG2 > 0): a wire TCP/UDP frame
that misses the flow cache and is neither a member (CTM_CMD inserts) nor recent egress (a frame the host sent out)
reaches the matcher with ct 3 while CTM_CONTROL's COMPLETE holds and CTM_LEASE runs, and is decided with the
SHUNT_NONE vector (CONTROL bit 4 still sends its ACCEPT to the host); members, egress within the window, ICMP, a
structure not complete, an expired lease give ct 0; deletes make a tuple NEW again; the registers (CTM_*,
CNT_CT_NONE) and the tables. Expected decisions: hwmodel.decide with the ct of hypafilter.hw.ctmember.CtMember.

A dual-stack core (issue #25, `core_ct_member_dual_stack`) with conntrack-first policies on both sides: a parsed IPv6
TCP/UDP wire frame in no entry gets ct 3 (a NEW SYN the policy drops is dropped on the NIC, one it accepts is forced
to the host by CONTROL bit 6), the same tuple after an IPv6 CTM_CMD insert ct 0 (shunted), an IPv6 tuple the flow
cache holds ct 1/2 (decided), a reply to an IPv6 frame the host sent ct 0 for the window, and an IPv6 host frame the
walk refuses (AH, a fragment) makes the lookups between its address pair possible members for the window, another
pair's and an IPv4 tuple of the same folded addresses still ct 3; IPv4 frames beside them as in the IPv4-only core.
Expected decisions: hwmodel.decide for IPv4 frames, test_core_ipv6.expect6 for IPv6 ones, each with the ct of the
flow cache's contents and CtMember."""

from __future__ import annotations

import random

import cocotb
import pytest
from cocotb.triggers import ClockCycles, RisingEdge
from hypafilter.analysis.plan import action_words, build_plan
from hypafilter.config import Config
from hypafilter.hw import ctmember as cm
from hypafilter.hw import flowcache as fc
from hypafilter.hw import model as hwmodel
from hypafilter.hw import regmap as R
from hypafilter.hw import vhdl
from hypafilter.hw.flowcache import Flow, Flow6
from hypafilter.iptables.document import parse_policy
from hypafilter.ir import Box, Header, Policy, Rule
from scapy.layers.inet6 import IPv6, IPv6ExtHdrDestOpt
from scapy.layers.l2 import Ether

from sim.hftb import fresh_build, header_frame, load_obj, run_ghdl, save_obj, tuser_for
from sim.hypafilter_core.test_core_ipv6 import expect6, frame6
from sim.hypafilter_core.test_hypafilter_core import TB

CTM_LOG2, EGRESS_LOG2 = 10, 8
MISS_ACCEPT, MISS_DROP = hwmodel.CONTROL_MISS_SHUNT_ACCEPT, hwmodel.CONTROL_MISS_SHUNT_DROP


def ct_policy() -> Policy:
    """Established first (ct 1..2), then rules that read ct 3 and rules that do not."""
    full = Box.full()
    tcp, udp = full.with_field("proto", 6, 6), full.with_field("proto", 17, 17)
    rules = [
        Rule((full.with_field("ct", 1, 2),), "ACCEPT"),
        Rule((tcp.with_field("dport", 80, 80),), "ACCEPT"),
        Rule((tcp.with_field("dport", 22, 22),), "DROP"),
        Rule((udp.with_field("dport", 53, 53).with_field("ct", 3, 3),), "DROP"),
        Rule((udp.with_field("dport", 5000, 5999),), "ACCEPT"),
    ]
    return Policy(rules, "DROP", original_rules=[("ct member test",)])


class CtmTB(TB):
    async def ctm(self, op: int, flow: Flow | None = None) -> None:
        for w, v in enumerate(cm.cmd_words(op, flow)):
            await self.axil.table_access(R, R.TABLE_CTM_CMD, w, v)

    async def fc_insert6(self, flow: Flow6) -> None:
        """An FC_CMD insert of an IPv6 flow (FC_KEY0..9), which must succeed."""
        for k, v in enumerate(fc.fc_key_regs(flow) + fc.fc_key6_regs(flow)):
            await self.axil.write(R.MAP.reg(f"FC_KEY{k}").offset, v)
        await self.axil.write(R.REG_FC_CMD, 1)
        for _ in range(1000):
            st = await self.axil.read(R.REG_FC_STATUS)
            if not st >> 31:
                assert st >> 24 & 0xF == 0, f"FC insert of {flow}: status {st >> 24 & 0xF}"
                return
        raise AssertionError("FC_STATUS stays busy")

    async def ticks(self, n: int) -> None:
        """n ms of the lease time base, with nothing in flight."""
        self.dut.lease_ticks.value = n
        await RisingEdge(self.dut.axis_aclk)
        self.dut.lease_ticks.value = 0
        await ClockCycles(self.dut.axis_aclk, 4)


async def exchange(tb, sends: list, expected: list) -> None:
    """Send `sends` (frame, tuser) into the core and check what comes out against `expected` (frame, tuser, what), in
    order: the same frames, the same TUSER."""
    tb.sink.frames.clear()
    await tb.src.send(sends)
    await tb.wait_out(len(expected))
    for k, ((f, tu, what), (got, gtu, _)) in enumerate(zip(expected, tb.sink.frames, strict=True)):
        assert got == f, f"frame {k} {what}: another frame came out"
        assert gtu == tu, f"frame {k} {what}: tuser {gtu:#x}, expected {tu:#x}"


@cocotb.test()
async def core_ct_member(dut):
    cfg = load_obj("HF_TB_CFG")
    plan, seed = cfg["plan"], cfg["seed"]
    n = len(plan.entries)
    tb = CtmTB(dut, seed, idle=0.2, ready=0.7)
    await tb.reset(n)
    ax, rng = tb.axil, random.Random(seed)
    await ClockCycles(dut.axis_aclk, 1 << max(CTM_LOG2, EGRESS_LOG2))  # the sweeps after reset
    assert await ax.read(R.REG_CTM_CONFIG) == cm.ctm_config(CTM_LOG2, EGRESS_LOG2)
    assert await ax.read(R.REG_CTM_WINDOW) == cm.DEFAULT_WINDOW_MS
    assert await ax.read(R.REG_CTM_CONTROL) == 0
    model = cm.CtMember(CTM_LOG2, EGRESS_LOG2)
    now = 0
    await tb.ticks(cm.DEFAULT_WINDOW_MS + 1)  # stamps read 0 after reset: recent for a window
    now += cm.DEFAULT_WINDOW_MS + 1
    control, gen = hwmodel.CONTROL_ENABLE | MISS_ACCEPT | MISS_DROP, 0x31
    await ax.write(R.REG_CONTROL, control)
    await ax.write(R.REG_GENERATION, gen)
    shunt = [rng.random() < 0.3 for _ in range(n + 1)]
    shunt_none = [s and rng.random() < 0.5 for s in shunt]
    shunt[0] = shunt_none[0] = False
    shunt[2], shunt_none[2] = True, False  # TCP 22 DROP: shunted with ct 0, dropped with ct 3
    shunt[4] = shunt_none[4] = True
    shunt_none[n] = False
    for name, bits in (("SHUNT", shunt), ("SHUNT_NONE", shunt_none)):
        for w in range((n + 1 + 31) // 32):
            word = sum(1 << j for j in range(32) if 32 * w + j <= n and bits[32 * w + j])
            await ax.table_access(R, getattr(R, f"TABLE_{name}"), w, word)
    regs = hwmodel.Regs.from_plan(plan)
    regs.shunt, regs.shunt_none, regs.generation, regs.control = [int(b) for b in shunt], shunt_none, gen, control
    regs.shunt_none = [int(b) for b in shunt_none]
    assert regs.shunt != regs.shunt_none
    counters = hwmodel.Counters(n)
    ct_none = 0

    def rand_flow() -> Flow:
        proto = rng.choice((6, 17))
        dport = rng.choice((80, 22, 443) if proto == 6 else (53, 5353, 5100))
        return Flow(
            0x0A000000 | rng.getrandbits(16), 0xC0A80000 | rng.getrandbits(8), proto, rng.randrange(1024, 65536), dport
        )

    def frame(
        fl: Flow, port: int, flags: int = 0x10, icmp: bool = False, fragment: bool = False
    ) -> tuple[bytes, int, Header]:
        iport = {0x01: 0, 0x04: 1, 0x10: 2, 0x40: 3}.get(port, 0)
        proto = 1 if icmp else fl.proto
        h = Header(
            fl.src,
            fl.dst,
            proto,
            0 if icmp else fl.sport,
            0 if icmp else fl.dport,
            8 if icmp else 0,
            0,
            iport,
            flags if proto == 6 else 0,
        )
        f = header_frame(h, rng)
        if fragment:  # MF set (the checksum no longer fits either): the parser calls it unparsed
            b = bytearray(f)
            b[20] |= 0x20
            f = bytes(b)
        return f, tuser_for(f, port), h

    decisions: list[hwmodel.Decision] = []  # of the frames of the last run

    async def run(items: list[tuple[Flow, int, dict]], complete: bool) -> list[int]:
        """Send the frames (wire or host ports); every output checked; the ct each wire frame had."""
        nonlocal ct_none
        expected, cts, sends = [], [], []
        decisions.clear()
        for fl, port, kw in items:
            f, tu, h = frame(fl, port, **kw)
            key = cm.key_of(fl)
            ct = 0
            if port in hwmodel.HOST_PORTS:
                if h.proto in (6, 17):
                    model.egress(key, now)
            else:
                ct = hwmodel.nic_miss_ct(f, port, model.possible(key, now), complete)
            d = hwmodel.decide(plan, f, port, regs, ct=ct, shunted=ct == 3 and model.shunted(key, now))
            if port in hwmodel.WIRE_PORTS and h.proto in (6, 17) and d.dst_port & 0xAA:
                model.shunt(key, now)  # a wire frame handed to the host stamps its key
            decisions.append(d)
            counters.add(d, port)
            ct_none += ct == 3
            cts.append(ct)
            sends.append((f, tu))
            if d.kind != hwmodel.Kind.DROP:
                expected.append((f, hwmodel.out_tuser(tu, d), (fl, port, ct, d)))
        await exchange(tb, sends, expected)
        return cts

    flows = [rand_flow() for _ in range(60)]
    members, strangers = flows[:30], flows[30:]
    for fl in members:
        await tb.ctm(cm.OP_INSERT, fl if rng.random() < 0.5 else fl.reply())
        model.insert(cm.key_of(fl))
    await ClockCycles(dut.axis_aclk, 20)
    assert await ax.read(R.REG_CTM_MEMBERS) == len(members)

    def mix(count: int) -> list:
        out = []
        for _ in range(count):
            fl = rng.choice(flows)
            fl = fl if rng.random() < 0.5 else fl.reply()
            r = rng.random()
            kw = {"icmp": True} if r < 0.1 else {"flags": rng.choice((0x02, 0x10, 0x11, 0x04))} if r < 0.4 else {}
            out.append((fl, rng.choice((0x01, 0x04, 0x10, 0x40)), kw))
        return out

    # -- not complete: no ct 3
    assert 3 not in await run(mix(60), complete=False)
    # -- complete, lease running: members ct 0, the others ct 3 (ICMP never)
    await ax.write(R.REG_CTM_LEASE, 5000)
    await ax.write(R.REG_CTM_CONTROL, cm.CONTROL_COMPLETE)
    got = await run(mix(200), complete=True)
    assert 3 in got and 0 in got
    # -- a stranger's SYN the host gets (TCP 80 accepted: to the host) and its reverse tuple right behind it on a wire
    # (an RST/ACK; the kernel calls it ESTABLISHED, the first frame having made the entry): ct 3, the structure and
    # the egress stamps do not hold it yet, but the first frame's shunt stamp sends it to the host with no index
    race = [Flow(0x0B000000 | rng.getrandbits(16), 0xC0A80000 | rng.getrandbits(8), 6, 1024 + k, 80) for k in range(8)]
    items = [
        it
        for fl in race
        for it in ((fl, 0x01, {"flags": 0x02}), (fl.reply(), rng.choice((0x01, 0x04)), {"flags": 0x14}))
    ]
    got = await run(items, complete=True)
    assert got == [3] * len(items), got
    assert all(d.dst_port & 0xAA for d in decisions[0::2]), decisions
    late = [(d.kind, d.reason, d.match_index) for d in decisions[1::2]]
    assert late == [(hwmodel.Kind.SHUNT, hwmodel.REASON_STATE, None)] * len(race), late
    # a window later the stamps have aged: the same replies (NEW or INVALID to a kernel without their entries) dropped
    await tb.ticks(cm.DEFAULT_WINDOW_MS)
    now += cm.DEFAULT_WINDOW_MS
    assert await run([(fl.reply(), 0x01, {"flags": 0x14}) for fl in race], complete=True) == [3] * len(race)
    assert all(d.kind == hwmodel.Kind.DROP for d in decisions), decisions
    # -- egress: the host sends frames of strangers; their replies are members until the window has passed
    out = strangers[:10]
    await run([(fl, rng.choice(sorted(hwmodel.HOST_PORTS)), {}) for fl in out], complete=True)
    got = await run([(fl.reply(), 0x01, {}) for fl in out], complete=True)
    assert got == [0] * len(out), got
    await tb.ticks(cm.DEFAULT_WINDOW_MS)
    now += cm.DEFAULT_WINDOW_MS
    got = await run([(fl.reply(), 0x04, {}) for fl in out], complete=True)
    assert 3 in got
    # -- a host frame the parser refuses (a first fragment) still stamps its key: its reply is a member
    frag = strangers[12:16]
    await run([(fl, 0x02, {"fragment": True}) for fl in frag], complete=True)
    assert await run([(fl.reply(), 0x01, {}) for fl in frag], complete=True) == [0] * len(frag)
    # -- deletes: a deleted tuple is NEW again
    for fl in members[:10]:
        await tb.ctm(cm.OP_DELETE, fl)
        model.delete(cm.key_of(fl))
    got = await run([(fl, 0x10, {}) for fl in members[:10]] + mix(100), complete=True)
    assert 3 in got[:10]
    # -- the lease runs out: COMPLETE clears, no ct 3 until the host sets it again
    await tb.ticks(5000)
    now += 5000
    assert await ax.read(R.REG_CTM_CONTROL) == 0 and await ax.read(R.REG_CTM_LEASE) == 0
    assert 3 not in await run(mix(60), complete=False)
    await ax.write(R.REG_CTM_LEASE, 100)
    assert 3 not in await run(mix(30), complete=False)
    await ax.write(R.REG_CTM_CONTROL, cm.CONTROL_COMPLETE)
    assert 3 in await run(mix(100), complete=True)
    # -- a clear: not complete any more, nothing a member
    await tb.ctm(cm.OP_CLEAR)
    model.clear()
    await ClockCycles(dut.axis_aclk, (1 << CTM_LOG2) + 20)
    assert await ax.read(R.REG_CTM_CONTROL) == 0 and await ax.read(R.REG_CTM_MEMBERS) == 0
    # -- registers and tables
    assert await ax.read(R.REG_CNT_CT_NONE) == ct_none
    for name in [r.name for r in R.MAP.registers if r.name.startswith("CNT_") and r.name != "CNT_CT_NONE"]:
        assert await ax.read(R.MAP.reg(name).offset) == counters.regs.get(name, 0), name
    for w in range((n + 1 + 31) // 32):
        word = sum(1 << j for j in range(32) if 32 * w + j <= n and shunt_none[32 * w + j])
        assert await ax.table_access(R, R.TABLE_SHUNT_NONE, w) == word
    assert await ax.read(R.REG_CTM_STATUS) == 0
    dut._log.info("core_ct_member: %d frames with ct 3, counters %s", ct_none, counters.regs)


# ---------------------------------------------------------------- the dual-stack core (issue #25)

# Conntrack-first policies with DROP by default, one per family (the shape of tests/system/test_ipv6_flowcache_emu.py):
# with ct 0 every row but the established entry's shunts (SHUNT), with ct 3 none does (SHUNT_NONE), and the miss
# forcing of both families is on (CONTROL bits 4-7): a NEW frame the policy drops is dropped on the NIC, one it accepts
# goes to the host (reason 3), a frame of a connection conntrack holds is shunted, a flow cache hit is decided
V4_CT = """*filter
:FORWARD DROP [0:0]
-A FORWARD -m conntrack --ctstate ESTABLISHED,RELATED -j ACCEPT
-A FORWARD -s 10.0.0.0/8 -p tcp --dport 80 -j ACCEPT
-A FORWARD -p udp --dport 53 -j ACCEPT
COMMIT
"""
V6_CT = """*filter
:FORWARD DROP [0:0]
-A FORWARD -m conntrack --ctstate ESTABLISHED,RELATED -j ACCEPT
-A FORWARD -p ipv6-icmp --icmpv6-type echo-request -j ACCEPT
-A FORWARD -s fd48:4600::/64 -p tcp --dport 80 -j ACCEPT
-A FORWARD -p udp --dport 5000:5100 -j ACCEPT
COMMIT
"""
DS_LOG2 = cm.MIN_LOG2  # counters per bank and egress stamps: the smallest structure, the shortest sweeps
DS_DEPTH = 4  # update buffer slots per family: fewer rows, a smaller core
NET6_A = 0xFD484600 << 96  # fd48:4600::/64: its TCP 80 accepted
NET6_B = 0x20010DB80001 << 80  # 2001:db8:1::/48: clients the IPv6 policy drops (TCP)
NET6_S = 0x20010DB80002 << 80  # 2001:db8:2::/48: servers


def ds_plans():
    """(IPv4 plan, IPv6 plan) of the conntrack-first policies, as the compiler builds them."""
    cfg = Config(update_buffer=DS_DEPTH)
    return build_plan(parse_policy(V4_CT, "v4.rules"), cfg), build_plan(parse_policy(V6_CT, "v6.rules", family=6), cfg)


@cocotb.test()
async def core_ct_member_dual_stack(dut):
    """The dual-stack core's ct 3 path (module docstring): every output frame and TUSER against the model, the ct of
    every wire frame from the flow cache's contents and CtMember, then the counters and SHUNT_NONE."""
    cfg = load_obj("HF_TB_CFG")
    p4, p6, seed = cfg["plan4"], cfg["plan6"], cfg["seed"]
    n6 = len(p6.entries)
    base, d6 = vhdl.v6_base(p4), vhdl.buffer6_depth(p4, p6)
    rows = base + n6 + 1 + d6
    tb = CtmTB(dut, seed, idle=0.2, ready=0.7)
    await tb.reset(rows)
    ax, rng = tb.axil, random.Random(seed)
    await ClockCycles(dut.axis_aclk, 1 << max(DS_LOG2, DS_GENERICS["FC_LOG2_SETS"]))  # the sweeps after reset
    assert await ax.read(R.REG_CTM_CONFIG) == cm.ctm_config(DS_LOG2, DS_LOG2, v6=True)  # bit 24: IPv6 keys
    fcg = DS_GENERICS
    assert await ax.read(R.REG_FC_CONFIG) == fc.fc_config(fcg["FC_LOG2_SETS"], fcg["FC_WAYS"], 32, wide=True)
    model, now, complete = cm.CtMember(DS_LOG2, DS_LOG2), 0, False
    await tb.ticks(cm.DEFAULT_WINDOW_MS + 1)  # stamps read 0 after reset: recent for a window
    now += cm.DEFAULT_WINDOW_MS + 1
    # the rows as NicClient.program writes them: the IPv6 plan's at V6_BASE, SHUNT_NONE's too (CTM_CONFIG bit 24)
    regs = hwmodel.Regs.from_plan(p4)
    regs.shunt = list(regs.shunt) + [int(b) for b in p6.shunt] + [1] * d6
    regs.actions = list(regs.actions) + list(action_words(p6)) + [0] * d6
    regs.shunt_none = list(regs.shunt_none) + [int(b) for b in p6.shunt_none] + [1] * d6
    regs.control |= hwmodel.miss_shunt6_control(p6.miss_shunt)
    assert len(regs.shunt) == len(regs.shunt_none) == rows
    assert regs.control == hwmodel.CONTROL_ENABLE | hwmodel.CONTROL_MISS_SHUNT | hwmodel.CONTROL_MISS_SHUNT6
    v6rows = range(base, base + n6 + 1)
    assert [regs.shunt[i] for i in v6rows] == [0] + [1] * n6, "the test wants ct 0 shunted below the established row"
    assert not any(regs.shunt_none[i] for i in v6rows), "the test wants ct 3 decided on every IPv6 row"
    none_words = [
        sum(1 << j for j in range(32) if 32 * w + j < rows and regs.shunt_none[32 * w + j])
        for w in range((rows + 31) // 32)
    ]
    for w, word in enumerate(none_words):
        await ax.table_access(R, R.TABLE_SHUNT_NONE, w, word)
    await ax.write(R.REG_CONTROL, regs.control)
    fc6: dict[int, int] = {}  # the IPv6 flows in the flow cache: wide canonical key -> its orientation
    tally = {"ct3": 0, "dropped": 0, "state": 0, "forwarded": 0}

    def flow6(net: int, dport: int, proto: int = 6) -> Flow6:
        return Flow6(net | rng.getrandbits(64), NET6_S | rng.getrandbits(16), proto, rng.randrange(1024, 65536), dport)

    def flow4(dport: int, proto: int = 6) -> Flow:
        return Flow(
            0x0A000000 | rng.getrandbits(16), 0xC0A80000 | rng.getrandbits(8), proto, rng.randrange(1024, 65536), dport
        )

    def frame_of(fl: Flow | Flow6, port: int, flags: int = 0x02, ext: str = "", icmp: bool = False):
        """(frame, header as the core parses it; None for an IPv6 chain its walk refuses: AH, a fragment)."""
        iport = hwmodel.WIRE_PORTS.get(port, 0)
        if isinstance(fl, Flow6):
            if icmp:  # an echo request between the flow's addresses
                h = Header(fl.src, fl.dst, 58, 0, 0, 128, 0, iport, 0)
            else:
                h = Header(fl.src, fl.dst, fl.proto, fl.sport, fl.dport, 0, 0, iport, flags if fl.proto == 6 else 0)
            if ext == "dst4":  # 4 destination options headers: a longer chain than the walk takes (refused)
                pkt = Ether(frame6(h, "", rng))
                l4 = pkt[IPv6].payload.copy()
                pkt[IPv6].remove_payload()
                del pkt[IPv6].nh, pkt[IPv6].plen
                opts = IPv6ExtHdrDestOpt() / IPv6ExtHdrDestOpt() / IPv6ExtHdrDestOpt() / IPv6ExtHdrDestOpt(nh=fl.proto)
                return bytes(pkt / opts / l4), None
            return frame6(h, ext, rng), None if ext in ("ah", "frag") else h
        h = Header(fl.src, fl.dst, fl.proto, fl.sport, fl.dport, 0, 0, iport, flags if fl.proto == 6 else 0)
        return header_frame(h, rng), h

    async def run(items: list) -> list[tuple[int, hwmodel.Decision]]:
        """Send the frames ((flow, port, frame options)); every output and its TUSER checked; (ct, decision) of each
        (ct of a host frame: 0)."""
        expected, out, sends = [], [], []
        for fl, port, kw in items:
            f, h = frame_of(fl, port, **kw)
            tu = tuser_for(f, port)
            v6, ct = isinstance(fl, Flow6), 0
            mkey = cm.key_of(fl)  # the structure's key (the flow cache's wide one is `key` below)
            if port in hwmodel.HOST_PORTS:  # passed to the paired MAC; its stamp as the core writes it
                if v6 and h is None:
                    model.egress_unknown6(fl.src, fl.dst, now)
                elif h.proto in (6, 17):
                    model.egress(cm.key_of(fl), now)
                d = hwmodel.decide(p4, f, port, regs)
            elif v6:
                if h is None:  # refused by the walk: to the host unparsed, its address pair stamped "unknown"
                    model.refused6(fl.src, fl.dst, now)
                if h is not None and h.proto in (6, 17):
                    key, swap = fc.canonical(fl, wide=True)
                    if key in fc6 and not fc.bypass(h.proto, h.tcp_flags):
                        ct = 1 + fc.direction(swap, fc6[key])
                    elif complete and not model.possible(mkey, now):
                        ct = 3
                if ct == 3 and model.shunted(mkey, now):  # a frame of its key went to the host: unjudged
                    meta = hwmodel.pack_meta(hwmodel.NO_INDEX, 0, hwmodel.REASON_STATE, regs.generation & 0xFFFF)
                    d = hwmodel.Decision(hwmodel.Kind.SHUNT, port << 1, meta, None, 0, hwmodel.REASON_STATE)
                else:
                    d = expect6(p4, p6, h, port, tu, regs, ct=ct)
            else:
                ct = hwmodel.nic_miss_ct(f, port, model.possible(mkey, now), complete)
                d = hwmodel.decide(p4, f, port, regs, ct=ct, shunted=ct == 3 and model.shunted(mkey, now))
            # a wire frame with a key (IPv4 TCP/UDP, a parsed IPv6 TCP/UDP one) handed to the host stamps it
            if port in hwmodel.WIRE_PORTS and h is not None and h.proto in (6, 17) and d.dst_port & 0xAA:
                model.shunt(mkey, now)
            tally["ct3"] += ct == 3
            tally["dropped"] += d.kind == hwmodel.Kind.DROP
            tally["state"] += d.reason == hwmodel.REASON_STATE
            tally["forwarded"] += d.kind == hwmodel.Kind.FORWARD and d.match_index is not None
            out.append((ct, d))
            sends.append((f, tu))
            if d.kind != hwmodel.Kind.DROP:
                expected.append((f, hwmodel.out_tuser(tu, d), (fl, port, ct, d.kind.name, d.reason)))
        await exchange(tb, sends, expected)
        return out

    def wire() -> int:
        return rng.choice(sorted(hwmodel.WIRE_PORTS))

    def kinds(out) -> list[tuple[int, str, int | None]]:
        return [(ct, d.kind.name, d.reason) for ct, d in out]

    drop6 = [flow6(NET6_B, 22) for _ in range(4)] + [flow6(NET6_A, 443)]  # NEW: the IPv6 policy entry drops them
    acc6 = [flow6(NET6_A, 80), flow6(NET6_B, 5050, 17)]  # NEW: accepted, so forced to conntrack (bit 6)
    mem6 = [flow6(NET6_B, 22), flow6(NET6_A, 80), flow6(NET6_B, 5001, 17), flow6(NET6_B, 443)]
    cached6 = flow6(NET6_A, 80)  # in the structure and in the flow cache
    drop4, acc4, mem4 = [flow4(22), flow4(443)], [flow4(80)], [flow4(22), flow4(53, 17)]
    ACK, SYNACK = 0x10, 0x12  # (SYN: frame_of's default)
    syn_all = [(fl, wire(), {}) for fl in drop6 + acc6 + mem6 + drop4 + acc4 + mem4]

    # -- not complete: no frame of either family gets ct 3
    assert all(ct == 0 for ct, _ in await run(syn_all))
    # those frames went to the host (ct 0: shunted), so their shunt stamps hold their tuples off ct 3 for a window
    await tb.ticks(cm.DEFAULT_WINDOW_MS)
    now += cm.DEFAULT_WINDOW_MS
    # -- complete: inserts by CTM_CMD (IPv6 ones with w3 bit 10), either direction's tuple
    await ax.write(R.REG_CTM_LEASE, 60000)
    await ax.write(R.REG_CTM_CONTROL, cm.CONTROL_COMPLETE)
    complete = True
    for fl in [*mem6, *mem4, cached6]:
        await tb.ctm(cm.OP_INSERT, fl if rng.random() < 0.5 else fl.reply())
        model.insert(cm.key_of(fl))
    await tb.fc_insert6(cached6)
    fc6[fc.canonical(cached6, wide=True)[0]] = fc.canonical(cached6, wide=True)[1]
    await ClockCycles(dut.axis_aclk, 20)
    assert await ax.read(R.REG_CTM_MEMBERS) == model.members == len(mem6) + len(mem4) + 1
    # strangers' SYNs (some behind a destination options header: parsed by the walk) ct 3, members' frames ct 0, the
    # cached flow's ACKs ct 1 and 2 (its SYN bypasses the cache: a member, ct 0), an ICMPv6 echo never looked up
    items = [(fl, wire(), {"ext": "dst"} if k % 3 == 0 else {}) for k, fl in enumerate(drop6 + acc6)]
    items += [(fl, wire(), {}) for fl in drop4 + acc4]
    items += [(fl if k % 2 else fl.reply(), wire(), {"flags": ACK}) for k, fl in enumerate(mem6 + mem4)]
    items += [(cached6, wire(), {"flags": ACK}), (cached6.reply(), wire(), {"flags": ACK}), (cached6, wire(), {})]
    items += [(drop6[0], wire(), {"icmp": True})]
    out = await run(items)
    k6 = len(drop6) + len(acc6)
    assert kinds(out[: len(drop6)]) == [(3, "DROP", None)] * len(drop6), kinds(out)
    assert kinds(out[len(drop6) : k6]) == [(3, "SHUNT", hwmodel.REASON_STATE)] * len(acc6), kinds(out)
    assert kinds(out[k6 : k6 + 2]) == [(3, "DROP", None)] * 2 and kinds(out[k6 + 2 : k6 + 3])[0][:2] == (3, "SHUNT")
    k = k6 + len(drop4 + acc4)
    assert all(ct == 0 and d.kind == hwmodel.Kind.SHUNT for ct, d in out[k : k + len(mem6 + mem4)]), kinds(out)
    ovr = hwmodel.REASON_OVERRULE
    assert kinds(out[-4:]) == [(1, "FORWARD", None), (2, "FORWARD", None), (0, "SHUNT", ovr), (0, "SHUNT", ovr)]
    # -- the same tuple once the host inserts its entry: ct 0 (shunted, conntrack holds it); deleted: ct 3 again
    target = drop6[0]
    await tb.ctm(cm.OP_INSERT, target.reply())
    model.insert(cm.key_of(target))
    out = await run([(target, wire(), {}), (target.reply(), wire(), {"flags": SYNACK}), (acc6[0], wire(), {})])
    assert kinds(out[:2]) == [(0, "SHUNT", hwmodel.REASON_POLICY)] * 2 and kinds(out)[2][:2] == (3, "SHUNT")
    await tb.ctm(cm.OP_DELETE, target)
    model.delete(cm.key_of(target))
    # ct 3 again, but its frames just went to the host: unjudged (reason 3, no index) until their shunt stamp ages
    out = await run([(target, wire(), {})])
    assert kinds(out) == [(3, "SHUNT", hwmodel.REASON_STATE)] and out[0][1].match_index is None, kinds(out)
    await tb.ticks(cm.DEFAULT_WINDOW_MS)
    now += cm.DEFAULT_WINDOW_MS
    assert kinds(await run([(target, wire(), {})])) == [(3, "DROP", None)]
    # -- egress: the host sends SYNs of strangers (either family); their replies are ct 0 until the window has passed
    eg = [flow6(NET6_B, 22) for _ in range(3)] + [flow4(22)]
    await run([(fl, rng.choice(hwmodel.HOST_PORTS), {}) for fl in eg])
    replies = [(fl.reply(), wire(), {"flags": SYNACK}) for fl in eg]
    assert all(ct == 0 and d.kind == hwmodel.Kind.SHUNT for ct, d in await run(replies))
    await tb.ticks(cm.DEFAULT_WINDOW_MS)
    now += cm.DEFAULT_WINDOW_MS
    assert kinds(await run(replies)) == [(3, "DROP", None)] * len(eg)
    # -- strangers' first frames on a wire behind 4 destination options headers (the walk refuses the chain; the
    # kernel's conntrack walks it and makes the entry of an accepted one), each with its plain reverse tuple right
    # behind it: the refused frame stamps its address pair, so the reply is not NEW to the core (ct 0: shunted); a
    # window later the same replies get ct 3 and are dropped
    race6 = [flow6(NET6_A, 80), flow6(NET6_B, 5050, 17), flow6(NET6_A, 80)]
    flags = {6: SYNACK, 17: 0}
    items = [
        it for fl in race6 for it in ((fl, wire(), {"ext": "dst4"}), (fl.reply(), wire(), {"flags": flags[fl.proto]}))
    ]
    out = await run(items)
    assert kinds(out[0::2]) == [(0, "SHUNT", hwmodel.REASON_UNPARSED)] * len(race6), kinds(out)
    assert all(ct == 0 and d.kind == hwmodel.Kind.SHUNT for ct, d in out[1::2]), kinds(out)
    await tb.ticks(cm.DEFAULT_WINDOW_MS)
    now += cm.DEFAULT_WINDOW_MS
    assert kinds(await run(items[1::2])) == [(3, "DROP", None)] * len(race6)
    # -- IPv6 host frames the walk refuses (an AH chain, a first fragment): their ports unknown, every IPv6 lookup
    # between the same two addresses (either direction, any ports) ct 0 for the window; another pair's ct 3, and an
    # IPv4 tuple of the pair's folded addresses too (its key is not IPv6)
    p1, p2 = flow6(NET6_B, 22), flow6(NET6_B, 22)
    q = next(f for f in (flow6(NET6_B, 22) for _ in range(20)) if cm.unknown6_index(cm.fold(f.src), cm.fold(f.dst))
             not in {cm.unknown6_index(cm.fold(p.src), cm.fold(p.dst)) for p in (p1, p2)})  # fmt: skip
    twin = Flow(cm.fold(p1.src), cm.fold(p1.dst), 6, 40000, 22)
    await run([(p1.reply(), 0x02, {"ext": "ah"}), (p2, 0x08, {"ext": "frag"})])
    pair = [
        (Flow6(p1.src, p1.dst, 6, 50000, 22), wire(), {}),  # another source port
        (Flow6(p1.dst, p1.src, 17, 5353, 5050), wire(), {}),  # the other direction, UDP: the policy accepts it
        (Flow6(p2.src, p2.dst, 6, 1234, 8080), wire(), {}),
        (Flow6(p2.dst, p2.src, 6, 22, 1234), wire(), {"flags": SYNACK}),
    ]
    others = [(q, wire(), {}), (twin, wire(), {})]
    out = await run(pair + others)
    assert all(ct == 0 and d.kind == hwmodel.Kind.SHUNT for ct, d in out[: len(pair)]), kinds(out)
    assert kinds(out[len(pair) :]) == [(3, "DROP", None)] * 2, kinds(out)
    await tb.ticks(cm.DEFAULT_WINDOW_MS)
    now += cm.DEFAULT_WINDOW_MS
    out = await run(pair)
    assert [ct for ct, _ in out] == [3] * len(pair) and kinds(out)[1] == (3, "SHUNT", hwmodel.REASON_STATE)
    # -- the counters, SHUNT_NONE as written, nothing refused
    assert await ax.read(R.REG_CNT_CT_NONE) == tally["ct3"]
    assert await ax.read(R.REG_CNT_DROPPED) == tally["dropped"]
    assert await ax.read(R.REG_CNT_SHUNT_STATE) == tally["state"]
    assert await ax.read(R.REG_CNT_FORWARDED) == tally["forwarded"]
    assert await ax.read(R.REG_CTM_MEMBERS) == model.members and await ax.read(R.REG_CTM_STATUS) == 0
    for w, word in enumerate(none_words):
        assert await ax.table_access(R, R.TABLE_SHUNT_NONE, w) == word
    dut._log.info("core_ct_member_dual_stack: %s", tally)


# ---------------------------------------------------------------- the pytest side

CTM_GENERICS = {
    "FC_LOG2_SETS": 10,
    "FC_WAYS": 4,
    "FC_TICK_CYCLES": 16,
    "LEASE_TICK_CYCLES": 0,
    "CTM_LOG2": CTM_LOG2,
    "CTM_EGRESS_LOG2": EGRESS_LOG2,
}


def _run_core(tag: str, testcase: str, cfg: dict, generics: dict, plan, plan6=None, build_args=None) -> None:
    """Render the core of `plan` (and `plan6`: a dual-stack core) at 256 bits into build/sim/hypafilter_core/<tag>
    and run `testcase` of this module on it with `cfg` (HF_TB_CFG)."""
    out = fresh_build("hypafilter_core", tag)
    path = save_obj(cfg, out / "cfg.pkl")
    vhdl.render(plan, out / "gen", tdata_width=256, plan6=plan6)
    run_ghdl(
        "hypafilter_core",
        vhdl.sources(out / "gen"),
        tag,
        {"C_S_AXIS_DATA_WIDTH": 256, "C_FIFO_DEPTH_BYTES": 4096, **generics},
        env={"HF_TB_CFG": str(path)},
        testcase=testcase,
        test_module="sim.hf_ct_member.test_core_ct_member",
        build_args=build_args,
    )


@pytest.mark.sim
def test_core_ct_member():
    plan = vhdl.minimal_plan(ct_policy())
    _run_core("ct_member", "core_ct_member", {"plan": plan, "seed": 5}, CTM_GENERICS, plan)


# the dual-stack core: the flow cache holds IPv6 tuples and the structure IPv6 keys (both generics' V6 follow the plan6)
DS_GENERICS = {
    "FC_LOG2_SETS": 10,
    "FC_WAYS": 4,
    "FC_TICK_CYCLES": 16,
    "LEASE_TICK_CYCLES": 0,
    "CTM_LOG2": DS_LOG2,
    "CTM_EGRESS_LOG2": DS_LOG2,
}


@pytest.mark.sim
def test_core_ct_member_dual_stack():
    """core_ct_member_dual_stack on a dual-stack core (256 bits) of the conntrack-first policies."""
    p4, p6 = ds_plans()
    cfg = {"plan4": p4, "plan6": p6, "seed": 6}
    _run_core("ct_member6", "core_ct_member_dual_stack", cfg, DS_GENERICS, p4, plan6=p6, build_args=["-O0"])
