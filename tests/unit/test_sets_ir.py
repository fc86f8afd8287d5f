"""Unit tests of the set-slot ternary of the IR (ir.box sets_mask/sets_value, Header.sets) and ir.sets."""

from __future__ import annotations

import itertools

import numpy as np
from hypafilter.analysis.geometry import BoxSet, first_match
from hypafilter.ir import Box, Header
from hypafilter.ir.box import box_minus, boxes_minus
from hypafilter.ir.sets import MAX_SET_SLOTS, SetElem, SetInfo, SetSlot, elem_matches

FULL = Box.full()


def _sets_box(mask: int, value: int, **fields) -> Box:
    b = FULL
    for name, (lo, hi) in fields.items():
        b = b.with_field(name, lo, hi)
    out = b.with_sets(mask, value)
    assert out is not None
    return out


def test_box_rejects_value_outside_mask():
    try:
        Box(FULL.lo, FULL.hi, 0, 0, 0b01, 0b10)
    except ValueError as e:
        assert "sets_value" in str(e)
    else:
        raise AssertionError("accepted a sets value outside its mask")


def test_intersect_contains_and_with_field_keep_sets():
    a = _sets_box(0b01, 0b01)  # member of slot 0
    b = _sets_box(0b11, 0b00)  # member of neither slot
    c = _sets_box(0b10, 0b10, dst=(5, 9))
    assert a.intersect(b) is None
    ac = a.intersect(c)
    assert ac is not None and (ac.sets_mask, ac.sets_value) == (0b11, 0b11)
    assert ac.with_field("src", 1, 2).sets_mask == 0b11
    assert a.with_sets(0b01, 0) is None
    assert ac.contains(Header(dst=5, sets=0b11))
    assert not ac.contains(Header(dst=5, sets=0b01))
    assert not ac.contains(Header(dst=10, sets=0b11))
    assert FULL.contains(Header(sets=0b101))


def test_minus_over_set_bits_is_exact():
    """a \\ b over every header of a small space: the pieces are disjoint and cover exactly a minus b."""
    a = _sets_box(0b001, 0b001, dst=(0, 3))
    b = _sets_box(0b110, 0b010, dst=(2, 5))
    pieces = box_minus(a, b)
    for dst, sets in itertools.product(range(8), range(8)):
        h = Header(dst=dst, sets=sets)
        want = a.contains(h) and not b.contains(h)
        got = [p.contains(h) for p in pieces]
        assert sum(got) == int(want), (dst, sets, pieces)
    assert boxes_minus([a], [a]) == []


def test_geometry_reads_the_sets_ternary():
    """The numpy engine's first match agrees with Box.contains for headers with set bits."""
    rules = [[_sets_box(0b01, 0b01, dst=(0, 3))], [_sets_box(0b10, 0b00)], [FULL]]
    src = BoxSet.from_unions(rules)
    hdrs = [Header(dst=d, tcp_flags=f, sets=s) for d in (1, 7) for f in (0, 0x12) for s in range(4)]
    vals = np.array([h.values() for h in hdrs], dtype=np.int64)
    flags = np.array([h.tcp_flags | h.sets << 8 for h in hdrs], dtype=np.int64)
    got = first_match(BoxSet.points(vals, flags), src, default=3)
    want = [next(i for i, r in enumerate(rules) if any(b.contains(h) for b in r)) for h in hdrs]
    assert got.tolist() == want


def test_slot_and_elements():
    assert MAX_SET_SLOTS == 8
    slot = SetSlot("svc", "hash:ip,port", ("dst", "dst"))
    assert str(slot) == "svc dst,dst"
    info = SetInfo("svc", "hash:ip,port", entries=(SetElem(0x0A000001, 0x0A000001, 32, 6, 80),))
    assert info.dimension == 2 and info.supported() == ""
    e = info.entries[0]
    assert elem_matches(info, e, 1, 0x0A000001, 6, 1000, 80, slot.dirs)
    assert not elem_matches(info, e, 1, 0x0A000001, 17, 1000, 80, slot.dirs)  # the proto is part of the key
    assert not elem_matches(info, e, 1, 0x0A000001, 6, 80, 1000, slot.dirs)
    assert "type" in SetInfo("x", "list:set").supported()
    assert "family" in SetInfo("x", "hash:ip", family="inet6").supported()
