"""Structured form of one parsed iptables rule (checks, matches, target) and its geometric reduction to boxes."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from hypafilter.iptables.tables import STATEFUL_MATCHES as STATEFUL
from hypafilter.ir import MAXV, PROTO_TCP, PROTO_UDP, Box, Origin
from hypafilter.ir.box import (
    boxes_intersect,
    complement,
    complement_union,
    field_boxes,
    flags_boxes,
    product_boxes,
)

Boxes = list[Box]


@dataclass
class Addr:
    """`-s`/`-d`: address and netmask (both host-order ints)."""

    net: int
    mask: int
    invert: bool = False

    @property
    def prefix(self) -> int | None:
        inv = ~self.mask & 0xFFFFFFFF
        if inv & (inv + 1):
            return None  # not contiguous
        return 32 - inv.bit_length()

    def intervals(self) -> list[tuple[int, int]] | None:
        p = self.prefix
        if p is None:
            return None
        lo = self.net
        hi = self.net | (~self.mask & 0xFFFFFFFF)
        return complement(lo, hi, MAXV[0]) if self.invert else [(lo, hi)]


@dataclass
class Iface:
    """`-i`/`-o`: interface name (`+` suffix = prefix wildcard)."""

    name: str
    invert: bool = False

    @property
    def matches_all(self) -> bool:
        return self.name == "+"


@dataclass
class PortCheck:
    lo: int
    hi: int
    invert: bool = False

    @property
    def is_full(self) -> bool:
        return self.lo == 0 and self.hi == 0xFFFF

    def intervals(self) -> list[tuple[int, int]]:
        return complement(self.lo, self.hi, 0xFFFF) if self.invert else [(self.lo, self.hi)]


@dataclass
class TcpUdp:
    """`-m tcp` / `-m udp`."""

    name: str
    sport: PortCheck | None = None
    dport: PortCheck | None = None
    flags: tuple[int, int, bool] | None = None  # mask, comp, invert
    option: tuple[int, bool] | None = None  # --tcp-option number, invert (not a header field: complex)


@dataclass
class Multiport:
    """`-m multiport`: kind is sports, dports or ports; entries are (lo, hi, written_as_range)."""

    kind: str = ""
    entries: list[tuple[int, int, bool]] = field(default_factory=list)
    invert: bool = False


@dataclass
class Iprange:
    src: tuple[int, int, bool] | None = None
    dst: tuple[int, int, bool] | None = None


@dataclass
class Icmp:
    type: int = -1
    code_min: int = 0
    code_max: int = 0xFF
    invert: bool = False

    @property
    def is_any(self) -> bool:
        return self.type == 0xFF  # the kernel lets type 255 match every ICMP packet, whatever the codes


@dataclass
class Comment:
    text: str | None = None


@dataclass
class Verbatim:
    """A match the compiler does not model: its tokens after `-m NAME`, kept as written."""

    name: str
    tokens: list[str] = field(default_factory=list)


Match = TcpUdp | Multiport | Iprange | Icmp | Comment | Verbatim


@dataclass
class ParsedRule:
    """One rule as written, before chain flattening."""

    chain: str
    src: Addr | None = None
    dst: Addr | None = None
    iif: Iface | None = None
    oif: Iface | None = None
    proto: int | None = None  # None = no -p; 0 = all
    proto_invert: bool = False
    frag: bool | None = None  # None = no -f; False = ! -f
    matches: list[Match] = field(default_factory=list)
    target: str = ""  # "" = no target
    target_args: list[str] = field(default_factory=list)
    goto: bool = False
    origin: Origin | None = None
    # Filled by `analyse`:
    boxes: Boxes = field(default_factory=list)
    complex: list[tuple[str, ...]] = field(default_factory=list)
    stateful: bool = False
    # Canonical option tokens, set only by the parser's whole-line fast path (canonical.rule_options reads it).
    options_cache: tuple[str, ...] | None = field(default=None, compare=False, repr=False)


def analyse(rule: ParsedRule, hw_ports: dict[str, int], options_of) -> None:
    """Fill rule.boxes (the header part as a union of boxes) and rule.complex (the checks hardware lacks).

    The boxes hold the standard header options and the header matches written before the first match with
    per-rule state; every match from that one on is a complex group (ARCHITECTURE §2: the fast path never
    decides a packet whose walk would have changed state).

    `options_of(match)` gives a match's canonical tokens (from canonical.py), used for complex token groups.
    """
    parts: list = []  # Boxes, or _FieldPart for a union of intervals on one field
    cx: list[tuple[str, ...]] = []
    for a, fname, opt in ((rule.src, "src", "-s"), (rule.dst, "dst", "-d")):
        if a is None:
            continue
        iv = a.intervals()
        if iv is None:  # non-contiguous netmask: not an interval, leave it to netfilter
            cx.append(options_of(("addr", opt, a)))
        elif not (a.mask == 0 and not a.invert):
            parts.append(_FieldPart(fname, iv))
    if rule.iif is not None and not (rule.iif.matches_all and not rule.iif.invert):
        # The ingress device as netfilter sees it (the bridge, for bridged traffic): software decides it.
        cx.append(options_of(("iface", "-i", rule.iif)))
    if rule.oif is not None and not (rule.oif.matches_all and not rule.oif.invert):
        cx.append(options_of(("iface", "-o", rule.oif)))
    if rule.proto:
        p = rule.proto
        parts.append(_FieldPart("proto", complement(p, p, 0xFF) if rule.proto_invert else [(p, p)]))
    if rule.frag is not None:
        cx.append(options_of(("frag", rule.frag)))
    for m in rule.matches:
        if rule.stateful and not isinstance(m, Comment):
            # The kernel evaluates matches in order: a header check written after a match with per-rule state
            # (a limit's bucket, a recent list, a quota) runs only once that match has been evaluated. Left out
            # of the reduction, the hardware region stays a superset of every packet that reaches the state.
            cx.append(options_of(m))
            continue
        if isinstance(m, TcpUdp):
            for pc, fname in ((m.sport, "sport"), (m.dport, "dport")):
                if pc is not None and not (pc.is_full and not pc.invert):
                    parts.append(_FieldPart(fname, pc.intervals()))
            if m.flags is not None:
                parts.append(flags_boxes(*m.flags))
            if m.option is not None:
                cx.append(("-m", "tcp") + (("!",) if m.option[1] else ()) + ("--tcp-option", str(m.option[0])))
        elif isinstance(m, Multiport):
            if rule.proto not in (PROTO_TCP, PROTO_UDP):  # sctp/dccp/udplite ports are not header fields here
                cx.append(options_of(m))
                continue
            iv = [(lo, hi) for lo, hi, _ in m.entries]
            if m.kind == "ports":
                if m.invert:
                    comp = complement_union(iv, 0xFFFF)
                    parts.append(boxes_intersect(field_boxes("sport", comp), field_boxes("dport", comp)))
                else:
                    parts.append(field_boxes("sport", iv) + field_boxes("dport", iv))
            else:
                fname = "sport" if m.kind == "sports" else "dport"
                parts.append(_FieldPart(fname, complement_union(iv, 0xFFFF) if m.invert else iv))
        elif isinstance(m, Iprange):
            for r, fname in ((m.src, "src"), (m.dst, "dst")):
                if r is not None:
                    lo, hi, inv = r
                    parts.append(_FieldPart(fname, complement(lo, hi, MAXV[0]) if inv else [(lo, hi)]))
        elif isinstance(m, Icmp):
            if m.is_any:
                if m.invert:
                    parts.append([])
            else:
                t, c1, c2 = m.type, m.code_min, m.code_max
                inside = [Box.full().with_field("icmp_type", t, t).with_field("icmp_code", c1, c2)]
                if not m.invert:
                    parts.append(inside)
                else:
                    out = field_boxes("icmp_type", complement(t, t, 0xFF))
                    out += [
                        Box.full().with_field("icmp_type", t, t).with_field("icmp_code", lo, hi)
                        for lo, hi in complement(c1, c2, 0xFF)
                    ]
                    parts.append(out)
        elif isinstance(m, Comment):
            pass
        elif isinstance(m, Verbatim):
            if m.name == "physdev":
                port = _physdev_port(m, hw_ports)
                if port is not None:
                    port_no, inv = port
                    parts.append(
                        field_boxes("iport", complement(port_no, port_no, MAXV[7]) if inv else [(port_no, port_no)])
                    )
                    continue
            if m.name in STATEFUL:
                rule.stateful = True
            cx.append(options_of(m))
    rule.boxes = _combine(parts)
    rule.complex = cx


class _FieldPart(tuple):
    """(field, intervals): a union of intervals on one field, kept unexpanded until _combine."""

    def __new__(cls, name: str, intervals):
        return super().__new__(cls, (name, [(lo, hi) for lo, hi in intervals if lo <= hi]))


def _combine(parts: list) -> Boxes:
    """The intersection of the parts as a union of boxes, in the order the pairwise product gives."""
    names = [p[0] for p in parts if isinstance(p, _FieldPart)]
    if len(names) == len(parts) and len(set(names)) == len(names):
        return product_boxes(parts)  # common case: each field restricted once, no flags
    boxes = [Box.full()]
    for p in parts:
        boxes = boxes_intersect(boxes, field_boxes(*p) if isinstance(p, _FieldPart) else p)
    return boxes


def _physdev_port(m: Verbatim, hw_ports: dict[str, int]) -> tuple[int, bool] | None:
    toks = m.tokens
    inv = bool(toks) and toks[0] == "!"
    rest = toks[1:] if inv else toks
    if len(rest) == 2 and rest[0] == "--physdev-in" and not rest[1].endswith("+") and rest[1] in hw_ports:
        return hw_ports[rest[1]], inv
    return None


def target_column(origin: Origin | None, target: str) -> int:
    """1-based column of the jump or goto target `target` in the rule's text (0 when it cannot be found)."""
    if origin is None:
        return 0
    m = re.search(rf"(?:^|\s)(?:-j|-g|--jump|--goto)\s+({re.escape(target)})(?=\s|$)", origin.text)
    return m.start(1) + 1 if m else 0
