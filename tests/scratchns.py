"""A network namespace of a test's own for the system tier: a fresh netfilter, removed again whatever happens."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator

from hypafilter import netns

from conftest import need_root, need_tool


@contextlib.contextmanager
def scratch_netns(prefix: str, *tools: str) -> Iterator[str]:
    """A new namespace named `prefix-<random>` (the prefix says which test made it, should one be left behind);
    the test is skipped, or fails in CI, without root or without `ip` and `tools`."""
    need_root()
    need_tool("ip", *tools)
    name = f"{prefix}-{uuid.uuid4().hex[:8]}"
    netns.add(name)
    try:
        yield name
    finally:
        netns.delete(name)
