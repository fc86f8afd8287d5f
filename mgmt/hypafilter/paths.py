"""Where the repository's non-Python parts live (hw/, driver/, scripts/, constraints/, build/), found once."""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # mgmt/hypafilter/paths.py -> the repository
HW_DIR = ROOT / "hw"
DRIVER_DIR = ROOT / "driver"
SCRIPTS_DIR = ROOT / "scripts"
CONSTRAINTS_DIR = ROOT / "constraints"
DOCS_DIR = ROOT / "docs"
BUILD_ROOT = Path(os.environ.get("HF_BUILD_ROOT", ROOT / "build"))
