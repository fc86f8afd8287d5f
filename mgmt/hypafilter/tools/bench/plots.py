"""PNG plots of the paper-evaluation CSV rows (matplotlib, headless): one line plot per figure."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from matplotlib.figure import Figure

PAPER_SCALING_POINT = (5000, 18.3)  # §VIII-I: worst-case HSA vector calculation at 5,000 rules
MODE_ORDER = ("index", "selective", "exact", "lower_bound")
X_LABELS = {"K": "complex rules K", "step": "insertion #", "rules": "rules"}


def mean_std(rows: Sequence[dict], series: str, x: str, y: str) -> dict[str, tuple[list, list, list]]:
    """Per series value: (xs, mean of y over the other keys (sets), std)."""
    acc: dict[str, dict] = defaultdict(lambda: defaultdict(list))
    for r in rows:
        if r.get(y) in (None, ""):
            continue
        acc[str(r[series])][r[x]].append(float(r[y]))
    out = {}
    for s, by_x in acc.items():
        xs = sorted(by_x)
        out[s] = (xs, [float(np.mean(by_x[v])) for v in xs], [float(np.std(by_x[v])) for v in xs])
    return out


@dataclass(frozen=True)
class LinePlot:
    """One figure: `y` against `x`, a line (mean, std bars) per value of `series`; called as `plot(rows, path)`."""

    series: str
    x: str
    y: str
    title: str
    ylabel: str
    log: bool = False
    order: Sequence[str] = ()
    select: Callable[[Sequence[dict]], Sequence[dict]] | None = None  # CSV rows -> the rows to plot
    decorate: Callable | None = None

    def __call__(self, rows: Sequence[dict], path: Path) -> Path:
        # A bare Figure rather than pyplot: no global figure state and no display backend to choose.
        fig = Figure(figsize=(7, 4.2))
        ax = fig.subplots()
        data = mean_std(self.select(rows) if self.select else rows, self.series, self.x, self.y)
        keys = [k for k in self.order if k in data] + sorted(k for k in data if k not in self.order)
        for k in keys:
            xs, m, s = data[k]
            ax.errorbar(xs, m, yerr=s, marker="o", ms=3, capsize=2, label=k)
        if self.log:
            ax.set_yscale("log")
        if self.decorate:
            self.decorate(ax)
        ax.set_title(self.title, fontsize=10)
        ax.set_xlabel(X_LABELS[self.x])
        ax.set_ylabel(self.ylabel)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        return path


def _timed_updates(rows: Sequence[dict]) -> list[dict]:
    """Fig. 15's points: a series per strategy/mode, in ms; a new-core step whose build was not timed is left out."""
    return [
        {**r, "series": f"{r['strategy']}/{r['mode']}", "total_ms": float(r["total_s"]) * 1000.0}
        for r in rows
        if r.get("total_s") not in ("", None)
        and not (r.get("hardware") == "new core" and r.get("rebuild_s") in ("", None))
    ]


def _paper_point(ax) -> None:
    ax.set_xscale("log")
    ax.plot(*PAPER_SCALING_POINT, "r*", ms=12, label="paper: 18.3 s at 5,000 rules")


# `hypafilter bench paper` draws figure KEY of its results with `plots.KEY(rows, path)`.
fig11 = LinePlot(
    "mode", "K", "shunting_rules", "Fig. 11 — shunting rules (mean over sets, std)", "shunting rules", order=MODE_ORDER
)
fig12 = LinePlot(
    "mode",
    "K",
    "shunted_packets",
    "Fig. 12 — shunted packets (mean over sets, std)",
    "shunted packets",
    order=MODE_ORDER,
)
fig13 = LinePlot(
    "strategy",
    "K",
    "traversed_rules",
    "Fig. 13 — rules traversed in software for shunted packets (index-based shunting)",
    "traversed rules (sum over shunted packets)",
    log=True,
    order=("full", "cut", "hsa_cut", "interval", "interval_geo", "interval_vmap"),
)
fig14 = LinePlot(
    "mode",
    "K",
    "speedup",
    "Fig. 14 — speedup hybrid vs software-only (model, measured host cost)",
    "speedup (packet rate ratio)",
    log=True,
    order=MODE_ORDER,
)
fig15 = LinePlot(
    "series",
    "step",
    "total_ms",
    "Fig. 15 — update delay for consecutive insertions",
    "update delay [ms]",
    log=True,
    select=_timed_updates,
)
scaling = LinePlot(
    "mode",
    "rules",
    "analysis_s",
    "§VIII-I — shunt analysis time vs rule count",
    "seconds (median over repeats)",
    log=True,
    decorate=_paper_point,
)
