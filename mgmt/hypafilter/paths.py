"""Where the repository's non-Python parts live (hw/, driver/, scripts/, constraints/, build/), found once; and the
lock that builds into build/ take."""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # mgmt/hypafilter/paths.py -> the repository
HW_DIR = ROOT / "hw"
DRIVER_DIR = ROOT / "driver"
SCRIPTS_DIR = ROOT / "scripts"
CONSTRAINTS_DIR = ROOT / "constraints"
DOCS_DIR = ROOT / "docs"
BUILD_ROOT = Path(os.environ.get("HF_BUILD_ROOT", ROOT / "build"))


@contextlib.contextmanager
def build_lock(path: Path) -> Iterator[None]:
    """`path`'s lock held exclusively, waiting for it: one build of a folder at a time (several deployments, or
    pytest-xdist workers, may start the same build at once)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield
