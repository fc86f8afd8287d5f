"""The update buffer's records in the state directory: `static.json` (the running matcher's entries, their boxes in
order, and its buffer depth: written when a new core or program starts) and the state's `overlay` (what the buffer
and the valid mask hold now), read by every update that tries the buffer first (analysis.overlay.align)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from hypafilter.analysis.overlay import Overlay, Slot
from hypafilter.hw import vhdl
from hypafilter.ir import Box


class StaticEntry:
    """A static entry of the running matcher as the state directory keeps it: its boxes (what `align` compares)."""

    __slots__ = ("boxes",)

    def __init__(self, boxes):
        self.boxes = tuple(boxes)


def _box_json(b) -> list:
    out = [list(b.lo), list(b.hi), b.flags_mask, b.flags_value]
    return out + [b.sets_mask, b.sets_value] if b.sets_mask else out


def _box_of(j) -> Box:
    return Box(tuple(j[0]), tuple(j[1]), j[2], j[3], *(j[4:6] if len(j) > 4 else ()))


def static_path(state_dir: Path) -> Path:
    return Path(state_dir) / "static.json"


def sets_key(plan) -> list:
    """The set tables a matcher is built with (each slot's type, directions and geometry, in slot order: what the
    core's hash takes of them); [] for a plan without set slots."""
    return vhdl.set_generics(plan) if vhdl.set_slots(plan) else []


def write_static(state_dir: Path, plan, depth: int, binary: str, write=None) -> None:
    """The running matcher's entries (their boxes, in order), its update buffer's depth and its set tables: written
    when a new core (program) starts, read by every update that tries the buffer first."""
    doc = {
        "binary": binary,
        "depth": depth,
        "entries": [[_box_json(b) for b in e.boxes] for e in plan.entries],
        "sets": sets_key(plan),
    }
    text = json.dumps(doc) + "\n"
    if write is not None:  # the state directory's private writer (ops.deploy)
        write(static_path(state_dir), text)
    else:
        static_path(state_dir).write_text(text)


def read_static(state_dir: Path, binary: str, plan=None) -> tuple[list[StaticEntry], int] | None:
    """(entries, depth) of the running matcher `binary`, None when unknown or of another matcher. With `plan`: None
    too when the matcher's set tables are not the plan's (a rule of a set the matcher has no table for, in a buffer
    slot, would match without its set: a new core must be built; a record from before the sets were kept counts as
    different)."""
    try:
        doc = json.loads(static_path(state_dir).read_text())
    except (OSError, ValueError):
        return None
    if doc.get("binary") != binary:
        return None
    if plan is not None and doc.get("sets") != sets_key(plan):
        return None
    return [StaticEntry(_box_of(b) for b in e) for e in doc["entries"]], int(doc.get("depth", 0))


def overlay_json(ov: Overlay) -> dict:
    return {
        "n_static": ov.n_static,
        "depth": ov.depth,
        "invalid": [int(i) for i in np.flatnonzero(~ov.valid)],
        "slots": [[_box_json(sl.box), sl.pos, sl.master] for sl in ov.slots],
    }


def overlay_of(doc: dict) -> Overlay:
    valid = np.ones(doc["n_static"], dtype=bool)
    valid[doc["invalid"]] = False
    return Overlay(doc["n_static"], doc["depth"], valid, tuple(Slot(_box_of(b), p, m) for b, p, m in doc["slots"]))
