"""`hypafilter` on the command line, as an operator runs it, for the system tests that bring up a lab of their own
(its name LAB, its deploy state in STATE: the environment's HF_LAB and HF_STATE_DIR), and that lab with the xdp
topology for a test module's `lab` fixture."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator

from conftest import need_root, need_tool

HF = [sys.executable, "-m", "hypafilter"]
XDP_LAB_TOOLS = ("ip", "iptables-restore", "clang", "cc", "make", "tc", "ethtool", "nft")


class HfCli:
    """`hypafilter` for the lab `lab` with its deploy state in `state`: hf(*args) runs one command."""

    def __init__(self, lab: str, state: str):
        self.lab = lab
        self.state = state

    def __call__(self, *args: str, check: bool = True, fail: str | None = None) -> subprocess.CompletedProcess:
        """`hypafilter ARGS...`, its output captured; with `check` it must exit 0 (else the test fails quoting its
        stderr). `fail`: the deploy step that is to fail (deploy's test hook HF_FAIL_STEP)."""
        env = dict(os.environ, HF_LAB=self.lab, HF_STATE_DIR=self.state)
        if fail:
            env["HF_FAIL_STEP"] = fail
        p = subprocess.run(HF + list(args), capture_output=True, text=True, env=env)
        if check:
            assert p.returncode == 0, f"hypafilter {' '.join(args)}: {p.stderr[-3000:]}"
        return p

    @contextlib.contextmanager
    def xdp_lab(self) -> Iterator[str]:
        """The lab brought up afresh with the xdp topology (`lab up --target xdp`; whatever was left of it and its
        state removed first), for a module fixture to yield from inside the `with`; when the block ends the
        deployment is undeployed, the lab taken down and its state removed. As in a fixture's own teardown, a
        block that raises skips that (the next setup removes what is left). The test is skipped, or fails in CI,
        without root or the lab's tools."""
        need_root()
        need_tool(*XDP_LAB_TOOLS)
        self("lab", "down", "--name", self.lab, check=False)
        shutil.rmtree(self.state, ignore_errors=True)
        self("lab", "up", "--target", "xdp", "--name", self.lab)
        yield self.lab
        self("undeploy", "-q", check=False)
        self("lab", "down", "--name", self.lab, check=False)
        shutil.rmtree(self.state, ignore_errors=True)
