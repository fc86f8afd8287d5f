"""Constants from driver/hypafilter_shared.h, read from the header itself so Python never keeps a copy."""

from __future__ import annotations

import re
from pathlib import Path

from hypafilter.paths import DRIVER_DIR

HEADER = DRIVER_DIR / "hypafilter_shared.h"
_DEFINE = re.compile(r"^#define\s+(HF_\w+)\s+(0x[0-9A-Fa-f]+|\d+|\"[^\"]*\")", re.M)


def _load(path: Path = HEADER) -> dict[str, int | str]:
    values: dict[str, int | str] = {}
    for name, raw in _DEFINE.findall(path.read_text()):
        values[name] = raw.strip('"') if raw.startswith('"') else int(raw, 0)
    return values


C = _load()
globals().update(C)


def pack_meta(index: int, action: int, reason: int, generation: int) -> int:
    """The 64-bit metadata word M (ARCHITECTURE §4)."""
    return (
        (index & C["HF_META_INDEX_MASK"])
        | (action & C["HF_META_ACTION_MASK"]) << C["HF_META_ACTION_SHIFT"]
        | (reason & C["HF_META_REASON_MASK"]) << C["HF_META_REASON_SHIFT"]
        | (generation & C["HF_META_GEN_MASK"]) << C["HF_META_GEN_SHIFT"]
        | C["HF_META_MAGIC"] << C["HF_META_MAGIC_SHIFT"]
    )


def unpack_meta(m: int) -> dict[str, int]:
    return {
        "index": m & C["HF_META_INDEX_MASK"],
        "action": (m >> C["HF_META_ACTION_SHIFT"]) & C["HF_META_ACTION_MASK"],
        "reason": (m >> C["HF_META_REASON_SHIFT"]) & C["HF_META_REASON_MASK"],
        "generation": (m >> C["HF_META_GEN_SHIFT"]) & C["HF_META_GEN_MASK"],
        "magic": (m >> C["HF_META_MAGIC_SHIFT"]) & 0xFFFF,
    }
