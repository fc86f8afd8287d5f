"""`hypafilter verify`: the same frames through the hybrid path and the original policy alone; verdicts compared."""

from __future__ import annotations

import argparse
import json
import sys

from hypafilter.cli.common import (
    add_ipv6_default_arg,
    add_policy_args,
    frame_options,
    load_config,
    load_ipv6,
    load_policy_v4,
    progress,
)
from hypafilter.config import MODES, STRATEGIES
from hypafilter.errors import HypafilterError


def kinds_arg(text: str) -> tuple[str, ...]:
    """`--kinds`: comma-separated frame kinds, or `default` (the malformed kinds) or `all` (every kind)."""
    from hypafilter.ops.verify import FRAME_KINDS, MALFORMED_KINDS

    named = {"default": MALFORMED_KINDS, "all": FRAME_KINDS}
    out: list[str] = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        out += named.get(part, (part,))
    if "normal" in out:
        # The report counts well-formed frames under "normal"; they are always sent (1 - --malformed of them).
        raise argparse.ArgumentTypeError(
            "'normal' is not a malformed kind: well-formed frames are always sent (the share 1 - --malformed); "
            f"--kinds chooses the malformed ones from {', '.join(FRAME_KINDS)}"
        )
    unknown = sorted(set(out) - set(FRAME_KINDS))
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown frame kinds {', '.join(unknown)} (choose from {', '.join(FRAME_KINDS)})"
        )
    if not out:
        raise argparse.ArgumentTypeError("no frame kind given (names, `default` or `all`)")
    return tuple(dict.fromkeys(out))


def cmd_verify(args: argparse.Namespace) -> int:
    from hypafilter.ops import deploy
    from hypafilter.ops.connections import ConnectionSpec
    from hypafilter.ops.verify import MALFORMED_KINDS, Six, verify

    conns = None
    if args.connections is not None:
        given = {"nbytes": args.connection_bytes} if args.connection_bytes is not None else {}
        if args.connection_kinds is not None:
            given["kinds"] = args.connection_kinds
        conns = ConnectionSpec(args.connections, **given)
    elif args.connection_bytes is not None or args.connection_kinds is not None:
        raise HypafilterError("--connection-bytes and --connection-kinds need --connections")
    cfg = load_config(args)
    if args.target:
        cfg.target = args.target
    cfg = deploy.site_config(cfg)  # the policy's interface checks meet the lab's interfaces
    live6 = None
    if args.live:
        # the deployment's policy as the firewall's live ruleset has it now (the oracle gets the same rules)
        from hypafilter import netns
        from hypafilter.ops.policysync import live

        if args.policy or args.classbench:
            raise HypafilterError("--live takes the policy from the firewall's live ruleset: give no POLICY")
        deploy.configure_from_state()
        st = deploy.read_state()
        if not st:
            raise HypafilterError("--live: nothing is deployed")
        cfg = deploy.site_config(deploy.deployed_config(st))
        text = netns.run(["iptables-save", "-t", cfg.table], st["site"].get("netns"))
        policy = live.live_policy(text, st, cfg) if args.unfollowed else live.followed(text, st, cfg)
        live6 = _live_six(st, args)
    else:
        if args.unfollowed:
            raise HypafilterError("--unfollowed needs --live")
        policy = load_policy_v4(args, cfg, progress(args, quiet=args.json))
    v6 = load_ipv6(args, cfg, policy.base_chain)
    six = live6
    if v6 is not None or args.ipv6_default:
        if args.live:
            raise HypafilterError("--live takes the IPv6 side from the firewall's ip6tables too: give no IPv6 policy")
        six = Six(v6, packets=args.packets, ipv4=not args.family6)
    log = progress(args, quiet=args.json)
    report = verify(
        policy,
        cfg,
        packets=args.packets,
        kinds=args.kinds or MALFORMED_KINDS,
        connections=conns,
        live=args.live,
        six=six,
        log=log,
        cover=args.cover,
        attack=args.attack or (),
        attack_share=args.attack_share if args.attack_share is not None else (0.5 if args.attack else 0.0),
        **frame_options(args),
    )
    conn = report.get("connections")
    if args.json:
        print(json.dumps(report))
    else:
        keep = ("packets", "mismatches", "shunted", "hw_forwarded", "hw_dropped", "delivered_oracle", "duplicates")
        summary = {k: report[k] for k in keep}
        obs = report["observers"]
        if obs["rules"]:  # the observing rules' counters, compared with the oracle's (ops/observers.py)
            keep = ("rules", "mismatches", "matched_oracle", "matched_hybrid", "not_comparable")
            summary["observers"] = {k: obs[k] for k in keep}
        if "ipv6" in report:
            keep = ("packets", "mismatches", "delivered_oracle", "mode")
            summary["ipv6"] = {k: report["ipv6"][k] for k in keep}
        print(json.dumps(summary))
        for ex in report["examples"]:
            print(f"mismatch: {json.dumps(ex)}", file=sys.stderr)
        for ex in obs["examples"]:
            print(f"observer mismatch: {json.dumps(ex)}", file=sys.stderr)
        conn6 = (report.get("ipv6") or {}).get("connections")
        if conn6:
            keep = ("connections", "bytes", "mismatches", "completed_oracle", "by_kind")
            print(json.dumps({"ipv6_connections": {k: conn6[k] for k in keep}}))
            for ex in conn6["examples"]:
                print(f"IPv6 connection mismatch: {json.dumps(ex)}", file=sys.stderr)
        if conn:
            keep = ("connections", "bytes", "mismatches", "completed_oracle", "hw_share", "by_kind")
            print(json.dumps({"connections": {k: conn[k] for k in keep}}))
            for ex in conn["examples"]:
                print(f"connection mismatch: {json.dumps(ex)}", file=sys.stderr)
    lim = report.get("limited", {})
    if lim.get("rules") and not args.json:
        print(json.dumps({"limited": {k: lim[k] for k in ("rules", "mismatches", "seconds")}}))
        for ex in lim["examples"]:
            print(f"limited rule mismatch: {json.dumps(ex)}", file=sys.stderr)
    bad = report["mismatches"] or report["observers"]["mismatches"] or lim.get("mismatches")
    conn6 = (report.get("ipv6") or {}).get("connections")
    return 1 if bad or (conn and conn["mismatches"]) or (conn6 and conn6["mismatches"]) else 0


def _live_six(st: dict, args):
    """verify --live of a deployment with an IPv6 side (docs/ipv6.md "Following ip6tables"): the IPv6 policy is
    ip6tables' live ruleset, which the deployment must follow (unless --unfollowed); None in mode kernel."""
    from hypafilter import netns
    from hypafilter.ops.policysync import follow6
    from hypafilter.ops.verify import Six

    six = st.get("ipv6") or {"mode": "kernel"}
    if six.get("mode", "kernel") == "kernel":
        return None
    text = netns.run(["ip6tables-save"], st["site"].get("netns"))
    if not args.unfollowed and not follow6.unchanged(text, six):
        raise HypafilterError(
            "the deployment has not followed ip6tables' live ruleset (the policy sync service has not applied it yet)"
        )
    return Six(follow6.live_v6(text, st), packets=args.packets)


def register(sub) -> None:
    p = sub.add_parser("verify", help="compare the hybrid path with the original policy alone (the kernel as oracle)")
    add_policy_args(p, ipv6=True)
    p.add_argument("--trace", metavar="T[.gz]", help="ClassBench header trace to draw headers from")
    p.add_argument(
        "--live",
        action="store_true",
        help="the deployment's policy as the firewall's live ruleset has it now (what fail2ban, ufw, iptables "
        "changed included), instead of POLICY",
    )
    p.add_argument(
        "--unfollowed",
        action="store_true",
        help="with --live: compare even when the deployment has not followed the live ruleset (the policy sync "
        "service down): the hybrid must then still give the live ruleset's verdicts (its lease run out, the fast "
        "path decides nothing)",
    )
    p.add_argument("--packets", type=int, default=1000, help="frames to send (default 1000)")
    p.add_argument("--seed", type=int, default=1, help="random seed (default 1)")
    p.add_argument("--malformed", type=float, default=0.1, help="share of malformed frames (default 0.1)")
    p.add_argument(
        "--cover",
        action="store_true",
        help="send the low and high corner of every rule's ranges first (two frames a rule, in rule order, within "
        "--packets), then the drawn frames",
    )
    p.add_argument(
        "--kinds",
        type=kinds_arg,
        metavar="K[,K...]",
        help="kinds of the malformed frames: names, `default` (the classic malformed kinds) or `all` (also VLAN "
        "VID 0, 802.1ad, QinQ, every fragment kind, bad IPv4 checksums, trailing bytes, link-local group "
        "destinations, unknown ethertypes); see docs/deploy.md",
    )
    p.add_argument(
        "--attack",
        type=lambda text: tuple(k.strip() for k in text.split(",") if k.strip()),
        metavar="SHAPE[,SHAPE...]",
        help="send attack frames too, from spoofed sources to the policy's destinations and ports: syn, ack, rst, "
        "fin (FIN, xmas, null scans), udp, frag (fragments of new flows), icmp_error (quoting flows sent before "
        "or invented ones); their kinds in the report are attack_<shape>",
    )
    p.add_argument(
        "--attack-share",
        type=float,
        metavar="S",
        help="share of the frames that are attack frames (default 0.5 with --attack)",
    )
    p.add_argument(
        "--connections",
        type=int,
        metavar="N",
        help="after the frames, N real connections (TCP and UDP in turn, to the ports the policy names) on both "
        "paths, compared per connection; the report gains `connections` with hw_share",
    )
    p.add_argument(
        "--connection-bytes",
        type=int,
        metavar="B",
        help="payload bytes each way per connection (default 4096, ops.connections.ConnectionSpec)",
    )
    p.add_argument(
        "--connection-kinds",
        type=lambda text: tuple(k.strip() for k in text.split(",") if k.strip()),
        metavar="K[,K]",
        help="kinds of the connections, in turn: tcp, udp or tcp,udp (default)",
    )
    add_ipv6_default_arg(p)
    p.add_argument("--strategy", choices=STRATEGIES, metavar="STRATEGY", help="software strategy: %(choices)s")
    p.add_argument("--mode", choices=MODES, metavar="MODE", help="shunting mode: %(choices)s")
    p.add_argument("--target", choices=("emu", "xdp"), help="fast path (default: the configuration's target, emu)")
    p.add_argument("--json", action="store_true", help="the full report as one JSON object")
    p.set_defaults(func=cmd_verify)
