"""Testbench of hypafilter_core built with a flow cache (FC_LOG2_SETS > 0): hits in both directions reach the matcher
with ct 1/2, misses and SYN/FIN/RST bypass frames have ct 0, flows beyond the ways of a set are refused (full) and
miss, deletions (by key and by slot) and inserts while frames stream, back-pressure, the FC_* registers and the
FLOW_KEY/FLOW_SEEN/FLOW_HITS tables through the indirect interface, and CONTROL bits 4/5 (a miss whose decision is
ACCEPT/DROP shunted with reason 3, CNT_SHUNT_STATE).

Expected decisions: hwmodel.decide with the frame's ct (the cache model below) and the CONTROL bits. Expected sets and
slots come from hypafilter.hw.flowcache (the flow cache's Python reference)."""

from __future__ import annotations

import random
from collections import Counter

import cocotb
import pytest
from cocotb.triggers import ClockCycles, ReadOnly, RisingEdge
from hypafilter.hw import flowcache as fc
from hypafilter.hw import model as hwmodel
from hypafilter.hw import regmap as R
from hypafilter.hw import vhdl
from hypafilter.hw.flowcache import Flow
from hypafilter.ir import Box, Header, Policy, Rule

from conftest import TEST_FULL, need_tool
from sim.hftb import fresh_build, header_frame, load_obj, run_ghdl, save_obj, tuser_for
from sim.hftraffic import PORT_OF_IPORT
from sim.hypafilter_core.test_hypafilter_core import TB

LOG2_SETS, WAYS, TS_W, TICK = 10, 4, 32, 16
MISS_ACCEPT, MISS_DROP = hwmodel.CONTROL_MISS_SHUNT_ACCEPT, hwmodel.CONTROL_MISS_SHUNT_DROP
BYPASS_FLAGS = (0x02, 0x01, 0x04, 0x12, 0x11, 0x00, 0x08, 0x28)  # SYN, FIN, RST, with ACK; no ACK: -, PSH, PSH+URG
ACK = 0x10


def flow_policy() -> Policy:
    """Every header gets a hardware verdict (no complex rule): ACCEPT and DROP both reachable in both directions."""
    full = Box.full()
    tcp, udp = full.with_field("proto", 6, 6), full.with_field("proto", 17, 17)
    rules = [
        Rule((tcp.with_field("dport", 80, 80),), "ACCEPT"),
        Rule((tcp.with_field("dport", 22, 22),), "DROP"),
        Rule((udp.with_field("dport", 53, 53),), "ACCEPT"),
        Rule((udp.with_field("sport", 5000, 5999),), "DROP"),
        Rule((full.with_field("src", 0x0A000000, 0x0AFFFFFF),), "ACCEPT"),
    ]
    return Policy(rules, "DROP", original_rules=[("flow cache test",)])


def header_of(flow: Flow, iport: int, flags: int = ACK) -> Header:
    return Header(flow.src, flow.dst, flow.proto, flow.sport, flow.dport, 0, 0, iport, flags if flow.proto == 6 else 0)


class CacheModel:
    """The entries as the host made them (hypafilter.hw.flowcache's key, set and slot; lowest free way first)."""

    def __init__(self):
        self.slot_of: dict[int, int] = {}  # canonical key -> slot
        self.orient: dict[int, int] = {}  # canonical key -> orientation bit of the inserted flow
        self.used: set[int] = set()
        self.inserts = self.deletes = self.full = 0
        self.closing: dict[int, int] = {}  # canonical key -> FINs passed (an RST: 2); at 2 the entry never hits
        self.touched: set[int] = set()  # keys whose entry a FIN/RST passed (its stats word written: counted)
        self.busy: set[int] = set()  # sets host commands write while the frames pass: no FIN/RST sent there

    def insert(self, flow: Flow) -> tuple[int, int]:
        key, swap = fc.canonical(flow)
        if key in self.slot_of:
            return fc.ST_EXISTS, self.slot_of[key]
        s = fc.set_index(key, LOG2_SETS)
        for way in range(WAYS):
            slot = fc.slot(way, s, LOG2_SETS)
            if slot not in self.used:
                self.used.add(slot)
                self.slot_of[key], self.orient[key] = slot, swap
                self._forget(key)
                self.inserts += 1
                return fc.ST_OK, slot
        self.full += 1
        return fc.ST_FULL, 0

    def delete(self, flow: Flow) -> int:
        key, _ = fc.canonical(flow)
        slot = self.slot_of.pop(key)
        self.orient.pop(key)
        self._forget(key)
        self.used.discard(slot)
        self.deletes += 1
        return slot

    def delete_probe(self) -> int:
        """A slot that holds no entry."""
        return next(s for s in range(WAYS << LOG2_SETS) if s not in self.used)

    def _forget(self, key: int) -> None:
        self.closing.pop(key, None)
        self.touched.discard(key)

    def ct(self, h: Header, l4_ok: bool = True) -> int:
        """The frame's ct: 0 unknown (miss, bypass, not TCP/UDP, a closed entry), 1 original direction, 2 reply.
        Then the frame passes: a TCP FIN or RST of a cached flow counts towards closing its entry (hf_flow_cache's
        header; never sent to a busy set, where a host write may make the hardware miss the FIN)."""
        key, swap = fc.canonical(Flow(h.src, h.dst, h.proto, h.sport, h.dport))
        out = 0
        if h.proto in (6, 17) and not fc.bypass(h.proto, h.tcp_flags, l4_ok) and key in self.slot_of:
            out = 0 if self.closing.get(key, 0) >= 2 else 1 + fc.direction(swap, self.orient[key])
        if h.proto == 6 and h.tcp_flags & 0x05 and key in self.slot_of:
            assert fc.set_index(key, LOG2_SETS) not in self.busy, "a FIN/RST sent to a set a command writes"
            self.closing[key] = 2 if h.tcp_flags & 0x04 else min(2, self.closing.get(key, 0) + 1)
            self.touched.add(key)
        return out


def key_of(h: Header) -> int:
    return fc.canonical(Flow(h.src, h.dst, h.proto, h.sport, h.dport))[0]


class FcTB(TB):
    async def fc_command(self, op: int, flow: Flow | None = None, slot: int = 0) -> tuple[int, int]:
        ax = self.axil
        if flow is not None:
            for reg, v in zip(("FC_KEY0", "FC_KEY1", "FC_KEY2", "FC_KEY3"), fc.fc_key_regs(flow), strict=True):
                await ax.write(R.MAP.reg(reg).offset, v)
        await ax.write(R.REG_FC_SLOT, slot)
        await ax.write(R.REG_FC_CMD, op)
        for _ in range(1000):
            st = await ax.read(R.REG_FC_STATUS)
            if not st >> 31:
                return (st >> 24) & 0xF, st & 0xFFFFFF
        raise AssertionError("FC_STATUS stays busy")

    async def flow_words(self, slot: int) -> tuple[tuple[int, ...], int, int]:
        words = tuple([await self.axil.table_access(R, R.TABLE_FLOW_KEY, slot * 4 + w) for w in range(4)])
        seen = await self.axil.table_access(R, R.TABLE_FLOW_SEEN, slot)
        hits = await self.axil.table_access(R, R.TABLE_FLOW_HITS, slot)
        return words, seen, hits


@cocotb.test()
async def core_flow_cache(dut):
    cfg = load_obj("HF_TB_CFG")
    plan, seed, rtl = cfg["plan"], cfg["seed"], cfg["rtl"]
    n = len(plan.entries)
    tb = FcTB(dut, seed, idle=0.2, ready=0.7)
    await tb.reset(n)
    ax, rng = tb.axil, random.Random(seed)
    assert await ax.read(R.REG_FC_CONFIG) == fc.fc_config(LOG2_SETS, WAYS, TS_W)
    assert await ax.read(R.REG_FC_OCCUPANCY) == 0
    control, gen = hwmodel.CONTROL_ENABLE | MISS_ACCEPT | MISS_DROP, 0x77
    await ax.write(R.REG_CONTROL, control)
    await ax.write(R.REG_GENERATION, gen)
    base_regs = hwmodel.Regs.from_plan(plan)
    base_regs.generation = gen
    cache = CacheModel()
    counters = hwmodel.Counters(n)
    flow_hits: Counter = Counter()  # canonical key -> hits counted by the cache
    ct_seen: Counter = Counter()  # (src, dst, sport, dport, ct) at the matcher's ports, ct != 0 (RTL only)
    ct_want: Counter = Counter()

    if rtl:  # the matcher's h_ct port, sampled every cycle: each hit is one cycle with ct != 0, aligned with its header

        async def watch_ct():
            m = dut.matcher
            while True:
                await RisingEdge(dut.axis_aclk)
                await ReadOnly()
                ct = int(m.h_ct.value)
                if ct:
                    v = (int(m.h_src.value), int(m.h_dst.value), int(m.h_sport.value), int(m.h_dport.value), ct)
                    ct_seen[v] += 1

        cocotb.start_soon(watch_ct())

    def expect(h: Header, ctl: int, uncertain: bool = False, bad_l4: bool = False):
        """(frame, tuser, variants): variants = [(decision, ct)], two for a frame sent while its flow is deleted;
        `bad_l4`: a TCP data offset or UDP length field that conntrack calls INVALID (never a hit)."""
        f = header_frame(h, rng)
        if bad_l4:
            b = bytearray(f)
            l4 = 14 + (b[14] & 0xF) * 4
            if h.proto == 6:
                b[l4 + 12] = rng.choice((0, 4, 15)) << 4
            else:
                b[l4 + 4 : l4 + 6] = rng.choice((0, 7, len(b) - l4 + 1)).to_bytes(2, "big")
            f = bytes(b)
        sp = PORT_OF_IPORT[h.iport]
        tu = tuser_for(f, sp)
        regs = hwmodel.Regs(base_regs.shunt, base_regs.actions, gen, ctl)
        cts = [cache.ct(h, hwmodel.l4_ok(f))] + ([0] if uncertain else [])
        return f, tu, sp, h, [(hwmodel.decide(plan, f, sp, regs, ct=c), c) for c in cts]

    async def run(items, ready: float = 0.7, idle: float = 0.2, during=None) -> list:
        """Send the frames (while `during` runs, if given), check every output frame; the chosen variants."""
        tb.sink.ready, tb.src.idle = ready, idle
        tb.sink.frames.clear()
        sender = cocotb.start_soon(tb.src.send([(f, tu) for f, tu, *_ in items]))
        if during is not None:
            await during()
        await sender
        want_out = sum(1 for *_, v in items if v[0][0].kind != hwmodel.Kind.DROP)
        await tb.wait_out(want_out)
        chosen, k = [], 0
        for f, tu, sp, h, variants in items:
            if variants[0][0].kind == hwmodel.Kind.DROP:
                assert len(variants) == 1
                d, c = variants[0]
            else:
                got, gtu, _ = tb.sink.frames[k]
                k += 1
                assert got == f, f"frame {k - 1}: data differs"
                match = [(d, c) for d, c in variants if hwmodel.out_tuser(tu, d) == gtu]
                assert match, f"frame {k - 1} {h}: tuser {gtu:#x}, expected one of " + ", ".join(
                    f"{hwmodel.out_tuser(tu, d):#x} (ct {c}, {d})" for d, c in variants
                )
                d, c = match[0]
            counters.add(d, sp)
            if c:
                flow_hits[key_of(h)] += 1
                ct_want[(h.src, h.dst, h.sport, h.dport, c)] += 1
            chosen.append(c)
        return chosen

    def rand_flow(proto: int | None = None) -> Flow:
        proto = proto or rng.choice((6, 17))
        src = rng.choice((0x0A000000 | rng.getrandbits(24), 0xC0A80000 | rng.getrandbits(16)))
        dst = 0xC0A80000 | rng.getrandbits(16)
        dport = rng.choice((80, 22, 443) if proto == 6 else (53, 123, 4000))
        sport = rng.choice((rng.randrange(1024, 65536), rng.randrange(5000, 6000)))
        return Flow(src, dst, proto, sport, dport)

    # -- inserts: slots as the reference computes them; a duplicate exists; find answers the slot
    flows = [rand_flow() for _ in range(48)]
    for fl in flows:
        assert await tb.fc_command(fc.OP_INSERT, fl) == cache.insert(fl), fl
    assert await tb.fc_command(fc.OP_INSERT, flows[0].reply()) == (
        fc.ST_EXISTS,
        cache.slot_of[fc.canonical(flows[0])[0]],
    )
    assert await tb.fc_command(fc.OP_FIND, flows[3].reply()) == (fc.ST_OK, cache.slot_of[fc.canonical(flows[3])[0]])
    assert (await tb.fc_command(fc.OP_FIND, rand_flow()))[0] == fc.ST_NOT_FOUND
    assert (await tb.fc_command(fc.OP_READ, slot=WAYS << LOG2_SETS))[0] == fc.ST_BAD
    assert (await tb.fc_command(7))[0] == fc.ST_BAD
    # -- collisions: WAYS + 2 flows of one set; the last two are refused and miss
    target = fc.set_index(fc.canonical(flows[5])[0], LOG2_SETS)
    crowd = []
    while len(crowd) < WAYS + 2:
        fl = rand_flow()
        if fc.set_index(fc.canonical(fl)[0], LOG2_SETS) == target:
            crowd.append(fl)
    for fl in crowd:
        assert await tb.fc_command(fc.OP_INSERT, fl) == cache.insert(fl), fl
    overflow = [fl for fl in crowd if fc.canonical(fl)[0] not in cache.slot_of]
    assert len(overflow) >= 2 and cache.full >= 2
    assert await ax.read(R.REG_FC_OCCUPANCY) == len(cache.slot_of)

    # -- hits both ways, misses, bypass frames, other protocols; then heavy back-pressure and back-to-back frames
    def traffic(count: int, ctl: int, kept: list[Flow]) -> list:
        items = []
        for _ in range(count):
            r = rng.random()
            if r < 0.55:
                fl = rng.choice(kept)
                fl = fl if rng.random() < 0.5 else fl.reply()
                h = header_of(fl, rng.randrange(4))
            elif r < 0.65:  # bypass flags, FIN and RST among them (they close the entry: never in a busy set)
                calm = [f for f in kept if fc.set_index(fc.canonical(f)[0], LOG2_SETS) not in cache.busy]
                fl = rng.choice([f for f in calm if f.proto == 6] or calm)
                h = header_of(fl if rng.random() < 0.5 else fl.reply(), rng.randrange(4), rng.choice(BYPASS_FLAGS))
            elif r < 0.7:  # a cached flow's frame with a length conntrack calls INVALID
                fl = rng.choice(kept)
                items.append(
                    expect(header_of(fl if rng.random() < 0.5 else fl.reply(), rng.randrange(4)), ctl, bad_l4=True)
                )
                continue
            elif r < 0.85:
                h = header_of(rng.choice(overflow) if rng.random() < 0.4 else rand_flow(), rng.randrange(4))
            else:
                fl = rng.choice(kept)
                h = Header(
                    fl.src, fl.dst, rng.choice((1, 47)), 0, 0, 8 if rng.random() < 0.5 else 0, 0, rng.randrange(4)
                )
            items.append(expect(h, ctl))
        return items

    items = traffic(400, control, flows)
    got = await run(items)
    assert 1 in got and 2 in got and 0 in got, "traffic without hits of both directions and misses"
    assert await run(traffic(150, control, flows), ready=0.25, idle=0.0)
    assert await run(traffic(150, control, flows), ready=1.0, idle=0.0)

    # -- host commands while frames stream: inserts of new flows, deletes by key and by slot, table reads
    doomed = [
        fl for fl in flows if expect(header_of(fl, 0), control & ~MISS_DROP)[4][0][0].kind == hwmodel.Kind.FORWARD
    ]
    doomed = doomed[:6]
    assert len(doomed) >= 4, "too few flows with an ACCEPT verdict to delete"
    kept = [fl for fl in flows if fl not in doomed]
    fresh = [rand_flow() for _ in range(8)]
    cache.busy = {fc.set_index(fc.canonical(fl)[0], LOG2_SETS) for fl in doomed + fresh}
    items = traffic(500, control, kept)
    cache.busy = set()
    for k in range(0, len(items), 6):  # frames of the doomed flows all through: each a hit, until it is deleted
        fl = doomed[(k // 6) % len(doomed)]
        items.insert(k, expect(header_of(fl, rng.randrange(4)), control, uncertain=True))

    async def commands():
        await ClockCycles(dut.axis_aclk, 200)
        for i, fl in enumerate(doomed):
            slot = cache.delete(fl)
            if i % 2:
                assert await tb.fc_command(fc.OP_DELETE, fl.reply() if i % 4 == 1 else fl) == (fc.ST_OK, slot)
            else:
                assert await tb.fc_command(fc.OP_DELETE_SLOT, slot=slot) == (fc.ST_OK, slot)
            words, _, _ = await tb.flow_words(slot)
            assert words[3] >> 31 == 0, f"slot {slot} still valid after its delete"
        for fl in fresh:  # not in this traffic: nothing in flight depends on them
            assert await tb.fc_command(fc.OP_INSERT, fl) == cache.insert(fl)
        assert (await tb.fc_command(fc.OP_DELETE, doomed[0]))[0] == fc.ST_NOT_FOUND
        assert (await tb.fc_command(fc.OP_DELETE_SLOT, slot=cache.delete_probe()))[0] == fc.ST_NOT_FOUND

    chosen = await run(items, during=commands)
    # each doomed flow: hits, then misses once its delete is done (never a hit after a miss)
    for fl in doomed:
        key = fc.canonical(fl)[0]
        seq = [c for it, c in zip(items, chosen, strict=True) if len(it[4]) == 2 and key_of(it[3]) == key]
        assert seq == sorted(seq, key=lambda c: c == 0), f"{fl}: a hit after a miss ({seq})"
    # after the commands: the doomed flows miss, the fresh ones hit; in host mode the hits are delivered (reason 5)
    ctl = hwmodel.CONTROL_ENABLE | hwmodel.CONTROL_HOST_MODE | MISS_ACCEPT
    await ax.write(R.REG_CONTROL, ctl)
    last = [expect(header_of(fl if rng.random() < 0.5 else fl.reply(), rng.randrange(4)), ctl) for fl in doomed + fresh]
    last += traffic(100, ctl, kept + fresh)
    got = await run(last, ready=0.5)
    assert all(c == 0 for c in got[: len(doomed)]) and all(got[len(doomed) : len(doomed) + len(fresh)])

    # -- registers and tables
    assert await ax.read(R.REG_FC_OCCUPANCY) == len(cache.slot_of)
    assert await ax.read(R.REG_FC_INSERTS) == cache.inserts
    assert await ax.read(R.REG_FC_DELETES) == cache.deletes
    assert await ax.read(R.REG_FC_FULL) == cache.full
    now = await ax.read(R.REG_FC_NOW)
    assert now > 0
    for key, slot in cache.slot_of.items():
        words, seen, hits = await tb.flow_words(slot)
        counted = flow_hits[key] > 0 or key in cache.touched  # a FIN/RST writes the stats word too
        assert words == fc.flow_key_words(fc.key_word(key, cache.orient[key]), counted), f"FLOW_KEY of {slot}"
        assert hits == flow_hits[key], f"FLOW_HITS of slot {slot}: {hits} != {flow_hits[key]}"
        hit = flow_hits[key] > 0
        assert (seen == 0) if not hit else 0 < seen <= now, f"FLOW_SEEN of slot {slot}: {seen} (now {now})"
    for name in [r.name for r in R.MAP.registers if r.name.startswith("CNT_")] + ["PKTIN", "PKTOUT"]:
        assert await ax.read(R.MAP.reg(name).offset) == counters.regs.get(name, 0), name
    assert counters.regs.get("CNT_SHUNT_STATE", 0) > 0
    for i in range(n + 1):
        assert await ax.table_access(R, R.TABLE_HITS, i) == counters.hits[i], f"HITS[{i}]"
    if rtl:
        assert ct_seen == ct_want, f"ct at the matcher: {ct_seen - ct_want} unexpected, {ct_want - ct_seen} missing"
    # -- clear: every flow misses; the counters of the cache keep their values except the occupancy
    assert await tb.fc_command(fc.OP_CLEAR) == (fc.ST_OK, 0)
    assert await ax.read(R.REG_FC_OCCUPANCY) == 0
    cache = CacheModel()
    got = await run([expect(header_of(fl, rng.randrange(4)), ctl) for fl in kept[:10]])
    assert not any(got)
    dut._log.info("core_flow_cache: counters %s, flow hits %d", counters.regs, sum(flow_hits.values()))


# ---------------------------------------------------------------- the pytest side

FC_GENERICS = {"FC_LOG2_SETS": LOG2_SETS, "FC_WAYS": WAYS, "FC_TICK_CYCLES": TICK}


def _cfg(out, rtl: bool):
    plan = vhdl.minimal_plan(flow_policy())
    return plan, save_obj({"plan": plan, "seed": 21, "rtl": rtl}, out / "cfg.pkl")


@pytest.mark.sim
@pytest.mark.parametrize("width", [256, pytest.param(512, marks=TEST_FULL)])
def test_core_flow_cache(width):
    out = fresh_build("hypafilter_core", f"flow_cache_w{width}")
    plan, cfg = _cfg(out, rtl=True)
    vhdl.render(plan, out / "gen", tdata_width=width)
    run_ghdl(
        "hypafilter_core",
        vhdl.sources(out / "gen"),
        f"flow_cache_w{width}",
        {"C_S_AXIS_DATA_WIDTH": width, "C_FIFO_DEPTH_BYTES": 4096, **FC_GENERICS},
        env={"HF_TB_CFG": str(cfg)},
        testcase="core_flow_cache",
        test_module="test_core_flow_cache",
    )


@TEST_FULL  # make test-full
@pytest.mark.sim
def test_core_flow_cache_postsynth():
    """The GHDL netlist of the core with its flow cache passes the same test (no internal signals watched)."""
    need_tool("ghdl")
    from sim.hypafilter_core.test_postsynth import synth_netlist

    out = fresh_build("hypafilter_core", "flow_cache_postsynth")
    plan, cfg = _cfg(out, rtl=False)
    sources = synth_netlist(plan, out / "synth", 256, generics=FC_GENERICS)
    run_ghdl(
        "hypafilter_core",
        sources,
        "flow_cache_postsynth_run",
        {},
        env={"HF_TB_CFG": str(cfg)},
        testcase="core_flow_cache",
        test_module="test_core_flow_cache",
    )
