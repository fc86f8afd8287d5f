"""`hypafilter import-classbench`: a ClassBench filter set as an iptables policy (paper §VIII-C)."""

from __future__ import annotations

import argparse
import sys

from hypafilter.errors import HypafilterError
from hypafilter.tools.classbench import classbench_policy_text


def register(sub) -> None:
    p = sub.add_parser("import-classbench", help="convert a ClassBench filter set into an iptables-save policy")
    p.add_argument("filters", metavar="FILTERS")
    p.add_argument("--complex", type=int, default=0, metavar="K", help="number of complex rules (evenly placed)")
    p.add_argument("--policy", choices=("ACCEPT", "DROP"), default="ACCEPT", help="chain policy")
    p.add_argument("--actions", choices=("accept", "alternate"), default="accept", help="rule actions")
    p.add_argument("--deterministic", action="store_true", help="complex rules without the statistic match")
    p.add_argument("--chain", default="FORWARD", help="base chain (default FORWARD)")
    p.add_argument("-o", "--output", metavar="FILE", help="write here instead of stdout")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    text = classbench_policy_text(
        args.filters, args.complex, args.policy, args.actions, args.deterministic, chain=args.chain
    )
    if args.output:
        try:
            with open(args.output, "w", encoding="utf-8") as f:
                f.write(text)
        except OSError as e:
            raise HypafilterError(f"{args.output}: {e.strerror}") from e
    else:
        sys.stdout.write(text)
    return 0
