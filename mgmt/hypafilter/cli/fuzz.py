"""`hypafilter fuzz`: the kernel-differential fuzzer (tools/fuzz.py) on the lab: random policies from seeds through
`verify` over shunting modes × software strategies, the kernel alone as the oracle; `-6`/`--ipv6` adds a random
ip6tables policy beside each (dual stack) and IPv6 frames of every verify6 kind (docs/deploy.md "Fuzzing")."""

from __future__ import annotations

import argparse
import json
import sys

from hypafilter.cli.common import progress


def cmd_fuzz(args: argparse.Namespace) -> int:
    from hypafilter.errors import HypafilterError
    from hypafilter.tools import fuzz

    try:
        pairs = fuzz.pairs_named(args.pairs)
    except ValueError as e:
        raise HypafilterError(f"--pairs: {e}") from e
    if args.policies < 1 or args.frames < 0 or (args.frames6 is not None and args.frames6 < 0):
        raise HypafilterError("--policies must be at least 1, --frames and --frames6 not negative")
    frames6 = (args.frames6 if args.frames6 is not None else args.frames) if args.ipv6 else 0
    seeds = range(args.seed, args.seed + args.policies)
    r = fuzz.run(
        seeds,
        args.frames,
        pairs,
        target=args.target,
        ipv6=args.ipv6,
        frames6=frames6,
        log=progress(args, quiet=args.json),
        attack_share=args.attack_share,
        connections=args.connections,
    )
    s = r.summary()
    if args.json:
        print(json.dumps({**s, "by_kind": r.tally.by_kind, "runs": r.tally.runs}))
    else:
        print(r.tally.table())
        print(json.dumps({k: v for k, v in s.items() if k != "examples"}))
        for ex in s["examples"]:
            print(f"mismatch: {json.dumps(ex)}", file=sys.stderr)
    return 1 if r.mismatches else 0


def register(sub) -> None:
    p = sub.add_parser(
        "fuzz", help="random policies through verify on the lab, the kernel as oracle (-6: dual stack with IPv6)"
    )
    p.add_argument(
        "-6",
        "--ipv6",
        action="store_true",
        help="dual stack: a random ip6tables policy beside each IPv4 one, IPv6 frames of every kind (on xdp the "
        "program decides IPv6: xdp_ipv6 on; on emu the dual-stack core: emu_ipv6 on)",
    )
    p.add_argument("--target", choices=("emu", "xdp"), default="emu", help="fast path (default emu)")
    p.add_argument("--seed", type=int, default=1, help="first policy seed (default 1)")
    p.add_argument("--policies", type=int, default=1, help="policies, seeds SEED, SEED+1, ... (default 1)")
    p.add_argument("--frames", type=int, default=500, help="IPv4 frames per (mode, strategy) pair (default 500)")
    p.add_argument("--frames6", type=int, help="with -6: IPv6 frames per pair (default: --frames)")
    p.add_argument(
        "--pairs",
        default="quick",
        help="(mode, strategy) pairs: quick (every strategy but tree's, and selective/tree), all, or "
        "MODE/STRATEGY[,...] (default quick)",
    )
    p.add_argument("--attack-share", type=float, default=0.3, help="share of IPv4 attack frames (default 0.3)")
    p.add_argument(
        "--connections",
        type=int,
        default=0,
        metavar="N",
        help="policies that read conntrack state (even seeds): N real connections per pair after the frames "
        "(verify --connections; IPv6 ones too with -6)",
    )
    p.add_argument("--json", action="store_true", help="the summary, frames by kind and every pair's run as JSON")
    p.set_defaults(func=cmd_fuzz)
