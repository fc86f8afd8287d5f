#!/usr/bin/env python3
"""Strategy tree's live K0 tree, lazily rebuilt (docs/optimize.md, "The live K0 tree"): a ClassBench policy's K0 path
as a live deployment on xdp loads it, against the policy alone in the kernel (the packet-rate bench's namespaces).

For each stage: the program's build time, the changed rules K0T diverts, the rules evaluated per trace header on the
K0 path (Program.run with the K0-tree mark: dispatch tests and policy lines, the live rules for a diverted frame),
and `bench optimize`'s comparison (probe verdicts, frames/s of the live list and of K0T). Stages: the tree built for
the policy (a deploy); the same tree after N bans inserted by the operator at random places (a follow: the bans
diverted ahead of it), N = 1 and 8; the tree rebuilt for the changed policy. Prints one JSON line per stage.

    PYTHONPATH=mgmt .venv/bin/python scripts/k0-lazy.py [--filters F] [--trace T] [--seconds S] [--repeats R]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHARED = ROOT.parent / "shared" / "data" / "classbench"


def main() -> None:
    from hypafilter.analysis.plan import build_plan
    from hypafilter.analysis.program import K0_TREE, build_program, mark_for
    from hypafilter.config import Config
    from hypafilter.iptables.document import parse_policy
    from hypafilter.ir import Header
    from hypafilter.tools.bench import optimize as bench
    from hypafilter.tools.classbench import classbench_policy_text, read_trace

    ap = argparse.ArgumentParser()
    ap.add_argument("--filters", default=str(SHARED / "acl1_1100.filters"))
    ap.add_argument("--trace", default=str(SHARED / "acl1_1100_trace.gz"))
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--probes", type=int, default=2000)
    a = ap.parse_args()

    text = classbench_policy_text(a.filters, policy="DROP", actions="alternate")
    rows = bench.trace_rows(read_trace(a.trace)[:20000])
    rng = random.Random(7)

    def banned(n: int) -> str:
        lines = text.splitlines()
        at = [i for i, ln in enumerate(lines) if ln.startswith("-A FORWARD")]
        for _ in range(n):
            src = rows[rng.randrange(len(rows))][0]
            net = f"{src >> 24}.{(src >> 16) & 255}.{(src >> 8) & 255}.0/24"
            lines.insert(rng.choice(at), f"-A FORWARD -s {net} -j DROP")
        return "\n".join(lines) + "\n"

    def path_mean(t: str, base: str | None) -> float:
        cfg = Config(strategy="tree", tree_min_segment=16)
        if base is not None:
            p0 = build_plan(parse_policy(base, filename="b", base_chain="FORWARD", config=cfg), cfg, live=True)
            p0.k0_tree = True
            build_program(p0, "tree")
        plan = build_plan(parse_policy(t, filename="p", base_chain="FORWARD", config=cfg), cfg, live=True)
        plan.k0_tree, plan.trees_fresh = True, base is None
        prog = build_program(plan, "tree")
        hs = [Header(src=s, dst=d, proto=17, sport=sp, dport=dp) for s, d, sp, dp in rows[:3000]]
        return statistics.mean(prog.run(h, mark_for(prog, 0, K0_TREE), lambda *x: False)[1] for h in hs)

    b8 = banned(8)
    stages = [("deployed", text, None), ("lazy+1", banned(1), text), ("lazy+8", b8, text), ("rebuilt+8", b8, None)]
    for name, t, base in stages:
        res, summary = bench.k0_live_program(t, name, base)
        rep = bench.run(t, res, rows, seconds=a.seconds, repeats=a.repeats, probes=a.probes, log=lambda m: None)
        out = {
            "stage": name,
            **{k: summary[k] for k in ("k0_tree", "k0_changed", "k0_rules_written", "build_s")},
            "path_mean_k0": round(path_mean(t, base), 1),
            **{k: rep.get(k) for k in ("probes", "mismatches", "pps_in", "pps_out", "speedup", "pps_empty")},
        }
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
