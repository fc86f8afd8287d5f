"""Conntrack state as a hardware dimension: the split of state-only rules (iptables.ctstate), miss forcing
(Plan.miss_shunt) and the hybrid against the reference semantics with frames of every ct value.

The complex_eval of the property tests keeps the flow cache's promise: a frame with ct = 1 (2) belongs to a
connection in state ESTABLISHED seen in its original (reply) direction; with ct = 3 no conntrack entry holds it, so
the kernel reads it as NEW (original direction) or INVALID (no conntrack: xt_conntrack tests no --ctdir); with
ct = 0 it may be in any state.
The unsplit policy, evaluated with that callback, is the reference.
"""

from __future__ import annotations

import dataclasses

import pytest
from hypafilter.analysis.decision import decision
from hypafilter.analysis.hybrid import hybrid_verdict
from hypafilter.analysis.plan import build_plan
from hypafilter.analysis.program import STRATEGIES, build_program
from hypafilter.config import Config
from hypafilter.iptables.ctstate import NO_ENTRY, split_states, state_check
from hypafilter.iptables.document import parse_policy
from hypafilter.ir import Header, Policy
from hypafilter.ir.semantics import reference_verdict
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.irbuild import make_rule

CTSTATES = ("INVALID", "NEW", "ESTABLISHED", "RELATED", "UNTRACKED")
DIRS = ("ORIGINAL", "REPLY")
STATE_GROUPS = [
    ("-m", "conntrack", "--ctstate", "ESTABLISHED,RELATED"),
    ("-m", "conntrack", "--ctstate", "NEW"),
    ("-m", "conntrack", "--ctstate", "INVALID"),
    ("-m", "conntrack", "!", "--ctstate", "NEW"),
    ("-m", "conntrack", "!", "--ctstate", "ESTABLISHED"),
    ("-m", "state", "--state", "ESTABLISHED"),
    ("-m", "state", "!", "--state", "INVALID,NEW"),
    ("-m", "conntrack", "--ctdir", "REPLY"),
    ("-m", "conntrack", "--ctstate", "ESTABLISHED", "--ctdir", "ORIGINAL"),
    ("-m", "conntrack", "--ctstate", "DNAT"),  # not decidable on a hit: the rule stays complex
    ("-m", "conntrack", "--ctstatus", "ASSURED"),  # another option: stays complex
]
STRING = ("-m", "string", "--string", "X", "--algo", "bm")
ADDRS = [0x0A010203, 0x0A020001, 0xC0A80101]
PORTS = [22, 53, 80]


def _rule(kind: str, line: int, groups, proto, port):
    kw = {}
    if proto:
        kw["proto"] = proto
        if port:
            kw["dport"] = (port, port)
    return make_rule(kind, complex=groups, line=line, **kw)


@st.composite
def ct_rules(draw):
    out = []
    for line in range(1, draw(st.integers(1, 8)) + 1):
        proto = draw(st.sampled_from([None, "tcp", "udp"]))
        port = draw(st.sampled_from([None, *PORTS])) if proto else None
        target = draw(st.sampled_from(["ACCEPT", "DROP", "LOG"]))
        shape = draw(st.sampled_from(["plain", "state", "state", "state2", "string", "state+string"]))
        groups = []
        if shape.startswith("state"):
            groups.append(draw(st.sampled_from(STATE_GROUPS)))
        if shape == "state2":
            groups.append(draw(st.sampled_from(STATE_GROUPS)))
        if "string" in shape:
            groups.append(STRING)
        out.append(_rule(target, line, groups, proto, port))
    return out


@st.composite
def ct_headers(draw):
    proto = draw(st.sampled_from([1, 6, 17]))
    return Header(
        src=draw(st.sampled_from(ADDRS)),
        dst=draw(st.sampled_from(ADDRS)),
        proto=proto,
        dport=draw(st.sampled_from(PORTS)) if proto != 1 else 0,
        ct=draw(st.sampled_from([0, 0, 1, 2, 3])),
    )


def consistent_eval(seed: int):
    """complex_eval that keeps the flow cache's promise. The connection state of a frame with ct 0/3 and every other
    complex check are random, fixed per (rule line, header): the same answers for both parts of a split rule."""

    def bit(k: int) -> int:
        return (seed >> (k % 61)) & 1

    def conn(h: Header) -> tuple[str, str | None]:
        if h.ct in (1, 2):
            return "ESTABLISHED", DIRS[h.ct - 1]
        k = h.src + h.dport * 3 + h.proto + h.ct
        if h.ct == 3:
            return ("NEW", "ORIGINAL") if bit(k) else ("INVALID", NO_ENTRY)
        return CTSTATES[(bit(k) << 2 | bit(k + 1) << 1 | bit(k + 2)) % 5], DIRS[bit(k + 3)]

    def ev(i, rule, h):
        line = rule.origin.line
        for j, g in enumerate(rule.complex):
            chk = state_check(g)
            if chk is not None:
                ok = chk(*conn(h))
            else:  # a string match, --ctstate DNAT, --ctstatus: random (DNAT even on a hit)
                ok = bool(bit(line * 11 + j * 5 + h.dport + h.src % 7 + h.ct))
            if not ok:
                return False
        return True

    return ev


def policies(rs, default: str) -> tuple[Policy, Policy]:
    """(unsplit, split): the rules as written, and as the front end hands them on."""
    orig = [(*r.levels[0].options, "-j", r.target) for r in rs]
    reads = any(g[1] in ("conntrack", "state") for r in rs for g in r.complex)
    unsplit = Policy(rules=list(rs), default=default, original_rules=orig, reads_conntrack=reads)
    return unsplit, dataclasses.replace(unsplit, rules=split_states(list(rs)))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ct_rules(),
    st.sampled_from(["ACCEPT", "DROP"]),
    st.lists(ct_headers(), min_size=1, max_size=14),
    st.integers(0, (1 << 61) - 1),
    st.sampled_from(["bridge", "host"]),
)
def test_split_policy_and_hybrid_equal_the_reference(rs, default, hdrs, seed, nic_mode):
    unsplit, split = policies(rs, default)
    ev = consistent_eval(seed)
    config = Config(nic_mode=nic_mode)
    for h in hdrs:
        want = reference_verdict(unsplit, h, ev)
        assert reference_verdict(split, h, ev) == want, h
    for mode in ("index", "selective", "exact"):
        for strategy in STRATEGIES:
            if strategy == "hsa_cut" and mode == "index":
                continue
            plan = build_plan(split, config, mode=mode, strategy=strategy)  # mirroring depends on the strategy
            assert plan.miss_shunt == ((nic_mode == "bridge", True) if split.reads_conntrack else (False, False))
            for h in hdrs:
                want = reference_verdict(unsplit, h, ev)
                got, shunted, _ = hybrid_verdict(plan, strategy, h, ev, nic_mode=nic_mode)
                assert got == want, (mode, strategy, h)
                mi, _, action = decision(plan, h)
                if split.reads_conntrack and h.ct == 0 and not shunted:
                    # conntrack sees every frame the fast path does not know: only a host-mode ACCEPT stays
                    assert nic_mode == "host" and action == 1, (mode, h)
                if split.reads_conntrack and h.ct == 3 and not shunted:
                    # a frame without an entry is decided only when dropped (no state left in the kernel), or as
                    # host mode's ACCEPT (delivered to the host's conntrack)
                    assert action == 2 or (nic_mode == "host" and action == 1), (mode, h)


@pytest.mark.parametrize("nic_mode", ["bridge", "host"])
def test_without_miss_forcing_an_unknown_frame_would_be_kept_from_conntrack(nic_mode):
    """What the check above guards: entries above the first state rule do not shunt by their bit, so a ct = 0 frame
    would be decided in hardware; miss forcing sends it to conntrack instead (host mode: the DROP only)."""
    pol = parse_policy(
        "*filter\n:FORWARD ACCEPT [0:0]\n-A FORWARD -p tcp -m tcp --dport 80 -j ACCEPT\n"
        "-A FORWARD -p udp -m udp --dport 53 -j DROP\n"
        "-A FORWARD -m conntrack --ctstate ESTABLISHED,RELATED -j ACCEPT\n-A FORWARD -p tcp -j DROP\nCOMMIT\n"
    )
    for mode in ("index", "selective", "exact"):
        plan = build_plan(pol, Config(nic_mode=nic_mode), mode=mode)
        web, dns = Header(proto=6, dport=80), Header(proto=17, dport=53)
        assert not plan.shunt[0] and not plan.shunt[1]
        assert decision(plan, web) == (0, nic_mode == "bridge", 1)
        assert decision(plan, dns) == (1, True, 2)
        assert decision(plan, dataclasses.replace(dns, ct=1)) == (1, False, 2)  # a hit: conntrack knows it
        plan.miss_shunt = (False, False)
        assert not decision(plan, web)[1] and not decision(plan, dns)[1]


def _one(text: str):
    pol = parse_policy("*filter\n:FORWARD DROP [0:0]\n" + text + "\nCOMMIT\n")
    return pol.rules


def _ct_of(rule) -> list[tuple[int, int]]:
    return sorted({(b.lo[-1], b.hi[-1]) for b in rule.boxes})


M0, M03 = [(0, 0)], [(0, 0), (3, 3)]  # the miss part's ct: 0, or 0 and 3 when NEW and INVALID read it apart


@pytest.mark.parametrize(
    ("match", "hit", "miss"),
    [
        ("-m conntrack --ctstate ESTABLISHED,RELATED", [(1, 2)], M0),
        ("-m conntrack --ctstate RELATED,ESTABLISHED", [(1, 2)], M0),
        ("-m state --state ESTABLISHED", [(1, 2)], M0),
        ("-m state --state established", [(1, 2)], M0),
        ("-m conntrack ! --ctstate NEW", [(1, 2)], M03),  # INVALID holds, NEW not
        ("-m conntrack --ctstate ESTABLISHED --ctdir ORIGINAL", [(1, 1)], M0),
        ("-m conntrack --ctdir REPLY", [(2, 2)], M0),  # without a conntrack only a state check can match
        ("-m conntrack --ctdir reply", [(2, 2)], M0),
        ("-m conntrack --ctstate ESTABLISHED -m conntrack --ctdir REPLY", [(2, 2)], M0),  # conjunction
        ("-m state ! --state NEW -m conntrack --ctdir ORIGINAL", [(1, 1)], M0),
        ("-m conntrack --ctstate NEW", None, M03),  # never on a hit: the miss part alone
        ("-m conntrack --ctstate INVALID", None, M03),
        ("-m conntrack ! --ctstate ESTABLISHED", [(3, 3)], M0),  # NEW and INVALID both: no entry is decided
        ("-m conntrack ! --ctstate ESTABLISHED,RELATED", [(3, 3)], M0),
        ("-m conntrack --ctstate NEW,INVALID", [(3, 3)], M0),
        ("-m conntrack --ctstate NEW,INVALID --ctdir ORIGINAL", [(3, 3)], M0),  # INVALID: --ctdir not tested
        ("-m conntrack --ctstate NEW,INVALID --ctdir REPLY", None, M03),
        ("-m conntrack --ctstate INVALID --ctdir REPLY", None, M03),
        ("-m state ! --state RELATED", [(1, 3)], M0),
        ("-m conntrack ! --ctstate RELATED --ctdir REPLY", [(2, 2)], M03),
        ("-m conntrack --ctstate ESTABLISHED -m conntrack --ctstate NEW", None, M0),
        ("-m conntrack --ctstate ESTABLISHED --ctdir ORIGINAL -m conntrack --ctdir REPLY", None, M0),
    ],
)
def test_split_states_negation_ctdir_conjunction(match, hit, miss):
    rules = _one(f"-A FORWARD -p tcp -m tcp --dport 22 {match} -j ACCEPT")
    parts = [r.ct_part for r in rules]
    m = rules[-1]
    assert m.ct_part == "miss" and not m.is_simple and m.complex
    assert _ct_of(m) == miss
    if hit is None:
        assert parts == ["miss"]
    else:
        a = rules[0]
        assert parts == ["hit", "miss"] and a.is_simple and not a.complex and _ct_of(a) == hit
        assert a.levels == m.levels and a.origin == m.origin and a.target == m.target
        assert all(b.interval("dport") == (22, 22) and b.interval("proto") == (6, 6) for b in a.boxes)


def test_hit_part_with_ct_1_and_3_is_two_boxes():
    (a, _) = _one("-A FORWARD -p tcp -m conntrack ! --ctstate RELATED --ctdir ORIGINAL -j DROP")
    assert _ct_of(a) == [(1, 1), (3, 3)]


@pytest.mark.parametrize(
    "match",
    [
        "-m conntrack --ctstate ESTABLISHED,DNAT",  # virtual NAT states: a hit does not know them
        "-m conntrack --ctstate SNAT",
        "-m conntrack --ctstate ESTABLISHED --ctstatus ASSURED",  # another conntrack option
        "-m conntrack --ctstate ESTABLISHED --ctproto tcp",
        "-m conntrack --ctstate ESTABLISHED -m string --string x --algo bm",  # another complex check
        "-m conntrack --ctstate ESTABLISHED -m limit --limit 5/s",  # per-rule state
        "-m connmark --mark 1 -m conntrack --ctstate ESTABLISHED",
        "-i eth0 -m conntrack --ctstate ESTABLISHED",  # an interface check no site configuration resolved
    ],
)
def test_rules_with_other_checks_stay_wholly_complex(match):
    rules = _one(f"-A FORWARD -p tcp {match} -j ACCEPT")
    assert len(rules) == 1 and rules[0].ct_part == "" and not rules[0].is_simple
    assert _ct_of(rules[0]) == [(0, 3)]


def test_only_accept_and_drop_are_split_and_user_chains_and_guards_behave():
    text = """-N CHK
-A FORWARD -m conntrack --ctstate ESTABLISHED -j LOG
-A FORWARD -m conntrack --ctstate ESTABLISHED -j REJECT
-A FORWARD -p tcp -m conntrack --ctstate ESTABLISHED,RELATED -j CHK
-A CHK -s 10.0.0.0/8 -j RETURN
-A CHK -m state --state INVALID -j RETURN
-A CHK -p tcp -m tcp --dport 80 -j ACCEPT
-A CHK -j DROP"""
    pol = parse_policy("*filter\n:FORWARD DROP [0:0]\n:CHK - [0:0]\n" + text.split("\n", 1)[1] + "\nCOMMIT\n")
    kinds = [(r.target, r.ct_part, r.approximate) for r in pol.rules]
    # LOG and REJECT are complex by their target: left as they are. The jump's state check is conjoined into the
    # flattened rules of CHK; the complex RETURN guard (state INVALID) makes the rules after it approximate, so
    # they stay whole (complex) as well.
    assert kinds[:2] == [("LOG", "", False), ("REJECT", "", False)]
    assert all(r.approximate and r.ct_part == "" for r in pol.rules[2:])


def test_jump_with_a_state_check_into_a_guard_free_chain_splits_each_flattened_rule():
    pol = parse_policy(
        "*filter\n:FORWARD DROP [0:0]\n:WEB - [0:0]\n"
        "-A FORWARD -p tcp -m conntrack --ctstate ESTABLISHED -j WEB\n"
        "-A WEB -s 10.0.0.0/8 -j RETURN\n-A WEB -p tcp -m tcp --dport 80 -j ACCEPT\n-A WEB -j DROP\nCOMMIT\n"
    )
    assert [r.ct_part for r in pol.rules] == ["hit", "miss", "hit", "miss"]
    a = pol.rules[0]
    assert all(b.interval("src")[0] > 0x0AFFFFFF or b.interval("src")[1] < 0x0A000000 for b in a.boxes)
    assert len(a.levels) == 2 and a.levels[1].unless  # written back through its helper chain, guard included


def test_hit_frames_of_a_conntrack_first_policy_are_decided_in_hardware():
    pol = parse_policy(open("rulesets/conntrack.rules").read())
    plan = build_plan(pol, Config(), mode="selective")
    est = Header(src=0x0A000201, dst=0x0A000101, proto=6, sport=8080, dport=40000, tcp_flags=0x10)
    assert decision(plan, dataclasses.replace(est, ct=2)) == (0, False, 1)  # the hit part, in hardware
    assert decision(plan, dataclasses.replace(est, ct=1)) == (0, False, 1)
    mi, shunted, _ = decision(plan, est)  # ct 0: a miss, left to conntrack
    assert shunted and mi != 0


def test_software_writes_a_split_rule_from_its_levels():
    """Both parts render as the original rule, once in FULL (verbatim), and the chains stay consistent."""
    pol = parse_policy(open("rulesets/conntrack.rules").read())
    plan = build_plan(pol, Config(), mode="exact")
    prog = build_program(plan, "cut")
    from hypafilter.netfilter.restore import render_iptables

    text = render_iptables(prog, "filter")
    full = [ln for ln in text.splitlines() if ln.startswith("-A HF1_FULL ")]
    assert sum("conntrack" in ln for ln in full) == 1
    assert len(full) == len(pol.original_rules)


def test_lint_names_the_parts(tmp_path, capsys):
    from hypafilter.cli import main

    f = tmp_path / "p.rules"
    f.write_text(open("rulesets/conntrack.rules").read())
    assert main(["lint", "--no-kernel", str(f)]) == 0
    out = capsys.readouterr().out
    assert "#0 " in out and "simple on a flow-cache hit (original direction and reply direction)" in out
    assert "#1 " in out and "complex (on a flow-cache miss): match -m conntrack --ctstate ESTABLISHED,RELATED" in out


def test_analyze_counts_frames_forced_on_a_miss():
    """Trace headers have ct 0: in a policy that reads conntrack every one of them is shunted (bridge mode)."""
    import numpy as np
    from hypafilter.analysis.traffic import analyze
    from hypafilter.ir import NDIM

    pol = parse_policy(open("rulesets/conntrack.rules").read())
    pts = np.zeros((4, NDIM), dtype=np.int64)
    pts[:, 2] = [6, 17, 1, 47]  # proto
    out = analyze(pol, Config(), pts)
    assert out["shunted_packets_selective"] == out["shunted_packets_index_based"] == 4
    pts[:, -1] = 1  # all of them hits of established flows: the hit part decides them in hardware
    out = analyze(pol, Config(), pts)
    assert out["shunted_packets_selective"] == out["shunted_packets_index_based"] == 0


@pytest.mark.parametrize(("mode", "strategy"), [("exact", "cut"), ("selective", "hsa_cut"), ("exact", "interval")])
def test_a_split_rule_is_one_line_where_both_parts_are_tested(mode, strategy):
    """A string rule above the state rule: both parts of the split rule meet its reduction (exact chains) or come
    after the first shunting entry (CUT), and the chain holds the original rule once (a "policy" line of span 2)."""
    from hypafilter.netfilter.restore import render_iptables

    pol = parse_policy(
        "*filter\n:FORWARD DROP [0:0]\n-A FORWARD -p tcp -m string --string x --algo bm -j DROP\n"
        "-A FORWARD -m conntrack --ctstate ESTABLISHED,RELATED -j ACCEPT\n"
        "-A FORWARD -p tcp -m tcp --dport 80 -j ACCEPT\nCOMMIT\n"
    )
    assert [r.ct_part for r in pol.rules] == ["", "hit", "miss", ""]
    prog = build_program(build_plan(pol, Config(), mode=mode, strategy=strategy), strategy)
    spans = [r for rules in prog.chains.values() for r in rules if r.kind == "policy" and r.span == 2]
    assert spans and all(r.index == 1 for r in spans)
    for rules in prog.chains.values():  # never both parts as lines of their own in one chain
        idx = [r.index for r in rules if r.kind == "policy"]
        assert not (1 in idx and 2 in idx)
    text = render_iptables(prog, "filter")
    for chain in {c for c in prog.chains if c != prog.verbatim_full}:
        lines = [ln for ln in text.splitlines() if ln.startswith(f"-A {chain} ")]
        assert sum("conntrack" in ln for ln in lines) <= 1, chain
    ev = consistent_eval(12345)
    for ct in (0, 1, 2):
        for h in (Header(proto=6, dport=80, ct=ct), Header(proto=17, dport=53, ct=ct)):
            assert hybrid_verdict(build_plan(pol, Config(), mode=mode, strategy=strategy), strategy, h, ev)[
                0
            ] == reference_verdict(pol, h, ev)


def test_compile_writes_the_miss_forcing_bits(tmp_path):
    import json

    from hypafilter.cli import main

    out = tmp_path / "out"
    assert main(["compile", "rulesets/conntrack.rules", "-o", str(out)]) == 0
    regs = json.loads((out / "registers.json").read_text())
    assert regs[-1] == {"register": "CONTROL", "mask": 0x30, "value": 0x30}
    assert json.loads((out / "manifest.json").read_text())["miss_shunt"] == {"accept": True, "drop": True}
    assert "miss forcing (CONTROL bits 4/5)" in (out / "partition.txt").read_text()


def test_resolved_interface_checks_leave_the_state_checks_alone():
    """With the site's interfaces, `-i br0` holds for every NIC frame and physdev becomes an iport interval: the
    state check is then the only complex one and the rule splits; `-i nf+` matches no NIC frame (no IR rule)."""
    cfg = Config(bridge="br0", hw_ports={"nf0": 0, "nf1": 1})
    pol = parse_policy(
        "*filter\n:FORWARD DROP [0:0]\n"
        "-A FORWARD -i br0 -m conntrack --ctstate ESTABLISHED,RELATED -j ACCEPT\n"
        "-A FORWARD -m physdev --physdev-in nf0 -m state --state ESTABLISHED -j ACCEPT\n"
        "-A FORWARD -i nf+ -m conntrack --ctstate ESTABLISHED -j ACCEPT\nCOMMIT\n",
        config=cfg,
    )
    assert [r.ct_part for r in pol.rules] == ["hit", "miss", "hit", "miss"]
    assert {b.interval("iport") for b in pol.rules[2].boxes} == {(0, 0)}
