"""Test-wide helpers: where ../shared is, the rule that nothing is skipped for lack of tools in CI, and the
system tier's deployed lab."""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import tempfile
from pathlib import Path

import pytest
from hypafilter import netns

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


def ns_sh(ns: str, *cmd: str, stdin: str | None = None) -> str:
    """Run a command in network namespace `ns`; its stdout, or a netns.CommandError quoting stderr."""
    return netns.run(cmd, ns, input=stdin)


@contextlib.contextmanager
def deployed_lab(name: str, target: str = "emu"):
    """A lab `name` for `target` with deploy pointed at it; state in /run/hypafilter/test-<name>; undeployed and torn
    down after, and deploy pointed back where it was."""
    need_root()
    if target == "xdp":
        need_tool("ip", "iptables-restore", "clang", "cc", "make", "tc", "ethtool", "nft")
    else:
        need_tool("ip", "iptables-restore", "clang", "ghdl", "verilator", "ethtool")
    from hypafilter.ops import deploy
    from hypafilter.ops.lab import Lab

    state = f"/run/hypafilter/test-{name}"
    was = (deploy.LAB_NAME, deploy.STATE_DIR)
    deploy.configure(lab=name, state_dir=state)
    shutil.rmtree(state, ignore_errors=True)
    lab = Lab(name, target=target)
    lab.down()
    lab.up()
    try:
        yield lab
    finally:
        try:
            deploy.undeploy()
        finally:
            lab.down()
            shutil.rmtree(state, ignore_errors=True)
            deploy.configure(*was)


@pytest.fixture(scope="module")
def lab(request):
    """System tier: a lab of the test module's own (its LAB constant; its TARGET, emu unless the module says xdp)
    with deploy pointed at it (deployed_lab). Modules with a `lab` of their own (a bare lab, no deploy) define it and
    so override this one."""
    with deployed_lab(request.module.LAB, getattr(request.module, "TARGET", "emu")) as lab:
        yield lab


# Modules of the sim and system tiers that take longest, with their seconds in one run (`make test` with
# PYTEST_ADDOPTS=--durations=0, setup + call + teardown summed per module; docs/testing.md). Under pytest-xdist
# (`make test`: sim on two workers, system on three) the longest start first, so no worker is left with a long module at
# the end while the others idle. Modules not listed keep their collection order after these.
LONG_MODULES = {
    # the fresh-clone `make test` at 145debf (session 18: sim on two workers, system on three), setup + call + teardown
    # summed per module over the tests `make test` runs now (the cuts after that run left out)
    "test_fuzz.py": 191,
    "test_real_rulesets.py": 126,
    "test_hypafilter_core.py": 108,
    "test_xdp_lab.py": 94,
    "test_deploy.py": 91,
    "test_ipv6_flowcache_emu.py": 76,
    "test_policysync_lease.py": 68,
    "test_ct_timewait.py": 68,
    "test_flowsync.py": 64,
    "test_livepolicy.py": 63,
    "test_exactness.py": 63,
    "test_emu_sets.py": 63,
    "test_verify_connections.py": 56,
    "test_ipv6_deploy.py": 56,
    "test_tree_strategy.py": 54,
    "test_equivalence.py": 53,
    "test_xdp_newflows.py": 52,
    "test_live_tools.py": 50,
    "test_lazy_rebuild.py": 48,
    "test_hf_set_table.py": 47,
    "test_xdp_ct_timewait.py": 43,
    "test_xdp_overlay.py": 41,
    "test_xdp_liberal.py": 40,
    "test_xdp.py": 39,
    "test_exact_state.py": 39,
    "test_verify_limits.py": 37,
    "test_synth_tools.py": 36,
    "test_core_ct_member.py": 36,
    "test_xdp_flowsync_scale.py": 33,
    "test_ipset_xdp.py": 33,
    "test_hf_ct_member.py": 33,
    "test_bench_rate_xdp.py": 31,
    "test_xdp_v6_lab.py": 29,
    "test_real_rulesets6.py": 29,
    "test_optimize.py": 27,
    "test_hf_prio_enc.py": 27,
    "test_hf_flow_cache.py": 27,
    "test_core_flow_cache.py": 27,
    "test_failclosed.py": 26,
    "test_update_buffer.py": 25,
    "test_ctstate.py": 24,
    "test_ct_invalid.py": 24,
    "test_mirror.py": 23,
    "test_hf_header_parser.py": 23,
    "test_emu.py": 23,
    "test_core_ipv6.py": 22,
    "test_netfilter_load.py": 21,
    "test_livepolicy6.py": 20,
    "test_dashboard.py": 20,
}


# `make test-full` (HF_TEST_FULL=1): tests and parameters that `make test` leaves out to stay within its 20 minutes on
# a 2-core machine: larger variants (more seeds, wider buses, larger sets), post-synthesis simulations of the whole
# core, scale runs and second targets of a behaviour `make test` checks elsewhere (docs/testing.md "make test and
# make test-full"). Deselected, not skipped.
TEST_FULL = pytest.mark.optin("HF_TEST_FULL")
FULL_RUN = os.environ.get("HF_TEST_FULL", "") not in ("", "0")  # for scales that differ between the two


def full_beyond(values, keep: int = 1) -> list:
    """Parameters for @pytest.mark.parametrize: the first `keep` in `make test`, the others in `make test-full` only."""
    return [
        v if i < keep else pytest.param(*(v if isinstance(v, tuple) else (v,)), marks=TEST_FULL)
        for i, v in enumerate(values)
    ]


def _wanted(item) -> bool:
    """A test marked `optin("VAR")` runs only where VAR is set (its make target sets it), else it is deselected."""
    return all(os.environ.get(m.args[0], "") not in ("", "0") for m in item.iter_markers("optin"))


def pytest_collection_modifyitems(config, items):
    """Opt-in tests deselected, not skipped, unless their variable is set (a default run, CI's included, reports no
    skip it did not mean); then the longest modules first (LONG_MODULES), the order inside each module unchanged (a
    stable sort)."""
    off = [item for item in items if not _wanted(item)]
    if off:
        config.hook.pytest_deselected(items=off)
        items[:] = [item for item in items if _wanted(item)]
    items.sort(key=lambda item: -LONG_MODULES.get(item.path.name, 0))


@contextlib.contextmanager
def _worker_lock(item):
    """Under pytest-xdist, a test marked `solo` runs while no other worker runs a test; every other test holds the
    lock shared. Held over the item's whole protocol, so module fixtures (a lab coming up, an emulator build) that
    its setup or teardown runs count too. For tests whose thresholds read time or CPU share (hardware share of real
    connections, dashboard budgets): they keep their thresholds and see the machine as a sequential run does.
    A gate taken before the lock lets a waiting solo test in ahead of the next shared one (no starvation)."""
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if not run:
        yield
        return
    base = Path(tempfile.gettempdir()) / f"hypafilter-tests-{run}"
    solo = item.get_closest_marker("solo") is not None
    with open(f"{base}.gate", "a+") as gate, open(f"{base}.lock", "a+") as lock:
        fcntl.flock(gate, fcntl.LOCK_EX if solo else fcntl.LOCK_SH)
        fcntl.flock(lock, fcntl.LOCK_EX if solo else fcntl.LOCK_SH)
        if not solo:
            fcntl.flock(gate, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
            fcntl.flock(gate, fcntl.LOCK_UN)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    with _worker_lock(item):
        yield
