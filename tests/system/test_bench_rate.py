"""`hypafilter bench rate` at small scale: the JSON it promises, and the same verdict for every frame on every path.

Speed is measured, not asserted: the figures depend on the machine and its load (docs/emulator.md)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
from hypafilter import netns

from conftest import ROOT, need_root, need_tool

LAB = "t-rate"
STATE = f"/run/hypafilter/test-{LAB}"
# The JSON fields issue #13 names, written out here on their own (not read from the code under test).
FIELDS = tuple(
    "target frames hybrid_pps iptables_pps nft_pps speedup_vs_iptables speedup_vs_nft hw_share mismatches".split()
)


@pytest.mark.system
def test_bench_rate_json(shared_dir, tmp_path):
    need_root()
    need_tool("ip", "iptables-restore", "nft", "clang", "ghdl", "verilator", "ethtool")
    env = dict(os.environ, HF_LAB=LAB, HF_STATE_DIR=STATE)
    hf = [sys.executable, "-m", "hypafilter"]
    filters = tmp_path / "acl1_60.filters"
    src = shared_dir / "data" / "classbench" / "acl1_1100.filters"
    filters.write_text("".join(src.read_text().splitlines(keepends=True)[:60]))
    shutil.rmtree(STATE, ignore_errors=True)
    try:
        # Simple rules only: nft can say all of it, and the hardware decides every frame.
        p = subprocess.run(
            hf
            + ["bench", "rate", "--target", "emu", "--classbench", str(filters), "--policy", "DROP"]
            + ["--actions", "alternate", "--frames", "2000"],
            capture_output=True,
            text=True,
            env=env,
        )
        assert p.returncode == 0, p.stderr[-3000:]
        r = json.loads(p.stdout)
        assert tuple(r) == FIELDS
        assert r["target"] == "emu" and r["frames"] == 2000 and r["mismatches"] == 0
        for k in ("hybrid_pps", "iptables_pps", "nft_pps", "speedup_vs_iptables", "speedup_vs_nft"):
            assert isinstance(r[k], float) and r[k] > 0, k
        assert r["hw_share"] == 1.0
        assert "command: hypafilter bench rate" in p.stderr

        # Complex rules (string matches): frames are shunted to netfilter; nft cannot load the policy from text,
        # so its figures are null and the reason is in the full report.
        p = subprocess.run(
            hf + ["bench", "rate", str(ROOT / "rulesets" / "example.rules"), "--frames", "1500", "--json"],
            capture_output=True,
            text=True,
            env=env,
        )
        assert p.returncode == 0, p.stderr[-3000:]
        r = json.loads(p.stdout)
        assert set(FIELDS) <= set(r)
        assert r["mismatches"] == 0 and r["mismatches_vs_iptables"] == 0
        assert 0.0 < r["hw_share"] < 1.0
        assert r["nft_pps"] is None and r["speedup_vs_nft"] is None and "nftables" in r["nft_error"]
        assert r["nic"]["PKTIN"] == 1500
        assert 0 < r["delivered"]["hybrid"] == r["delivered"]["iptables"] < 1500
        # The plain namespace holds the oracle again, and no nft table of the bench is left behind.
        assert "hfrate" not in netns.run(["nft", "list", "tables"], f"{LAB}-plain")
    finally:
        subprocess.run(hf + ["undeploy", "-q"], env=env, capture_output=True)
        subprocess.run(hf + ["lab", "down", "--name", LAB], env=env, capture_output=True)
        shutil.rmtree(STATE, ignore_errors=True)
    assert not netns.exists(f"{LAB}-fw")
