"""Prometheus exposition of the newest snapshot: counters accumulated by the collector, gauges of the deployment.

Conventions (docs/dashboard.md): every `*_total` is a counter of the exporter process (it never goes down while the
process runs: NIC restarts, new generations and undeploys are absorbed by the collector); within one family the
label values partition what is counted, so a sum over any label is a total; rules are named by a stable id.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from hypafilter.tools.dashboard.collector import (
    FLOWSYNC_COUNTERS,
    UPDATE_BUCKETS,
    WIRE_DECISIONS,
    Snapshot,
    Totals,
    rates,
)

# Per-rule series are exported up to this many rules: above it, one series per rule costs more (a 50,000-rule
# policy made 7.9 MB per scrape) than it tells; /api/rules pages through every rule instead.
RULE_SERIES_LIMIT = 1000
DRIFT_PARTS: tuple[str, ...] = ("netfilter", "shim", "nic", "flowsync", "policysync")
# The policy sync service's counters (docs/deploy.md, "Live policy"), as the service counts them since it started.
POLICYSYNC_COUNTERS = ("events", "changes", "applied", "unchanged", "failed", "resyncs", "own")


def _fmt(b: float) -> str:
    return repr(float(b))


def update_histogram(t: Totals) -> HistogramMetricFamily:
    h = HistogramMetricFamily(
        "hypafilter_update_duration_seconds", "Duration of successful deploys and updates seen by this exporter."
    )
    buckets = [(_fmt(b), n) for b, n in zip(UPDATE_BUCKETS, t.update_buckets, strict=True)]
    buckets.append(("+Inf", t.update_count))
    h.add_metric([], buckets, sum_value=t.update_sum)
    return h


def flowsync_gauges(fs: dict) -> Iterator[Metric]:
    """The flow sync service's gauges: whether it should and does run, flows offloaded, the hardware table's
    occupancy, and the sync lag (conntrack event read -> hardware write done) over its last samples."""
    for name, text, value in (
        ("hypafilter_flowsync_wanted", "1 when the deployment wants the flow sync service.", fs.get("wanted")),
        ("hypafilter_flowsync_up", "1 when the flow sync service runs.", fs.get("running")),
    ):
        g = GaugeMetricFamily(name, text)
        g.add_metric([], 1.0 if value else 0.0)
        yield g
    if not fs.get("running"):
        return
    for name, text, key in (
        ("hypafilter_flows_offloaded", "Flows the service installed in the hardware flow cache.", "offloaded"),
        ("hypafilter_flow_cache_occupancy", "Valid entries of the hardware flow cache (FC_OCCUPANCY).", "occupancy"),
    ):
        g = GaugeMetricFamily(name, text)
        g.add_metric([], float(fs[key]) if fs.get(key) is not None else math.nan)
        yield g
    lag = GaugeMetricFamily(
        "hypafilter_flowsync_lag_seconds",
        "Sync lag, conntrack event read to hardware write done, over the service's last samples (NaN: none).",
        labels=["quantile"],
    )
    for q, key in (("0.5", "lag_p50_ms"), ("1", "lag_max_ms")):
        v = fs.get(key)
        lag.add_metric([q], v / 1000 if v is not None else math.nan)
    yield lag


def policysync_metrics(ps: dict) -> Iterator[Metric]:
    """The policy sync service: up, following (no change it could not apply), shunting everything for a change
    now, its lease on the fast path (armed; expired: the fast path shunts everything), its counters, its two lags,
    and the update buffer's slots in use."""
    running = bool(ps.get("running"))
    lease = ps.get("lease") or {}
    for name, text, value in (
        ("hypafilter_policysync_up", "1 when the policy sync service runs.", running),
        (
            "hypafilter_policysync_following",
            "1 when it follows the live ruleset (no change it failed).",
            running and bool(ps.get("following")),
        ),
        (
            "hypafilter_policysync_shunting_all",
            "1 while a change makes the fast path shunt everything.",
            running and bool(ps.get("safe")),
        ),
        ("hypafilter_policysync_lease_armed", "1 when the fast path holds a policy sync lease.", lease.get("armed")),
        (
            "hypafilter_policysync_lease_expired",
            "1 when the policy sync lease expired: the fast path shunts everything (the service did not renew it).",
            lease.get("expired"),
        ),
    ):
        g = GaugeMetricFamily(name, text)
        g.add_metric([], 1.0 if value else 0.0)
        yield g
    if running:
        c = CounterMetricFamily(
            "hypafilter_policysync_operations",
            "Policy sync service since it started: nf_tables events, foreign changes, changes applied, listings "
            "equal to the deployed policy, failures, resyncs after lost events, its own changes recognised.",
            labels=["what"],
        )
        for k in POLICYSYNC_COUNTERS:
            c.add_metric([k], float(ps.get(k) or 0))
        yield c
        lag = GaugeMetricFamily(
            "hypafilter_policysync_lag_seconds",
            "Events read to the fail safe in force (stage safe) and to the fast path deciding again (stage apply), "
            "over the service's last samples (NaN: none).",
            labels=["stage", "quantile"],
        )
        for stage, key in (("safe", "lag_safe_ms"), ("apply", "lag_apply_ms")):
            d = ps.get(key) or {}
            for q, k in (("0.5", "p50"), ("0.99", "p99"), ("1", "max")):
                v = d.get(k)
                lag.add_metric([stage, q], v / 1000 if v is not None else math.nan)
        yield lag
    buf = ps.get("buffer")
    g = GaugeMetricFamily(
        "hypafilter_update_buffer_slots", "The update buffer's slots: in use, and the matcher's depth.", labels=["what"]
    )
    g.add_metric(["used"], float(buf["used"]) if buf else 0.0)
    g.add_metric(["depth"], float(buf["depth"]) if buf else 0.0)
    yield g


def drift_parts(drift: tuple[str, ...]) -> dict[str, int]:
    """1 for each part of the system (netfilter, shim, nic) that ops.deploy.drift found different, else 0."""
    out = dict.fromkeys(DRIFT_PARTS, 0)
    for d in drift:
        part = d.split(":", 1)[0].strip()
        out[part if part in out else "other"] = 1
    return out


class SnapshotCollector:
    """A prometheus_client custom collector reading the newest snapshots on every scrape."""

    def __init__(self, snapshots: Callable[[], list[Snapshot]], rule_series_limit: int = RULE_SERIES_LIMIT):
        self._snapshots = snapshots
        self._rule_limit = rule_series_limit

    def collect(self) -> Iterator[Metric]:
        snaps = self._snapshots()
        if not snaps:
            return
        cur = snaps[-1]
        dep = cur.deployment
        up = GaugeMetricFamily("hypafilter_deployed", "1 when a policy is deployed.")
        up.add_metric([], 1.0 if dep else 0.0)
        yield up
        errs = GaugeMetricFamily("hypafilter_collector_errors", "Sources that failed in the newest snapshot.")
        errs.add_metric([], float(len(cur.errors)))
        yield errs
        ts = GaugeMetricFamily("hypafilter_snapshot_timestamp_seconds", "Unix time of the newest snapshot.")
        ts.add_metric([], cur.time)
        yield ts
        # Counters of the process: shown whether or not something is deployed now.
        yield from self._counters(cur.totals or Totals(), dep, cur)
        if dep is None:
            return

        gen = GaugeMetricFamily("hypafilter_generation", "Deployed configuration generation.")
        gen.add_metric([], float(dep.generation))
        yield gen
        info = GaugeMetricFamily(
            "hypafilter_deployment_info", "What is deployed.", labels=["policy_hash", "target", "mode", "strategy"]
        )
        info.add_metric([dep.policy_hash, dep.target, dep.mode, dep.strategy], 1.0)
        yield info
        part = dep.partition
        rules = GaugeMetricFamily("hypafilter_rules", "Rules of the deployed policy by kind.", labels=["kind"])
        rules.add_metric(["simple"], float(part["simple"]))
        rules.add_metric(["complex"], float(part["complex"]))
        yield rules
        entries = GaugeMetricFamily("hypafilter_hardware_entries", "Hardware entries (without the policy entry).")
        entries.add_metric([], float(part["hardware_entries"]))
        yield entries
        shunting = GaugeMetricFamily("hypafilter_shunting_entries", "Hardware entries whose shunt bit is set.")
        shunting.add_metric([], float(part["shunting_entries"]))
        yield shunting

        # Always present while deployed: NaN when the last interval classified nothing (0/0 has no ratio), so an
        # idle link neither loses the series nor reads as "nothing shunted".
        ratio = GaugeMetricFamily(
            "hypafilter_shunt_ratio",
            "Shunted / classified frames over the last sampling interval (NaN: no traffic or no reading).",
        )
        r = rates(snaps[-2], cur) if len(snaps) >= 2 else None
        ratio.add_metric([], r.shunt_ratio if r is not None and r.valid and r.shunt_ratio is not None else math.nan)
        yield ratio

        if cur.drift is not None:
            drift = GaugeMetricFamily(
                "hypafilter_drift",
                "1 when the live part differs from what was deployed (hypafilter status), else 0.",
                labels=["what"],
            )
            for what, v in drift_parts(cur.drift).items():
                drift.add_metric([what], float(v))
            yield drift

        if cur.flowsync:
            yield from flowsync_gauges(cur.flowsync)
        if cur.policysync:
            yield from policysync_metrics(cur.policysync)

        n = len(dep.rules)
        shown = GaugeMetricFamily(
            "hypafilter_rule_series", "Rules with per-rule series in this exposition (all rules are in /api/rules)."
        )
        shown.add_metric([], float(n if n <= self._rule_limit else 0))
        yield shown
        if n <= self._rule_limit:
            yield from self._rules(cur.totals or Totals(), dep)

    def _counters(self, t: Totals, dep, cur: Snapshot) -> Iterator[Metric]:
        wire = CounterMetricFamily(
            "hypafilter_wire_frames",
            "Frames from the wire by the hardware's decision; each frame counts once (decision, reason).",
            labels=["decision", "reason"],
        )
        for c, (decision, reason) in WIRE_DECISIONS.items():
            wire.add_metric([decision, reason], float(t.hw.get(c, 0)))
        yield wire
        for name, c, text in (
            (
                "hypafilter_forced_shunt_frames",
                "CNT_SHUNT_FORCED",
                "Shunted frames that were shunted because of "
                "shunt-all during an update (also counted under their reason in hypafilter_wire_frames_total).",
            ),
            (
                "hypafilter_mirrored_frames",
                "CNT_MIRROR",
                "Frames the hardware decided whose copy (or, in host mode, the frame) went to the host with reason "
                '"mirror" for its observing rules (also counted under their decision in hypafilter_wire_frames_total).',
            ),
            ("hypafilter_from_host_frames", "CNT_FROM_HOST", "Frames the host sent back through the NIC."),
            ("hypafilter_fifo_drop_frames", "CNT_FIFO_DROP", "Frames lost to a full FIFO."),
        ):
            m = CounterMetricFamily(name, text)
            m.add_metric([], float(t.hw.get(c, 0)))
            yield m
        pe = CounterMetricFamily("hypafilter_policy_entry_hits", "Frames no hardware entry matched (policy entry).")
        pe.add_metric([], float(t.policy_entry))
        yield pe
        main = CounterMetricFamily(
            "hypafilter_netfilter_main_packets", "Packets that entered the tool's netfilter chains (shunted or k = 0)."
        )
        main.add_metric([], float(t.nf_main))
        yield main
        updates = CounterMetricFamily(
            "hypafilter_updates", "Deploys, updates and undeploys seen by this exporter.", labels=["kind", "result"]
        )
        for (kind, result), n in sorted(t.updates.items()):
            updates.add_metric([kind, result], float(n))
        yield updates
        yield update_histogram(t)
        fs = CounterMetricFamily(
            "hypafilter_flowsync_operations",
            "Flow sync service (docs/flowsync.md): hardware inserts, deletes (conntrack destroyed or left "
            "ESTABLISHED), evictions (the poll or a resync found conntrack without the flow), insert failures (set "
            "full), conntrack timeout refreshes, conntrack events read, errors.",
            labels=["op"],
        )
        for c in FLOWSYNC_COUNTERS:
            fs.add_metric([c], float(t.flowsync.get(c, 0)))
        yield fs

    def _rules(self, t: Totals, dep) -> Iterator[Metric]:
        info = GaugeMetricFamily(
            "hypafilter_rule_info",
            "One series per deployed rule: its stable id and where it is written now.",
            labels=["rule", "index", "chain", "where", "kind", "target"],
        )
        hw = CounterMetricFamily(
            "hypafilter_rule_hardware_hits",
            "Frames whose first matching hardware entry is the rule's (with the policy entry: every frame once).",
            labels=["rule"],
        )
        nf = CounterMetricFamily(
            "hypafilter_rule_netfilter_packets", "Packets the rule's netfilter lines matched.", labels=["rule"]
        )
        for r in dep.rules:
            kind = "simple" if r.simple else "complex"
            info.add_metric([r.id, str(r.index), r.chain, r.where, kind, r.target], 1.0)
            if r.entry is not None:
                hw.add_metric([r.id], float(t.rule_hw.get(r.id, 0)))
            nf.add_metric([r.id], float(t.rule_nf.get(r.id, 0)))
        yield info
        yield hw
        yield nf


def render(snapshots: Callable[[], list[Snapshot]], rule_series_limit: int = RULE_SERIES_LIMIT) -> bytes:
    """The Prometheus text exposition of the newest snapshots."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SnapshotCollector(snapshots, rule_series_limit))
    return generate_latest(registry)
