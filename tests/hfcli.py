"""`hypafilter` on the command line, as an operator runs it, for the system tests that bring up a lab of their own
(its name LAB, its deploy state in STATE: the environment's HF_LAB and HF_STATE_DIR), that lab with the xdp
topology for a test module's `lab` fixture, and the live policy's checks (the policy sync service's status, the
deployment following the live ruleset, `verify --live`)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

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
        stdout's and stderr's tails: `status` says its drift on stdout). `fail`: the deploy step that is to fail
        (deploy's test hook HF_FAIL_STEP)."""
        env = dict(os.environ, HF_LAB=self.lab, HF_STATE_DIR=self.state)
        if fail:
            env["HF_FAIL_STEP"] = fail
        p = subprocess.run(HF + list(args), capture_output=True, text=True, env=env)
        if check:
            assert p.returncode == 0, (
                f"hypafilter {' '.join(args)} exited {p.returncode}: {p.stderr[-3000:]}\nstdout: {p.stdout[-3000:]}"
            )
        return p

    def service(self) -> dict:
        """What `policysync status` prints (the policy sync service's status file and whether it runs; docs/deploy.md,
        "Live policy"), read in this process: a poll costs no interpreter start."""
        from hypafilter.ops import deploy
        from hypafilter.ops.policysync.service import SERVICE

        st = deploy.read_state(Path(self.state) / "state.json") or {}
        return SERVICE.status(Path(self.state), st.get("policysync"))

    def followed(self, timeout: float = 120.0) -> dict:
        """The policy sync service's status once the deployment follows the firewall's live ruleset as it is now:
        the deployed policy is the live ruleset's (as `verify --live` checks it) and the service follows, with the
        fail safe lifted, with every commit the kernel has made so far judged by it (a status file written before
        the service read the last deploy's events says nothing of them). A change that needs a new core takes
        seconds (an emulator build); AssertionError after `timeout`."""
        from hypafilter import netns
        from hypafilter.errors import HypafilterError
        from hypafilter.ops import deploy
        from hypafilter.ops.policysync import live
        from hypafilter.ops.policysync.nftevents import NfTables
        from hypafilter.ops.policysync.service import SERVICE

        deadline = time.monotonic() + timeout
        doc, why = {}, "no deployment"
        while time.monotonic() < deadline:
            st = deploy.read_state(Path(self.state) / "state.json")
            if st:
                cfg = deploy.deployed_config(st)
                ns = st["site"].get("netns")
                nft = NfTables(ns)
                try:
                    now = nft.generation()
                finally:
                    nft.close()
                text = netns.run(["iptables-save", "-t", cfg.table], ns)
                doc = SERVICE.status(Path(self.state), st.get("policysync"))
                try:
                    live.followed(text, st, cfg)
                    behind = False
                except HypafilterError:
                    behind = True
                if behind:
                    why = "the deployed policy is not the live ruleset"
                elif doc.get("safe") or not doc.get("following"):
                    why = "the service is not following, or fails safe"
                elif (doc.get("seen_generation") or 0) < now:
                    why = f"the service has not judged the commits up to generation {now} yet"
                else:
                    return doc
            time.sleep(0.1)
        raise AssertionError(f"the deployment did not follow the live ruleset within {timeout:g} s ({why}): {doc}")

    def verify_live(self, packets: int = 1500, unfollowed: bool = False) -> dict:
        """`verify --live --packets N --json`, which must give 0 mismatches (the kernel with the live ruleset alone
        as oracle); its report. `unfollowed`: also when the deployment has not followed the live ruleset (the policy
        sync service down)."""
        extra = ["--unfollowed"] if unfollowed else []
        p = self("verify", "--live", *extra, "--packets", str(packets), "--json", check=False)
        assert p.stdout, f"verify --live: {p.stderr[-2000:]}"
        r = json.loads(p.stdout)
        assert r["mismatches"] == 0, r["examples"][:3]
        return r

    @contextlib.contextmanager
    def deployed_lab(self, target: str, policy: str | Path) -> Iterator[str]:
        """The lab brought up afresh for `target` (emu or xdp; whatever was left of it and its state removed first)
        with `policy` deployed on it, for a module fixture to yield `target` from inside the `with`; when the block
        ends the deployment is undeployed, the lab taken down and its state removed (a block that raises skips
        that, as a fixture's own teardown would; the next setup removes what is left)."""
        need_root()
        if target == "xdp":
            need_tool(*XDP_LAB_TOOLS)
        self("lab", "down", "--name", self.lab, check=False)
        shutil.rmtree(self.state, ignore_errors=True)
        self("lab", "up", "--name", self.lab, *(["--target", "xdp"] if target == "xdp" else []))
        self("deploy", str(policy), "--target", target, "-q")
        yield target
        self("undeploy", "-q", check=False)
        self("lab", "down", "--name", self.lab, check=False)
        shutil.rmtree(self.state, ignore_errors=True)

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
