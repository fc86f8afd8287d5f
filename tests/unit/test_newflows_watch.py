"""The new-flow permission's follower (ops.policysync.newflows.NewFlows) as a state machine: withdrawn at once,
restored only by a check that began after the last cause, never written while the deployment's lock is held. The
namespace's sources and the permission are stand-ins here; tests/system/test_newflows_follow.py runs the real ones."""

from __future__ import annotations

import fcntl
import threading
import time

from hypafilter.ops.policysync.newflows import NewFlows


class Perm:
    """A permission with the xdp program's count: `started`/`finished` the watcher's, `granted` hfx_ctsync's."""

    def __init__(self):
        self.bit = True
        self.writes = []
        self.started_n = self.finished = self.granted = 0

    def allowed(self) -> bool:
        return True

    def on(self) -> bool:
        return self.bit

    def settled(self):
        return self.started_n if self.started_n == self.finished else None

    def started(self):
        return self.started_n

    def current(self) -> bool:
        return self.granted == self.started_n

    def set(self, on: bool, seq=None) -> None:
        if on:
            self.granted = seq
        self.bit = on
        self.writes.append(on)

    def change(self, running: bool = False) -> None:
        """A change counted as it enters the kernel (and returned, unless `running`)."""
        self.started_n += 1
        self.finished += not running


class Quiet:
    def read(self):
        return None

    def read_events(self):
        return []

    def close(self):
        pass


class Check:
    """The check's answers in order, each given only once `go` is set (so a test decides when a check ends)."""

    def __init__(self, *answers: str):
        self.answers = list(answers)
        self.go = threading.Event()
        self.go.set()
        self.calls = 0

    def __call__(self, ns) -> str:
        self.calls += 1
        self.go.wait(5)
        return self.answers.pop(0)


def watch(tmp_path, check: Check, perm: Perm) -> NewFlows:
    q = Quiet()
    return NewFlows("x", tmp_path, lambda m: None, lambda: False, check=check, sources=(q, q, q), permission=perm)


def settle(w: NewFlows) -> None:
    for _ in range(500):
        w.step({})
        if not w.pending():
            return
        time.sleep(0.002)
    raise AssertionError("the watch did not settle")


def test_withdrawn_at_once_and_restored_by_a_passing_check(tmp_path):
    perm, check = Perm(), Check("", "", "a helper")
    w = watch(tmp_path, check, perm)
    settle(w)  # the first check passes: the bit stays
    assert perm.bit and perm.writes == []
    w.withdraw(time.monotonic(), {})
    assert perm.writes == [False], "not withdrawn before the check"
    assert w.counts["withdrawals"] == 1 and len(w.lag_withdraw) == 1
    settle(w)
    assert perm.writes == [False, True] and w.counts["restores"] == 1
    w.withdraw(time.monotonic(), {})
    settle(w)  # the check finds a helper: it stays withdrawn
    assert perm.writes == [False, True, False] and not perm.bit and w.why == "a helper"


def test_a_check_begun_before_the_cause_restores_nothing(tmp_path):
    perm, check = Perm(), Check("", "")
    w = watch(tmp_path, check, perm)
    check.go.clear()
    w.step({})  # check 1 runs (it read the namespace before the cause)
    assert w.checking is not None
    w.withdraw(time.monotonic(), {})
    assert perm.writes == [False]
    check.go.set()
    while w.checking.is_alive():
        time.sleep(0.001)
    w.step({})  # check 1's "" collected: check 2 starts, nothing restored meanwhile
    assert perm.writes == [False]
    settle(w)
    assert check.calls == 2 and perm.writes == [False, True]


def test_nothing_written_while_the_deployments_lock_is_held(tmp_path):
    perm, check = Perm(), Check("", "")
    w = watch(tmp_path, check, perm)
    settle(w)
    with open(tmp_path / "deploy.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # a deploy (another open file: as another process's)
        w.withdraw(time.monotonic(), {})
        assert perm.writes == [] and w.want_off
    w.step({})
    assert perm.writes == [False], "the deferred withdrawal"
    settle(w)
    assert perm.writes == [False, True]


def test_a_counted_change_is_granted_again_at_the_count_read_before_the_check(tmp_path):
    """The watcher counted a change (the program already reads no miss as ct 3): the poll asks for the check, which
    grants at the count read before it began; a change counted during the check, or still running when it began,
    makes that answer stale: no grant until a check begun after it."""
    perm, check = Perm(), Check("", "", "", "", "")
    w = watch(tmp_path, check, perm)
    settle(w)
    assert perm.writes == [] and perm.current()
    perm.change()
    assert not perm.current()
    w.poll(time.monotonic() + 1, {})
    settle(w)
    assert perm.granted == 1 and perm.current() and w.counts["regrants"] == 1 and w.counts["restores"] == 0
    perm.change()
    w.poll(time.monotonic() + 2, {})
    check.go.clear()
    w.step({})  # the check begins at count 2
    perm.change()  # ... and a change comes meanwhile
    check.go.set()
    while w.checking.is_alive():
        time.sleep(0.001)
    w.step({})
    assert perm.granted == 1, "granted at a count another change followed"
    perm.change(running=True)  # a change entered the kernel and has not returned: nothing read now is its result
    w.poll(time.monotonic() + 3, {})
    settle(w)
    assert perm.granted == 1 and not perm.current()
    perm.finished += 1
    w.poll(time.monotonic() + 4, {})
    settle(w)
    assert perm.granted == 4 and perm.current()
