"""Arguments shared by every command that takes a policy: POLICY, or --classbench FILTERS with import options."""

from __future__ import annotations

import argparse
import dataclasses
import sys

from hypafilter.config import Config
from hypafilter.errors import HypafilterError
from hypafilter.ir import Policy


def add_policy_args(p: argparse.ArgumentParser, required: bool = True, ipv6: bool = False) -> None:
    """The policy arguments; `ipv6`: also -6 (POLICY is an ip6tables policy) and --ipv6 V6POLICY (dual stack), for the
    commands that handle them (docs/ipv6.md)."""
    p.add_argument("policy", nargs="?", metavar="POLICY", help="iptables-save file or plain rule file")
    if ipv6:
        p.add_argument(
            "-6",
            dest="family6",
            action="store_true",
            help="POLICY is an ip6tables policy (ip6tables-save file or ip6tables command lines); with --classbench: "
            "the filters mapped into IPv6 (docs/ipv6.md)",
        )
        p.add_argument(
            "--ipv6",
            metavar="V6POLICY",
            help="the ip6tables policy beside the IPv4 POLICY (dual stack): both are read, checked and reported",
        )
    p.add_argument("--chain", default="FORWARD", help="base chain (default FORWARD)")
    p.add_argument("--config", metavar="TOML", help="site configuration (see docs/configuration.md)")
    p.add_argument(
        "--allow-empty",
        action="store_true",
        help="accept a file without rules for the base chain (the chain policy then decides every packet)",
    )
    p.add_argument(
        "--ipsets",
        metavar="FILE",
        help="the ipsets the policy's -m set matches read (`ipset save` format; default: the firewall's live sets); "
        "created in the lab and the oracle's namespace (docs/sets.md)",
    )
    cb = p.add_argument_group("ClassBench import (instead of POLICY; same meaning as `hypafilter import-classbench`)")
    cb.add_argument("--classbench", metavar="FILTERS", help="ClassBench filter set")
    cb.add_argument("--complex", type=int, default=0, metavar="K", help="number of complex rules to place")
    cb.add_argument("--policy", dest="cb_policy", choices=("ACCEPT", "DROP"), default="ACCEPT", help="chain policy")
    cb.add_argument("--actions", choices=("accept", "alternate"), default="accept", help="rule actions")
    cb.add_argument("--deterministic", action="store_true", help="complex rules without the statistic match")
    p.set_defaults(_policy_required=required)


def load_config(args: argparse.Namespace) -> Config:
    """The site configuration, with --strategy/--mode from the command line over it where the command has them."""
    cfg = Config.load(getattr(args, "config", None))
    strategy, mode = getattr(args, "strategy", None), getattr(args, "mode", None)
    if strategy:
        cfg.strategy = strategy
    if mode:
        cfg.shunt_mode = mode
    if strategy or mode:
        cfg.validate("command line")
    return cfg


def resolved_lines(policy: Policy) -> list[str]:
    """One line per interface check the deployment's interfaces decided for NIC frames (Policy.resolved)."""
    from hypafilter.iptables.writer import tokens_text

    out = []
    for origin, toks, outcome in policy.resolved:
        where = f"{origin.file}:{origin.line}" if origin else policy.source
        chain = f" (chain {origin.chain})" if origin and origin.chain != policy.base_chain else ""
        note = (
            "; the rule matches no NIC frame: it leaves the hardware analysis, software keeps it for other frames"
            if outcome.startswith("false")
            else ""
        )
        out.append(f"{where}{chain}: {tokens_text(toks)}: {outcome}{note}")
    return out


def interfaces_text(policy: Policy) -> str:
    bridge, ports = policy.interfaces
    names = ", ".join(f"{n}=MAC{p}" for n, p in ports)
    if bridge:
        return f"bridge {bridge}, NIC ports {names}"
    return f"NIC ports {names} (no bridge configured)" if ports else "none configured"


def frame_options(args: argparse.Namespace) -> dict:
    """The frame-drawing options `verify` and `bench rate` share (--seed, --trace, --malformed), as keywords."""
    return {"seed": args.seed, "trace": args.trace, "malformed": args.malformed}


def progress(args: argparse.Namespace, quiet: bool = False):
    """A logger of progress lines on stderr, or one that says nothing."""
    if quiet or getattr(args, "quiet", False):
        return lambda s: None
    return lambda s: print(f"hypafilter: {s}", file=sys.stderr)


def set_env(args: argparse.Namespace, config: Config):
    """What the front end knows of the sets (iptables.sets.SetEnv): --ipsets FILE, else the firewall namespace's
    live sets (the lab's or the site's, when it exists; else this namespace's), with the target's set slots."""
    from hypafilter.iptables.sets import SetEnv
    from hypafilter.netfilter import ipset
    from hypafilter.targets import set_capability, set_capability6

    target = getattr(args, "target", None) or config.target
    slots, capacity = set_capability(target)
    path = getattr(args, "ipsets", None)
    if path:
        sets, text = ipset.read_file(path)
        return SetEnv(sets, slots, capacity, target, path, text=text, v6_slots=set_capability6(target))
    from hypafilter import netns
    from hypafilter.ops import deploy

    ns = deploy.NS_FW if deploy.NS_FW and netns.exists(deploy.NS_FW) else None

    def live() -> tuple[dict, str]:
        try:
            text = ipset.save_text(ns)
            return ipset.parse_save(text, f"ipset save ({ns or 'this namespace'})"), text
        except HypafilterError:
            return {}, ""

    return SetEnv(
        {},
        slots,
        capacity,
        target,
        f"live sets of {ns or 'this namespace'}",
        loader=live,
        v6_slots=set_capability6(target),
    )


def load_policy(args: argparse.Namespace, config: Config | None = None) -> Policy:
    """The Policy named by the arguments (a file, or a ClassBench import); the sets its -m set matches read from
    --ipsets or the live kernel (Policy.sets, .ipsets_text). With -6 an ip6tables policy (Policy.family 6)."""
    config = config or load_config(args)
    if getattr(args, "family6", False) and getattr(args, "ipv6", None):
        raise HypafilterError("give either -6 POLICY (IPv6 only) or POLICY --ipv6 V6POLICY (dual stack), not both")
    return _with_sets(
        args, config, lambda env: _load_policy(args, config, env, 6 if getattr(args, "family6", False) else 4)
    )


def load_policy6(args: argparse.Namespace, config: Config | None = None) -> Policy | None:
    """The ip6tables policy of --ipv6 V6POLICY (dual stack), None without it; read as POLICY is (same chain,
    configuration and sets)."""
    path = getattr(args, "ipv6", None)
    if not path:
        return None
    config = config or load_config(args)
    return _with_sets(
        args, config, lambda env: parse_policy_file(path, args.chain, config, args.allow_empty, env, family=6)
    )


def _with_sets(args: argparse.Namespace, config: Config, load) -> Policy:
    import dataclasses

    env = set_env(args, config)
    policy = load(env)
    if not env.text:
        return policy
    return dataclasses.replace(
        policy, ipsets_text=env.text, sets=dict(env.sets), ipsets_file=getattr(args, "ipsets", None) or ""
    )


def _load_policy(args: argparse.Namespace, config: Config, env, family: int = 4) -> Policy:
    from hypafilter.iptables.document import parse_policy

    if args.classbench and args.policy:
        raise HypafilterError("give either POLICY or --classbench, not both")
    if args.classbench:
        from hypafilter.tools.classbench import classbench_policy_text

        text = classbench_policy_text(
            args.classbench,
            complex_rules=args.complex,
            policy=args.cb_policy,
            actions=args.actions,
            deterministic=args.deterministic,
        )
        if family == 6:
            from hypafilter.tools.classbench6 import v6_policy_text

            text = v6_policy_text(text)
        return parse_policy(
            text,
            filename=args.classbench,
            base_chain=args.chain,
            config=config,
            allow_empty=args.allow_empty,
            sets=env,
            family=family,
        )
    if not args.policy:
        raise HypafilterError("no policy given (POLICY or --classbench FILTERS)")
    return parse_policy_file(args.policy, args.chain, config, args.allow_empty, env, family)


def parse_policy_file(path: str, chain: str, config: Config, allow_empty: bool, env, family: int = 4) -> Policy:
    """parse_policy of a file, with the file's own errors (missing, not UTF-8) said as such."""
    from hypafilter.iptables.document import parse_policy, read_policy_text

    text = read_policy_text(path)
    return parse_policy(
        text, filename=path, base_chain=chain, config=config, allow_empty=allow_empty, sets=env, family=family
    )


def add_ipv6_default_arg(p: argparse.ArgumentParser) -> None:
    """--ipv6-default of deploy, update and verify (docs/ipv6.md, "Deploy and verify"); their -6 and --ipv6 are
    add_policy_args(ipv6=True)'s."""
    p.add_argument(
        "--ipv6-default",
        choices=("kernel", "drop"),
        default=None,
        help="without an IPv6 policy: kernel (default) leaves ip6tables as the operator has it, drop drops every "
        "IPv6 frame (ip6tables' base chain policy DROP, no rule)",
    )


EMPTY_V4 = "*filter\n:INPUT ACCEPT [0:0]\n:FORWARD ACCEPT [0:0]\n:OUTPUT ACCEPT [0:0]\nCOMMIT\n"


def load_ipv6(args: argparse.Namespace, config: Config, base_chain: str):
    """The IPv6 side the arguments name, as deploy and verify load it (netfilter.ip6.V6Policy: the file verbatim,
    for ip6tables): --ipv6 V6POLICY, or POLICY with -6, or --ipv6-default drop; None for mode kernel. The file is
    read by the IPv6 front end first (its errors name file, line and token; its rules aim verify's frames) and then
    loaded by ip6tables itself in a scratch namespace."""
    from hypafilter.netfilter import ip6

    path = getattr(args, "ipv6", None) or (args.policy if getattr(args, "family6", False) else None)
    if path and args.ipv6_default:
        raise HypafilterError("--ipv6-default is for a deployment without an IPv6 policy: drop it or the policy")
    if path:
        if getattr(args, "family6", False) and getattr(args, "ipv6", None):
            raise HypafilterError("give either -6 POLICY (IPv6 only) or POLICY --ipv6 V6POLICY (dual stack), not both")
        env = set_env(args, config)
        ir = parse_policy_file(path, base_chain, config, True, env, family=6)
        sets_text = env.text or _live_sets_text()  # --ipsets FILE, else the firewall's sets
        return dataclasses.replace(ip6.read(path, base_chain, sets_text), ir=ir)
    if args.ipv6_default == "drop":
        return ip6.drop_policy(base_chain)
    return None


def _live_sets_text() -> str:
    """`ipset save` of the firewall namespace (the lab's or the site's; else this one), "" when unreadable."""
    from hypafilter import netns
    from hypafilter.netfilter import ipset
    from hypafilter.ops import deploy

    ns = deploy.NS_FW if deploy.NS_FW and netns.exists(deploy.NS_FW) else None
    try:
        return ipset.save_text(ns)
    except HypafilterError:
        return ""


def load_policy_v4(args: argparse.Namespace, config: Config, log=lambda s: None) -> Policy:
    """load_policy, or with -6 (POLICY is the IPv6 policy) the IPv4 side an IPv6 policy alone gets: the firewall's
    live iptables ruleset as it is (`live_policy_v4`; deploy, update and verify take the same one)."""
    if getattr(args, "family6", False):
        if args.classbench:
            raise HypafilterError(
                "-6 with --classbench: deploy and verify take an ip6tables-save file (analyze and bench rate take "
                "--classbench with -6)"
            )
        return live_policy_v4(args, config, log)
    return load_policy(args, config)


def live_policy_v4(args: argparse.Namespace, config: Config, log=lambda s: None) -> Policy:
    """The IPv4 side of `deploy|update|verify -6 V6POLICY` (docs/ipv6.md "An IPv6 policy alone"): the firewall's
    live iptables ruleset as it is, read with `iptables-save -t TABLE` (the policy is the kernel's live ruleset,
    ARCHITECTURE §2), the tool's own chains left out. With a deployment that is its IPv4 side as the kernel holds it
    (the deployed policy, and every change the policy sync service followed): only the IPv6 side is replaced. Without
    one it is what the operator has: deployed as it is, so nothing of the IPv4 filtering changes. A firewall with no
    such table (nothing filters IPv4) gives the empty policy with every base chain ACCEPT, which is what the kernel
    then does. The listing is parsed as any policy file: an error names `iptables-save -t TABLE (NS)`, its line and
    token."""
    from hypafilter import netns
    from hypafilter.iptables.document import parse_policy
    from hypafilter.ops import deploy
    from hypafilter.ops.policysync import live

    ns = deploy.NS_FW if deploy.NS_FW and netns.exists(deploy.NS_FW) else None
    if deploy.NS_FW and ns is None:
        text, how = EMPTY_V4, f"the empty policy, every base chain ACCEPT ({deploy.NS_FW} does not exist yet: no table)"
        source = "(no IPv4 ruleset: -6)"
    else:
        text = netns.run(["iptables-save", "-t", config.table], ns)
        text = live.strip_tool(text, config.chain_prefix) if text.strip() else EMPTY_V4
        how = "the firewall's live IPv4 ruleset as it is"
        source = f"iptables-save -t {config.table} ({ns or 'this namespace'})"
    policy = _with_sets(
        args,
        config,
        lambda env: parse_policy(
            text, filename=source, base_chain=args.chain, config=config, allow_empty=True, sets=env
        ),
    )
    st = deploy.read_state()
    if st and (
        st.get("policy_hash") == policy.policy_hash() or st.get("live_digest") == live.digest(text, config.chain_prefix)
    ):
        # the deployment's IPv4 side as it runs: kept under its name (the same policy: nothing of IPv4 changes)
        policy = dataclasses.replace(policy, source=st.get("policy_source") or source)
        how = f"the deployed IPv4 policy {policy.source}" + (
            f", as {source} holds it" if policy.source != source else ""
        )
    elif st:
        how = (
            f"iptables' live ruleset ({source}), which is not the deployed IPv4 policy {st.get('policy_source')}: a "
            "change the policy sync service has not followed yet, deployed with it"
        )
    elif ns is not None or not deploy.NS_FW:
        how = f"{how} ({source})"
    n = len(policy.rules)
    log(
        f"-6: the IPv4 side is {how}: {n} rule{'s' * (n != 1)} for {args.chain}, policy {policy.default}; deployed as "
        'it is beside the IPv6 policy (docs/ipv6.md "An IPv6 policy alone")'
    )
    return policy
