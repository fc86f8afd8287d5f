"""Testbench of hf_set_table, one build per set type: a header every cycle (most of them on the set's elements, in
nested prefixes), run-time inserts and deletes through the indirect port while the headers flow, longest-prefix match
with nomatch elements, uncertain elements and the slot's SET_CTL bit, a table filled until the host's placement
refuses (hypafilter.hw.settable is the model the answers are compared with, and the placement the writes come
from), read-back of elements, banks and SET_INFO. The IPv6 builds (V6, HF_ST_V6=1: an inet6 set's slot) run the same
with 128-bit addresses, prefixes up to /128 (nested /32../128), ICMPv6 types as ports and tables SET6_*."""

from __future__ import annotations

import os
import random

import cocotb
import pytest
from cocotb.clock import Clock
from cocotb.triggers import FallingEdge, ReadOnly, RisingEdge
from hypafilter.hw import settable
from hypafilter.hw.settable import Elem, Geometry, Image, TableFull
from hypafilter.ir import Header

from sim.hftb import hw, run_ghdl

SOURCES = ("hf_pkg.vhd", "hf_set_pkg.vhd", "hf_ram.vhd", "hf_set_table.vhd")
TYPES = {v: k for k, v in settable.SETTYPES.items()}
PROTOS = (6, 17, 1, 47, 132, 0)
PROTOS6 = (6, 17, 58, 47, 132, 1, 59)


GENERICS = ("SETTYPE", "ADDR_DIR", "PORT_DIR", "BANKS", "LOG2_BUCKETS", "WAYS")


def generics_of(dut) -> dict[str, int]:
    """The unit's generics: from the entity, or (a synthesised netlist has none) from HF_ST_GENERICS."""
    env = os.environ.get("HF_ST_GENERICS")
    if env:
        return dict(zip(GENERICS, (int(x) for x in env.split(",")), strict=True))
    return {k: int(getattr(dut, k).value) for k in GENERICS}


class TB:
    """Clock, the header driver (one header per cycle, answers checked LATENCY cycles later against the model
    state around the header's flight) and the indirect port."""

    def __init__(self, dut):
        self.dut = dut
        g = generics_of(dut)
        self.g = g
        self.v6 = os.environ.get("HF_ST_V6") == "1"
        self.abits = 128 if self.v6 else 32
        self.t_elem, self.t_bank, self.t_info, self.t_ctl = settable.tables(self.v6)
        self.settype = TYPES[g["SETTYPE"]]
        self.dirs = ("dst" if g["ADDR_DIR"] else "src", "dst" if g["PORT_DIR"] else "src")
        if self.settype == "bitmap:port":
            self.dirs = (self.dirs[1],)
        self.geom = Geometry(g["BANKS"], g["LOG2_BUCKETS"], g["WAYS"])
        self.img = Image(0, self.settype, self.geom, v6=self.v6)
        self.ctl_unc = True
        self.rng = random.Random(g["SETTYPE"])
        self.cyc = 0
        self.versions: list[tuple[int, list[Elem], bool]] = []  # (cycle it holds from, elements, SET_CTL bit 0)
        self.sent: list[tuple[int, Header]] = []
        self.checked = self.mismatch = 0
        self.members = self.uncertain = 0
        self.traffic = True
        for name in ("h_src", "h_dst", "h_proto", "h_sport", "h_dport", "h_icmp_type", "h_icmp_code", "ind_req",
                     "ind_write", "ind_addr", "ind_wdata"):  # fmt: skip
            getattr(dut, name).value = 0
        dut.rst.value = 0

    def snapshot(self) -> None:
        self.versions.append((self.cyc, self.img.elems(), self.ctl_unc))

    def header(self) -> Header:
        r, elems, ab = self.rng, self.img.elems(), self.abits
        icmp = 58 if self.v6 else 1
        proto = r.choice(PROTOS6 if self.v6 else PROTOS)
        h = dict(src=r.getrandbits(ab), dst=r.getrandbits(ab), proto=proto, sport=r.getrandbits(16),
                 dport=r.getrandbits(16), icmp_type=r.getrandbits(8), icmp_code=r.getrandbits(8))  # fmt: skip
        if proto not in (6, 17):
            h["sport"] = h["dport"] = 0
        if proto != icmp:
            h["icmp_type"] = h["icmp_code"] = 0
        if elems and r.random() < 0.8:
            e = r.choice(elems)
            a = e.addr | (r.getrandbits(ab) & ~settable.prefix_mask(e.plen, ab) & ((1 << ab) - 1))
            h[self.dirs[0] if self.settype != "bitmap:port" else "src"] = a
            if self.settype in settable.PORT_TYPES:
                pdir = self.dirs[-1]
                h["proto"] = e.proto or r.choice((6, 17))
                if h["proto"] == icmp:
                    h["icmp_type"], h["icmp_code"] = e.port >> 8, e.port & 0xFF
                else:
                    h["sport" if pdir == "src" else "dport"] = e.port
        return Header(**h)

    async def clock(self) -> None:
        d, lat = self.dut, settable.LATENCY
        while True:
            await FallingEdge(d.clk)
            h = self.header() if self.traffic else Header()
            d.h_src.value, d.h_dst.value, d.h_proto.value = h.src, h.dst, h.proto
            d.h_sport.value, d.h_dport.value = h.sport, h.dport
            d.h_icmp_type.value, d.h_icmp_code.value = h.icmp_type, h.icmp_code
            await RisingEdge(d.clk)
            self.cyc += 1
            self.sent.append((self.cyc, h if self.traffic else None))
            await ReadOnly()
            if len(self.sent) >= lat:
                c, old = self.sent[-lat]  # registered LATENCY - 1 edges ago: its answer is out now
                if old is not None:
                    self.check(c, old, int(d.member.value), int(d.unc.value))

    def check(self, c: int, h: Header, member: int, unc: int) -> None:
        # the answer of the model version in force when the header was looked up (any version that was current
        # within a few cycles of it: a write lands between the request and ind_done)
        answers = set()
        for k, (since, elems, ctl) in enumerate(self.versions):
            until = self.versions[k + 1][0] if k + 1 < len(self.versions) else 1 << 60
            if since - 4 <= c + 2 and c - 2 <= until + 4:
                answers.add(settable.lookup(self.settype, self.dirs, elems, h, ctl, self.v6))
        self.checked += 1
        got = (bool(member), bool(unc))
        self.members += member
        self.uncertain += unc
        if got not in answers and not (got[1] and any(a[1] for a in answers)):
            self.mismatch += 1
            if self.mismatch < 10:
                self.dut._log.error(f"cycle {c}: {h} gave {got}, model {answers}")

    async def reset(self) -> None:
        d = self.dut
        await FallingEdge(d.clk)
        d.rst.value = 1
        await FallingEdge(d.clk)
        d.rst.value = 0

    async def access(self, table: int, index: int, word: int = 0, write: bool = True) -> int:
        d = self.dut
        await FallingEdge(d.clk)
        d.ind_req.value, d.ind_write.value = 1, int(write)
        d.ind_addr.value, d.ind_wdata.value = table << 24 | index, word
        await FallingEdge(d.clk)
        d.ind_req.value = 0
        for _ in range(1 << (self.geom.log2_buckets + 2)):
            await ReadOnly()
            if int(d.ind_done.value):
                return int(d.ind_rdata.value)
            await FallingEdge(d.clk)
        raise AssertionError("no ind_done")

    async def apply(self, writes) -> None:
        for table, index, word in writes:
            await self.access(table, index, word)
        await RisingEdge(self.dut.clk)
        self.snapshot()

    async def set_ctl(self, unc: bool) -> None:
        await self.access(self.t_ctl, 0, int(unc))
        self.ctl_unc = unc
        self.snapshot()

    async def insert(self, e: Elem) -> None:
        await self.apply(self.img.insert(e))

    async def delete(self, e: Elem) -> None:
        await self.apply(self.img.delete(e))

    async def idle(self, n: int) -> None:
        for _ in range(n):
            await RisingEdge(self.dut.clk)


def some_elems(settype: str, rng: random.Random, n: int, v6: bool = False) -> list[Elem]:
    """Elements of the type: for the net types nested prefixes (a /8, a /16 inside it marked nomatch, a /24
    inside that, a /32 inside that; IPv6: /32, /48 nomatch, /64, /128, ...) besides scattered ones."""
    out: list[Elem] = []
    if settype == "bitmap:port":
        return [Elem(port=p) for p in rng.sample(range(65536), n)]
    nets = settype in ("hash:net", "hash:net,port")
    ab = 128 if v6 else 32
    for k in range(n):
        plen = ab
        if nets:
            plen = ((32, 48, 64, 128, 40, 56, 127) if v6 else (8, 16, 24, 32, 12, 20, 28))[k % 7]
        proto, port = 0, 0
        if settype in settable.PORT_TYPES:
            proto = rng.choice((6, 17, 58, 47) if v6 else (6, 17, 1, 47))
            port = 0 if proto == 47 else rng.getrandbits(16)
        nested = nets and k % 7 and out
        base = out[k - 1].addr if nested else rng.getrandbits(ab)
        addr = base | (rng.getrandbits(ab) & ~settable.prefix_mask(out[k - 1].plen if nested else 0, ab))
        if nested and settype in settable.PORT_TYPES:
            proto, port = out[k - 1].proto, out[k - 1].port  # nested keys share proto and port
        addr &= settable.prefix_mask(plen, ab)
        out.append(Elem(addr, plen, proto, port, nomatch=settype in ("hash:net", "hash:net,port") and k % 7 == 1))
    return out


@cocotb.test()
async def set_table(dut):
    cocotb.start_soon(Clock(dut.clk, 4, units="ns").start())
    tb = TB(dut)
    tb.snapshot()
    await tb.reset()
    cocotb.start_soon(tb.clock())
    # during the sweep and until SET_CTL bit 0 is cleared, every answer is uncertain
    await tb.idle(20)
    info = await tb.access(tb.t_info, 0, write=False)
    assert info == settable.SETTYPES[tb.settype] | tb.g["ADDR_DIR"] << 4 | tb.g["PORT_DIR"] << 5 | \
        (settable.INFO_V6 if tb.v6 else 0) | tb.geom.banks << 8 | tb.geom.log2_buckets << 16 | \
        tb.geom.ways << 24, hex(info)  # fmt: skip
    # the other family's tables are not this unit's: reads give 0
    assert await tb.access(settable.tables(not tb.v6)[2], 0, write=False) == 0
    await tb.set_ctl(False)
    await tb.access(tb.t_ctl, 0, 0xABCDE5 << 8)  # the host's tag, bit 0 still clear
    assert await tb.access(tb.t_ctl, 0, write=False) == 0xABCDE5 << 8
    rng = random.Random(7)
    elems = some_elems(tb.settype, rng, 21, tb.v6)
    # inserts while headers flow, one at a time
    for e in elems:
        await tb.insert(e)
        await tb.idle(3)
    await tb.idle(200)
    # read back one element and a bank register
    e = elems[3]
    bank, bkt, way = tb.img.where[tb.img.normal(e).ident]
    i0 = settable.elem_index(0, bank, bkt, way, tb.geom.ways, 0, tb.v6)
    nw = 4 if tb.v6 else 1
    words = [await tb.access(tb.t_elem, i0 | k, write=False) for k in range(nw)]
    assert sum(w << (32 * (nw - 1 - k)) for k, w in enumerate(words)) == tb.img.normal(e).addr, words
    w1 = await tb.access(tb.t_elem, i0 | nw, write=False)
    assert w1 == settable.W1_VALID | (settable.W1_NOMATCH if e.nomatch else 0) | e.proto << 16 | e.port, hex(w1)
    got = await tb.access(tb.t_bank, bank, write=False)
    assert got == settable.BANK_ENABLE | tb.img.bank_len[bank], hex(got)
    # an uncertain element (near its timeout), then certain again
    for e in elems[:4]:
        await tb.insert(Elem(e.addr, e.plen, e.proto, e.port, e.nomatch, uncertain=True))
    await tb.idle(150)
    for e in elems[:4]:
        await tb.insert(e)
    # deletes, among them the nomatch element inside a longer and a shorter prefix
    for e in elems[::2]:
        await tb.delete(e)
    await tb.idle(150)
    # the whole slot uncertain (the host rewrites the set), then not
    await tb.set_ctl(True)
    await tb.idle(30)
    await tb.set_ctl(False)
    # fill the table until the placement refuses: every placed element still answers, the refused one changed
    # nothing
    full = 0
    fill = some_elems(tb.settype, random.Random(11), 4 * tb.geom.capacity, tb.v6) if tb.geom.capacity <= 1024 else []
    for e in fill:
        try:
            writes = tb.img.insert(e)
        except TableFull:
            full += 1
            if full > 20:
                break
            continue
        tb.traffic = False
        await tb.apply(writes)
        tb.traffic = True
        await tb.idle(2)
    if fill:
        assert full, "the table never filled up"
        assert None not in tb.img.bank_len and len(tb.img) > tb.geom.capacity // 3, (tb.img.bank_len, len(tb.img))
    await tb.idle(400)
    # SET_CTL bit 1 clears the slot (the host's full reload); a reset empties it too and sets SET_CTL bit 0 again
    tb.traffic = False
    await tb.access(tb.t_ctl, 0, 0b10)
    tb.img = Image(0, tb.settype, tb.geom, v6=tb.v6)
    await tb.set_ctl(False)
    tb.traffic = True
    await tb.idle(60)
    for e in elems[:5]:
        await tb.insert(e)
    await tb.idle(60)
    tb.img = Image(0, tb.settype, tb.geom, v6=tb.v6)
    tb.ctl_unc = True
    tb.traffic = False
    await tb.reset()
    tb.snapshot()
    tb.traffic = True
    await tb.idle(100)
    dut._log.info(f"{tb.checked} answers checked, {tb.members} members, {tb.uncertain} uncertain")
    assert tb.mismatch == 0, f"{tb.mismatch} of {tb.checked} answers differ from the model"
    assert tb.members > 100 and tb.uncertain > 50


# (type, addr dir, port dir, banks, log2 buckets, ways): small tables, so that "full" comes within the test
CASES = [
    ("hash:ip", 1, 0, 2, 4, 2),
    ("hash:net", 0, 0, 8, 3, 2),
    ("hash:ip,port", 0, 1, 2, 3, 4),
    ("hash:net,port", 1, 0, 8, 2, 2),
    ("bitmap:port", 0, 1, 1, 5, 4),
]


# IPv6 slots (V6): the address types, small tables again
CASES6 = [
    ("hash:ip", 0, 0, 2, 4, 2),
    ("hash:net", 1, 0, 8, 3, 2),
    ("hash:ip,port", 1, 1, 2, 3, 4),
    ("hash:net,port", 0, 1, 8, 2, 2),
]


def _run(settype, adir, pdir, banks, lb, ways, v6: bool) -> None:
    generics = {"SETTYPE": settable.SETTYPES[settype], "ADDR_DIR": adir, "PORT_DIR": pdir, "BANKS": banks,
                "LOG2_BUCKETS": lb, "WAYS": ways}  # fmt: skip
    tag = settype.replace(":", "_").replace(",", "_")
    if v6:
        generics["V6"] = True
        tag += "_v6"
    run_ghdl("hf_set_table", hw(*SOURCES), tag, generics,
             env={"HF_SEED": os.environ.get("HF_SEED", "1"), "HF_ST_V6": str(int(v6))})  # fmt: skip


@pytest.mark.sim
@pytest.mark.parametrize("settype, adir, pdir, banks, lb, ways", CASES, ids=[c[0].replace(":", "_") for c in CASES])
def test_set_table(settype, adir, pdir, banks, lb, ways):
    _run(settype, adir, pdir, banks, lb, ways, False)


@pytest.mark.sim
@pytest.mark.parametrize("settype, adir, pdir, banks, lb, ways", CASES6, ids=[c[0].replace(":", "_") for c in CASES6])
def test_set_table6(settype, adir, pdir, banks, lb, ways):
    _run(settype, adir, pdir, banks, lb, ways, True)
