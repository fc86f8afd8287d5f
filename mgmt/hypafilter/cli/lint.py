"""`hypafilter lint POLICY`: validate a policy and summarise its partition into simple and complex rules."""

from __future__ import annotations

import argparse
import sys

from hypafilter.cli.common import add_policy_args, interfaces_text, load_config, load_policy, resolved_lines
from hypafilter.config import mirrors
from hypafilter.errors import shown, shown_text
from hypafilter.iptables.writer import tokens_text
from hypafilter.ir import FIELD_INDEX, HW_TARGETS, Rule
from hypafilter.ir.semantics import observes


def complex_reasons(rule: Rule) -> list[str]:
    """Why a flattened rule cannot be decided by the hardware alone (empty for simple rules)."""
    reasons = []
    for group in rule.complex:
        if group[:1] == ("-m",) or group[:2] == ("!", "-m"):
            reasons.append(f"match {tokens_text(map(shown, group))}")
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


def run(args: argparse.Namespace) -> int:
    config = load_config(args)
    policy = load_policy(args, config)
    rules = policy.rules
    n_simple = len(policy.simple_indices)
    print(f"{policy.source}: chain {policy.base_chain}, policy {policy.default}")
    print(
        f"{len(policy.original_rules)} rules in {policy.base_chain}, {len(policy.user_chains)} user chains reachable; "
        f"flattened: {len(rules)} rules, {n_simple} simple, {len(rules) - n_simple} complex"
    )
    if policy.ignored_tables:
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
    for i, r in enumerate(rules):
        if r.is_simple and r.ct_part != "hit":
            continue
        where = f"{r.origin.file}:{r.origin.line}" if r.origin else "?"
        chain = f" (chain {r.origin.chain})" if r.origin and r.origin.chain != policy.base_chain else ""
        if r.is_simple:  # the hit part of a rule split on conntrack state (iptables.ctstate)
            print(f"  #{i} {where}{chain}: simple on a flow-cache hit ({ct_text(r)}): its state checks hold there")
            continue
        part = " (on a flow-cache miss)" if r.ct_part == "miss" else ""
        print(f"  #{i} {where}{chain}: complex{part}: {'; '.join(complex_reasons(r))}{observing_text(r, config)}")
    status = 0
    if not args.no_kernel:
        from hypafilter.iptables import kernel

        why = kernel.available()
        if why:
            print(f"  kernel check skipped: {why}")
        else:
            errors = kernel.check(
                *kernel.policy_lines(policy, config.table), table=config.table, sets_text=policy.ipsets_text or None
            )
            for e in errors:
                print(f"hypafilter: error: {e}", file=sys.stderr)
            print(f"  kernel check: {'every rule loads' if not errors else f'{len(errors)} refused'}")
            status = 2 if errors else 0
    if args.verbose:
        for i, r in enumerate(rules):
            kind = ("simple " if r.is_simple else "complex") + (f" [ct {r.ct_part}]" if r.ct_part else "")
            print(
                f"  #{i} {kind} {len(r.boxes)} box(es) -> {r.target or '(none)'}: {shown_text(r.origin.text) if r.origin else ''}"
            )
    return status


def register(subparsers) -> None:
    p = subparsers.add_parser("lint", help="validate a policy (no files written)", description=__doc__)
    add_policy_args(p)
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
