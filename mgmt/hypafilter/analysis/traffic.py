"""What a policy's plans do to traffic: shunted packets per shunting mode and software rules traversed per strategy
(the analysis behind `hypafilter analyze` and the paper's Figs. 11-13)."""

from __future__ import annotations

import time

import numpy as np

from hypafilter.analysis.decision import match_indices
from hypafilter.analysis.plan import Plan, build_plan
from hypafilter.analysis.program import build_program, mark_for
from hypafilter.ir import FIELD_INDEX


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
    shunted_pos = fpos[:-1][plan.may_shunt[:-1]]  # as program._cut_list: entries forced on a miss count too
    beta = int(shunted_pos.min()) if len(shunted_pos) else n_rules
    costs["cut"] = list_cost(cplx | (pos >= beta), 1)
    costs["hsa_cut"] = list_cost(plan.hsa_members(), 1)
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


def analyze(policy, config, points: np.ndarray | None = None) -> dict:
    """Shunt vectors (selective, index-based) and, for header points (values[p, NDIM]), shunted packets and the
    software rules each strategy traverses for them (paper §VIII, Figs. 11-13)."""
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
    if points is not None:
        mi = match_indices(sel, points)  # index and selective mode share their entries
        miss = np.asarray(points)[:, FIELD_INDEX["ct"]] == 0  # a frame the flow cache does not know: miss forcing
        n1 = sel.n + 1
        sel_hist = np.bincount(mi, weights=sel.shunt[mi] | (miss & sel.forced[mi]), minlength=n1).astype(np.int64)
        idx_hist = np.bincount(mi, weights=idx.shunt[mi] | (miss & idx.forced[mi]), minlength=n1).astype(np.int64)
        costs = strategy_costs(idx)
        out["packets"] = int(len(points))
        out["shunted_packets_selective"] = int(sel_hist.sum())
        out["shunted_packets_index_based"] = int(idx_hist.sum())
        out["traversed_rules"] = {s: int((idx_hist * costs[s]).sum()) for s in ("full", "cut", "hsa_cut", "interval")}
    out["analysis_seconds"] = round(time.perf_counter() - t0, 6)
    return out
