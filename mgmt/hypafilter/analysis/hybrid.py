"""The Python emulation of the whole hybrid: the hardware's decision, the mark the shim writes, and the generated
netfilter chains interpreted exactly as they are loaded. The kernel-oracle tests check the real thing; this model
lets the property tests and the analysis explore far more packets than a namespace can carry.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from hypafilter.analysis.decision import decision, mirrored
from hypafilter.analysis.geometry import BoxSet, first_match
from hypafilter.analysis.program import MARK_MIRROR, build_program, mark_for
from hypafilter.errors import HypafilterError
from hypafilter.ir import ACTION_ACCEPT, Header, Policy
from hypafilter.ir.semantics import ComplexEval, never

ACTION_NAMES = {1: "ACCEPT", 2: "DROP"}


def hybrid_verdict(
    plan,
    strategy: str,
    header: Header,
    complex_eval: ComplexEval | None = None,
    foreign_mark: int = 0,
    mark_mask: int = 0xFFFFFFFF,
    mark_shift: int = 0,
    nic_mode: str = "bridge",
    trace: list[int] | None = None,
) -> tuple[str, bool, int]:
    """(verdict, shunted, traversed) of the hybrid system: hardware decision, shim mark, generated netfilter.

    The software side runs the very chain structure the emitters write (netfilter.build_program), with the mark
    the shim would write (other mark bits set to `foreign_mark`, to check that dispatch honours the mask).
    A mirrored frame (Plan.mirror, reason 4) keeps the hardware's verdict; its copy runs the program with the
    mirror mark, and `traversed` counts the copy's rules. `trace` gets every flattened policy rule software
    evaluates for the frame or its copy, in order. A copy the program would forward (bridge mode) is an error.
    """

    mi, shunted, action = decision(plan, header)
    # the policy entry is index n; with an update buffer (analysis.overlay.View) the slots' indices follow it
    hw_verdict = ACTION_NAMES.get(action, plan.policy.default) if mi != plan.n else plan.policy.default
    mirror = mirrored(plan, mi, shunted, action)
    if not shunted and not mirror and not (nic_mode == "host" and hw_verdict == "ACCEPT"):
        return hw_verdict, False, 0
    cache = plan.__dict__.setdefault("_programs", {})
    key = (strategy, mark_mask, mark_shift, nic_mode)
    if key not in cache:
        # the chains are the master rule set's (a View carries its Plan; the interval rows are the View's)
        cache[key] = build_program(
            getattr(plan, "plan", None) or plan, strategy, mark_mask=mark_mask, mark_shift=mark_shift, nic_mode=nic_mode
        )
    prog = cache[key]
    ev = complex_eval or never
    if mirror:
        mark = mark_for(prog, int(plan.interval[mi]), action | MARK_MIRROR, foreign_mark)
        verdict, count = prog.run(header, mark, ev, trace)
        want = hw_verdict if nic_mode == "host" and hw_verdict == "ACCEPT" else "DROP"
        if verdict != want:
            raise HypafilterError(
                f"mirror copy of entry {mi} ({hw_verdict}) ended in {verdict}, not {want} ({nic_mode} mode)"
            )
        return hw_verdict, False, count
    if not shunted:
        # host mode: the hardware's ACCEPT reaches INPUT with the "decided" mark value, which MAIN accepts at once
        verdict, count = prog.run(header, mark_for(prog, 0, ACTION_ACCEPT, foreign_mark), ev, trace)
        return verdict, False, count
    mark = mark_for(prog, int(plan.interval[mi]), action, foreign_mark)
    verdict, count = prog.run(header, mark, ev, trace)
    return verdict, True, count


def first_rule_match(policy: Policy, positions: Sequence[int], values: np.ndarray, flags=None) -> np.ndarray:
    """For many headers: the first of `positions` (rule positions) whose boxes contain it, else len(rules)."""
    src = BoxSet.from_unions([policy.rules[i].boxes for i in positions], owners=list(positions))
    return first_match(BoxSet.points(values, flags), src, default=len(policy.rules))
