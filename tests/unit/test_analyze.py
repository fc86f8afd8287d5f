"""Unit tests for `hypafilter analyze`: the JSON contract and the vectorised counts against the chain interpreter."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypafilter.analysis.decision import match_indices
from hypafilter.analysis.hybrid import hybrid_verdict
from hypafilter.analysis.plan import build_plan
from hypafilter.analysis.traffic import analyze, strategy_costs
from hypafilter.cli import main
from hypafilter.ir import FIELDS, Header
from hypafilter.tools.classbench import classbench_policy, read_trace, trace_udp_values

from tests.irbuild import listing1

KEYS = [
    "rules",
    "complex",
    "simple",
    "shunt_vector_selective",
    "shunt_vector_index_based",
    "shunting_rules_selective",
    "shunting_rules_index_based",
    "packets",
    "shunted_packets_selective",
    "shunted_packets_index_based",
    "traversed_rules",
    "analysis_seconds",
]


def test_listing1_without_trace():
    res = analyze(listing1(), None)
    assert list(res) == [
        k
        for k in KEYS
        if k not in ("packets", "shunted_packets_selective", "shunted_packets_index_based", "traversed_rules")
    ]
    assert res["shunt_vector_selective"] == "00011" and res["shunt_vector_index_based"] == "00111"
    assert res["shunting_rules_selective"] == 1 and res["shunting_rules_index_based"] == 2


@pytest.mark.shared
def test_costs_equal_the_interpreter_on_classbench(shared_dir):
    f = shared_dir / "data" / "classbench" / "acl2_1100.filters"
    pol = classbench_policy(f, complex_rules=30, deterministic=True)
    pol.rules = pol.rules[:300]
    pol.original_rules = pol.original_rules[:300]
    trace = read_trace(shared_dir / "data" / "classbench" / "acl2_1100_trace.gz")[:400]
    vals = trace_udp_values(trace)
    plan = build_plan(pol, mode="index")
    costs = strategy_costs(plan)
    mi = match_indices(plan, vals)
    for p in range(0, len(vals), 7):
        h = Header(**dict(zip(FIELDS, (int(x) for x in vals[p]), strict=True)))
        for s in ("full", "cut", "interval", "interval_geo"):
            v, shunted, count = hybrid_verdict(plan, s, h)
            if shunted:
                assert count == costs[s][mi[p]], (s, p)
    sel = build_plan(pol, mode="selective")
    hsa = strategy_costs(sel)["hsa_cut"]
    for p in range(0, len(vals), 7):
        h = Header(**dict(zip(FIELDS, (int(x) for x in vals[p]), strict=True)))
        _, shunted, count = hybrid_verdict(sel, "hsa_cut", h)
        if shunted:
            assert count == hsa[mi[p]]


@pytest.mark.shared
def test_cli_json_shape_and_consistency(shared_dir, capsys):
    f = shared_dir / "data" / "classbench" / "acl1_1100.filters"
    t = shared_dir / "data" / "classbench" / "acl1_1100_trace.gz"
    assert main(["analyze", "--classbench", str(f), "--complex", "20", "--trace", str(t), "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert list(res) == KEYS
    assert list(res["traversed_rules"]) == ["full", "cut", "hsa_cut", "interval"]
    assert res["rules"] == 1100 and res["complex"] == 20 and res["simple"] == 1080
    assert len(res["shunt_vector_selective"]) == 1081
    assert res["shunting_rules_selective"] == res["shunt_vector_selective"][:-1].count("1")
    assert res["shunted_packets_selective"] <= res["shunted_packets_index_based"] <= res["packets"]
    tr = res["traversed_rules"]
    assert tr["interval"] < tr["hsa_cut"] < tr["full"] and tr["cut"] <= tr["full"]
    # Cross-check the shunted count with a plain first-match over the trace.
    pol = classbench_policy(f, complex_rules=20)
    plan = build_plan(pol, mode="selective")
    vals = trace_udp_values(read_trace(t))
    simple = np.array(pol.simple_indices)
    inside = np.zeros(len(vals), dtype=np.int64) + len(simple)
    lo = np.array([pol.rules[i].boxes[0].lo for i in simple])
    hi = np.array([pol.rules[i].boxes[0].hi for i in simple])
    for p in range(0, len(vals), 500):
        m = np.flatnonzero(((lo <= vals[p]) & (vals[p] <= hi)).all(axis=1))
        inside[p] = m[0] if len(m) else len(simple)
    sample = np.arange(0, len(vals), 500)
    assert (match_indices(plan, vals[sample]) == inside[sample]).all()


def test_cli_table_output(tmp_path, capsys):
    from hypafilter.tools.classbench import classbench_policy_text

    filt = tmp_path / "f.filters"
    filt.write_text("@10.0.0.0/8\t0.0.0.0/0\t0 : 65535\t53 : 53\t0x11/0xFF\t0x0000/0x0000\n" * 3)
    assert "udp" in classbench_policy_text(filt)
    assert main(["analyze", "--classbench", str(filt), "--complex", "1"]) == 0
    out = capsys.readouterr().out
    assert "shunt_vector_selective" in out and "rules" in out


def test_mirroring_counts_and_costs_equal_the_interpreter():
    """A policy with observing rules: mirror vectors and mirrored packets are reported, the copies' interval cost is
    what the interpreter counts for them, and full/cut/hsa_cut are costed on the plan without mirroring."""
    from hypafilter.config import Config

    from tests.unit.test_mirror import _policy

    pol = _policy()
    hdrs = [Header(proto=p, dport=d, src=s) for p in (1, 6, 17) for d in (22, 53, 80, 443, 8080) for s in (1, 2)]
    vals = np.array([h.values() for h in hdrs], dtype=np.int64)
    res = analyze(pol, Config(), vals)
    assert res["mirror_vector_index_based"] == "01100" and res["mirroring_rules_index_based"] == 2
    assert [r.split(":")[-1].strip() for r in res["observing_rules"]] == ["LOG", "NFLOG"]
    plan = build_plan(pol, Config(), mode="index")
    costs = strategy_costs(plan)
    copies, traversed = 0, 0
    for h in hdrs:
        v, shunted, count = hybrid_verdict(plan, "interval", h)
        mi = int(match_indices(plan, np.array([h.values()], dtype=np.int64))[0])
        if plan.mirror[mi] or shunted:
            assert count == costs["interval"][mi], h
            copies += not shunted
            traversed += count
    assert res["mirrored_packets_index_based"] == copies > 0
    assert res["traversed_rules"]["interval"] == traversed
    plain = analyze(pol, Config(strategy="cut"), vals)
    assert "mirror_vector_index_based" not in plain
    assert {s: res["traversed_rules"][s] for s in ("full", "cut", "hsa_cut")} == {
        s: plain["traversed_rules"][s] for s in ("full", "cut", "hsa_cut")
    }
