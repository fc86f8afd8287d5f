"""Testbench of a dual-stack hypafilter_core (issue #25, docs/ipv6.md "The NIC's core"): a core generated from an
IPv4 and an IPv6 plan, IPv6 frames (scapy) at and around every IPv6 rule's bounds and IPv4 frames (sim/hftraffic),
each frame's decision and match_index checked against the compiler's plans."""

from __future__ import annotations

import dataclasses
import ipaddress
import random
import shutil

import cocotb
import pytest
from cocotb.triggers import ClockCycles
from hypafilter.analysis.decision import match_index
from hypafilter.analysis.plan import action_words, build_plan
from hypafilter.config import Config
from hypafilter.hw import model as hwmodel
from hypafilter.hw import regmap, vhdl
from hypafilter.iptables.document import parse_policy
from hypafilter.ir import FIELDS, WIDTHS, Header
from hypafilter.ir.family import ADDR_MAX
from hypafilter.shared import pack_meta
from scapy.layers.inet import TCP, UDP
from scapy.layers.inet6 import IPv6, IPv6ExtHdrDestOpt, IPv6ExtHdrFragment, IPv6ExtHdrRouting
from scapy.layers.ipsec import AH
from scapy.layers.l2 import Ether
from scapy.packet import Raw

from sim.hftb import SIM_BUILD, load_obj, run_ghdl, save_obj, tuser_for
from sim.hftraffic import PORT_OF_IPORT, frames_for
from sim.hypafilter_core.test_hypafilter_core import FIFO_BYTES, TB

# The IPv4 side: its last rule matches half of every address space, so a core whose IPv4 entries did not test the
# frame's family would give IPv6 frames (whose bytes at the IPv4 source's offset mostly lie below 128.0.0.0) an IPv4
# index; the IPv6 side's last rule (::/1) does the same for IPv4 frames that no IPv4 entry holds.
V4_RULES = """*filter
:FORWARD DROP [0:0]
-A FORWARD -p tcp -s 10.0.0.0/8 --dport 22 -j ACCEPT
-A FORWARD -p udp -d 192.168.1.0/24 -j DROP
-A FORWARD -p icmp --icmp-type 8 -j ACCEPT
-A FORWARD -s 0.0.0.0/1 -j DROP
COMMIT
"""
# Prefixes of several lengths, a single address, iprange ranges that are no prefix (128-bit range comparators),
# port ranges, ICMPv6 type and code, TCP flags, a protocol without ports; the default ACCEPT (its entry shunts
# nothing: the IPv6 policy entry must be met too, by frames beyond ::/1)
V6_RULES = """*filter
:FORWARD ACCEPT [0:0]
-A FORWARD -p tcp -s 2001:db8::/32 --dport 22 -j ACCEPT
-A FORWARD -p udp -d 2001:db8:1::5 --dport 53 -j DROP
-A FORWARD -m iprange --src-range 2001:db8::10-2001:db8::1:3 -p tcp -j DROP
-A FORWARD -m iprange --dst-range 2001:db8:0:0:8000::-2001:db8:0:1::7fff -p udp --sport 1000:2000 -j ACCEPT
-A FORWARD -p ipv6-icmp --icmpv6-type port-unreachable -j DROP
-A FORWARD -p ipv6-icmp --icmpv6-type echo-request -s fe80::/10 -j ACCEPT
-A FORWARD -p tcp --tcp-flags SYN,ACK SYN -d 2001:db8:2::/48 -j DROP
-A FORWARD -p 47 -s 2001:db8:3::/64 -j DROP
-A FORWARD -d ::/1 -j DROP
COMMIT
"""
TAG = "dual_stack_w256"
# next-header values ipv6_find_hdr steps over: a frame "of" such a protocol would be a chain, not a header
EXT_HEADERS = frozenset({0, 43, 44, 51, 60})


def plans():
    """(IPv4 plan, IPv6 plan) of the policies above, as the compiler builds them."""
    cfg = Config()
    return build_plan(parse_policy(V4_RULES, "v4.rules"), cfg), build_plan(
        parse_policy(V6_RULES, "v6.rules", family=6), cfg
    )


# ---------------------------------------------------------------- IPv6 frames and what the plans say of them


def frame6(h: Header, ext: str = "", rng: random.Random | None = None) -> bytes:
    """An IPv6 frame of header h (src/dst 128-bit) with scapy: optional extension headers before the upper layer
    ("dst": destination options, "rt": routing type 0 with no address, "ah": AH, "frag": a first fragment)."""
    ip = IPv6(src=str(ipaddress.IPv6Address(h.src)), dst=str(ipaddress.IPv6Address(h.dst)), hlim=64)
    if h.proto == 6:
        l4 = TCP(sport=h.sport, dport=h.dport, flags=h.tcp_flags, seq=rng.getrandbits(32) if rng else 1)
    elif h.proto == 17:
        l4 = UDP(sport=h.sport, dport=h.dport) / Raw(b"q3")
    elif h.proto == 58:
        l4 = Raw(bytes([h.icmp_type, h.icmp_code, 0, 0, 0, 0, 0, 0]))
    else:
        l4 = Raw(bytes(8))
    chain = {
        "": ip,
        "dst": ip / IPv6ExtHdrDestOpt(),
        "rt": ip / IPv6ExtHdrRouting(type=0, addresses=[]),
        "ah": ip / AH(nh=h.proto, payloadlen=2, spi=1, seq=1, icv=b"\0" * 4),
        "frag": ip / IPv6ExtHdrFragment(offset=0, m=1, id=7),
    }[ext]
    if ext == "ah":
        pkt = Ether(src="02:00:00:00:00:01", dst="02:00:00:00:00:02") / chain / l4
    else:
        last = chain.lastlayer() if ext else chain
        last.nh = h.proto
        pkt = Ether(src="02:00:00:00:00:01", dst="02:00:00:00:00:02") / chain / l4
    return bytes(pkt)


def _around(lo: int, hi: int, top: int) -> list[int]:
    return sorted({v for v in (lo - 1, lo, lo + 1, hi - 1, hi, hi + 1) if 0 <= v <= top})


def bound_headers(plan6, rng: random.Random) -> list[Header]:
    """For every box of every IPv6 entry, a header inside it, then that header with one field at a time moved to the
    box's bounds and one step beyond them (addresses: the 128-bit bounds the ranks stand for)."""
    amap = plan6.addr_map
    out = []
    tops = {n: ADDR_MAX[6] if n in ("src", "dst") else (1 << WIDTHS[n]) - 1 for n in FIELDS}
    for e in plan6.entries:
        for b in e.boxes:
            if b.is_empty():
                continue
            bounds = {}
            for name, lo, hi in zip(FIELDS, b.lo, b.hi, strict=True):
                if name in ("src", "dst"):
                    lo, hi = vhdl.unrank(amap, name, lo, hi)
                bounds[name] = (lo, hi)
            base = {n: rng.randint(lo, hi) if n not in ("ct",) else 0 for n, (lo, hi) in bounds.items()}
            if bounds["ct"][0] > 0:
                continue  # ct is 0 without an IPv6 flow cache: no frame reaches such a box
            flags = (b.flags_value | (rng.randrange(256) & ~b.flags_mask)) & 0xFF
            variants = [dict(base)]
            for name in ("src", "dst", "proto", "sport", "dport", "icmp_type", "icmp_code"):
                for v in _around(*bounds[name], tops[name]):
                    variants.append({**base, name: v})
            variants.append({**base, "flags": flags ^ b.flags_mask})
            out += [_header(v, v.pop("flags", flags)) for v in variants if v["proto"] not in EXT_HEADERS]
    return out


def _header(v: dict, flags: int) -> Header:
    """A header as a frame carries it: ports only for TCP/UDP, type/code only for ICMPv6, flags only for TCP."""
    v = dict(v)
    if v["proto"] not in (6, 17):
        v["sport"] = v["dport"] = 0
    if v["proto"] != 58:
        v["icmp_type"] = v["icmp_code"] = 0
    v["ct"] = 0
    return Header(**v, tcp_flags=flags if v["proto"] == 6 else 0)


def random_header6(rng: random.Random) -> Header:
    """Addresses near the policy's (2001:db8::/32, fe80::/10) or anywhere (beyond ::/1 too)."""

    def addr() -> int:
        r = rng.random()
        if r < 0.5:
            return (0x20010DB8 << 96) | (rng.randrange(4) << 80) | rng.getrandbits(rng.choice((4, 16, 64, 80)))
        if r < 0.6:
            return (0xFE80 << 112) | rng.getrandbits(64)
        return rng.getrandbits(128)

    proto = rng.choice((6, 6, 17, 17, 58, 47, 132))
    tcp_udp = proto in (6, 17)
    return Header(
        src=addr(),
        dst=addr(),
        proto=proto,
        sport=rng.choice((rng.getrandbits(16), 1000, 2000, 999, 2001)) if tcp_udp else 0,
        dport=rng.choice((rng.getrandbits(16), 22, 53)) if tcp_udp else 0,
        icmp_type=rng.choice((1, 128, rng.randrange(256))) if proto == 58 else 0,
        icmp_code=rng.choice((4, 0, 3)) if proto == 58 else 0,
        iport=rng.randrange(4),
        tcp_flags=rng.randrange(256) if proto == 6 else 0,
    )


def frames6(plan6, rng: random.Random) -> list[tuple[bytes, int, Header | None]]:
    """(frame, tuser, header or None when the core must leave it unparsed): the bounds' headers, random ones, the
    same behind a destination-options or routing header (parsed), and behind AH or a fragment header (unparsed)."""
    hs = bound_headers(plan6, rng) + [random_header6(rng) for _ in range(60)]
    out = []
    for h in hs:
        r = rng.random()
        ext = "" if r < 0.7 else "dst" if r < 0.8 else "rt" if r < 0.85 else "ah" if r < 0.93 else "frag"
        f = frame6(h, ext, rng)
        out.append((f, tuser_for(f, PORT_OF_IPORT[h.iport]), None if ext in ("ah", "frag") else h))
    return out


def expect6(
    plan4, plan6, h: Header | None, src_port: int, tuser: int, regs: hwmodel.Regs, ct: int = 0
) -> hwmodel.Decision:
    """The core's decision for an IPv6 frame (h: its header, None: unparsed), from the plans: the hardware index is
    v6_base + the IPv6 plan's first entry holding the header's address ranks and `ct` (its policy entry when none).
    `ct` as the core gives it (0 without a flow cache and a conntrack membership structure; 1/2 a flow cache hit; 3
    no conntrack entry): at ct 3 the row's bit comes from `regs.shunt_none` (SHUNT_NONE), and the IPv6 side's miss
    forcing takes an ACCEPT at ct 0 or 3 (bit 6), a DROP at ct 0 (bit 7), as hwmodel.decide's bits 4/5 do."""
    n4 = len(plan4.entries)
    gen = regs.generation & 0xFFFF
    shunt_port = src_port << 1
    if not regs.control & hwmodel.CONTROL_ENABLE:  # not judged: no index (docs/shim.md)
        meta = pack_meta(hwmodel.NO_INDEX, 0, hwmodel.REASON_UNPARSED, gen)
        return hwmodel.Decision(hwmodel.Kind.SHUNT, shunt_port, meta, None, 0, hwmodel.REASON_UNPARSED)
    if h is None:
        meta = pack_meta(n4, 0, hwmodel.REASON_UNPARSED, gen)
        return hwmodel.Decision(hwmodel.Kind.SHUNT, shunt_port, meta, n4, 0, hwmodel.REASON_UNPARSED)
    base = vhdl.v6_base(plan4)
    j = match_index(plan6, plan6.addr_map.header(dataclasses.replace(h, ct=ct)))
    idx = base + j
    action = regs.actions[idx] & 7
    reason = hwmodel.REASON_POLICY if j == len(plan6.entries) else hwmodel.REASON_OVERRULE
    meta = pack_meta(idx, action, reason, gen)
    bits = regs.shunt_none if ct == 3 and regs.shunt_none is not None else regs.shunt
    if bits[idx] or action not in (1, 2) or regs.control & hwmodel.CONTROL_SHUNT_ALL:
        return hwmodel.Decision(hwmodel.Kind.SHUNT, shunt_port, meta, idx, action, reason)
    # the IPv6 side's miss forcing (CONTROL bits 6/7), never the IPv4 side's bits 4/5
    if action == 1:
        forced = hwmodel.CONTROL_MISS_SHUNT6_ACCEPT if ct in (0, 3) else 0
    else:
        forced = hwmodel.CONTROL_MISS_SHUNT6_DROP if ct == 0 else 0
    if regs.control & forced:
        meta = pack_meta(idx, action, hwmodel.REASON_STATE, gen)
        return hwmodel.Decision(hwmodel.Kind.SHUNT, shunt_port, meta, idx, action, hwmodel.REASON_STATE)
    if action == 1:
        return hwmodel.Decision(hwmodel.Kind.FORWARD, hwmodel.PAIRED[src_port], None, idx, action, None)
    return hwmodel.Decision(hwmodel.Kind.DROP, 0, None, idx, action, None)


def _ipv6(f: bytes) -> bool:
    """Whether the IPv4 side's traffic generator made an IPv6 frame (its kernel-apart mix has some): those are this
    test's own frames' business, the IPv4 model calls every one unparsed."""
    et = f[12:14]
    return et == b"\x86\xdd" or (et in (b"\x81\x00", b"\x88\xa8") and f[16:18] == b"\x86\xdd")


def _parsed(plan4, x: tuple, regs: hwmodel.Regs) -> bool:
    """Whether a (frame, tuser, header) of the traffic is a wire frame the core classifies."""
    f, tu, h = x
    sp = (tu >> 16) & 0xFF
    if h == "v4":
        return hwmodel.decide(plan4, f, sp, regs).reason in (hwmodel.REASON_OVERRULE, hwmodel.REASON_POLICY)
    return h is not None and sp in hwmodel.PAIRED


# ---------------------------------------------------------------- cocotb test (runs inside GHDL)


@cocotb.test()
async def core_dual_stack(dut):
    """Shunt everything (every frame's match_index and reason visible), then the tables' verdicts, then a SHUNT
    and ACTION rewrite of IPv6 rows, then each family's miss forcing alone (CONTROL bits 4/5: IPv4 frames forced,
    IPv6 ones decided; bits 6/7: the reverse); every output frame and TUSER, the hit counters of every row."""
    cfg = load_obj("HF_TB_CFG")
    p4, p6, phases = cfg["plan4"], cfg["plan6"], cfg["phases"]
    n4, n6 = len(p4.entries), len(p6.entries)
    base = vhdl.v6_base(p4)
    rows = base + n6 + 1 + vhdl.buffer6_depth(p4, p6)  # the IPv6 buffer's slots' rows last (no slot enabled here)
    tb = TB(dut, cfg["seed"], idle=0.2, ready=0.7)
    await tb.reset(rows)
    ax, R = tb.axil, regmap
    assert await ax.read(R.REG_NUM_ENTRIES) == n4
    assert await ax.read(R.REG_IND_CONFIG) == rows
    assert await ax.read(R.REG_MATCHER_HASH) == int(vhdl.matcher_hash(p4, p6)[-8:], 16)
    regs = hwmodel.Regs.from_plan(p4)
    d6 = vhdl.buffer6_depth(p4, p6)
    regs.shunt = list(regs.shunt) + [int(b) for b in p6.shunt] + [1] * d6
    regs.actions = list(regs.actions) + list(action_words(p6)) + [0] * d6
    assert len(regs.shunt) == rows
    hits = [0] * rows
    expected, seen = [], {"v6_entries": set(), "v4": 0, "unparsed6": 0}
    forced = {3: [0, 0], 4: [0, 0]}  # phase -> [IPv4, IPv6] frames shunted by miss forcing (reason 3)
    decided6 = {3: 0, 4: 0}
    for phase, frames in enumerate(phases):
        if phase == 0:
            regs.control = hwmodel.CONTROL_ENABLE | hwmodel.CONTROL_SHUNT_ALL
        elif phase == 1:
            regs.control = hwmodel.CONTROL_ENABLE
        elif phase == 2:  # the IPv6 rows are rows like any other: flip actions, shunt some
            rng = random.Random(cfg["seed"])
            for i in range(base, rows):
                a = regs.actions[i] & 7
                regs.actions[i] = 3 - a if a in (1, 2) else 1
                await ax.table_access(R, R.TABLE_ACTION, i, regs.actions[i])
            for w in range(base // 32, (rows + 31) // 32):
                for i in range(max(32 * w, base), min(32 * w + 32, rows)):
                    regs.shunt[i] = rng.randrange(2)
                word = sum(b << k for k, b in enumerate(regs.shunt[32 * w : 32 * w + 32]))
                await ax.table_access(R, R.TABLE_SHUNT, w, word)
        elif phase == 3:  # the IPv4 side reads conntrack, the IPv6 side does not
            regs.control = hwmodel.CONTROL_ENABLE | hwmodel.CONTROL_MISS_SHUNT
        elif phase == 4:  # the reverse
            regs.control = hwmodel.CONTROL_ENABLE | hwmodel.CONTROL_MISS_SHUNT6
        await ax.write(R.REG_CONTROL, regs.control)
        if phase == 0:  # the latency probes first: a parsed IPv4 frame, a parsed IPv6 frame
            frames = list(frames)
            for fam in ("v6", "v4"):
                k = next(k for k, x in enumerate(frames) if _parsed(p4, x, regs) and (x[2] == "v4") == (fam == "v4"))
                frames.insert(0, frames.pop(k))
        for f, tu, h in frames:
            sp = (tu >> 16) & 0xFF
            if h == "v4":
                d = hwmodel.decide(p4, f, sp, regs)
                seen["v4"] += 1
            else:
                d = expect6(p4, p6, h, sp, tu, regs)
                if h is None:
                    seen["unparsed6"] += 1
                else:
                    seen["v6_entries"].add(d.match_index)
            if d.match_index is not None and d.reason != hwmodel.REASON_UNPARSED and sp in hwmodel.PAIRED:
                hits[d.match_index] += 1
            if phase in forced and d.reason == hwmodel.REASON_STATE:
                forced[phase][h != "v4"] += 1
            if phase in forced and h not in ("v4", None) and d.kind != hwmodel.Kind.SHUNT:
                decided6[phase] += 1
            if d.kind != hwmodel.Kind.DROP:
                expected.append((f, hwmodel.out_tuser(tu, d), d))
        if phase == 0:
            # latency of a lone frame through an empty core, no back-pressure: the parser gives either family's
            # header in the same cycle and the matcher has one shape, so both take the same number of cycles
            tb.src.idle, tb.sink.ready = 0.0, 1.0
            lat = []
            for k in range(2):
                await tb.src.send([frames[k][:2]])
                await tb.wait_out(k + 1)
                lat.append(tb.sink.frames[-1][2] - tb.src.accepted_first[-1])
            dut._log.info("RESULT latency_cycles IPv4 %d IPv6 %d (lone frame, empty core, 256 bits)", *lat)
            assert lat[0] == lat[1], lat
            tb.src.idle, tb.sink.ready = 0.2, 0.7
            frames = frames[2:]
        await tb.src.send([(f, tu) for f, tu, _ in frames])
        for _ in range(20000):
            if len(tb.sink.frames) >= len(expected):
                break
            await ClockCycles(dut.axis_aclk, 1)
        await ClockCycles(dut.axis_aclk, 100)
        # in order, each as the plans say (the first that differs named, with what was expected of it)
        for k, ((f, tu, d), (got, gtu, _)) in enumerate(zip(expected, tb.sink.frames, strict=False)):
            what = f"phase {phase}, frame {k}: {d.kind.name}, index {d.match_index}, reason {d.reason}"
            assert got == f, f"{what}: another frame came out ({got[:60].hex()})"
            assert gtu == tu, f"{what}: tuser {gtu:#x} != {tu:#x} ({f.hex()})"
        assert len(tb.sink.frames) == len(expected), f"phase {phase}: {len(tb.sink.frames)} frames out"
    for i in range(rows):
        assert await ax.table_access(R, R.TABLE_HITS, i) == hits[i], f"HITS[{i}]"
    # every IPv6 entry and the IPv6 policy entry decided some frame; AH and fragments were met
    assert seen["v6_entries"] >= set(range(base, base + n6 + 1)), sorted(seen["v6_entries"])
    assert seen["unparsed6"] > 0 and seen["v4"] > 0
    # each family's miss forcing met frames of its own family only
    assert forced[3][0] > 0 and forced[3][1] == 0 and decided6[3] > 0, (forced, decided6)
    assert forced[4][0] == 0 and forced[4][1] > 0 and decided6[4] == 0, (forced, decided6)
    await ClockCycles(dut.axis_aclk, 10)
    dut._log.info("core_dual_stack: %d frames out of %s", len(expected), [len(p) for p in phases])


# ---------------------------------------------------------------- pytest entry


@pytest.mark.sim
def test_core_dual_stack():
    """core_dual_stack on a core generated from a small dual-stack compile (256 bits)."""
    p4, p6 = plans()
    out = SIM_BUILD / "hypafilter_core" / TAG
    if out.exists():
        shutil.rmtree(out)
    gen = out / "gen"
    vhdl.render(p4, gen, tdata_width=256, plan6=p6)
    rng = random.Random(25)
    phases = []
    for k in range(5):
        v6 = frames6(p6, rng) if k == 0 else rng.sample(frames6(p6, rng), 120)
        v4 = [(f, t, "v4") for f, t in frames_for(p4, rng, 150 if k == 0 else 60) if not _ipv6(f)]
        mix = v6 + v4
        rng.shuffle(mix)
        phases.append(mix)
    cfg = save_obj({"plan4": p4, "plan6": p6, "phases": phases, "seed": 25}, out / "cfg.pkl")
    run_ghdl(
        "hypafilter_core",
        vhdl.sources(gen),
        TAG,
        {"C_S_AXIS_DATA_WIDTH": 256, "C_FIFO_DEPTH_BYTES": FIFO_BYTES},
        env={"HF_TB_CFG": str(cfg)},
        testcase="core_dual_stack",
        test_module="test_core_ipv6",
        build_args=["-O0"],
    )


def test_dual_stack_rows_follow_ipv4():
    """The IPv6 rows follow the IPv4 entries, the IPv4 policy entry and the buffer's slots (no GHDL)."""
    p4, p6 = plans()
    assert vhdl.v6_base(p4) == len(p4.entries) + 1 + p4.buffer_depth
    m = vhdl.matcher_source(p4, p6)
    assert [i for i, _, _, _ in m["rows"]] == list(range(len(p4.entries))) + [
        vhdl.v6_base(p4) + j for j in range(len(p6.entries))
    ]
    # the IPv6 entries are masked by the IPv6 update buffer's VALID6 (local bit j), the IPv4 ones by VALID
    base = vhdl.v6_base(p4)
    assert all((v, k) == (i - base, "valid6") for i, _, v, k in m["rows"] if i >= base)
    assert all((v, k) == (i, "valid") for i, _, v, k in m["rows"] if i < base)
    assert vhdl.matcher_hash(p4, p6) != vhdl.matcher_hash(p4)
