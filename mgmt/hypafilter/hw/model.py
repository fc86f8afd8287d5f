"""Python reference model of the hardware core: the header parser and the per-packet decision, bit-exact with hw/.

The VHDL core, its testbenches, the emulated NIC and the verifier all compare against these two functions:
`parse_frame(frame, src_port)` (None = unparsed, shunted with reason 2) and
`decide(plan, frame, src_port, regs)`. The parsing rules are written down once here and in docs/hardware.md:

- Ethernet II. Destination MACs 01:80:C2:00:00:00..0F (STP and the other link-local groups) are unparsed: the
  Linux bridge treats them specially (it may not forward them, or hand them to the host), so the host decides.
- One VLAN tag (0x8100 or 0x88A8) is parsed: the kernel's receive path pops either into the packet's metadata,
  and br_netfilter (bridge-nf-filter-vlan-tagged=1) filters the IPv4 inside. Two tags (either TPID, in any
  order) make the frame *unfilterable* (`unfilterable`): after the outer tag is popped the frame is still tagged,
  so no iptables rule sees it and the kernel bridge passes it unfiltered (measured on this kernel; see
  docs/hardware.md). `decide` drops such frames and counts them in CNT_DROP_UNFILTERABLE, unless CONTROL bit 2
  (PASS_UNFILTERABLE) is set: then they are unparsed and the host's bridge passes them as the kernel does.
- Only IPv4 (0x0800) is parsed: version 4, IHL >= 5, total length >= IHL*4 and ending exactly where the frame
  ends (frame length = TUSER[15:0], which the testbenches and the emulator set to the byte count of the frame):
  br_netfilter trims bytes after the datagram (Ethernet padding included) before the filter runs, so the kernel
  forwards a shorter frame than it received, which only netfilter can reproduce; and a correct header checksum
  over all IHL*4 bytes (br_netfilter drops a bridged packet whose checksum is wrong).
- Every fragment (MF set or offset != 0) is unparsed: a conntrack rule anywhere turns on defragmentation, and
  then only the reassembled packet is filtered, so the hardware must not decide any piece of it.
- L4 bytes needed, all inside the IPv4 total length: TCP 20, UDP 8, ICMP 8 -- the fixed header sizes below which
  the kernel's tcp/udp/icmp matches hotdrop the packet, so a shorter one is left to netfilter (unparsed) rather
  than forwarded by a hardware match the kernel would never make. Other protocols need none (a rule on -p 47
  reads no L4 byte). Only the bytes the parser reads (ports .. TCP flags, ICMP type and code) must lie within the
  first 96 bytes of the frame; the rest of the minimum is checked against the total length alone.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from enum import IntEnum

import numpy as np

from hypafilter.analysis import decision
from hypafilter.analysis.geometry import BoxSet
from hypafilter.analysis.overlay import Overlay, hw_indices
from hypafilter.analysis.plan import action_words
from hypafilter.config import NIC_MODES
from hypafilter.hw import settable, updatebuffer
from hypafilter.hw.updatebuffer import Image
from hypafilter.ir import (
    ACTION_ACCEPT,
    ACTION_DROP,
    ACTION_NONE,
    PROTO_ICMP,
    PROTO_TCP,
    PROTO_UDP,
    Header,
)
from hypafilter.ir.box import CT_NONE
from hypafilter.shared import C, pack_meta

WIRE_PORTS = {0x01: 0, 0x04: 1, 0x10: 2, 0x40: 3}  # one-hot src_port -> iport
HOST_PORTS = (0x02, 0x08, 0x20, 0x80)
PAIRED = {0x01: 0x04, 0x04: 0x01, 0x10: 0x40, 0x40: 0x10}  # bridge mode: MAC0<->MAC1, MAC2<->MAC3
VLAN_TPIDS = (0x8100, 0x88A8)  # 802.1Q, 802.1ad
ETH_IPV4 = 0x0800
LINK_LOCAL_PREFIX = bytes.fromhex("0180c20000")  # 01:80:C2:00:00:00..0F: the bridge's link-local groups
L4_NEED = {PROTO_TCP: 20, PROTO_UDP: 8, PROTO_ICMP: 8}  # xt_tcpudp / xt icmp minimum header sizes
HEADER_BYTES = 96  # every byte the parser reads lies below this offset (1 tag + IHL 15 + 14 TCP bytes = 92)

CONTROL_ENABLE = 1 << 0
CONTROL_SHUNT_ALL = 1 << 1
CONTROL_PASS_UNFILTERABLE = 1 << 2
CONTROL_HOST_MODE = 1 << 3
CONTROL_MISS_SHUNT_ACCEPT = 1 << 4
CONTROL_MISS_SHUNT_DROP = 1 << 5
CONTROL_MISS_SHUNT = CONTROL_MISS_SHUNT_ACCEPT | CONTROL_MISS_SHUNT_DROP
# a dual-stack core's IPv6 frames the flow cache does not know (ct 0; bit 6 also ct 3 accepted) by the IPv6 plan's miss
# forcing (docs/ipv6.md "## emu")
CONTROL_MISS_SHUNT6_ACCEPT = 1 << 6
CONTROL_MISS_SHUNT6_DROP = 1 << 7
CONTROL_MISS_SHUNT6 = CONTROL_MISS_SHUNT6_ACCEPT | CONTROL_MISS_SHUNT6_DROP
REASON_OVERRULE = C["HF_REASON_OVERRULE"]
REASON_POLICY = C["HF_REASON_POLICY"]
REASON_UNPARSED = C["HF_REASON_UNPARSED"]
REASON_STATE = C["HF_REASON_STATE"]
REASON_MIRROR = C["HF_REASON_MIRROR"]
ACTION_MIRROR_BIT = C["HF_ACTION_MIRROR_BIT"]  # in the ACTION table word: the entry's decided frames are mirrored
CNT_MIRROR = "CNT_MIRROR"  # counts every frame delivered with reason 4
REASON_DECIDED = C["HF_REASON_DECIDED"]
NO_INDEX = 0xFFFFFF  # M[23:0] of a frame shunted for an uncertain set lookup or not judged: no hardware index (k = 0)


class Kind(IntEnum):
    DROP = 0
    FORWARD = 1
    SHUNT = 2
    # Log mirroring (reason 4): the verdict is the hardware's; the ingress port's DMA queue gets the frame with M.
    # ACCEPT in bridge mode: dst_port = paired MAC | DMA queue (the MAC copy untagged, the DMA copy tagged);
    # DROP: dst_port = DMA queue only; host-mode ACCEPT: the DMA queue (the frame itself, reason 4).
    MIRROR = 3


def _u16(b: bytes, off: int) -> int:
    return (b[off] << 8) | b[off + 1]


def unfilterable(frame: bytes) -> bool:
    """Two VLAN tags (802.1Q or 802.1ad, in any order): a frame the bridge's netfilter never filters."""
    return len(frame) >= 18 and _u16(frame, 12) in VLAN_TPIDS and _u16(frame, 16) in VLAN_TPIDS


def link_local(frame: bytes) -> bool:
    """Destination 01:80:C2:00:00:00..0F, a group the Linux bridge never treats as ordinary traffic."""
    return frame[:5] == LINK_LOCAL_PREFIX and len(frame) > 5 and frame[5] < 0x10


def ipv4_header_sum(header: bytes) -> int:
    """The ones' complement sum of the header's 16-bit words, folded as ip_fast_csum does: 0xFFFF when the
    checksum field is right."""
    s = sum(_u16(header, k) for k in range(0, len(header) - 1, 2))
    while s > 0xFFFF:
        s = (s & 0xFFFF) + (s >> 16)
    return s


def parse_frame(frame: bytes, src_port: int) -> Header | None:
    """The header of a wire frame as the hardware parser sees it, or None when the parser must not guess."""
    iport = WIRE_PORTS.get(src_port, 0)
    n = len(frame)
    if n < 14 or unfilterable(frame) or link_local(frame):
        return None
    et, l3 = _u16(frame, 12), 14
    if et in VLAN_TPIDS:
        if n < 18:
            return None
        et, l3 = _u16(frame, 16), 18
    if et != ETH_IPV4 or l3 + 20 > n:
        return None
    ver, ihl = frame[l3] >> 4, frame[l3] & 0xF
    total = _u16(frame, l3 + 2)
    if ver != 4 or ihl < 5 or total < ihl * 4 or l3 + total != n:
        return None
    if _u16(frame, l3 + 6) & 0x3FFF:  # MF or a fragment offset
        return None
    if ipv4_header_sum(frame[l3 : l3 + ihl * 4]) != 0xFFFF:
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


def l4_ok(frame: bytes) -> bool:
    """The parser's h_l4_ok for a frame parse_frame parses: False when conntrack's tcp_error or udp_error calls the
    packet INVALID for its lengths (TCP data offset below 5 words or beyond the IPv4 payload, UDP length field below
    8 or beyond it), whatever its connection's state; such a frame never hits the flow cache. True for every other
    protocol. (The rest of their checks: the TCP flags are the flow cache's bypass, flowcache.bypass; the
    checksums the core cannot check before it decides, docs/flowsync.md.)"""
    l3 = 18 if _u16(frame, 12) in VLAN_TPIDS else 14
    ihl, proto = frame[l3] & 0xF, frame[l3 + 9]
    l4, room = l3 + ihl * 4, _u16(frame, l3 + 2) - ihl * 4
    if proto == PROTO_TCP:
        return 5 <= frame[l4 + 12] >> 4 and (frame[l4 + 12] >> 4) * 4 <= room
    if proto == PROTO_UDP:
        return 8 <= _u16(frame, l4 + 4) <= room
    return True


def miss_ct(frame: bytes, src_port: int = 0x01) -> int:
    """The ct the xdp program gives a frame conntrack holds no entry for, with HFX_CT_NONE (docs/xdp.md "New
    flows"): 3 for a parsed TCP or UDP frame whose lengths conntrack accepts (the program looks it up), else 0 (ICMP
    and other protocols are not looked up; unparsed frames get no ct)."""
    h = parse_frame(frame, src_port)
    return CT_NONE if h is not None and h.proto in (PROTO_TCP, PROTO_UDP) and l4_ok(frame) else 0


def nic_miss_ct(frame: bytes, src_port: int, possible_member: bool, complete: bool) -> int:
    """The ct the core gives a wire frame its flow cache misses, with the conntrack membership structure
    (hw/ctmember.py, docs/flowsync.md "New flows on the NIC"): 3 while COMPLETE holds (`complete`: CTM_CONTROL bit 0
    and CTM_LEASE running) for a frame whose key the structure does not hold (`possible_member` False: no counter
    test passes, no recent egress stamp) and that the xdp program would look up (`miss_ct`: parsed TCP/UDP, lengths
    conntrack accepts); else 0."""
    return miss_ct(frame, src_port) if complete and not possible_member else 0


@dataclass
class Regs:
    """The run-time register state the decision depends on: the tables as plain lists, one value per hardware index
    (n + 1 + δ rows; n + 1 for a core without an update buffer), `actions` holding the ACTION table words (action
    code | ACTION_MIRROR_BIT), and the update buffer's tables VALID and BUF (`buffer`, hw.updatebuffer.Image; None:
    the plan's own overlay, if it has one, else none)."""

    shunt: list[int]
    actions: list[int]
    generation: int = 0
    control: int = CONTROL_ENABLE
    buffer: Image | None = None
    lease_expired: bool = False  # the policy sync lease (`Lease`) ran out: no wire frame is judged
    # the shunt bits for a frame with ct 3 (no conntrack entry; Plan.shunt_none): the xdp target's hfx_ent shunt
    # bit 1, the NIC's table SHUNT_NONE (ct 3 from its conntrack membership structure, hw/ctmember.py). None: `shunt`.
    shunt_none: list[int] | None = None
    # the set slots' tables (hw.settable.SlotState per slot of plan.set_slots); None: as after reset (every lookup
    # uncertain) for a plan with set slots
    sets: tuple | None = None

    @staticmethod
    def from_plan(plan, unfilterable: str = "drop", nic_mode: str = "bridge") -> Regs:
        """The registers as the register client leaves them for `plan` (Config.unfilterable, Config.nic_mode): a Plan's
        tables with the slots' rows as after reset (shunted, no action) and an empty buffer, or an
        analysis.overlay.View's rows, valid mask and slots."""
        control = CONTROL_ENABLE | unfilterable_control(unfilterable) | nic_mode_control(nic_mode)
        control |= miss_shunt_control(getattr(plan, "miss_shunt", (False, False)))
        n, rows = len(plan.entries), updatebuffer.rows(plan)
        shunt, actions = [int(b) for b in plan.shunt], action_words(plan)
        shunt += [1] * (rows - len(shunt))
        actions += [0] * (rows - len(actions))
        ov = getattr(plan, "overlay", None)
        buf = updatebuffer.image(ov) if ov is not None else updatebuffer.pristine(n, updatebuffer.buffer_depth(plan))
        none = getattr(plan, "shunt_none", None)
        shunt_none = None if none is None else [int(b) for b in none] + [1] * (rows - len(none))
        slots = getattr(plan, "set_slots", ())
        policy = getattr(plan, "policy", None)
        sets = settable.slot_states(slots, getattr(policy, "sets", {}) or {}) if slots else None
        return Regs(shunt, actions, control=control, buffer=buf, shunt_none=shunt_none, sets=sets)


LEASE_MAX = 0xFFFFFFFF
LEASE_EXPIRIES_MAX = 0xFFFF


@dataclass
class Lease:
    """The policy sync lease (registers LEASE and LEASE_STATUS) as hf_regs keeps it: ticks left, armed (the last write
    was not 0) and the expiries since reset. Per clock cycle the ticks of that cycle come first (`tick`), then a write
    of LEASE (`write`), which wins over them. Armed and at 0 it has expired: the core then judges no wire frame
    (`Regs.lease_expired`), from the cycle after the counter reached 0."""

    left: int = 0
    armed: bool = False
    expiries: int = 0

    def write(self, value: int) -> None:
        if not 0 <= value <= LEASE_MAX:
            raise ValueError(f"LEASE takes 0..{LEASE_MAX} ticks, not {value}")
        self.left, self.armed = value, value != 0

    def tick(self, ticks: int = 1) -> None:
        if self.left > ticks:
            self.left -= ticks
            return
        if self.armed and self.left and self.expiries < LEASE_EXPIRIES_MAX:
            self.expiries += 1
        self.left = 0

    @property
    def expired(self) -> bool:
        return self.armed and self.left == 0

    def status(self) -> int:
        """The LEASE_STATUS word."""
        return self.expiries << 16 | int(self.expired) << 1 | int(self.armed)


def lease_status(word: int) -> dict:
    """A LEASE_STATUS word as {armed, expired, expiries}."""
    return {"armed": bool(word & 1), "expired": bool(word & 2), "expiries": word >> 16}


def unfilterable_control(setting: str) -> int:
    """The CONTROL bits of Config.unfilterable: "drop" (the default) or "pass"."""
    bits = {"drop": 0, "pass": CONTROL_PASS_UNFILTERABLE}
    if setting not in bits:
        raise ValueError(f"unfilterable must be drop or pass, not {setting!r}")
    return bits[setting]


def nic_mode_control(mode: str) -> int:
    """The CONTROL bits of Config.nic_mode: "bridge" (the default) or "host" (bit 3, HOST_MODE)."""
    if mode not in NIC_MODES:
        raise ValueError(f"nic_mode must be bridge or host, not {mode!r}")
    return CONTROL_HOST_MODE if mode == "host" else 0


def miss_shunt_control(miss_shunt) -> int:
    """The CONTROL bits 4/5 (MISS_SHUNT_ACCEPT, MISS_SHUNT_DROP) of Plan.miss_shunt, (accept, drop)."""
    accept, drop = miss_shunt
    return (CONTROL_MISS_SHUNT_ACCEPT if accept else 0) | (CONTROL_MISS_SHUNT_DROP if drop else 0)


def miss_shunt6_control(miss_shunt6) -> int:
    """The CONTROL bits 6/7 (MISS_SHUNT6_ACCEPT, MISS_SHUNT6_DROP) of a dual-stack core's IPv6 plan's miss_shunt."""
    accept, drop = miss_shunt6
    return (CONTROL_MISS_SHUNT6_ACCEPT if accept else 0) | (CONTROL_MISS_SHUNT6_DROP if drop else 0)


@dataclass
class Decision:
    kind: Kind
    dst_port: int
    meta: int | None  # M (TUSER[127:64]) for SHUNT and host-mode FORWARD; None: TUSER[127:64] passes unchanged
    match_index: int | None  # None for frames not classified (from the host, bad src_port)
    action: int
    reason: int | None
    forced: bool = False  # shunted only because of CONTROL bit 1
    counters: tuple[str, ...] = field(default=())  # register names this frame increments


def decide(plan, frame: bytes, src_port: int, regs: Regs, ct: int = 0, shunted: bool = False) -> Decision:
    """What the core does with one frame arriving on `src_port` (one-hot TUSER[23:16]); `ct` is what the flow cache
    knows of it (ir.box CT_*: 0 unknown, 1/2 a hit in the original/reply direction), 0 without a flow cache; 3 (no
    conntrack entry: the kernel reads the frame as NEW or INVALID) from the xdp target's lookup or the NIC's conntrack
    membership structure (hw/ctmember.py: not a member, no recent egress, COMPLETE). `shunted`: the NIC's shunt stamp
    of the frame's key is recent (hw/ctmember.py `CtMember.shunted`: a wire frame of that key went to the host less
    than the window ago, or the frame just before it did); a frame with ct 3 then goes to the host with reason 3 and
    no index, since the frame that went may create its entry before the host sees it.

    The hardware index (match_index, the row of every table) is `hw_index`: the static first match under the update
    buffer's valid mask and slots (`regs.buffer`). Precedence (the first that applies): a host port, not a wire port,
    unfilterable drop; unparsed (reason 2);
    the entry's shunt bit (for ct 3: `regs.shunt_none`), a non-decisive action, shunt everything (reasons 0/1); miss
    forcing, CONTROL bits 4/5 for a frame with ct = 0 whose verdict would be ACCEPT/DROP, and bit 4 for a frame with
    ct = 3 whose verdict would be ACCEPT (reason 3: conntrack must create its entry; a NEW frame the policy drops
    leaves none); the entry's mirror bit (ACTION word bit 3, reason 4: Kind.MIRROR); host-mode ACCEPT (reason 5);
    forward or drop. An expired policy sync lease (`regs.lease_expired`) acts as CONTROL bit 0 clear: every wire
    frame unparsed, two-tag frames included, and with no index (M[23:0] = NO_INDEX, match_index None): the shim marks
    a frame unparsed by a core that judged it (M[23:0] = n) for the live K0 tree, never one the core did not judge."""
    n = len(plan.entries)
    gen = regs.generation & 0xFFFF
    if src_port in HOST_PORTS:
        return Decision(Kind.FORWARD, src_port >> 1, None, None, ACTION_NONE, None, counters=("CNT_FROM_HOST",))
    if src_port not in WIRE_PORTS:
        return Decision(Kind.DROP, 0, None, None, ACTION_NONE, None)  # not a port of this datapath: never emitted
    shunt_port = src_port << 1
    enabled = regs.control & CONTROL_ENABLE and not regs.lease_expired
    if enabled and not regs.control & CONTROL_PASS_UNFILTERABLE and unfilterable(frame):
        return Decision(Kind.DROP, 0, None, None, ACTION_NONE, None, False, ("CNT_DROP_UNFILTERABLE",))
    hdr = parse_frame(frame, src_port) if enabled else None
    if hdr is not None and ct:
        hdr = dataclasses.replace(hdr, ct=ct & 3)
    if hdr is None and not enabled:
        # not judged (CONTROL bit 0 clear, the lease expired): no index, so the shim never takes it for a frame the
        # core judged unparsed while it vouched for its tables (docs/shim.md, "The live K0 tree on the NIC")
        meta = pack_meta(NO_INDEX, ACTION_NONE, REASON_UNPARSED, gen)
        return Decision(
            Kind.SHUNT, shunt_port, meta, None, ACTION_NONE, REASON_UNPARSED, False, ("CNT_SHUNT_UNPARSED",)
        )
    if hdr is None:
        meta = pack_meta(n, ACTION_NONE, REASON_UNPARSED, gen)
        return Decision(Kind.SHUNT, shunt_port, meta, n, ACTION_NONE, REASON_UNPARSED, False, ("CNT_SHUNT_UNPARSED",))
    slots = getattr(plan, "set_slots", ())
    if slots:
        states = (
            regs.sets
            if regs.sets is not None
            else tuple(settable.SlotState(s.settype, tuple(s.dirs), (), True) for s in slots)
        )
        bits, unc = settable.set_bits(states, hdr)
        if unc:
            # a set lookup rests on an uncertain element: no index (the shim gives k = 0, the whole policy)
            meta = pack_meta(NO_INDEX, ACTION_NONE, REASON_STATE, gen)
            cnt = ("CNT_SHUNT_STATE", "CNT_SET_UNCERTAIN")
            return Decision(Kind.SHUNT, shunt_port, meta, None, ACTION_NONE, REASON_STATE, False, cnt)
        hdr = dataclasses.replace(hdr, sets=bits)
    if hdr.ct == CT_NONE and shunted:
        meta = pack_meta(NO_INDEX, ACTION_NONE, REASON_STATE, gen)
        return Decision(Kind.SHUNT, shunt_port, meta, None, ACTION_NONE, REASON_STATE, False, ("CNT_SHUNT_STATE",))
    idx = hw_index(plan, hdr, regs.buffer)
    word = regs.actions[idx] & 0xF
    action = word & 0x7  # bit 3 is the mirror bit (HF_ACTION_MIRROR_BIT), never part of the action code
    reason = REASON_POLICY if idx == n else REASON_OVERRULE
    rcnt = "CNT_SHUNT_POLICY" if idx == n else "CNT_SHUNT_OVERRULE"
    meta = pack_meta(idx, action, reason, gen)
    bits = regs.shunt_none if hdr.ct == CT_NONE and regs.shunt_none is not None else regs.shunt
    if bits[idx] or action not in (ACTION_ACCEPT, ACTION_DROP):
        return Decision(Kind.SHUNT, shunt_port, meta, idx, action, reason, False, (rcnt,))
    if regs.control & CONTROL_SHUNT_ALL:
        return Decision(Kind.SHUNT, shunt_port, meta, idx, action, reason, True, (rcnt, "CNT_SHUNT_FORCED"))
    if (
        not hdr.ct
        and regs.control
        & (
            (CONTROL_MISS_SHUNT_ACCEPT if action == ACTION_ACCEPT else 0)
            | (CONTROL_MISS_SHUNT_DROP if action == ACTION_DROP else 0)
        )
    ) or (hdr.ct == CT_NONE and action == ACTION_ACCEPT and regs.control & CONTROL_MISS_SHUNT_ACCEPT):
        # conntrack must see a frame of a connection the fast path does not know (Plan.miss_shunt)
        meta = pack_meta(idx, action, REASON_STATE, gen)
        return Decision(Kind.SHUNT, shunt_port, meta, idx, action, REASON_STATE, False, ("CNT_SHUNT_STATE",))
    if word & ACTION_MIRROR_BIT and action in (ACTION_ACCEPT, ACTION_DROP):
        # log mirroring: the hardware's verdict stands; the host gets a copy (bridge ACCEPT: also forwarded; host
        # ACCEPT: the frame itself) with reason 4 and the action without the mirror bit
        meta = pack_meta(idx, action, REASON_MIRROR, gen)
        if action == ACTION_DROP:
            dst, cnt = shunt_port, ("CNT_DROPPED", CNT_MIRROR)
        elif regs.control & CONTROL_HOST_MODE:
            dst, cnt = shunt_port, ("CNT_FORWARDED", CNT_MIRROR)
        else:
            dst, cnt = PAIRED[src_port] | shunt_port, ("CNT_FORWARDED", CNT_MIRROR)
        return Decision(Kind.MIRROR, dst, meta, idx, action, REASON_MIRROR, False, cnt)
    if action == ACTION_ACCEPT and regs.control & CONTROL_HOST_MODE:
        # host mode: the verdict is final; the frame goes to the ingress port's DMA queue as a shunt does
        meta = pack_meta(idx, action, REASON_DECIDED, gen)
        return Decision(Kind.FORWARD, shunt_port, meta, idx, action, REASON_DECIDED, False, ("CNT_FORWARDED",))
    if action == ACTION_ACCEPT:
        return Decision(Kind.FORWARD, PAIRED[src_port], None, idx, action, None, False, ("CNT_FORWARDED",))
    return Decision(Kind.DROP, 0, None, idx, action, None, False, ("CNT_DROPPED",))


@functools.lru_cache(maxsize=64)
def _overlay(img: Image) -> Overlay:
    return updatebuffer.overlay_of(img)


def hw_index(plan, hdr: Header, buffer: Image | None) -> int:
    """The hardware index of a parsed header: the plan's static entries under the update buffer's register image
    (analysis.overlay.hw_indices, the one definition); without an image the plan's own decision
    (analysis.decision.match_index, which applies a View's overlay)."""
    if buffer is None:
        return decision.match_index(plan, hdr)
    if buffer.n != len(plan.entries):
        raise ValueError(f"update buffer image of {buffer.n} static entries for a plan of {len(plan.entries)}")
    ov = _overlay(buffer)
    if ov.pristine and getattr(plan, "overlay", None) is None:
        return decision.match_index(plan, hdr)
    points = BoxSet.points(
        np.array([hdr.values()], dtype=np.int64), np.array([hdr.tcp_flags | hdr.sets << 8], dtype=np.int64)
    )
    return int(hw_indices(decision.entry_set(plan), ov, points)[0])


def out_tuser(tuser: int, d: Decision) -> int:
    """TUSER of the first output beat: dst_port set, M in [127:64] when shunted, every other bit kept."""
    t = (tuser & ~(0xFF << 24)) | (d.dst_port << 24)
    if d.meta is not None:
        t = (t & ((1 << 64) - 1)) | (d.meta << 64)
    return t


class Counters:
    """Expected register counters for a sequence of decisions (PKTIN, PKTOUT, CNT_*, per-row HITS: n + 1, and the
    buffer slots' rows as frames reach them)."""

    def __init__(self, n_entries: int, depth: int = 0):
        self.regs: dict[str, int] = {}
        self.hits = [0] * (n_entries + 1 + depth)

    def add(self, d: Decision, src_port: int) -> None:
        for name in d.counters:
            self.regs[name] = self.regs.get(name, 0) + 1
        if src_port in WIRE_PORTS:
            self.regs["PKTIN"] = self.regs.get("PKTIN", 0) + 1
        if d.kind != Kind.DROP:
            self.regs["PKTOUT"] = self.regs.get("PKTOUT", 0) + 1
        if d.match_index is not None and d.reason != REASON_UNPARSED:
            if d.match_index >= len(self.hits):
                self.hits += [0] * (d.match_index + 1 - len(self.hits))
            self.hits[d.match_index] += 1


def hw_index6(entries6, ov6: Overlay, hdr: Header) -> int:
    """The local IPv6 index (hardware index - V6_BASE) of a parsed IPv6 header on a dual-stack core whose IPv6 update
    buffer holds `ov6` (analysis.overlay.align6's overlay, hw/hf_update_buffer6.vhd): the first static IPv6 entry
    (`entries6`, boxes in 128-bit address space: analysis.overlay.unranked_boxes) that VALID6 keeps and that holds
    the header (n6: none, the IPv6 policy entry), then the first slot, in slot order, that holds it and whose position
    is at most that: n6 + 1 + b (analysis.overlay.hw_indices' rule, on Python ints: the addresses are 128-bit)."""
    t = hdr.values()

    def holds(box) -> bool:
        return all(box.lo[i] <= t[i] <= box.hi[i] for i in range(len(t))) and (
            hdr.tcp_flags & box.flags_mask == box.flags_value and not box.sets_mask
        )

    n6 = len(entries6)
    i = next((j for j, e in enumerate(entries6) if ov6.valid[j] and any(holds(b) for b in e.boxes)), n6)
    for b, s in enumerate(ov6.slots):
        if s.pos <= i and holds(s.box):
            return n6 + 1 + b
    return i
