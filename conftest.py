"""Test-wide helpers: where ../shared is, and the rule that nothing is skipped for lack of tools in CI."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent
SHARED = ROOT.parent / "shared"
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


def need(condition: bool, why: str) -> None:
    """Skip when `condition` is false, except in CI (CI=true), where the missing piece is a failure."""
    if condition:
        return
    if IN_CI:
        pytest.fail(f"CI must provide this, never skip: {why}")
    pytest.skip(why)  # reached only outside CI: with CI=true the pytest.fail above ends the test


def need_tool(*names: str) -> None:
    for n in names:
        need(shutil.which(n) is not None, f"tool '{n}' not installed (make test installs it)")


def need_root() -> None:
    need(os.geteuid() == 0, "needs root (network namespaces, netfilter)")


@pytest.fixture
def shared_dir() -> Path:
    need(SHARED.is_dir(), f"{SHARED} is absent (fresh clone without shared/): this test reads it")
    return SHARED
