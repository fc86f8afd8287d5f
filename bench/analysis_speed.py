"""Benchmark of the compiler core: shunt analysis at 5k/1k and 100k/10k rules, parse + compile of 10k rules.

Run: .venv/bin/python bench/analysis_speed.py [--shared ../shared] [--repeat 3]
Prints each figure (best of --repeat; parse + compile: median of --repeat) and the command line; docs/compiler.md quotes its output.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
from hypafilter.analysis.plan import build_plan, selective_bits
from hypafilter.config import Config
from hypafilter.ir import MAXV, PROTO_UDP, Box, Level, Policy, Rule
from hypafilter.netfilter.restore import to_iptables_restore
from hypafilter.tools.classbench import classbench_policy, classbench_policy_text, complex_positions, read_filters


def scaled_policy(rows: np.ndarray, n: int, k: int) -> Policy:
    """n ClassBench-like rules: copies of `rows` whose long prefixes are moved to other address blocks."""
    out = []
    cx = set(complex_positions(n, k))
    for i in range(n):
        c, r = divmod(i, len(rows))
        row = rows[r].copy()
        for lo, hi in ((0, 1), (2, 3)):
            size = row[hi] - row[lo] + 1
            if c and size <= 1 << 20:  # a /12 or longer: move it to another /12 block of the copy
                row[lo] ^= (c * 0x9E3) << 20 & 0xFFF00000
                row[hi] = row[lo] + size - 1
        b = Box(
            (int(row[0]), int(row[2]), PROTO_UDP, int(row[4]), int(row[6]), 0, 0, 0),
            (int(row[1]), int(row[3]), PROTO_UDP, int(row[5]), int(row[7]), MAXV[5], MAXV[6], MAXV[7]),
        )
        cplx = (("-m", "string", "--algo", "bm", "!", "--string", "BAD"),) if i in cx else ()
        out.append(Rule(boxes=(b,), target="ACCEPT", complex=cplx, levels=(Level(()),)))
    return Policy(rules=out, source=f"scaled-{n}")


def best(fn, repeat: int) -> tuple[float, object]:
    t, res = float("inf"), None
    for _ in range(repeat):
        t0 = time.perf_counter()
        res = fn()
        t = min(t, time.perf_counter() - t0)
    return t, res


def median(fn, repeat: int) -> tuple[float, object]:
    """Median wall time of `repeat` runs (the machine is shared, so the best run flatters and the mean wobbles)."""
    times, res = [], None
    for _ in range(repeat):
        t0 = time.perf_counter()
        res = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shared", default=str(Path(__file__).resolve().parents[1].parent / "shared"))
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    cb = Path(args.shared) / "data" / "classbench"
    print("command:", " ".join([Path(sys.executable).name, *sys.argv]))
    rows = read_filters(cb / "acl1_10k.filters")

    for n, k, limit in ((5000, 1000, 0.2), (100_000, 10_000, 10.0)):
        pol = scaled_policy(rows, n, k)
        t, bits = best(lambda pol=pol: selective_bits(pol), args.repeat if n < 50_000 else 1)
        print(
            f"shunt analysis (Alg. 1, selective vector): {n} rules, {k} complex: {t:.3f} s "
            f"(target <= {limit} s), {int(bits.sum())} shunting rules"
        )
        t, plan = best(lambda pol=pol: build_plan(pol, mode="selective"), 1)
        print(f"  whole build_plan (vectors, actions, intervals, chains): {t:.3f} s, {plan.num_intervals} intervals")

    f = cb / "acl1_10k.filters"
    text = classbench_policy_text(f, complex_rules=1000)
    from hypafilter.iptables.document import parse_policy

    cfg = Config()

    def parse_compile():
        pol = parse_policy(text, str(f), "FORWARD", cfg)
        plan = build_plan(pol, cfg, "selective")
        return pol, plan, to_iptables_restore(plan, "interval")

    t, (pol, plan, out) = median(parse_compile, args.repeat)
    t_parse, _ = median(lambda: parse_policy(text, str(f), "FORWARD", cfg), args.repeat)
    t_direct, _ = median(lambda: classbench_policy(f, complex_rules=1000), args.repeat)
    print(
        f"parse + compile (plan + interval iptables text) of {len(pol.rules)} rules, 1000 complex: median {t:.3f} s "
        f"(target <= 2 s; parse alone {t_parse:.3f} s, ClassBench straight to IR {t_direct:.3f} s), "
        f"{out.count(chr(10))} lines"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
