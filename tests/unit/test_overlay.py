"""The SFL update buffer's decision (analysis.overlay): a matcher built for one policy, with the overlay `align`
computes, decides every header as the plan of the changed policy (the master rule set) — same master entry, same
shunt bit and action — and the whole hybrid through it gives the reference verdict (ir.semantics)."""

from __future__ import annotations

import numpy as np
import pytest
from hypafilter.analysis.decision import decision, match_index
from hypafilter.analysis.overlay import BufferFull, Overlay, Slot, align
from hypafilter.analysis.plan import build_plan
from hypafilter.config import Config
from hypafilter.ir import Box
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.irbuild import make_policy
from tests.unit.test_properties import _callback, headers, mismatches, rules


@st.composite
def edits(draw, base):
    """A list of rules changed by a few inserts and deletes (what iptables -I / -D do)."""
    rs = list(base)
    for _ in range(draw(st.integers(1, 4))):
        if rs and draw(st.booleans()):
            del rs[draw(st.integers(0, len(rs) - 1))]
        else:
            rs.insert(draw(st.integers(0, len(rs))), draw(rules()))
    return rs


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data(), st.sampled_from(["ACCEPT", "DROP"]), st.integers(0, (1 << 61) - 1))
def test_static_matcher_with_overlay_decides_as_the_master_rule_set(data, default, seed):
    base = data.draw(st.lists(rules(), min_size=1, max_size=8))
    changed = data.draw(edits(base))
    hdrs = data.draw(st.lists(headers(), min_size=1, max_size=16))
    ev = _callback(seed)
    for mode in ("selective", "exact", "index"):
        for strategy in ("interval", "interval_geo", "full"):
            cfg = Config()
            static = build_plan(make_policy(base, default), cfg, mode=mode, strategy=strategy)
            master = build_plan(make_policy(changed, default), cfg, mode=mode, strategy=strategy)
            try:
                view = align(static.entries, master, depth=64)
            except BufferFull:
                continue
            for h in hdrs:
                hw, shunted, action = decision(view, h)
                want = match_index(master, h)
                assert view.master[hw] == want, (mode, h)
                assert (shunted, action) == decision(master, h)[1:], (mode, h)
            assert mismatches(view, strategy, hdrs, ev) == [], (mode, strategy)


def test_buffer_full_is_refused():
    from tests.irbuild import make_rule

    base = [make_rule("ACCEPT", src="10.0.0.0/8")]
    changed = [make_rule("DROP", proto="tcp", dports=[22, 80, 443])] + base  # three boxes: three slots
    cfg = Config()
    static = build_plan(make_policy(base, "DROP"), cfg, mode="selective")
    master = build_plan(make_policy(changed, "DROP"), cfg, mode="selective")
    with pytest.raises(BufferFull) as e:
        align(static.entries, master, depth=2)
    assert (e.value.needed, e.value.depth) == (3, 2)
    view = align(static.entries, master, depth=3)
    assert [s.pos for s in view.overlay.slots] == [0, 0, 0]
    assert view.overlay.valid.tolist() == [True]


def test_overlay_rejects_unsorted_slots():
    b = Box.full()
    with pytest.raises(ValueError):
        Overlay(2, 4, np.ones(2, dtype=bool), (Slot(b, 2, 3), Slot(b, 0, 0)))
    with pytest.raises(ValueError):
        Overlay(2, 1, np.ones(2, dtype=bool), (Slot(b, 0, 0), Slot(b, 0, 1)))
