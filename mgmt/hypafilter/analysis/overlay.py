"""The SFL update buffer (ARCHITECTURE §8, `../shared/papers/sfl-small-fast-lazy.txt`): a running matcher's static
entries, a valid mask over them and δ run-time-writable buffer slots, which together decide as the master rule set.

Index space of the hardware with a buffer ("hardware index"; the metadata's match_index, the SHUNT/ACTION/HITS rows,
the shim's interval map): 0 .. n-1 the static entries, n the policy entry, n + 1 + b buffer slot b (b < depth). The
decision (`hw_index`, the one definition; `analysis.decision` calls it for a plan that carries an overlay):

    i = the first static entry j with valid[j] whose boxes hold the header (n when none does)
    the first slot b, in slot order, with pos_b <= i whose box holds the header: n + 1 + b
    otherwise i

Slots are kept sorted by insert position (ties in the master rule set's order), so "the first slot in slot order"
is "the lowest insert position, then buffer order" of §8. A master entry of several boxes (multiport, negations)
takes one slot per box, all with the same position and master index.

`align` finds the overlay that makes a running matcher decide as a new plan (the master rule set), and the table
rows (shunt, action, mirror, interval) of every hardware index from that plan; `view` is what the targets program.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field

import numpy as np

from hypafilter.analysis.geometry import BoxSet, first_match
from hypafilter.ir import NDIM, Box


@dataclass(frozen=True)
class Slot:
    """One update-buffer entry: one box, the static entry it precedes (`pos`, 0 .. n; n = after every static entry)
    and the master rule set's entry it stands for."""

    box: Box
    pos: int
    master: int


@dataclass
class Overlay:
    """What the buffer and the valid mask hold, for a matcher of `n_static` entries with `depth` slots."""

    n_static: int
    depth: int
    valid: np.ndarray  # bool [n_static]
    slots: tuple[Slot, ...] = ()

    def __post_init__(self):
        self.valid = np.asarray(self.valid, dtype=bool)
        if self.valid.shape != (self.n_static,):
            raise ValueError(f"valid mask of {self.valid.shape} for {self.n_static} static entries")
        if len(self.slots) > self.depth:
            raise ValueError(f"{len(self.slots)} buffer slots for a buffer of {self.depth}")
        if any(a.pos > b.pos for a, b in zip(self.slots, self.slots[1:], strict=False)):
            raise ValueError("buffer slots must be sorted by insert position")
        if any(not 0 <= s.pos <= self.n_static for s in self.slots):
            raise ValueError("a buffer slot's insert position is outside 0 .. n_static")

    @classmethod
    def empty(cls, n_static: int, depth: int) -> Overlay:
        return cls(n_static, depth, np.ones(n_static, dtype=bool), ())

    @property
    def rows(self) -> int:
        """Table rows of the hardware index space: static entries, the policy entry, the slots."""
        return self.n_static + 1 + self.depth

    @property
    def used(self) -> int:
        return len(self.slots)

    @property
    def pristine(self) -> bool:
        """Nothing in the buffer and every static entry valid: the matcher decides as it was built."""
        return not self.slots and bool(self.valid.all())

    def slot_set(self) -> BoxSet:
        return BoxSet.from_unions([[s.box] for s in self.slots])


def hw_indices(static: BoxSet, ov: Overlay, points: BoxSet) -> np.ndarray:
    """The hardware index of many headers (`points`, as BoxSet.points): `static` holds the matcher's entries' boxes
    (owner = entry index)."""
    n = ov.n_static
    keep = ov.valid[static.owner] if len(static) else np.zeros(0, dtype=bool)
    i = first_match(points, static.take(np.flatnonzero(keep)), default=n)
    if not ov.slots:
        return i
    out = i.copy()
    pos = np.array([s.pos for s in ov.slots], dtype=np.int64)
    pending = np.ones(len(points), dtype=bool)
    # slots in order: the first that holds a point with pos <= i wins (few slots: one pass each)
    for b, s in enumerate(ov.slots):
        one = BoxSet.from_unions([[s.box]])
        hit = first_match(points, one, default=-1) == 0
        win = pending & hit & (pos[b] <= i)
        out[win] = n + 1 + b
        pending &= ~win
    return out


@dataclass
class View:
    """A running matcher with its overlay, in the shape every consumer of a plan reads (`analysis.decision`,
    `hw.model`, `NicClient.program`, the XDP target): `entries` are the static entries (the matcher's identity),
    the tables have one row per hardware index."""

    entries: list  # the static plan's entries (each with .boxes)
    overlay: Overlay
    shunt: np.ndarray  # bool [rows]
    actions: np.ndarray  # int [rows]
    interval: np.ndarray  # int [rows]
    mirror: np.ndarray | None  # bool [rows] or None
    miss_shunt: tuple[bool, bool]
    master: np.ndarray  # int [rows]: the master entry of each hardware index (-1: an unused slot)
    plan: object = field(repr=False, default=None)  # the master rule set's Plan
    shunt_none: np.ndarray | None = None  # bool [rows]: the master's Plan.shunt_none per row (None: `shunt`)

    @property
    def n(self) -> int:
        return len(self.entries)

    @property
    def policy(self):
        return self.plan.policy

    @property
    def valid(self) -> np.ndarray:
        return self.overlay.valid

    @property
    def slots(self) -> tuple[Slot, ...]:
        return self.overlay.slots

    # The matcher's set tables are the master's: an update keeps a matcher only when its set slots are the master
    # plan's (ops.buffer.static_sets), so the view's hash and tables read them from the master.
    @property
    def set_slots(self) -> tuple:
        return tuple(getattr(self.plan, "set_slots", ()) or ())

    @property
    def set_geometry(self):
        return getattr(self.plan, "set_geometry", None)


class BufferFull(Exception):
    """The master rule set needs more buffer slots than the matcher has: a new core (program) must be built."""

    def __init__(self, needed: int, depth: int):
        super().__init__(f"the change needs {needed} update-buffer slots; the matcher has {depth}")
        self.needed = needed
        self.depth = depth


def _entry_key(e) -> tuple:
    return tuple(sorted(e.boxes))


def align(static_entries: list, master_plan, depth: int) -> View:
    """The overlay and tables under which a matcher built from `static_entries` decides as `master_plan`.

    The static entries kept are a longest common subsequence of the two entry lists (equal boxes, in order); every
    other static entry is masked off, every other master entry becomes one slot per box, inserted before the next
    kept static entry. Raises BufferFull when that takes more than `depth` slots."""
    n = len(static_entries)
    m = len(master_plan.entries)
    a = [_entry_key(e) for e in static_entries]
    b = [_entry_key(e) for e in master_plan.entries]
    sm = difflib.SequenceMatcher(None, a, b, autojunk=False)
    kept: dict[int, int] = {}  # static index -> master index
    for blk in sm.get_matching_blocks():
        for t in range(blk.size):
            kept[blk.a + t] = blk.b + t
    valid = np.zeros(n, dtype=bool)
    valid[list(kept)] = True
    master_to_static = {mj: si for si, mj in kept.items()}
    # next kept static entry after each master entry (its insert position)
    slots: list[Slot] = []
    nxt = n
    pos_of = [n] * m
    for mj in range(m - 1, -1, -1):
        if mj in master_to_static:
            nxt = master_to_static[mj]
        pos_of[mj] = nxt
    for mj in range(m):
        if mj in master_to_static:
            continue
        for bx in master_plan.entries[mj].boxes:
            if not bx.is_empty():
                slots.append(Slot(bx, pos_of[mj], mj))
    if len(slots) > depth:
        raise BufferFull(len(slots), depth)
    slots.sort(key=lambda s: (s.pos, s.master))
    ov = Overlay(n, depth, valid, tuple(slots))
    rows = ov.rows
    master = np.full(rows, -1, dtype=np.int64)
    for si, mj in kept.items():
        master[si] = mj
    master[n] = m  # the policy entry
    for bi, s in enumerate(slots):
        master[n + 1 + bi] = s.master
    live = master >= 0
    src = np.where(live, master, m)

    def rows_of(arr, fill):
        if arr is None:
            return None
        arr = np.asarray(arr)
        out = arr[src].copy()
        out[~live] = fill
        return out

    p = master_plan
    shunt = rows_of(p.shunt, True).astype(bool)
    actions = rows_of(p.actions, 0).astype(np.int64)
    interval = rows_of(p.interval, 0).astype(np.int64)
    mirror = rows_of(getattr(p, "mirror", None), False)
    none = rows_of(getattr(p, "shunt_none", None), True)
    return View(
        entries=list(static_entries),
        overlay=ov,
        shunt=shunt,
        actions=actions,
        interval=interval,
        mirror=None if mirror is None else mirror.astype(bool),
        miss_shunt=tuple(getattr(p, "miss_shunt", (False, False))),
        master=master,
        plan=p,
        shunt_none=None if none is None else none.astype(bool),
    )


def box_key(ov: Overlay) -> list[tuple]:
    """The slots as plain tuples (lo, hi, flags mask, flags value, pos[, sets mask, sets value]): what a target writes
    and reads back (the sets ternary only where a slot has one: targets without set slots never write it)."""
    return [
        (s.box.lo, s.box.hi, s.box.flags_mask, s.box.flags_value, s.pos)
        + ((s.box.sets_mask, s.box.sets_value) if s.box.sets_mask else ())
        for s in ov.slots
    ]


assert NDIM == 9  # the slot word layout (hw/regmap.txt BUF, the XDP program's hf_buf) names these nine fields


# ---- IPv6: the buffer of a ranked plan (docs/ipv6.md "The update buffer for IPv6") ---------------------------------

ADDR6_TOP = (1 << 128) - 1


def unranked_boxes(plan6, entry) -> tuple[Box, ...]:
    """An entry of a family-6 plan (boxes on the address ranks of `plan6.addr_map`) as the boxes in address space
    it stands for: each rank interval [r_lo, r_hi] becomes [starts[r_lo], end of rank r_hi] (a box reaching the last
    rank reaches the top address, as targets.xdp.tables.build_tables6 writes it); a box whose lowest rank no address
    has is empty and left out. Exact: every address of one elementary interval is in the same boxes."""
    from hypafilter.ir import FIELDS

    amap = plan6.addr_map
    out = []
    for b in entry.boxes:
        if b.is_empty():
            continue
        lo, hi = list(b.lo), list(b.hi)
        empty = False
        for dim in ("src", "dst"):
            i = FIELDS.index(dim)
            starts = amap.starts[dim]
            top = len(starts) - 1
            if lo[i] > top:
                empty = True
                break
            a_lo = int(starts[lo[i]])
            a_hi = ADDR6_TOP if hi[i] >= top else int(starts[hi[i] + 1]) - 1
            lo[i], hi[i] = a_lo, a_hi
        if not empty:
            out.append(Box(tuple(lo), tuple(hi), b.flags_mask, b.flags_value, b.sets_mask, b.sets_value))
    return tuple(out)


@dataclass
class _Entry6:
    boxes: tuple


@dataclass
class _Master6:
    entries: list
    shunt: np.ndarray
    actions: np.ndarray
    interval: np.ndarray
    mirror: object
    shunt_none: object
    miss_shunt: tuple
    policy: object = None
    set_slots: tuple = ()


def align6(static6, master6, depth: int, k_base: int = 0, verbatim: bool = False) -> View:
    """`align` for family-6 plans: the overlay under which a running IPv6 table set built from the plan `static6`
    decides as the plan `master6`, though the two rank their addresses differently (a changed rule can add elementary
    intervals, which renumbers the ranks). Both plans' entries are compared, and the slots written, in address space
    (`unranked_boxes`): a kept static entry matches the same addresses in the running tables as the master entry it
    stands for, and a slot holds raw 128-bit address intervals, which the targets compare as such. The rows are the
    master's, its non-zero k offset by `k_base` (0 everywhere when `verbatim`), as build_tables6 writes them. The
    View's `entries` and `master`'s boxes are in address space. Raises BufferFull as `align`."""
    static = [_Entry6(unranked_boxes(static6, e)) for e in static6.entries]
    entries = [_Entry6(unranked_boxes(master6, e)) for e in master6.entries]
    interval = np.array([int(k) + k_base if int(k) and not verbatim else 0 for k in master6.interval], dtype=np.int64)
    m = _Master6(
        entries=entries,
        shunt=np.asarray(master6.shunt),
        actions=np.asarray(master6.actions),
        interval=interval,
        mirror=getattr(master6, "mirror", None),
        shunt_none=getattr(master6, "shunt_none", None),
        miss_shunt=tuple(getattr(master6, "miss_shunt", (False, False))),
        policy=getattr(master6, "policy", None),
        # the set slots the master's boxes test (a dual-stack core's IPv6 set tables: the View's tables load them)
        set_slots=tuple(getattr(master6, "set_slots", ()) or ()),
    )
    return align(static, m, depth)
