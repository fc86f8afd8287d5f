"""`hypafilter bench paper`: reproduces the paper's evaluation (Figs. 11-15, §VIII-I) into CSV, PNG and docs/results.md;
`hypafilter bench rate`: frames per second through the hybrid path against the policy alone in iptables and nft."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

from hypafilter.cli.common import add_policy_args, frame_options, load_config, load_policy, progress, set_env
from hypafilter.config import MODES, STRATEGIES
from hypafilter.errors import HypafilterError
from hypafilter.paths import ROOT


def register(sub) -> None:
    p = sub.add_parser("bench", help="benchmarks (paper evaluation, packet rate)")
    bsub = p.add_subparsers(dest="bench_command", metavar="BENCH")
    bsub.required = True
    q = bsub.add_parser("paper", help="reproduce the HyPaFilter+ evaluation figures 11-15 and the scaling test")
    q.add_argument("--sets", help="comma-separated ClassBench sets (default: acl1-5,fw1-5; quick: acl1,fw1)")
    q.add_argument("--out", metavar="DIR", help="output folder for CSV/PNG (default build/bench-paper[-quick])")
    q.add_argument("--quick", action="store_true", help="reduced grid, under 5 minutes")
    q.add_argument("--figures", help="comma-separated subset of 11,12,13,14,15,scaling (11-13 run together)")
    q.add_argument("--ks", help="comma-separated K values (complex rules) for Figs. 11-13")
    q.add_argument("--rate-sets", help="sets for Fig. 14 (packet rate)")
    q.add_argument("--rate-ks", help="K values for Fig. 14")
    q.add_argument("--seconds", type=float, help="seconds per packet-rate measurement")
    q.add_argument("--repeats", type=int, help="repeats per packet-rate measurement (median reported)")
    q.add_argument("--update-steps", type=int, help="consecutive insertions for Fig. 15")
    q.add_argument("--scaling-sizes", help="rule counts for the scaling test")
    q.add_argument("--shared", metavar="DIR", help="the shared folder with data/classbench (default ../shared)")
    q.add_argument(
        "--results-md",
        metavar="FILE",
        help="where to write the results page (default docs/results.md for a full run without --out, else OUT/results.md)",
    )
    q.add_argument("--no-results-md", action="store_true", help="do not write the results page")
    q.set_defaults(func=run_paper)
    r = bsub.add_parser(
        "rate",
        help="frames/s of the same frames through the hybrid path and through the policy alone in iptables and nft",
    )
    add_policy_args(r, ipv6=True)
    r.add_argument("--target", default="emu", help="fast path of the hybrid (default emu)")
    r.add_argument(
        "--ipv6-share",
        type=float,
        default=0.5,
        metavar="F",
        help="with POLICY --ipv6 V6POLICY: the share of IPv6 frames (default 0.5; -6: every frame IPv6)",
    )
    r.add_argument("--frames", type=int, default=20000, help="frames per path (default 20000)")
    r.add_argument("--seed", type=int, default=1, help="random seed of the frames (default 1)")
    r.add_argument("--trace", metavar="T[.gz]", help="ClassBench header trace to draw headers from")
    r.add_argument("--malformed", type=float, default=0.0, help="share of malformed frames (default 0)")
    r.add_argument(
        "--window", type=int, default=2048, help="frames ahead of the emulated NIC's decisions (default 2048)"
    )
    r.add_argument("--seconds", type=float, default=2.0, help="seconds per path and round of the rate pass (default 2)")
    r.add_argument(
        "--repeats", type=int, default=3, help="rounds of the rate pass, medians reported (default 3; 0: none)"
    )
    r.add_argument("--cpu", type=int, help="CPU the sender is pinned to (default: the last; -1: not pinned)")
    r.add_argument(
        "--sender",
        choices=("packet", "live"),
        default="packet",
        help="packet: AF_PACKET sendmmsg (default); live (--target xdp): xdp_frames by BPF_PROG_TEST_RUN live frames",
    )
    r.add_argument(
        "--prog-repeat",
        type=int,
        default=100,
        help="xdp: BPF_PROG_TEST_RUN runs of each frame for the program's own cost (default 100; 0: not measured)",
    )
    r.add_argument(
        "--prog-frames",
        type=int,
        default=500,
        help="xdp: frames (the first of the bench's) for the program's own cost (default 500; ~40 ms each here)",
    )
    r.add_argument(
        "--established",
        action="store_true",
        help="the trace's TCP/UDP headers as established connections (conntrack entries created first)",
    )
    r.add_argument(
        "--ct-first",
        action="store_true",
        help="with --classbench: an ESTABLISHED,RELATED accept rule before the imported rules",
    )
    r.add_argument(
        "--attack",
        choices=("syn", "udp"),
        help="every frame an attack frame: TCP SYN or UDP from spoofed sources to destinations the policy drops",
    )
    r.add_argument("--attackers", type=int, default=1000, help="spoofed sources of --attack (default 1000)")
    r.add_argument(
        "--blocklist",
        type=int,
        metavar="N",
        help="--attack: networks of a blocklist dropped ahead of the policy, half the attack frames from them"
        " (default 10000; 0: none)",
    )
    r.add_argument(
        "--blocklist-as",
        choices=("ipset", "rules"),
        default="ipset",
        help="the blocklist as one -m set --match-set rule over a hash:net ipset (default) or one -s NET rule each",
    )
    r.add_argument(
        "--blocklist-share",
        type=float,
        default=0.5,
        help="--attack: share of the attack frames from blocklisted sources (default 0.5)",
    )
    r.add_argument(
        "--legit",
        metavar="PROTO:PORT",
        help="--attack: the legitimate connections' protocol and port (default: a new flow the policy accepts)",
    )
    r.add_argument(
        "--legit-connections",
        type=int,
        default=20,
        help="--attack: legitimate connections per path, run under the flood (default 20)",
    )
    r.add_argument(
        "--legit-timeout",
        type=float,
        default=5.0,
        help="--attack: seconds a legitimate connection's connect or read may take (default 5)",
    )
    r.add_argument(
        "--legit-queue",
        type=float,
        metavar="SECONDS",
        help="--attack on emu: the flood's queue ahead of the NIC while the legitimate connections run, in seconds of "
        "the NIC's rate in the correctness pass (default 0.25: tools/bench/attack.LEGIT_QUEUE_S; 0: --window frames)",
    )
    r.add_argument("--strategy", choices=STRATEGIES, metavar="STRATEGY", help="software strategy: %(choices)s")
    r.add_argument("--mode", choices=MODES, metavar="MODE", help="shunting mode: %(choices)s")
    r.add_argument("--json", action="store_true", help="the full report as one JSON object")
    r.set_defaults(func=run_rate)
    c = bsub.add_parser(
        "churn",
        help="a deployed policy under traffic while iptables inserts and deletes single-source bans at given rates",
    )
    add_policy_args(c)
    c.add_argument("--target", default="emu", choices=("emu", "xdp"), help="fast path (default emu)")
    c.add_argument("--rates", default="1,10,100", help="changes per second, one window each (default 1,10,100)")
    c.add_argument("--seconds", type=float, default=60.0, help="seconds per rate (default 60)")
    c.add_argument("--live-bans", type=int, default=4, help="bans standing at once before the oldest goes (default 4)")
    c.add_argument("--frames", type=int, default=2000, help="distinct frames the sender cycles through (default 2000)")
    c.add_argument("--strategy", choices=STRATEGIES, metavar="STRATEGY", help="software strategy: %(choices)s")
    c.add_argument("--mode", choices=MODES, metavar="MODE", help="shunting mode: %(choices)s")
    c.add_argument(
        "--ct-first",
        action="store_true",
        help="with --classbench: an ESTABLISHED,RELATED accept rule before the imported rules",
    )
    c.add_argument("--json", action="store_true", help="one JSON object per rate, one per line")
    c.set_defaults(func=run_churn)
    o = bsub.add_parser(
        "optimize",
        help="the same frames through a policy and through its `hypafilter optimize` rewrite, each alone in the kernel",
    )
    o.add_argument("policy", nargs="?", metavar="POLICY", help="iptables-save file or plain rule file")
    o.add_argument("--classbench", metavar="FILTERS", help="ClassBench filter set (instead of POLICY)")
    o.add_argument(
        "-6",
        dest="family6",
        action="store_true",
        help="POLICY is an ip6tables policy, or the ClassBench set mapped into IPv6 (docs/ipv6.md) with the trace's "
        "headers drawn inside their filters' mapped prefixes; both loaded with ip6tables-nft, IPv6 frames",
    )
    o.add_argument("--policy", dest="cb_policy", choices=("ACCEPT", "DROP"), default="DROP", help="chain policy")
    o.add_argument("--actions", choices=("accept", "alternate"), default="alternate", help="rule actions")
    o.add_argument("--trace", metavar="T[.gz]", required=True, help="ClassBench header trace: the frames sent")
    o.add_argument("--frames", type=int, default=20000, help="distinct frames of the rate runs (default 20000)")
    o.add_argument("--probes", type=int, default=5000, help="trace headers sent once each for verdicts (default 5000)")
    o.add_argument("--seconds", type=float, default=2.0, help="seconds per rate run (default 2)")
    o.add_argument("--repeats", type=int, default=3, help="rate runs of each (median reported; default 3)")
    o.add_argument("--binth", type=int, default=8, help="leaf size (default 8)")
    o.add_argument("--max-expansion", type=float, default=4.0, help="expansion bound (default 4.0)")
    o.add_argument("--min-segment", type=int, default=16, help="shortest run made into a tree (default 16)")
    o.add_argument("--seed", type=int, default=1, help="random seed of the probes (default 1)")
    o.add_argument(
        "--backend",
        choices=("nft", "legacy"),
        default="nft",
        help="iptables back end both are loaded with (default nft: iptables-nft; legacy: x_tables)",
    )
    o.add_argument(
        "--k0",
        metavar="STRATEGY",
        choices=STRATEGIES,
        help="instead of optimize's rewrite: the hybrid's k = 0 path of STRATEGY (the chains compile writes, FORWARD "
        "jumping to MAIN, every frame unmarked: k = 0), e.g. tree against interval (docs/optimize.md)",
    )
    o.add_argument(
        "--peers",
        action="store_true",
        help="also the policy in nft (iptables-restore-translate), as `nft -o` rewrites it and as nft verdict maps "
        "(header rules only; nft back end)",
    )
    o.add_argument("--json", action="store_true", help="the report as one JSON object")
    o.set_defaults(func=run_optimize)
    x = bsub.add_parser("xdp-cost", help="per-frame cost (BPF_PROG_TEST_RUN) and verifier figures of the XDP fast path")
    add_policy_args(x, ipv6=True)
    x.add_argument(
        "--ipv6-share",
        type=float,
        default=0.5,
        help="with POLICY --ipv6 V6POLICY: the share of IPv6 frames (default 0.5; -6: every frame IPv6)",
    )
    x.add_argument("--frames", type=int, default=2000, help="distinct frames (default 2000)")
    x.add_argument("--repeat", type=int, default=100, help="runs of each frame (default 100)")
    x.add_argument("--seed", type=int, default=1, help="random seed of the frames (default 1)")
    x.add_argument("--trace", metavar="T[.gz]", help="ClassBench header trace to draw headers from")
    x.add_argument("--mode", choices=MODES, metavar="MODE", help="shunting mode: %(choices)s")
    x.add_argument("--words", type=int, default=0, help="a program with this many vector words (default: the plan's)")
    x.add_argument("--all-fields", action="store_true", help="a program that looks up every field")
    x.add_argument(
        "--update-buffer",
        type=int,
        metavar="D",
        help="update-buffer slots of the program (default: the configuration's update_buffer)",
    )
    x.add_argument(
        "--buffer-slots",
        type=int,
        default=0,
        metavar="K",
        help="K of the policy's rules left out of the static matcher and decided by buffer slots (default 0)",
    )
    x.add_argument(
        "--buffer-at",
        choices=("spread", "top"),
        default="spread",
        help="which rules go to the buffer: evenly spaced, or the first K (every frame scans all K slots)",
    )
    x.add_argument(
        "--established",
        action="store_true",
        help="the trace's TCP/UDP headers as established connections (as bench rate's: conntrack entries created in "
        "the test run's namespace, the lookup on)",
    )
    x.add_argument(
        "--ct-first",
        action="store_true",
        help="with --classbench: an ESTABLISHED,RELATED accept rule before the imported rules",
    )
    x.add_argument(
        "--lease",
        choices=("off", "armed", "expired"),
        default="off",
        help="the policy sync lease word: disarmed (default), armed (the clock read per frame) or expired",
    )
    x.set_defaults(func=run_xdp_cost)


def run_optimize(args: argparse.Namespace) -> int:
    from hypafilter.cli.optimize import policy_text
    from hypafilter.optimize.emit import optimize
    from hypafilter.optimize.tree import Params
    from hypafilter.tools.bench import optimize as bench
    from hypafilter.tools.classbench import read_filters, read_trace

    text, name = policy_text(args)
    family = 6 if args.family6 else 4
    if args.k0 and family == 6:
        raise HypafilterError("--k0 is the IPv4 hybrid's k = 0 path: not with -6")
    if args.k0:
        res, summary = bench.k0_program(text, name, args.k0, args.min_segment)
    else:
        res = optimize(
            text,
            name,
            Params(binth=args.binth, max_expansion=args.max_expansion),
            min_segment=args.min_segment,
            family=family,
        )
        summary = res.summary()
    trace = read_trace(args.trace)
    if family == 6:
        rows = bench.trace_rows6(text, trace[: args.frames])
    else:
        rows = bench.trace_rows(trace[: args.frames])
    report = {"policy": name, "trace": args.trace, **summary}
    if args.classbench and not args.k0 and family == 6:
        report.update(bench.path_stats6(res, rows[:5000]))
    elif args.classbench and not args.k0:
        f = read_filters(args.classbench)
        report.update(bench.path_stats(res, f[:, [0, 2, 4, 6]], f[:, [1, 3, 5, 7]], rows[:5000]))
    log = (lambda m: print(m, file=sys.stderr)) if args.json else print
    report.update(
        bench.run(
            text,
            res,
            rows,
            args.seconds,
            args.repeats,
            args.probes,
            args.seed,
            args.backend,
            args.peers,
            log=log,
            family=family,
        )
    )
    report["command"] = "hypafilter " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    if args.json:
        print(json.dumps(report))
    else:
        for k, v in report.items():
            print(f"{k}: {v}")
    peers_bad = any(v for k, v in report.items() if k.endswith("_mismatches") and k != "counter_mismatches")
    return 1 if report["mismatches"] or report["counter_mismatches"] or peers_bad else 0


def run_rate(args: argparse.Namespace) -> int:
    from hypafilter.tools.bench.attack import parse_legit
    from hypafilter.tools.bench.rate import FIELDS, rate

    cfg = load_config(args)
    cfg.target = "xdp"  # the program measured is the xdp target's: its set slots (docs/sets.md) included
    if args.ct_first and not args.classbench:
        raise HypafilterError("--ct-first needs --classbench (a policy file states its own conntrack rule)")
    nft_policy = None
    v6, v6_headers, v6_share = None, None, 0.0
    nft_v6 = None
    if args.family6 or args.ipv6:
        policy, v6, v6_headers, nft_v6 = _rate_ipv6(args, cfg, sets=True)
        if args.classbench and args.complex and not args.family6:
            nft_policy = _classbench(args, cfg, 0)  # as below: the IPv4 side's nft path without the string match
        v6_share = 1.0 if args.family6 else args.ipv6_share
        if not 0 < v6_share <= 1:
            raise HypafilterError("--ipv6-share: a share in (0, 1]")
    elif args.classbench:
        policy = _classbench(args, cfg, args.complex)
        if args.complex:
            # nft has no string match: its path loads the same rules without the complex rules' string match
            # (rate.rate compares it only on frames whose payload the string cannot match).
            nft_policy = _classbench(args, cfg, 0)
    else:
        policy = load_policy(args, cfg)
    report = rate(
        policy,
        cfg,
        target=args.target,
        frames=args.frames,
        window=args.window,
        seconds=args.seconds,
        repeats=args.repeats,
        cpu=args.cpu,
        established=args.established,
        attack=args.attack,
        attackers=args.attackers,
        blocklist=args.blocklist,
        blocklist_as=args.blocklist_as,
        blocklist_share=args.blocklist_share,
        legit=parse_legit(args.legit),
        legit_connections=args.legit_connections,
        legit_timeout=args.legit_timeout,
        **({"legit_queue": args.legit_queue} if args.legit_queue is not None else {}),
        prog_repeat=args.prog_repeat,
        prog_frames=args.prog_frames,
        sender=args.sender,
        nft_policy=nft_policy,
        nft_v6=nft_v6,
        v6=v6,
        v6_frames=v6_share,
        v6_headers=v6_headers,
        **frame_options(args),
        log=progress(args, quiet=args.json),
    )
    report["command"] = "hypafilter " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    print(json.dumps(report if args.json else {k: report[k] for k in FIELDS}))
    if not args.json:
        print(f"command: {report['command']}", file=sys.stderr)
    return 1 if report["mismatches"] else 0


def _rate_ipv6(args: argparse.Namespace, cfg, sets: bool = False):
    """bench rate's IPv6 side (docs/ipv6.md "bench rate with IPv6"): (the IPv4 policy, the IPv6 policy as deploy takes
    it, the trace's headers mapped into IPv6 or None, the IPv6 policy the nft path loads when it is not that one:
    `-6 --classbench --complex N` without the complex rules' string match, else None). `-6 V6POLICY`: the IPv4 side
    is the empty policy (every base chain ACCEPT; no IPv4 frame is sent); `-6 --classbench F`: the filter set mapped
    into IPv6 as the analysis benchmark maps it (tools.classbench6), and with --trace its trace mapped beside it;
    `POLICY --ipv6 V6POLICY`: both families' frames. `sets`: the IPv6 policy's -m set matches read the sets of --ipsets FILE (or the firewall's live
    ones), inet6 sets as set slots of the IPv6 plan (docs/sets.md "IPv6 sets"); with -6 the empty IPv4 side carries
    the --ipsets text, which the bench creates in the lab's firewall (as deploy -6 and verify -6 do). `--ct-first`
    (`-6 --classbench` only): the mapped set with the ESTABLISHED,RELATED accept first, as the IPv4 import has it; its
    trace is mapped beside the set without that rule (the trace names its filters by their 0-based index)."""
    from hypafilter.iptables.document import parse_policy
    from hypafilter.netfilter import ip6

    if args.ct_first and not (args.family6 and args.classbench):
        raise HypafilterError("--ct-first with IPv6 is -6 --classbench's: not with --ipv6 or an ip6tables policy file")
    headers, text_nft = None, None
    if args.family6:
        if args.classbench:
            from hypafilter.tools.classbench import classbench_policy_text
            from hypafilter.tools.classbench6 import v6_policy_text

            def mapped(complex_rules: int) -> str:
                return v6_policy_text(
                    classbench_policy_text(
                        args.classbench,
                        complex_rules=complex_rules,
                        policy=args.cb_policy,
                        actions=args.actions,
                        deterministic=args.deterministic,
                    )
                )

            text = mapped(args.complex)
            if args.complex:  # the same rules without the string match (the mapping draws the same prefixes)
                text_nft = ct_first_text(mapped(0), args.chain) if args.ct_first else mapped(0)
            source = f"{args.classbench} (mapped into IPv6)"
            if args.trace:
                import random

                from hypafilter.tools.classbench import read_trace as read_rows
                from hypafilter.tools.classbench6 import v6_trace

                rows = read_rows(args.trace).tolist()
                if len(rows) > args.frames:
                    rows = [rows[i] for i in sorted(random.Random(args.seed).sample(range(len(rows)), args.frames))]
                headers = v6_trace(text, rows, args.seed)
            if args.ct_first:
                text = ct_first_text(text, args.chain)
        elif args.policy:
            from hypafilter.iptables.document import read_policy_text

            text, source = read_policy_text(args.policy), args.policy
            if args.trace:
                raise HypafilterError(
                    "-6 --trace: a ClassBench trace maps into IPv6 beside its filter set (--classbench)"
                )
        else:
            raise HypafilterError("-6: give an ip6tables policy (V6POLICY) or --classbench FILTERS")
        policy = parse_policy(
            "*filter\n:INPUT ACCEPT [0:0]\n:FORWARD ACCEPT [0:0]\n:OUTPUT ACCEPT [0:0]\nCOMMIT\n",
            filename="(no IPv4 policy: -6)",
            base_chain=args.chain,
            config=cfg,
            allow_empty=True,
        )
    else:
        from hypafilter.iptables.document import read_policy_text

        policy = _classbench(args, cfg, args.complex) if args.classbench else load_policy(args, cfg)
        text, source = read_policy_text(args.ipv6), args.ipv6
    import dataclasses

    env = set_env(args, cfg) if sets else None
    ir = parse_policy(text, filename=source, base_chain=args.chain, config=cfg, allow_empty=True, family=6, sets=env)
    # checked by ip6tables-restore --test in a scratch namespace (with the sets it reads)
    v6 = ip6.parse(text, source, args.chain, sets_text=env.text if env is not None else "")
    if args.family6 and env is not None and env.text and getattr(args, "ipsets", None):
        policy = dataclasses.replace(policy, ipsets_text=env.text, ipsets_file=args.ipsets)
    nft_v6 = None
    if text_nft is not None:
        ir0 = parse_policy(text_nft, filename=source, base_chain=args.chain, config=cfg, allow_empty=True, family=6)
        nft_v6 = dataclasses.replace(v6, text=text_nft, ir=ir0)
    return policy, dataclasses.replace(v6, ir=ir), headers, nft_v6


def run_churn(args: argparse.Namespace) -> int:
    from hypafilter.ops import deploy
    from hypafilter.tools.bench.churn import FIELDS, churn

    cfg = load_config(args)
    if args.target:
        cfg.target = args.target
    cfg = deploy.site_config(cfg)
    policy = _classbench(args, cfg, args.complex) if args.classbench else load_policy(args, cfg)
    rates = tuple(float(r) for r in args.rates.split(","))
    results = churn(
        policy,
        cfg,
        target=args.target,
        rates=rates,
        seconds=args.seconds,
        live_bans=args.live_bans,
        frames=args.frames,
        log=progress(args, quiet=args.json),
    )
    command = "hypafilter " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    for r in results:
        r["command"] = command
        print(json.dumps(r if args.json else {k: r[k] for k in FIELDS}))
    if not args.json:
        print(f"command: {command}", file=sys.stderr)
    return 1 if any(r["mismatches"] for r in results) else 0


def _classbench(args: argparse.Namespace, cfg, complex_rules: int):
    """The --classbench import with `complex_rules` complex rules, with --ct-first its conntrack rule first."""
    from hypafilter.iptables.document import parse_policy
    from hypafilter.tools.classbench import classbench_policy_text

    text = classbench_policy_text(
        args.classbench,
        complex_rules=complex_rules,
        policy=args.cb_policy,
        actions=args.actions,
        deterministic=args.deterministic,
    )
    if args.ct_first:
        text = ct_first_text(text, args.chain)
    return parse_policy(text, filename=args.classbench, base_chain=args.chain, config=cfg, allow_empty=args.allow_empty)


def ct_first_text(text: str, chain: str) -> str:
    """A ClassBench import's restore text (IPv4, or mapped into IPv6) with an ESTABLISHED,RELATED accept rule before
    its rules (--ct-first)."""
    lines = text.splitlines(keepends=True)
    at = next(i for i, ln in enumerate(lines) if ln.startswith(("-A ", "COMMIT")))
    lines.insert(at, f"-A {chain} -m conntrack --ctstate ESTABLISHED,RELATED -j ACCEPT\n")
    return "".join(lines)


def run_xdp_cost(args: argparse.Namespace) -> int:
    from hypafilter.analysis.plan import build_plan
    from hypafilter.tools.bench.xdpcost import xdp_cost

    cfg = load_config(args)
    cfg.target = "xdp"  # the program measured is the xdp target's: its set slots (docs/sets.md) included
    if args.ct_first and not args.classbench:
        raise HypafilterError("--ct-first needs --classbench (a policy file states its own conntrack rule)")
    if args.established and not args.trace:
        raise HypafilterError("--established needs --trace (its TCP and UDP headers are the flows)")
    v6 = None
    if args.family6 or args.ipv6:
        if args.established or args.buffer_slots:
            raise HypafilterError("--established and --buffer-slots measure IPv4 frames: not with -6 or --ipv6")
        policy, v6, v6_headers, _ = _rate_ipv6(args, cfg, sets=True)
        v6_share = 1.0 if args.family6 else args.ipv6_share
        if not 0 < v6_share <= 1:
            raise HypafilterError("--ipv6-share: a share in (0, 1]")
    else:
        policy = _classbench(args, cfg, args.complex) if args.ct_first else load_policy(args, cfg)
    if args.frames < 1 or args.repeat < 1:
        raise HypafilterError("--frames and --repeat must be at least 1")
    plan = build_plan(policy, cfg, mode=args.mode)
    if v6 is not None:  # the IPv6 side's table set in the program (docs/ipv6.md "## xdp"), as deploy builds it
        from hypafilter.targets.xdp.v6 import plan6_for

        cfg.xdp_ipv6 = True
        plan6, why = plan6_for(v6, cfg, plan)
        if plan6 is None:
            raise HypafilterError(f"the IPv6 policy cannot go into the XDP program: {why}")
        v6_args = {"plan6": plan6, "v6": v6, "v6_share": v6_share, "v6_headers": v6_headers}
    else:
        v6_args = {}
    options = (
        "frames",
        "repeat",
        "seed",
        "trace",
        "words",
        "all_fields",
        "lease",
    )  # xdp_cost's keywords, as the flags name them
    extra = {}
    if args.established:
        from hypafilter.targets.xdp.target import control_of
        from hypafilter.tools.bench.rate import established_probes

        probes, flows = established_probes(policy, args.trace, args.frames, args.seed)
        control = control_of(cfg.unfilterable, cfg.nic_mode, plan.miss_shunt)
        extra = {"frame_list": [p.frame for p in probes], "flows": flows, "control": control}
    depth = cfg.update_buffer if args.update_buffer is None else args.update_buffer
    if depth < 0:
        raise HypafilterError("--update-buffer must be at least 0")
    if args.buffer_slots:
        from hypafilter.tools.bench.xdpcost import buffer_view

        plan = buffer_view(plan, args.buffer_slots, depth, args.buffer_at)
    if v6 is not None and args.family6:
        options = tuple(o for o in options if o != "trace")  # -6 --trace: the trace's headers mapped into IPv6
    report = xdp_cost(plan, policy, **{k: getattr(args, k) for k in options}, **extra, depth=depth, **v6_args)
    report["command"] = "hypafilter " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    print(json.dumps(report))
    return 0


def _list(s: str | None, conv=str) -> tuple | None:
    return None if s is None else tuple(conv(x) for x in s.split(",") if x.strip())


def grid_from_args(args: argparse.Namespace):
    from hypafilter.tools.bench.paper import Grid

    g = Grid.quick() if args.quick else Grid.full()
    changes = {}
    for attr, val in (
        ("sets", _list(args.sets)),
        ("ks", _list(args.ks, int)),
        ("rate_sets", _list(args.rate_sets)),
        ("rate_ks", _list(args.rate_ks, int)),
        ("rate_seconds", args.seconds),
        ("repeats", args.repeats),
        ("update_steps", args.update_steps),
        ("scaling_sizes", _list(args.scaling_sizes, int)),
        ("figures", _list(args.figures)),
    ):
        if val is not None:
            changes[attr] = val
    if "sets" in changes and args.quick and not args.rate_sets:
        changes["rate_sets"] = changes["sets"][:1]
    g = replace(g, **changes)
    bad = set(g.figures) - {"11", "12", "13", "14", "15", "scaling"}
    if bad:
        raise HypafilterError(f"--figures: unknown figure(s) {', '.join(sorted(bad))}")
    return g


def _grid_name(grid) -> str:
    """'full' or 'quick' only when the grid is exactly that preset; anything narrowed by options is 'custom'."""
    from hypafilter.tools.bench import paper

    for name in ("full", "quick"):
        if grid == getattr(paper.Grid, name)():
            return name
    return "custom (reduced)"


def run_paper(args: argparse.Namespace) -> int:
    from hypafilter.config import Config
    from hypafilter.tools.bench import paper, plots, report

    grid = grid_from_args(args)
    shared = Path(args.shared) if args.shared else ROOT.parent / "shared"
    if not (shared / "data" / "classbench").is_dir():
        raise HypafilterError(f"{shared}/data/classbench not found (give --shared DIR)")
    figs = set(grid.figures)
    needed = set()
    if figs & {"11", "12", "13"}:
        needed |= set(grid.sets)
    if "14" in figs:
        needed |= set(grid.rate_sets)
    if "15" in figs:
        needed |= set(grid.update_sets)
    for name in sorted(needed):
        paper.set_paths(shared, name)  # fails before anything is written
    out = Path(args.out) if args.out else ROOT / "build" / ("bench-paper-quick" if args.quick else "bench-paper")
    out.mkdir(parents=True, exist_ok=True)
    build = ROOT / "build" / "bench-work"  # frames, scaled sets, emulator builds: never under docs/
    build.mkdir(parents=True, exist_ok=True)
    config = Config()
    command = (
        "hypafilter " + " ".join(shlex.quote(a) for a in sys.argv[1:])
        if sys.argv[0].endswith("hypafilter")
        else "hypafilter bench paper " + " ".join(shlex.quote(a) for a in _argv_of(args))
    )

    def log(msg: str) -> None:
        print(msg, flush=True)

    res = paper.Results()
    t_start = time.perf_counter()
    steps = [
        ("fig11-13", bool(figs & {"11", "12", "13"}), lambda: paper.analytic(grid, shared, config, log)),
        ("fig14", "14" in figs, lambda: {"fig14": paper.rates(grid, shared, config, build, log)}),
        ("fig15", "15" in figs, lambda: {"fig15": paper.updates(grid, shared, config, build, log)}),
        ("scaling", "scaling" in figs, lambda: {"scaling": paper.scaling(grid, shared, config, build, log)}),
    ]
    for name, wanted, fn in steps:
        if not wanted:
            continue
        log(f"{name}:")
        t0 = time.perf_counter()
        res.rows.update(fn())
        res.seconds[name] = time.perf_counter() - t0
        log(f"{name}: {res.seconds[name]:.1f} s")
    wall = time.perf_counter() - t_start

    for key, rows in res.rows.items():
        report.write_csv(out / f"{report.CSV_NAMES[key]}.csv", rows)
        getattr(plots, key)(rows, out / f"{key}.png")
    meta = {
        "command": command,
        "wall_seconds": wall,
        "step_seconds": res.seconds,
        "grid_name": _grid_name(grid),
        "grid": {k: (",".join(map(str, v)) if isinstance(v, tuple) else v) for k, v in asdict(grid).items()},
        "finished": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "machine": report.machine(),
        "notes": res.notes,
    }
    (out / "run.json").write_text(json.dumps(meta, indent=2) + "\n")
    log(f"wrote {', '.join(sorted(p.name for p in out.glob('*.csv')))} and plots to {out}")
    if not args.no_results_md:
        # The committed docs/results.md is the full default run's page; a --quick or --out run writes its own
        # page beside its output unless --results-md names a file.
        default_md = ROOT / "docs" / "results.md" if not (args.quick or args.out) else out / "results.md"
        md = Path(args.results_md) if args.results_md else default_md
        md.parent.mkdir(parents=True, exist_ok=True)
        md.write_text(report.render(out.resolve(), md.resolve(), meta, res.rows) + report.kept(md))
        log(f"wrote {md}")
    log(f"command: {command}\nwall time: {wall:.1f} s")
    return 0


def _argv_of(args: argparse.Namespace) -> list[str]:
    """The options of this run as a command line (when called through main(argv) rather than the script)."""
    out = []
    for opt in (
        "sets",
        "out",
        "figures",
        "ks",
        "rate_sets",
        "rate_ks",
        "seconds",
        "repeats",
        "update_steps",
        "scaling_sizes",
        "shared",
        "results_md",
    ):
        v = getattr(args, opt)
        if v is not None:
            out += [f"--{opt.replace('_', '-')}", str(v)]
    if args.quick:
        out.append("--quick")
    return out
