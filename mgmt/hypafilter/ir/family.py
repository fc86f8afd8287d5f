"""Address families of the IR (issue #25, docs/ipv6.md "Input and IR"): 32-bit IPv4 and 128-bit IPv6 addresses, and
the compression of an IPv6 policy's address dimensions to ranks that every analysis, plan and table builder takes as
it takes an IPv4 policy.

A family-6 policy (`Policy.family == 6`, read with `-6` or `--ipv6`) holds 128-bit address intervals in its boxes'
src and dst (Python ints; the rest of the header space is IPv4's: proto is the upper-layer protocol ipv6_find_hdr
finds, icmp_type/icmp_code are ICMPv6's under proto 58). numpy, the hardware and the xdp tables use at most 32-bit
address values, so an IPv6 policy is analysed through `compress`:

- per address dimension the starts of the policy's elementary intervals: every box's lo and hi + 1 (below
  2**128), and 0; sorted, `AddrMap.starts[dim]`, starts[0] = 0. Rank r stands for the addresses
  [starts[r], starts[r + 1] - 1], the last rank for [starts[-1], 2**128 - 1];
- every box's [lo, hi] becomes [rank(lo), rank(hi)], except that a box reaching 2**128 - 1 ends at 2**32 - 1 (MAXV)
  instead of at the top rank, so that an address left unrestricted stays the full interval (the analysis, the
  hardware generator and the xdp tables recognise it so). No frame's rank exceeds the top rank, so that changes no
  match;
- a frame's address maps to `AddrMap.rank(dim, addr)` (a binary search over the starts).

Exact for matching and for header-space analysis: a box's bounds are starts (lo) and starts minus one (hi), so every
address of one elementary interval lies in the same boxes, and a frame is in a box iff its rank is in the ranked box.
The ranked policy is an ordinary IR policy (ranks < 2**32) with `family` 6 and `addr_map` set; `build_plan` gives its
Plan `family` 6 and the same `addr_map`.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from hypafilter.ir.box import FIELD_INDEX, FULL_HI, MAXV, Box, Header

ADDR_BITS: dict[int, int] = {4: 32, 6: 128}
ADDR_MAX: dict[int, int] = {f: (1 << b) - 1 for f, b in ADDR_BITS.items()}
ADDR_DIMS: tuple[str, ...] = ("src", "dst")
_SRC, _DST = FIELD_INDEX["src"], FIELD_INDEX["dst"]


def full_hi(family: int) -> tuple[int, ...]:
    """The upper corner of the full box of a family's raw (uncompressed) policy."""
    if family not in ADDR_BITS:
        raise ValueError(f"unknown address family {family!r} (4 or 6)")
    hi = list(MAXV)
    hi[_SRC] = hi[_DST] = ADDR_MAX[family]
    return tuple(hi)


@contextmanager
def address_space(family: int) -> Iterator[None]:
    """While active, Box.full() (and everything built from it: field_boxes, product_boxes, ...) spans the family's
    addresses. The front end builds a family-6 policy's boxes inside it; nothing else needs it."""
    token = FULL_HI.set(full_hi(family))
    try:
        yield
    finally:
        FULL_HI.reset(token)


@dataclass(frozen=True)
class AddrMap:
    """The rank space of a compressed policy: per address dimension the sorted starts of its elementary intervals."""

    family: int
    starts: dict[str, tuple[int, ...]]

    def rank(self, dim: str, addr: int) -> int:
        """The rank of a frame's address in dimension `dim` ("src" or "dst")."""
        return bisect.bisect_right(self.starts[dim], addr) - 1

    def ranks(self, dim: str) -> int:
        """How many ranks dimension `dim` has (the top rank is ranks - 1)."""
        return len(self.starts[dim])

    def interval(self, dim: str, r: int) -> tuple[int, int]:
        """The addresses rank r of `dim` stands for."""
        s = self.starts[dim]
        hi = s[r + 1] - 1 if r + 1 < len(s) else ADDR_MAX[self.family]
        return s[r], hi

    def header(self, h: Header) -> Header:
        """A frame's header with its addresses replaced by their ranks (what a target's tables look up)."""
        return dataclasses.replace(h, src=self.rank("src", h.src), dst=self.rank("dst", h.dst))


def compress(policy):
    """(ranked policy, AddrMap) of a policy with wide addresses (see the module docstring). The ranked policy keeps
    everything else (original rules, levels, origins, sets, family) and carries `addr_map`."""
    from hypafilter.ir.rule import Policy  # (ir.rule imports nothing from here; keep the module import-light)

    assert isinstance(policy, Policy)
    top = ADDR_MAX[policy.family]
    cuts: dict[int, set[int]] = {_SRC: {0}, _DST: {0}}
    for r in policy.rules:
        for b in r.boxes:
            for d in (_SRC, _DST):
                cuts[d].add(b.lo[d])
                if b.hi[d] < top:
                    cuts[d].add(b.hi[d] + 1)
    starts = {d: tuple(sorted(c)) for d, c in cuts.items()}
    for d, s in starts.items():
        if len(s) > MAXV[d]:  # (2**32 - 1 elementary intervals: far beyond any policy the tool can analyse)
            raise ValueError(f"{len(s)} elementary address intervals do not fit 32-bit ranks")
    index = {d: {v: i for i, v in enumerate(s)} for d, s in starts.items()}

    def ranked(b: Box) -> Box:
        lo, hi = list(b.lo), list(b.hi)
        for d in (_SRC, _DST):
            lo[d] = index[d][b.lo[d]]
            hi[d] = MAXV[d] if b.hi[d] >= top else index[d][b.hi[d] + 1] - 1
        return Box(tuple(lo), tuple(hi), b.flags_mask, b.flags_value, b.sets_mask, b.sets_value)

    amap = AddrMap(policy.family, {"src": starts[_SRC], "dst": starts[_DST]})
    rules = [dataclasses.replace(r, boxes=tuple(ranked(b) for b in r.boxes)) for r in policy.rules]
    return dataclasses.replace(policy, rules=rules, addr_map=amap), amap
