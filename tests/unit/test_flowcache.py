"""Unit tests of hypafilter.hw.flowcache: canonical key of both directions, hash and set, stored and register words."""

from __future__ import annotations

import random
import zlib

import pytest
from hypafilter.hw import flowcache as fc
from hypafilter.hw import regmap
from hypafilter.hw.flowcache import Flow


def test_both_directions_share_one_key():
    rng = random.Random(1)
    for _ in range(500):
        f = Flow(
            rng.getrandbits(32), rng.getrandbits(32), rng.choice((6, 17)), rng.getrandbits(16), rng.getrandbits(16)
        )
        (k1, s1), (k2, s2) = fc.canonical(f), fc.canonical(f.reply())
        assert k1 == k2 and s1 != s2
        assert fc.direction(s1, s1) == 0 and fc.direction(s2, s1) == 1
        assert fc.decode_word(fc.key_word(k1, s1)).flow == f
        assert fc.decode_word(fc.key_word(k1, s2)).flow == f.reply()


def test_key_layout_and_equal_endpoints():
    f = Flow(0x0A000002, 0x0A000001, 6, 80, 1234)
    key, swap = fc.canonical(f)
    assert swap == 1 and key == 0x0A000001 << 72 | 0x0A000002 << 40 | 1234 << 24 | 80 << 8 | 6
    same = Flow(7, 7, 17, 9, 9)
    assert fc.canonical(same)[1] == fc.canonical(same.reply())[1] == 0  # one direction only: always "original"


def test_hash_is_zlib_crc32_of_the_key_bytes():
    key = fc.canonical(Flow(0xC0A80001, 0x08080808, 17, 5353, 53))[0]
    assert fc.key_hash(key) == zlib.crc32(key.to_bytes(13, "big"))
    assert fc.set_index(key, 10) == fc.key_hash(key) & 0x3FF
    # spread: 4,096 sequential flows (one client, consecutive ports) over 1,024 sets
    sets = [fc.set_index(fc.canonical(Flow(0x0A000001, 0x0A000002, 6, 10000 + p, 443))[0], 10) for p in range(4096)]
    assert max(sets.count(s) for s in set(sets)) <= 5 and len(set(sets)) == 1024


def test_words_and_slots():
    f = Flow(0x01020304, 0x05060708, 6, 443, 50000)
    key, swap = fc.canonical(f)
    word = fc.key_word(key, swap, epoch=1)
    e = fc.decode_word(word)
    assert (e.valid, e.epoch, e.orient, e.key) == (True, 1, swap, key) and word < 1 << fc.WORD_BITS
    entry, counted = fc.words_to_entry(fc.flow_key_words(word, True))
    assert counted and entry.flow == f and entry.valid
    assert fc.way_set(fc.slot(3, 77, 10), 10) == (3, 77)
    assert fc.fc_key_regs(f) == (0x01020304, 0x05060708, 443 << 16 | 50000, 6)
    assert fc.bypass(6, 0x12) and not fc.bypass(6, 0x10) and not fc.bypass(17, 0x02)
    # no ACK: INVALID to conntrack (tcp_error), so never a hit; ACK with PSH, URG, ECE, CWR is
    assert all(fc.bypass(6, f) for f in (0x00, 0x08, 0x20, 0x28, 0xC0)) and not fc.bypass(17, 0x00)
    assert not any(fc.bypass(6, 0x10 | f) for f in (0x08, 0x20, 0x28, 0xC0, 0xE8))


def test_register_map_describes_the_flow_cache():
    m = regmap.MAP
    assert [m.table(t).id for t in ("FLOW_KEY", "FLOW_SEEN", "FLOW_HITS")] == [3, 4, 5]
    assert m.table("FLOW_KEY").depth == 4 * fc.MAX_ENTRIES
    assert m.reg("FC_CONFIG").reset == 0 and m.reg("FC_CMD").access == "WO"
    # 1.10: the conntrack membership structure (1.9: set membership tables; 1.8: the policy sync lease; 1.7: the update
    # buffer; 1.6: CNT_MIRROR; 1.5: CONTROL bits 4/5, CNT_SHUNT_STATE)
    assert m.reg("VERSION").reset >= 0x0001000A


def test_lengths_conntrack_calls_invalid_never_hit():
    """model.l4_ok (the parser's h_l4_ok): TCP data offset 5..(IPv4 payload / 4), UDP length 8..(IPv4 payload);
    anything else is a bypass for TCP and UDP alike."""
    from hypafilter.hw import model
    from hypafilter.ops.verify import build_frame

    def frame(proto: int, doff: int | None = None, ulen: int | None = None) -> bytes:
        h = {"src": 1, "dst": 2, "proto": proto, "sport": 3, "dport": 4, "flags": 0x10}
        f = bytearray(build_frame(1, h, b"x" * 16))  # L4 payload: TCP 20 + 16 bytes, UDP 8 + 16 bytes
        if doff is not None:
            f[34 + 12] = doff << 4
        if ulen is not None:
            f[34 + 4 : 34 + 6] = ulen.to_bytes(2, "big")
        return bytes(f)

    assert model.l4_ok(frame(6)) and model.l4_ok(frame(17)) and model.l4_ok(frame(1))
    assert [d for d in range(16) if model.l4_ok(frame(6, doff=d))] == [5, 6, 7, 8, 9]  # 36 bytes: up to 9 words
    assert [n for n in range(40) if model.l4_ok(frame(17, ulen=n))] == list(range(8, 25))
    assert fc.bypass(17, 0, l4_ok=False) and fc.bypass(6, 0x10, l4_ok=False) and not fc.bypass(6, 0x10, l4_ok=True)


def test_ipv6_keys_of_a_wide_cache():
    """A dual-stack core's cache (`wide`): 304-bit keys over the full 128-bit addresses, both directions under one
    key, the family byte apart from the addresses (a.b.c.d and ::a.b.c.d are two flows), the CRC-32 of 38 bytes,
    and the register words (FLOW_KEY with bit 9, FLOW_KEY6, FC_KEY0..9) round-tripping."""
    from hypafilter.hw.flowcache import Flow6

    rng = random.Random(6)
    for _ in range(300):
        f = Flow6(rng.getrandbits(128), rng.getrandbits(128), rng.choice((6, 17)), rng.getrandbits(16), 443)
        (k1, s1), (k2, s2) = fc.canonical(f, wide=True), fc.canonical(f.reply(), wide=True)
        assert k1 == k2 and s1 != s2 and k1 >> 296 == 1 and k1 < 1 << fc.KEY_BITS6
        assert fc.key_hash(k1, wide=True) == zlib.crc32(k1.to_bytes(38, "big"))
        for k, s, flow in ((k1, s1, f), (k1, s2, f.reply())):
            word = fc.key_word(k, s, epoch=1, wide=True)
            assert word < 1 << fc.WORD_BITS6 and fc.decode_word(word, wide=True).flow == flow
            entry, counted = fc.words_to_entry(fc.flow_key_words(word, True, wide=True), fc.flow_key6_words(word))
            assert counted and entry.flow == flow and fc.flow_key_words(word, True, wide=True)[3] & fc.FLOW_KEY_V6
        # one address bit flipped: another key
        bit = rng.randrange(128)
        g = Flow6(f.src ^ (1 << bit), f.dst, f.proto, f.sport, f.dport)
        assert fc.canonical(g, wide=True)[0] != k1
        regs = (*fc.fc_key_regs(f), *fc.fc_key6_regs(f))
        assert regs[0] | regs[4] << 32 | regs[5] << 64 | regs[6] << 96 == f.src and regs[3] == 0x100 | f.proto
        assert regs[1] | regs[7] << 32 | regs[8] << 64 | regs[9] << 96 == f.dst
    v4, v4c = Flow(0x0A000001, 0x0A000002, 6, 1, 2), Flow6(0x0A000001, 0x0A000002, 6, 1, 2)
    k4, k6 = fc.canonical(v4, wide=True)[0], fc.canonical(v4c, wide=True)[0]
    assert k4 != k6 and k4 >> 296 == 0 and k4 & ((1 << 296) - 1) == k6 & ((1 << 296) - 1)
    word = fc.key_word(k4, 0, wide=True)
    assert fc.decode_word(word, wide=True).flow == v4 and fc.flow_key6_words(word) == (0,) * 6
    assert fc.words_to_entry(fc.flow_key_words(word, False, wide=True), (0,) * 6)[0].flow == v4
    # an IPv4-only cache has no key for an IPv6 flow; its words without FLOW_KEY6 are refused
    with pytest.raises(ValueError, match="IPv6"):
        fc.canonical(v4c)
    with pytest.raises(ValueError, match="FLOW_KEY6"):
        fc.words_to_entry(fc.flow_key_words(fc.key_word(k6, 0, wide=True), False, wide=True))
    m = regmap.MAP
    assert m.table("FLOW_KEY6").depth == fc.FLOW_KEY6_STRIDE * fc.MAX_ENTRIES
    assert [m.reg(f"FC_KEY{i}").offset for i in range(4, 10)] == list(range(0xE0, 0xF8, 4))
    assert fc.fc_config(10, 4, 32, wide=True) == fc.fc_config(10, 4, 32) | fc.FC_CONFIG_V6
