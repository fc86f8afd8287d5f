"""Observing rules on both paths: did the hybrid's netfilter see exactly the frames the kernel's observing rules see?

An observing rule (a LOG, NFLOG, AUDIT, TRACE or ULOG target, or no target at all: a counting rule) never decides a
verdict, so comparing verdicts cannot tell whether the hybrid ran it on the right frames. Its packet counter can:
in the plain namespace the policy runs alone, in the firewall namespace the tool's chains hold one or more copies
of each rule (the verbatim FULL chain, interval segments and blocks, helper chains of a flattened rule), and a
frame walks at most one of them. So for every observing rule of the oracle, the counter delta over a run must equal
the sum of the deltas of the firewall's rules with the same text (`iptables-save -c`, the kernel's own rendering,
compared after the chain name). The rules are told apart by their text alone: identical rules add up on both sides.

Counters come from the kernel, never from the code under test; `verify` reports the comparison as
report["observers"] (and `make fuzz` counts its mismatches).
"""

from __future__ import annotations

import re
import time
from collections import Counter
from collections.abc import Callable

from hypafilter import netns
from hypafilter.ir.semantics import OBSERVING_TARGETS

_LINE = re.compile(r"^\[(\d+):\d+\] -A (\S+) (.*)$")
_TARGET = re.compile(r"(?:^| )-[jg] (\S+)")


def observing(rule_text: str) -> bool:
    """Whether an `iptables-save` rule body (after the chain name) only observes: no target, or an observing one."""
    m = _TARGET.search(rule_text)
    return m is None or m.group(1) in OBSERVING_TARGETS


def snapshot(ns: str, table: str = "filter") -> Counter:
    """Packet counters of the observing rules in `ns`, summed by rule text."""
    out: Counter = Counter()
    for line in netns.run(["iptables-save", "-c", "-t", table], ns).splitlines():
        m = _LINE.match(line)
        if m and observing(m.group(3)):
            out[m.group(3)] += int(m.group(1))
    return out


def settled(ns: str, table: str = "filter", limit: float = 1.0, step: float = 0.05) -> Counter:
    """snapshot() once two reads `step` apart agree (frames still in a softirq finish their walk), at most `limit` s."""
    last = snapshot(ns, table)
    end = time.monotonic() + limit
    while time.monotonic() < end:
        time.sleep(step)
        now = snapshot(ns, table)
        if now == last:
            return now
        last = now
    return last


def compare(
    fw_before: Counter,
    fw_after: Counter,
    plain_before: Counter,
    plain_after: Counter,
    comparable: Callable[[str], bool] = lambda text: True,
) -> dict:
    """Per observing rule of the oracle: its counter delta against the firewall's (same text). Rules the firewall
    lacks count as 0 there (a rule the hybrid never ran). A rule `comparable` rejects (its count depends on time or
    chance, e.g. a rate limit that triggers) is reported, never counted as a mismatch."""
    rows = []
    for text in sorted(set(plain_after) | set(plain_before)):
        oracle = plain_after[text] - plain_before[text]
        hybrid = fw_after[text] - fw_before[text]
        rows.append({"rule": text, "oracle": oracle, "hybrid": hybrid, "comparable": comparable(text)})
    bad = [r for r in rows if r["comparable"] and r["oracle"] != r["hybrid"]]
    return {
        "rules": len(rows),
        "not_comparable": sum(not r["comparable"] for r in rows),
        "matched_oracle": sum(r["oracle"] for r in rows),
        "matched_hybrid": sum(r["hybrid"] for r in rows),
        "mismatches": len(bad),
        "examples": bad[:10],
    }
