"""`hypafilter optimize POLICY -o OUT.rules`: the policy's filter table rewritten as decision trees in jump chains
(HiTables), for any iptables host; docs/optimize.md."""

from __future__ import annotations

import json
import os
import sys
import tempfile


def register(sub) -> None:
    p = sub.add_parser(
        "optimize",
        help="rewrite an iptables policy as decision trees in jump chains (same verdicts, shorter walks)",
    )
    p.add_argument("policy", nargs="?", metavar="POLICY", help="iptables-save file or plain rule file")
    p.add_argument("-o", "--output", metavar="OUT", help="iptables-restore file to write (default: standard output)")
    p.add_argument(
        "-6",
        dest="family6",
        action="store_true",
        help="POLICY is an ip6tables policy (ip6tables-save file or ip6tables lines); OUT is an ip6tables-restore file."
        " With --classbench: the set mapped into IPv6 (docs/ipv6.md)",
    )
    cb = p.add_argument_group("ClassBench import (instead of POLICY)")
    cb.add_argument("--classbench", metavar="FILTERS", help="ClassBench filter set")
    cb.add_argument("--policy", dest="cb_policy", choices=("ACCEPT", "DROP"), default="ACCEPT", help="chain policy")
    cb.add_argument("--actions", choices=("accept", "alternate"), default="accept", help="rule actions")
    t = p.add_argument_group("trees")
    t.add_argument("--binth", type=int, default=8, help="a node with at most this many rules is a leaf (default 8)")
    t.add_argument(
        "--max-expansion",
        type=float,
        default=4.0,
        help="rules written per rule of a tree's segment, dispatch and copies included (default 4.0)",
    )
    t.add_argument(
        "--min-segment", type=int, default=16, help="shortest run of movable rules made into a tree (default 16)"
    )
    t.add_argument("--prefix", default="ht", help="prefix of the tree chains (default ht)")
    p.add_argument("--json", action="store_true", help="print the summary as JSON on standard error")
    p.set_defaults(func=run)


def policy_text(args) -> tuple[str, str]:
    """(text, file name) of the policy to optimise: POLICY or a ClassBench import."""
    from hypafilter.errors import HypafilterError

    if bool(args.policy) == bool(args.classbench):
        raise HypafilterError("give POLICY or --classbench FILTERS")
    if args.classbench:
        from hypafilter.tools.classbench import classbench_policy_text

        text = classbench_policy_text(args.classbench, policy=args.cb_policy, actions=args.actions)
        if getattr(args, "family6", False):
            from hypafilter.tools.classbench6 import v6_policy_text

            text = v6_policy_text(text)
        return text, args.classbench
    try:
        with open(args.policy, encoding="utf-8") as f:
            return f.read(), args.policy
    except (OSError, UnicodeDecodeError) as e:
        raise HypafilterError(f"{args.policy}: cannot read: {e}") from e


def run(args) -> int:
    from hypafilter.errors import HypafilterError
    from hypafilter.optimize.emit import optimize
    from hypafilter.optimize.tree import Params

    if args.binth < 1 or args.max_expansion < 1 or args.min_segment < 2:
        raise HypafilterError("--binth must be at least 1, --max-expansion at least 1, --min-segment at least 2")
    text, name = policy_text(args)
    res = optimize(
        text,
        name,
        Params(binth=args.binth, max_expansion=args.max_expansion),
        args.prefix,
        args.min_segment,
        family=6 if args.family6 else 4,
    )
    if args.output:
        d = os.path.dirname(os.path.abspath(args.output))
        fd, tmp = tempfile.mkstemp(dir=d, prefix=".optimize-")
        with os.fdopen(fd, "w") as f:
            f.write(res.text)
        os.replace(tmp, args.output)
    else:
        sys.stdout.write(res.text)
    s = res.summary()
    if args.json:
        print(json.dumps(s), file=sys.stderr)
    else:
        kept = ", ".join(f"{n} ({why})" for why, n in s["kept_in_place"].items()) or "none"
        print(
            f"{name}: {s['rules_in']} rules in, {s['rules_out']} out (x{s['expansion']}), {s['trees']} trees over "
            f"{s['rules_in_trees']} rules; kept in place: {kept}; {s['build_s']} s",
            file=sys.stderr,
        )
        for note in s["notes"]:
            print(f"{name}: {note}", file=sys.stderr)
    return 0
