"""Structured form of one parsed iptables rule (checks, matches, target) and its geometric reduction to boxes."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from hypafilter.config import Interfaces, pair
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
from hypafilter.ir.family import ADDR_BITS, ADDR_MAX

Boxes = list[Box]


@dataclass
class Addr:
    """`-s`/`-d`: address and netmask (both host-order ints)."""

    net: int
    mask: int
    invert: bool = False
    family: int = 4  # 6: 128-bit net and mask (ip6tables)

    @property
    def prefix(self) -> int | None:
        top = ADDR_MAX[self.family]
        inv = ~self.mask & top
        if inv & (inv + 1):
            return None  # not contiguous
        return ADDR_BITS[self.family] - inv.bit_length()

    def intervals(self) -> list[tuple[int, int]] | None:
        p = self.prefix
        if p is None:
            return None
        top = ADDR_MAX[self.family]
        lo = self.net
        hi = self.net | (~self.mask & top)
        return complement(lo, hi, top) if self.invert else [(lo, hi)]


@dataclass
class Iface:
    """`-i`/`-o`: interface name (`+` suffix = prefix wildcard)."""

    name: str
    invert: bool = False

    @property
    def matches_all(self) -> bool:
        return self.name == "+"


def if_match(pattern: str, name: str) -> bool:
    """Whether interface `name` matches `pattern` as the kernel compares them (ifname_compare_aligned, nft's
    iifname): the whole name, or with a trailing `+` every name that starts with the rest (`+` alone: any name)."""
    return name.startswith(pattern[:-1]) if pattern.endswith("+") else name == pattern


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
    family: int = 4  # 6: 128-bit addresses (ip6tables)


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
class Icmp6(Icmp):
    """`-m icmp6 --icmpv6-type T[/C]` (ip6tables): the kernel's icmp6_match has no "any" type (IPv4's type 255)."""

    @property
    def is_any(self) -> bool:
        return False


@dataclass
class Comment:
    text: str | None = None


@dataclass
class Verbatim:
    """A match the compiler does not model: its tokens after `-m NAME`, kept as written."""

    name: str
    tokens: list[str] = field(default_factory=list)


Match = TcpUdp | Multiport | Iprange | Icmp | Icmp6 | Comment | Verbatim

# `-p` of an ip6tables rule compares the protocol ipv6_find_hdr(skb, &thoff, -1, ...) returns: the header after the
# extension-header chain (net/ipv6/exthdrs_core.c). With the nf_tables back end (iptables-nft, what this project's
# kernel runs) `-p` is `meta l4proto`, set by nft_set_pktinfo_ipv6 (include/net/netfilter/nf_tables_ipv6.h), which
# passes IP6_FH_F_AUTH: the walk stops at an AH header and 51 is the protocol. So hop-by-hop (0), routing (43),
# fragment (44) and destination options (60) are never the protocol: `-p` of one of them never matches (ip6tables
# warns "never matched protocol"), `! -p` of one matches every frame; `-p 0` is "all". AH (51) is the protocol of a
# frame whose chain reaches AH (legacy ip6_tables' ip6_packet_match passes no flags and walks past AH: there
# `-p ah` never matches; docs/ipv6.md). No Next Header (59) is returned for a chain that ends with it.
# A frame the walk cannot finish (truncated, bad lengths) gets no protocol: no `-p` test matches it under nf_tables
# (hotdrop under legacy); the fast paths hand such frames to the stack unparsed.
IPV6_EXT_PROTOS = frozenset({43, 44, 60})


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
    family: int = 4  # 6: a rule of an ip6tables policy
    # Filled by `analyse`:
    boxes: Boxes = field(default_factory=list)
    complex: list[tuple[str, ...]] = field(default_factory=list)
    stateful: bool = False
    # Interface checks the deployment's Interfaces decided for NIC frames: (the check's tokens, what it became).
    resolved: list[tuple[tuple[str, ...], str]] = field(default_factory=list)
    # An interface check is false for every NIC frame: the rule leaves the hardware analysis (software keeps it).
    never: bool = False
    # Canonical option tokens, set only by the parser's whole-line fast path (canonical.rule_options reads it).
    options_cache: tuple[str, ...] | None = field(default=None, compare=False, repr=False)


NEVER = "false for every NIC frame"
ALWAYS = "true for every NIC frame"


def analyse(rule: ParsedRule, ifaces: Interfaces, options_of) -> None:
    """Fill rule.boxes (the header part as a union of boxes) and rule.complex (the checks hardware lacks).

    The boxes hold the standard header options and the header matches written before the first match with
    per-rule state; every match from that one on is a complex group (ARCHITECTURE §2: the fast path never
    decides a packet whose walk would have changed state).

    `options_of(match)` gives a match's canonical tokens (from canonical.py), used for complex token groups.
    Interface checks are resolved against `ifaces` for the frames the NIC hands to the bridged FORWARD chain
    (docs/policy-language.md, Interfaces); rule.resolved says what each became, rule.never that one is false.
    """
    parts: list = []  # Boxes, or _FieldPart for a union of intervals on one field
    cx: list[tuple[str, ...]] = []
    rule.resolved, rule.never = [], False
    for a, fname, opt in ((rule.src, "src", "-s"), (rule.dst, "dst", "-d")):
        if a is None:
            continue
        iv = a.intervals()
        if iv is None:  # non-contiguous netmask: not an interval, leave it to netfilter
            cx.append(options_of(("addr", opt, a)))
        elif not (a.mask == 0 and not a.invert):
            parts.append(_FieldPart(fname, iv))
    for iface, opt, what in ((rule.iif, "-i", "input"), (rule.oif, "-o", "output")):
        if iface is None or (iface.matches_all and not iface.invert):
            continue
        toks = options_of(("iface", opt, iface))
        if not ifaces.bridged:  # the device netfilter sees is unknown here: software decides the check
            cx.append(toks)
            continue
        # br_netfilter hands a bridged frame to FORWARD with the bridge as its input and output device.
        holds = if_match(iface.name, ifaces.bridge) != iface.invert
        rule.resolved.append((toks, f"{ALWAYS if holds else NEVER} (its {what} device is the bridge {ifaces.bridge})"))
        rule.never |= not holds
    if rule.proto and rule.family == 6 and rule.proto in IPV6_EXT_PROTOS:
        if not rule.proto_invert:  # never the upper-layer protocol (see IPV6_EXT_PROTOS); `!` of it: every frame
            parts.append([])
    elif rule.proto:
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
                    top = ADDR_MAX[m.family]
                    parts.append(_FieldPart(fname, complement(lo, hi, top) if inv else [(lo, hi)]))
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
                ports = _physdev_ports(m, ifaces)
                if ports is not None:
                    rule.resolved.append((options_of(m), _ports_text(ports, ifaces)))
                    if not ports:
                        rule.never = True
                    elif ports != ifaces.all_ports or not ifaces.bridged:
                        parts.append(_FieldPart("iport", _runs(ports)))
                    continue
            if m.name in STATEFUL:
                rule.stateful = True
            cx.append(options_of(m))
    if rule.never:  # no NIC frame matches: nothing of it is hardware's business (software keeps the rule)
        rule.boxes, rule.complex = [], []
        return
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


PHYSDEV_OPTIONS = {  # option -> takes an interface name
    "--physdev-in": True,
    "--physdev-out": True,
    "--physdev-is-in": False,
    "--physdev-is-out": False,
    "--physdev-is-bridged": False,
}


def physdev_options(tokens: list[str]) -> list[tuple[str, str, bool]] | None:
    """A physdev match's options as (option, name, negated), or None when they are not all understood."""
    out: list[tuple[str, str, bool]] = []
    i = 0
    while i < len(tokens):
        inv = tokens[i] == "!"
        i += inv
        if i >= len(tokens) or tokens[i] not in PHYSDEV_OPTIONS or any(o == tokens[i] for o, _, _ in out):
            return None
        opt, name = tokens[i], ""
        i += 1
        if PHYSDEV_OPTIONS[opt]:
            if i >= len(tokens) or not 0 < len(tokens[i]) < 16 or tokens[i] == "!":
                return None
            name, i = tokens[i], i + 1
        out.append((opt, name, inv))
    return out or None


def _physdev_ports(m: Verbatim, ifaces: Interfaces) -> set[int] | None:
    """The NIC ports whose frames the physdev match `m` holds for, or None when that is not known.

    In bridge mode a NIC frame in on port n is bridged from the interface of n to the interface of pair(n): it
    entered by a bridge port, leaves by one and is bridged (xt_physdev, FORWARD). Without a bridge only
    `[!] --physdev-in NAME` of a mapped NAME is known: the one port that interface is."""
    opts = physdev_options(m.tokens)
    if opts is None:
        return None
    if not ifaces.bridged:
        if len(opts) != 1 or opts[0][0] != "--physdev-in" or ifaces.port(opts[0][1]) is None:
            return None
        port = ifaces.port(opts[0][1])
        return set(range(MAXV[7] + 1)) - {port} if opts[0][2] else {port}
    ports = set()
    for name, port in ifaces.ports:
        seen = {"--physdev-in": name, "--physdev-out": ifaces.name(pair(port))}
        if all((opt not in seen or if_match(arg, seen[opt])) != inv for opt, arg, inv in opts):
            ports.add(port)
    return ports


def _runs(ports: set[int]) -> list[tuple[int, int]]:
    """Sorted ports as intervals of consecutive ones ({1, 2, 3} -> [(1, 3)])."""
    out: list[tuple[int, int]] = []
    for p in sorted(ports):
        if out and out[-1][1] == p - 1:
            out[-1] = (out[-1][0], p)
        else:
            out.append((p, p))
    return out


def _ports_text(ports: set[int], ifaces: Interfaces) -> str:
    if not ports:
        return f"{NEVER} (no NIC port's frames: {ifaces.describe()})"
    if ifaces.bridged and ports == ifaces.all_ports:
        return f"{ALWAYS} (every NIC port's frames: {ifaces.describe()})"
    names = [f"MAC{p} ({ifaces.name(p)})" if ifaces.name(p) else f"MAC{p}" for p in sorted(ports)]
    return "hardware field iport: frames in on " + ", ".join(names)


def target_column(origin: Origin | None, target: str) -> int:
    """1-based column of the jump or goto target `target` in the rule's text (0 when it cannot be found)."""
    if origin is None:
        return 0
    m = re.search(rf"(?:^|\s)(?:-j|-g|--jump|--goto)\s+({re.escape(target)})(?=\s|$)", origin.text)
    return m.start(1) + 1 if m else 0
