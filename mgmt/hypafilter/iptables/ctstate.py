"""Conntrack state as a hardware dimension: the split of a rule whose only complex checks are connection states.

A frame the flow cache knows (ir.box ct = 1 or 2) belongs to a connection conntrack holds as ESTABLISHED, seen in
its original (1) or reply (2) direction: the sync service installs only confirmed, established flows and removes
a flow when conntrack destroys it. So a rule whose complex checks are only `-m conntrack --ctstate/--ctdir` and
`-m state --state` (negations allowed, several of them in one rule) is decided by geometry for such a frame. The
front end writes it as two IR rules at consecutive positions, same levels and origin:

  A (hit part, simple):   its boxes with ct in H, H = {1 if the checks hold for (ESTABLISHED, ORIGINAL)} ∪
                          {2 if they hold for (ESTABLISHED, REPLY)}; no complex checks; left out when H is empty
  B (miss part, complex): its boxes with ct in {0, 3}, the state checks kept as complex checks

Software writes both from the same levels, i.e. the original rule verbatim (a rule without per-rule state, so a
second copy never changes a verdict). Only rules whose target is ACCEPT or DROP are split (A must be a hardware
entry); any other conntrack option (--ctstatus, --ctproto, --ctorig*, --ctexpire, ...), a SNAT/DNAT virtual state
(a hit does not say whether the connection is NATed), or `! --ctdir` (iptables refuses it) keeps the whole rule
complex, as does an approximate rule (a complex RETURN guard above it).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from hypafilter.ir import HW_TARGETS, Rule
from hypafilter.ir.box import CT_NEVER, CT_ORIGINAL, CT_REPLY, CT_UNKNOWN, boxes_intersect, field_boxes

STATES = frozenset({"INVALID", "NEW", "ESTABLISHED", "RELATED", "UNTRACKED"})
VIRTUAL_STATES = frozenset({"SNAT", "DNAT"})  # --ctstate only: the connection's NAT bits
DIRECTIONS = ("ORIGINAL", "REPLY")
HIT = {CT_ORIGINAL: "ORIGINAL", CT_REPLY: "REPLY"}  # ct value of a flow-cache hit -> conntrack direction
MISS_CT = [(CT_UNKNOWN, CT_UNKNOWN), (CT_NEVER, CT_NEVER)]

Check = Callable[[str, str], bool]  # (state, direction) -> does the check hold


def _states(text: str, allowed: frozenset[str]) -> frozenset[str] | None:
    names = [s.upper() for s in text.split(",")]
    if not names or any(s not in allowed for s in names):
        return None
    return frozenset(names)


def state_check(group: tuple[str, ...]) -> Check | None:
    """The check a complex token group makes, as a function of (state, direction), when it is a connection-state
    check only (`-m conntrack` with --ctstate/--ctdir, `-m state --state`); None otherwise."""
    if len(group) < 2 or group[0] != "-m" or group[1] not in ("conntrack", "state"):
        return None
    toks = list(group[2:])
    seen: dict[str, tuple[object, bool]] = {}
    i = 0
    while i < len(toks):
        neg = toks[i] == "!"
        i += neg
        if i + 1 >= len(toks):
            return None
        opt, arg = toks[i], toks[i + 1]
        i += 2
        if opt in seen:
            return None
        if group[1] == "state" and opt == "--state":
            st = _states(arg, STATES)
        elif group[1] == "conntrack" and opt == "--ctstate":
            st = _states(arg, STATES | VIRTUAL_STATES)
            if st is not None and st & VIRTUAL_STATES:
                return None  # a hit does not say whether the connection is NATed
        elif group[1] == "conntrack" and opt == "--ctdir" and not neg and arg.upper() in DIRECTIONS:
            st = arg.upper()
        else:
            return None
        if st is None:
            return None
        seen[opt] = (st, neg)
    if not seen:
        return None

    def check(state: str, direction: str) -> bool:
        for opt, (arg, neg) in seen.items():
            if opt == "--ctdir":
                if direction != arg:
                    return False
            elif (state in arg) == neg:  # type: ignore[operator]
                return False
        return True

    return check


def hit_values(checks: list[Check]) -> list[int]:
    """H: the ct values of a flow-cache hit for which every check holds (the state is ESTABLISHED)."""
    return [ct for ct, d in HIT.items() if all(c("ESTABLISHED", d) for c in checks)]


def split_rule(rule: Rule) -> list[Rule]:
    """[rule], or its hit part A (when H is not empty) and its miss part B (see the module docstring)."""
    if not rule.complex or rule.target not in HW_TARGETS or rule.approximate or rule.stateful_pos is not None:
        return [rule]
    checks = [state_check(g) for g in rule.complex]
    if any(c is None for c in checks):
        return [rule]
    out = []
    hit = hit_values(checks)  # type: ignore[arg-type]
    if hit:
        a = boxes_intersect(list(rule.boxes), field_boxes("ct", [(hit[0], hit[-1])]))  # {1}, {2} or 1..2
        out.append(dataclasses.replace(rule, boxes=tuple(a), complex=(), ct_part="hit"))
    b = boxes_intersect(list(rule.boxes), field_boxes("ct", MISS_CT))
    out.append(dataclasses.replace(rule, boxes=tuple(b), ct_part="miss"))
    return out


def split_states(rules: list[Rule]) -> list[Rule]:
    """The flattened rule list with every rule whose only complex checks are connection states split."""
    out: list[Rule] = []
    for r in rules:
        out.extend(split_rule(r))
    return out
