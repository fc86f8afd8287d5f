"""The flow cache's meanings in Python (hw/hf_flow_cache.vhd): canonical key, hash, set and slot, stored words,
command and status codes, and the words the register interface shows. The testbench and the host sync service use
these; the VHDL implements the same definitions.

A flow is (src, dst, proto, sport, dport) in its original direction. Both directions share one entry under the
canonical key: the two (address, port) endpoints ordered as 48-bit numbers `addr << 16 | port`, the smaller ("lo")
first, plus the orientation bit of the original direction (1 when its source is the "hi" endpoint). A lookup
canonicalises its own header the same way; its direction is its swap bit xor the stored orientation (0 original,
1 reply). The set is the low LOG2_SETS bits of zlib's CRC-32 of the key's 13 bytes: a linear XOR network in
hardware (three LUT levels per bit), good spread for structured keys, and `zlib.crc32` here. It is not keyed: a
sender who aims many flows at one set only makes them miss, which is safe (a miss is a shunt).

A dual-stack core's cache holds IPv6 tuples too (`wide`, the cache's generic V6; FC_CONFIG bit 24): its key is 304
bits, a family byte (1 IPv6, 0 IPv4), the lo and hi addresses in 128 bits each (an IPv4 address zero-extended, kept
apart from the IPv6 address ::a.b.c.d by the family byte), the ports and the protocol; endpoints compare as
`addr << 16 | port` over 144 bits and the set is the CRC-32 of the key's 38 bytes. Exact: no address is folded, so a
hit is the flow's own full tuple. An IPv6 flow is a `Flow6`; its commands carry the upper 96 address bits in
FC_KEY4..9 and FC_KEY3 bit 8, its entries read them from table FLOW_KEY6.
"""

from __future__ import annotations

import socket
import zlib
from dataclasses import dataclass
from typing import ClassVar

KEY_BITS = 104
WORD_BITS = 107  # valid(106) epoch(105) orient(104) key(103:0)
KEY_BITS6, WORD_BITS6 = 304, 307  # with IPv6 tuples: family(303:296) lo_ip(295:168) hi_ip(167:40) ports proto
FC_CONFIG_V6 = 1 << 24  # FC_CONFIG: the cache holds IPv6 tuples
FC_KEY3_V6 = 1 << 8  # FC_KEY3: the command's key is an IPv6 flow (FC_KEY4..9: the addresses' bits 127:32)
FLOW_KEY_V6 = 1 << 9  # FLOW_KEY word 3: the entry is an IPv6 flow (FLOW_KEY6: the addresses' bits 127:32)
FLOW_KEY6_STRIDE = 8  # FLOW_KEY6 index = slot * 8 + w, w0..2 lo address bits 63:32..127:96, w3..5 the hi one's
LATENCY = 4  # cycles from a lookup to its result
TCP_BYPASS_FLAGS = 0x07  # FIN, SYN, RST: such TCP frames never hit, so conntrack sees setup and teardown
# ... and nor does a segment without ACK: with none of SYN/FIN/RST the only flags conntrack's tcp_error accepts are
# ACK and ACK|URG (after masking ECE, CWR, PSH); any other segment is INVALID to it whatever the flow's state, so it
# must reach conntrack (a miss) rather than be called ESTABLISHED by a hit
TCP_ACK = 0x10
PROTO_TCP, PROTO_UDP = 6, 17  # the protocols of the flows a key holds
MIN_ENTRIES, MAX_ENTRIES = 4096, 65536

# host commands (hf_flow_cache h_op, the FC_CMD register's op field) and their status codes (r_status, FC_STATUS)
OP_INSERT, OP_DELETE, OP_DELETE_SLOT, OP_READ, OP_FIND, OP_CLEAR = 1, 2, 3, 4, 5, 6
ST_OK, ST_EXISTS, ST_FULL, ST_NOT_FOUND, ST_BAD = 0, 1, 2, 3, 4


@dataclass(frozen=True)
class Flow:
    src: int
    dst: int
    proto: int
    sport: int = 0
    dport: int = 0

    def reply(self) -> Flow:
        return Flow(self.dst, self.src, self.proto, self.dport, self.sport)


@dataclass(frozen=True)
class Flow6:
    """An IPv6 TCP/UDP flow in its original direction (128-bit addresses): what names an AF_INET6 conntrack entry.
    A class of its own, not `Flow` with wider numbers: only a cache with IPv6 tuples (a dual-stack core's, `wide`)
    holds it (a table says which families it holds, `families`), and `family` tells the ctnetlink codec which tuple
    attributes and nfgenmsg family a request about it carries."""

    family: ClassVar[int] = socket.AF_INET6
    src: int
    dst: int
    proto: int
    sport: int = 0
    dport: int = 0

    def reply(self) -> Flow6:
        return Flow6(self.dst, self.src, self.proto, self.dport, self.sport)


def is_v6(flow) -> bool:
    return isinstance(flow, Flow6)


def canonical(flow: Flow | Flow6, wide: bool = False) -> tuple[int, int]:
    """(canonical key, swap bit): key = lo_ip << 72 | hi_ip << 40 | lo_port << 24 | hi_port << 8 | proto; in a
    cache with IPv6 tuples (`wide`) family << 296 | lo_ip << 168 | hi_ip << 40 | lo_port << 24 | hi_port << 8 |
    proto (family 1 for a Flow6)."""
    v6 = is_v6(flow)
    if v6 and not wide:
        raise ValueError(f"{flow}: an IPv6 flow has no key in a cache of IPv4 tuples")
    a, b = flow.src << 16 | flow.sport, flow.dst << 16 | flow.dport
    swap = int(a > b)
    lo, hi = (b, a) if swap else (a, b)
    low = (hi >> 16) << 40 | (lo & 0xFFFF) << 24 | (hi & 0xFFFF) << 8 | flow.proto
    if wide:
        return int(v6) << 296 | (lo >> 16) << 168 | low, swap
    return (lo >> 16) << 72 | low, swap


def key_hash(key: int, wide: bool = False) -> int:
    return zlib.crc32(key.to_bytes((KEY_BITS6 if wide else KEY_BITS) // 8, "big"))


def set_index(key: int, log2_sets: int, wide: bool = False) -> int:
    return key_hash(key, wide) & ((1 << log2_sets) - 1)


def slot(way: int, set_: int, log2_sets: int) -> int:
    return way << log2_sets | set_


def way_set(slot_: int, log2_sets: int) -> tuple[int, int]:
    return slot_ >> log2_sets, slot_ & ((1 << log2_sets) - 1)


def bypass(proto: int, tcp_flags: int, l4_ok: bool = True) -> bool:
    """A lookup that misses whatever the cache holds (res_bypass): TCP with SYN, FIN or RST or without ACK, or a
    frame whose TCP data offset or UDP length conntrack calls INVALID (`l4_ok` False: the parser's h_l4_ok,
    model.l4_ok)."""
    return not l4_ok or (proto == PROTO_TCP and (bool(tcp_flags & TCP_BYPASS_FLAGS) or not tcp_flags & TCP_ACK))


def direction(swap: int, orient: int) -> int:
    return swap ^ orient


@dataclass(frozen=True)
class Entry:
    """One decoded key word."""

    valid: bool
    epoch: int
    orient: int
    key: int
    wide: bool = False  # a key of a cache with IPv6 tuples (KEY_BITS6)

    @property
    def flow(self) -> Flow | Flow6:
        """The flow in its original direction (a Flow6 for an IPv6 key)."""
        lo_port, hi_port, proto = (self.key >> 24) & 0xFFFF, (self.key >> 8) & 0xFFFF, self.key & 0xFF
        if self.wide:
            lo_ip, hi_ip = (self.key >> 168) & ((1 << 128) - 1), (self.key >> 40) & ((1 << 128) - 1)
            cls = Flow6 if self.key >> 296 & 1 else Flow
        else:
            lo_ip, hi_ip, cls = self.key >> 72, (self.key >> 40) & 0xFFFFFFFF, Flow
        f = cls(lo_ip, hi_ip, proto, lo_port, hi_port)
        return f.reply() if self.orient else f


def key_word(key: int, orient: int, epoch: int = 0, valid: bool = True, wide: bool = False) -> int:
    kb = KEY_BITS6 if wide else KEY_BITS
    return int(valid) << (kb + 2) | epoch << (kb + 1) | orient << kb | key


def decode_word(word: int, wide: bool = False) -> Entry:
    kb = KEY_BITS6 if wide else KEY_BITS
    return Entry(bool(word >> (kb + 2) & 1), word >> (kb + 1) & 1, word >> kb & 1, word & ((1 << kb) - 1), wide)


# The register view (hw/regmap.txt): FLOW_KEY holds 4 words per slot (index = slot * 4 + word), FLOW_SEEN and
# FLOW_HITS one each; FC_STATUS = busy << 31 | status << 24 | slot. A cache with IPv6 tuples shows the addresses'
# bits 31:0 in FLOW_KEY (w3 bit 9: an IPv6 entry) and their bits 127:32 in FLOW_KEY6 (8 words per slot, 6 used).
def flow_key_words(word: int, counted: bool, wide: bool = False) -> tuple[int, int, int, int]:
    """FLOW_KEY words 0..3 of a slot: lo_ip, hi_ip (bits 31:0 in a wide cache), lo_port << 16 | hi_port,
    valid << 31 | counted << 30 | v6 << 9 | orient << 8 | proto (counted: hit since its insert, else
    FLOW_SEEN/HITS read 0)."""
    e = decode_word(word, wide)
    lo_at, v6 = (168, e.key >> 296 & 1) if wide else (72, 0)
    return (
        (e.key >> lo_at) & 0xFFFFFFFF,
        (e.key >> 40) & 0xFFFFFFFF,
        (e.key >> 8) & 0xFFFFFFFF,
        int(e.valid) << 31 | int(counted) << 30 | v6 << 9 | e.orient << 8 | (e.key & 0xFF),
    )


def flow_key6_words(word: int) -> tuple[int, ...]:
    """FLOW_KEY6 words 0..5 of a slot of a wide cache: the lo address's bits 63:32, 95:64, 127:96, then the hi's."""
    e = decode_word(word, True)
    lo, hi = e.key >> 168 & ((1 << 128) - 1), e.key >> 40 & ((1 << 128) - 1)
    return tuple(a >> (32 * i) & 0xFFFFFFFF for a in (lo, hi) for i in (1, 2, 3))


def words_to_entry(words: tuple[int, int, int, int], words6: tuple[int, ...] | None = None) -> tuple[Entry, bool]:
    """Inverse of flow_key_words: (entry with epoch 0, counted); `words6`, the slot's FLOW_KEY6 words 0..5, for an
    IPv6 entry (FLOW_KEY w3 bit 9), which it needs. The entry is a wide one when `words6` is given."""
    w0, w1, w2, w3 = words
    if words6 is None:
        if w3 & FLOW_KEY_V6:
            raise ValueError("an IPv6 flow-cache entry without its FLOW_KEY6 words")
        key = w0 << 72 | w1 << 40 | w2 << 8 | (w3 & 0xFF)
        return Entry(bool(w3 >> 31 & 1), 0, w3 >> 8 & 1, key), bool(w3 >> 30 & 1)
    v6 = w3 >> 9 & 1
    lo = w0 | sum(w << (32 * i) for i, w in enumerate(words6[0:3], 1)) if v6 else w0
    hi = w1 | sum(w << (32 * i) for i, w in enumerate(words6[3:6], 1)) if v6 else w1
    key = v6 << 296 | lo << 168 | hi << 40 | w2 << 8 | (w3 & 0xFF)
    return Entry(bool(w3 >> 31 & 1), 0, w3 >> 8 & 1, key, True), bool(w3 >> 30 & 1)


def fc_key_regs(flow: Flow | Flow6) -> tuple[int, int, int, int]:
    """FC_KEY0..3 for a key command: src, dst (bits 31:0 of an IPv6 flow's), sport << 16 | dport,
    v6 << 8 | proto."""
    v6 = is_v6(flow)
    return (
        flow.src & 0xFFFFFFFF,
        flow.dst & 0xFFFFFFFF,
        flow.sport << 16 | flow.dport,
        (FC_KEY3_V6 if v6 else 0) | flow.proto,
    )


def fc_key6_regs(flow: Flow6) -> tuple[int, ...]:
    """FC_KEY4..9 for a key command of an IPv6 flow: src bits 63:32, 95:64, 127:96, then dst's."""
    return tuple(a >> (32 * i) & 0xFFFFFFFF for a in (flow.src, flow.dst) for i in (1, 2, 3))


def fc_config(log2_sets: int, ways: int, ts_w: int, wide: bool = False) -> int:
    """FC_CONFIG of a core with a flow cache (0: none): LOG2_SETS | WAYS << 8 | TS_W << 16 | v6 << 24."""
    return log2_sets | ways << 8 | ts_w << 16 | (FC_CONFIG_V6 if wide else 0)
