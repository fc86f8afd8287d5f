"""The fast path's per-frame cost and verifier figures for a policy (`hypafilter bench xdp-cost`): the program built
for the plan runs every frame `repeat` times through BPF_PROG_TEST_RUN in a scratch namespace.

With `flows` (established frames, `bench rate --established`): conntrack entries for the flows are created in the
scratch namespace first (as the bench creates them in the lab, their TCP entries marked liberal), and the
program is loaded with the conntrack lookup on (its timeouts read from that namespace, as the target reads them
from the firewall's) and the plan's miss forcing: bpf_xdp_ct_lookup (netns -1) looks up in the namespace of the
test run's device, so the frames are established hits there, and the figure is the cost of the established path.
The program's counters are reported (`counters`): a hit is decided here (CNT_FORWARDED / CNT_DROPPED), a miss
shunted (CNT_SHUNT_STATE).

The update buffer (docs/xdp.md "Update buffer (SFL)"): `depth` slots in the program; `buffer_view` puts some of the
plan's own entries into them (left out of the static matcher), so the frames decide as the plan does and the figure
is the cost of the slot scan.

IPv6 (`bench xdp-cost -6 V6POLICY`, `POLICY --ipv6 V6POLICY`; docs/ipv6.md "## xdp"): `plan6`, the family-6 plan of
the IPv6 side (targets.xdp.v6.plan6_for), gets the program's IPv6 table set, and the share `v6_share` of the frames
are verify6's IPv6 frames (`probes6`: aimed at `v6`'s rules and networks, or `v6_headers`, a trace mapped into
IPv6; well-formed TCP/UDP/ICMPv6 and the extension-header and malformed kinds in verify6's mix). The figures are
given per frame kind (`by_kind`) and family (`by_family`); `counters.HITS6` is the program's own count of frames
its IPv6 path matched an IPv6 entry for (hfx6_hits, times `repeat`)."""

from __future__ import annotations

import os
import random
import statistics
import time
from collections.abc import Sequence

from hypafilter import netns
from hypafilter.analysis.overlay import View, align
from hypafilter.errors import HypafilterError
from hypafilter.targets.xdp.run import run_frames
from hypafilter.targets.xdp.tables import FAST_FIELDS, build_tables, build_tables6, shape6
from hypafilter.targets.xdp.target import CONTROL_ENABLE, read_ct_config

# the lease word per `lease` setting: 0 disarmed; 2**62 ns (about 146 years of uptime) ahead; 1 ns, long past
LEASE_WORDS = {"off": 0, "armed": 1 << 62, "expired": 1}


def xdp_cost(
    plan,
    policy,
    frames: int = 2000,
    repeat: int = 100,
    seed: int = 1,
    trace=None,
    words: int = 0,
    all_fields=False,
    frame_list: Sequence[bytes] | None = None,
    flows: Sequence[tuple] | None = None,
    control: int = CONTROL_ENABLE,
    depth: int = 0,
    lease: str = "off",
    plan6=None,
    v6=None,
    v6_share: float = 0.0,
    v6_headers: Sequence[dict] | None = None,
) -> dict:
    """`words`/`all_fields`: load the plan's tables into a larger program (vector words, every field looked up), to
    see the verifier's figures of shapes bigger than the plan's. `depth`: the program's update-buffer slots (at
    least a View's); `plan` may be a View (`buffer_view`), its slots then scanned for every frame. `frame_list`: these frames (the first `frames` of
    them) instead of generated ones; `flows` (proto, src, dst, sport, dport): established in the scratch namespace's
    conntrack first, the lookup on (module doc); `control`: the program's CONTROL (default: enabled, bridge mode, no
    miss forcing); `lease`: the policy sync lease word, "off" (disarmed, 0), "armed" (far ahead: every frame reads
    the clock and is decided as usual) or "expired" (in the past: every frame passed undecided)."""
    from hypafilter.ops.verify import FrameGen, build_frame, read_trace

    rng = random.Random(seed)
    gen = FrameGen(policy, rng)
    rows = read_trace(trace, frames, rng) if trace and frame_list is None else None
    n6 = round(frames * v6_share) if plan6 is not None else 0
    if frame_list is not None:
        fr = [(0, f) for f in frame_list[: frames - n6]]
    else:
        fr = [
            (0, build_frame(u, rows[(u - 1) % len(rows)] if rows else gen.header(), b""))
            for u in range(1, frames - n6 + 1)
        ]
    kinds = ["v4"] * len(fr)
    if n6:
        from hypafilter.ops.verify import DST_MAC, ID_MAC_PREFIX
        from hypafilter.ops.verify6 import probes6

        six = probes6(v6, len(fr) + 1, n6, seed, DST_MAC, ID_MAC_PREFIX, headers=v6_headers)
        fr += [(0, f) for _, _, f in six]
        kinds += [k for _, k, _ in six]
    t0 = time.perf_counter()
    t = build_tables(plan)
    tables_s = time.perf_counter() - t0
    if depth < t.depth:
        raise HypafilterError(f"a program of {depth} buffer slots for a view of {t.depth}")
    shape = t.shape(depth)
    if words:
        if words < t.words:
            raise HypafilterError(f"--words {words}: the plan needs {t.words}")
        shape["words"] = words
    if all_fields:
        shape["fields"] = list(FAST_FIELDS)
    t6 = None
    if plan6 is not None:  # the IPv6 table set after the IPv4 side's rows (as XdpTarget.program places it)
        plan6.index_base = t.n + 1 + depth
        t6 = build_tables6(plan6)
        shape["v6"] = shape6(t6)
    ns = f"hfxc-{os.getpid()}"
    netns.delete(ns)
    netns.add(ns)
    try:
        netns.run(["ip", "-n", ns, "link", "add", "c0", "type", "veth", "peer", "name", "c1"])
        for i in ("c0", "c1"):
            netns.run(["ip", "-n", ns, "link", "set", i, "up"])
        ct = None
        if flows is not None:
            from hypafilter.tools.bench.ctflows import open_flows

            open_flows(ns, list(flows))
            ct = read_ct_config(ns)
            if not ct.lookup:
                raise HypafilterError(f"{ns}: conntrack's sysctls unreadable (no conntrack lookup to measure)")
        lease_ns = LEASE_WORDS.get(lease)
        if lease_ns is None:
            raise HypafilterError(f"--lease {lease!r}: one of {', '.join(LEASE_WORDS)}")
        res = run_frames(
            plan,
            fr,
            ["c0", "c1"],
            ns=ns,
            control=control,
            repeat=repeat,
            shape=shape,
            ct=ct,
            lease_ns=lease_ns,
            plan6=plan6,
        )
    finally:
        netns.delete(ns)
    per = sorted(v.ns for v in res.verdicts)
    by_kind: dict[str, list[int]] = {}
    for k, v in zip(kinds, res.verdicts, strict=True):
        by_kind.setdefault(k, []).append(v.ns)
    fam = {"4": by_kind.get("v4", []), "6": [x for k, xs in by_kind.items() if k != "v4" for x in xs]}
    v6_part = {}
    if plan6 is not None:
        v6_part = {
            "ipv6": {
                "entries": t6.n,
                "boxes": t6.boxes,
                "vectors": len(t6.vectors),
                "address_intervals": {f: len(s) for f, s in t6.spans.items()},
                "sets": len(t6.sets),
                "frames": n6,
            },
            "by_family": {f: _figures(xs) for f, xs in fam.items() if xs},
            "by_kind": {k: _figures(xs) for k, xs in sorted(by_kind.items())},
        }
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
        "established_flows": len(flows) if flows is not None else None,
        "buffer_slots": depth,
        "lease": lease,
        "buffer_used": t.overlay.used if t.overlay is not None else 0,
        "counters": {k: v for k, v in res.counters.items() if isinstance(v, int) and v},
        "hits_by_slots": sum(res.counters["HITS"][t.n + 1 :]),
        **v6_part,
    }


def _figures(ns: list[int]) -> dict:
    """ns per frame of some frames: their count, mean, median and 99th percentile."""
    s = sorted(ns)
    return {
        "frames": len(s),
        "ns_mean": round(statistics.fmean(s), 1),
        "ns_median": s[len(s) // 2],
        "ns_p99": s[min(len(s) - 1, int(len(s) * 0.99))],
    }


def buffer_view(plan, slots: int, depth: int, at: str = "spread") -> View:
    """`plan` decided through the update buffer: `slots` of its entries (evenly spaced, or with at="top" the first
    ones, whose slots every frame then scans) left out of the static matcher and placed in the buffer by
    analysis.overlay.align, which gives the plan's decision for every header (`bench xdp-cost --buffer-slots`)."""
    n = len(plan.entries)
    if not 0 <= slots <= min(n, depth):
        raise HypafilterError(f"--buffer-slots {slots}: at most the {min(n, depth)} entries the buffer and plan have")
    if at == "top":
        out = set(range(slots))
    elif at == "spread":
        out = {(2 * k + 1) * n // (2 * slots) for k in range(slots)}
    else:
        raise HypafilterError(f"--buffer-at {at!r}: spread or top")
    view = align([e for j, e in enumerate(plan.entries) if j not in out], plan, depth)
    return view
