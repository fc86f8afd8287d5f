"""Log mirroring (docs/internals.md, "Log mirroring"): the plan's mirror vector, the model of the core (Kind.MIRROR,
reason 4, ACTION bit 3), the software leaves (k, 5)/(k, 6) and the bridge guard, and where mirroring must not apply.

The property test against the reference semantics (verdicts and the observing rules each header reaches) is in
test_properties.py; this file pins the contract's concrete values.
"""

from __future__ import annotations

import dataclasses

import pytest
from hypafilter.analysis.plan import action_words, build_plan
from hypafilter.analysis.program import MARK_MIRROR, build_program, mark_for
from hypafilter.cli.compile import register_image
from hypafilter.config import MODES, STRATEGIES, Config, mirrors
from hypafilter.errors import HypafilterError
from hypafilter.hw import model as hwmodel
from hypafilter.ir import Header
from hypafilter.ir.semantics import never
from hypafilter.shared import C, unpack_meta
from hypothesis import given, settings
from hypothesis import strategies as st
from scapy.layers.inet import ICMP, IP, TCP, UDP
from scapy.layers.l2 import Ether

from tests.irbuild import make_policy, make_rule
from tests.unit.test_model import frame
from tests.unit.test_properties import rules

STRING = [("-m", "string", "--string", "X", "--algo", "bm")]


def _policy():
    """R0 tcp/22 ACCEPT; R1 icmp LOG; R2 tcp/80 ACCEPT; R3 udp DROP; R4 string DROP; R5 tcp/443 ACCEPT; R6 NFLOG."""
    return make_policy(
        [
            make_rule("ACCEPT", proto="tcp", dport=(22, 22)),
            make_rule("LOG", proto="icmp"),
            make_rule("ACCEPT", proto="tcp", dport=(80, 80)),
            make_rule("DROP", proto="udp"),
            make_rule("DROP", proto="tcp", dport=(8080, 8080), complex=STRING),
            make_rule("ACCEPT", proto="tcp", dport=(443, 443)),
            make_rule("NFLOG", proto="tcp"),
        ],
        "DROP",
    )


def test_shared_header_values():
    assert (C["HF_REASON_MIRROR"], C["HF_ACTION_MIRROR_BIT"], C["HF_MARK_MIRROR"]) == (4, 0x8, 0x4)
    assert (C["HF_STAT_MIRROR"], C["HF_STAT_MIRROR_DROPPED"], C["HF_STAT_COUNT"]) == (6, 7, 8)
    assert MARK_MIRROR == C["HF_MARK_MIRROR"] and hwmodel.ACTION_MIRROR_BIT == C["HF_ACTION_MIRROR_BIT"]
    assert hwmodel.REASON_MIRROR == 4 and hwmodel.Kind.MIRROR == 3


def test_index_mode_mirrors_after_the_first_observing_rule():
    plan = build_plan(_policy(), mode="index", strategy="interval")
    assert [e.rule_index for e in plan.entries] == [0, 2, 3, 5]
    assert list(plan.observing) == [False, True, False, False, False, False, True]
    # shunt: after the first deciding complex rule (R4); mirror: after the first observing rule (R1), not shunted
    assert plan.shunt_string() == "00011"
    assert list(plan.mirror) == [False, True, True, False, False]
    assert list(plan.delivers) == [False, True, True, True, True]
    assert action_words(plan) == [1, 1 | 8, 2 | 8, 1, 2]
    assert list(plan.actions) == [1, 1, 2, 1, 2]  # Plan.actions keep the codes
    acts = [w for w in register_image(plan) if w.get("table") == "ACTION"]
    assert [w["value"] for w in acts] == [1, 9, 10, 1, 2]
    rep = plan.report()
    assert rep["mirror_vector"] == "01100" and rep["observing_rules"] == [1, 6] and rep["mirroring_entries"] == 2


def test_selective_mode_mirrors_entries_an_observing_reduction_meets():
    plan = build_plan(_policy(), mode="selective", strategy="interval_geo")
    # R2 tcp/80 and R3 udp: no deciding reduction meets them, the icmp LOG neither: decided without a copy. R5
    # tcp/443 is met by nothing deciding above (R4 is tcp/8080) and by no observing rule above (R6 is below).
    assert plan.shunt_string() == "00001" and not plan.mirror.any()
    pol = _policy()
    pol.rules[1] = make_rule("LOG", proto="tcp")  # now R1 meets R2 and R5, not R3 (udp)
    plan = build_plan(pol, mode="selective", strategy="interval_geo")
    assert plan.shunt_string() == "00001"
    assert list(plan.mirror) == [False, True, False, True, False]
    assert plan.geo_chains[int(plan.interval[1])] == [1]  # the copy of R2's frames runs R1 only
    assert plan.geo_chains[int(plan.interval[3])] == [1]  # R4's reduction (tcp/8080) does not meet tcp/443


def test_policy_entry_mirrors_when_only_observing_rules_reach_it():
    pol = make_policy([make_rule("ACCEPT", proto="tcp"), make_rule("LOG", proto="udp")], "ACCEPT")
    for mode in ("index", "selective"):
        plan = build_plan(pol, mode=mode, strategy="interval")
        assert plan.shunt_string() == "00" and list(plan.mirror) == [False, True], mode
        assert action_words(plan) == [1, 1 | 8]


def test_arrays_are_computed_once_and_refresh_recomputes_them():
    plan = build_plan(_policy(), Config(), mode="index", strategy="interval")
    assert plan.may_shunt is plan.may_shunt  # an attribute, not a property computed on each access
    plan.miss_shunt = (True, True)
    assert not plan.forced.any()
    plan.refresh()
    assert list(plan.forced) == [True, True, True, True, True]
    assert list(plan.may_shunt) == [True] * 5 and list(plan.delivers) == [True] * 5


@pytest.mark.parametrize("nic_mode", ["bridge", "host"])
def test_leaves_and_guard(nic_mode):
    pol = _policy()
    plan = build_plan(pol, mode="index", strategy="interval")
    prog = build_program(plan, "interval", "HF9_", nic_mode=nic_mode)
    k80, kudp = int(plan.interval[1]), int(plan.interval[2])
    a5, a6 = prog.name(f"L{k80}A5"), prog.name(f"L{kudp}A6")
    assert prog.chains[a5][0].kind == "unmark" and prog.chains[a6][0].kind == "unmark"
    assert prog.chains[a5][-1].target == ("ACCEPT" if nic_mode == "host" else "DROP")
    assert prog.chains[a6][-1].target == "DROP"
    assert prog.name(f"L{k80}A1") not in prog.chains  # R2's frames never reach software themselves
    icmp, web, dns = Header(proto=1), Header(proto=6, dport=80), Header(proto=17, dport=53)
    for h, k, a, want in ((web, k80, 5, "ACCEPT" if nic_mode == "host" else "DROP"), (dns, kudp, 6, "DROP")):
        trace: list[int] = []
        assert prog.run(h, mark_for(prog, k, a), never, trace) == (want, prog.run(h, mark_for(prog, k, a), never)[1])
        assert trace == [1]  # the chain above R2/R3: the LOG rule (and it does not decide)
    guard = [r for r in prog.chains[prog.main] if r.kind == "mark" and r.target == "DROP"]
    if nic_mode == "bridge":
        assert guard == [dataclasses.replace(guard[0], value=MARK_MIRROR, mask=MARK_MIRROR)]
        assert prog.chains[prog.main][-2] == guard[0] and prog.chains[prog.main][-1].target == prog.name("K0")
        # a mirror mark no leaf takes (an unknown k, or a copy of a DROP where only ACCEPTs are mirrored): dropped
        assert prog.run(icmp, mark_for(prog, 60, 5), never)[0] == "DROP"
        assert prog.run(web, mark_for(prog, k80, 6), never)[0] == "DROP"
    else:  # host mode: only a copy of a DROP is dropped; the "copy" of an ACCEPT is the frame, the policy decides
        assert [(r.value, r.mask) for r in guard] == [(0x6, 0xF)] and prog.chains[prog.main][-2] == guard[0]
        assert prog.run(Header(proto=17), mark_for(prog, 60, 6), never)[0] == "DROP"
        assert prog.run(web, mark_for(prog, 60, 5), never)[0] == "ACCEPT"
        assert prog.run(Header(proto=6, dport=9), mark_for(prog, 60, 5), never)[0] == "DROP"  # the policy: DROP
    # a mark without the mirror bit that no leaf knows: the full policy decides, as before
    assert prog.run(web, mark_for(prog, 60, 1), never)[0] == "ACCEPT"


def test_guard_respects_mask_and_shift():
    plan = build_plan(_policy(), mode="index", strategy="interval")
    prog = build_program(plan, "interval", "HF9_", mark_mask=0x00FFFF00, mark_shift=8)
    guard = prog.chains[prog.main][-2]
    assert (guard.value, guard.mask, guard.target) == (0x400, 0x400, "DROP")
    assert prog.run(Header(proto=17), mark_for(prog, 60, 6, foreign=0xFF0000FF), never)[0] == "DROP"


def test_no_guard_without_mirroring():
    pol = make_policy([make_rule("ACCEPT", proto="tcp"), make_rule("DROP", proto="udp", complex=STRING)], "ACCEPT")
    plan = build_plan(pol, mode="index", strategy="interval")
    prog = build_program(plan, "interval")
    assert not any(r.kind == "mark" and r.target == "DROP" and r.value == MARK_MIRROR for r in prog.chains[prog.main])


@pytest.mark.parametrize("strategy", ["full", "cut", "hsa_cut"])
def test_a_mirroring_plan_refuses_other_strategies(strategy):
    plan = build_plan(_policy(), mode="selective", strategy="interval")
    plan.mirror[1] = True
    plan.refresh()
    with pytest.raises(HypafilterError, match="mirrors observing rules"):
        build_program(plan, strategy)


def _as_deciding(rule):
    """The same rule with a deciding complex target: what an observing rule is without mirroring."""
    return dataclasses.replace(rule, target="REJECT") if rule.target in ("LOG", "NFLOG", "") else rule


@settings(max_examples=60, deadline=None)
@given(st.lists(rules(), min_size=1, max_size=9), st.sampled_from(["ACCEPT", "DROP"]))
def test_nothing_mirrors_outside_index_selective_with_interval(rs, default):
    """full/cut/hsa_cut and exact mode: no mirror bit, no observing rule, and the very shunt vector the policy
    gets when every observing rule is a deciding complex rule (observing rules are treated as before)."""
    pol = make_policy(rs, default)
    twin = make_policy([_as_deciding(r) for r in rs], default)
    for mode in MODES:
        for strategy in STRATEGIES:
            plan = build_plan(pol, mode=mode, strategy=strategy)
            if mirrors(mode, strategy):
                assert not (plan.mirror & plan.shunt).any()
                continue
            assert not plan.mirror.any() and not plan.observing.any(), (mode, strategy)
            assert plan.shunt_string() == build_plan(twin, mode=mode, strategy=strategy).shunt_string()
            assert action_words(plan) == [int(a) for a in plan.actions]


# ---------------------------------------------------------------------------------------- the model of the core


def _regs(plan, **kw):
    return hwmodel.Regs.from_plan(plan, **kw)


def test_model_mirror_decisions():
    plan = build_plan(_policy(), mode="index", strategy="interval")
    regs = _regs(plan)
    assert regs.actions == [1, 9, 10, 1, 2] + [0] * plan.buffer_depth  # the slots' rows: no action
    web = frame(Ether() / IP() / TCP(dport=80))
    d = hwmodel.decide(plan, web, 0x01, regs)  # bridge ACCEPT: forwarded and a tagged copy to the DMA queue
    assert (d.kind, d.dst_port, d.match_index, d.action, d.reason) == (hwmodel.Kind.MIRROR, 0x04 | 0x02, 1, 1, 4)
    assert unpack_meta(d.meta) == {"index": 1, "action": 1, "reason": 4, "generation": 0, "magic": 0x4846}
    assert hwmodel.CNT_MIRROR in d.counters and "CNT_FORWARDED" in d.counters
    d = hwmodel.decide(plan, frame(Ether() / IP() / UDP()), 0x10, regs)  # DROP: only the copy
    assert (d.kind, d.dst_port, d.action, d.reason) == (hwmodel.Kind.MIRROR, 0x20, 2, 4)
    assert unpack_meta(d.meta)["action"] == 2 and hwmodel.CNT_MIRROR in d.counters
    d = hwmodel.decide(plan, frame(Ether() / IP() / TCP(dport=22)), 0x01, regs)  # above the LOG rule: no copy
    assert (d.kind, d.dst_port, d.meta) == (hwmodel.Kind.FORWARD, 0x04, None)
    d = hwmodel.decide(plan, frame(Ether() / IP() / TCP(dport=443)), 0x01, regs)  # shunt bit first
    assert (d.kind, d.reason) == (hwmodel.Kind.SHUNT, 0)
    d = hwmodel.decide(plan, frame(Ether() / IP() / ICMP()), 0x01, regs)  # policy entry: shunted
    assert (d.kind, d.reason) == (hwmodel.Kind.SHUNT, 1)
    host = _regs(plan, nic_mode="host")
    d = hwmodel.decide(plan, web, 0x04, host)  # host-mode ACCEPT: the frame itself, reason 4 (not 5)
    assert (d.kind, d.dst_port, d.reason, d.action) == (hwmodel.Kind.MIRROR, 0x08, 4, 1)
    counters = hwmodel.Counters(plan.n)
    counters.add(hwmodel.decide(plan, web, 0x01, regs), 0x01)
    assert counters.regs[hwmodel.CNT_MIRROR] == 1 and counters.regs["PKTOUT"] == 1


def test_model_mirror_precedence():
    plan = build_plan(_policy(), mode="index", strategy="interval")
    plan.miss_shunt = (True, True)
    plan.refresh()
    regs = _regs(plan)
    web = frame(Ether() / IP() / TCP(dport=80))
    assert hwmodel.decide(plan, web, 0x01, regs).reason == hwmodel.REASON_STATE  # miss forcing first (ct = 0)
    d = hwmodel.decide(plan, web, 0x01, regs, ct=1)  # a flow-cache hit: mirrored
    assert (d.kind, d.reason) == (hwmodel.Kind.MIRROR, 4)
    regs.control |= hwmodel.CONTROL_SHUNT_ALL
    d = hwmodel.decide(plan, web, 0x01, regs, ct=1)
    assert (d.kind, d.reason, d.forced) == (hwmodel.Kind.SHUNT, 0, True)  # shunt everything before mirroring
    # the mirror bit never turns a non-decisive action into a decision
    regs = _regs(plan)
    regs.actions[1] = 0x8
    assert hwmodel.decide(plan, web, 0x01, regs, ct=1).kind == hwmodel.Kind.SHUNT


def test_hybrid_model_keeps_the_verdict_and_runs_the_copy():
    from hypafilter.analysis.hybrid import hybrid_verdict

    plan = build_plan(_policy(), mode="index", strategy="interval")
    for nic_mode in ("bridge", "host"):
        for h, want in ((Header(proto=6, dport=80), "ACCEPT"), (Header(proto=17, dport=53), "DROP")):
            trace: list[int] = []
            v, shunted, count = hybrid_verdict(plan, "interval", h, nic_mode=nic_mode, trace=trace)
            assert (v, shunted, trace) == (want, False, [1]) and count >= 2
    # a broken leaf that would forward a copy is an error of the model, never a silent duplicate
    prog = build_program(plan, "interval")
    leaf = prog.name(f"L{int(plan.interval[1])}A5")
    prog.chains[leaf][-1] = dataclasses.replace(prog.chains[leaf][-1], target="ACCEPT")
    plan.__dict__["_programs"] = {("interval", 0xFFFFFFFF, 0, "bridge"): prog}
    with pytest.raises(HypafilterError, match="mirror copy"):
        hybrid_verdict(plan, "interval", Header(proto=6, dport=80))


def test_vhdl_power_on_actions_carry_the_mirror_bit(tmp_path):
    from hypafilter.hw import vhdl

    plan = build_plan(_policy(), mode="index", strategy="interval")
    text = "".join(p.read_text() for p in vhdl.render(plan, tmp_path) if "policy_pkg" in p.name)
    body = text[text.index("function action_init") :]
    # entries 1 and 2 (mirrored ACCEPT and DROP) power on as 0x9 and 0xA
    for i, word in ((1, "9"), (2, "A")):
        assert f'if i = {i} then\n      r := x"{word}";' in body, body


@pytest.mark.parametrize("strategy", ["interval", "tree"])
def test_a_live_copy_meets_each_observer_once_when_its_chain_starts_where_a_shunted_one_does(strategy):
    """A live deployment writes a copy's chain as an explicit list (its rules only the live chain runs left out) and
    a shunted frame's as a prefix view of the complex list: two families of segments whose first intervals can be
    the same k. Each needs its own segment C<k> (the second C<k>F<f>): reusing the first family's made the copy of
    a !10/8 frame meet the counter rule twice (found by test_tree_strategy's live property test)."""
    from tests.unit.test_properties import _callback, mismatches

    pol = make_policy(
        [
            make_rule(""),
            make_rule("ACCEPT", src="10.0.0.0/8"),
            make_rule("DROP", src="10.0.0.0/8", complex=[("-m", "string", "--string", "X", "--algo", "bm")]),
            make_rule("ACCEPT", src="10.0.0.0/8"),
            make_rule("ACCEPT", src="10.0.0.0/8", not_src=True),
        ],
        "ACCEPT",
    )
    h = Header(src=0xC0A80101, dst=0x0A010203, proto=1)
    plan = build_plan(pol, Config(), live=True, strategy=strategy)
    assert plan.mirror[-2] and plan.shunt.any()
    assert mismatches(plan, strategy, [h], _callback(0)) == []
    prog = build_program(plan, strategy)
    segs = [n for n in prog.chains if n.startswith(prog.name("C"))]
    assert len(segs) == len(set(segs)) == 3 and prog.name("C2F1") in segs, segs
