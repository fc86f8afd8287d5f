"""The header space and its algebra: fields, boxes (intervals per field + a TCP-flags ternary), headers as points,
and the operations on unions of boxes that the parser, flattening and analysis share (ARCHITECTURE §2).

Header model (the same convention in the hardware parser, the Python reference model and the trace tools):
every IPv4 packet is a point in the space of FIELDS below. Fields that a packet does not carry are 0: ports
are 0 unless the protocol is TCP (6) or UDP (17); icmp_type/icmp_code are 0 unless the protocol is ICMP (1);
tcp_flags (byte 13 of the TCP header) is 0 unless TCP; iport is the ingress MAC index (0..3); ct is what the
fast path knows of the frame's connection (0 unknown: no flow cache, a miss, a TCP SYN/FIN/RST, neither TCP nor
UDP; 1 a flow-cache hit in the flow's original direction, conntrack state ESTABLISHED; 2 a hit in the reply
direction, ESTABLISHED; 3 no entry: conntrack holds no connection for the frame, so the kernel reads it as NEW or
INVALID, produced only where the fast path can prove the miss — the xdp target's lookup in the kernel's own table,
never the NIC's flow cache, which holds only offloaded flows). A check on a port, ICMP field or TCP flags always
comes with the matching protocol check, so the zero convention never lets a rule match a packet it should not. Only the hit
and miss parts of a rule whose sole complex checks are conntrack states narrow ct (iptables.ctstate); every other
rule spans ct 0..3.
"""

from __future__ import annotations

import itertools
from contextvars import ContextVar
from dataclasses import dataclass

# Interval dimensions of a box, in this order everywhere (numpy arrays use this column order).
FIELDS: tuple[str, ...] = ("src", "dst", "proto", "sport", "dport", "icmp_type", "icmp_code", "iport", "ct")
WIDTHS: dict[str, int] = {
    "src": 32,
    "dst": 32,
    "proto": 8,
    "sport": 16,
    "dport": 16,
    "icmp_type": 8,
    "icmp_code": 8,
    "iport": 2,
    "ct": 2,
}
MAXV: tuple[int, ...] = tuple((1 << WIDTHS[f]) - 1 for f in FIELDS)
NDIM = len(FIELDS)
FIELD_INDEX = {f: i for i, f in enumerate(FIELDS)}

PROTO_ICMP, PROTO_TCP, PROTO_UDP = 1, 6, 17
# Values of the ct field (see the module docstring).
CT_UNKNOWN, CT_ORIGINAL, CT_REPLY, CT_NONE = 0, 1, 2, 3

# The upper corner of the full box. MAXV (32-bit addresses) except while the front end builds the boxes of an
# ip6tables policy, whose src/dst are 128-bit (ir.family.address_space sets it; compress() brings such a policy back
# to 32-bit ranks before any analysis).
_ZERO: tuple[int, ...] = tuple(0 for _ in FIELDS)
FULL_HI: ContextVar[tuple[int, ...]] = ContextVar("hypafilter_full_hi", default=MAXV)


@dataclass(frozen=True, order=True)
class Box:
    """A hyper-rectangle: closed intervals per FIELDS dimension, plus a ternary test on TCP flags.

    The flags test is `(tcp_flags & flags_mask) == flags_value` (iptables' --tcp-flags); mask 0 = any.
    The sets test is the same ternary over set-slot membership bits (ir.sets): `(sets & sets_mask) == sets_value`,
    bit i = the frame is a member of slot i's set by slot i's directions; mask 0 = any.
    """

    lo: tuple[int, ...]
    hi: tuple[int, ...]
    flags_mask: int = 0
    flags_value: int = 0
    sets_mask: int = 0
    sets_value: int = 0

    def __post_init__(self):
        if len(self.lo) != NDIM or len(self.hi) != NDIM:
            raise ValueError("box needs one interval per field")
        if self.flags_value & ~self.flags_mask:
            raise ValueError("flags_value has bits outside flags_mask")
        if self.sets_value & ~self.sets_mask:
            raise ValueError("sets_value has bits outside sets_mask")

    @staticmethod
    def full() -> Box:
        return Box(_ZERO, FULL_HI.get())

    def with_field(self, name: str, lo: int, hi: int) -> Box:
        i = FIELD_INDEX[name]
        return Box(
            self.lo[:i] + (lo,) + self.lo[i + 1 :],
            self.hi[:i] + (hi,) + self.hi[i + 1 :],
            self.flags_mask,
            self.flags_value,
            self.sets_mask,
            self.sets_value,
        )

    def with_sets(self, mask: int, value: int) -> Box | None:
        """This box with the sets ternary `(sets & mask) == value` added (None: contradicts the box's own)."""
        if (self.sets_value ^ value) & self.sets_mask & mask:
            return None
        return Box(self.lo, self.hi, self.flags_mask, self.flags_value, self.sets_mask | mask, self.sets_value | value)

    def interval(self, name: str) -> tuple[int, int]:
        i = FIELD_INDEX[name]
        return self.lo[i], self.hi[i]

    def is_empty(self) -> bool:
        return any(lo > hi for lo, hi in zip(self.lo, self.hi, strict=True))

    def intersect(self, other: Box) -> Box | None:
        if (self.flags_value ^ other.flags_value) & self.flags_mask & other.flags_mask:
            return None
        if (self.sets_value ^ other.sets_value) & self.sets_mask & other.sets_mask:
            return None
        lo = tuple(max(a, b) for a, b in zip(self.lo, other.lo, strict=True))
        hi = tuple(min(a, b) for a, b in zip(self.hi, other.hi, strict=True))
        if any(a > b for a, b in zip(lo, hi, strict=True)):
            return None
        return Box(
            lo,
            hi,
            self.flags_mask | other.flags_mask,
            self.flags_value | other.flags_value,
            self.sets_mask | other.sets_mask,
            self.sets_value | other.sets_value,
        )

    def contains(self, point: Header) -> bool:
        v = point.values()
        if any(not (lo <= x <= hi) for lo, hi, x in zip(self.lo, self.hi, v, strict=True)):
            return False
        if (point.sets & self.sets_mask) != self.sets_value:
            return False
        return (point.tcp_flags & self.flags_mask) == self.flags_value


def boxes_intersect(a: list[Box], b: list[Box]) -> list[Box]:
    """Intersection of two unions of boxes (pairwise)."""
    out = []
    for x in a:
        for y in b:
            z = x.intersect(y)
            if z is not None:
                out.append(z)
    return out


@dataclass(frozen=True)
class Header:
    """A packet header as a point in the header space (see the module docstring for the zero convention)."""

    src: int = 0
    dst: int = 0
    proto: int = 0
    sport: int = 0
    dport: int = 0
    icmp_type: int = 0
    icmp_code: int = 0
    iport: int = 0
    tcp_flags: int = 0
    ct: int = 0  # not a header byte: what the flow cache knows (CT_*), 0 without one
    sets: int = 0  # not a header byte: bit i = member of set slot i's set by its directions (ir.sets)

    def values(self) -> tuple[int, ...]:
        return (
            self.src, self.dst, self.proto, self.sport, self.dport, self.icmp_type, self.icmp_code, self.iport,
            self.ct,
        )  # fmt: skip


# Box differences can multiply boxes; above this many per rule the subtraction is abandoned and the rule is
# marked approximate instead (still exact in software, only less precise for shunting).
MAX_BOXES = 4096


def box_minus(a: Box, b: Box) -> list[Box]:
    """a \\ b as disjoint boxes (at most 2 per dimension plus one per TCP flag bit and per set-slot bit that b
    tests and a does not)."""
    if a.intersect(b) is None:
        return [a]
    out: list[Box] = []
    lo, hi = list(a.lo), list(a.hi)
    fm, fv, sm, sv = a.flags_mask, a.flags_value, a.sets_mask, a.sets_value
    for i in range(NDIM):
        if lo[i] < b.lo[i]:
            out.append(Box(tuple(lo), tuple(hi[:i] + [b.lo[i] - 1] + hi[i + 1 :]), fm, fv, sm, sv))
            lo[i] = b.lo[i]
        if hi[i] > b.hi[i]:
            out.append(Box(tuple(lo[:i] + [b.hi[i] + 1] + lo[i + 1 :]), tuple(hi), fm, fv, sm, sv))
            hi[i] = b.hi[i]
    free = b.flags_mask & ~a.flags_mask
    for bit in range(8):
        m = 1 << bit
        if free & m:
            out.append(Box(tuple(lo), tuple(hi), fm | m, fv | (~b.flags_value & m), sm, sv))
            fm, fv = fm | m, fv | (b.flags_value & m)
    free = b.sets_mask & ~a.sets_mask
    bit = 0
    while free >> bit:
        m = 1 << bit
        if free & m:
            out.append(Box(tuple(lo), tuple(hi), fm, fv, sm | m, sv | (~b.sets_value & m)))
            sm, sv = sm | m, sv | (b.sets_value & m)
        bit += 1
    return out


def boxes_minus(a: list[Box], b: list[Box], limit: int = MAX_BOXES) -> list[Box] | None:
    """Union a minus union b; None when the result would exceed `limit` boxes."""
    cur = list(a)
    for y in b:
        nxt: list[Box] = []
        for x in cur:
            nxt.extend(box_minus(x, y))
            if len(nxt) > limit:
                return None
        cur = nxt
    return cur


def complement(lo: int, hi: int, top: int) -> list[tuple[int, int]]:
    """The closed intervals of [0, top] outside [lo, hi] (at most two)."""
    out = []
    if lo > 0:
        out.append((0, lo - 1))
    if hi < top:
        out.append((hi + 1, top))
    return out


def complement_union(intervals: list[tuple[int, int]], top: int) -> list[tuple[int, int]]:
    """The closed intervals of [0, top] outside a union of intervals."""
    out, nxt = [], 0
    for lo, hi in sorted(intervals):
        if lo > nxt:
            out.append((nxt, lo - 1))
        nxt = max(nxt, hi + 1)
    if nxt <= top:
        out.append((nxt, top))
    return out


def field_boxes(name: str, intervals: list[tuple[int, int]]) -> list[Box]:
    full = Box.full()
    return [full.with_field(name, lo, hi) for lo, hi in intervals if lo <= hi]


def flags_boxes(mask: int, comp: int, invert: bool) -> list[Box]:
    """Boxes for `(flags & mask) == comp`, or its negation as disjoint ternaries (one per mask bit)."""
    full = Box.full()
    if comp & ~mask:  # the kernel compares against bits outside the mask too: never equal
        return [full] if invert else []
    if not invert:
        return [Box(full.lo, full.hi, mask, comp)]
    out, fixed_mask, fixed_val = [], 0, 0
    for bit in range(8):
        b = 1 << bit
        if mask & b:
            out.append(Box(full.lo, full.hi, fixed_mask | b, fixed_val | (~comp & b)))
            fixed_mask, fixed_val = fixed_mask | b, fixed_val | (comp & b)
    return out


def product_boxes(parts: list[tuple[str, list[tuple[int, int]]]]) -> list[Box]:
    """The boxes of a conjunction of per-field interval unions, each field named at most once: one box per
    combination of intervals (itertools.product order). Empty intervals are dropped."""
    names = [name for name, _ in parts]
    if len(set(names)) != len(names):
        raise ValueError("product_boxes: a field is named twice")
    full = Box.full()
    idx = [FIELD_INDEX[n] for n in names]
    out = []
    for combo in itertools.product(*([(lo, hi) for lo, hi in ivs if lo <= hi] for _, ivs in parts)):
        lo, hi = list(full.lo), list(full.hi)
        for i, (a, b) in zip(idx, combo, strict=True):
            lo[i], hi[i] = a, b
        out.append(Box(tuple(lo), tuple(hi)))
    return out
