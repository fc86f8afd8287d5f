"""A dual-stack core with set tables of both families (issue #25, docs/sets.md "IPv6 sets"): an IPv4 blocklist slot
beside three IPv6 slots (hf_set_table with V6: an inet6 hash:net blocklist by source with nested /32 to /128 prefixes
and a nomatch hole, the same set by destination, an inet6 hash:ip,port service set with TCP, UDP and ICMPv6
elements), IPv4 and IPv6 frames side by side, each frame's output and TUSER checked against the plans and the host's
model of the tables (hw.settable, hw.model): before the host loads the tables (every parsed frame uncertain: reason
3, no index), after, after run-time inserts, deletes and an element turned uncertain (near its timeout); SET_CONFIG,
SET6_INFO, read-back and CNT_SET_UNCERTAIN too."""

from __future__ import annotations

import dataclasses
import ipaddress
import random

import cocotb
import pytest
from cocotb.triggers import ClockCycles
from hypafilter.analysis.plan import action_words, build_plan
from hypafilter.config import Config
from hypafilter.hw import model as hwmodel
from hypafilter.hw import regmap, settable, vhdl
from hypafilter.hw.settable import Elem, Geometry, SlotState
from hypafilter.iptables.document import parse_policy
from hypafilter.iptables.sets import SetEnv
from hypafilter.ir import Header
from hypafilter.ir.sets import SetInfo
from hypafilter.shared import pack_meta

from sim.hftb import SIM_BUILD, fresh_build, header_frame, load_obj, run_ghdl, save_obj, tuser_for
from sim.hftraffic import PORT_OF_IPORT, frames_for
from sim.hypafilter_core.test_core_ipv6 import _ipv6, expect6, frame6
from sim.hypafilter_core.test_hypafilter_core import FIFO_BYTES, TB

R = regmap
GEOM = Geometry(banks=8, log2_buckets=4, ways=2)
TAG = "sets6_w256"
V4_RULES = """*filter
:FORWARD ACCEPT [0:0]
-A FORWARD -m set --match-set bl4 src -j DROP
-A FORWARD -p tcp -j DROP
COMMIT
"""
V6_RULES = """*filter
:FORWARD DROP [0:0]
-A FORWARD -m set --match-set bl6 src -j DROP
-A FORWARD -p tcp -m set --match-set svc6 dst,dst -j ACCEPT
-A FORWARD -p udp -m set --match-set svc6 dst,dst -j ACCEPT
-A FORWARD -p ipv6-icmp -m set --match-set svc6 dst,dst -j ACCEPT
-A FORWARD -p udp -m set ! --match-set bl6 dst -j ACCEPT
COMMIT
"""


def a6(s: str) -> int:
    return int(ipaddress.IPv6Address(s))


def a4(s: str) -> int:
    return int(ipaddress.IPv4Address(s))


BL4 = [Elem(a4("10.0.0.0"), 8), Elem(a4("10.1.0.0"), 16, nomatch=True)]
BL6 = [
    Elem(a6("2001:db8::"), 32),
    Elem(a6("2001:db8:1::"), 48, nomatch=True),
    Elem(a6("2001:db8:1:5::"), 64),
    Elem(a6("2001:db8:1:6::66"), 128),
    Elem(a6("2001:db9:7::"), 48),
]
SVC6 = [
    Elem(a6("2001:db8:2::1"), 128, 6, 22),
    Elem(a6("2001:db8:2::1"), 128, 17, 53),
    Elem(a6("2001:db8:2::2"), 128, 6, 443),
    Elem(a6("2001:db8:2::1"), 128, 58, 128 << 8),  # icmpv6:echo-request
]
SRC6 = ("2001:db8:7::1", "2001:db8:1:7::1", "2001:db8:1:5::9", "2001:db8:1:6::66", "2001:db8:1:6::67",
        "2001:db9:7:1::1", "2001:dead::1", "2001:db8:2::1")  # fmt: skip
DST6 = ("2001:db8:2::1", "2001:db8:2::2", "2001:db8:2::3", "2001:db8:1:5::1", "2001:db8:1::1", "2001:dead::2")
SRC4 = ("10.2.3.4", "10.1.9.9", "192.0.2.1")


def plans():
    """(IPv4 plan, IPv6 plan) with their set slots, as the compiler builds them for the emulated NIC."""
    cfg = Config()
    sets = {
        "bl4": SetInfo("bl4", "hash:net"),
        "bl6": SetInfo("bl6", "hash:net", family="inet6", netmask=128),
        "svc6": SetInfo("svc6", "hash:ip,port", family="inet6", netmask=128),
    }
    env = SetEnv(sets, 8, 1 << 16, "emu", "test", v6_slots=True)  # (the plans; the test's tables are small)
    p4 = build_plan(parse_policy(V4_RULES, "v4.rules", sets=env), cfg)
    p6 = build_plan(parse_policy(V6_RULES, "v6.rules", sets=env, family=6), cfg)
    for p in (p4, p6):
        p.set_geometry = GEOM
    return p4, p6


def header6(rng: random.Random) -> Header:
    proto = rng.choice((6, 6, 17, 17, 58, 58, 1, 59, 47))
    tcp_udp = proto in (6, 17)
    icmp_svc = proto == 58 and rng.random() < 0.5  # ICMPv6 at the service set's element
    return Header(
        src=a6(rng.choice(SRC6)) | (rng.getrandbits(8) if rng.random() < 0.3 else 0),
        dst=a6("2001:db8:2::1" if icmp_svc else rng.choice(DST6)),
        proto=proto,
        sport=rng.randrange(1024, 65536) if tcp_udp else 0,
        dport=rng.choice((22, 53, 443, rng.randrange(1, 65536))) if tcp_udp else 0,
        icmp_type=rng.choice((128, 129)) if proto == 58 else 0,
        icmp_code=0,
        iport=rng.randrange(4),
        tcp_flags=0x02 if proto == 6 else 0,
    )


def traffic(p4, rng: random.Random, n: int) -> list:
    """(frame, tuser, header or "v4") of IPv6 frames at the sets and IPv4 frames (some from the IPv4 blocklist)."""
    out = []
    for _ in range(n):
        h = header6(rng)
        f = frame6(h, "", rng)
        out.append((f, tuser_for(f, PORT_OF_IPORT[h.iport]), h))
    for f, t in frames_for(p4, rng, n // 2):
        if not _ipv6(f):
            out.append((f, t, "v4"))
    for _ in range(n // 4):  # IPv4 frames from the blocklist's net and its nomatch hole
        src = a4(rng.choice(SRC4))
        h = Header(src=src, dst=a4("192.0.2.9"), proto=17, sport=1000, dport=53)
        f = header_frame(h, rng)
        out.append((f, tuser_for(f, rng.choice((0x01, 0x04))), "v4"))
    rng.shuffle(out)
    return out


class Tables:
    """The host's images: the IPv4 slot's, then the IPv6 slots' (their own numbering, tables SET6_*)."""

    def __init__(self, p4, p6):
        self.s4, self.s6 = tuple(p4.set_slots), tuple(p6.set_slots)
        self.img4 = [settable.Image(i, s.settype, GEOM) for i, s in enumerate(self.s4)]
        self.img6 = [settable.Image(i, s.settype, GEOM, v6=True) for i, s in enumerate(self.s6)]
        self.ctl4 = [True] * len(self.s4)
        self.ctl6 = [True] * len(self.s6)

    def states4(self):
        return tuple(SlotState(s.settype, s.dirs, tuple(self.img4[i].elems()), self.ctl4[i])
                     for i, s in enumerate(self.s4))  # fmt: skip

    def states6(self):
        return tuple(SlotState(s.settype, s.dirs, tuple(self.img6[i].elems()), self.ctl6[i], True)
                     for i, s in enumerate(self.s6))  # fmt: skip


def expect(p4, p6, h, sp: int, tu: int, regs: hwmodel.Regs, states6) -> hwmodel.Decision:
    """An IPv6 frame's decision: the IPv6 slots' bits (uncertain: shunted with reason 3 and no index), then the
    IPv6 plan's first entry (test_core_ipv6.expect6)."""
    bits, unc = settable.set_bits(states6, h)
    if unc and regs.control & hwmodel.CONTROL_ENABLE:
        meta = pack_meta(hwmodel.NO_INDEX, 0, hwmodel.REASON_STATE, regs.generation & 0xFFFF)
        return hwmodel.Decision(hwmodel.Kind.SHUNT, sp << 1, meta, None, 0, hwmodel.REASON_STATE, False,
                                ("CNT_SHUNT_STATE", "CNT_SET_UNCERTAIN"))  # fmt: skip
    return expect6(p4, p6, dataclasses.replace(h, sets=bits), sp, tu, regs)


async def apply(ax, writes) -> None:
    for table, index, word in writes:
        await ax.table_access(R, table, index, word)


@cocotb.test()
async def core_sets6(dut):
    cfg = load_obj("HF_TB_CFG")
    p4, p6 = cfg["plan4"], cfg["plan6"]
    n6 = len(p6.entries)
    base = vhdl.v6_base(p4)
    d6 = vhdl.buffer6_depth(p4, p6)
    rows = base + n6 + 1 + d6
    tb = TB(dut, cfg["seed"], idle=0.2, ready=0.8)
    await tb.reset(max(rows, 1 << GEOM.log2_buckets))
    ax = tb.axil
    t = Tables(p4, p6)
    assert await ax.read(R.REG_SET_CONFIG) == len(t.s4) | settable.LATENCY << 8 | len(t.s6) << 16
    for i, s in enumerate(t.s6):
        info = await ax.table_access(R, R.TABLE_SET6_INFO, i << settable.SLOT_SHIFT)
        g = settable.slot_generics(s.settype, s.dirs, GEOM)
        assert info == g["SETTYPE"] | g["ADDR_DIR"] << 4 | g["PORT_DIR"] << 5 | settable.INFO_V6 | \
            GEOM.banks << 8 | GEOM.log2_buckets << 16 | GEOM.ways << 24, f"SET6_INFO of slot {i}: {info:#x}"  # fmt: skip
        assert await ax.table_access(R, R.TABLE_SET6_CTL, i << settable.SLOT_SHIFT) == 1  # uncertain after reset
    assert await ax.table_access(R, R.TABLE_SET6_INFO, len(t.s6) << settable.SLOT_SHIFT) == 0  # no table: 0
    assert await ax.table_access(R, R.TABLE_SET_INFO, 0) & settable.INFO_V6 == 0

    regs = hwmodel.Regs.from_plan(p4)
    regs.shunt = list(regs.shunt) + [int(b) for b in p6.shunt] + [1] * d6
    regs.actions = list(regs.actions) + list(action_words(p6)) + [0] * d6
    rng = random.Random(cfg["seed"])
    expected: list = []
    counts = {"unc6": 0, "member6": 0, "v4": 0, "icmp6_accept": 0}

    async def phase(n: int) -> None:
        regs.sets = t.states4()
        st6 = t.states6()
        batch = traffic(p4, rng, n)
        for f, tu, h in batch:
            sp = (tu >> 16) & 0xFF
            if h == "v4":
                d = hwmodel.decide(p4, f, sp, regs)
                counts["v4"] += 1
            else:
                d = expect(p4, p6, h, sp, tu, regs, st6)
                counts["unc6"] += d.reason == hwmodel.REASON_STATE
                counts["member6"] += settable.set_bits(st6, h)[0] != 0
                counts["icmp6_accept"] += h.proto == 58 and d.kind == hwmodel.Kind.FORWARD
            if d.kind != hwmodel.Kind.DROP:
                expected.append((f, hwmodel.out_tuser(tu, d), d))
        await tb.src.send([(f, tu) for f, tu, _ in batch])
        for _ in range(30000):
            if len(tb.sink.frames) >= len(expected):
                break
            await ClockCycles(dut.axis_aclk, 1)
        await ClockCycles(dut.axis_aclk, 100)
        for k, ((f, tu, d), (got, gtu, _)) in enumerate(zip(expected, tb.sink.frames, strict=False)):
            what = f"frame {k}: {d.kind.name}, index {d.match_index}, reason {d.reason}"
            meta = gtu >> 64
            assert got == f, (f"{what}: another frame came out ({got[:60].hex()}, dst_port {gtu >> 24 & 0xFF:#x}, "
                              f"index {meta & 0xFFFFFF:#x}, reason {meta >> 28 & 0xF})")  # fmt: skip
            assert gtu == tu, f"{what}: tuser {gtu:#x} != {tu:#x} ({f.hex()})"
        assert len(tb.sink.frames) == len(expected), f"{len(tb.sink.frames)} frames out, {len(expected)} expected"

    # 1: nothing loaded: every parsed frame of either family is uncertain
    await phase(20)
    assert counts["unc6"] > 10
    # 2: both families loaded, then certain
    for i, elems in enumerate([BL4]):
        await apply(ax, [w for e in elems for w in t.img4[i].insert(e)])
        await ax.table_access(R, R.TABLE_SET_CTL, i << settable.SLOT_SHIFT, 0)
        t.ctl4[i] = False
    for i, s in enumerate(t.s6):
        for e in BL6 if s.name == "bl6" else SVC6:
            await apply(ax, t.img6[i].insert(e))
        await ax.table_access(R, R.TABLE_SET6_CTL, i << settable.SLOT_SHIFT, 0)
        t.ctl6[i] = False
    e = t.img6[0].normal(BL6[1])
    b, bkt, way = t.img6[0].where[e.ident]
    i0 = settable.elem_index(0, b, bkt, way, GEOM.ways, 0, v6=True)
    words = [await ax.table_access(R, R.TABLE_SET6_ELEM, i0 | k) for k in range(4)]
    assert words == [0x20010DB8, 0x00010000, 0, 0], words
    assert await ax.table_access(R, R.TABLE_SET6_ELEM, i0 | 4) == settable.W1_VALID | settable.W1_NOMATCH
    assert await ax.table_access(R, R.TABLE_SET6_BANK, b) == settable.BANK_ENABLE | 48
    unc_before = counts["unc6"]
    await phase(80)
    # 3: run-time changes, as `ipset add/del` reach the tables: the /128 deleted, a /127 added, the /64 uncertain,
    # a service element added and one deleted
    bl = [i for i, s in enumerate(t.s6) if s.name == "bl6"]
    svc = next(i for i, s in enumerate(t.s6) if s.name == "svc6")
    for i in bl:
        await apply(ax, t.img6[i].delete(Elem(a6("2001:db8:1:6::66"), 128)))
        await apply(ax, t.img6[i].insert(Elem(a6("2001:db8:1:6::66"), 127)))
        await apply(ax, t.img6[i].insert(Elem(a6("2001:db8:1:5::"), 64, uncertain=True)))
    await apply(ax, t.img6[svc].insert(Elem(a6("2001:db8:2::3"), 128, 17, 53)))
    await apply(ax, t.img6[svc].delete(Elem(a6("2001:db8:2::2"), 128, 6, 443)))
    await phase(80)
    assert counts["unc6"] > unc_before + 10 and counts["member6"] > 50 and counts["icmp6_accept"] > 0, counts
    dut._log.info("core_sets6: %d frames out, %s", len(expected), counts)


@pytest.mark.sim
def test_core_sets6():
    """core_sets6 on a dual-stack core with IPv4 and IPv6 set slots (256 bits)."""
    p4, p6 = plans()
    assert len(p4.set_slots) == 1 and [s.name for s in p6.set_slots] == ["bl6", "svc6", "bl6"]
    out = fresh_build("hypafilter_core", TAG)
    gen = out / "gen"
    vhdl.render(p4, gen, tdata_width=256, plan6=p6)
    cfg = save_obj({"plan4": p4, "plan6": p6, "seed": 6}, out / "cfg.pkl")
    run_ghdl(
        "hypafilter_core",
        vhdl.sources(gen),
        TAG,
        {"C_S_AXIS_DATA_WIDTH": 256, "C_FIFO_DEPTH_BYTES": FIFO_BYTES},
        env={"HF_TB_CFG": str(cfg)},
        testcase="core_sets6",
        test_module="sim.hf_set_core.test_hf_set_core6",
        build_args=["-O0"],
    )
    assert SIM_BUILD.exists()
