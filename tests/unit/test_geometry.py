"""Unit tests for hypafilter.analysis.geometry: the bitset engine agrees with pairwise box tests."""

from __future__ import annotations

import numpy as np
import pytest
from hypafilter.analysis import geometry
from hypafilter.analysis.geometry import BoxSet
from hypafilter.ir import MAXV, NDIM, Box, Header


def _random_boxes(rng: np.random.Generator, m: int, small: bool = True) -> BoxSet:
    """Boxes over a small value range per dimension so that intersections are neither rare nor certain."""
    span = np.array([8, 8, 3, 6, 6, 2, 2, 4, 4]) if small else np.array(MAXV) + 1
    a = rng.integers(0, span, size=(m, NDIM))
    b = rng.integers(0, span, size=(m, NDIM))
    lo, hi = np.minimum(a, b), np.maximum(a, b)
    wild = rng.random((m, NDIM)) < 0.3
    lo[wild] = 0
    hi[wild] = np.broadcast_to(np.array(MAXV), (m, NDIM))[wild]
    fm = np.where(rng.random(m) < 0.3, rng.integers(0, 4, m), 0)
    fv = rng.integers(0, 4, m) & fm
    return BoxSet(lo.astype(np.int64), hi.astype(np.int64), fm, fv, rng.integers(0, 50, m))


@pytest.mark.parametrize("seed", range(6))
def test_any_intersection_matches_bruteforce(seed, monkeypatch):
    rng = np.random.default_rng(seed)
    # Tiny chunks and blocks exercise the chunk/ block boundaries (partial words, several chunks).
    monkeypatch.setattr(geometry, "SOURCE_CHUNK", 70)
    monkeypatch.setattr(geometry, "TARGET_BLOCK", 33)
    tg, src = _random_boxes(rng, 200), _random_boxes(rng, 230)
    before = rng.integers(0, 55, len(tg))
    assert (geometry.any_intersection(tg, src) == geometry.bruteforce_any_intersection(tg, src)).all()
    got = geometry.any_intersection(tg, src, before)
    assert (got == geometry.bruteforce_any_intersection(tg, src, before)).all()
    assert 0 < got.sum() < len(tg)  # the case mix is not degenerate


def test_intersecting_owners_and_first_match(monkeypatch):
    rng = np.random.default_rng(7)
    monkeypatch.setattr(geometry, "SOURCE_CHUNK", 64)
    tg, src = _random_boxes(rng, 120), _random_boxes(rng, 150)
    owners = geometry.intersecting_owners(tg, src)
    for i in range(len(tg)):
        one = tg.take(np.array([i]))
        want = sorted(
            {
                int(src.owner[j])
                for j in range(len(src))
                if geometry.bruteforce_any_intersection(one, src.take(np.array([j])))[0]
            }
        )
        assert list(owners[i]) == want
    pts = rng.integers(0, [8, 8, 3, 6, 6, 2, 2, 4, 4], size=(300, NDIM))
    flags = rng.integers(0, 4, 300)
    fm = geometry.first_match(BoxSet.points(pts, flags), src, default=-1)
    for p in range(300):
        inside = (src.lo <= pts[p]).all(axis=1) & (pts[p] <= src.hi).all(axis=1) & ((flags[p] & src.fmask) == src.fval)
        assert fm[p] == (src.owner[inside].min() if inside.any() else -1)


def test_from_unions_skips_empty_and_keeps_owner():
    full = Box.full()
    b = full.with_field("dport", 80, 80)
    empty = full.with_field("sport", 5, 4)
    bs = BoxSet.from_unions([[b, empty], [], [full]], owners=[3, 4, 9])
    assert list(bs.owner) == [3, 9]
    assert bs.lo[0, 4] == 80 and bs.hi[0, 4] == 80
    h = Header(proto=6, dport=80, tcp_flags=0x12)
    assert b.contains(h)
    pts = BoxSet.points(np.array([h.values()]), np.array([h.tcp_flags]))
    assert list(geometry.first_match(pts, bs, default=-1)) == [3]


def test_contained_in_any_matches_bruteforce(monkeypatch):
    rng = np.random.default_rng(11)
    monkeypatch.setattr(geometry, "SOURCE_CHUNK", 64)
    tg, src = _random_boxes(rng, 150), _random_boxes(rng, 200)
    got = geometry.contained_in_any(tg, src)
    inside = (src.lo[None] <= tg.lo[:, None]).all(2) & (tg.hi[:, None] <= src.hi[None]).all(2)
    inside &= ((src.fmask[None] & ~tg.fmask[:, None]) == 0) & (
        ((src.fval[None] ^ tg.fval[:, None]) & src.fmask[None]) == 0
    )
    assert (got == inside.any(axis=1)).all()
    assert 0 < got.sum() < len(tg)
