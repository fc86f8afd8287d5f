"""`hypafilter analyze`: shunt vectors, shunted packets and traversed software rules of a policy (paper §VIII)."""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from hypafilter.analysis.decision import match_indices
from hypafilter.analysis.plan import Plan, build_plan
from hypafilter.analysis.program import build_program, mark_for
from hypafilter.cli.common import add_policy_args, load_config, load_policy
from hypafilter.tools.classbench import read_trace, trace_udp_values


def register(sub) -> None:
    p = sub.add_parser("analyze", help="shunting and software-strategy analysis of a policy (optionally on a trace)")
    add_policy_args(p)
    p.add_argument("--trace", metavar="T[.gz]", help="ClassBench header trace (headers taken as UDP)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=run)


def strategy_costs(plan: Plan) -> dict[str, np.ndarray]:
    """Rules software tests per match_index (n + 1 values) for each strategy, complex checks evaluating false.

    Counted as the program interpreter counts (netfilter.Program.run): every conditional rule evaluated, i.e. the
    policy rules up to and including the first match (or the whole list), the mark tests of the dispatch, and one
    per jump into a block chain of the interval strategies.
    """
    pol = plan.policy
    n_rules = len(pol.rules)
    # Complex rules never match here, so a packet's first match is its hardware entry's rule (or none).
    fpos = np.array([e.rule_index for e in plan.entries] + [n_rules], dtype=np.int64)
    cplx = np.array([not r.is_simple for r in pol.rules], dtype=bool)
    pos = np.arange(n_rules)

    def list_cost(members: np.ndarray, extra: int) -> np.ndarray:
        lst = pos[members]
        at = np.searchsorted(lst, fpos, side="right")
        found = (at > 0) & (lst[np.maximum(at - 1, 0)] == fpos) if len(lst) else np.zeros(len(fpos), dtype=bool)
        return np.where(found, at, len(lst)) + extra

    costs = {"full": list_cost(np.ones(n_rules, dtype=bool), 0)}
    shunted_pos = fpos[:-1][plan.shunt[:-1]]
    beta = int(shunted_pos.min()) if len(shunted_pos) else n_rules
    costs["cut"] = list_cost(cplx | (pos >= beta), 1)
    costs["hsa_cut"] = list_cost(cplx | plan.conflict, 1)
    for name in ("interval", "interval_geo"):
        if name == "interval_geo" and plan.mode == "exact":
            costs[name] = costs["interval"]
            continue
        prog = build_program(plan, name)
        memo: dict[tuple[int, int], int] = {}
        c = np.zeros(plan.n + 1, dtype=np.int64)
        for j in range(plan.n + 1):
            key = (int(plan.interval[j]), int(plan.actions[j]))
            if key not in memo:
                # Complex rules never match here: the whole path (dispatch, block jumps, chain) is tested.
                memo[key] = prog.path_cost(mark_for(prog, *key))
            c[j] = memo[key]
        costs[name] = c
    return costs


def analyze(policy, config, trace=None) -> dict:
    t0 = time.perf_counter()
    sel = build_plan(policy, config, mode="selective")
    idx = build_plan(policy, config, mode="index")
    out = {
        "rules": len(policy.rules),
        "complex": len(policy.complex_indices),
        "simple": len(policy.simple_indices),
        "shunt_vector_selective": sel.shunt_string(),
        "shunt_vector_index_based": idx.shunt_string(),
        "shunting_rules_selective": int(sel.shunt[:-1].sum()),
        "shunting_rules_index_based": int(idx.shunt[:-1].sum()),
    }
    if trace is not None:
        mi = match_indices(sel, trace_udp_values(trace))
        hist = np.bincount(mi, minlength=sel.n + 1)
        idx_hist = hist * idx.shunt
        costs = strategy_costs(idx)
        out["packets"] = int(len(trace))
        out["shunted_packets_selective"] = int((hist * sel.shunt).sum())
        out["shunted_packets_index_based"] = int(idx_hist.sum())
        out["traversed_rules"] = {s: int((idx_hist * costs[s]).sum()) for s in ("full", "cut", "hsa_cut", "interval")}
    out["analysis_seconds"] = round(time.perf_counter() - t0, 6)
    return out


def run(args: argparse.Namespace) -> int:
    config = load_config(args)
    policy = load_policy(args, config)
    trace = read_trace(args.trace) if args.trace else None
    res = analyze(policy, config, trace)
    if args.json:
        print(json.dumps(res))
        return 0
    width = max(len(k) for k in res)
    for k, v in res.items():
        if k == "traversed_rules":
            for s, c in v.items():
                print(f"{'traversed_rules.' + s:<{width + 10}} {c}")
        elif isinstance(v, str) and len(v) > 72:
            print(f"{k:<{width + 10}} {v[:72]}… ({len(v)} bits, {v.count('1')} set)")
        else:
            print(f"{k:<{width + 10}} {v}")
    return 0
