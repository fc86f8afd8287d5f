"""The new-flows hold on the NIC (docs/flowsync.md "New flows on the NIC"): a file in the deployment's state directory
that the policy sync service writes while the firewall namespace has what can make a frame without a conntrack entry
RELATED or UNTRACKED (ops.policysync.newflows), and under whose lock the flow sync service renews COMPLETE only while it
is absent (ops.flowsync.members)."""

from __future__ import annotations

import contextlib
import fcntl
from pathlib import Path

HOLD_FILE = "newflows.hold"  # in the state directory: present while ct 3 is withheld


@contextlib.contextmanager
def hold_lock(state_dir: Path):
    """The hold's lock (exclusive): the flow sync service renews COMPLETE under it after looking at the hold, the
    policy sync service sets the hold and clears COMPLETE under it: no renewal falls between the two."""
    with open(Path(state_dir) / (HOLD_FILE + ".lock"), "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def held(state_dir: Path) -> bool:
    """Whether ct 3 is withheld on the NIC (the hold file exists): the flow sync service does not set COMPLETE."""
    return (Path(state_dir) / HOLD_FILE).exists()
