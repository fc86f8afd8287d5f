"""Sets in the fast path (issue #24): set slots, set descriptions and elements, format-free.

A *set slot* is one distinct (set name, directions) pair that a simple rule tests with `-m set --match-set`; the
compiled program carries its slots in order, and bit i of a header's `sets` (ir.box.Header.sets) is "the frame is a
member of slot i's set, looked up by slot i's directions". A rule's test becomes the box ternary
`(sets & sets_mask) == sets_value` (bit 1: `--match-set`, bit 0: `! --match-set`).

SetInfo describes a kernel set as `ipset save` or the kernel's netlink dump gives it; SetElem is one element.
Membership follows the kernel's ip_set code (net/netfilter/ipset/): see `member`.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field

# At most this many slots in one compiled program: a rule needing another slot stays complex.
MAX_SET_SLOTS = 8

# The set types the fast path implements (family inet; family inet6 on targets with IPv6 set slots, bitmap:port being
# family-less), and their dimensions (how many directions they read).
SET_TYPES: dict[str, int] = {
    "hash:ip": 1,
    "hash:net": 1,
    "hash:ip,port": 2,
    "hash:net,port": 2,
    "bitmap:port": 1,
}
PORT_TYPES = frozenset({"hash:ip,port", "hash:net,port"})
NET_TYPES = frozenset({"hash:net", "hash:net,port"})


@dataclass(frozen=True)
class SetSlot:
    """One membership bit of the fast path: set `name` of type `settype`, read by `dirs` ("src"/"dst" per
    dimension, as many as the type has)."""

    name: str
    settype: str
    dirs: tuple[str, ...]

    def __str__(self) -> str:
        return f"{self.name} {','.join(self.dirs)}"


@dataclass(frozen=True)
class SetElem:
    """One element. Addresses as ints (IPv4, or 128-bit for a family inet6 set); a net is [addr_lo, addr_hi] with
    `prefix` its length (32 for an IPv4 address, 128 for an IPv6 one). `proto`/`port` for the port types (port = type << 8 | code for icmp, proto 0 = the set's default),
    `port` alone for bitmap:port. `timeout_s` = seconds left when read (None: no timeout). `nomatch` as ipset's."""

    addr_lo: int = 0
    addr_hi: int = 0
    prefix: int = 32
    proto: int = 0
    port: int = 0
    timeout_s: int | None = None
    nomatch: bool = False

    def key(self) -> tuple[int, int, int, int]:
        """What identifies the element in its set (the kernel's element key)."""
        return (self.addr_lo, self.prefix, self.proto, self.port)


@dataclass(frozen=True)
class SetInfo:
    """A kernel set: `ipset create` parameters plus its elements (in the order read)."""

    name: str
    settype: str
    family: str = "inet"
    hashsize: int = 1024
    maxelem: int = 65536
    netmask: int = 32
    timeout_default: int | None = None  # the set's `timeout` (None: the set has no timeout support)
    entries: tuple[SetElem, ...] = ()
    port_range: tuple[int, int] = (0, 65535)  # bitmap:port's range
    options: tuple[str, ...] = field(default=(), compare=False)  # other create options, verbatim (counters, ...)

    @property
    def dimension(self) -> int:
        return SET_TYPES.get(self.settype, 0)

    def supported(self, family: int = 4) -> str:
        """'' when the fast path implements this set for a policy of `family` (4: iptables, 6: ip6tables), else why
        not (for lint). bitmap:port has no family (the kernel's NFPROTO_UNSPEC): either policy reads it."""
        if self.settype not in SET_TYPES:
            return f"set {self.name}: type {self.settype} is not in the fast path"
        want = "inet" if family == 4 else "inet6"
        if self.settype != "bitmap:port" and self.family != want:
            return f"set {self.name}: family {self.family} in an IPv{family} policy"
        return ""


def ip_str(a: int, family: int = 4) -> str:
    return str(ipaddress.IPv4Address(a) if family == 4 else ipaddress.IPv6Address(a))


def elem_matches(info: SetInfo, e: SetElem, src: int, dst: int, proto: int, sport: int, dport: int,
                 dirs: tuple[str, ...]) -> bool:  # fmt: skip
    """Does element e hold the frame's key (the kernel's elem equality after masking), ignoring timeouts?"""
    addr = src if dirs[0] == "src" else dst
    if info.settype == "bitmap:port":
        return e.port == (sport if dirs[0] == "src" else dport)
    if not (e.addr_lo <= addr <= e.addr_hi):
        return False
    if info.settype in PORT_TYPES:
        return e.proto == proto and e.port == (sport if dirs[1] == "src" else dport)
    return True


def frame_ports(proto: int, sport: int, dport: int, icmp_type: int, icmp_code: int) -> tuple[int, int] | None:
    """(source, destination) "port" a set's kadt reads from an unfragmented IPv4 frame (ip_set_get_ip4_port): the
    ports of TCP, UDP, SCTP and UDP-Lite, type << 8 | code for ICMP (both directions), 0 for other protocols; None
    for protocol 0 (no port: no element matches). Headers as the IR has them (SCTP/UDP-Lite ports are no IR field:
    callers pass them)."""
    if proto == 0:
        return None
    if proto == 1:
        p = icmp_type << 8 | icmp_code
        return p, p
    return sport, dport


def frame_ports6(proto: int, sport: int, dport: int, icmp_type: int, icmp_code: int) -> tuple[int, int] | None:
    """(source, destination) "port" a set's kadt reads from an unfragmented IPv6 frame (ip_set_get_ip6_port: the
    upper-layer protocol after ipv6_skip_exthdr): TCP, UDP, SCTP, UDP-Lite ports, type << 8 | code for ICMPv6 (58),
    0 for other protocols; None for no-next-header (59: ipv6_skip_exthdr fails, no element matches). ICMP (1) inside
    IPv6 is read as ICMP by the kernel (type << 8 | code of its first two bytes): callers pass them as icmp fields."""
    if proto == 59:
        return None
    if proto in (1, 58):
        p = icmp_type << 8 | icmp_code
        return p, p
    return sport, dport


def member(info: SetInfo, dirs: tuple[str, ...], src: int, dst: int, proto: int, ports: tuple[int, int] | None,
           now_s: float | None = None) -> bool:  # fmt: skip
    """The kernel's answer to `-m set --match-set info.name dirs` for a frame (no timeouts: every element lives,
    unless `now_s` is given, then elements with timeout_s <= now_s are gone): the reference semantics the fast path's
    tables implement (docs/sets.md). hash:net types: the longest matching prefix decides, a nomatch element there
    answers no. bitmap:port: TCP and UDP only. Fewer dirs than the type's dimension: no."""
    t = info.settype
    if len(dirs) < SET_TYPES.get(t, 99):
        return False
    live = [e for e in info.entries if now_s is None or e.timeout_s is None or e.timeout_s > now_s]
    if t == "bitmap:port":
        if proto not in (6, 17) or ports is None:
            return False
        port = ports[0] if dirs[0] == "src" else ports[1]
        return any(e.port == port for e in live)
    addr = src if dirs[0] == "src" else dst
    if t in PORT_TYPES:
        if ports is None:
            return False
        port = ports[0] if dirs[1] == "src" else ports[1]
        live = [e for e in live if e.proto == proto and e.port == port]
    hits = [e for e in live if e.addr_lo <= addr <= e.addr_hi]
    if not hits:
        return False
    return not max(hits, key=lambda e: e.prefix).nomatch
