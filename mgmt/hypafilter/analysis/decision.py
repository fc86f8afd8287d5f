"""The hardware's first-match decision, defined once: which entry a header hits, and what the core then does.

Every consumer of "what would the matcher say" uses this module: the analysis (shunted packets per trace), the
Python model of the core (`hw.model`), the emulation of the whole hybrid (`analysis.hybrid`), the benchmarks, the
unit and property tests and the cocotb testbenches (through `hw.model`). The verifier (`ops.verify`) needs no model:
it compares the running hybrid with the kernel's verdicts on the original policy.

`plan` is anything with `entries` (each with `boxes`), `shunt` and `actions` of length n + 1: an
`analysis.plan.Plan` or the hardware's own view of one (`hw.vhdl.HwPlan`). match_index == n is the policy entry.
A plan with `mirror` (bool, n + 1; log mirroring) sends the host a copy of a frame its entry decides (reason 4).
"""

from __future__ import annotations

import numpy as np

from hypafilter.analysis.geometry import BoxSet, first_match
from hypafilter.analysis.overlay import hw_indices
from hypafilter.ir import ACTION_ACCEPT, ACTION_DROP, Header

_sets: dict[int, tuple[object, BoxSet]] = {}


def entry_set(plan) -> BoxSet:
    """Every entry's boxes as one BoxSet (owner = entry index), cached per plan object."""
    es = getattr(plan, "entry_set", None)
    if es is not None:
        return es
    hit = _sets.get(id(plan))
    if hit is None or hit[0] is not plan:
        hit = (plan, BoxSet.from_unions([e.boxes for e in plan.entries]))
        _sets[id(plan)] = hit
    return hit[1]


def match_index(plan, header: Header) -> int:
    """Index of the first entry whose boxes contain the header; len(plan.entries) when none does. A plan with an
    update buffer (`overlay`: analysis.overlay.View) answers the hardware index of the master rule set's match."""
    if getattr(plan, "overlay", None) is not None:
        v = np.array([header.values()], dtype=np.int64)
        return int(match_indices(plan, v, np.array([header.tcp_flags | header.sets << 8], dtype=np.int64))[0])
    s = entry_set(plan)
    n = len(plan.entries)
    if not len(s):
        return n
    v = np.array(header.values(), dtype=np.int64)
    ok = np.all((s.lo <= v) & (v <= s.hi), axis=1) & (((header.tcp_flags | header.sets << 8) & s.fmask) == s.fval)
    hits = s.owner[ok]
    return int(hits.min()) if len(hits) else n


def match_indices(plan, values: np.ndarray, flags: np.ndarray | None = None) -> np.ndarray:
    """match_index for many headers (values[p, NDIM] in ir.FIELDS order, flags[p] the TCP flags byte)."""
    ov = getattr(plan, "overlay", None)
    if ov is not None:
        return hw_indices(entry_set(plan), ov, BoxSet.points(values, flags))
    return first_match(BoxSet.points(values, flags), entry_set(plan), default=len(plan.entries))


def miss_forced(plan, action: int, ct: int = 0) -> bool:
    """Whether a frame with hardware action `action` is shunted by miss forcing (Plan.miss_shunt, CONTROL bits 4/5;
    plans without it force nothing): with ct 0 (the flow cache does not know it) an ACCEPT or DROP that miss_shunt
    names; with ct 3 (no conntrack entry: NEW or INVALID to the kernel) only an ACCEPT, when ACCEPT is forced —
    conntrack must create the entry of a NEW frame the policy accepts, while a NEW frame the policy drops leaves no
    entry (its unconfirmed conntrack is freed with the skb) and an INVALID one never had one."""
    accept, drop = getattr(plan, "miss_shunt", (False, False))
    if ct == 3:
        return bool(accept and action == ACTION_ACCEPT)
    if ct:
        return False
    return bool((accept and action == ACTION_ACCEPT) or (drop and action == ACTION_DROP))


def shunt_bit(plan, mi: int, ct: int = 0) -> bool:
    """The entry's shunt bit for a frame with this ct: Plan.shunt_none for ct 3 (no conntrack entry), else shunt."""
    bits = getattr(plan, "shunt_none", None) if ct == 3 else None
    return bool((plan.shunt if bits is None else bits)[mi])


def mirrored(plan, mi: int, shunted: bool, action: int) -> bool:
    """Whether the hardware sends the host a mirror copy (reason 4) of a frame it decided: the entry's mirror bit,
    when the frame is neither shunted nor forced (`shunted` as `decision` says) and the action decides. In host
    mode the "copy" of an ACCEPT is the frame itself (delivered with reason 4 instead of 5)."""
    mirror = getattr(plan, "mirror", None)
    return mirror is not None and not shunted and bool(mirror[mi]) and action in (ACTION_ACCEPT, ACTION_DROP)


def decision(plan, header: Header) -> tuple[int, bool, int]:
    """(match_index, shunted, action code) of a parsed header with the plan's tables loaded: shunted by the
    entry's bit (shunt_bit), or by miss forcing (miss_forced) (hw.model.decide gives the reasons)."""
    mi = match_index(plan, header)
    action = int(plan.actions[mi])
    return mi, shunt_bit(plan, mi, header.ct) or miss_forced(plan, action, header.ct), action
