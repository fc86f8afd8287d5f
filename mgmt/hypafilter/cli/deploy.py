"""`hypafilter deploy|update|undeploy|status`: put a policy on the target, change it, remove it, show it."""

from __future__ import annotations

import argparse
import json
import sys

from hypafilter.cli.common import (
    add_ipv6_default_arg,
    add_policy_args,
    load_config,
    load_ipv6,
    load_policy,
    load_policy_v4,
    progress,
)
from hypafilter.config import MODES, STRATEGIES
from hypafilter.errors import HypafilterError

EXIT_DEGRADED = 1  # deploy/update: committed, but a service the deployment wants did not start (as status: drift)


def _summary(state: dict) -> dict:
    keys = ("policy_hash", "policy_source", "generation", "mode", "strategy", "partition", "main_chain")
    out = {k: state.get(k) for k in keys}
    six = state.get("ipv6") or {"mode": "kernel"}
    out["ipv6"] = {k: six.get(k) for k in ("mode", "source", "rules") if k in six}
    last = (state.get("history") or [{}])[-1]
    out["duration_s"] = last.get("duration_s")
    out["applied_s"] = last.get("applied_s")  # from the start until the new policy held (the rest: tidying up)
    out["steps"] = last.get("steps")
    return out


def cmd_deploy(args: argparse.Namespace) -> int:
    from hypafilter.ops import deploy

    if args.command == "update" and not deploy.read_state():
        raise HypafilterError("nothing is deployed: use `hypafilter deploy`")
    cfg = load_config(args)
    if args.target:
        cfg.target = args.target
    elif args.command == "update":  # the deployed target, whatever the configuration's default
        cfg.target = deploy.read_state().get("target", cfg.target)
    if args.ports:
        if (args.target or cfg.target) != "xdp":
            raise HypafilterError("--ports needs --target xdp")
        deploy.configure_ports(args.ports.split(","), args.netns)
    elif args.command == "update":
        deploy.configure_from_state()
    cfg = deploy.site_config(cfg)  # the policy's interface checks meet the lab's interfaces
    # -6 V6POLICY alone: the IPv4 side is iptables' live ruleset as it is (with a deployment, its deployed IPv4 side
    # as the kernel holds it): only the IPv6 side changes (docs/ipv6.md "An IPv6 policy alone")
    policy = load_policy_v4(args, cfg, progress(args)) if args.family6 else load_policy(args, cfg)
    v6 = load_ipv6(args, cfg, policy.base_chain)
    if args.command == "update" and v6 is None and args.ipv6_default is None:
        # an update without IPv6 arguments keeps the deployed IPv6 side
        from hypafilter.netfilter import ip6

        six = (deploy.read_state() or {}).get("ipv6") or {}
        v6 = ip6.V6Policy.from_state(six) if six.get("mode", "kernel") != "kernel" else None
    if policy.ipsets_file:  # --ipsets: the sets created where the policy is loaded, before it (docs/sets.md)
        from hypafilter.netfilter import ipset

        ipset.restore(deploy.NS_FW, policy.ipsets_text)
    before = deploy.read_state()
    state = deploy.deploy(policy, cfg, target=cfg.target, force=args.force, log=progress(args), v6=v6)
    summary = _summary(state)
    # Nothing changed (the same policy and settings, no drift): say so instead of the old summary as if new.
    summary["changed"] = not before or before.get("generation") != state.get("generation")
    if not summary["changed"]:
        summary["duration_s"], summary["applied_s"], summary["steps"] = 0, 0, {}
    if state.get("degraded"):
        summary["degraded"] = state["degraded"]
    print(json.dumps(summary, indent=None if args.json else 1))
    if state.get("degraded"):
        # deployed and committed, but a service it wants does not run: status shows the drift, and deploy of the
        # same policy tries again (docs/deploy.md, "Services")
        print(f"hypafilter: deployed DEGRADED: {'; '.join(state['degraded'])}", file=sys.stderr)
        return EXIT_DEGRADED
    return 0


def cmd_undeploy(args: argparse.Namespace) -> int:
    from hypafilter.ops import deploy

    deploy.configure_from_state()
    if not deploy.undeploy(log=progress(args)):
        print("hypafilter: nothing deployed", file=sys.stderr)
    return 0


def _fmt_status(st: dict) -> str:
    if not st.get("deployed"):
        return "nothing deployed"
    p = st.get("partition", {})
    lines = [f"DRIFT    {d}" for d in st.get("drift") or []]
    if st.get("busy"):  # deploy.status waited STATUS_WAIT for the lock in vain
        lines.insert(0, "BUSY     a deploy, update or policy sync apply still runs: what follows may be half-way")
    lines += [
        f"policy   {st['policy_source']} (hash {st['policy_hash'][:16]}), generation {st['generation']}",
        f"rules    IPv4 (iptables): {p.get('rules')} ({p.get('simple')} simple, {p.get('complex')} complex), "
        f"{p.get('entries')} hardware entries, {p.get('shunted_entries')} shunted; "
        f"mode {st['mode']}, strategy {st['strategy']}",
        _fmt_ipv6(st.get("ipv6") or {}),
        f"nic      {st['nic'].get('name')} pid {st['nic'].get('pid')}",
    ]
    if st.get("trees"):
        lines.insert(-1, _fmt_trees(st["trees"]))
    nc = st.get("nic_counters") or {}
    if "error" in nc:
        lines.append(f"hardware unreachable: {nc['error']}")
    else:
        lines.append(
            f"hardware in {nc.get('PKTIN')} frames: forwarded {nc.get('CNT_FORWARDED')}, dropped {nc.get('CNT_DROPPED')} "
            f"(of these mirrored to the host {nc.get('CNT_MIRROR')}), "
            f"shunted: may-overrule {nc.get('CNT_SHUNT_OVERRULE')}, policy {nc.get('CNT_SHUNT_POLICY')}, "
            f"unparsed {nc.get('CNT_SHUNT_UNPARSED')}, forced {nc.get('CNT_SHUNT_FORCED')}; "
            f"from host {nc.get('CNT_FROM_HOST')}, fifo drops {nc.get('CNT_FIFO_DROP')}"
        )
    for name, loaded in (st.get("user_chains") or {}).items():
        lines.append(f"user     chain {name} is loaded as {loaded}")
    ss = st.get("shim_stats") or {}
    lines.append("shim     " + ", ".join(f"{k}={v}" for k, v in ss.items() if not isinstance(v, dict)))
    for chain, rules in sorted((st.get("netfilter") or {}).items()):
        if isinstance(rules, list):
            lines.append(f"chain    {chain} (IPv4, iptables): {len(rules)} rules")
            for r in rules:
                if r["packets"]:
                    lines.append(f"  {r['packets']:>8} pkts  {r['rule']}")
    lines.append(_fmt_flowsync(st.get("flowsync") or {}))
    lines.append(_fmt_policysync(st.get("policysync") or {}, st.get("overlay")))
    lines += _fmt_sets(st.get("sets") or {}, (st.get("policysync") or {}).get("sets") or {})
    # a NIC set table too small for its set (NicClient: the slot stays uncertain, its frames go to the host)
    lines += [f"sets     NIC table: {e}" for e in (st.get("tables") or {}).get("set_errors") or []]
    last = (st.get("history") or [{}])[-1]
    lines.append(f"last     {last.get('kind', last.get('result'))} took {last.get('duration_s')}s")
    return "\n".join(lines)


def _fmt_trees(t: dict) -> str:
    """The trees line of `status` (strategy tree, docs/optimize.md): the trees the chains hold, and what the last
    follow kept of the last rebuild's (its changed rules diverted ahead of them)."""
    line = f"trees    {t.get('trees', 0)} interval-chain trees over {t.get('rules_in_trees', 0)} rules"
    if t.get("lazy_trees"):
        line += (
            f", {t['lazy_trees']} kept from the last rebuild with the rules changed since diverted ahead of them"
            f" ({t.get('lazy_changed', 0)} over all of them)"
        )
    k0 = t.get("k0_tree")
    if k0 in ("built", "lazy"):
        line += f"; K0T {k0}" + (f" ({t.get('k0_changed', 0)} changed rules diverted)" if k0 == "lazy" else "")
    elif k0:
        line += f"; K0 stays the live list: {k0}"
    return line


def _fmt_ipv6(six: dict) -> str:
    """The IPv6 line of `status` (docs/ipv6.md): what happens to IPv6 frames, and ip6tables' rules."""
    base = six.get("base_chain", "FORWARD")
    if six.get("error"):
        live = f"ip6tables unreadable: {six['error']}"
    else:
        live = (
            f"ip6tables filter holds {six.get('live_rules')} rules (IPv6), {six.get('live_base_rules')} in {base}, "
            f"{base} policy {six.get('live_base_policy')}"
        )
    mode = six.get("mode", "kernel")
    if mode == "drop":
        what = f"every IPv6 frame DROPPED (--ipv6-default drop: ip6tables {base} policy DROP, no rule)"
    elif mode == "policy":
        n = sum((six.get("rules") or {}).values())
        what = f"IPv6 policy {six.get('source')} ({n} rules, IPv6) decides every IPv6 frame in ip6tables (k = 0)"
        fast = six.get("xdp") or six.get("nic")
        if fast:
            where = "the XDP program" if six.get("xdp") else "the NIC's core"
            what = (
                f"IPv6 policy {six.get('source')} ({n} rules, IPv6) decided in {where} by its "
                f"{fast.get('entries')} entries where it parses the frame, else in ip6tables (k = 0)"
            )
            buf = fast.get("buffer") or {}
            if buf.get("used") or buf.get("invalid"):  # the IPv6 update buffer in use (docs/ipv6.md)
                what += (
                    f", with {buf.get('used', 0)} of {buf.get('depth')} IPv6 update-buffer slots and "
                    f"{len(buf.get('invalid') or ())} entries masked off"
                )
            if six.get("chains"):
                ch = six["chains"]
                what += (
                    f"; shunted frames with their k (> {ch.get('k_base')}) through the interval chains in ip6tables "
                    f"({ch.get('main')}, strategy {ch.get('strategy')})"
                )
    else:
        what = (
            "IPv6 NOT filtered by hypafilter: every IPv6 frame goes to the stack (k = 0) and meets ip6tables as the "
            "operator has it (--ipv6-default kernel)"
        )
    return f"ipv6     {what}; {live}"


def _fmt_flowsync(fs: dict) -> str:
    """The flow sync service's line of `status` (docs/flowsync.md)."""
    if not fs.get("wanted"):
        return f"flowsync not running: {fs.get('reason') or 'not wanted by this deployment'}"
    liberal = fs.get("mode") == "liberal"
    if not fs.get("running"):
        what = "new TCP entries are not marked liberal" if liberal else "the flow cache does not follow conntrack"
        if fs.get("down") and fs["down"] != "is not running":  # its supervisor runs: restarting or starting
            return f"flowsync DOWN: {what}; the service {fs['down']}"
        return f"flowsync DOWN: {what} (deploy again, or undeploy)"
    # the families whose entries it offloads (a status file of an older service does not say: IPv4)
    fams = " and ".join({"ipv4": "IPv4", "ipv6": "IPv6"}.get(f, f) for f in fs.get("families", ()))
    fams = f" ({fams} only)" if fams and " and " not in fams else f" ({fams})" if fams else ""
    if liberal:
        return (
            f"flowsync pid {fs.get('pid')} (liberal marks): {fs.get('offloaded')} TCP flows held{fams}, "
            f"{fs.get('liberal')} entries marked liberal; sync lag p50 {fs.get('lag_p50_ms')} ms, "
            f"max {fs.get('lag_max_ms')} ms"
        )
    return (
        f"flowsync pid {fs.get('pid')}: {fs.get('offloaded')} flows offloaded{fams}, occupancy {fs.get('occupancy')}, "
        f"{fs.get('waiting')} waiting for a way (set full); "
        f"inserts {fs.get('inserts')}, deletes {fs.get('deletes')}, evictions {fs.get('evictions')}, "
        f"insert failures (set full) {fs.get('insert_failures')}, timeout refreshes {fs.get('refreshes')}; "
        f"sync lag p50 {fs.get('lag_p50_ms')} ms, max {fs.get('lag_max_ms')} ms"
    ) + _fmt_members(fs.get("members"))


def _fmt_members(m: dict | None) -> str:
    """[ctm] Where the NIC's conntrack membership structure stands (ops/flowsync/members.py `Members.phase`): the
    service is ready before a load's clear is over; until COMPLETE a miss is not NEW (it goes to conntrack)."""
    if not m:
        return ""
    phase = m.get("phase")
    if phase == "complete":
        six = ", IPv4 and IPv6" if "ipv6" in (m.get("families") or ()) else ""
        return f"; new flows decided: membership COMPLETE ({m.get('entries')} entries{six})"
    what = {
        "clearing": "clearing the membership structure",
        "loading": f"loading the membership structure ({m.get('pending')} entries pending)",
    }.get(phase, "membership loaded, COMPLETE not renewed (held, or behind conntrack's events)")
    return f"; new flows NOT decided yet: {what}; misses go to conntrack"


def _fmt_sets(sets: dict, follow: dict) -> list[str]:
    """The set lines of `status` (docs/sets.md): the slots in the fast path and how the kernel's sets are followed,
    and each set match left to netfilter with why."""
    if not sets.get("slots") and not sets.get("complex"):
        return []
    lines = []
    if sets.get("slots"):
        how = "following the kernel's sets" if follow.get("following") else "NOT following the kernel's sets"
        if follow.get("error"):
            how += f" ({follow['error']}): frames leave to the stack"
        lag = follow.get("lag_release_ms") or {}
        lines.append(
            f"sets     {len(sets['slots'])} slot(s) in the fast path: {'; '.join(sets['slots'])}; {how}; "
            f"{follow.get('syncs', 0)} syncs, release lag p50 {lag.get('p50')} ms, max {lag.get('max')} ms"
        )
    for c in sets.get("complex") or []:
        lines.append(f"sets     {c['where']}: {c['test']}: complex: {c['why']}")
    return lines


def _fmt_policysync(ps: dict, overlay: dict | None) -> str:
    """The policy sync service's line of `status` (docs/deploy.md, "Live policy")."""
    buf = f"update buffer {len(overlay['slots'])}/{overlay['depth']} slots" if overlay else "no update buffer in use"
    if not ps.get("wanted"):
        return f"policysync not running: {ps.get('reason') or 'not wanted by this deployment'}"
    if not ps.get("running"):
        if ps.get("down") and ps["down"] != "is not running":  # its supervisor runs: restarting or starting
            return f"policysync DOWN: changes to the live ruleset are not followed; the service {ps['down']}"
        return (
            "policysync DOWN: changes to the live ruleset are not followed; the fast path decides nothing once its "
            "lease runs out (deploy again, or undeploy)"
        )
    if ps.get("error"):
        return f"policysync CANNOT FOLLOW: {ps['error']}; the fast path shunts everything"
    lag = ps.get("lag_safe_ms") or {}
    app = ps.get("lag_apply_ms") or {}
    return (
        f"policysync pid {ps.get('pid')}: following the live ruleset; {ps.get('changes')} changes, "
        f"{ps.get('applied')} applied (last: {ps.get('last_kind') or '-'}), {ps.get('own')} own; "
        f"fail-safe lag p50 {lag.get('p50')} ms, p99 {lag.get('p99')} ms; applied p50 {app.get('p50')} ms; {buf}; "
        + _fmt_lease(ps)
        + _fmt_follow6(ps.get("ipv6"))
    )


def _fmt_follow6(six: dict | None) -> str:
    """The IPv6 side's part of the policy sync line (docs/ipv6.md "Following ip6tables")."""
    if not six:
        return ""
    if six.get("mode", "kernel") == "kernel":
        return "; IPv6: nothing to follow (ip6tables as the operator has it decides every IPv6 frame)"
    if six.get("error"):
        return f"; IPv6 CANNOT FOLLOW ip6tables: {six['error']}; every IPv6 frame to ip6tables (k = 0)"
    lag, app = six.get("lag_safe_ms") or {}, six.get("lag_apply_ms") or {}
    held = "; IPv6 held: every IPv6 frame to ip6tables until applied" if six.get("safe") else ""
    return (
        f"; IPv6: following ip6tables; {six.get('changes')} changes, {six.get('applied')} applied "
        f"(last: {six.get('last_how') or '-'}); hold lag p50 {lag.get('p50')} ms; applied p50 {app.get('p50')} ms"
        + held
    )


def _fmt_lease(ps: dict) -> str:
    """The policy sync lease's part of that line: its length and how often the service renewed it (p50)."""
    if not ps.get("lease_ms"):
        return "no lease"
    every = (ps.get("lease_interval_ms") or {}).get("p50")
    return f"lease {ps['lease_ms']} ms" + (f", renewed every {every} ms (p50)" if every is not None else "")


def cmd_status(args: argparse.Namespace) -> int:
    from hypafilter.ops import deploy

    deploy.configure_from_state()
    st = deploy.status()
    print(json.dumps(st, indent=1, default=str) if args.json else _fmt_status(st))
    if st.get("drift"):  # what runs is not what was deployed: `hypafilter deploy` of the same policy repairs it
        return 1
    return 0


def register(sub) -> None:
    for name, help_ in (
        ("deploy", "compile, build and load a policy on the target (all or nothing)"),
        ("update", "replace the deployed policy, make-before-break"),
    ):
        p = sub.add_parser(name, help=help_)
        add_policy_args(p, ipv6=True)
        p.add_argument(
            "--target",
            choices=("emu", "xdp"),
            help="where to deploy (default: deploy the configuration's target, emu; update the deployed one)",
        )
        p.add_argument(
            "--ports",
            metavar="IF0,IF1",
            help="xdp: deploy on these two interfaces (a bridge port pair) instead of the lab's firewall",
        )
        p.add_argument("--netns", metavar="NS", help="with --ports: the network namespace holding them")
        add_ipv6_default_arg(p)
        p.add_argument("--strategy", choices=STRATEGIES, help="software strategy")
        p.add_argument("--mode", choices=MODES, help="shunting mode")
        p.add_argument("--force", action="store_true", help="redeploy even if this policy is deployed")
        p.add_argument("--json", action="store_true", help="one-line JSON summary")
        p.add_argument("-q", "--quiet", action="store_true", help="no progress lines")
        p.set_defaults(func=cmd_deploy)
    p = sub.add_parser("undeploy", help="remove the deployment (NIC, chains, shim)")
    p.add_argument("-q", "--quiet", action="store_true")
    p.set_defaults(func=cmd_undeploy)
    p = sub.add_parser("status", help="what is deployed, with live counters")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_status)
