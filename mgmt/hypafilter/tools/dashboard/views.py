"""JSON views of snapshots: what /api returns and the page renders (pure functions, no I/O)."""

from __future__ import annotations

from typing import Any

from hypafilter.tools.dashboard.collector import HW_COUNTERS, SHUNT_REASONS, Deployment, Snapshot, counter_delta, rates

_REASON_COUNTER = {reason: c for c, (path, reason) in HW_COUNTERS.items() if path == "shunted"}


def _ratio(part: float, whole: float) -> float | None:
    return part / whole if whole > 0 else None


def totals(snap: Snapshot) -> dict[str, Any]:
    hw = snap.hw
    shunted = snap.shunted()
    classified = snap.classified()
    return {
        "forwarded": hw.get("CNT_FORWARDED", 0),
        "dropped": hw.get("CNT_DROPPED", 0),
        "shunted": shunted,
        "shunted_by_reason": {r: hw.get(_REASON_COUNTER[r], 0) for r in SHUNT_REASONS},
        "from_host": hw.get("CNT_FROM_HOST", 0),
        "fifo_drop": hw.get("CNT_FIFO_DROP", 0),
        "classified": classified,
        "shunt_ratio": _ratio(shunted, classified),
        "netfilter_main_packets": snap.nf_main[0],
    }


def rate_point(prev: Snapshot, cur: Snapshot) -> dict[str, Any]:
    r = rates(prev, cur)
    return {
        "seq": cur.seq,
        "time": cur.time,
        "seconds": r.seconds,
        "valid": r.valid,
        "forwarded": r.hw["CNT_FORWARDED"],
        "dropped": r.hw["CNT_DROPPED"],
        "shunted": r.shunted,
        "shunted_by_reason": {reason: r.hw[_REASON_COUNTER[reason]] for reason in SHUNT_REASONS},
        "from_host": r.hw["CNT_FROM_HOST"],
        "classified": r.classified,
        "shunt_ratio": r.shunt_ratio,
        "netfilter_main": r.nf_main,
    }


def summary(snaps: list[Snapshot]) -> dict[str, Any]:
    """The latest totals and the rates over the last sampling interval."""
    if not snaps:
        return {
            "seq": 0,
            "time": None,
            "deployed": False,
            "generation": None,
            "totals": None,
            "rates": None,
            "errors": [],
        }
    cur = snaps[-1]
    dep = cur.deployment
    return {
        "seq": cur.seq,
        "time": cur.time,
        "deployed": dep is not None,
        "generation": cur.generation,
        "policy_hash": dep.policy_hash if dep else None,
        "totals": totals(cur) if cur.hw else None,
        "rates": rate_point(snaps[-2], cur) if len(snaps) >= 2 else None,
        "errors": list(cur.errors),
    }


def series(snaps: list[Snapshot], last: int | None = None) -> dict[str, Any]:
    """Rate points between consecutive snapshots (oldest first), optionally only the last `last` of them."""
    if last is not None:
        snaps = snaps[-(last + 1) :] if last > 0 else snaps[-1:]
    points = [rate_point(a, b) for a, b in zip(snaps, snaps[1:], strict=False)]
    return {"points": points, "reasons": list(SHUNT_REASONS)}


def rules_view(snaps: list[Snapshot]) -> dict[str, Any]:
    """The original policy rule by rule, hardware HITS merged with netfilter counters.

    hw_hits: packets whose first matching hardware entry is the rule's. nf_packets: packets the netfilter rules
    emitted for it matched (complex rules; simple rules on the k = 0 path, and shunted simple rules the software
    strategy evaluates again). hits = nf_packets, plus hw_hits when the hardware's first matches are final or go to
    a software path that does not count them again (RuleInfo.counts_hw). Under the interval strategy the hardware
    count of a shunting simple rule still includes packets an earlier complex rule then claims in software.
    """
    if not snaps or snaps[-1].deployment is None:
        return {"seq": snaps[-1].seq if snaps else 0, "generation": None, "rules": [], "policy_entry": None}
    cur = snaps[-1]
    dep = cur.deployment
    prev = snaps[-2] if len(snaps) >= 2 and snaps[-2].generation == cur.generation else None
    dt = (cur.mono - prev.mono) if prev else 0.0

    def hw_of(s: Snapshot, rule) -> int:
        return s.hits[rule.entry] if rule.entry is not None and rule.entry < len(s.hits) else 0

    def hits_of(s: Snapshot, rule) -> int:
        return (hw_of(s, rule) if rule.counts_hw else 0) + s.nf.get(rule.index, (0, 0))[0]

    rows = []
    for rule in dep.rules:
        hw = hw_of(cur, rule)
        nf_p, nf_b = cur.nf.get(rule.index, (0, 0))
        hits = hits_of(cur, rule)
        rate = None
        if prev is not None and dt > 0 and prev.hits and cur.hits:
            rate = counter_delta(hits_of(prev, rule), hits) / dt
        rows.append(
            {
                "index": rule.index,
                "text": rule.text,
                "where": rule.where,
                "target": rule.target,
                "kind": "simple" if rule.simple else "complex",
                "entry": rule.entry,
                "shunting": rule.shunt,
                "hw_hits": hw,
                "nf_packets": nf_p,
                "nf_bytes": nf_b,
                "hits": hits,
                "hits_rate": rate,
            }
        )
    n = dep.n_entries
    policy_entry = {
        "entry": n,
        "default": dep.default,
        "shunting": dep.policy_shunt,
        "hw_hits": cur.hits[n] if n < len(cur.hits) else 0,
    }
    return {"seq": cur.seq, "generation": dep.generation, "rules": rows, "policy_entry": policy_entry}


def deployment_view(dep: Deployment | None) -> dict[str, Any]:
    if dep is None:
        return {"deployed": False, "history": []}
    return {
        "deployed": True,
        "generation": dep.generation,
        "policy": dep.policy,
        "policy_hash": dep.policy_hash,
        "target": dep.target,
        "mode": dep.mode,
        "strategy": dep.strategy,
        "default": dep.default,
        "chains": dep.prefix + "*",
        "netns": dep.netns,
        "partition": dep.partition,
        "history": [
            {
                "generation": u.generation,
                "kind": u.kind,
                "started": u.started,
                "duration": u.duration,
                "ok": u.ok,
                "policy_hash": u.policy_hash,
                "policy": u.policy,
                "error": u.error,
                "steps": dict(u.steps),
            }
            for u in dep.history
        ],
    }


def snapshot_view(snap: Snapshot) -> dict[str, Any]:
    """The raw counters of one snapshot."""
    return {
        "seq": snap.seq,
        "time": snap.time,
        "generation": snap.generation,
        "hw": dict(snap.hw),
        "hits": list(snap.hits),
        "netfilter": {str(i): {"packets": p, "bytes": b} for i, (p, b) in sorted(snap.nf.items())},
        "netfilter_main": {"packets": snap.nf_main[0], "bytes": snap.nf_main[1]},
        "errors": list(snap.errors),
    }
