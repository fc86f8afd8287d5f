"""Test-wide helpers: where ../shared is, the rule that nothing is skipped for lack of tools in CI, and the
system tier's deployed lab."""

from __future__ import annotations

import os
import shutil
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


@pytest.fixture(scope="module")
def lab(request):
    """System tier: a lab of the test module's own (its LAB constant; its TARGET, emu unless the module says xdp)
    with deploy pointed at it; state in /run/hypafilter/test-<LAB>; undeployed and torn down after the module, and
    deploy pointed back where it was. Modules with a `lab` of their own (a bare lab, no deploy) define it and so
    override this one."""
    need_root()
    target = getattr(request.module, "TARGET", "emu")
    if target == "xdp":
        need_tool("ip", "iptables-restore", "clang", "cc", "make", "tc", "ethtool", "nft")
    else:
        need_tool("ip", "iptables-restore", "clang", "ghdl", "verilator", "ethtool")
    from hypafilter.ops import deploy
    from hypafilter.ops.lab import Lab

    name = request.module.LAB
    state = f"/run/hypafilter/test-{name}"
    was = (deploy.LAB_NAME, deploy.STATE_DIR)
    deploy.configure(lab=name, state_dir=state)
    shutil.rmtree(state, ignore_errors=True)
    lab = Lab(name, target=target)
    lab.down()
    lab.up()
    yield lab
    try:
        deploy.undeploy()
    finally:
        lab.down()
        shutil.rmtree(state, ignore_errors=True)
        deploy.configure(*was)
