"""The nf_tables event codec (ops.policysync.nftevents) and the live listing's stripping (ops.policysync.live), on
messages built as the kernel writes them (include/uapi/linux/netfilter/nf_tables.h)."""

from __future__ import annotations

import struct

from hypafilter.ops.netlink import nla
from hypafilter.ops.policysync.live import strip_tool
from hypafilter.ops.policysync.nftevents import NFNL_SUBSYS_NFTABLES, parse_event
from hypafilter.ops.policysync.worker import relevant


def message(mtype: int, family: int, attrs: bytes) -> bytes:
    body = struct.pack("=BBH", family, 0, 0) + attrs
    return struct.pack("=IHHII", 16 + len(body), NFNL_SUBSYS_NFTABLES << 8 | mtype, 0, 0, 0) + body


def test_rule_and_generation_events():
    rule = message(6, 2, nla(1, b"filter\0") + nla(2, b"FORWARD\0"))
    e = parse_event(rule, 0)
    assert (e.kind, e.family, e.table, e.chain) == ("newrule", "ip", "filter", "FORWARD")
    assert relevant(e, "filter") and not relevant(e, "nat")
    gen = message(15, 0, nla(1, struct.pack(">I", 42)) + nla(2, struct.pack(">I", 4242)) + nla(3, b"iptables\0"))
    g = parse_event(gen, 0)
    assert (g.kind, g.gen, g.pid, g.proc) == ("newgen", 42, 4242, "iptables") and not relevant(g, "filter")
    bridge = parse_event(message(3, 7, nla(1, b"hf_unfilterable\0") + nla(3, b"c\0")), 0)
    assert bridge.family == "bridge" and not relevant(bridge, "filter")
    other = struct.pack("=IHHII", 20, 1 << 8 | 0, 0, 0, 0) + b"\0" * 4  # a conntrack message: not an nf_tables event
    assert parse_event(other, 0) is None


def test_strip_tool_keeps_the_operators_rules():
    text = (
        "*filter\n:FORWARD DROP [0:0]\n:HF7_MAIN - [0:0]\n:HF7_K0 - [0:0]\n:HFX - [0:0]\n"
        "-A FORWARD -j HF7_MAIN\n-A FORWARD -s 10.0.1.1/32 -j DROP\n-A FORWARD -j HFX\n"
        "-A HF7_MAIN -m mark --mark 0x0/0xfffffff0 -j HF7_K0\n-A HFX -j ACCEPT\nCOMMIT\n"
    )
    out = strip_tool(text, "HF")
    assert "HF7" not in out
    assert "-A FORWARD -s 10.0.1.1/32 -j DROP" in out and ":HFX - [0:0]" in out and "-A FORWARD -j HFX" in out


def test_digest_ignores_counters_comments_and_the_tools_chains():
    from hypafilter.ops.policysync.live import digest

    a = "# Generated\n*filter\n:FORWARD DROP [12:3400]\n:HF3_MAIN - [0:0]\n-A FORWARD -j HF3_MAIN\n-A FORWARD -j ACCEPT\nCOMMIT\n"
    b = "# other\n*filter\n:FORWARD DROP [99:9]\n:HF4_MAIN - [0:0]\n-A FORWARD -j HF4_MAIN\n-A FORWARD -j ACCEPT\nCOMMIT\n"
    assert digest(a, "HF") == digest(b, "HF")
    assert digest(a, "HF") != digest(a.replace("-j ACCEPT", "-j DROP"), "HF")
    assert digest(a, "HF") != digest(a.replace(":FORWARD DROP", ":FORWARD ACCEPT"), "HF")


def test_orphans_are_the_chains_a_deployed_file_leaves_unreached():
    from hypafilter.config import Config
    from hypafilter.iptables.document import parse_policy
    from hypafilter.ops.ruleset import orphans

    snapshot = (
        "*filter\n:INPUT ACCEPT [0:0]\n:FORWARD DROP [0:0]\n:OUTPUT ACCEPT [0:0]\n:OLD - [0:0]\n:OLDER - [0:0]\n"
        ":KEPT - [0:0]\n:INUSE - [0:0]\n:HF4_MAIN - [0:0]\n"
        "-A INPUT -j INUSE\n-A FORWARD -j HF4_MAIN\n-A FORWARD -j OLD\n-A OLD -j OLDER\n-A KEPT -j ACCEPT\nCOMMIT\n"
    )
    pol = parse_policy(
        "*filter\n:FORWARD DROP [0:0]\n:KEPT - [0:0]\n-A FORWARD -j KEPT\n-A KEPT -j ACCEPT\nCOMMIT\n",
        "new.rules",
        config=Config(),
    )
    assert orphans(snapshot, pol, "HF") == ["OLD", "OLDER"]
    # a chain the file declares stays, reached or not (ufw's empty ones: its commands use them later)
    declared = parse_policy(
        "*filter\n:FORWARD DROP [0:0]\n:KEPT - [0:0]\n:OLDER - [0:0]\n-A FORWARD -j KEPT\n-A KEPT -j ACCEPT\nCOMMIT\n",
        "new.rules",
        config=Config(),
    )
    assert orphans(snapshot, declared, "HF") == ["OLD"]


def test_expectation_events():
    """ctnetlink's expectation messages (NFNL_SUBSYS_CTNETLINK_EXP): NEW and DELETE, nothing else."""
    from hypafilter.ops.policysync.newflows import NFNL_SUBSYS_CTNETLINK_EXP, parse_exp

    def exp(mtype: int, subsys: int = NFNL_SUBSYS_CTNETLINK_EXP) -> bytes:
        return struct.pack("=IHHII", 20, subsys << 8 | mtype, 0, 0, 0) + b"\2\0\0\0"

    assert parse_exp(exp(0), 0) == "new" and parse_exp(exp(2), 0) == "destroy"
    assert parse_exp(exp(1), 0) is None  # a GET
    assert parse_exp(exp(0, subsys=1), 0) is None  # a conntrack entry's NEW
