"""The hardware region of a rule with per-rule state: only the header checks the kernel tests before the
stateful match (tests/system/test_exact_state.py compares the traffic with the kernel)."""

from __future__ import annotations

import pytest
from hypafilter.analysis.plan import build_plan
from hypafilter.config import Config
from hypafilter.iptables.document import parse_policy
from hypafilter.iptables.parser import parse_rule
from hypafilter.ir import Box


def test_port_after_limit_is_left_to_software():
    (r,) = parse_rule("-p udp -m limit --limit 1/s -m udp --dport 80 -j ACCEPT")
    assert r.boxes == [Box.full().with_field("proto", 17, 17)]  # every UDP packet reaches the bucket
    assert r.complex == [("-m", "limit", "--limit", "1/s"), ("-m", "udp", "--dport", "80")]


def test_port_before_limit_stays_in_the_region():
    (r,) = parse_rule("-p udp -m udp --dport 80 -m limit --limit 1/s -j ACCEPT")
    assert r.boxes == [Box.full().with_field("proto", 17, 17).with_field("dport", 80, 80)]
    assert r.complex == [("-m", "limit", "--limit", "1/s")]


@pytest.mark.parametrize(
    "rule",
    [
        "-s 10.0.0.0/8 -p tcp -m recent --set --name x -m tcp --dport 22 -m iprange --src-range 10.0.0.1-10.0.0.9",
        "-s 10.0.0.0/8 -p tcp -m quota --quota 10 -m multiport --dports 22,23 -m icmp --icmp-type 8",
    ],
)
def test_standard_options_always_come_first(rule):
    """-s/-d/-p are tested before any match, wherever they are written; every match after the state is kept."""
    (r,) = parse_rule(rule.replace("-m icmp --icmp-type 8", "") + " -j DROP")
    assert r.boxes == [Box.full().with_field("src", 0x0A000000, 0x0AFFFFFF).with_field("proto", 6, 6)]
    assert len(r.complex) == rule.count("-m ") - rule.count("-m icmp")


def test_a_simple_rule_after_the_stateful_one_shunts():
    """selective: the limit rule's region is every UDP packet, so the UDP/81 ACCEPT below it meets it and shunts."""
    pol = parse_policy(
        "*filter\n:FORWARD DROP [0:0]\n"
        "-A FORWARD -p udp -m limit --limit 1/hour --limit-burst 3 -m udp --dport 80 -j ACCEPT\n"
        "-A FORWARD -p udp -m udp --dport 81 -j ACCEPT\n"
        "-A FORWARD -p tcp -m tcp --dport 81 -j ACCEPT\nCOMMIT\n"
    )
    sel = build_plan(pol, Config(), mode="selective")
    assert [bool(b) for b in sel.shunt[:2]] == [True, False], sel.shunt_string()
    exact = build_plan(pol, Config(), mode="exact")
    assert exact.entries[0].boxes == (Box.full().with_field("proto", 17, 17),)  # UDP/81 matches it first: shunted
