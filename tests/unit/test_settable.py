"""The core's set tables on the host side (hw.settable): the slot's answer equals the kernel's reference semantics
(ir.sets.member) for every set type, the placement's writes and images, and the model's use of them."""

from __future__ import annotations

import random

import pytest
from hypafilter.hw import settable
from hypafilter.hw.settable import Elem, Geometry, Image, TableFull
from hypafilter.ir import Header
from hypafilter.ir.sets import SetElem, SetInfo, frame_ports, frame_ports6, member

DIRS = {
    "hash:ip": [("src",), ("dst",)],
    "hash:net": [("src",), ("dst",)],
    "hash:ip,port": [("src", "dst"), ("dst", "dst"), ("dst", "src")],
    "hash:net,port": [("src", "dst"), ("dst", "src")],
    "bitmap:port": [("src",), ("dst",)],
}


def random_set(settype: str, rng: random.Random) -> SetInfo:
    """A small set with nested prefixes (net types, nomatch among them) over few addresses, protos and ports, so
    that random frames hit it."""
    entries, seen = [], set()
    for _ in range(12):
        if settype == "bitmap:port":
            e = SetElem(port=rng.choice((22, 80, 443, 1000)))
        else:
            plen = rng.choice((8, 16, 24, 26, 32)) if "net" in settype else 32
            a = (10 << 24 | rng.choice((0, 1)) << 16 | rng.choice((0, 2)) << 8 | rng.choice((0, 5, 77))) & (
                settable.prefix_mask(plen)
            )
            proto, port = 0, 0
            if "port" in settype:
                proto = rng.choice((6, 17, 1))
                port = rng.choice((22, 53, 8 << 8))
            e = SetElem(a, a | (~settable.prefix_mask(plen) & 0xFFFFFFFF), plen, proto, port,
                        nomatch="net" in settype and rng.random() < 0.3)  # fmt: skip
        if e.key() not in seen:
            seen.add(e.key())
            entries.append(e)
    return SetInfo("s", settype, entries=tuple(entries))


def random_header(rng: random.Random) -> Header:
    proto = rng.choice((6, 17, 1, 47, 0))
    addr = lambda: 10 << 24 | rng.choice((0, 1)) << 16 | rng.choice((0, 2, 9)) << 8 | rng.choice((0, 5, 77, 200))  # noqa: E731
    ports = (22, 53, 80, 443, 1000, 7)
    return Header(src=addr(), dst=addr(), proto=proto, sport=rng.choice(ports) if proto in (6, 17) else 0,
                  dport=rng.choice(ports) if proto in (6, 17) else 0, icmp_type=8 if proto == 1 else 0)  # fmt: skip


@pytest.mark.parametrize("settype", sorted(DIRS))
def test_slot_answer_is_the_kernels(settype):
    """For every direction choice: the table's answer (longest prefix, nomatch, port rules) is ir.sets.member's."""
    rng = random.Random(settype)
    hits = 0
    for _ in range(30):
        info = random_set(settype, rng)
        for dirs in DIRS[settype]:
            elems = settable.elems_of(info, dirs)
            img, _ = settable.image_of(0, settype, elems, Geometry(16, 4, 2))
            for _ in range(40):
                h = random_header(rng)
                want = member(info, dirs, h.src, h.dst, h.proto,
                              frame_ports(h.proto, h.sport, h.dport, h.icmp_type, h.icmp_code))  # fmt: skip
                got, unc = settable.lookup(settype, dirs, img.elems(), h)
                assert not unc and got == want, (info, dirs, h)
                hits += got
    assert hits > 50


def test_uncertain_and_unparsed_ports():
    info = SetInfo("s", "hash:ip,port", entries=(SetElem(5, 5, 32, 6, 80, timeout_s=1), SetElem(6, 6, 32, 6, 80)))
    st = settable.SlotState("hash:ip,port", ("dst", "dst"), tuple(settable.elems_of(info, ("dst", "dst"))))
    assert st.lookup(Header(dst=5, proto=6, dport=80)) == (True, True)  # 1 s left: may expire any moment
    assert st.lookup(Header(dst=6, proto=6, dport=80)) == (True, False)
    assert st.lookup(Header(dst=6, proto=132)) == (False, True)  # SCTP: ports the parser does not read
    # fewer directions than dimensions: the kernel matches nothing, the table holds nothing
    assert settable.elems_of(info, ("dst",)) == []


def test_placement_writes_images_and_full():
    geom = Geometry(2, 2, 1)  # 2 banks of 4 buckets, 1 way
    img = Image(3, "hash:net", geom)
    w = img.insert(Elem(0x0A000000, 8))
    # bank opened (its length) before the element, the element's w0 then w1 (the commit), slot 3 in bits 22:20
    assert w[0] == (settable.TABLE_SET_BANK, 3 << 20 | 0, settable.BANK_ENABLE | 8)
    assert [x[0] for x in w[1:]] == [settable.TABLE_SET_ELEM] * 2 and w[2][1] == w[1][1] | 1
    assert w[1][1] >> 20 == 3 and w[2][2] == settable.W1_VALID
    assert img.insert(Elem(0x0A010000, 16, nomatch=True))[0][2] == settable.BANK_ENABLE | 16
    with pytest.raises(TableFull, match="no bank is free"):
        img.insert(Elem(0x0A010200, 24))
    assert len(img) == 2 and img.bank_len == [8, 16]
    # the same key again changes its flags in place: one element write, no bank write
    w = img.insert(Elem(0x0A000000, 8, uncertain=True))
    assert [x[0] for x in w] == [settable.TABLE_SET_ELEM] * 2 and w[1][2] & settable.W1_UNCERTAIN
    # deleting the last element of a bank disables it
    w = img.delete(Elem(0x0A010000, 16))
    assert w[-1] == (settable.TABLE_SET_BANK, 3 << 20 | 1, 0) and img.bank_len == [8, None]
    back = settable.image_from_dict(settable.image_dict(img))
    assert back.cells == img.cells and back.bank_len == img.bank_len and back.where == img.where
    # diff: deletes before inserts
    w = settable.diff_writes(back, [Elem(0x0B000000, 8)])
    assert back.elems() == [Elem(0x0B000000, 8)] and w[0][2] == 0
    assert settable.runs([(8, 4, 1), (8, 5, 2), (9, 6, 3), (8, 7, 4)]) == [(8, 4, [1, 2]), (9, 6, [3]), (8, 7, [4])]


def test_default_geometry_holds_a_10000_network_blocklist():
    """The NIC's default table: 10,000 networks over six prefix lengths (with nomatch holes) placed."""
    rng = random.Random(7)
    elems, seen = [], set()
    while len(elems) < 10_000:
        plen = rng.choice((16, 20, 24, 24, 24, 28, 32))
        a = rng.getrandbits(32) & settable.prefix_mask(plen)
        if (a, plen) not in seen:
            seen.add((a, plen))
            elems.append(Elem(a, plen, nomatch=len(elems) % 50 == 0))
    img, writes = settable.image_of(0, "hash:net", elems)
    assert len(img) == 10_000 and len(writes) >= 20_000


def test_register_map_describes_the_set_tables():
    from hypafilter.hw import regmap

    m = regmap.MAP
    assert m.reg("VERSION").reset >= 0x00010009  # 1.9: set membership tables
    assert [m.table(t).id for t in ("SET_ELEM", "SET_BANK", "SET_INFO", "SET_CTL")] == [8, 9, 10, 11]
    assert m.table("SET_INFO").access == "RO" and m.reg("SET_CONFIG").offset == 0xAC
    assert 0xAC <= m.reg("CNT_SET_UNCERTAIN").offset <= 0xBC
    # the slot field (bits 22:20) holds every slot, and every element index of the largest table
    assert (7 << settable.SLOT_SHIFT | settable.elem_index(0, 15, 4095, 7, 8, 1)) < m.table("SET_ELEM").depth


# ---- IPv6 slots (a dual-stack core's tables of inet6 sets: hf_set_table with V6)

BASE6 = 0x20010DB8 << 96


def random_set6(settype: str, rng: random.Random) -> SetInfo:
    """A small inet6 set with nested prefixes up to /128 (nomatch among them) over few addresses, protos and ports."""
    entries, seen = [], set()
    top = (1 << 128) - 1
    for _ in range(12):
        plen = rng.choice((32, 48, 64, 96, 127, 128)) if "net" in settype else 128
        a = (BASE6 | rng.choice((0, 1)) << 80 | rng.choice((0, 2)) << 64 | rng.choice((0, 5, 77))) & (
            settable.prefix_mask(plen, 128)
        )
        proto, port = 0, 0
        if "port" in settype:
            proto = rng.choice((6, 17, 58))
            port = rng.choice((22, 53, 128 << 8))
        e = SetElem(a, a | (~settable.prefix_mask(plen, 128) & top), plen, proto, port,
                    nomatch="net" in settype and rng.random() < 0.3)  # fmt: skip
        if e.key() not in seen:
            seen.add(e.key())
            entries.append(e)
    return SetInfo("s6", settype, family="inet6", netmask=128, entries=tuple(entries))


@pytest.mark.parametrize("settype", ["hash:ip", "hash:net", "hash:ip,port", "hash:net,port"])
def test_ipv6_slot_answer_is_the_kernels(settype):
    """An IPv6 slot's answer (128-bit keys, longest prefix up to /128, ICMPv6 type << 8 | code as the port) is
    ir.sets.member's for IPv6 frames; ICMP inside IPv6 (whose bytes the parser does not give) is uncertain and no
    next header (59) matches nothing."""
    rng = random.Random(settype + "6")
    hits = 0
    for _ in range(20):
        info = random_set6(settype, rng)
        for dirs in DIRS[settype]:
            img, _ = settable.image_of(0, settype, settable.elems_of(info, dirs), Geometry(16, 4, 2), v6=True)
            for _ in range(40):
                proto = rng.choice((6, 17, 58, 47, 59))
                addr = lambda: BASE6 | rng.choice((0, 1)) << 80 | rng.choice((0, 2, 9)) << 64 | rng.choice((0, 5, 77))  # noqa: E731
                tcp_udp = proto in (6, 17)
                h = Header(src=addr(), dst=addr(), proto=proto, sport=rng.choice((22, 53, 7)) if tcp_udp else 0,
                           dport=rng.choice((22, 53, 7)) if tcp_udp else 0,
                           icmp_type=rng.choice((128, 129)) if proto == 58 else 0)  # fmt: skip
                want = member(info, dirs, h.src, h.dst, h.proto,
                              frame_ports6(h.proto, h.sport, h.dport, h.icmp_type, h.icmp_code))  # fmt: skip
                got, unc = settable.lookup(settype, dirs, img.elems(), h, v6=True)
                assert not unc and got == want, (info, dirs, h)
                hits += got
    assert hits > 50
    if "port" in settype:
        assert settable.lookup(settype, ("dst", "dst"), img.elems(), Header(dst=BASE6, proto=1), v6=True)[1]


def test_ipv6_placement_writes_set6_tables():
    img = Image(2, "hash:net", Geometry(2, 2, 1), v6=True)
    a = 0x20010DB8_00010002_00000000_00000066
    w = img.insert(Elem(a, 128))
    # bank opened at /128 (SET6_BANK), then the four address words (most significant first) and the commit (w4), at
    # word index (bucket * WAYS + way) << 3 | w
    assert w[0] == (settable.TABLE_SET6_BANK, 2 << 20 | 0, settable.BANK_ENABLE | 128)
    assert [x[0] for x in w[1:]] == [settable.TABLE_SET6_ELEM] * 5
    assert [x[2] for x in w[1:5]] == [0x20010DB8, 0x00010002, 0, 0x66] and w[5][2] == settable.W1_VALID
    assert [x[1] & 7 for x in w[1:]] == [0, 1, 2, 3, 4] and w[1][1] >> 20 == 2
    # the bucket hash reads the address folded to 32 bits
    assert settable.key(a, 6, 80) == (0x20010DB8 ^ 0x00010002 ^ 0x66) << 24 | 6 << 16 | 80
    assert settable.image_from_dict(settable.image_dict(img)).v6
    # deleting clears all five words and the bank
    w = img.delete(Elem(a, 128))
    assert [x[2] for x in w[:5]] == [0] * 5 and w[-1] == (settable.TABLE_SET6_BANK, 2 << 20, 0)
    with pytest.raises(ValueError, match="8192"):
        Image(0, "hash:net", Geometry(1, 12, 4), v6=True)
