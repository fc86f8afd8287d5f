"""The deployment's services (ops/services.py) on the generic runner (ops/daemon.py): the records, log lines,
warnings, drift and status that deploy, undeploy and status get for a list of services, and the flow sync
service's answers per target. Nothing is started: a fake service answers, and a state directory without pid files
has nothing running."""

from __future__ import annotations

from pathlib import Path

from hypafilter.errors import HypafilterError
from hypafilter.ops import services
from hypafilter.ops.daemon import Service
from hypafilter.ops.flowsync.service import SERVICE as FLOWSYNC
from hypafilter.targets.base import Target
from hypafilter.targets.xdp.target import XdpTarget


class Fake(Service):
    """A service whose answers are given: `why` (why not), a launch that returns 42 or raises `fail`."""

    why = ""
    fail: Exception | None = None
    stop_error: Exception | None = None

    def why_not(self, policy, plan, tgt, nic):
        return self.why

    def record(self, tgt):
        return {"mode": "m"}

    def launch(self, ns, state_dir, tgt):
        if self.fail:
            raise self.fail
        return 42

    def down(self, tgt):
        return "nothing follows"

    def stop(self, state_dir, timeout=10.0):
        if self.stop_error:
            raise self.stop_error
        return False


def start(svc, tmp_path: Path):
    warnings, lines = [], []
    out = services.start_wanted("ns", tmp_path, None, None, None, {}, warnings, lines.append, services=[svc])
    return out[svc.name], warnings, lines


def test_records_log_and_warnings_of_a_started_service(tmp_path):
    svc = Fake("fake", "fake service")
    assert start(svc, tmp_path) == (
        {"wanted": True, "mode": "m", "pid": 42, "reason": ""},
        [],
        ["fake service running (pid 42, mode m)"],
    )
    svc.why = "not today"
    assert start(svc, tmp_path) == ({"wanted": False, "mode": "m", "reason": "not today"}, [], [])
    svc.why, svc.fail = "", HypafilterError("boom")
    assert start(svc, tmp_path) == (
        {"wanted": True, "mode": "m", "pid": None, "reason": "failed to start: boom"},
        ["starting the fake service: boom"],
        [],
    )


def test_stop_all_reports_each_service_it_could_not_stop(tmp_path):
    ok, bad = Fake("ok", "ok service"), Fake("bad", "bad service")
    bad.stop_error = OSError("gone")
    assert [(s.name, str(e)) for s, e in services.stop_all(tmp_path, [ok, bad])] == [("bad", "gone")]


def test_flowsync_drift_is_worded_by_the_target(tmp_path):
    st = {"flowsync": {"wanted": True, "mode": "liberal"}}
    assert services.drift(st, tmp_path, XdpTarget) == [
        "flowsync: the flow sync service is not running (no new TCP entry is marked liberal)"
    ]
    assert services.drift({"flowsync": {"wanted": True}}, tmp_path, Target) == [
        "flowsync: the flow sync service is not running (the NIC's flow cache does not follow conntrack)"
    ]
    assert services.drift({"flowsync": {"wanted": False, "reason": "x"}}, tmp_path, Target) == []
    assert services.drift({}, tmp_path, Target) == []


def test_status_of_each_service_by_name(tmp_path):
    FLOWSYNC.write_status_file(tmp_path, {"running": True, "pid": 1, "inserts": 3})
    got = services.status({"flowsync": {"wanted": True, "reason": ""}}, tmp_path)
    assert got["flowsync"] == {
        "running": False,
        "down": "is not running",
        "pid": 1,
        "inserts": 3,
        "wanted": True,
        "reason": "",
    }
    assert got["policysync"] == {"running": False, "down": "is not running"}  # no status file, nothing wanted
    assert services.status({}, tmp_path)["flowsync"]["running"] is False


def test_policysync_reports_a_change_it_cannot_follow(tmp_path):
    from hypafilter.ops.policysync.service import SERVICE as POLICYSYNC

    POLICYSYNC.write_status_file(tmp_path, {"running": True, "pid": 1, "error": "change: bad rule"})
    assert POLICYSYNC.problems(tmp_path) == [
        "policysync: cannot follow the live ruleset (change: bad rule); the fast path shunts everything"
    ]
    POLICYSYNC.write_status_file(tmp_path, {"running": True, "pid": 1, "error": ""})
    assert POLICYSYNC.problems(tmp_path) == []


def test_flowsync_asks_the_policy_then_the_target():
    class Plan:
        decides_established = False

    class Tgt:
        flowsync_mode = "liberal"

        def flowsync_why_not(self, plan, nic):
            return "the target says no"

    assert FLOWSYNC.why_not(None, Plan(), Tgt(), {}) == "the policy's hardware entries do not read conntrack state"
    Plan.decides_established = True
    assert FLOWSYNC.why_not(None, Plan(), Tgt(), {}) == "the target says no"
    assert FLOWSYNC.record(Tgt()) == {"mode": "liberal"}


def test_a_service_whose_worker_restarts_is_drift_until_the_new_one_serves(tmp_path, monkeypatch):
    """The supervisor runs (its pid alive) but no worker serves: after an abnormal end (the supervisor's status file
    says restarting), right after a kill -9 of the worker (the file still names the dead worker), and before the
    first worker has finished its start (no worker named). Each is drift, and status says it does not run; a live
    worker named by the supervisor's own status file is not."""
    import os
    import subprocess

    me = os.getpid()
    monkeypatch.setattr(FLOWSYNC, "running_pid", lambda state_dir: me)
    monkeypatch.setattr(FLOWSYNC, "alive", lambda pid: pid == me)
    st = {"flowsync": {"wanted": True, "mode": "flowcache", "pid": me, "reason": ""}}
    down = "(the NIC's flow cache does not follow conntrack)"

    FLOWSYNC.write_status_file(tmp_path, {"running": False, "restarting": True, "pid": me, "last_exit": -9})
    assert services.drift(st, tmp_path, Target) == [
        f"flowsync: the flow sync service is restarting its worker (the last one exited -9) {down}"
    ]
    assert services.status(st, tmp_path)["flowsync"]["running"] is False

    gone = subprocess.Popen(["true"])
    gone.wait()
    FLOWSYNC.write_status_file(tmp_path, {"running": True, "pid": me, "worker": gone.pid})
    assert services.drift(st, tmp_path, Target) == [
        f"flowsync: the flow sync service is restarting its worker (worker {gone.pid} is gone) {down}"
    ]
    FLOWSYNC.state_path(tmp_path).unlink()
    assert services.drift(st, tmp_path, Target) == [
        f"flowsync: the flow sync service is starting (its worker has not finished its start) {down}"
    ]
    FLOWSYNC.write_status_file(tmp_path, {"running": True, "pid": me, "worker": me, "offloaded": 3})
    assert services.drift(st, tmp_path, Target) == []
    got = services.status(st, tmp_path)["flowsync"]
    assert got["running"] is True and got["down"] == "" and got["mode"] == "flowcache"  # mode from the record


def test_a_wanted_service_that_did_not_start_makes_the_deployment_degraded(tmp_path, monkeypatch):
    svc = Fake("fake", "fake service")
    svc.fail = HypafilterError("did not get ready within 20 s")
    rec, _, _ = start(svc, tmp_path)
    assert services.failed({"fake": rec, "other": {"wanted": False, "reason": "x"}}) == [
        "fake: failed to start: did not get ready within 20 s"
    ]
    svc.fail = None
    assert services.failed({"fake": start(svc, tmp_path)[0]}) == []
    monkeypatch.setenv("HF_FAIL_STEP", "service-fake")  # the tests' failure injection
    rec, warnings, _ = start(svc, tmp_path)
    assert rec["pid"] is None and "injected failure" in warnings[0]
