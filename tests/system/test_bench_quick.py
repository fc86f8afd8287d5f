"""`hypafilter bench paper --quick` end to end: real netfilter in namespaces, every figure's CSV, PNG and the page."""

from __future__ import annotations

import csv
import subprocess
import sys
import time

import pytest

from conftest import ROOT, TEST_FULL, need_root, need_tool

pytestmark = [pytest.mark.system, pytest.mark.shared, pytest.mark.slow, TEST_FULL]  # make test-full


def _rows(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_quick_run_end_to_end(shared_dir, tmp_path):
    need_root()
    need_tool("gcc", "iptables-restore", "nft", "ip")
    out = tmp_path / "out"
    md = out / "results.md"  # a --quick/--out run writes its page beside its output, never over docs/results.md
    committed = (ROOT / "docs" / "results.md").read_bytes()
    t0 = time.monotonic()
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "hypafilter",
            "bench",
            "paper",
            "--quick",
            "--shared",
            str(shared_dir),
            "--out",
            str(out),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    wall = time.monotonic() - t0
    assert r.returncode == 0, r.stderr[-3000:] + r.stdout[-3000:]
    assert wall < 300
    assert (ROOT / "docs" / "results.md").read_bytes() == committed
    for stem in (
        "fig11_shunting_rules",
        "fig12_shunted_packets",
        "fig13_traversed_rules",
        "fig14_packet_rate",
        "fig15_update_delay",
        "scaling_analysis_time",
    ):
        assert _rows(out / f"{stem}.csv"), stem
    for png in ("fig11", "fig12", "fig13", "fig14", "fig15", "scaling"):
        assert (out / f"{png}.png").read_bytes()[:4] == b"\x89PNG"
    # Fig. 14: real measurements happened; selective shunting never shunts more than index-based shunting.
    f14 = _rows(out / "fig14_packet_rate.csv")
    for row in f14:
        assert float(row["sw_only_pps"]) > 0
        assert float(row["bridge_only_pps"]) > float(row["sw_only_pps"]) * 0.5
    by = {(r["K"], r["mode"]): float(r["shunted_fraction"]) for r in f14}
    for (k, mode), frac in by.items():
        if mode == "selective" and (k, "index") in by:
            assert frac <= by[(k, "index")]
    ok = [r for r in f14 if r["speedup"]]
    assert ok and all(float(r["speedup"]) > 1 for r in ok)
    # Fig. 15: every insertion was loaded into the namespace and timed.
    f15 = [r for r in _rows(out / "fig15_update_delay.csv") if not r["error"]]
    assert f15 and all(float(r["load_s"]) > 0 and float(r["total_s"]) >= float(r["load_s"]) for r in f15)
    # An insertion of a complex rule is a register update with index/selective shunting (a handful of changed
    # words on the real emulated core), a new core in exact mode (the rule's reduction joins the matcher).
    assert {r["register_target"] for r in f15} == {"emu"}
    for r in f15:
        if r["mode"] == "exact":
            assert r["hardware"] == "new core" and r["register_writes"] == "", r
        else:
            # (each changed SHUNT word has a SHUNT_NONE twin on a core with the conntrack membership structure)
            assert r["hardware"] == "registers" and 1 <= int(r["register_writes"]) <= 20, r
            assert float(r["registers_s"]) > 0
    text = md.read_text()
    for head in ("## Fig. 11", "## Fig. 14", "## Fig. 15", "## §VIII-I", "**Model**", "Wall time:"):
        assert head in text
