"""The core's set membership tables (hw/hf_set_table.vhd, issue #24): the answer a slot gives for a frame, and the
host's placement of a set's elements into the banks, buckets and ways of a slot (the writes of tables SET_ELEM and
SET_BANK).

A slot's table is BANKS hash banks; each bank holds the elements of one prefix length (its SET_BANK register) in
2**LOG2_BUCKETS buckets of WAYS elements. A lookup probes every enabled bank in parallel with the frame's address
masked to that bank's length, and the longest length that hits decides: a nomatch element there means "not a
member" (the kernel's hash:net walks its prefix lengths from the most specific and stops at the first element it
finds). hash:ip and hash:ip,port use the same banks at length 32 (or the set's netmask). The bucket of a key is an
H3 hash (`bucket`), the same function as hf_set_pkg.set_hash; the host chooses bank and way, so an insert or a
delete is two table writes (w0, then w1 commits) and the fast path never waits for it.

An IPv6 slot (a dual-stack core's slot of an inet6 set, `Image.v6`; hf_set_table's V6) keys 128-bit addresses with
banks of prefix lengths up to 128, in tables SET6_* (18-21) whose element cells have 8 words: w0..w3 the address,
most significant first, w4 the commit. Its bucket hash reads the address folded to 32 bits (`fold32`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hypafilter.hw import regmap
from hypafilter.ir import PROTO_ICMP, PROTO_TCP, PROTO_UDP

# type codes of hf_set_pkg (ST_*) and SET_INFO
SETTYPES = {"hash:ip": 1, "hash:net": 2, "hash:ip,port": 3, "hash:net,port": 4, "bitmap:port": 5}
ADDR_TYPES = frozenset({"hash:ip", "hash:net", "hash:ip,port", "hash:net,port"})
PORT_TYPES = frozenset({"hash:ip,port", "hash:net,port", "bitmap:port"})
PROTO_SCTP, PROTO_UDPLITE = 132, 136  # ports the kernel reads but the parser does not: uncertain
PROTO_ICMPV6, PROTO_NONE6 = 58, 59  # IPv6: ICMPv6's type << 8 | code is the port; no next header never matches
LATENCY = 4  # cycles from the header to member/unc (hf_set_table)
KEY_W = 56
MAX_HASH_BITS = 16
MAX_BANKS = 16
MAX_LOG2_BUCKETS = 13
W1_VALID, W1_UNCERTAIN, W1_NOMATCH = 1 << 31, 1 << 30, 1 << 29
BANK_ENABLE = 1 << 31
SLOT_SHIFT = 20
TABLE_SET_ELEM = regmap.TABLE_SET_ELEM  # type: ignore[attr-defined]
TABLE_SET_BANK = regmap.TABLE_SET_BANK  # type: ignore[attr-defined]
TABLE_SET_INFO = regmap.TABLE_SET_INFO  # type: ignore[attr-defined]
TABLE_SET_CTL = regmap.TABLE_SET_CTL  # type: ignore[attr-defined]
TABLE_SET6_ELEM = regmap.TABLE_SET6_ELEM  # type: ignore[attr-defined]
TABLE_SET6_BANK = regmap.TABLE_SET6_BANK  # type: ignore[attr-defined]
TABLE_SET6_INFO = regmap.TABLE_SET6_INFO  # type: ignore[attr-defined]
TABLE_SET6_CTL = regmap.TABLE_SET6_CTL  # type: ignore[attr-defined]
INFO_V6 = 1 << 6  # SET_INFO / SET6_INFO: an IPv6 slot
MASK64 = (1 << 64) - 1


def _hash_rows() -> tuple[int, ...]:
    x, rows = 0x9E3779B97F4A7C15, []
    for _ in range(MAX_HASH_BITS):
        x ^= (x << 13) & MASK64
        x ^= x >> 7
        x ^= (x << 17) & MASK64
        rows.append(x & ((1 << KEY_W) - 1))
    return tuple(rows)


HASH_ROWS = _hash_rows()


def fold32(addr: int) -> int:
    """An address folded to the 32 bits the bucket hash reads: the XOR of its 32-bit words (hf_set_pkg.fold32); an
    IPv4 address is itself."""
    r = 0
    while addr:
        r ^= addr & 0xFFFFFFFF
        addr >>= 32
    return r


def key(addr: int, proto: int, port: int) -> int:
    """The 56-bit key the bucket hash reads: the address folded to 32 bits << 24 | proto << 16 | port."""
    return fold32(addr) << 24 | (proto & 0xFF) << 16 | (port & 0xFFFF)


def bucket(k: int, bits: int) -> int:
    """Bucket of key k among 2**bits (H3: bit i = parity of k & HASH_ROWS[i]); hf_set_pkg.set_hash."""
    return sum(((k & HASH_ROWS[i]).bit_count() & 1) << i for i in range(bits))


def prefix_mask(plen: int, bits: int = 32) -> int:
    top = (1 << bits) - 1
    return (top << (bits - plen)) & top if plen else 0


@dataclass(frozen=True)
class Geometry:
    """The generics of one slot's table: banks, log2 of the buckets per bank, ways per bucket."""

    banks: int = 16
    log2_buckets: int = 9
    ways: int = 8

    def __post_init__(self):
        if not 1 <= self.banks <= MAX_BANKS:
            raise ValueError(f"a set table has 1..{MAX_BANKS} banks, not {self.banks}")
        if not 1 <= self.log2_buckets <= MAX_LOG2_BUCKETS:
            raise ValueError(f"LOG2_BUCKETS is 1..{MAX_LOG2_BUCKETS}, not {self.log2_buckets}")
        if self.ways not in (1, 2, 4, 8) or (self.ways << self.log2_buckets) > 1 << 15:
            raise ValueError(f"WAYS is 1, 2, 4 or 8 with buckets * WAYS <= 32768, not {self.ways}")

    @property
    def per_bank(self) -> int:
        return self.ways << self.log2_buckets

    @property
    def capacity(self) -> int:
        return self.banks * self.per_bank

    def fits_v6(self) -> bool:
        """An IPv6 slot's cells have 8 index words (SET6_ELEM index bits 15:3): buckets * WAYS at most 8192."""
        return self.per_bank <= 1 << 13


# The NIC's default: 16 banks of 512 buckets x 8 ways = 65,536 element cells per slot, ipset's default maxelem
# (docs/hardware.md, "Set tables": 8 ways hold 4.6 times the elements of 4 ways x 1,024 buckets before a set of 16
# prefix lengths first finds a bucket full).
DEFAULT_GEOMETRY = Geometry(16, 9, 8)


def elem_bits(settype: str, v6: bool = False) -> int:
    """Bits of one stored element (valid, uncertain, nomatch, address if any, proto and port if any)."""
    return 3 + ((128 if v6 else 32) if settype in ADDR_TYPES else 0) + (24 if settype in PORT_TYPES else 0)


def slot_generics(settype: str, dirs: tuple[str, ...], geom: Geometry = DEFAULT_GEOMETRY) -> dict[str, int]:
    """hf_set_table's generics for a slot of this type read by these directions (an IPv6 slot's are the same, with
    V6 set by the core: its SET6_* arrays)."""
    if settype not in SETTYPES:
        raise ValueError(f"set type {settype} has no hardware table")
    addr_dir = dirs[0] if settype != "bitmap:port" else "src"
    port_dir = dirs[-1] if settype in PORT_TYPES else "src"
    return {
        "SETTYPE": SETTYPES[settype],
        "ADDR_DIR": int(addr_dir == "dst"),
        "PORT_DIR": int(port_dir == "dst"),
        "BANKS": geom.banks,
        "LOG2_BUCKETS": geom.log2_buckets,
        "WAYS": geom.ways,
    }


@dataclass(frozen=True)
class Elem:
    """One element as the table stores it: the address masked to `plen` (0 for bitmap:port), proto and port (0 for
    the address types), nomatch, and uncertain (near its timeout: a frame it decides is shunted)."""

    addr: int = 0
    plen: int = 32
    proto: int = 0
    port: int = 0
    nomatch: bool = False
    uncertain: bool = False

    @property
    def ident(self) -> tuple[int, int, int, int]:
        return (self.addr, self.plen, self.proto, self.port)


def frame_key(settype: str, dirs: tuple[str, ...], hdr, v6: bool = False) -> tuple[bool, bool, int, int, int]:
    """(eligible, uncertain, address, proto, port) of a parsed header for a slot: what the kernel's kadt reads
    (ip_set_get_ip4_port: TCP/UDP ports, ICMP type << 8 | code, 0 for protocols without ports, protocol 0 never
    matches; bitmap:port matches TCP and UDP only). SCTP and UDP-Lite ports are not parsed: uncertain. An IPv6 slot
    (`v6`, ip_set_get_ip6_port): ICMPv6 type << 8 | code; ICMP (1), whose fields the parser does not give for an IPv6
    frame, uncertain; no next header (59) never matches."""
    addr = (hdr.src if dirs[0] == "src" else hdr.dst) if settype in ADDR_TYPES else 0
    if settype not in PORT_TYPES:
        return True, False, addr, 0, 0
    pdir = dirs[-1]
    proto = hdr.proto
    if proto in (PROTO_TCP, PROTO_UDP):
        port = hdr.sport if pdir == "src" else hdr.dport
    elif proto == (PROTO_ICMPV6 if v6 else PROTO_ICMP):
        port = hdr.icmp_type << 8 | hdr.icmp_code
    else:
        port = 0
    if settype == "bitmap:port":
        ok = proto in (PROTO_TCP, PROTO_UDP)
        return ok, False, 0, 0, port
    unc = proto in (PROTO_SCTP, PROTO_UDPLITE) or (v6 and proto == PROTO_ICMP)
    return proto != (PROTO_NONE6 if v6 else 0), unc, addr, proto, port


def lookup(
    settype: str, dirs: tuple[str, ...], elems, hdr, all_uncertain: bool = False, v6: bool = False
) -> tuple[bool, bool]:
    """(member, uncertain) of a header for a slot holding `elems`: the longest prefix length with an element of the
    frame's key decides (nomatch there: not a member); uncertain when any element of the key is uncertain, or the
    protocol's ports are not parsed, or the whole slot is (SET_CTL bit 0). The hardware answers exactly this."""
    ok, unc, addr, proto, port = frame_key(settype, dirs, hdr, v6)
    bits = 128 if v6 else 32
    best, member = -1, False
    if ok:
        for e in elems:
            if (addr & prefix_mask(e.plen, bits)) == e.addr and e.proto == proto and e.port == port:
                unc = unc or e.uncertain
                if e.plen > best:
                    best, member = e.plen, not e.nomatch
    return member, unc or all_uncertain


class TableFull(Exception):
    """An element that no bank of its prefix length has room for, and no free bank to open: the set is too large
    for this table (its rules must become complex again)."""


def elem_index(slot: int, bank: int, bkt: int, way: int, ways: int, w: int, v6: bool = False) -> int:
    """SET_ELEM's index of word w of a cell (SET6_ELEM's for an IPv6 slot: 8 words a cell)."""
    return slot << SLOT_SHIFT | bank << 16 | (bkt * ways + way) << (3 if v6 else 1) | w


def tables(v6: bool) -> tuple[int, int, int, int]:
    """The table ids (ELEM, BANK, INFO, CTL) of an IPv4 or an IPv6 slot."""
    if v6:
        return TABLE_SET6_ELEM, TABLE_SET6_BANK, TABLE_SET6_INFO, TABLE_SET6_CTL
    return TABLE_SET_ELEM, TABLE_SET_BANK, TABLE_SET_INFO, TABLE_SET_CTL


@dataclass
class Image:
    """The host's copy of one slot's table: which element sits in which bank, bucket and way, and the bank lengths.
    insert/delete return the indirect writes [(table, index, word)] that bring the hardware to the new image."""

    slot: int
    settype: str
    geom: Geometry = DEFAULT_GEOMETRY
    bank_len: list[int | None] = field(default_factory=list)  # None: disabled
    cells: dict[tuple[int, int, int], Elem] = field(default_factory=dict)  # (bank, bucket, way) -> element
    where: dict[tuple[int, int, int, int], tuple[int, int, int]] = field(default_factory=dict)
    v6: bool = False  # an IPv6 slot's table (SET6_*, 128-bit addresses)

    def __post_init__(self):
        if not self.bank_len:
            self.bank_len = [None] * self.geom.banks
        if self.v6 and not self.geom.fits_v6():
            raise ValueError(f"an IPv6 set table has buckets * WAYS <= 8192, not {self.geom.per_bank}")

    @property
    def addr_bits(self) -> int:
        return 128 if self.v6 else 32

    def __len__(self) -> int:
        return len(self.where)

    def _bucket(self, e: Elem) -> int:
        return bucket(key(e.addr, e.proto, e.port), self.geom.log2_buckets)

    def _elem_writes(self, bank: int, bkt: int, way: int, e: Elem | None) -> list[tuple[int, int, int]]:
        t = tables(self.v6)[0]
        i0 = elem_index(self.slot, bank, bkt, way, self.geom.ways, 0, self.v6)
        nw = 4 if self.v6 else 1  # address words, most significant first; then the commit word
        if e is None:
            return [(t, i0 | k, 0) for k in range(nw + 1)]
        w1 = W1_VALID | (W1_UNCERTAIN if e.uncertain else 0) | (W1_NOMATCH if e.nomatch else 0)
        words = [(t, i0 | k, (e.addr >> (32 * (nw - 1 - k))) & 0xFFFFFFFF) for k in range(nw)]
        return [*words, (t, i0 | nw, w1 | e.proto << 16 | e.port)]

    def _bank_write(self, bank: int) -> tuple[int, int, int]:
        plen = self.bank_len[bank]
        word = 0 if plen is None else BANK_ENABLE | plen
        return (tables(self.v6)[1], self.slot << SLOT_SHIFT | bank, word)

    def normal(self, e: Elem) -> Elem:
        if self.settype == "bitmap:port":
            return Elem(0, 0, 0, e.port, e.nomatch, e.uncertain)
        return Elem(e.addr & prefix_mask(e.plen, self.addr_bits), e.plen, e.proto, e.port, e.nomatch, e.uncertain)

    def insert(self, e: Elem) -> list[tuple[int, int, int]]:
        """Place e (replacing the element of the same key: its flags change); raises TableFull, changing nothing."""
        e = self.normal(e)
        at = self.where.get(e.ident)
        if at is not None:
            self.cells[at] = e
            return self._elem_writes(*at, e)
        bkt = self._bucket(e)
        banks = [b for b, n in enumerate(self.bank_len) if n == e.plen]
        for b in banks:
            for w in range(self.geom.ways):
                if (b, bkt, w) not in self.cells:
                    return self._place(b, bkt, w, e, [])
        free = [b for b, n in enumerate(self.bank_len) if n is None]
        if not free:
            why = f"its bucket is full in every bank of length {e.plen}" if banks else "no bank is free for its length"
            raise TableFull(f"set slot {self.slot}: no room for {e}: {why}")
        b = free[0]
        self.bank_len[b] = e.plen
        return self._place(b, bkt, 0, e, [self._bank_write(b)])

    def _place(self, b, bkt, w, e, writes):
        self.cells[(b, bkt, w)] = e
        self.where[e.ident] = (b, bkt, w)
        return writes + self._elem_writes(b, bkt, w, e)

    def delete(self, e: Elem) -> list[tuple[int, int, int]]:
        """Remove the element of e's key (nothing when absent); a bank left empty is disabled and freed."""
        e = self.normal(e)
        at = self.where.pop(e.ident, None)
        if at is None:
            return []
        del self.cells[at]
        writes = self._elem_writes(*at, None)
        b = at[0]
        if not any(k[0] == b for k in self.cells):
            self.bank_len[b] = None
            writes.append(self._bank_write(b))
        return writes

    def elems(self) -> list[Elem]:
        return list(self.cells.values())


def image_of(slot: int, settype: str, elems, geom: Geometry = DEFAULT_GEOMETRY, v6: bool = False) -> tuple[Image, list]:
    """A fresh image holding elems and the writes that load it into a table just reset (every bank disabled,
    every element invalid); raises TableFull when they do not fit."""
    img = Image(slot, settype, geom, v6=v6)
    writes: list[tuple[int, int, int]] = []
    # most common lengths first, so that each gets its banks before rarer ones take the last free ones
    by_len: dict[int, int] = {}
    for e in elems:
        by_len[e.plen] = by_len.get(e.plen, 0) + 1
    for e in sorted(elems, key=lambda e: (-by_len[e.plen], e.plen)):
        writes += img.insert(e)
    return img, writes


# An element whose timeout has at most this many seconds left is uncertain: ipset reports whole seconds of a timer
# kept in jiffies, so the kernel may expire it any moment now (the follower deletes it at its expiry).
UNCERTAIN_S = 2


def elems_of(info, dirs: tuple[str, ...], uncertain_s: int = UNCERTAIN_S) -> list[Elem]:
    """A kernel set's elements (ir.sets.SetInfo) as a slot's table holds them. A slot read by fewer directions than
    the type has dimensions never matches in the kernel (ip_set_test: opt->dim < dimension): no element then. For
    the port types proto 0 is ipset's default, TCP; hash:ip elements are stored at the set's netmask. An inet6
    set's elements are 128-bit (an IPv6 slot's)."""
    if len(dirs) < info.dimension:
        return []
    bits = 128 if info.family == "inet6" else 32
    out = []
    for e in info.entries:
        unc = e.timeout_s is not None and e.timeout_s <= uncertain_s
        if info.settype == "bitmap:port":
            out.append(Elem(0, 0, 0, e.port, False, unc))
            continue
        plen = info.netmask if info.settype in ("hash:ip", "hash:ip,port") else e.prefix
        proto = (e.proto or PROTO_TCP) if info.settype in PORT_TYPES else 0
        port = e.port if info.settype in PORT_TYPES else 0
        out.append(Elem(e.addr_lo & prefix_mask(plen, bits), plen, proto, port, e.nomatch, unc))
    return out


@dataclass(frozen=True)
class SlotState:
    """One slot's table as the model sees it: its type and directions, its elements, SET_CTL bit 0."""

    settype: str
    dirs: tuple[str, ...]
    elems: tuple[Elem, ...] = ()
    all_uncertain: bool = False
    v6: bool = False

    def lookup(self, hdr) -> tuple[bool, bool]:
        return lookup(self.settype, self.dirs, self.elems, hdr, self.all_uncertain, self.v6)


def slot_states(slots, sets: dict, v6: bool = False) -> tuple[SlotState, ...]:
    """The tables as the register client loads them for `slots` from the sets by name (ir.sets.SetInfo); a slot
    whose set is not known stays uncertain (as after reset). `v6`: the IPv6 slots of a dual-stack core."""
    out = []
    for s in slots:
        info = sets.get(s.name)
        if info is None:
            out.append(SlotState(s.settype, tuple(s.dirs), (), True, v6))
        else:
            out.append(SlotState(s.settype, tuple(s.dirs), tuple(elems_of(info, tuple(s.dirs))), False, v6))
    return tuple(out)


def set_bits(states, hdr) -> tuple[int, bool]:
    """(Header.sets, uncertain) of a parsed header under the slots' tables."""
    bits, unc = 0, False
    for i, st in enumerate(states):
        m, u = st.lookup(hdr)
        bits |= int(m) << i
        unc = unc or u
    return bits, unc


def image_dict(img: Image) -> dict:
    """An image as JSON-able data (deploy keeps it as the `known` of the next programming)."""
    return {
        "slot": img.slot,
        "settype": img.settype,
        "v6": int(img.v6),
        "geometry": [img.geom.banks, img.geom.log2_buckets, img.geom.ways],
        "bank_len": list(img.bank_len),
        "cells": [
            [b, k, w, e.addr, e.plen, e.proto, e.port, int(e.nomatch), int(e.uncertain)]
            for (b, k, w), e in sorted(img.cells.items())
        ],  # fmt: skip
    }


def image_from_dict(d: dict) -> Image:
    img = Image(int(d["slot"]), str(d["settype"]), Geometry(*(int(x) for x in d["geometry"])), v6=bool(d.get("v6")))
    img.bank_len = [None if x is None else int(x) for x in d["bank_len"]]
    for b, k, w, addr, plen, proto, port, nom, unc in d["cells"]:
        e = Elem(addr, plen, proto, port, bool(nom), bool(unc))
        img.cells[(b, k, w)] = e
        img.where[e.ident] = (b, k, w)
    return img


def diff_writes(img: Image, elems) -> list[tuple[int, int, int]]:
    """The writes that make `img` hold exactly `elems` (deletes first, then inserts and flag changes); raises
    TableFull when an insert finds no room (the image then holds the deletes and the inserts before it)."""
    want = {}
    for e in elems:
        e = img.normal(e)
        want[e.ident] = e
    writes: list[tuple[int, int, int]] = []
    for ident in [i for i in img.where if i not in want]:
        writes += img.delete(img.cells[img.where[ident]])
    for ident, e in want.items():
        at = img.where.get(ident)
        if at is None or img.cells[at] != e:
            writes += img.insert(e)
    return writes


def runs(writes) -> list[tuple[int, int, list[int]]]:
    """Writes (table, index, word) as runs of consecutive indices of one table, in order: (table, start, words)."""
    out: list[tuple[int, int, list[int]]] = []
    for t, i, w in writes:
        if out and out[-1][0] == t and out[-1][1] + len(out[-1][2]) == i:
            out[-1][2].append(w)
        else:
            out.append((t, i, [w]))
    return out
