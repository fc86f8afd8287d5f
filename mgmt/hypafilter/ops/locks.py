"""Advisory file locks shared by the deployment and its services."""

from __future__ import annotations

import contextlib
import fcntl
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def flock_now(path: Path) -> Iterator[bool]:
    """`path`'s lock held exclusively if nobody holds it now (yields True), else False at once, without waiting."""
    with open(path, "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        yield True
