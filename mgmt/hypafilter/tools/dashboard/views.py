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
        "mirrored": hw.get("CNT_MIRROR", 0),  # a subset of forwarded + dropped: the host also got them (reason 4)
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
        "mirrored": r.hw["CNT_MIRROR"],
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
            "drift": None,
            "flowsync": None,
            "policysync": None,
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
        # What `hypafilter status` reports as drift: [] none, None not checked yet (or nothing deployed).
        "drift": list(cur.drift) if cur.drift is not None else None,
        "flowsync": flowsync_view(cur),
        "policysync": policysync_view(cur),
    }


POLICYSYNC_FIELDS = (
    "running",
    "following",
    "error",
    "safe",
    "events",
    "changes",
    "applied",
    "unchanged",
    "failed",
    "resyncs",
    "own",
    "lag_safe_ms",
    "lag_apply_ms",
    "last_kind",
    "buffer",
    "lease",
    "pid",
)


def policysync_view(snap: Snapshot) -> dict[str, Any] | None:
    """The policy sync service (docs/deploy.md, "Live policy"): whether it follows the live ruleset, its counters
    and lags, the update buffer's use, the fast path's lease. None: nothing deployed."""
    ps = snap.policysync
    if not ps:
        return None
    return {k: ps.get(k) for k in POLICYSYNC_FIELDS}


FLOWSYNC_FIELDS = ("offloaded", "occupancy", "lag_p50_ms", "lag_max_ms", "lag_samples", "last_error", "pid")


def flowsync_view(snap: Snapshot) -> dict[str, Any] | None:
    """The flow sync service (docs/flowsync.md): whether it should and does run, its gauges, and its counters
    accumulated by the collector (they never go down across service restarts). None: nothing deployed."""
    fs = snap.flowsync
    if not fs:
        return None
    out: dict[str, Any] = {
        "wanted": bool(fs.get("wanted")),
        "running": bool(fs.get("running")),
        "reason": fs.get("reason", ""),
    }
    out.update({k: fs.get(k) for k in FLOWSYNC_FIELDS})
    out["counters"] = dict(snap.totals.flowsync) if snap.totals else {}
    return out


def series(snaps: list[Snapshot], last: int | None = None) -> dict[str, Any]:
    """Rate points between consecutive snapshots (oldest first), optionally only the last `last` of them."""
    if last is not None:
        snaps = snaps[-(last + 1) :] if last > 0 else snaps[-1:]
    points = [rate_point(a, b) for a, b in zip(snaps, snaps[1:], strict=False)]
    return {"points": points, "reasons": list(SHUNT_REASONS)}


RULE_SORTS = ("index", "hits", "hw_hits", "nf_packets", "hits_rate")
_RULE_SUMS: dict[str, tuple] = {}  # "last": (snapshot key, hits, rates) of the newest rules_view
MAX_PAGE = 1000


def rules_view(
    snaps: list[Snapshot],
    offset: int = 0,
    limit: int = 100,
    sort: str = "index",
    order: str | None = None,
    q: str | None = None,
) -> dict[str, Any]:
    """The original policy rule by rule, hardware HITS merged with netfilter counters, one page of it.

    hw_hits: packets whose first matching hardware entry is the rule's. nf_packets: packets the netfilter rules
    emitted for it matched (complex rules; simple rules on the k = 0 path, and shunted simple rules the software
    strategy evaluates again). hits = nf_packets, plus hw_hits when the hardware's first matches are final or go to
    a software path that does not count them again (RuleInfo.counts_hw). Under the interval strategy the hardware
    count of a shunting simple rule still includes packets an earlier complex rule then claims in software.

    Rows are filtered by `q` (a substring of the rule's text, where, id or kind), sorted by `sort` (`order` asc or
    desc; counters default to desc) and cut to [offset, offset + limit); `matched` counts the filtered rows and
    `max_hits` is over all rules, so bars keep one scale across pages.
    """
    if sort not in RULE_SORTS:
        raise ValueError(f"sort must be one of {', '.join(RULE_SORTS)}")
    order = order or ("asc" if sort == "index" else "desc")
    if order not in ("asc", "desc"):
        raise ValueError("order must be asc or desc")
    limit = max(0, min(limit, MAX_PAGE))
    if not snaps or snaps[-1].deployment is None:
        return {
            "seq": snaps[-1].seq if snaps else 0,
            "generation": None,
            "total": 0,
            "matched": 0,
            "offset": offset,
            "limit": limit,
            "sort": sort,
            "order": order,
            "max_hits": 0,
            "rules": [],
            "policy_entry": None,
        }
    cur = snaps[-1]
    dep = cur.deployment
    prev = snaps[-2] if len(snaps) >= 2 and snaps[-2].generation == cur.generation else None
    dt = (cur.mono - prev.mono) if prev else 0.0
    with_rate = prev is not None and dt > 0 and bool(prev.hits) and bool(cur.hits)

    def hw_of(s: Snapshot, rule) -> int:
        return s.hits[rule.entry] if rule.entry is not None and rule.entry < len(s.hits) else 0

    def hits_of(s: Snapshot, rule) -> int:
        return (hw_of(s, rule) if rule.counts_hw else 0) + s.nf.get(rule.index, (0, 0))[0]

    rules = dep.rules
    # Every page of one snapshot shares the per-rule sums (50,000 of them at the scale the page must stay usable).
    key = (cur.seq, prev.seq if prev else None, id(dep))
    cached = _RULE_SUMS.get("last")
    if cached is not None and cached[0] == key:
        hits, rates_ = cached[1], cached[2]
    else:
        hits = [hits_of(cur, r) for r in rules]
        rates_ = (
            [counter_delta(hits_of(prev, r), h) / dt for r, h in zip(rules, hits, strict=True)] if with_rate else None
        )
        _RULE_SUMS["last"] = (key, hits, rates_)
    chosen = range(len(rules))
    if q:
        needle = q.lower()
        chosen = [
            i
            for i in chosen
            if needle in rules[i].text.lower()
            or needle in rules[i].where.lower()
            or needle == rules[i].id
            or needle == ("simple" if rules[i].simple else "complex")
        ]
    keys = {
        "index": None,
        "hits": lambda i: hits[i],
        "hw_hits": lambda i: hw_of(cur, rules[i]),
        "nf_packets": lambda i: cur.nf.get(i, (0, 0))[0],
        "hits_rate": lambda i: rates_[i] if rates_ else 0.0,
    }
    key = keys[sort]
    if key is None:
        chosen = list(chosen) if order == "asc" else list(reversed(chosen))
    else:
        # Stable: equal counts keep policy order, whichever the direction.
        chosen = sorted(chosen, key=lambda i: (-key(i), i) if order == "desc" else (key(i), i))
    rows = []
    for i in chosen[offset : offset + limit]:
        rule = rules[i]
        nf_p, nf_b = cur.nf.get(rule.index, (0, 0))
        rows.append(
            {
                "index": rule.index,
                "id": rule.id,
                "text": rule.text,
                "where": rule.where,
                "chain": rule.chain,
                "target": rule.target,
                "kind": "simple" if rule.simple else "complex",
                "entry": rule.entry,
                "shunting": rule.shunt,
                "hw_hits": hw_of(cur, rule),
                "nf_packets": nf_p,
                "nf_bytes": nf_b,
                "hits": hits[i],
                "hits_rate": rates_[i] if rates_ else None,
            }
        )
    n = dep.n_entries
    policy_entry = {
        "entry": n,
        "default": dep.default,
        "shunting": dep.policy_shunt,
        "hw_hits": cur.hits[n] if n < len(cur.hits) else 0,
    }
    return {
        "seq": cur.seq,
        "generation": dep.generation,
        "total": len(rules),
        "matched": len(chosen),
        "offset": offset,
        "limit": limit,
        "sort": sort,
        "order": order,
        "max_hits": max(hits, default=0),
        "rules": rows,
        "policy_entry": policy_entry,
    }


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
