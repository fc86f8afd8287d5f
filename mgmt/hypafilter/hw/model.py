"""Python reference model of the hardware core: the header parser and the per-packet decision, bit-exact with hw/.

The VHDL core, its testbenches, the emulated NIC and the verifier all compare against these two functions:
`parse_frame(frame, src_port)` (None = unparsed, shunted with reason 2) and
`decide(plan, frame, src_port, regs)`. The parsing rules are written down once here and in docs/hardware.md:

- Ethernet II, then up to two VLAN tags (0x8100 or 0x88A8, in any order); a third tag is an unknown ethertype.
- Only IPv4 (0x0800) is parsed: version 4, IHL >= 5, total length >= IHL*4 and within the frame
  (frame length = TUSER[15:0], which the testbenches and the emulator set to the byte count of the frame).
- Fragments with offset != 0 are unparsed; a first fragment (offset 0, MF set) is parsed like any packet,
  because its L4 header is present and netfilter matches ports on it the same way.
- L4 bytes needed, all inside the IPv4 total length: TCP 20, UDP 8, ICMP 8 -- the fixed header sizes below which
  the kernel's tcp/udp/icmp matches hotdrop the packet, so a shorter one is left to netfilter (unparsed) rather
  than forwarded by a hardware match the kernel would never make. Other protocols need none (a rule on -p 47
  reads no L4 byte). Only the bytes the parser reads (ports .. TCP flags, ICMP type and code) must lie within the
  first 96 bytes of the frame; the rest of the minimum is checked against the total length alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum

from hypafilter.analysis import decision
from hypafilter.ir import (
    ACTION_ACCEPT,
    ACTION_DROP,
    ACTION_NONE,
    PROTO_ICMP,
    PROTO_TCP,
    PROTO_UDP,
    Header,
)
from hypafilter.shared import C, pack_meta

WIRE_PORTS = {0x01: 0, 0x04: 1, 0x10: 2, 0x40: 3}  # one-hot src_port -> iport
HOST_PORTS = (0x02, 0x08, 0x20, 0x80)
PAIRED = {0x01: 0x04, 0x04: 0x01, 0x10: 0x40, 0x40: 0x10}  # bridge mode: MAC0<->MAC1, MAC2<->MAC3
VLAN_TPIDS = (0x8100, 0x88A8)
ETH_IPV4 = 0x0800
L4_NEED = {PROTO_TCP: 20, PROTO_UDP: 8, PROTO_ICMP: 8}  # xt_tcpudp / xt icmp minimum header sizes
HEADER_BYTES = 96  # every byte the parser reads lies below this offset (2 tags + IHL 15 + 14 TCP bytes)

CONTROL_ENABLE = 1 << 0
CONTROL_SHUNT_ALL = 1 << 1
REASON_OVERRULE = C["HF_REASON_OVERRULE"]
REASON_POLICY = C["HF_REASON_POLICY"]
REASON_UNPARSED = C["HF_REASON_UNPARSED"]


class Kind(IntEnum):
    DROP = 0
    FORWARD = 1
    SHUNT = 2


def _u16(b: bytes, off: int) -> int:
    return (b[off] << 8) | b[off + 1]


def parse_frame(frame: bytes, src_port: int) -> Header | None:
    """The header of a wire frame as the hardware parser sees it, or None when the parser must not guess."""
    iport = WIRE_PORTS.get(src_port, 0)
    n = len(frame)
    if n < 14:
        return None
    et, l3 = _u16(frame, 12), 14
    for _ in range(2):
        if et not in VLAN_TPIDS:
            break
        if l3 + 4 > n:
            return None
        et, l3 = _u16(frame, l3 + 2), l3 + 4
    if et != ETH_IPV4 or l3 + 20 > n:
        return None
    ver, ihl = frame[l3] >> 4, frame[l3] & 0xF
    total = _u16(frame, l3 + 2)
    if ver != 4 or ihl < 5 or total < ihl * 4 or l3 + total > n:
        return None
    if _u16(frame, l3 + 6) & 0x1FFF:
        return None
    proto = frame[l3 + 9]
    src = int.from_bytes(frame[l3 + 12 : l3 + 16], "big")
    dst = int.from_bytes(frame[l3 + 16 : l3 + 20], "big")
    l4 = l3 + ihl * 4
    if l4 + L4_NEED.get(proto, 0) > l3 + total:
        return None
    if proto in (PROTO_TCP, PROTO_UDP):
        flags = frame[l4 + 13] if proto == PROTO_TCP else 0
        return Header(src, dst, proto, _u16(frame, l4), _u16(frame, l4 + 2), 0, 0, iport, flags)
    if proto == PROTO_ICMP:
        return Header(src, dst, proto, 0, 0, frame[l4], frame[l4 + 1], iport, 0)
    return Header(src, dst, proto, 0, 0, 0, 0, iport, 0)


@dataclass
class Regs:
    """The run-time register state the decision depends on (tables as plain lists, n + 1 long)."""

    shunt: list[int]
    actions: list[int]
    generation: int = 0
    control: int = CONTROL_ENABLE

    @staticmethod
    def from_plan(plan) -> Regs:
        return Regs([int(b) for b in plan.shunt], [int(a) for a in plan.actions])


@dataclass
class Decision:
    kind: Kind
    dst_port: int
    meta: int | None  # M (TUSER[127:64]) for SHUNT; None: TUSER[127:64] passes unchanged
    match_index: int | None  # None for frames not classified (from the host, bad src_port)
    action: int
    reason: int | None
    forced: bool = False  # shunted only because of CONTROL bit 1
    counters: tuple[str, ...] = field(default=())  # register names this frame increments


def decide(plan, frame: bytes, src_port: int, regs: Regs) -> Decision:
    """What the core does with one frame arriving on `src_port` (one-hot TUSER[23:16])."""
    n = len(plan.entries)
    gen = regs.generation & 0xFFFF
    if src_port in HOST_PORTS:
        return Decision(Kind.FORWARD, src_port >> 1, None, None, ACTION_NONE, None, counters=("CNT_FROM_HOST",))
    if src_port not in WIRE_PORTS:
        return Decision(Kind.DROP, 0, None, None, ACTION_NONE, None)  # not a port of this datapath: never emitted
    shunt_port = src_port << 1
    hdr = parse_frame(frame, src_port) if regs.control & CONTROL_ENABLE else None
    if hdr is None:
        meta = pack_meta(n, ACTION_NONE, REASON_UNPARSED, gen)
        return Decision(Kind.SHUNT, shunt_port, meta, n, ACTION_NONE, REASON_UNPARSED, False, ("CNT_SHUNT_UNPARSED",))
    idx = decision.match_index(plan, hdr)
    action = regs.actions[idx] & 0xF
    reason = REASON_POLICY if idx == n else REASON_OVERRULE
    rcnt = "CNT_SHUNT_POLICY" if idx == n else "CNT_SHUNT_OVERRULE"
    meta = pack_meta(idx, action, reason, gen)
    if regs.shunt[idx] or action not in (ACTION_ACCEPT, ACTION_DROP):
        return Decision(Kind.SHUNT, shunt_port, meta, idx, action, reason, False, (rcnt,))
    if regs.control & CONTROL_SHUNT_ALL:
        return Decision(Kind.SHUNT, shunt_port, meta, idx, action, reason, True, (rcnt, "CNT_SHUNT_FORCED"))
    if action == ACTION_ACCEPT:
        return Decision(Kind.FORWARD, PAIRED[src_port], None, idx, action, None, False, ("CNT_FORWARDED",))
    return Decision(Kind.DROP, 0, None, idx, action, None, False, ("CNT_DROPPED",))


def out_tuser(tuser: int, d: Decision) -> int:
    """TUSER of the first output beat: dst_port set, M in [127:64] when shunted, every other bit kept."""
    t = (tuser & ~(0xFF << 24)) | (d.dst_port << 24)
    if d.meta is not None:
        t = (t & ((1 << 64) - 1)) | (d.meta << 64)
    return t


class Counters:
    """Expected register counters for a sequence of decisions (PKTIN, PKTOUT, CNT_*, per-entry HITS)."""

    def __init__(self, n_entries: int):
        self.regs: dict[str, int] = {}
        self.hits = [0] * (n_entries + 1)

    def add(self, d: Decision, src_port: int) -> None:
        for name in d.counters:
            self.regs[name] = self.regs.get(name, 0) + 1
        if src_port in WIRE_PORTS:
            self.regs["PKTIN"] = self.regs.get("PKTIN", 0) + 1
        if d.kind != Kind.DROP:
            self.regs["PKTOUT"] = self.regs.get("PKTOUT", 0) + 1
        if d.match_index is not None and d.reason != REASON_UNPARSED:
            self.hits[d.match_index] += 1
