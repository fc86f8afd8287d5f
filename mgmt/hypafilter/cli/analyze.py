"""`hypafilter analyze`: shunt vectors, shunted packets and traversed software rules of a policy (paper §VIII)."""

from __future__ import annotations

import argparse
import json

from hypafilter.analysis.traffic import analyze
from hypafilter.cli.common import (
    add_policy_args,
    interfaces_text,
    load_config,
    load_policy,
    load_policy6,
    resolved_lines,
)
from hypafilter.config import STRATEGIES
from hypafilter.errors import HypafilterError
from hypafilter.tools.classbench import read_trace, trace_udp_values


def register(sub) -> None:
    p = sub.add_parser("analyze", help="shunting and software-strategy analysis of a policy (optionally on a trace)")
    add_policy_args(p, ipv6=True)
    p.add_argument("--trace", metavar="T[.gz]", help="ClassBench header trace (headers taken as UDP)")
    p.add_argument(
        "--strategy",
        choices=STRATEGIES,
        help="the site's strategy (default: the configuration's); tree adds traversed_rules.tree: the walks of its "
        "chains as written, a tree counted by its path",
    )
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    config = load_config(args)
    if args.trace and args.family6:
        raise HypafilterError(
            "--trace: ClassBench traces are IPv4 headers (not with -6; with --ipv6 the trace is the IPv4 side's)"
        )
    policy = load_policy(args, config)
    policy6 = load_policy6(args, config)
    points = trace_udp_values(read_trace(args.trace)) if args.trace else None
    res = analyze(policy, config, points)
    if policy6 is not None:  # dual stack: the IPv6 side's figures under "ipv6"
        res["ipv6"] = analyze(policy6, config)
    if policy.resolved:
        res["interfaces"] = interfaces_text(policy)
        res["interface_checks_resolved"] = resolved_lines(policy)
    if args.json:
        print(json.dumps(res))
        return 0
    _print(res, max(len(k) for k in res))
    return 0


def _print(res: dict, width: int, prefix: str = "") -> None:
    for k, v in res.items():
        if k == "ipv6" and isinstance(v, dict):  # dual stack: the IPv6 side's figures
            _print(v, width, "ipv6.")
            continue
        k = prefix + k
        if isinstance(v, dict):
            for s, c in v.items():
                print(f"{k + '.' + s:<{width + 10}} {c}")
        elif isinstance(v, list):
            for line in v:
                print(f"{k:<{width + 10}} {line}")
        elif isinstance(v, str) and len(v) > 72:
            print(f"{k:<{width + 10}} {v[:72]}… ({len(v)} bits, {v.count('1')} set)")
        else:
            print(f"{k:<{width + 10}} {v}")
