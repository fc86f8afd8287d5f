"""Numpy form of many box unions and the vectorised intersection / first-match engine used by the analysis.

A `BoxSet` holds m boxes as arrays (lo[m, NDIM], hi[m, NDIM], one ternary mask/value, owner): the ternary's low
8 bits are the TCP-flags test, the bits above them the set-slot test (Box.sets_mask << 8). The engine answers
"which source boxes intersect this target box (optionally: only sources whose owner is below a bound)" for many
targets at once. Instead of testing all target × source pairs (9e8 pairs for 90k simple × 10k complex rules),
it precomputes, per dimension, cumulative bitsets over the sources: row r of the "lo" table is the set of sources
with lo <= key[r], row r of the "hi" table the set with hi >= key[r]. A target interval [a, b] intersects a
source in that dimension iff the source is in lo-row(b) and hi-row(a); AND-ing those rows over the dimensions
(plus a flags-compatibility row and an owner-prefix mask) gives the exact set of intersecting sources as
m/64 machine words per target. Points are boxes of width 0, so first-match classification of trace headers is
the same operation followed by "lowest set bit" (sources are ordered by owner = priority).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.ma  # np.unique's first call imports it (~10 ms): at import, not inside the first update

from hypafilter.errors import HypafilterError
from hypafilter.ir import MAXV, NDIM, Box
from hypafilter.ir.sets import MAX_SET_SLOTS

# Every bit of the combined ternary (8 TCP flag bits, then one bit per set slot).
TERNARY_MASK = (1 << (8 + MAX_SET_SLOTS)) - 1

_MAXV = np.array(MAXV, dtype=np.int64)
# Sources are processed in chunks so that the per-dimension tables stay small (rows x chunk/64 words each).
SOURCE_CHUNK = 4096
TARGET_BLOCK = 1024


@dataclass
class BoxSet:
    """m boxes as arrays; `owner[i]` is the index (rule position, entry index, ...) box i belongs to."""

    lo: np.ndarray  # int64 [m, NDIM]
    hi: np.ndarray  # int64 [m, NDIM]
    fmask: np.ndarray  # int64 [m]
    fval: np.ndarray  # int64 [m]
    owner: np.ndarray  # int64 [m]

    def __len__(self) -> int:
        return int(self.owner.shape[0])

    @classmethod
    def empty(cls) -> BoxSet:
        z = np.zeros((0, NDIM), dtype=np.int64)
        e = np.zeros(0, dtype=np.int64)
        return cls(z, z.copy(), e, e.copy(), e.copy())

    @classmethod
    def from_unions(cls, unions: Sequence[Sequence[Box]], owners: Sequence[int] | None = None) -> BoxSet:
        """One BoxSet from several unions; the boxes of unions[j] get owner owners[j] (default j)."""
        lo, hi, fm, fv, ow = [], [], [], [], []
        for j, boxes in enumerate(unions):
            o = j if owners is None else owners[j]
            for b in boxes:
                if b.is_empty():
                    continue
                lo.append(b.lo)
                hi.append(b.hi)
                fm.append(b.flags_mask | b.sets_mask << 8)
                fv.append(b.flags_value | b.sets_value << 8)
                ow.append(o)
        if not ow:
            return cls.empty()
        try:
            lo_a, hi_a = np.array(lo, dtype=np.int64), np.array(hi, dtype=np.int64)
        except OverflowError:  # 128-bit addresses of an IPv6 policy that was not ranked
            raise HypafilterError(
                "boxes with 128-bit addresses: an IPv6 policy is analysed on its address ranks (ir.family.compress)"
            ) from None
        return cls(
            lo_a.reshape(-1, NDIM),
            hi_a.reshape(-1, NDIM),
            np.array(fm, dtype=np.int64),
            np.array(fv, dtype=np.int64),
            np.array(ow, dtype=np.int64),
        )

    @classmethod
    def points(cls, values: np.ndarray, flags: np.ndarray | None = None) -> BoxSet:
        """Headers as zero-width boxes: values[p, NDIM] (FIELDS order), flags[p] the TCP flags byte, with the
        header's set-slot bits above it (tcp_flags | sets << 8; sets 0 when only the flags byte is given)."""
        v = np.asarray(values, dtype=np.int64).reshape(-1, NDIM)
        f = np.zeros(len(v), dtype=np.int64) if flags is None else np.asarray(flags, dtype=np.int64)
        # A point's flags and set bits are fully specified: mask = all 8 flag bits and every slot bit.
        return cls(
            v, v, np.full(len(v), TERNARY_MASK, dtype=np.int64), f & TERNARY_MASK, np.arange(len(v), dtype=np.int64)
        )

    def take(self, idx: np.ndarray) -> BoxSet:
        return BoxSet(self.lo[idx], self.hi[idx], self.fmask[idx], self.fval[idx], self.owner[idx])

    def select_owners(self, owners: np.ndarray | Sequence[int]) -> BoxSet:
        """The boxes whose owner is in `owners`."""
        return self.take(np.isin(self.owner, np.asarray(owners, dtype=np.int64)))


def _set_bits(rows: np.ndarray, row_of: np.ndarray) -> None:
    """rows[row_of[j], j // 64] |= 1 << (j % 64) for every source j."""
    j = np.arange(len(row_of))
    np.bitwise_or.at(rows, (row_of, j >> 6), np.left_shift(np.uint64(1), (j & 63).astype(np.uint64)))


class _Chunk:
    """Bitset tables over one chunk of sources (sorted by owner)."""

    def __init__(self, src: BoxSet):
        self.src = src
        m = len(src)
        self.m = m
        self.words = (m + 63) >> 6
        self.tables: list[tuple[int, np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = []
        for d in range(NDIM):
            lo, hi = src.lo[:, d], src.hi[:, d]
            if not lo.any() and (hi == _MAXV[d]).all():
                continue  # every source is a wildcard here: the dimension never excludes anything
            klo = np.unique(lo)
            rlo = np.zeros((len(klo) + 1, self.words), dtype=np.uint64)  # row 0: "lo <= b" with b below all keys
            _set_bits(rlo, np.searchsorted(klo, lo) + 1)
            np.bitwise_or.accumulate(rlo, axis=0, out=rlo)
            khi = np.unique(hi)
            rhi = np.zeros((len(khi) + 1, self.words), dtype=np.uint64)  # last row: "hi >= a" with a above all
            _set_bits(rhi, np.searchsorted(khi, hi))
            rhi[::-1] = np.bitwise_or.accumulate(rhi[::-1], axis=0)
            self.tables.append((d, klo, rlo, khi, rhi))
        self.flag_sources = bool(src.fmask.any())

    def and_bits(self, tgt: BoxSet, before: np.ndarray | None, contain: bool = False) -> np.ndarray:
        """[len(tgt), words] bitsets of the sources intersecting each target (and with owner < before).

        With `contain`, the sources that contain the whole target box instead (lo <= target lo, hi >= target hi).
        """
        n = len(tgt)
        acc = np.full((n, self.words), np.uint64(0xFFFFFFFFFFFFFFFF), dtype=np.uint64)
        if self.m & 63:
            acc[:, -1] = np.uint64((1 << (self.m & 63)) - 1)
        if before is not None:
            cnt = np.searchsorted(self.src.owner, before, side="left")
            base = np.arange(self.words, dtype=np.int64) * 64
            rem = np.clip(cnt[:, None] - base[None, :], 0, 64)
            partial = np.left_shift(np.uint64(1), np.minimum(rem, 63).astype(np.uint64)) - np.uint64(1)
            acc &= np.where(rem >= 64, np.uint64(0xFFFFFFFFFFFFFFFF), partial)
        for d, klo, rlo, khi, rhi in self.tables:
            acc &= rlo[np.searchsorted(klo, (tgt.lo if contain else tgt.hi)[:, d], side="right")]
            acc &= rhi[np.searchsorted(khi, (tgt.hi if contain else tgt.lo)[:, d], side="left")]
        if self.flag_sources:
            pairs, inv = np.unique(np.stack([tgt.fmask, tgt.fval], axis=1), axis=0, return_inverse=True)
            frows = np.zeros((len(pairs), self.words), dtype=np.uint64)
            for r, (fm, fv) in enumerate(pairs):
                if contain:  # every packet of the target satisfies the source's flag test
                    ok = ((self.src.fmask & ~fm) == 0) & (((self.src.fval ^ fv) & self.src.fmask) == 0)
                else:
                    ok = ((self.src.fval ^ fv) & self.src.fmask & fm) == 0
                frows[r] = _pack(ok, self.words)
            acc &= frows[inv.reshape(-1)]
        return acc


def _pack(ok: np.ndarray, words: int) -> np.ndarray:
    """A bool vector as little-endian uint64 bitset words."""
    b = np.packbits(ok.astype(np.uint8), bitorder="little")
    buf = np.zeros(words * 8, dtype=np.uint8)
    buf[: len(b)] = b
    return buf.view(np.uint64)


def _chunks(src: BoxSet) -> Iterator[_Chunk]:
    order = np.argsort(src.owner, kind="stable")
    s = src.take(order)
    for start in range(0, len(s), SOURCE_CHUNK):
        yield _Chunk(s.take(np.arange(start, min(start + SOURCE_CHUNK, len(s)))))


def any_intersection(targets: BoxSet, sources: BoxSet, before: np.ndarray | None = None) -> np.ndarray:
    """bool[len(targets)]: target i intersects some source box (with source owner < before[i] when given)."""
    hit = np.zeros(len(targets), dtype=bool)
    if len(targets) == 0 or len(sources) == 0:
        return hit
    bef = None if before is None else np.asarray(before, dtype=np.int64)
    for ch in _chunks(sources):
        # Targets whose bound lies below the chunk's first owner cannot see it; found targets are done.
        todo = ~hit
        if bef is not None:
            todo &= bef > ch.src.owner[0]
        idx = np.flatnonzero(todo)
        for s in range(0, len(idx), TARGET_BLOCK):
            blk = idx[s : s + TARGET_BLOCK]
            bits = ch.and_bits(targets.take(blk), None if bef is None else bef[blk])
            hit[blk] = bits.any(axis=1)
    return hit


def contained_in_any(targets: BoxSet, sources: BoxSet) -> np.ndarray:
    """bool[len(targets)]: target i lies entirely inside one single source box."""
    hit = np.zeros(len(targets), dtype=bool)
    if len(targets) == 0 or len(sources) == 0:
        return hit
    for ch in _chunks(sources):
        idx = np.flatnonzero(~hit)
        for s in range(0, len(idx), TARGET_BLOCK):
            blk = idx[s : s + TARGET_BLOCK]
            hit[blk] = ch.and_bits(targets.take(blk), None, contain=True).any(axis=1)
    return hit


def intersecting_owners(targets: BoxSet, sources: BoxSet, before: np.ndarray | None = None) -> list[np.ndarray]:
    """Per target box: sorted unique owners of the source boxes it intersects (owner < before[i] when given)."""
    out: list[list[np.ndarray]] = [[] for _ in range(len(targets))]
    if len(targets) and len(sources):
        bef = None if before is None else np.asarray(before, dtype=np.int64)
        for ch in _chunks(sources):
            for s in range(0, len(targets), TARGET_BLOCK):
                blk = np.arange(s, min(s + TARGET_BLOCK, len(targets)))
                bits = ch.and_bits(targets.take(blk), None if bef is None else bef[blk])
                rows = np.flatnonzero(bits.any(axis=1))
                if not len(rows):
                    continue
                unpacked = np.unpackbits(bits[rows].view(np.uint8), axis=1, bitorder="little")[:, : ch.m]
                for r, u in zip(rows, unpacked, strict=True):
                    out[blk[r]].append(ch.src.owner[np.flatnonzero(u)])
    return [np.unique(np.concatenate(o)) if o else np.zeros(0, dtype=np.int64) for o in out]


def first_match(points: BoxSet, sources: BoxSet, default: int) -> np.ndarray:
    """int64[len(points)]: the smallest owner among source boxes containing each point, else `default`."""
    res = np.full(len(points), default, dtype=np.int64)
    if len(points) == 0 or len(sources) == 0:
        return res
    done = np.zeros(len(points), dtype=bool)
    for ch in _chunks(sources):
        idx = np.flatnonzero(~done)
        for s in range(0, len(idx), TARGET_BLOCK):
            blk = idx[s : s + TARGET_BLOCK]
            bits = ch.and_bits(points.take(blk), None)
            nz = bits != 0
            rows = np.flatnonzero(nz.any(axis=1))
            if not len(rows):
                continue
            w = nz[rows].argmax(axis=1)
            word = bits[rows, w]
            low = word & (~word + np.uint64(1))
            bit = np.log2(low.astype(np.float64)).astype(np.int64)  # exact: low is a power of two
            res[blk[rows]] = ch.src.owner[w * 64 + bit]
            done[blk[rows]] = True
    return res


def owners_any(box_hits: np.ndarray, owners: np.ndarray, n: int) -> np.ndarray:
    """bool[n]: owner j has at least one box with box_hits set."""
    out = np.zeros(n, dtype=bool)
    out[owners[box_hits]] = True
    return out


def bruteforce_any_intersection(targets: BoxSet, sources: BoxSet, before: np.ndarray | None = None) -> np.ndarray:
    """The same answer as any_intersection by testing every pair (for tests on small inputs)."""
    if len(targets) == 0 or len(sources) == 0:
        return np.zeros(len(targets), dtype=bool)
    ok = (targets.lo[:, None, :] <= sources.hi[None, :, :]).all(axis=2)
    ok &= (sources.lo[None, :, :] <= targets.hi[:, None, :]).all(axis=2)
    ok &= ((targets.fval[:, None] ^ sources.fval[None, :]) & targets.fmask[:, None] & sources.fmask[None, :]) == 0
    if before is not None:
        ok &= sources.owner[None, :] < np.asarray(before)[:, None]
    return ok.any(axis=1)
