"""PNG plots of the paper-evaluation CSV rows (matplotlib, headless): one function per figure."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

PAPER_SCALING_POINT = (5000, 18.3)  # §VIII-I: worst-case HSA vector calculation at 5,000 rules


def _plt():
    import matplotlib  # noqa: PLC0415 (only the bench needs it, and only headless)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    return plt


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


def _lines(
    path: Path,
    rows: Sequence[dict],
    series: str,
    x: str,
    y: str,
    title: str,
    xlabel: str,
    ylabel: str,
    log: bool = False,
    order: Sequence[str] = (),
    decorate: Callable | None = None,
) -> Path:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.2))
    data = mean_std(rows, series, x, y)
    keys = [k for k in order if k in data] + sorted(k for k in data if k not in order)
    for k in keys:
        xs, m, s = data[k]
        ax.errorbar(xs, m, yerr=s, marker="o", ms=3, capsize=2, label=k)
    if log:
        ax.set_yscale("log")
    if decorate:
        decorate(ax)
    ax.set_title(title, fontsize=10)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


MODE_ORDER = ("index", "selective", "exact", "lower_bound")


def fig11(rows, path: Path) -> Path:
    return _lines(
        path,
        rows,
        "mode",
        "K",
        "shunting_rules",
        "Fig. 11 — shunting rules (mean over sets, std)",
        "complex rules K",
        "shunting rules",
        order=MODE_ORDER,
    )


def fig12(rows, path: Path) -> Path:
    return _lines(
        path,
        rows,
        "mode",
        "K",
        "shunted_packets",
        "Fig. 12 — shunted packets (mean over sets, std)",
        "complex rules K",
        "shunted packets",
        order=MODE_ORDER,
    )


def fig13(rows, path: Path) -> Path:
    return _lines(
        path,
        rows,
        "strategy",
        "K",
        "traversed_rules",
        "Fig. 13 — rules traversed in software for shunted packets (index-based shunting)",
        "complex rules K",
        "traversed rules (sum over shunted packets)",
        log=True,
        order=("full", "cut", "hsa_cut", "interval", "interval_geo", "interval_vmap"),
    )


def fig14(rows, path: Path) -> Path:
    return _lines(
        path,
        rows,
        "mode",
        "K",
        "speedup",
        "Fig. 14 — speedup hybrid vs software-only (model, measured host cost)",
        "complex rules K",
        "speedup (packet rate ratio)",
        log=True,
        order=MODE_ORDER,
    )


def fig15(rows, path: Path) -> Path:
    ok = [
        {**r, "series": f"{r['strategy']}/{r['mode']}", "total_ms": float(r["total_s"]) * 1000.0}
        for r in rows
        if r.get("total_s") not in ("", None)
        and not (r.get("hardware") == "new core" and r.get("rebuild_s") in ("", None))  # total without the build
    ]
    return _lines(
        path,
        ok,
        "series",
        "step",
        "total_ms",
        "Fig. 15 — update delay for consecutive insertions",
        "insertion #",
        "update delay [ms]",
        log=True,
    )


def scaling(rows, path: Path) -> Path:
    def mark(ax):
        ax.set_xscale("log")
        ax.plot(*PAPER_SCALING_POINT, "r*", ms=12, label="paper: 18.3 s at 5,000 rules")

    return _lines(
        path,
        rows,
        "mode",
        "rules",
        "analysis_s",
        "§VIII-I — shunt analysis time vs rule count",
        "rules",
        "seconds (median over repeats)",
        log=True,
        decorate=mark,
    )
