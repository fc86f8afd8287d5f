"""The update buffer's register image (hw/hf_update_buffer.vhd; hw/regmap.txt BUF_CONFIG and tables VALID, BUF): the
words of a slot and of the valid mask, an analysis.overlay.Overlay as those words and back, and the order in which the
host writes a change. Defined once here for the model of the core (hw.model), the register client (targets.nic) and
the testbenches.

The decision itself is analysis.overlay.hw_indices; the hardware evaluates exactly that over its slots in slot order,
whatever their positions. An image describes an Overlay when its enabled slots are sorted by position (what every
write sequence below leaves and the host keeps); `overlay_of` refuses any other image.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from hypafilter.analysis.overlay import Overlay, Slot
from hypafilter.config import UPDATE_BUFFER_DEFAULT
from hypafilter.ir import FIELDS, MAXV, Box

WORDS = 16  # BUF index stride: word w of slot b is table index b * WORDS + w
USED = 11  # words 0..10 hold a slot; 11..15 read 0 and ignore writes
W_FLAGS = 8  # TCP flags mask | value << 8
W_CONTROL = 9  # enable << 31 | pos: written last, it makes the slot live
W_SETS = 10  # set slot bits (ir.sets) mask | value << 8
ENABLE = 1 << 31
POS_MASK = 0xFFFFFF
# (lo word, lo shift, hi word, hi shift) of each field, in the order of ir.FIELDS
LAYOUT: dict[str, tuple[int, int, int, int]] = {
    "src": (0, 0, 1, 0),
    "dst": (2, 0, 3, 0),
    "proto": (6, 0, 6, 8),
    "sport": (4, 0, 4, 16),
    "dport": (5, 0, 5, 16),
    "icmp_type": (6, 16, 6, 24),
    "icmp_code": (7, 0, 7, 8),
    "iport": (7, 16, 7, 18),
    "ct": (7, 20, 7, 22),
}
assert tuple(LAYOUT) == FIELDS


def _word_masks() -> tuple[int, ...]:
    masks = [0] * USED
    for name, (lw, ls, hw, hs) in LAYOUT.items():
        m = MAXV[FIELDS.index(name)]
        masks[lw] |= m << ls
        masks[hw] |= m << hs
    masks[W_FLAGS] = 0xFFFF
    masks[W_CONTROL] = ENABLE | POS_MASK
    masks[W_SETS] = 0xFFFF
    return tuple(masks)


WORD_MASKS = _word_masks()  # the bits each word holds; the others read 0
# a box no header is in: what a disabled slot stands for in an Overlay (BoxSet.from_unions drops empty boxes)
NEVER = Box(tuple(MAXV), tuple(0 for _ in FIELDS))


def buffer_depth(plan) -> int:
    """Update buffer slots (δ) of the core built for `plan`: an analysis.overlay.View's overlay depth, a Plan's or
    HwPlan's buffer_depth (Config.update_buffer), the default for anything else."""
    ov = getattr(plan, "overlay", None)
    if ov is not None:
        return ov.depth
    return int(getattr(plan, "buffer_depth", UPDATE_BUFFER_DEFAULT))


def rows(plan) -> int:
    """Rows of the core's SHUNT, ACTION and HITS tables: every hardware index (entries, policy entry, slots)."""
    return len(plan.entries) + 1 + buffer_depth(plan)


def slot_words(slot: Slot | None) -> list[int]:
    """The USED words of a slot, enabled; None: a disabled slot (all zero)."""
    if slot is None:
        return [0] * USED
    b = slot.box
    if b.is_empty():
        raise ValueError("an empty box cannot be a slot (it would never match; leave the slot disabled)")
    if not 0 <= slot.pos <= POS_MASK:
        raise ValueError(f"slot position {slot.pos} does not fit the control word")
    w = [0] * USED
    for k, (lw, ls, hw, hs) in enumerate(LAYOUT.values()):
        w[lw] |= b.lo[k] << ls
        w[hw] |= b.hi[k] << hs
    w[W_FLAGS] = b.flags_mask | b.flags_value << 8
    if b.sets_mask >> 8:
        raise ValueError("a slot tests at most 8 set slots (w10)")
    w[W_SETS] = b.sets_mask | b.sets_value << 8
    w[W_CONTROL] = ENABLE | slot.pos
    return w


def slot_of(words: Sequence[int], master: int = -1) -> Slot | None:
    """The slot the USED words describe, None when disabled."""
    if not words[W_CONTROL] & ENABLE:
        return None
    lo, hi = [], []
    for k, (lw, ls, hw, hs) in enumerate(LAYOUT.values()):
        m = MAXV[k]
        lo.append((words[lw] >> ls) & m)
        hi.append((words[hw] >> hs) & m)
    fmask, fval = words[W_FLAGS] & 0xFF, (words[W_FLAGS] >> 8) & 0xFF
    smask, sval = words[W_SETS] & 0xFF, (words[W_SETS] >> 8) & 0xFF
    pos = words[W_CONTROL] & POS_MASK
    if fval & ~fmask or sval & ~smask:  # (flags & mask) == value never holds
        return Slot(NEVER, pos, master)
    return Slot(Box(tuple(lo), tuple(hi), fmask, fval, smask, sval), pos, master)


def valid_words(valid: Sequence[bool]) -> list[int]:
    """The VALID table: bit j of word w = static entry 32 * w + j."""
    words = [0] * ((len(valid) + 31) // 32)
    for i, v in enumerate(valid):
        if v:
            words[i // 32] |= 1 << (i % 32)
    return words


def valid_of(words: Sequence[int], n: int) -> np.ndarray:
    return np.array([bool(words[i // 32] >> (i % 32) & 1) for i in range(n)], dtype=bool)


@dataclass(frozen=True)
class Image:
    """What the VALID and BUF tables hold for a matcher of `n` static entries: `valid` the VALID words, `buf` USED
    words per slot (slot b at b * USED)."""

    n: int
    valid: tuple[int, ...]
    buf: tuple[int, ...]

    @property
    def depth(self) -> int:
        return len(self.buf) // USED

    def slot(self, b: int) -> tuple[int, ...]:
        return self.buf[b * USED : (b + 1) * USED]

    def enabled(self, b: int) -> bool:
        return bool(self.buf[b * USED + W_CONTROL] & ENABLE)

    def same_slot(self, other: Image, b: int) -> bool:
        """Slot b decides alike in both: disabled in both, or the same words."""
        if not self.enabled(b) and not other.enabled(b):
            return True
        return self.slot(b) == other.slot(b)

    def same(self, other: Image) -> bool:
        return (
            self.valid == other.valid
            and self.depth == other.depth
            and all(self.same_slot(other, b) for b in range(self.depth))
        )

    @property
    def pristine(self) -> bool:
        """Every static entry valid and no slot enabled: the matcher decides as it was built."""
        return bool(valid_of(self.valid, self.n).all()) and not any(self.enabled(b) for b in range(self.depth))

    def as_dict(self) -> dict:
        return {"n": self.n, "valid": list(self.valid), "buf": list(self.buf)}

    @classmethod
    def from_dict(cls, d: dict) -> Image:
        return cls(int(d["n"]), tuple(int(x) for x in d["valid"]), tuple(int(x) for x in d["buf"]))


def image(ov: Overlay) -> Image:
    """The register image of an overlay: its valid mask, its slots in order, the unused ones disabled."""
    buf: list[int] = []
    for b in range(ov.depth):
        buf += slot_words(ov.slots[b] if b < len(ov.slots) else None)
    return Image(ov.n_static, tuple(valid_words(ov.valid)), tuple(buf))


def pristine(n: int, depth: int) -> Image:
    """The image after reset: every static entry valid, every slot disabled."""
    return image(Overlay.empty(n, depth))


def overlay_of(img: Image) -> Overlay:
    """The Overlay an image describes: the slots up to the last enabled one, each
    disabled one in between as a slot that never matches (it keeps the hardware indices of the slots after it).
    ValueError when the enabled slots are not sorted by position or one is beyond n."""
    slots: list[Slot] = []
    last = max((b for b in range(img.depth) if img.enabled(b)), default=-1)
    for b in range(last + 1):
        s = slot_of(img.slot(b))
        slots.append(s if s is not None else Slot(NEVER, slots[-1].pos if slots else 0, -1))
    return Overlay(img.n, img.depth, valid_of(img.valid, img.n), tuple(slots))


def _disable_and_mask(old, new, buf: str, words: int, w_control: int, valid: str):
    """The first writes of `writes` and `writes6`: (the slots that change, [the control word 0 of each of them that
    is or may be enabled, then the runs of the valid mask's words that differ])."""
    out: list[tuple[str, int, list[int]]] = []
    changed = [b for b in range(new.depth) if old is None or not old.same_slot(new, b)]
    for b in changed:
        if old is None or old.enabled(b):
            out.append((buf, b * words + w_control, [0]))
    i = 0
    while i < len(new.valid):
        if old is not None and old.valid[i] == new.valid[i]:
            i += 1
            continue
        j = i
        while j < len(new.valid) and (old is None or old.valid[j] != new.valid[j]):
            j += 1
        out.append((valid, i, list(new.valid[i:j])))
        i = j
    return changed, out


def writes(old: Image | None, new: Image) -> list[tuple[str, int, list[int]]]:
    """The table writes that take the core from `old` (None: not known) to `new`, in order, as (table, first index,
    words) runs for stream writes: every enabled slot that changes is disabled first (its control word), then the
    VALID words that differ, then each changed slot that `new` uses, its words 0..9 in one run, the control word
    (enable) last; a slot whose sets word (w10, after the control word) is or may have been non-zero gets it written
    before the control word. Slots disabled in `new` keep their stale fields. Frames classified between the first and the last
    write see states that are neither `old` nor `new`: the caller brackets the sequence with CONTROL bit 1."""
    changed, out = _disable_and_mask(old, new, "BUF", WORDS, W_CONTROL, "VALID")
    for b in changed:
        if new.enabled(b):
            words = list(new.slot(b))
            if words[W_SETS] or old is None or old.slot(b)[W_SETS]:
                out.append(("BUF", b * WORDS, words[:W_CONTROL]))
                out.append(("BUF", b * WORDS + W_SETS, [words[W_SETS]]))
                out.append(("BUF", b * WORDS + W_CONTROL, [words[W_CONTROL]]))
            else:
                out.append(("BUF", b * WORDS, words[:W_SETS]))
    return out


def box_tuples(ov: Overlay) -> list[tuple | None]:
    """The slots as analysis.overlay.box_key gives them, None for a slot that never matches (a disabled one)."""
    return [
        None if s.box == NEVER else (s.box.lo, s.box.hi, s.box.flags_mask, s.box.flags_value, s.pos) for s in ov.slots
    ]


# ---- the IPv6 update buffer of a dual-stack core (hw/hf_update_buffer6.vhd; hw/regmap.txt BUF6_CONFIG, tables BUF6
# and VALID6; docs/ipv6.md "## emu"): the slots of analysis.overlay.align6's View, whose boxes hold raw 128-bit
# addresses, at local indices n6 + 1 + b (hardware index V6_BASE + n6 + 1 + b)
WORDS6 = 32  # BUF6 index stride
USED6 = 23  # w0..w15 the addresses, w16..w22 as BUF's w4..w10
W6_FLAGS, W6_CONTROL, W6_SETS = 20, 21, 22
_ADDR6 = 16  # words of the addresses: src lo, src hi, dst lo, dst hi, four 32-bit chunks each, most significant first


def slot_words6(slot: Slot | None) -> list[int]:
    """The USED6 words of an IPv6 slot (its box's src/dst in 128-bit address space), enabled; None: disabled."""
    if slot is None:
        return [0] * USED6
    b = slot.box
    if b.is_empty():
        raise ValueError("an empty box cannot be a slot (it would never match; leave the slot disabled)")
    if not 0 <= slot.pos <= POS_MASK:
        raise ValueError(f"slot position {slot.pos} does not fit the control word")
    w: list[int] = []
    for v in (b.lo[0], b.hi[0], b.lo[1], b.hi[1]):
        if not 0 <= v < 1 << 128:
            raise ValueError(f"IPv6 slot bound {v:#x} is not a 128-bit address")
        w += [(v >> s) & 0xFFFFFFFF for s in (96, 64, 32, 0)]
    rest = [0] * USED  # the other fields as an IPv4 slot's words 4..10 (the addresses left 0)
    for k, (lw, ls, hw, hs) in enumerate(LAYOUT.values()):
        if FIELDS[k] in ("src", "dst"):
            continue
        rest[lw] |= b.lo[k] << ls
        rest[hw] |= b.hi[k] << hs
    rest[W_FLAGS] = b.flags_mask | b.flags_value << 8
    rest[W_SETS] = b.sets_mask | b.sets_value << 8
    rest[W_CONTROL] = ENABLE | slot.pos
    return w + rest[4:USED]


@dataclass(frozen=True)
class Image6(Image):
    """What the VALID6 and BUF6 tables hold: `Image` with USED6 words per slot."""

    @property
    def depth(self) -> int:
        return len(self.buf) // USED6

    def slot(self, b: int) -> tuple[int, ...]:
        return self.buf[b * USED6 : (b + 1) * USED6]

    def enabled(self, b: int) -> bool:
        return bool(self.buf[b * USED6 + W6_CONTROL] & ENABLE)

    @classmethod
    def from_dict(cls, d: dict) -> Image6:
        return cls(int(d["n"]), tuple(int(x) for x in d["valid"]), tuple(int(x) for x in d["buf"]))


def image6(ov: Overlay) -> Image6:
    """The BUF6/VALID6 register image of an IPv6 overlay (align6's): valid mask, slots in order, the rest disabled."""
    buf: list[int] = []
    for b in range(ov.depth):
        buf += slot_words6(ov.slots[b] if b < len(ov.slots) else None)
    return Image6(ov.n_static, tuple(valid_words(ov.valid)), tuple(buf))


def pristine6(n6: int, depth6: int) -> Image6:
    """The IPv6 buffer's image after reset: every static IPv6 entry valid, every slot disabled."""
    return image6(Overlay.empty(n6, depth6))


def writes6(old: Image6 | None, new: Image6) -> list[tuple[str, int, list[int]]]:
    """`writes` for the IPv6 buffer (tables BUF6 and VALID6, USED6 words a slot, the control word w21 last)."""
    changed, out = _disable_and_mask(old, new, "BUF6", WORDS6, W6_CONTROL, "VALID6")
    for b in changed:
        if new.enabled(b):
            words = list(new.slot(b))
            out.append(("BUF6", b * WORDS6, words[:W6_CONTROL]))
            out.append(("BUF6", b * WORDS6 + W6_SETS, [words[W6_SETS]]))
            out.append(("BUF6", b * WORDS6 + W6_CONTROL, [words[W6_CONTROL]]))
    return out
