"""Strategy tree against the kernel (docs/optimize.md, "The hybrid's software side").

1. A 1,100-rule ClassBench policy with 64 complex rules (string matches) ahead of it, deployed on the xdp target
   with strategy tree: every shunted frame's interval chain is those 64 rules, walked as a tree (dispatch gotos, the
   port guard, leaves). verify sends trace-like frames, malformed ones and fragments (which the fast path leaves
   unparsed: k = 0, the operator's live rules) through the hybrid and through the policy alone in the plain
   namespace: 0 mismatches.
2. The k = 0 path of the program compile writes (not live: K0 walks the whole policy as a tree) loaded alone with
   FORWARD jumping to MAIN, against the policy alone: the same probes (trace headers, rule corners, truncated
   transport headers, first and later fragments, IP options) through both, with iptables-nft and iptables-legacy
   (`hypafilter bench optimize --k0 tree`'s comparison): 0 mismatches.
"""

from __future__ import annotations

import re

import pytest

from conftest import need_root, need_tool, ns_sh

pytestmark = pytest.mark.system

LAB = "tre"
TARGET = "xdp"
CB = "acl1_1100"


def _policy_text(shared_dir) -> str:
    from hypafilter.tools.classbench import classbench_policy_text

    text = classbench_policy_text(shared_dir / "data/classbench" / f"{CB}.filters", policy="DROP", actions="alternate")
    lines = text.splitlines()
    first = next(i for i, ln in enumerate(lines) if ln.startswith("-A FORWARD"))
    rules = [ln for ln in lines if ln.startswith("-A FORWARD")]
    # 64 complex rules on the headers of every 17th rule (so that frames drawn from the policy reach them)
    cx = [
        f"{r.rsplit(' -j ', 1)[0]} -m string --string BAD{j % 5} --algo bm -j {('DROP', 'ACCEPT')[j % 2]}"
        for j, r in enumerate(rules[::17][:64])
    ]
    return "\n".join(lines[:first] + cx + lines[first:]) + "\n"


def test_a_1100_rule_policy_with_tree_chains_on_xdp_matches_the_kernel(lab, shared_dir):
    from hypafilter.config import Config
    from hypafilter.iptables.document import parse_policy
    from hypafilter.ops.verify import FRAME_KINDS, verify

    policy = parse_policy(_policy_text(shared_dir), filename=f"{CB}+64", base_chain="FORWARD", config=Config())
    assert len(policy.rules) >= 1100
    config = Config(shunt_mode="selective", strategy="tree", target=TARGET)
    report = verify(policy, config, packets=3000, seed=7, malformed=0.3, kinds=FRAME_KINDS)
    listing = ns_sh(lab.ns_fw, "iptables-save", "-c", "-t", "filter")
    gotos = [ln for ln in listing.splitlines() if re.search(r"-A HF\d+_T\d+ .* -g ", ln)]
    assert len(gotos) >= 8, "the interval chain of 64 complex rules is walked as a tree"
    walked = sum(int(ln[1 : ln.index(":")]) for ln in gotos)
    assert walked > 100, "shunted frames went through the tree's dispatch"
    assert "-m u32 ! --u32" in listing  # the port guard: truncated and fragmented frames to the linear copy
    print(f"tree: {report['packets']} frames, {report['mismatches']} mismatches, by kind {report['by_kind']}")
    assert report["mismatches"] == 0, report["examples"][:3]
    unparsed = sum(v["packets"] for k, v in report["by_kind"].items() if k != "valid")
    assert unparsed >= 300 and report["packets"] >= 3000


@pytest.mark.parametrize("backend", ["nft", "legacy"])
def test_the_k0_tree_alone_matches_the_policy_alone(shared_dir, backend):
    need_root()
    need_tool("gcc", "iptables-restore", "iptables-legacy-restore", "ip")
    from hypafilter.tools.bench import optimize as bench
    from hypafilter.tools.classbench import read_trace

    text = _policy_text(shared_dir)
    res, summary = bench.k0_program(text, f"{CB}+64", "tree")
    assert summary["trees"] >= 2 and summary["rules_in_trees"] >= 1100, summary
    rows = bench.trace_rows(read_trace(shared_dir / "data/classbench" / f"{CB}_trace.gz")[:3000])
    rep = bench.run(text, res, rows, repeats=0, probes=2000, backend=backend, log=lambda m: None)
    print(f"k0 tree ({backend}): {rep['probes']} probes, {rep['mismatches']} mismatches")
    assert rep["probes"] > 2000 and rep["mismatches"] == 0, rep


def test_the_k0_tree_of_fuzzer_policies_matches_them():
    """The fuzzer's random policies (user chains with RETURN and goto, MARK read back, conntrack states, strings,
    observing and per-rule-state rules), trees on runs of 2: each policy alone and its K0 tree alone in the kernel,
    the same probes (rule corners, drawn headers, malformed frames, attack shapes). `make fuzz-tree`: 100 policies."""
    need_root()
    need_tool("gcc", "iptables-restore", "ip", "conntrack")
    from hypafilter.tools.bench import optimize as bench

    reps = bench.fuzz((3, 4), packets=2000, min_segment=2, k0="tree", log=print)
    assert all(r["trees"] >= 4 for r in reps), reps
    assert [r["mismatches"] for r in reps] == [0, 0], reps
