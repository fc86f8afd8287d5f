"""`hypafilter optimize` against the kernel: the same frames (trace headers, TCP and ICMP twins, truncated transport
headers, fragments, IP options) through a policy and through its rewrite, each loaded alone in a namespace with
iptables-nft and with iptables-legacy; every verdict and every moved rule's packet count must agree. And the guard
that sends frames without readable ports to the linear copy is needed: without it, iptables-legacy's udp match drops
a truncated header that the original accepted before reaching any port check."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from hypafilter.optimize.emit import optimize
from hypafilter.optimize.tree import Params
from hypafilter.tools.bench import optimize as bench

from conftest import ROOT, need_root, need_tool

pytestmark = [pytest.mark.system]


@pytest.mark.parametrize("backend", ["nft", "legacy"])
def test_a_classbench_firewall_set_gets_the_same_verdicts_and_counts(shared_dir, tmp_path, backend):
    need_root()
    need_tool("gcc", "iptables-restore", "iptables-legacy-restore", "ip")
    # 400 rules of fw1 (wildcard-heavy: the trees cut ports, so the guard and the linear copy are in use)
    filters = tmp_path / "fw1_400.filters"
    filters.write_text("".join((shared_dir / "data/classbench/fw1_1100.filters").read_text().splitlines(True)[:400]))
    cmd = [sys.executable, "-m", "hypafilter", "bench", "optimize", "--classbench", str(filters)]
    cmd += ["--trace", str(shared_dir / "data/classbench/fw1_1100_trace.gz"), "--repeats", "0", "--probes", "3000"]
    cmd += ["--backend", backend, "--json"]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.stdout, r.stderr[-3000:]
    rep = json.loads(r.stdout)
    assert rep["trees"] == 1 and rep["expansion"] <= 4.0
    assert rep["path_mean_out"] < rep["path_mean_in"] / 3
    assert rep["mismatches"] == 0, rep
    assert rep["counter_mismatches"] == [], rep
    assert rep["probes"] > 3000 and r.returncode == 0


def _port_policy() -> str:
    """UDP rules that differ only in their port: the tree cuts ports. The first rule accepts UDP from 10/8 whatever
    its ports (no udp match: a truncated header passes it)."""
    lines = ["*filter", ":FORWARD DROP [0:0]", "-A FORWARD -s 10.0.0.0/8 -p udp -j ACCEPT"]
    for i in range(120):
        lo = 1000 + 20 * i
        lines.append(f"-A FORWARD -p udp -m udp --dport {lo}:{lo + 9} -j {'ACCEPT' if i % 2 else 'DROP'}")
    return "\n".join([*lines, "COMMIT"]) + "\n"


def test_without_the_guard_legacy_drops_a_truncated_header_the_original_accepts():
    need_root()
    need_tool("gcc", "iptables-legacy-restore", "ip")
    text = _port_policy()
    rows = [(0x0A000001 + i, 0xC0A80001, 4000 + i, 1000 + (i * 7) % 2400) for i in range(2000)]
    rows += [(0x0B000001 + i, 0xC0A80001, 4000 + i, 1000 + (i * 7) % 2400) for i in range(2000)]
    guarded = optimize(text, "ports.rules", Params(binth=4), min_segment=8)
    assert "--u32" in guarded.text
    ok = bench.run(text, guarded, rows, repeats=0, probes=3000, seed=3, backend="legacy", log=lambda m: None)
    assert ok["mismatches"] == 0 and ok["counter_mismatches"] == [], ok
    unguarded = optimize(text, "ports.rules", Params(binth=4, guard=False), min_segment=8)
    assert "--u32" not in unguarded.text
    bad = bench.run(text, unguarded, rows, repeats=0, probes=3000, seed=3, backend="legacy", log=lambda m: None)
    assert bad["mismatches"] > 0, bad


def test_fuzzed_policies_keep_their_verdicts_and_counts():
    """The fuzzer's policies (user chains with RETURN and goto, marks, conntrack, strings, observing rules, per-rule
    state) with trees forced small. Seed 27 holds `-p udp -m udp -m iprange ...`: the udp match drops a truncated
    header before the range is read, so the range must not keep such a frame away from the rule. Seed 90 holds
    `! -p icmp`, whose protocol 0 a split must not test (`-p 0` is every protocol)."""
    need_root()
    need_tool("gcc", "iptables-restore", "conntrack", "ip")
    reports = bench.fuzz([27, 90, *range(1, 5)], packets=2500, log=lambda m: None)
    bad = [r for r in reports if r["mismatches"] or r["counter_mismatches"]]
    assert not bad, bad
    assert sum(r["rules_in_trees"] for r in reports) >= 50  # trees were built and walked
