"""`hypafilter synth`: resource and timing estimates of the generated core (yosys), or a Vivado project script."""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from hypafilter.cli.common import add_policy_args, load_config, load_policy


def register(sub) -> None:
    p = sub.add_parser("synth", help="synthesis estimate of the generated hardware (yosys) or Vivado Tcl")
    add_policy_args(p)
    # (no -6 here: an option that looks like a negative number makes argparse read "--slices -2" as two options)
    v6 = p.add_argument_group('dual-stack core (docs/ipv6.md "The NIC\'s core"; without POLICY: no IPv4 entry)')
    v6.add_argument("--ipv6", metavar="V6POLICY", help="the ip6tables policy beside the IPv4 one")
    v6.add_argument(
        "--ipv6-classbench", metavar="FILTERS", help="the IPv6 side from a ClassBench set mapped into IPv6 (as -6)"
    )
    p.add_argument("--tool", choices=("yosys", "vivado"), default="yosys", help="yosys estimate or Vivado script")
    p.add_argument("--json", action="store_true", help="print the estimate as JSON")
    p.add_argument("--width", type=int, choices=(256, 512), default=256, help="TDATA width (default 256)")
    p.add_argument("--fanin", type=int, default=8, help="priority encoder fan-in (default 8)")
    p.add_argument("--fifo-bytes", type=int, default=65536, help="packet FIFO size (default 64 kB)")
    p.add_argument("--matcher-only", action="store_true", help="skip the whole-core estimate")
    p.add_argument(
        "--slices",
        type=int,
        metavar="M",
        help="estimate the matcher as the sum of separately synthesised slices of M entries (an upper bound; "
        "default and 0: the whole matcher)",
    )
    p.add_argument(
        "--encoder",
        choices=("auto", "whole", "subtrees"),
        default="auto",
        help="encoder estimate: whole, or the subtrees under its last stage plus a bound of that stage "
        "(default: whole up to a 4096-wide tree)",
    )
    p.add_argument(
        "--flow-cache",
        metavar="LOG2_SETS:WAYS",
        help="estimate the flow cache alone (hw/hf_flow_cache.vhd, no policy), e.g. 14:4 for 65,536 entries",
    )
    p.add_argument(
        "--flow-cache-ipv6",
        action="store_true",
        help="with --flow-cache: the cache of a dual-stack core, whose keys hold IPv6 tuples too (generic V6)",
    )
    p.add_argument(
        "--ct-member",
        metavar="LOG2:EGRESS_LOG2",
        help="estimate the conntrack membership structure alone (hw/hf_ct_member.vhd), e.g. 20:12 for 4 banks of "
        "2**20 counters and 4,096 egress stamps",
    )
    p.add_argument(
        "--ct-member-ipv6",
        action="store_true",
        help="with --ct-member: the structure of a dual-stack core, whose keys take IPv6 tuples too (generic V6)",
    )
    p.add_argument(
        "--core-flow-cache",
        metavar="LOG2_SETS:WAYS",
        help="build the whole core (estimate or Vivado script) with a flow cache inside, e.g. 14:4 for 65,536 "
        "entries (default: none)",
    )
    p.add_argument(
        "--update-buffer",
        type=int,
        metavar="SLOTS",
        help="slots of the core's update buffer (default: the configuration's update_buffer, 16; 0: none)",
    )
    p.add_argument("--out", metavar="DIR", help="build folder (default: a temporary folder; vivado: build/vivado)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    # the analysis and the synthesis flow load only when the command runs (start-up time of every other command)
    from hypafilter.analysis.plan import build_plan
    from hypafilter.cli.common import load_policy6
    from hypafilter.errors import HypafilterError
    from hypafilter.hw import synth
    from hypafilter.ir import Policy

    if args.flow_cache:
        return _flow_cache(args)
    if args.ct_member:
        return _ct_member(args)
    fc = _geometry("--core-flow-cache", args.core_flow_cache) if args.core_flow_cache else None
    config = load_config(args)
    if args.update_buffer is not None:
        config.update_buffer = args.update_buffer
        config.validate("--update-buffer")
    # a dual-stack core (docs/ipv6.md "The NIC's core"): the IPv6 side from --ipv6 or --ipv6-classbench, the IPv4
    # side from POLICY or --classbench, or none (IPv6 entries alone)
    if args.ipv6 and args.ipv6_classbench:
        raise HypafilterError("give either --ipv6 V6POLICY or --ipv6-classbench FILTERS, not both")
    dual = bool(args.ipv6 or args.ipv6_classbench)
    policy = load_policy(args, config) if args.policy or args.classbench or not dual else Policy([], "ACCEPT")
    policy6 = load_policy6(args, config)
    if args.ipv6_classbench:
        from hypafilter.iptables.document import parse_policy
        from hypafilter.tools.classbench import classbench_policy_text
        from hypafilter.tools.classbench6 import v6_policy_text

        text6 = v6_policy_text(classbench_policy_text(args.ipv6_classbench, complex_rules=args.complex))
        policy6 = parse_policy(text6, args.ipv6_classbench, args.chain, config, family=6)
    plan = build_plan(policy, config)
    plan6 = build_plan(policy6, config) if policy6 is not None else None
    if args.tool == "vivado":
        if plan6 is not None:
            raise HypafilterError("the Vivado script is for IPv4-only cores for now (docs/ipv6.md)")
        out = Path(args.out or "build/vivado")
        tcl = synth.vivado_project(plan, out, args.width, args.fanin, args.fifo_bytes, flow_cache=fc)
        rc = synth.run_vivado(tcl)
        if rc is None:
            print(f"wrote {tcl}; vivado is not on PATH, so nothing was built (run: vivado -mode batch -source {tcl})")
            return 0
        return rc
    with tempfile.TemporaryDirectory(prefix="hf-synth-") as tmp:
        out = Path(args.out) if args.out else Path(tmp)
        est = synth.estimate(
            plan,
            out,
            args.width,
            args.fanin,
            args.fifo_bytes,
            core=not args.matcher_only,
            slices=args.slices,
            encoder_split={"auto": None, "whole": False, "subtrees": True}[args.encoder],
            flow_cache=fc,
            plan6=plan6,
        )
    if args.json:
        print(json.dumps(est, indent=2))
    else:
        me, how = est["matcher_encoder"], est["method"]
        v6 = f" + {est['entries_ipv6']} IPv6" if "entries_ipv6" in est else ""
        print(
            f"{est['entries']}{v6} entries: matcher+encoder {me['LUT']} LUT, {me['FF']} FF, {me['CARRY4']} CARRY4, "
            f"max {me['max_lut_levels']} LUT levels, {me['pipeline_cycles']} cycles"
        )
        if how["matcher"] == "slices":
            print(f"matcher estimated as the sum of {how['slices']} slices of <= {how['slice_entries']} entries")
            print(f"  ({how['note']})")
        if how["encoder"] == "subtrees":
            print(f"  ({how['encoder_note']})")
        b = est["buffer"]
        print(
            f"update buffer, {b['slots']} slots: {b['LUT']} LUT, {b['FF']} FF, max {b['max_lut_levels']} LUT levels, "
            f"+{b['added_latency_cycles']} cycles"
        )
        if "core" in est:
            c = est["core"]
            print(
                f"whole core: {c['LUT']} LUT, {c['FF']} FF, {c['BRAM36']} BRAM36 + {c['BRAM18']} BRAM18, "
                f"max {c['max_lut_levels']} LUT levels"
            )
    return 0


def _geometry(option: str, text: str) -> tuple[int, int]:
    """(LOG2_SETS, WAYS) of an option's value, checked as Config.flow_cache is."""
    from hypafilter.config import Config

    geometry = Config(flow_cache=text).flow_cache_geometry(option)
    if geometry is None:
        from hypafilter.errors import HypafilterError

        raise HypafilterError(f"{option} wants LOG2_SETS:WAYS, not '{text}'")
    return geometry


def _ct_member(args: argparse.Namespace) -> int:
    from hypafilter.errors import HypafilterError
    from hypafilter.hw import synth

    try:
        log2, egress_log2 = (int(x) for x in args.ct_member.split(":"))
    except ValueError:
        raise HypafilterError(f"--ct-member wants LOG2:EGRESS_LOG2 (e.g. 20:12), not '{args.ct_member}'") from None
    if not (8 <= log2 <= 24 and 4 <= egress_log2 <= 24):
        raise HypafilterError(f"--ct-member {args.ct_member}: LOG2 must be 8..24 and EGRESS_LOG2 4..24")
    with tempfile.TemporaryDirectory(prefix="hf-synth-") as tmp:
        est = synth.ct_member_estimate(
            Path(args.out) if args.out else Path(tmp), log2, egress_log2, v6=args.ct_member_ipv6
        )
    if args.json:
        print(json.dumps(est, indent=2))
    else:
        print(
            f"conntrack membership, 4 x {1 << log2} counters, {1 << egress_log2} egress stamps: {est['LUT']} LUT, "
            f"{est['FF']} FF, {est['BRAM36']} BRAM36 + {est['BRAM18']} BRAM18, max {est['max_lut_levels']} LUT levels"
        )
    return 0


def _flow_cache(args: argparse.Namespace) -> int:
    from hypafilter.hw import synth

    log2_sets, ways = _geometry("--flow-cache", args.flow_cache)
    with tempfile.TemporaryDirectory(prefix="hf-synth-") as tmp:
        est = synth.flow_cache_estimate(
            Path(args.out) if args.out else Path(tmp), log2_sets, ways, v6=args.flow_cache_ipv6
        )
    if args.json:
        print(json.dumps(est, indent=2))
    else:
        print(
            f"flow cache{' (IPv6 tuples)' if args.flow_cache_ipv6 else ''}, {est['entries']} entries ({ways} ways): {est['LUT']} LUT, {est['FF']} FF, "
            f"{est['BRAM36']} BRAM36 + {est['BRAM18']} BRAM18, max {est['max_lut_levels']} LUT levels"
        )
    return 0
