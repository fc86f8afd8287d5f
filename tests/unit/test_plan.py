"""Unit tests for hypafilter.analysis.plan: shunt vectors, actions and intervals, from the paper's Listing 1."""

from __future__ import annotations

import numpy as np
import pytest
from hypafilter.analysis.decision import decision
from hypafilter.analysis.plan import build_plan, selective_bits
from hypafilter.config import Config
from hypafilter.errors import HypafilterError
from hypafilter.iptables.document import parse_policy
from hypafilter.ir import ACTION_ACCEPT, ACTION_DROP, Header

from tests.irbuild import listing1, make_policy, make_rule

STRING = [("-m", "string", "--string", "X", "--algo", "bm")]


def test_listing1_selective_vector_is_0001_plus_policy_bit():
    plan = build_plan(listing1(), mode="selective")
    assert plan.shunt_string() == "00011"
    assert [e.rule_index for e in plan.entries] == [0, 1, 3, 5]
    assert list(plan.actions) == [ACTION_ACCEPT] * 4 + [ACTION_ACCEPT]


def test_listing1_index_based_shunts_r4_and_r6():
    plan = build_plan(listing1(), mode="index")
    shunting = [plan.entries[j].rule_index + 1 for j in range(plan.n) if plan.shunt[j]]
    assert shunting == [4, 6]
    assert plan.shunt[-1]


def test_listing1_intervals_follow_figure5():
    plan = build_plan(listing1(), mode="index")
    # G1 = {R1, R2}, G2 = {R4}, G3 = {R6}; the policy entry gets its own k.
    assert list(plan.interval) == [1, 1, 2, 3, 4]
    assert plan.chains == {1: [], 2: [2], 3: [2, 4], 4: [2, 4]}
    # R4 is TCP, R3 UDP: the geometric chain for G2 is empty.
    assert plan.geo_chains[2] == [] and plan.geo_chains[3] == [4]


def test_listing1_exact_mode_shunts_only_complex_entries():
    plan = build_plan(listing1(), mode="exact")
    assert plan.shunt_string() == "0010100"
    assert plan.n == 6 and plan.actions[2] == 0
    k3 = int(plan.interval[2])
    assert plan.chains[k3] == [2]  # only R3 itself: no later rule meets R3's reduction
    k5 = int(plan.interval[4])
    assert plan.chains[k5] == [4, 5]  # R5 then R6 (same geometry)


def test_no_complex_rules_means_no_shunting():
    pol = make_policy([make_rule("DROP", proto="tcp", dport=(22, 22)), make_rule("ACCEPT", src="10.0.0.0/8")], "DROP")
    for mode in ("index", "selective", "exact"):
        plan = build_plan(pol, mode=mode)
        assert not plan.shunt.any()
        assert plan.actions[-1] == ACTION_DROP


def test_policy_entry_bit_proved_empty_when_complex_rule_is_covered():
    pol = make_policy(
        [
            make_rule("ACCEPT", src="10.0.0.0/8"),
            make_rule("DROP", src="10.1.0.0/16", proto="udp", complex=STRING),
            make_rule("ACCEPT", src="10.1.0.0/16", proto="udp", dport=(53, 53)),
        ]
    )
    plan = build_plan(pol, mode="selective")
    assert not plan.shunt[-1]  # the reduction lies inside R1: no packet in it reaches the policy entry
    assert plan.shunt_string() == "010"
    pol.rules[0] = make_rule("ACCEPT", src="10.2.0.0/16")
    assert build_plan(pol, mode="selective").shunt[-1]


def test_selective_bits_respect_order_and_negation():
    pol = make_policy(
        [
            make_rule("ACCEPT", src="10.0.0.0/8", proto="tcp"),  # before any complex rule
            make_rule("LOG", src="10.0.0.0/8", not_src=True),  # LOG target: complex, negated source
            make_rule("DROP", src="10.1.0.0/16"),  # inside 10/8: disjoint from the negation
            make_rule("DROP", src="11.0.0.0/8"),  # outside 10/8: meets it
        ]
    )
    assert list(selective_bits(pol)) == [False, False, False, True]


def test_unknown_mode_is_an_error():
    with pytest.raises(HypafilterError, match="unknown shunting mode"):
        build_plan(listing1(), mode="fast")


def test_plan_arrays_have_contract_types():
    plan = build_plan(listing1())
    assert plan.shunt.dtype == bool and plan.actions.dtype == np.uint8 and plan.interval.dtype == np.uint32
    assert len(plan.shunt) == len(plan.actions) == len(plan.interval) == plan.n + 1
    assert (plan.interval >= 1).all()
    assert plan.policy_hash == listing1().policy_hash()
    rep = plan.report()
    assert rep["complex"] == 2 and rep["simple"] == 4 and rep["shunt_vector"] == "00011"


CT_POLICY = """*filter
:FORWARD ACCEPT [0:0]
-A FORWARD -p tcp -m tcp --dport 80 -j ACCEPT
-A FORWARD -p udp -m udp --dport 53 -j DROP
-A FORWARD -m conntrack --ctstate ESTABLISHED,RELATED -j ACCEPT
-A FORWARD -p tcp -m tcp --dport 22 -j ACCEPT
-A FORWARD -p tcp -j DROP
COMMIT
"""


@pytest.mark.parametrize("mode", ["index", "selective", "exact"])
def test_conntrack_policy_decides_no_unknown_frame_in_hardware(mode):
    """A policy that reads conntrack state: conntrack must see every packet of a connection the fast path does not
    know, the dropped ones too (a dropped reply still establishes it, a dropped RST still closes it). So a frame
    with ct = 0 is shunted (miss forcing, CONTROL bits 4/5) whatever entry it hits, the policy entry included,
    ACCEPT and DROP alike; the SHUNT table itself no longer carries that forcing."""
    pol = parse_policy(CT_POLICY)
    assert pol.reads_conntrack
    plan = build_plan(pol, Config(), mode=mode)
    assert plan.miss_shunt == (True, True)
    decisive = (plan.actions == ACTION_ACCEPT) | (plan.actions == ACTION_DROP)
    hit_only = np.array([pol.rules[e.rule_index].ct_part == "hit" for e in plan.entries] + [False])
    assert plan.may_shunt[decisive & ~hit_only].all(), (mode, plan.shunt_string())
    assert not plan.forced[hit_only].any()  # the hit part (ct 1..2) never meets a frame the flow cache misses
    assert not plan.shunt[0]  # tcp/80 ACCEPT above every complex rule: its shunt bit stays 0
    assert decision(plan, Header(proto=6, dport=80)) == (0, True, ACTION_ACCEPT)  # ct = 0: forced
    assert decision(plan, Header(proto=6, dport=80, ct=1)) == (0, False, ACTION_ACCEPT)  # a hit: decided
    assert ACTION_DROP in plan.actions and ACTION_ACCEPT in plan.actions  # the actions stay for software
    # The same policy without the conntrack rule forces nothing.
    plain = parse_policy(
        CT_POLICY.replace("-m conntrack --ctstate ESTABLISHED,RELATED ", "-m string --string x --algo bm ")
    )
    assert not plain.reads_conntrack
    pp = build_plan(plain, Config(), mode=mode)
    assert pp.miss_shunt == (False, False) and not pp.forced.any() and not pp.shunt[0]


@pytest.mark.parametrize("mode", ["index", "selective", "exact"])
def test_conntrack_policy_in_host_mode_keeps_accept_in_hardware(mode):
    """Host mode (INPUT): a hardware ACCEPT is delivered to the host, whose conntrack sees it in PREROUTING before
    INPUT; only a hardware DROP would hide a frame from conntrack, so only DROP is forced on a miss."""
    pol = parse_policy(CT_POLICY.replace("FORWARD", "INPUT"), base_chain="INPUT")
    assert pol.reads_conntrack and pol.base_chain == "INPUT"
    plan = build_plan(pol, Config(), mode=mode)
    assert plan.miss_shunt == (False, True)
    drop = plan.actions == ACTION_DROP
    accept = plan.actions == ACTION_ACCEPT
    assert plan.may_shunt[drop].all(), (mode, plan.shunt_string())
    assert not plan.forced[accept].any()
    bridge = build_plan(parse_policy(CT_POLICY), Config(), mode=mode)
    assert bridge.miss_shunt == (True, True)
    # Some ACCEPT entry that may shunt in bridge mode (a miss) is decided in hardware in host mode.
    assert (bridge.may_shunt[accept] & ~plan.may_shunt[accept]).any(), (mode, plan.shunt_string())


def test_conntrack_read_in_a_user_chain_counts():
    base = CT_POLICY.replace("-m conntrack --ctstate ESTABLISHED,RELATED ", "-m string --string x --algo bm ")
    text = base.replace(
        ":FORWARD ACCEPT [0:0]", ":FORWARD ACCEPT [0:0]\n:CTCHK - [0:0]\n-A CTCHK -m state --state INVALID -j DROP"
    )
    assert not parse_policy(text).reads_conntrack  # CTCHK is never reached
    assert parse_policy(text.replace("-j DROP\nCOMMIT", "-j DROP\n-A FORWARD -j CTCHK\nCOMMIT")).reads_conntrack
