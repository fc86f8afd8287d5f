"""Benchmark of the IPv6 analysis: 5,000 ClassBench-like IPv6 rules (acl1 mapped into 2001:db8::/32 plus random
/48-/128 prefixes, tools.classbench6), 1,000 of them complex: parse, rank compression, shunt analysis, whole plan;
the same filters as IPv4 beside them.

Run: .venv/bin/python bench/analysis_speed_ipv6.py [--shared ../shared] [--rules 5000] [--repeat 3]
Prints each figure (median of --repeat) and the command line; docs/ipv6.md "Input and IR" quotes its output.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from hypafilter.analysis.plan import build_plan, selective_bits
from hypafilter.config import Config
from hypafilter.iptables.document import parse_policy
from hypafilter.ir.family import compress
from hypafilter.tools.classbench import classbench_policy_text
from hypafilter.tools.classbench6 import v6_policy_text

sys.path.insert(0, str(Path(__file__).resolve().parent))
from analysis_speed import median


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shared", default=str(Path(__file__).resolve().parents[1].parent / "shared"))
    ap.add_argument("--rules", type=int, default=5000)
    ap.add_argument("--complex", type=int, default=1000)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    print("command:", " ".join([Path(sys.executable).name, *sys.argv]))
    src = Path(args.shared) / "data" / "classbench" / "acl1_10k.filters"
    lines = src.read_text().splitlines()[: args.rules]
    with tempfile.NamedTemporaryFile("w", suffix=".filters", delete=False) as f:
        f.write("\n".join(lines) + "\n")
    text4 = classbench_policy_text(f.name, complex_rules=args.complex)
    Path(f.name).unlink()
    text6 = v6_policy_text(text4)
    cfg = Config()
    for family, text in ((4, text4), (6, text6)):
        t_parse, pol = median(
            lambda text=text, family=family: parse_policy(text, src.name, config=cfg, family=family), args.repeat
        )
        t_rank, ranked = (0.0, pol) if family == 4 else median(lambda pol=pol: compress(pol)[0], args.repeat)
        t_alg1, bits = median(lambda ranked=ranked: selective_bits(ranked), args.repeat)
        t_plan, plan = median(lambda pol=pol: build_plan(pol, cfg, mode="selective"), args.repeat)
        ranks = (
            f", {plan.addr_map.ranks('src')} src / {plan.addr_map.ranks('dst')} dst address ranks"
            if family == 6
            else ""
        )
        print(
            f"IPv{family}: {len(pol.rules)} rules ({len(pol.complex_indices)} complex){ranks}: parse {t_parse:.3f} s, "
            f"rank compression {t_rank:.3f} s, shunt analysis (Alg. 1) {t_alg1:.3f} s ({int(bits.sum())} shunting), "
            f"whole build_plan (compression included) {t_plan:.3f} s, {plan.num_intervals} intervals"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
