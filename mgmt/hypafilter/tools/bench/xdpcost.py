"""The fast path's per-frame cost and verifier figures for a policy (`hypafilter bench xdp-cost`): the program built
for the plan runs every frame `repeat` times through BPF_PROG_TEST_RUN in a scratch namespace."""

from __future__ import annotations

import os
import random
import statistics
import time

from hypafilter import netns
from hypafilter.errors import HypafilterError
from hypafilter.targets.xdp.run import run_frames
from hypafilter.targets.xdp.tables import FAST_FIELDS, build_tables


def xdp_cost(
    plan, policy, frames: int = 2000, repeat: int = 100, seed: int = 1, trace=None, words: int = 0, all_fields=False
) -> dict:
    """`words`/`all_fields`: load the plan's tables into a larger program (vector words, every field looked up), to
    see the verifier's figures of shapes bigger than the plan's."""
    from hypafilter.ops.verify import FrameGen, build_frame, read_trace

    rng = random.Random(seed)
    gen = FrameGen(policy, rng)
    rows = read_trace(trace, frames, rng) if trace else None
    fr = [(0, build_frame(u, rows[(u - 1) % len(rows)] if rows else gen.header(), b"")) for u in range(1, frames + 1)]
    t0 = time.perf_counter()
    t = build_tables(plan)
    tables_s = time.perf_counter() - t0
    shape = t.shape()
    if words:
        if words < t.words:
            raise HypafilterError(f"--words {words}: the plan needs {t.words}")
        shape["words"] = words
    if all_fields:
        shape["fields"] = list(FAST_FIELDS)
    ns = f"hfxc-{os.getpid()}"
    netns.delete(ns)
    netns.add(ns)
    try:
        netns.run(["ip", "-n", ns, "link", "add", "c0", "type", "veth", "peer", "name", "c1"])
        for i in ("c0", "c1"):
            netns.run(["ip", "-n", ns, "link", "set", i, "up"])
        res = run_frames(plan, fr, ["c0", "c1"], ns=ns, repeat=repeat, shape=shape)
    finally:
        netns.delete(ns)
    per = sorted(v.ns for v in res.verdicts)
    return {
        "entries": len(plan.entries),
        "boxes": t.boxes,
        "vectors": len(t.vectors),
        "address_intervals": {f: len(s) for f, s in t.spans.items()},
        "shape": res.shape,
        "tables_seconds": round(tables_s, 3),
        **res.prog,
        "frames": len(fr),
        "repeat": repeat,
        "ns_mean": round(statistics.fmean(per), 1),
        "ns_median": per[len(per) // 2],
        "ns_p99": per[min(len(per) - 1, int(len(per) * 0.99))],
    }
