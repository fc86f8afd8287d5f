"""Testbench of hf_flow_cache: lookups at up to one per cycle (with idle gaps) checked result by result against a
Python model built on hypafilter.hw.flowcache (canonical key, CRC-32 set, slots, stored words): hits in both
directions, misses, SYN/FIN/RST bypass, full sets, host commands (insert, delete by key and slot, find, read,
clear) under continuous traffic, last-seen times and hit counters exact, back-to-back hits on one slot, reset."""

from __future__ import annotations

import os
import random
from collections import deque

import cocotb
import pytest
from cocotb.clock import Clock
from cocotb.triggers import ClockCycles, ReadOnly, RisingEdge
from hypafilter.hw import flowcache as fc
from hypafilter.hw.flowcache import Flow

from conftest import TEST_FULL
from sim.hftb import handshake, hw, run_ghdl

LOOKUP_PORTS = ("lk_src_ip", "lk_dst_ip", "lk_proto", "lk_sport", "lk_dport", "lk_tcp_flags", "lk_l4_ok")
HOST_PORTS = ("h_op", "h_src_ip", "h_dst_ip", "h_proto", "h_sport", "h_dport", "h_slot")
STAT_EPOCH: dict[int, int] = {}  # slot -> epoch of its stats word since the last reset sweep (which zeroes them)


def generics(dut) -> tuple[int, int, int]:
    """LOG2_SETS, WAYS, TS_W: from the generics, or for a synthesised netlist (which has none) from HF_FC_GENERICS."""
    if "HF_FC_GENERICS" in os.environ:
        return tuple(int(x) for x in os.environ["HF_FC_GENERICS"].split(","))
    return int(dut.LOG2_SETS.value), int(dut.WAYS.value), int(dut.TS_W.value)


class Model:
    """The cache as the host sees it: key words per (set, way), statistics per slot, counters."""

    def __init__(self, log2_sets: int, ways: int, ts_w: int):
        self.log2_sets, self.ways, self.ts_mask = log2_sets, ways, (1 << ts_w) - 1
        self.stat_epoch = STAT_EPOCH  # only a reset clears the stats words (not a clear, not a new cocotb test)
        self.empty()
        self.inserts = self.deletes = self.full = 0

    def empty(self) -> None:
        self.words: dict[int, int] = {}  # slot -> key word of a valid entry
        self.slots: dict[int, int] = {}  # canonical key -> slot
        self.stats: dict[int, tuple[int, int]] = {}  # slot -> (seen, hits) once hit (or passed a FIN/RST)
        self.closing: dict[int, int] = {}  # slot -> FINs passed (an RST: 2); at 2 the entry no longer hits
        self.unknown: set[int] = set()  # slots a FIN/RST may or may not have reached (it met a command)

    def find(self, flow: Flow) -> int | None:
        return self.slots.get(fc.canonical(flow)[0])

    def set_of(self, flow: Flow) -> int:
        return fc.set_index(fc.canonical(flow)[0], self.log2_sets)

    def lookup(self, flow: Flow, flags: int, l4_ok: int = 1) -> tuple[int, int, int, int]:
        """(hit, bypass, dir, slot) the hardware must answer."""
        if fc.bypass(flow.proto, flags, bool(l4_ok)):
            return 0, 1, 0, 0
        key, swap = fc.canonical(flow)
        s = self.slots.get(key)
        if s is None or self.closing.get(s, 0) >= 2:
            return 0, 0, 0, 0
        return 1, 0, fc.direction(swap, fc.decode_word(self.words[s]).orient), s

    def close(self, flow: Flow, flags: int) -> None:
        """A TCP frame with FIN or RST of a cached flow: its entry's closing count (the header of hf_flow_cache)."""
        s = self.find(flow)
        if s is None:
            return
        self.closing[s] = 2 if flags & 0x04 else min(2, self.closing.get(s, 0) + 1)
        if s not in self.stats:  # a stats word of this entry now: counted, never hit
            self.stats[s] = (0, 0)
            self.stat_epoch[s] = fc.decode_word(self.words[s]).epoch

    def forget(self, s: int) -> None:
        self.stats.pop(s, None)
        self.closing.pop(s, None)
        self.unknown.discard(s)

    def hit(self, slot: int, ts: int) -> None:
        _, hits = self.stats.get(slot, (0, 0))
        self.stats[slot] = (ts & self.ts_mask, hits + 1)
        self.stat_epoch[slot] = fc.decode_word(self.words[slot]).epoch

    def insert(self, flow: Flow) -> tuple[int, int]:
        key, swap = fc.canonical(flow)
        if key in self.slots:
            return fc.ST_EXISTS, self.slots[key]
        set_ = fc.set_index(key, self.log2_sets)
        for way in range(self.ways):
            s = fc.slot(way, set_, self.log2_sets)
            if s not in self.words:
                self.words[s] = fc.key_word(key, swap, 1 - self.stat_epoch.get(s, 0))
                self.slots[key] = s
                self.forget(s)
                self.inserts += 1
                return fc.ST_OK, s
        self.full += 1
        return fc.ST_FULL, 0

    def delete_slot(self, s: int) -> int:
        if s not in self.words:
            return fc.ST_NOT_FOUND
        del self.slots[fc.decode_word(self.words.pop(s)).key]
        self.forget(s)
        self.deletes += 1
        return fc.ST_OK

    def read(self, s: int) -> tuple[int, int, int, int]:
        """(word, counted, seen, hits) of a slot; a free slot reads its old word with the valid bit clear, which the
        model does not keep, so only a valid entry's word is compared."""
        seen, hits = self.stats.get(s, (0, 0))
        return self.words.get(s, 0), int(s in self.stats), seen, hits


class TB:
    """Clock, reset, the lookup driver/checker and the host command master of one hf_flow_cache, with the model."""

    @classmethod
    async def running(cls, dut, seed: int) -> TB:
        """A TB out of reset with its lookup driver running."""
        tb = cls(dut, seed)
        await tb.reset()
        cocotb.start_soon(tb.lookups())
        return tb

    def __init__(self, dut, seed: int):
        self.dut, self.rng = dut, random.Random(seed)
        self.log2_sets, self.ways, ts_w = generics(dut)
        self.entries = self.ways << self.log2_sets
        self.m = Model(self.log2_sets, self.ways, ts_w)
        cocotb.start_soon(Clock(dut.clk, 4, units="ns").start())
        for s in ("rst", "lk_valid", "h_valid", "cnt_clear", *LOOKUP_PORTS, *HOST_PORTS):
            getattr(dut, s).value = 0
        self.flows: list[Flow] = []  # the traffic's flows (in the cache or not)
        self.rate = 0.0  # chance of a lookup per cycle
        self.burst = 0.3  # chance that a lookup repeats the previous flow (back-to-back hits on one slot)
        self.syn = 0.1  # chance of bypass flags on a TCP lookup; half of it: a bad length (l4_ok 0)
        self.fin = 0.01  # chance of a FIN or an RST on a TCP lookup (they close the flow's entry)
        self.fin_unsure: set[int] = set()  # canonical keys of FIN/RST frames that met a command on their set
        self.pending: deque = deque()  # (valid, flow, flags, l4_ok, ts) per cycle, oldest first
        self.unsure: set[int] = set()  # sets a host command is changing: a result there may be old, new or a miss
        self.all_unsure = False  # a clear is running
        self.checked = {"hit": 0, "miss": 0, "bypass": 0, "unsure": 0, "same_slot_b2b": 0, "close": 0}
        self.last_hit_slot = -1
        self.script: deque = deque()  # (flow, flags) looked up one per cycle before any random lookup
        self.scripted: list[tuple[int, int]] = []  # (hit, bypass) of each scripted lookup, in order
        self.early: dict[int, list[int]] = {}  # hits on a slot an insert under way has just written

    async def reset(self) -> None:
        """Reset with no lookup in flight; the cache empties (sweep: ready low for 2**LOG2_SETS cycles)."""
        rate, self.rate = self.rate, 0.0
        await ClockCycles(self.dut.clk, fc.LATENCY + 2)
        self.dut.rst.value = 1
        await ClockCycles(self.dut.clk, 2)
        self.dut.rst.value = 0
        self.m.empty()
        self.m.inserts = self.m.deletes = self.m.full = 0
        STAT_EPOCH.clear()  # the reset sweep zeroes every stats word
        await RisingEdge(self.dut.clk)
        await ReadOnly()
        assert not int(self.dut.ready.value) and not int(self.dut.h_ready.value), "ready during the sweep"
        assert int(self.dut.now.value) == 0, "the timestamp restarts at reset"
        self.rate = rate
        for _ in range((1 << self.log2_sets) + 10):
            await RisingEdge(self.dut.clk)
            await ReadOnly()
            if int(self.dut.ready.value):
                break
        else:
            raise AssertionError("the sweep never ended")
        await RisingEdge(self.dut.clk)

    def _pick(self, prev: Flow | None) -> tuple[Flow, int, int]:
        if prev is not None and self.rng.random() < self.burst:
            f = prev
        else:
            f = self.rng.choice(self.flows)
            if self.rng.random() < 0.5:
                f = f.reply()
        flags = 0x10  # ACK
        if f.proto == fc.PROTO_TCP and self.rng.random() < self.syn:
            flags = self.rng.choice((0x12, 0x02, 0x00, 0x08, 0x20, 0x28, 0xC0, 0x18))
        if f.proto == fc.PROTO_TCP and self.rng.random() < self.fin:
            flags = self.rng.choice((0x11, 0x19, 0x14, 0x01, 0x04))
        # a length conntrack calls INVALID (the parser's h_l4_ok), TCP or UDP alike
        return f, flags, int(self.rng.random() >= self.syn / 2)

    async def lookups(self) -> None:
        """A lookup in a cycle with chance `rate`; the result LATENCY cycles later equals the model's."""
        d = self.dut
        prev = None
        while True:
            await RisingEdge(d.clk)
            scripted = bool(self.script)
            v = scripted or (bool(self.flows) and self.rng.random() < self.rate)
            if scripted:
                f, flags = self.script.popleft()
                l4_ok = 1
            else:
                f, flags, l4_ok = self._pick(prev) if v else (Flow(0, 0, 0), 0, 1)
            prev = f if v else prev
            d.lk_valid.value = int(v)
            for port, val in zip(LOOKUP_PORTS, (f.src, f.dst, f.proto, f.sport, f.dport, flags, l4_ok), strict=True):
                getattr(d, port).value = val
            await ReadOnly()
            self.pending.append((v, f, flags, l4_ok, int(d.now.value), scripted))
            if len(self.pending) > fc.LATENCY:
                self.check(*self.pending.popleft())

    def check(self, v: bool, f: Flow, flags: int, l4_ok: int, ts: int, scripted: bool = False) -> None:
        d = self.dut
        assert int(d.res_valid.value) == int(v), "a result that is not LATENCY cycles after its lookup"
        if not v:
            return
        got = (int(d.res_hit.value), int(d.res_bypass.value), int(d.res_dir.value), int(d.res_slot.value))
        if scripted:
            self.scripted.append(got[:2])
        want = self.m.lookup(f, flags, l4_ok)
        if not got[0]:
            got = (*got[:2], 0, 0)
        set_unsure = self.all_unsure or self.m.set_of(f) in self.unsure
        if got != want:
            unsure = set_unsure and not want[1]
            ok = unsure and (not got[0] or fc.way_set(got[3], self.log2_sets)[1] == self.m.set_of(f))
            # an entry a FIN/RST may have closed: a hit of it, or a miss
            s = self.m.find(f)
            ok = ok or (s in self.m.unknown and not want[1] and (not got[0] or got[3] == s))
            assert ok, f"lookup {f} flags {flags:#x} l4_ok {l4_ok}: got (hit, bypass, dir, slot) {got}, model {want}"
            self.checked["unsure"] += 1
        if f.proto == fc.PROTO_TCP and flags & 0x05:
            if set_unsure:  # the command may have written the entry before or after this frame passed
                self.fin_unsure.add(fc.canonical(f)[0])
                if (s := self.m.find(f)) is not None:
                    self.m.unknown.add(s)
            self.m.close(f, flags)
            self.checked["close"] += 1
        kind = "bypass" if got[1] else "hit" if got[0] else "miss"
        self.checked[kind] += 1
        if got[0]:
            if got[3] == self.last_hit_slot:
                self.checked["same_slot_b2b"] += 1
            if got[3] in self.m.words:
                self.m.hit(got[3], ts)
            else:
                self.early.setdefault(got[3], []).append(ts)
        self.last_hit_slot = got[3] if got[0] else -1

    async def command(self, op: int, flow: Flow | None = None, slot: int = 0) -> tuple[int, int, int, int, int, int]:
        """One host command: (status, slot, word, counted, seen, hits) at r_valid; the model follows there."""
        d = self.dut
        f = flow or Flow(0, 0, 0)
        unsure = set(range(1 << self.log2_sets)) if op == fc.OP_CLEAR else {self.m.set_of(f)} if flow else set()
        if op in (fc.OP_DELETE_SLOT, fc.OP_READ):
            unsure = {fc.way_set(slot, self.log2_sets)[1]}
        self.unsure |= unsure
        self.all_unsure = op == fc.OP_CLEAR
        for port, val in zip(HOST_PORTS, (op, f.src, f.dst, f.proto, f.sport, f.dport, slot), strict=True):
            getattr(d, port).value = val
        d.h_valid.value = 1
        await handshake(d.clk, d.h_ready)
        d.h_valid.value = 0
        for _ in range((1 << self.log2_sets) + 100):
            await ReadOnly()
            if int(d.r_valid.value):
                break
            await RisingEdge(d.clk)
        else:
            raise AssertionError(f"command {op} never completed")
        got = tuple(int(getattr(d, p).value) for p in ("r_status", "r_slot", "r_word", "r_counted", "r_seen", "r_hits"))
        self._follow(op, f, slot, got)
        await RisingEdge(d.clk)  # results from here on reflect the command
        self.unsure -= unsure
        self.all_unsure = False
        self.early.clear()
        self.fin_unsure.clear()
        return got

    def _follow(self, op: int, f: Flow, slot: int, got: tuple) -> None:
        """Apply the command to the model and check the answer."""
        m = self.m
        if op == fc.OP_INSERT:
            before = m.find(f)
            want = m.insert(f)
            assert got[:2] == want, f"insert {f}: {got[:2]}, model {want}"
            if want[0] == fc.ST_OK:
                assert got[2] == m.words[got[1]] and got[3:] == (0, 0, 0), f"insert {f}: {got}"
                for ts in self.early.pop(got[1], []):
                    m.hit(got[1], ts)
                if fc.canonical(f)[0] in self.fin_unsure:
                    m.unknown.add(got[1])
            elif want[0] == fc.ST_EXISTS:
                assert got[2] == m.words[before], f"insert of an existing flow {f}: {got}"
                self._stats_match(before, got)
        elif op in (fc.OP_DELETE, fc.OP_FIND):
            s = m.find(f)
            if s is None:
                assert got[:2] == (fc.ST_NOT_FOUND, 0), f"op {op} of an absent flow: {got}"
            else:
                assert got[:2] == (fc.ST_OK, s) and got[2] == m.words[s], f"op {op} of {f}: {got}, slot {s}"
                self._stats_match(s, got)
                if op == fc.OP_DELETE:
                    m.delete_slot(s)
        elif op in (fc.OP_DELETE_SLOT, fc.OP_READ):
            if slot >= self.entries:
                assert got == (fc.ST_BAD, slot, 0, 0, 0, 0), f"op {op} of slot {slot} out of range: {got}"
            elif op == fc.OP_READ:
                assert got[:2] == (fc.ST_OK, slot), f"read {slot}: {got}"
                if slot in m.words:
                    assert got[2] == m.words[slot], f"read {slot}: word {got[2]:#x}, model {m.words[slot]:#x}"
                    self._stats_match(slot, got)
                else:
                    assert not fc.decode_word(got[2]).valid and got[3:] == (0, 0, 0), f"read free {slot}: {got}"
            else:
                want = m.delete_slot(slot)
                assert got[:2] == (want, slot), f"delete slot {slot}: {got}, model {want}"
        elif op == fc.OP_CLEAR:
            assert got[0] == fc.ST_OK, got
            m.empty()
        else:
            assert got == (fc.ST_BAD, 0, 0, 0, 0, 0), f"unknown op {op}: {got}"

    def _stats_match(self, s: int, got: tuple) -> None:
        """Exact when no lookup is running; with traffic a counter may lead the checked results by the in-flight."""
        _, counted, seen, hits = self.m.read(s)
        if s in self.m.unknown:  # whether a FIN/RST wrote its stats word is not known
            assert got[5] <= hits + fc.LATENCY, f"slot {s}: {got}, model {hits}"
        elif self.rate == 0.0:
            assert got[3:] == (counted, seen, hits), f"stats of slot {s}: {got[3:]}, model {(counted, seen, hits)}"
        else:
            assert abs(got[5] - hits) <= fc.LATENCY, f"slot {s}: {got}, model {hits}"

    async def quiet(self) -> None:
        """No lookup any more, the last results checked."""
        self.rate = 0.0
        await ClockCycles(self.dut.clk, fc.LATENCY + 2)

    async def check_all(self, extra: int = 30) -> None:
        """With no traffic: every valid entry and some free slots read back exactly, and the counters."""
        assert self.rate == 0.0
        for s in sorted(self.m.words) + [self.rng.randrange(self.entries) for _ in range(extra)]:
            await self.command(fc.OP_READ, slot=s)
        self.check_counters()

    def check_counters(self) -> None:
        d, m = self.dut, self.m
        got = tuple(int(getattr(d, p).value) for p in ("occupancy", "cnt_inserts", "cnt_deletes", "cnt_full"))
        assert got == (len(m.words), m.inserts, m.deletes, m.full), f"counters {got}"


def random_flows(rng: random.Random, n: int) -> list[Flow]:
    """Flows among few hosts and ports (so endpoints often share an address or a port), TCP, UDP, ICMP, and flows
    whose two endpoints are equal."""
    hosts = [rng.getrandbits(32) for _ in range(12)]
    out = []
    for _ in range(n):
        proto = rng.choice((6, 6, 17, 1))
        ports = (0, 0) if proto == 1 else (rng.choice((80, 443, 53, rng.randrange(1 << 16))), rng.randrange(1 << 16))
        a, b = rng.choice(hosts), rng.choice(hosts)
        f = Flow(a, b, proto, *ports)
        out.append(f if rng.random() < 0.95 else Flow(a, a, proto, ports[0], ports[0]))
    return out


def same_set(rng: random.Random, log2_sets: int, n: int) -> list[Flow]:
    """n distinct flows of one set (a collision group)."""
    by_set: dict[int, list[Flow]] = {}
    while True:
        f = Flow(rng.getrandbits(32), rng.getrandbits(32), 17, rng.randrange(1 << 16), 53)
        group = by_set.setdefault(fc.set_index(fc.canonical(f)[0], log2_sets), [])
        group.append(f)
        if len(group) == n:
            return group


@cocotb.test()
async def lookups_follow_the_model(dut):
    tb = await TB.running(dut, 1)
    rng = tb.rng
    tb.flows = random_flows(rng, 120)
    for f in tb.flows[:80]:
        await tb.command(fc.OP_INSERT, f if rng.random() < 0.5 else f.reply())
    await tb.check_all()
    # full rate, then with idle gaps; host commands run beside the lookups
    for rate in (1.0, 0.7, 1.0):
        tb.rate = rate
        for _ in range(80):
            op = rng.randrange(8)
            f = rng.choice(tb.flows)
            if op == 0:
                await tb.command(fc.OP_INSERT, f)
            elif op == 1:
                await tb.command(fc.OP_DELETE, f if rng.random() < 0.5 else f.reply())
            elif op == 2 and tb.m.words:
                await tb.command(fc.OP_DELETE_SLOT, slot=rng.choice(sorted(tb.m.words)))
            elif op == 3:
                await tb.command(fc.OP_FIND, f.reply())
            elif op == 4:
                s = rng.choice(sorted(tb.m.words)) if tb.m.words and rng.random() < 0.8 else rng.randrange(tb.entries)
                await tb.command(fc.OP_READ, slot=s)
            else:
                await ClockCycles(dut.clk, rng.randrange(1, 80))
    await tb.quiet()
    await tb.check_all()
    # a delete under continuous lookups of its own flow: hits until the command, misses once it is done
    victim = next(f for f in tb.flows if tb.m.find(f) is not None and f.proto != 1)
    tb.flows, tb.burst, tb.syn = [victim], 0.0, 0.0
    tb.rate = 1.0
    await ClockCycles(dut.clk, 40)
    hits = tb.checked["hit"]
    assert tb.m.stats[tb.m.find(victim)][1] >= 35
    await tb.command(fc.OP_DELETE, victim.reply())
    misses = tb.checked["miss"]
    await ClockCycles(dut.clk, 40)
    assert tb.checked["miss"] - misses >= 35 and tb.checked["hit"] > hits
    await tb.quiet()
    await tb.check_all()
    c = tb.checked
    dut._log.info(f"lookups checked: {c}")
    assert c["hit"] > 1200 and c["miss"] > 200 and c["bypass"] > 100 and c["same_slot_b2b"] > 300 and c["close"] > 10


@cocotb.test()
async def fin_and_rst_close_entries(dut):
    """Conntrack's LAST_ACK and CLOSE: an entry hits through one FIN, not after a second FIN (either direction)
    or an RST, from the very next cycle (the FIN/RST frames themselves bypass); a new insert starts over."""
    tb = await TB.running(dut, 4)
    f, g = Flow(0x0A000001, 0x0A000102, 6, 40000, 443), Flow(0x0A000003, 0x0A000104, 6, 40001, 80)
    tb.flows = [f, g]  # no random lookups (rate 0): only the scripted ones below
    for x in (f, g):
        assert (await tb.command(fc.OP_INSERT, x))[0] == fc.ST_OK
    ack, fin, rst = 0x10, 0x11, 0x14
    lines = [(f, ack), (f, fin), (f.reply(), ack), (f, ack | 0x08), (f.reply(), fin), (f, ack), (f.reply(), ack)]
    lines += [(g, ack), (g.reply(), rst), (g, ack), (g.reply(), ack)]
    tb.script.extend(lines)
    await ClockCycles(dut.clk, len(lines) + fc.LATENCY + 2)
    assert tb.scripted == [(1, 0), (0, 1), (1, 0), (1, 0), (0, 1), (0, 0), (0, 0), (1, 0), (0, 1), (0, 0), (0, 0)]
    # the host reads the closed entries as counted (their FIN/RST wrote the stats word), hits kept
    for x, hits in ((f, 3), (g, 1)):
        got = await tb.command(fc.OP_FIND, x)
        assert got[0] == fc.ST_OK and got[3] == 1 and got[5] == hits, got
    # a new entry of the same flow (deleted, inserted again: the other epoch) hits again
    await tb.command(fc.OP_DELETE, f)
    await tb.command(fc.OP_INSERT, f.reply())
    tb.scripted.clear()
    tb.script.extend([(f, ack), (f.reply(), ack), (f, fin), (f, ack)])
    await ClockCycles(dut.clk, 4 + fc.LATENCY + 2)
    assert tb.scripted == [(1, 0), (1, 0), (0, 1), (1, 0)]
    await tb.quiet()
    await tb.check_all(extra=5)


@cocotb.test()
async def full_sets_and_bad_commands(dut):
    tb = await TB.running(dut, 2)
    group = same_set(tb.rng, tb.log2_sets, tb.ways + 2)
    tb.flows = group
    tb.rate = 1.0
    for f in group[: tb.ways]:
        assert (await tb.command(fc.OP_INSERT, f))[0] == fc.ST_OK
    for f in group[tb.ways :]:  # the set is full: refused, counted, and the flow keeps missing
        assert (await tb.command(fc.OP_INSERT, f))[0] == fc.ST_FULL
    assert (await tb.command(fc.OP_INSERT, group[0].reply()))[0] == fc.ST_EXISTS
    await ClockCycles(tb.dut.clk, 200)
    assert tb.m.find(group[-1]) is None
    # a deleted way is reused by the next insert
    await tb.command(fc.OP_DELETE, group[tb.ways // 2])
    assert (await tb.command(fc.OP_INSERT, group[-1]))[0] == fc.ST_OK
    await ClockCycles(tb.dut.clk, 100)
    await tb.quiet()
    await tb.check_all(extra=5)
    assert tb.checked["hit"] > 50 and tb.checked["miss"] > 30, tb.checked
    # out-of-range slots, unknown ops, absent flows
    await tb.command(fc.OP_READ, slot=tb.entries)
    await tb.command(fc.OP_DELETE_SLOT, slot=(1 << 24) - 1)
    await tb.command(0)
    await tb.command(7)
    await tb.command(fc.OP_FIND, Flow(1, 2, 17, 3, 4))
    await tb.command(fc.OP_DELETE, Flow(1, 2, 17, 3, 4))
    slots = (fc.slot(w, s, tb.log2_sets) for s in range(8) for w in range(tb.ways))
    free = next(s for s in slots if s not in tb.m.words)
    await tb.command(fc.OP_DELETE_SLOT, slot=free)
    tb.check_counters()


@cocotb.test()
async def clear_and_reset(dut):
    tb = await TB.running(dut, 3)
    rng = tb.rng
    tb.flows = random_flows(rng, 40)
    for f in tb.flows:
        await tb.command(fc.OP_INSERT, f)
    tb.rate = 0.9
    await ClockCycles(dut.clk, 300)
    # clear under traffic: ready low while it sweeps, empty afterwards (the counters keep their values)
    await tb.command(fc.OP_CLEAR)
    await ClockCycles(dut.clk, 50)
    await tb.quiet()
    tb.check_counters()
    assert int(dut.occupancy.value) == 0 and tb.m.inserts > 30
    # the counter clear (RESET bit 0 of the core) zeroes the event counters, not the occupancy
    await tb.command(fc.OP_INSERT, tb.flows[0])
    dut.cnt_clear.value = 1
    await RisingEdge(dut.clk)
    dut.cnt_clear.value = 0
    tb.m.inserts = tb.m.deletes = tb.m.full = 0
    await ReadOnly()
    tb.check_counters()
    await RisingEdge(dut.clk)
    await tb.command(fc.OP_DELETE, tb.flows[0])
    for f in tb.flows[:10]:
        await tb.command(fc.OP_INSERT, f)
    tb.rate = 1.0
    await ClockCycles(dut.clk, 200)
    # reset: empty, counters zero, timestamp restarted; entries inserted afterwards start uncounted
    await tb.reset()
    assert int(dut.occupancy.value) == 0
    tb.check_counters()
    await ClockCycles(dut.clk, 100)
    assert tb.checked["hit"] > 100
    hits = tb.checked["hit"]
    for f in tb.flows[10:20]:
        await tb.command(fc.OP_INSERT, f)
    await ClockCycles(dut.clk, 300)
    await tb.quiet()
    await tb.check_all(extra=5)
    assert tb.checked["hit"] > hits
    # nothing left in flight
    await ReadOnly()
    assert not int(dut.res_valid.value) and not int(dut.r_valid.value) and int(dut.h_ready.value)


@pytest.mark.sim
@pytest.mark.parametrize(
    "log2_sets, ways, ts_w",
    [(10, 4, 32), (11, 3, 12), pytest.param(12, 1, 16, marks=TEST_FULL), pytest.param(14, 4, 32, marks=TEST_FULL)],
)
def test_flow_cache(log2_sets, ways, ts_w):
    tag = f"s{log2_sets}_w{ways}_t{ts_w}"
    params = {"LOG2_SETS": log2_sets, "WAYS": ways, "TS_W": ts_w, "TICK_CYCLES": 3}
    run_ghdl("hf_flow_cache", hw("hf_pkg.vhd", "hf_ram.vhd", "hf_flow_cache.vhd"), tag, params)
