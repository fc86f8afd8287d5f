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
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

KEY_BITS = 104
WORD_BITS = 107  # valid(106) epoch(105) orient(104) key(103:0)
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


def canonical(flow: Flow) -> tuple[int, int]:
    """(canonical key, swap bit): key = lo_ip << 72 | hi_ip << 40 | lo_port << 24 | hi_port << 8 | proto."""
    a, b = flow.src << 16 | flow.sport, flow.dst << 16 | flow.dport
    swap = int(a > b)
    lo, hi = (b, a) if swap else (a, b)
    key = (lo >> 16) << 72 | (hi >> 16) << 40 | (lo & 0xFFFF) << 24 | (hi & 0xFFFF) << 8 | flow.proto
    return key, swap


def key_hash(key: int) -> int:
    return zlib.crc32(key.to_bytes(KEY_BITS // 8, "big"))


def set_index(key: int, log2_sets: int) -> int:
    return key_hash(key) & ((1 << log2_sets) - 1)


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

    @property
    def flow(self) -> Flow:
        """The flow in its original direction."""
        lo_ip, hi_ip = self.key >> 72, (self.key >> 40) & 0xFFFFFFFF
        lo_port, hi_port, proto = (self.key >> 24) & 0xFFFF, (self.key >> 8) & 0xFFFF, self.key & 0xFF
        f = Flow(lo_ip, hi_ip, proto, lo_port, hi_port)
        return f.reply() if self.orient else f


def key_word(key: int, orient: int, epoch: int = 0, valid: bool = True) -> int:
    return int(valid) << 106 | epoch << 105 | orient << 104 | key


def decode_word(word: int) -> Entry:
    return Entry(bool(word >> 106 & 1), word >> 105 & 1, word >> 104 & 1, word & ((1 << KEY_BITS) - 1))


# The register view (hw/regmap.txt): FLOW_KEY holds 4 words per slot (index = slot * 4 + word), FLOW_SEEN and
# FLOW_HITS one each; FC_STATUS = busy << 31 | status << 24 | slot.
def flow_key_words(word: int, counted: bool) -> tuple[int, int, int, int]:
    """FLOW_KEY words 0..3 of a slot: lo_ip, hi_ip, lo_port << 16 | hi_port,
    valid << 31 | counted << 30 | orient << 8 | proto (counted: hit since its insert, else FLOW_SEEN/HITS read 0)."""
    e = decode_word(word)
    return (
        e.key >> 72,
        (e.key >> 40) & 0xFFFFFFFF,
        (e.key >> 8) & 0xFFFFFFFF,
        int(e.valid) << 31 | int(counted) << 30 | e.orient << 8 | (e.key & 0xFF),
    )


def words_to_entry(words: tuple[int, int, int, int]) -> tuple[Entry, bool]:
    """Inverse of flow_key_words: (entry with epoch 0, counted)."""
    w0, w1, w2, w3 = words
    key = w0 << 72 | w1 << 40 | w2 << 8 | (w3 & 0xFF)
    return Entry(bool(w3 >> 31 & 1), 0, w3 >> 8 & 1, key), bool(w3 >> 30 & 1)


def fc_key_regs(flow: Flow) -> tuple[int, int, int, int]:
    """FC_KEY0..3 for a key command: src, dst, sport << 16 | dport, proto."""
    return flow.src, flow.dst, flow.sport << 16 | flow.dport, flow.proto


def fc_config(log2_sets: int, ways: int, ts_w: int) -> int:
    """FC_CONFIG of a core with a flow cache (0: none): LOG2_SETS | WAYS << 8 | TS_W << 16."""
    return log2_sets | ways << 8 | ts_w << 16
