"""Prometheus exposition of the latest snapshot: the same counters as /api, with path/reason labels."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from hypafilter.tools.dashboard.collector import HW_COUNTERS, Snapshot, rates

# Deploys and updates take from well under a second (cached build, table rewrite) to minutes (cold emulator build).
UPDATE_BUCKETS: tuple[float, ...] = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


def update_histogram(durations: list[float], buckets: tuple[float, ...] = UPDATE_BUCKETS) -> HistogramMetricFamily:
    h = HistogramMetricFamily(
        "hypafilter_update_duration_seconds", "Duration of successful deploys and updates (deploy journal)."
    )
    cumulative = []
    for b in buckets:
        cumulative.append((_fmt(b), sum(1 for d in durations if d <= b)))
    cumulative.append(("+Inf", len(durations)))
    h.add_metric([], cumulative, sum_value=float(sum(durations)))
    return h


def _fmt(b: float) -> str:
    return repr(float(b))


class SnapshotCollector:
    """A prometheus_client custom collector reading the newest snapshots on every scrape."""

    def __init__(self, snapshots: Callable[[], list[Snapshot]]):
        self._snapshots = snapshots

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

        if cur.hw:
            frames = CounterMetricFamily(
                "hypafilter_hardware_frames",
                "Frames the hardware classified, by path (forwarded, dropped, shunted, ...) and shunt reason.",
                labels=["path", "reason"],
            )
            for c, (path, reason) in HW_COUNTERS.items():
                frames.add_metric([path, reason], float(cur.hw.get(c, 0)))
            yield frames
            if len(snaps) >= 2:
                r = rates(snaps[-2], cur)
                ratio = GaugeMetricFamily(
                    "hypafilter_shunt_ratio", "Shunted / classified frames over the last sampling interval."
                )
                if r.shunt_ratio is not None:
                    ratio.add_metric([], r.shunt_ratio)
                    yield ratio

        hits = CounterMetricFamily(
            "hypafilter_rule_hits",
            "Per policy rule: first matches in hardware (source=hardware) and netfilter matches (source=netfilter).",
            labels=["rule", "kind", "source"],
        )
        for rule in dep.rules:
            kind = "simple" if rule.simple else "complex"
            if rule.entry is not None and rule.entry < len(cur.hits):
                hits.add_metric([str(rule.index), kind, "hardware"], float(cur.hits[rule.entry]))
            hits.add_metric([str(rule.index), kind, "netfilter"], float(cur.nf.get(rule.index, (0, 0))[0]))
        yield hits
        if dep.n_entries < len(cur.hits):
            pe = CounterMetricFamily("hypafilter_policy_entry_hits", "Frames no hardware entry matched.")
            pe.add_metric([], float(cur.hits[dep.n_entries]))
            yield pe
        main = CounterMetricFamily(
            "hypafilter_netfilter_main_packets", "Packets that entered the tool's netfilter chains (shunted or k = 0)."
        )
        main.add_metric([], float(cur.nf_main[0]))
        yield main

        updates = CounterMetricFamily(
            "hypafilter_updates", "Deploys and updates in the journal.", labels=["kind", "result"]
        )
        counts: dict[tuple[str, str], int] = {}
        for u in dep.history:
            key = (u.kind, "ok" if u.ok else "failed")
            counts[key] = counts.get(key, 0) + 1
        for (kind, result), n in sorted(counts.items()):
            updates.add_metric([kind, result], float(n))
        yield updates
        yield update_histogram([u.duration for u in dep.history if u.ok])


def render(snapshots: Callable[[], list[Snapshot]]) -> bytes:
    """The Prometheus text exposition of the newest snapshots."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SnapshotCollector(snapshots))
    return generate_latest(registry)
