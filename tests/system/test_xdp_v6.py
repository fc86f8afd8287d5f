"""IPv6 decided by the xdp program (docs/ipv6.md "## xdp"), the kernel as oracle: family-6 plans from hand-made IR
(tests/xdp_v6.py: ranked boxes and an AddrMap, until the IR's parser and compress are merged), frames of every
extension-header shape and the malformed ones, each through the program (BPF_PROG_TEST_RUN) and through the same
rules in ip6tables alone on a bridge (namespaces `v6x-k`, `v6x-w`). Every frame the program decides (forwarded or
dropped) must get the kernel's verdict; the frames the kernel reads differently from a plain header (fragments,
truncated or over-long chains, jumbo and malformed hop-by-hop options, trailing bytes, another version) must be
unparsed (value 0: the full policy in software, M reason 2). Shunted frames (k > 0) are not compared here: their
chains are ip6tables' (verify -6 on the lab, s12-v6ops)."""

from __future__ import annotations

import collections
import ipaddress
import os
import random

import pytest

from tests.system.test_xdp import veth_namespace
from tests.xdp_v6 import PARSED, Oracle, Rule6, frame, frames_for, ipv4_tcp, ranked_plan

pytestmark = pytest.mark.system

RUN_NS = "v6x-t"
PORTS = ("n0", "n1")
XDP_DROP, XDP_PASS, XDP_REDIRECT = 1, 2, 4
INDEX_BASE = 5  # the dual-stack index space: the IPv4 plan's n4 + 1 (below: 4 entries)

V4 = """*filter
:FORWARD ACCEPT [0:0]
-A FORWARD -s 10.0.0.0/8 -j DROP
-A FORWARD -p tcp --dport 22 -j DROP
-A FORWARD -p udp -j ACCEPT
-A FORWARD -d 192.0.2.0/24 -j DROP
COMMIT
"""

RULES = {
    "drop-default": (
        [
            Rule6(src="2001:db8:1::/48", proto="tcp", dport=(80, 88)),
            Rule6(src="2001:db8:1:5::/64", dst="2001:db8:2::/48", target="DROP"),
            Rule6(dst="2001:db8:2::/48", proto="udp", dport=(53, 53)),
            Rule6(proto="icmpv6", icmp6=128),
            Rule6(proto="icmpv6", icmp6=135),
            Rule6(src="2001:db8::/32", proto="tcp", dport=(8000, 8999), complex_=True),
            Rule6(dst="2001:db8:3::/64", proto="esp"),
            Rule6(src="2001:db8:4::/48", proto="59"),
            Rule6(src="2001:db8:4::/48", proto="132"),
            Rule6(dst="ff02::/16", target="DROP"),
            Rule6(src="::/0", dst="2001:db8:5::/48"),
        ],
        "DROP",
    ),
    "accept-default": (
        [
            Rule6(src="2001:db8:1::/48", dst="2001:db8:2::/48", target="DROP"),
            Rule6(proto="tcp", dport=(22, 23), target="DROP"),
            Rule6(src="2001:db8:1:8000::/49", complex_=True, target="DROP"),
            Rule6(proto="udp", dport=(1, 1023), target="DROP"),
            Rule6(proto="icmpv6", icmp6=1, target="DROP"),
            Rule6(dst="2001:db8:3::/64", proto="esp", target="DROP"),
            Rule6(src="fe80::/10", target="DROP"),
        ],
        "ACCEPT",
    ),
}


@pytest.fixture(scope="module")
def oracle():
    from conftest import need_root, need_tool

    need_root()
    need_tool("ip", "ip6tables-restore", "sysctl", "modprobe")
    with Oracle("v6x") as o:
        yield o


@pytest.fixture(scope="module")
def run_ns():
    with veth_namespace(RUN_NS, PORTS) as name:
        yield name


def _plan4():
    from hypafilter.analysis.plan import build_plan
    from hypafilter.iptables.document import parse_policy

    return build_plan(parse_policy(V4, "v6x-v4"))


# One policy in every run; with HF_XDP_V6_FULL=1 (`make test-xdp-v6`) the second one and the tests defined under FULL.
FULL = os.environ.get("HF_XDP_V6_FULL") == "1"
CASES = [("drop-default", "selective")] + ([("accept-default", "exact")] if FULL else [])


@pytest.mark.parametrize("name,mode", CASES)
def test_decided_frames_agree_with_ip6tables(oracle, run_ns, name, mode):
    from hypafilter.targets.xdp.run import run_frames

    rules, policy = RULES[name]
    text, plan6 = ranked_plan(rules, policy, mode=mode, index_base=INDEX_BASE)
    n6 = len(plan6.entries)
    frames = frames_for(rules, random.Random(hash(name) & 0xFFFF), 500)
    v4frame = ipv4_tcp("10.0.0.1", "192.0.2.1", 1234, 22)
    res = run_frames(_plan4(), [(0, f) for _, _, f in frames] + [(0, v4frame)], PORTS, ns=run_ns, plan6=plan6)
    kernel = oracle.passed(text, [f for _, _, f in frames])
    tally = collections.Counter()
    wrong = []
    for (uid, kind, _f), v in zip(frames, res.verdicts, strict=False):
        reason = (v.meta >> 28) & 0xF
        index = v.meta & 0xFFFFFF
        if v.retval in (XDP_DROP, XDP_REDIRECT):
            assert reason == 15 and INDEX_BASE <= index <= INDEX_BASE + n6, (uid, kind, hex(v.meta))
            assert not plan6.shunt[index - INDEX_BASE]
            tally[kind, "decided"] += 1
            if (v.retval == XDP_REDIRECT) != (uid in kernel):
                wrong.append((uid, kind, v.retval, uid in kernel))
        else:
            assert v.retval == XDP_PASS, (uid, kind, v.retval)
            tally[kind, "unparsed" if reason == 2 else "shunted"] += 1
            if reason == 2:
                assert v.value == 0 and index == INDEX_BASE + n6, (uid, kind, hex(v.meta))
            else:
                j = index - INDEX_BASE  # a shunted entry's frame, marked with its interval k
                assert plan6.shunt[j] and v.value >> 4 == plan6.interval[j], (uid, kind, hex(v.meta), v.value)
        if kind in PARSED:
            assert reason != 2, (uid, kind, "parsed frames are classified")
        else:
            assert reason == 2, (uid, kind, "left to the kernel")
    assert not wrong, f"{len(wrong)} frames decided against ip6tables: {wrong[:10]}"
    parsed = sum(c for (k, how), c in tally.items() if k in PARSED)
    decided = sum(c for (k, how), c in tally.items() if how == "decided")
    assert decided >= 0.3 * parsed, tally
    assert tally["plain", "shunted"] + tally["chain", "shunted"] > 0, "the complex rule's frames go to the kernel"
    assert 0 < len(kernel) < len(frames), "the kernel both passed and dropped frames"
    # The IPv4 frame beside them: the IPv4 table set (10/8 DROP, index 0), unchanged by the IPv6 one.
    v = res.verdicts[-1]
    assert v.retval == XDP_DROP and v.meta & 0xFFFFFF == 0
    assert res.counters["PKTIN"] == len(frames) + 1


def _ct_insert(ns: str, proto: str, src: str, dst: str, sport: int, dport: int) -> None:
    from hypafilter import netns

    argv = ["conntrack", "-I", "-s", src, "-d", dst, "-r", dst, "-q", src, "-p", proto, "--sport", str(sport)]
    argv += ["--dport", str(dport), "--reply-port-src", str(dport), "--reply-port-dst", str(sport), "-t", "600"]
    argv += ["-u", "SEEN_REPLY,ASSURED"] + (["--state", "ESTABLISHED"] if proto == "tcp" else [])
    netns.run(argv, ns)


def test_conntrack_lookup_with_ipv6_tuples(run_ns):
    """bpf_xdp_ct_lookup with bpf_sock_tuple.ipv6 against the kernel's own IPv6 entries (conntrack -I in the run's
    namespace) under a conntrack-first policy: UDP frames of an entry (either direction, behind extension headers too)
    are hits decided by the ESTABLISHED accept, and so is an ACK of a TCP entry (made through ctnetlink, which the
    program reads as liberal, as for IPv4), but never its FIN (to the stack); frames without an entry are ct
    3: dropped here where the policy drops them, forced where it accepts them."""
    from hypafilter import netns
    from hypafilter.targets.xdp.run import run_frames
    from hypafilter.targets.xdp.tables import CtConfig
    from hypafilter.targets.xdp.target import control_of

    from conftest import need_tool

    need_tool("conntrack")
    rules = [
        Rule6(proto="udp", dport=(5353, 5353)),
        Rule6(proto="tcp", dport=(22, 22), target="DROP"),
    ]
    _, plan6 = ranked_plan(rules, "DROP", index_base=INDEX_BASE, ct_first=True)
    assert plan6.miss_shunt[0]
    a, b = "2001:db8:1::10", "2001:db8:2::20"
    ia, ib = (int(ipaddress.IPv6Address(x)) for x in (a, b))
    netns.run(["conntrack", "-F"], run_ns, check=False)
    _ct_insert(run_ns, "udp", a, b, 40000, 9999)
    _ct_insert(run_ns, "tcp", a, b, 40001, 443)
    frames = [
        frame(1, ia, ib, 17, sport=40000, dport=9999),  # UDP entry, original direction
        frame(2, ib, ia, 17, sport=9999, dport=40000),  # its reply direction
        frame(3, ia, ib, 17, chain=(0, 60), sport=40000, dport=9999),  # behind extension headers
        frame(4, ia, ib, 6, sport=40001, dport=443),  # an ACK of the TCP ESTABLISHED entry
        frame(8, ia, ib, 6, sport=40001, dport=443, flags=0x11),  # its FIN: ct 0, to conntrack
        frame(5, ia, ib, 17, sport=40002, dport=9999),  # no entry, the policy drops it: ct 3, decided
        frame(6, ia, ib, 17, sport=40002, dport=5353),  # no entry, accepted: ct 3, forced to conntrack
        frame(7, ia, ib, 6, sport=40003, dport=22, flags=0x02),  # a SYN without entry to a dropped port
    ]
    # The IPv4 plan is stateless (no lookup, no miss forcing); the IPv6 one's own settings (hfx6_config) decide.
    ct = CtConfig(lookup=True, tcp_ms=432000000, udp_ms=120000, udp_unreplied_ms=30000, none=True)
    kw = {"control": control_of("drop", "bridge"), "control6": control_of("drop", "bridge", plan6.miss_shunt)}
    res = run_frames(_plan4(), [(0, f) for f in frames], PORTS, ns=run_ns, plan6=plan6, ct6=ct, **kw)
    got = [(v.retval, (v.meta >> 28) & 0xF, (v.meta & 0xFFFFFF) - INDEX_BASE) for v in res.verdicts]
    n6 = len(plan6.entries)
    assert got == [
        (XDP_REDIRECT, 15, 0),
        (XDP_REDIRECT, 15, 0),
        (XDP_REDIRECT, 15, 0),
        (XDP_REDIRECT, 15, 0),
        (XDP_PASS, 1, n6),  # the FIN, ct 0: the ESTABLISHED accept cannot decide it; the policy entry is shunted
        (XDP_DROP, 15, n6),
        (XDP_PASS, 3, 1),
        (XDP_DROP, 15, 2),
    ], got
    # Without the entries every TCP/UDP frame is a miss: none is forwarded.
    netns.run(["conntrack", "-F"], run_ns, check=False)
    res = run_frames(_plan4(), [(0, f) for f in frames], PORTS, ns=run_ns, plan6=plan6, ct6=ct, **kw)
    assert XDP_REDIRECT not in [v.retval for v in res.verdicts]


if FULL:  # `make test-xdp-v6`: the deploy path runs the same (test_xdp_v6_lab.py); these check its parts

    def test_chain_budget_and_hop_by_hop_in_host_mode(run_ns):
        """Eight extension headers are walked, nine are unparsed; a leading hop-by-hop header is unparsed in host mode
        (ip6_rcv_core parses its options before PREROUTING), parsed in bridge mode."""
        from hypafilter.targets.xdp.run import run_frames

        rules = [Rule6(proto="tcp", dport=(80, 80), target="DROP")]
        _, plan6 = ranked_plan(rules, "ACCEPT", index_base=INDEX_BASE)
        a, b = 0x20010DB8 << 96 | 1, 0x20010DB8 << 96 | 2
        frames = [frame(1, a, b, 6, chain=(60,) * 8, dport=80), frame(2, a, b, 6, chain=(60,) * 9, dport=80)]
        frames += [frame(3, a, b, 6, chain=(0,), dport=80)]
        bridge = run_frames(_plan4(), [(0, f) for f in frames], PORTS, ns=run_ns, plan6=plan6).verdicts
        host = run_frames(_plan4(), [(0, f) for f in frames], PORTS, ns=run_ns, plan6=plan6, control=1 | 8).verdicts
        assert [v.retval for v in bridge] == [XDP_DROP, XDP_PASS, XDP_DROP]
        assert (bridge[1].meta >> 28) & 0xF == 2
        assert [v.retval for v in host] == [XDP_DROP, XDP_PASS, XDP_PASS]
        assert [(v.meta >> 28) & 0xF for v in host[1:]] == [2, 2]

    ACCEPT, DROP = 1, 2  # M's action field

    def _decision(v) -> tuple[int, int]:
        """(action, match_index) of a frame the program decided itself (reason 15 or 5, host mode's decided ACCEPT)."""
        assert (v.meta >> 28) & 0xF in (5, 15), hex(v.meta)
        return (v.meta >> 24) & 0xF, v.meta & 0xFFFFFF

    def test_target_programs_both_table_sets(run_ns, tmp_path):
        """XdpTarget with a dual-stack plan (the IPv6 plan as `plan6`): the started program decides IPv6 frames by the
        IPv6 table set and IPv4 frames by the IPv4 one; a new IPv6 plan of the same shape is a map update of the running
        program; an IPv4 plan alone does not fit a program with an IPv6 table set (a new program), nor the reverse."""
        from hypafilter.config import Config
        from hypafilter.errors import HypafilterError
        from hypafilter.targets.base import Site
        from hypafilter.targets.xdp.run import run_pinned
        from hypafilter.targets.xdp.target import XdpTarget

        rules = [Rule6(dst="2001:db8:2::/48", proto="udp", target="DROP"), Rule6(proto="tcp", dport=(80, 80))]
        _, plan6 = ranked_plan(rules, "DROP", index_base=INDEX_BASE)
        flipped = [Rule6(dst="2001:db8:2::/48", proto="udp"), Rule6(proto="tcp", dport=(80, 80), target="DROP")]
        _, plan6b = ranked_plan(flipped, "DROP", index_base=INDEX_BASE)
        plan4 = _plan4()
        tgt = XdpTarget(Config(), Site("v6xt", run_ns, {"wire0": PORTS[0], "wire1": PORTS[1]}, tmp_path))
        a, b = 0x20010DB8000100000000000000000001, 0x20010DB8000200000000000000000002
        frames = [
            (0, frame(1, a, b, 17)),
            (0, frame(2, a, b, 6, dport=80)),
            (0, ipv4_tcp("10.0.0.1", "192.0.2.1", 1, 22)),
        ]
        info = tgt.start(tgt.build(plan4, plan6), 3)
        try:
            state = tgt.program(info, plan4, 3, plan6=plan6)
            # the IPv6 indices after the IPv4 entries, its policy entry and the update buffer's slots (Config's 16)
            base = len(plan4.entries) + 1 + Config().update_buffer
            assert state["v6"]["entries"] == len(plan6.entries) and state["v6"]["index_base"] == base
            got = [_decision(v) for v in run_pinned(info["pin"], frames, ns=run_ns).verdicts]
            assert got == [(DROP, base), (ACCEPT, base + 1), (DROP, 0)]
            plan4.plan6 = plan6b  # the attribute form: the same update
            tgt.program(info, plan4, 4)
            got = [_decision(v) for v in run_pinned(info["pin"], frames, ns=run_ns).verdicts]
            assert got == [(ACCEPT, base), (DROP, base + 1), (DROP, 0)]
            del plan4.plan6
            with pytest.raises(HypafilterError, match="do not fit"):
                tgt.program(info, plan4, 5)
        finally:
            tgt.stop(info)
        info = tgt.start(tgt.build(plan4), 6)
        try:
            with pytest.raises(HypafilterError, match="do not fit"):
                tgt.program(info, plan4, 6, plan6=plan6)
            tgt.program(info, plan4, 6)
            v = run_pinned(info["pin"], frames[:1], ns=run_ns).verdicts[0]
            assert v.retval == XDP_PASS and (v.meta >> 28) & 0xF == 2  # no IPv6 table set: unparsed, as before
        finally:
            tgt.stop(info)


# The IPv6 update buffer (docs/ipv6.md "The update buffer for IPv6"): the program's table set stays that of STATIC;
# the buffer (raw 128-bit slots, the valid mask, the master's rows) makes it decide as MASTER, which adds elementary
# intervals STATIC's ranks do not have (a /128 ban inside a /48 and a /64 destination), inserts them before the
# static entries they precede (a ban first, a DROP in the middle), and deletes a static entry (echo-request).
STATIC = RULES["drop-default"][0]
BAN6 = Rule6(src="2001:db8:1:5::66/128", target="DROP")  # inside STATIC's 2001:db8:1::/48 (and the /64 DROP)
MID6 = Rule6(dst="2001:db8:2:7::/64", proto="udp", target="DROP")  # before the udp/53 ACCEPT to 2001:db8:2::/48
# a complex ban (fail2ban's REJECT stays in ip6tables): the entries after it that it overlaps shunt their frames
CPLX6 = Rule6(src="2001:db8:4:1::/64", complex_=True, target="DROP")
MASTER = [BAN6, *STATIC[:2], MID6, STATIC[2], *STATIC[4:7], CPLX6, *STATIC[7:]]  # STATIC[3] (echo-request) deleted
EDGES = [  # one address past each new interval's edges: frames aimed there too
    Rule6(src="2001:db8:1:5::65/128"),
    Rule6(src="2001:db8:1:5::67/128"),
    Rule6(dst="2001:db8:2:6:ffff:ffff:ffff:ffff/128", proto="udp"),
    Rule6(dst="2001:db8:2:8::/128", proto="udp"),
]


def test_update_buffer6_decides_as_the_new_policy(oracle, run_ns):
    from hypafilter.analysis.overlay import align6
    from hypafilter.targets.xdp.run import run_frames

    _, static6 = ranked_plan(STATIC, "DROP", index_base=INDEX_BASE)
    text, master6 = ranked_plan(MASTER, "DROP", index_base=INDEX_BASE)
    depth = 8
    view = align6(static6, master6, depth)
    ov = view.overlay
    n6 = len(static6.entries)
    assert ov.used >= 2 and not ov.valid.all(), ov  # slots for the new rules, the deleted entry masked off
    assert ov.slots[0].pos == 0 and ov.slots[0].box.lo[0] == ov.slots[0].box.hi[0]  # the ban: first, one address
    frames = frames_for(STATIC + MASTER + EDGES, random.Random(25), 600)
    res = run_frames(_plan4(), [(0, f) for _, _, f in frames], PORTS, ns=run_ns, plan6=static6, view6=view)
    kernel = oracle.passed(text, [f for _, _, f in frames])
    tally = collections.Counter()
    wrong = []
    for (uid, kind, _f), v in zip(frames, res.verdicts, strict=True):
        reason = (v.meta >> 28) & 0xF
        local = (v.meta & 0xFFFFFF) - INDEX_BASE
        if reason == 2:
            continue
        assert 0 <= local <= n6 + depth, (uid, hex(v.meta))
        where = "slot" if local > n6 else "static"
        assert local >= n6 or ov.valid[local], (uid, local, "a masked-off static entry matched")
        if v.retval in (XDP_DROP, XDP_REDIRECT):
            assert not view.shunt[local], (uid, local)
            tally[where, "decided"] += 1
            if (v.retval == XDP_REDIRECT) != (uid in kernel):
                wrong.append((uid, kind, local, v.retval, uid in kernel))
        else:
            assert view.shunt[local] and v.value >> 4 == view.interval[local], (uid, local, v.value)
            tally[where, "shunted"] += 1
    assert not wrong, f"{len(wrong)} frames decided against ip6tables: {wrong[:10]}"
    print(f"IPv6 buffer: {ov.used} slots, {int((~ov.valid).sum())} masked; {dict(tally)}")
    assert tally["slot", "decided"] >= 5 and tally["static", "decided"] >= 30, tally
    # the complex ban is no entry (selective mode): the kept static entries it overlaps are shunted from here, their
    # rows rewritten with the new plan's shunt bit and k (checked per frame above)
    assert any(ov.valid[j] and view.shunt[j] and not static6.shunt[j] for j in range(n6)), list(view.shunt)
    # the same frames through STATIC's table set without the buffer do disagree with the new policy
    res0 = run_frames(_plan4(), [(0, f) for _, _, f in frames], PORTS, ns=run_ns, plan6=static6)
    stale = sum(
        1
        for (uid, _, _), v in zip(frames, res0.verdicts, strict=True)
        if v.retval in (XDP_DROP, XDP_REDIRECT) and (v.retval == XDP_REDIRECT) != (uid in kernel)
    )
    assert stale > 0
