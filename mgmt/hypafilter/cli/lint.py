"""`hypafilter lint POLICY`: validate a policy and summarise its partition into simple and complex rules."""

from __future__ import annotations

import argparse
import sys

from hypafilter.cli.common import (
    add_policy_args,
    interfaces_text,
    load_config,
    load_policy,
    load_policy6,
    resolved_lines,
)
from hypafilter.config import mirrors
from hypafilter.errors import shown, shown_text
from hypafilter.iptables.writer import tokens_text
from hypafilter.ir import FIELD_INDEX, HW_TARGETS, Rule
from hypafilter.ir.semantics import observes

# Why the matches only ip6tables has stay in software (lint of an IPv6 policy).
IPV6_MATCH_REASONS = {
    "hl": "the hop limit is not a fast-path field",
    "frag": "an extension-header match, decided by ip6tables: the fast paths read the upper-layer header only",
    "ipv6header": "an extension-header match, decided by ip6tables: the fast paths read the upper-layer header only",
    "hbh": "an extension-header match, decided by ip6tables: the fast paths read the upper-layer header only",
    "dst": "an extension-header match, decided by ip6tables: the fast paths read the upper-layer header only",
    "rt": "an extension-header match, decided by ip6tables: the fast paths read the upper-layer header only",
    "ah": "an extension-header match, decided by ip6tables: the fast paths read the upper-layer header only",
    "mh": "a mobility-header match, decided by ip6tables",
    "eui64": "compares the source address with the MAC address, decided by ip6tables",
}


def complex_reasons(rule: Rule, family: int = 4) -> list[str]:
    """Why a flattened rule cannot be decided by the hardware alone (empty for simple rules)."""
    reasons = []
    for group in rule.complex:
        if group[:1] == ("-m",) or group[:2] == ("!", "-m"):
            name = group[group.index("-m") + 1] if "-m" in group[:-1] else ""
            why = f" ({IPV6_MATCH_REASONS[name]})" if family == 6 and name in IPV6_MATCH_REASONS else ""
            reasons.append(f"match {tokens_text(map(shown, group))}{why}")
        else:
            reasons.append(f"check {tokens_text(map(shown, group))}")
    if rule.target not in HW_TARGETS:
        reasons.append(f"target {shown(rule.target)}" if rule.target else "no target (stateful match only)")
    if rule.approximate:
        reasons.append("behind a complex RETURN/goto guard in a user chain")
    return reasons


def set_lines(policy) -> list[str]:
    """What became of each -m set match (docs/sets.md): a set slot of the fast path, or why it stays complex."""
    notes = getattr(policy, "set_notes", [])
    if not notes:
        return []
    out = [f"  set matches: {len(policy.set_slots)} set slot(s) in the fast path"]
    for i, slot in enumerate(policy.set_slots):
        info = policy.sets.get(slot.name)
        size = f", {len(info.entries)} elements, maxelem {info.maxelem}" if info is not None else ""
        out.append(f"    slot {i}: {slot.name} ({slot.settype}) by {','.join(slot.dirs)}{size}")
    for n in notes:
        where = f"{n.origin.file}:{n.origin.line}" if n.origin else "?"
        what = f"simple (slot {n.slot})" if n.slot >= 0 else f"complex: {n.why}"
        out.append(f"    {where}: {shown_text(n.test)}: {what}")
    return out


def ct_text(rule: Rule) -> str:
    """The directions of a flow-cache hit a rule's boxes take (ct 1 original, 2 reply)."""
    ct = FIELD_INDEX["ct"]
    vals = {v for b in rule.boxes for v in range(b.lo[ct], b.hi[ct] + 1)} & {1, 2}
    return " and ".join(("original direction", "reply direction")[v - 1] for v in sorted(vals))


def observing_text(rule: Rule, config) -> str:
    """For an observing rule (LOG, NFLOG, no target): whether the fast path mirrors it under the configuration."""
    if not observes(rule):
        return ""
    if mirrors(config.shunt_mode, config.strategy):
        return "; observing: mirrored (the fast path decides, software sees a copy)"
    return f"; observing, not mirrored with shunt_mode {config.shunt_mode} and strategy {config.strategy}"


FAMILY_NAMES = {4: "IPv4 (iptables)", 6: "IPv6 (ip6tables)"}


def run(args: argparse.Namespace) -> int:
    config = load_config(args)
    policy = load_policy(args, config)
    policy6 = load_policy6(args, config)
    if policy.family == 4 and policy6 is None:
        return lint_policy(policy, config, args, "")
    status = lint_policy(policy, config, args, f"IPv{policy.family}")
    if policy6 is not None:
        status = max(status, lint_policy(policy6, config, args, "IPv6"))
    return status


def lint_policy(policy, config, args: argparse.Namespace, family: str) -> int:
    """Lint one policy. `family`: "" for an IPv4 policy linted alone (the output of earlier versions), else "IPv4"
    or "IPv6", named on the policy's line and on every rule listed (lint of an ip6tables policy or of a dual stack)."""
    rules = policy.rules
    n_simple = len(policy.simple_indices)
    tag = f" [{family}]" if family else ""
    fam = f", family {FAMILY_NAMES[policy.family]}" if family else ""
    print(f"{policy.source}: chain {policy.base_chain}, policy {policy.default}{fam}")
    print(
        f"{len(policy.original_rules)} rules in {policy.base_chain}, {len(policy.user_chains)} user chains reachable; "
        f"flattened: {len(rules)} rules, {n_simple} simple, {len(rules) - n_simple} complex"
    )
    if policy.ignored_tables and policy.family == 6:  # an IPv6 side is deployed verbatim (docs/ipv6.md)
        print(
            f"  tables besides {config.table} ({', '.join(policy.ignored_tables)}): loaded into ip6tables as they are; "
            "while the IPv6 policy has them, the fast path passes every IPv6 frame to ip6tables (k = 0)"
        )
    elif policy.ignored_tables:
        print(f"  tables ignored (only {config.table} is deployed): {', '.join(policy.ignored_tables)}")
    if policy.user_chains:
        from hypafilter.analysis.program import user_chain_names  # numpy: loaded only when needed

        prefix = f"{config.chain_prefix}1_"
        for name, loaded in user_chain_names(prefix, policy.user_chains).items():
            print(
                f"  user chain {name} is loaded as {loaded} (generation 1; {prefix} is {config.chain_prefix}<generation>_)"
            )
    resolved = resolved_lines(policy)
    if resolved:
        print(f"  interface checks resolved for NIC frames ({interfaces_text(policy)}):")
        for line in resolved:
            print(f"    {line}")
    for line in set_lines(policy):
        print(line)
    for origin, note in policy.notes:
        where = f"{origin.file}:{origin.line}" if origin else policy.source
        print(f"  {where}{tag}: {shown_text(note)}")
    for i, r in enumerate(rules):
        if r.is_simple and r.ct_part != "hit":
            continue
        where = (f"{r.origin.file}:{r.origin.line}" if r.origin else "?") + tag
        chain = f" (chain {r.origin.chain})" if r.origin and r.origin.chain != policy.base_chain else ""
        if r.is_simple:  # the hit part of a rule split on conntrack state (iptables.ctstate)
            print(f"  #{i} {where}{chain}: simple on a flow-cache hit ({ct_text(r)}): its state checks hold there")
            continue
        part = " (on a flow-cache miss)" if r.ct_part == "miss" else ""
        print(
            f"  #{i} {where}{chain}: complex{part}: {'; '.join(complex_reasons(r, policy.family))}{observing_text(r, config)}"
        )
    status = 0
    if not args.no_kernel:
        from hypafilter.iptables import kernel

        why = kernel.available(policy.family)
        if why:
            print(f"  kernel check skipped: {why}")
        else:
            errors = kernel.check(
                *kernel.policy_lines(policy, config.table),
                table=config.table,
                sets_text=policy.ipsets_text or None,
                family=policy.family,
            )
            for e in errors:
                print(f"hypafilter: error: {e}", file=sys.stderr)
            print(f"  kernel check: {'every rule loads' if not errors else f'{len(errors)} refused'}")
            status = 2 if errors else 0
    if args.verbose:
        for i, r in enumerate(rules):
            kind = ("simple " if r.is_simple else "complex") + (f" [ct {r.ct_part}]" if r.ct_part else "")
            print(
                f"  #{i}{tag} {kind} {len(r.boxes)} box(es) -> {r.target or '(none)'}: "
                f"{shown_text(r.origin.text) if r.origin else ''}"
            )
    return status


def register(subparsers) -> None:
    p = subparsers.add_parser("lint", help="validate a policy (no files written)", description=__doc__)
    add_policy_args(p, ipv6=True)
    p.add_argument("-v", "--verbose", action="store_true", help="list every flattened rule")
    p.add_argument(
        "--target",
        choices=("emu", "xdp", "sume"),
        help="the target the partition is for (its set slots decide which -m set matches are simple; default: the "
        "configuration's)",
    )
    p.add_argument(
        "--no-kernel",
        action="store_true",
        help="skip loading the rules into a scratch network namespace (done by default when run as root)",
    )
    p.set_defaults(func=run)
