"""What a policy's plans do to traffic: shunted packets per shunting mode and software rules traversed per strategy
(the analysis behind `hypafilter analyze` and the paper's Figs. 11-13)."""

from __future__ import annotations

import time

import numpy as np

from hypafilter.analysis.decision import match_indices
from hypafilter.analysis.plan import Plan, build_plan
from hypafilter.analysis.program import MARK_MIRROR, build_program, mark_for
from hypafilter.ir import FIELD_INDEX, FIELDS, Header
from hypafilter.ir.semantics import never


def strategy_costs(plan: Plan, plain: Plan | None = None) -> dict[str, np.ndarray]:
    """Rules software tests per match_index (n + 1 values) for each strategy, complex checks evaluating false.

    Counted as the program interpreter counts (netfilter.Program.run): every conditional rule evaluated, i.e. the
    policy rules up to and including the first match (or the whole list), the mark tests of the dispatch, and one
    per jump into a block chain of the interval strategies. A plan with log mirroring (Plan.mirror) is costed for
    the interval strategies only (a mirrored entry at its copy's leaf); `plain`, the same policy's plan without
    mirroring, for full, cut and hsa_cut (default: `plan`).
    """
    interval_plan = plan
    plan = plain if plain is not None else plan
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
    plan = interval_plan
    for name in ("interval", "interval_geo"):
        if name == "interval_geo" and plan.mode == "exact":
            costs[name] = costs["interval"]
            continue
        prog = build_program(plan, name)
        memo: dict[tuple[int, int], int] = {}
        c = np.zeros(plan.n + 1, dtype=np.int64)
        copy = plan.mirror & ~plan.may_shunt  # only ever a copy reaches software: its leaf (k, action | mirror)
        for j in range(plan.n + 1):
            key = (int(plan.interval[j]), int(plan.actions[j]) | (MARK_MIRROR if copy[j] else 0))
            if key not in memo:
                # Complex rules never match here: the whole path (dispatch, block jumps, chain) is tested.
                memo[key] = prog.path_cost(mark_for(prog, *key))
            c[j] = memo[key]
        costs[name] = c
    return costs


def tree_costs(
    plan: Plan, points: np.ndarray, mi: np.ndarray, delivered: np.ndarray, copies: np.ndarray | None = None
) -> np.ndarray:
    """Rules software tests for each point under strategy tree (0 for a point not `delivered` to software), complex
    checks evaluating false: Program.run over the chains compile writes, so a leaf whose chain is a decision tree
    counts its walk (the tree's dispatch tests, the guard, the rules of the one leaf it reaches: `bench optimize`'s
    path), not the whole list. The walk depends on the header, not only on the entry: one run per distinct
    (leaf, header). `copies` (log mirroring): the points whose frame is decided by the fast path and mirrored; their
    copy walks the leaf (k, action | mirror)."""
    prog = build_program(plan, "tree")
    out = np.zeros(len(points), dtype=np.int64)
    memo: dict[tuple, int] = {}
    copies = np.zeros(len(points), dtype=bool) if copies is None else copies
    for p in np.flatnonzero(delivered | copies):
        j = int(mi[p])
        row = tuple(int(v) for v in points[p])
        copy = MARK_MIRROR if copies[p] and not delivered[p] else 0
        key = (int(plan.interval[j]), int(plan.actions[j]) | copy, row)
        if key not in memo:
            h = Header(**dict(zip(FIELDS, row, strict=True)))
            memo[key] = prog.run(h, mark_for(prog, key[0], key[1]), never)[1]
        out[p] = memo[key]
    return out


def _where(rule) -> str:
    return f"{rule.origin.file}:{rule.origin.line}" if rule.origin else "?"


def analyze(policy, config, points: np.ndarray | None = None) -> dict:
    """Shunt vectors (selective, index-based) and, for header points (values[p, NDIM]), shunted packets and the
    software rules each strategy traverses for them (paper §VIII, Figs. 11-13). With log mirroring (the config's
    strategy interval, interval_geo or tree and observing rules in the policy) also the mirror vectors and mirrored
    packets (copies software runs the interval chain on; counted in the interval strategy's traversed rules),
    while full, cut and hsa_cut are costed on the plan without mirroring they would run with."""
    t0 = time.perf_counter()
    ranks = None
    if policy.family != 4 and policy.addr_map is None:  # an IPv6 policy: analysed on its address ranks (ir.family)
        from hypafilter.ir.family import compress

        policy, amap = compress(policy)
        ranks = {d: len(s) for d, s in amap.starts.items()}
    sel = build_plan(policy, config, mode="selective")
    idx = build_plan(policy, config, mode="index")
    idx_plain = build_plan(policy, config, mode="index", strategy="cut") if idx.observing.any() else idx
    out = {
        "rules": len(policy.rules),
        "complex": len(policy.complex_indices),
        "simple": len(policy.simple_indices),
        "shunt_vector_selective": sel.shunt_string(),
        "shunt_vector_index_based": idx.shunt_string(),
        "shunting_rules_selective": int(sel.shunt[:-1].sum()),
        "shunting_rules_index_based": int(idx.shunt[:-1].sum()),
    }
    if sel.observing.any() or idx.observing.any():
        out["observing_rules"] = [
            f"#{i} {_where(policy.rules[i])}: {policy.rules[i].target or 'no target'}"
            for i in np.flatnonzero(idx.observing)
        ]
        out["mirror_vector_selective"] = "".join("1" if b else "0" for b in sel.mirror)
        out["mirror_vector_index_based"] = "".join("1" if b else "0" for b in idx.mirror)
        out["mirroring_rules_selective"] = int(sel.mirror[:-1].sum())
        out["mirroring_rules_index_based"] = int(idx.mirror[:-1].sum())
    if points is not None:
        mi = match_indices(sel, points)  # index and selective mode share their entries
        miss = np.asarray(points)[:, FIELD_INDEX["ct"]] == 0  # a frame the flow cache does not know: miss forcing
        n1 = sel.n + 1

        def hist(weights):
            return np.bincount(mi, weights=weights, minlength=n1).astype(np.int64)

        def shunted(plan):
            return plan.shunt[mi] | (miss & plan.forced[mi])

        sel_hist, idx_hist = hist(shunted(sel)), hist(shunted(idx))
        plain_hist = hist(shunted(idx_plain))
        # a copy: mirrored entry, frame neither shunted nor forced
        sel_copies = hist(sel.mirror[mi] & ~shunted(sel))
        idx_copies = hist(idx.mirror[mi] & ~shunted(idx))
        costs = strategy_costs(idx, idx_plain)
        out["packets"] = int(len(points))
        out["shunted_packets_selective"] = int(sel_hist.sum())
        out["shunted_packets_index_based"] = int(idx_hist.sum())
        if "observing_rules" in out:
            out["mirrored_packets_selective"] = int(sel_copies.sum())
            out["mirrored_packets_index_based"] = int(idx_copies.sum())
        out["traversed_rules"] = {s: int((plain_hist * costs[s]).sum()) for s in ("full", "cut", "hsa_cut")}
        out["traversed_rules"]["interval"] = int(((idx_hist + idx_copies) * costs["interval"]).sum())
        if config.strategy == "tree":  # the walks of its chains as written (idx is built for it), copies included
            copies = idx.mirror[mi] & ~shunted(idx)
            out["traversed_rules"]["tree"] = int(tree_costs(idx, points, mi, shunted(idx), copies).sum())
    if ranks is not None:
        out["family"] = policy.family
        out["address_ranks"] = ranks
    out["analysis_seconds"] = round(time.perf_counter() - t0, 6)
    return out
