"""Conntrack state as a hardware dimension: the split of a rule whose only complex checks are connection states.

A frame the flow cache knows (ir.box ct = 1 or 2) belongs to a connection conntrack holds as ESTABLISHED, seen in
its original (1) or reply (2) direction: the sync service installs only confirmed, established flows and removes
a flow when conntrack destroys it. A frame with ct = 3 (CT_NONE) is one for which conntrack holds no entry at all
(the xdp target's lookup in the kernel's own table): the kernel reads it as NEW (original direction) or INVALID
(no conntrack attached), never ESTABLISHED or RELATED as long as no expectation can exist and nothing makes it
UNTRACKED (the xdp target produces ct 3 only then: targets.xdp.newflows). So a rule whose complex checks are only
`-m conntrack --ctstate/--ctdir` and `-m state --state` (negations allowed, several of them in one rule) is decided
by geometry for such frames too. The front end writes it as two IR rules at consecutive positions, same levels and
origin:

  A (hit part, simple):   its boxes with ct in H ∪ N, H = {1 if the checks hold for (ESTABLISHED, ORIGINAL)} ∪
                          {2 if they hold for (ESTABLISHED, REPLY)}, N = {3} when the checks hold both for (NEW,
                          ORIGINAL) and for an INVALID frame; no complex checks; left out when H ∪ N is empty
  B (miss part, complex): its boxes with ct 0, and ct 3 when the checks hold for one of NEW and INVALID but not
                          the other (then the kernel's own classification decides, so software does); the state
                          checks kept as complex checks

A ct-3 frame for which the checks hold for neither NEW nor INVALID lies in neither part: the rule cannot match it.
INVALID is read as xt_conntrack and xt_state read it (no conntrack attached to the skb): the state checks apply and
`--ctdir` is not tested, and a conntrack match without `--ctstate` does not match at all.

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
from hypafilter.ir.box import CT_NONE, CT_ORIGINAL, CT_REPLY, CT_UNKNOWN, boxes_intersect, field_boxes

STATES = frozenset({"INVALID", "NEW", "ESTABLISHED", "RELATED", "UNTRACKED"})
VIRTUAL_STATES = frozenset({"SNAT", "DNAT"})  # --ctstate only: the connection's NAT bits
DIRECTIONS = ("ORIGINAL", "REPLY")
HIT = {CT_ORIGINAL: "ORIGINAL", CT_REPLY: "REPLY"}  # ct value of a flow-cache hit -> conntrack direction
NO_ENTRY = None  # the direction argument of a Check for a frame without a conntrack (state INVALID)

Check = Callable[[str, str | None], bool]  # (state, direction or NO_ENTRY) -> does the check hold


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

    def check(state: str, direction: str | None) -> bool:
        if direction is NO_ENTRY and "--ctstate" not in seen and "--state" not in seen:
            return False  # xt_conntrack without a conntrack: only a state check can match
        for opt, (arg, neg) in seen.items():
            if opt == "--ctdir":
                if direction is not NO_ENTRY and direction != arg:
                    return False
            elif (state in arg) == neg:  # type: ignore[operator]
                return False
        return True

    return check


def hit_values(checks: list[Check]) -> list[int]:
    """H: the ct values of a flow-cache hit for which every check holds (the state is ESTABLISHED)."""
    return [ct for ct, d in HIT.items() if all(c("ESTABLISHED", d) for c in checks)]


def none_value(checks: list[Check]) -> bool | None:
    """What the checks say of a frame no conntrack entry holds (ct 3): True/False when they hold resp. fail both for
    NEW (original direction) and INVALID, None when the two readings differ."""
    new = all(c("NEW", "ORIGINAL") for c in checks)
    invalid = all(c("INVALID", NO_ENTRY) for c in checks)
    return new if new == invalid else None


def _ct_intervals(values: list[int]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for v in sorted(values):
        if out and out[-1][1] == v - 1:
            out[-1] = (out[-1][0], v)
        else:
            out.append((v, v))
    return out


def split_rule(rule: Rule) -> list[Rule]:
    """[rule], or its hit part A (when H is not empty) and its miss part B (see the module docstring)."""
    if not rule.complex or rule.target not in HW_TARGETS or rule.approximate or rule.stateful_pos is not None:
        return [rule]
    checks = [state_check(g) for g in rule.complex]
    if any(c is None for c in checks):
        return [rule]
    out = []
    none = none_value(checks)  # type: ignore[arg-type]
    hit = hit_values(checks) + ([CT_NONE] if none is True else [])  # type: ignore[arg-type]
    if hit:
        a = boxes_intersect(list(rule.boxes), field_boxes("ct", _ct_intervals(hit)))
        out.append(dataclasses.replace(rule, boxes=tuple(a), complex=(), ct_part="hit"))
    miss = [CT_UNKNOWN] + ([CT_NONE] if none is None else [])
    b = boxes_intersect(list(rule.boxes), field_boxes("ct", _ct_intervals(miss)))
    out.append(dataclasses.replace(rule, boxes=tuple(b), ct_part="miss"))
    return out


def split_states(rules: list[Rule]) -> list[Rule]:
    """The flattened rule list with every rule whose only complex checks are connection states split."""
    out: list[Rule] = []
    for r in rules:
        out.extend(split_rule(r))
    return out
