"""The conntrack membership structure's meanings in Python (hw/hf_ct_member.vhd): the key, the hashes, the counting
Bloom filter, the recent-egress table, command codes and register words. The testbenches, the model and the flow
sync service use these; the VHDL implements the same definitions (docs/flowsync.md, "New flows on the NIC").

Key: the flow cache's canonical key (`flowcache.canonical`: both directions of a tuple give one key, 104 bits). A
conntrack entry is held under the canonical keys of its original and its reply tuple (the same key without NAT,
two with it: each as seen on some wire); a frame is a possible member when its own canonical key is.

Counting Bloom filter: BANKS banks of 2**log2 counters of COUNTER_BITS bits, one counter per bank per key at
`bank_index`: zlib's CRC-32 and CRC-32C (Castagnoli) of the key's 13 bytes, their low bits for banks 0 and 1 and
their high bits for banks 2 and 3 (four different linear maps, each an XOR network in hardware). A key is a
possible member when all its counters are non-zero. An insert adds 1 to each of its counters, a delete takes 1 off;
a counter at COUNTER_MAX stays there for good (sticky: a permanent possible member, never a lost one), and a delete
that finds any of its counters at 0 changes nothing (it was never inserted: taking 1 off the others would lose real
members) and is counted as refused. Every error of the structure is thus a false positive: a frame shunted as
"unknown", never a frame called NEW while conntrack holds it.

IPv6 (a dual-stack core's structure, CTM_CONFIG bit 24): an IPv6 tuple (`Flow6`) is keyed by its addresses folded to
32 bits (`fold`: the XOR of the four 32-bit words) in the same canonical 104-bit key, with FAMILY6 above it
(`key_of`: 1 << 104 | key); its hashes are over the family byte and the key's 13 bytes. A fold or a hash collision
is a false positive, as every other error here. CTM_CMD carries the folded addresses and w3 bit 10 (`cmd_words`).
An IPv6 frame the host sends whose ports the core does not know (the parser's walk refused it) makes every IPv6
lookup between its two addresses, either direction and any ports, a possible member for a window
(`egress_unknown6`): a reply to it could belong to any tuple of that address pair. Its stamp goes to a table of
2**UNKNOWN6_LOG2 stamps at `unknown6_index`, a symmetric hash of the folded addresses (the addresses sit in the fixed
header, known whatever the walk refused); a collision is a false positive. A wire frame the walk refuses
(`refused6`) stamps its pair the same way: it has no key, so no shunt stamp, yet it goes to the host (unparsed) and
conntrack may make its entry from it before a reply right behind it is decided.

Recent egress: 2**egress_log2 timestamps (EGRESS_TS_BITS, in lease ticks, 1 ms), indexed by `egress_index`. The
core writes the current time at the index of every TCP/UDP frame the host sends out through the NIC; a key is
recent while (now - stamp) mod 2**EGRESS_TS_BITS < window. A stamp only moves forward, so a collision keeps every
key recent at least as long as its own frame made it (another false positive at most).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field

from hypafilter.hw.flowcache import KEY_BITS, Flow, Flow6, canonical

BANKS = 4
COUNTER_BITS = 4
COUNTER_MAX = (1 << COUNTER_BITS) - 1
EGRESS_TS_BITS = 32
UNKNOWN6_LOG2 = 8  # [V6] stamps of IPv6 host frames with unknown ports, by address pair (hf_ct_member's U6_LOG2)
LATENCY = 4  # cycles from a lookup to its result (the flow cache's, so both reach the matcher together)
MIN_LOG2, MAX_LOG2 = 8, 24
OP_INSERT, OP_DELETE, OP_CLEAR = 1, 2, 3
CMD_WORDS = 4  # table CTM_CMD: w0 src, w1 dst, w2 sport << 16 | dport, w3 v6 << 10 | op << 8 | proto (runs it)
CMD_V6 = 1 << 10  # CTM_CMD w3: an IPv6 key (w0/w1 the folded addresses)
CONFIG_V6 = 1 << 24  # CTM_CONFIG: the structure takes IPv6 keys (a dual-stack core)
FAMILY6 = 1 << KEY_BITS  # above an IPv6 key's 104 bits: its hashes cover the family byte 1
CONTROL_COMPLETE = 1  # CTM_CONTROL bit 0
DEFAULT_WINDOW_MS = 2000  # CTM_WINDOW after reset


def _crc32c_table() -> list[int]:
    t = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ (0x82F63B78 if c & 1 else 0)
        t.append(c)
    return t


_C_TABLE = _crc32c_table()


def crc32c(data: bytes) -> int:
    c = 0xFFFFFFFF
    for b in data:
        c = _C_TABLE[(c ^ b) & 0xFF] ^ (c >> 8)
    return c ^ 0xFFFFFFFF


@dataclass(frozen=True)
class Folded6(Flow):
    """An IPv6 tuple with its addresses folded (`fold`): what the structure keys and CTM_CMD carries."""

    def reply(self) -> Folded6:
        return Folded6(self.dst, self.src, self.proto, self.dport, self.sport)


def fold(addr: int) -> int:
    """A 128-bit address folded to 32 bits: the XOR of its four 32-bit words."""
    return (addr ^ addr >> 32 ^ addr >> 64 ^ addr >> 96) & 0xFFFFFFFF


def folded(flow: Flow6) -> Folded6:
    return Folded6(fold(flow.src), fold(flow.dst), flow.proto, flow.sport, flow.dport)


def key_of(flow: Flow | Flow6) -> int:
    """The structure's key of a tuple (either direction gives the same key)."""
    if isinstance(flow, Flow6):
        flow = folded(flow)
    if isinstance(flow, Folded6):
        return FAMILY6 | canonical(Flow(flow.src, flow.dst, flow.proto, flow.sport, flow.dport))[0]
    return canonical(flow)[0]


def is_v6_key(key: int) -> bool:
    return bool(key & FAMILY6)


def key_flow(key: int) -> Flow:
    """A flow whose key is `key` (a Folded6 for an IPv6 key; the hardware canonicalises a command's tuple itself)."""
    cls = Folded6 if is_v6_key(key) else Flow
    return cls(key >> 72 & 0xFFFFFFFF, (key >> 40) & 0xFFFFFFFF, key & 0xFF, (key >> 24) & 0xFFFF, (key >> 8) & 0xFFFF)


def _crcs(key: int) -> tuple[int, int]:
    b = key.to_bytes(KEY_BITS // 8 + (1 if is_v6_key(key) else 0), "big")
    return zlib.crc32(b), crc32c(b)


def bank_indices(key: int, log2: int) -> tuple[int, ...]:
    """The counter of `key` in each bank."""
    a, c = _crcs(key)
    m = (1 << log2) - 1
    return a & m, c & m, a >> (32 - log2), c >> (32 - log2)


def egress_index(key: int, egress_log2: int) -> int:
    a, c = _crcs(key)
    return (a ^ c) >> 8 & ((1 << egress_log2) - 1)


def unknown6_index(src: int, dst: int) -> int:
    """The unknown-ports stamp of an IPv6 address pair (folded addresses, `fold`): their XOR xor their sum mod 2**32
    rotated left by 13 (either order gives one index; the sum parts pairs with the same XOR, as ::1/::2 and
    ::1:1/::2:1), folded to UNKNOWN6_LOG2 bits, the XOR of its bytes."""
    s = (src + dst) & 0xFFFFFFFF
    x = src ^ dst ^ (s << 13 | s >> 19) & 0xFFFFFFFF
    return (x ^ x >> 8 ^ x >> 16 ^ x >> 24) & ((1 << UNKNOWN6_LOG2) - 1)


def cmd_words(op: int, flow: Flow | Flow6 | None = None) -> list[int]:
    """The 4 CTM_CMD words of a command (a clear has no key); an IPv6 tuple's with its folded addresses and bit 10."""
    f = flow or Flow(0, 0, 0)
    if isinstance(f, Flow6):
        f = folded(f)
    v6 = CMD_V6 if isinstance(f, Folded6) else 0
    return [f.src, f.dst, f.sport << 16 | f.dport, v6 | op << 8 | f.proto]


def ctm_config(log2: int, egress_log2: int, v6: bool = False) -> int:
    """CTM_CONFIG of a core with the structure (0: none): LOG2 | BANKS << 8 | COUNTER_BITS << 12 | EGRESS_LOG2 << 16
    | IPv6 keys << 24."""
    return log2 | BANKS << 8 | COUNTER_BITS << 12 | egress_log2 << 16 | (CONFIG_V6 if v6 else 0)


def parse_config(word: int) -> tuple[int, int] | None:
    """(log2, egress_log2) of CTM_CONFIG, None when the core has no structure."""
    return None if word == 0 else (word & 0xFF, word >> 16 & 0xFF)


def config_v6(word: int) -> bool:
    """Whether CTM_CONFIG says the structure takes IPv6 keys."""
    return word != 0 and bool(word & CONFIG_V6)


@dataclass
class CtMember:
    """The structure as the hardware keeps it (the reference the benches compare with)."""

    log2: int
    egress_log2: int = 12
    window: int = DEFAULT_WINDOW_MS
    banks: list[dict[int, int]] = field(default_factory=list)
    stamps: dict[int, int] = field(default_factory=dict)
    members: int = 0  # inserts minus deletes done (CTM_MEMBERS)
    saturated: int = 0  # counters an insert made sticky (CTM_SATURATED)
    refused: int = 0  # deletes refused: a counter of the key was 0 (CTM_STATUS bits 15:0)
    unknown6: dict[int, int] = field(default_factory=dict)  # unknown6_index -> time of the last such frame
    # shunt stamps: egress_index -> time the last wire frame of that index went to the host (the decision writes them)
    shunts: dict[int, int] = field(default_factory=dict)

    def __post_init__(self):
        if not self.banks:
            self.banks = [{} for _ in range(BANKS)]

    def insert(self, key: int) -> None:
        for bank, i in zip(self.banks, bank_indices(key, self.log2), strict=True):
            v = bank.get(i, 0)
            if v < COUNTER_MAX:
                bank[i] = v + 1
                if v + 1 == COUNTER_MAX:
                    self.saturated += 1
        self.members += 1

    def delete(self, key: int) -> bool:
        idx = bank_indices(key, self.log2)
        vals = [bank.get(i, 0) for bank, i in zip(self.banks, idx, strict=True)]
        if 0 in vals:
            self.refused += 1
            return False
        for bank, i, v in zip(self.banks, idx, vals, strict=True):
            if v < COUNTER_MAX:
                bank[i] = v - 1
        self.members -= 1
        return True

    def clear(self) -> None:
        self.banks = [{} for _ in range(BANKS)]
        self.members = 0

    def member(self, key: int) -> bool:
        return all(bank.get(i, 0) for bank, i in zip(self.banks, bank_indices(key, self.log2), strict=True))

    def egress(self, key: int, now: int) -> None:
        self.stamps[egress_index(key, self.egress_log2)] = now & ((1 << EGRESS_TS_BITS) - 1)

    def egress_unknown6(self, src: int, dst: int, now: int) -> None:
        """An IPv6 frame out (its 128-bit addresses) whose ports the core does not know: every IPv6 key of the same
        two addresses recent for a window."""
        self.unknown6[unknown6_index(fold(src), fold(dst))] = now & ((1 << EGRESS_TS_BITS) - 1)

    def refused6(self, src: int, dst: int, now: int) -> None:
        """An IPv6 wire frame whose ports the core does not know (the walk refused it, or its TCP/UDP header is cut):
        the core writes the same stamp as `egress_unknown6`, whatever its decision (it goes to the host unparsed, or
        is dropped as unfilterable: a false positive then), since the kernel's conntrack may make an entry of it."""
        self.egress_unknown6(src, dst, now)

    def shunt(self, key: int, now: int) -> None:
        """A wire frame of `key` handed to the host (shunted, or a copy delivered): it may create the entry of a frame
        of the same key that comes after it, before the host has seen it."""
        self.shunts[egress_index(key, self.egress_log2)] = now & ((1 << EGRESS_TS_BITS) - 1)

    def shunted(self, key: int, now: int) -> bool:
        """Whether a wire frame of `key` (or of a colliding key) went to the host less than the window ago: the
        decision then sends a frame with ct 3 to the host with no index (hw/model.py `decide`)."""
        s = self.shunts.get(egress_index(key, self.egress_log2), 0)
        return (now - s) % (1 << EGRESS_TS_BITS) < self.window

    def recent(self, key: int, now: int) -> bool:
        """Whether an egress frame of `key` (or of a colliding key) is younger than the window. A stamp never written
        reads 0 (the reset sweep)."""
        s = self.stamps.get(egress_index(key, self.egress_log2), 0)
        if is_v6_key(key):
            f = key_flow(key)
            u = self.unknown6.get(unknown6_index(f.src, f.dst), 0)
            if (now - u) % (1 << EGRESS_TS_BITS) < self.window:
                return True
        return (now - s) % (1 << EGRESS_TS_BITS) < self.window

    def possible(self, key: int, now: int) -> bool:
        """What a lookup answers: a possible member (a frame then gets ct 0), or not (ct 3 when complete)."""
        return self.member(key) or self.recent(key, now)
