"""What a rule does to a packet, defined once: the targets that end a chain walk, and the first-match walk over a
flattened policy (the reference classifier every other model is compared with).

`complex_eval(index, rule, header)` decides the checks the IR cannot see (string, statistic, a user chain kept
verbatim, ...) for a rule whose boxes contain the header: False = no match, True = match (the target then
applies), or a verdict string ("ACCEPT", "DROP", ...) = the rule decided that verdict (e.g. a verbatim user chain
that accepted). The same callback drives both sides of every comparison, so random matches stay comparable.
A rule without complex checks matches on geometry alone, whatever its target.
"""

from __future__ import annotations

from collections.abc import Callable

from hypafilter.ir.box import Header
from hypafilter.ir.rule import Policy, Rule

# Targets of the filter table, by what a match does to the walk (iptables(8), iptables-extensions(8)).
# Standard verdicts: ACCEPT/DROP end the walk, RETURN leaves the chain, QUEUE hands the packet to user space.
STANDARD_TARGETS = frozenset({"ACCEPT", "DROP", "RETURN", "QUEUE"})
# Extension targets that let the packet continue with the next rule.
NONTERMINAL_TARGETS = frozenset(
    {
        "AUDIT", "CHECKSUM", "CLASSIFY", "CONNMARK", "CONNSECMARK", "CT", "DSCP", "ECN", "HMARK", "IDLETIMER",
        "LED", "LOG", "MARK", "NFLOG", "NOTRACK", "RATEEST", "SECMARK", "SET", "TCPMSS", "TCPOPTSTRIP", "TEE",
        "TOS", "TRACE", "TTL", "ULOG",
    }
)  # fmt: skip
# Non-terminating targets that only observe the packet; every other one changes state a later rule may read
# (the packet mark, the connection mark, an ipset, header bytes, ...).
OBSERVING_TARGETS = frozenset({"AUDIT", "LOG", "NFLOG", "TRACE", "ULOG"})
STATE_CHANGING_TARGETS = NONTERMINAL_TARGETS - OBSERVING_TARGETS
# Log mirroring (docs/internals.md, "Log mirroring"): the rules that never decide and whose only effect is to be
# seen, which the fast path leaves to a copy of the frame: LOG, NFLOG, and a rule without a target ("" : a
# counting rule, or one whose matches keep per-rule state such as a limit or quota).
MIRRORED_TARGETS = frozenset({"LOG", "NFLOG", ""})
# Extension targets that decide (or divert) the packet when they match. SYNPROXY consumes SYN and ACK packets
# and lets every other packet continue; DNAT/SNAT/MASQUERADE/REDIRECT/NETMAP belong to the nat table, where
# they accept. A packet-dependent or table-dependent verdict is a complex rule's business: the model asks
# complex_eval for its outcome.
TERMINAL_EXTENSION_TARGETS = frozenset(
    {"REJECT", "NFQUEUE", "SYNPROXY", "TPROXY", "DNAT", "SNAT", "MASQUERADE", "NETMAP", "REDIRECT", "CLUSTERIP",
     "MIRROR"}
)  # fmt: skip
KNOWN_TARGETS = STANDARD_TARGETS | NONTERMINAL_TARGETS | TERMINAL_EXTENSION_TARGETS
# Targets whose match always ends the walk with that verdict, whatever the packet (the model's verdicts).
VERDICT_TARGETS = frozenset({"ACCEPT", "DROP", "REJECT", "QUEUE", "NFQUEUE"})

ComplexEval = Callable[[int, Rule, Header], "bool | str"]


def observes(rule: Rule) -> bool:
    """An observing rule (log mirroring): its target is LOG or NFLOG or it has none, so it never decides."""
    return rule.target in MIRRORED_TARGETS


def never(index: int, rule: Rule, header: Header) -> bool:
    """The default complex_eval: complex checks never match."""
    return False


def rule_outcome(policy: Policy, index: int, header: Header, complex_eval: ComplexEval) -> str | None:
    """What rule `index` does to `header`: a verdict string, "" (matched, non-terminal: continue) or None (no match)."""
    r = policy.rules[index]
    if not any(b.contains(header) for b in r.boxes):
        return None
    if r.complex or r.approximate:
        res = complex_eval(index, r, header)
        if isinstance(res, str):
            return res
        if not res:
            return None
    if r.target == "RETURN":  # a RETURN in the base chain ends it: the chain policy applies
        return policy.default
    if r.target in VERDICT_TARGETS:
        return r.target
    return ""


def reference_verdict(policy: Policy, header: Header, complex_eval: ComplexEval | None = None) -> str:
    """First match over the flattened rule list; non-terminal targets (LOG, MARK, ...) continue."""
    ev = complex_eval or never
    for i in range(len(policy.rules)):
        out = rule_outcome(policy, i, header, ev)
        if out:
            return out
    return policy.default
