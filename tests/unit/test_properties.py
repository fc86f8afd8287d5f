"""Property tests: for random policies and headers, the hybrid system's verdict equals the reference verdict.

Every strategy × shunting mode, with complex matches decided by one random callback shared by both sides, marks
placed under random masks with foreign bits set. A deliberately broken shunt vector must be caught. Observing rules
(LOG, NFLOG, no target; log mirroring) must be evaluated by software for exactly the headers, and in the order, in
which the reference walk over the original policy evaluates them.
"""

from __future__ import annotations

import numpy as np
from hypafilter.analysis.decision import decision
from hypafilter.analysis.hybrid import hybrid_verdict
from hypafilter.analysis.plan import build_plan
from hypafilter.analysis.program import STRATEGIES, build_program, mark_for
from hypafilter.config import Config
from hypafilter.ir import Header
from hypafilter.ir.semantics import reference_verdict, rule_outcome
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.irbuild import listing1, make_policy, make_rule

PREFIXES = [None, "10.0.0.0/8", "10.1.0.0/16", "10.1.2.0/24", "10.1.2.3/32", "192.168.0.0/16"]
ADDRS = [0x0A010203, 0x0A010204, 0x0A020001, 0xC0A80101, 0x08080808]
PORTS = [22, 53, 80, 443, 8080]
COMPLEX = [("-m", "string", "--string", "X", "--algo", "bm")]
MARKS = [(0xFFFFFFFF, 0), (0x00FFFF00, 8), (0x0FFFFFFF, 0), (0xFFFF0000, 16)]


@st.composite
def rules(draw):
    proto = draw(st.sampled_from([None, "tcp", "udp"]))
    kw = {}
    src = draw(st.sampled_from(PREFIXES))
    if src:
        kw.update(src=src, not_src=draw(st.booleans()))
    dst = draw(st.sampled_from(PREFIXES))
    if dst:
        kw.update(dst=dst, not_dst=draw(st.booleans()))
    if proto:
        kw["proto"] = proto
        ports = draw(st.sampled_from(["none", "one", "range", "multi"]))
        if ports == "one":
            p = draw(st.sampled_from(PORTS))
            kw["dport"] = (p, p)
        elif ports == "range":
            a, b = sorted(draw(st.lists(st.sampled_from(PORTS), min_size=2, max_size=2)))
            kw["dport"] = (a, b)
        elif ports == "multi":
            kw["dports"] = sorted(set(draw(st.lists(st.sampled_from(PORTS), min_size=1, max_size=3))))
    kind = draw(
        st.sampled_from(
            ["ACCEPT", "DROP", "ACCEPT", "DROP", "cDROP", "cACCEPT", "LOG", "NFLOG", "count", "MARK", "REJECT"]
        )
    )
    if kind.startswith("c") and kind != "count":
        return make_rule(kind[1:], complex=COMPLEX, **kw)
    if kind in ("LOG", "NFLOG", "count"):  # observing rules: LOG, NFLOG, no target (a counting rule)
        return make_rule("" if kind == "count" else kind, complex=COMPLEX if draw(st.booleans()) else (), **kw)
    if kind == "MARK":  # a complex rule that rewrites the mark: dispatch must not read it afterwards
        return make_rule("MARK", target_args=("--set-xmark", "0x5/0xffffffff"), **kw)
    return make_rule(kind, **kw)


@st.composite
def headers(draw):
    proto = draw(st.sampled_from([1, 6, 17]))
    port = draw(st.sampled_from(PORTS)) if proto != 1 else 0
    src, dst = draw(st.sampled_from(ADDRS)), draw(st.sampled_from(ADDRS))
    # ct: what a flow cache would know; no rule here reads a state, so any value is consistent with every callback
    return Header(src=src, dst=dst, proto=proto, dport=port, ct=draw(st.sampled_from([0, 0, 1, 2])))


def _callback(seed: int):
    """Random but fixed per (rule, header): the same answers on both sides of the comparison."""

    def ev(i, rule, h):
        return bool((seed >> ((i * 7 + h.dport + h.src) % 61)) & 1)

    return ev


OBSERVING = ("LOG", "NFLOG", "")


def reference_observed(pol, h, ev) -> list[int]:
    """The observing rules the kernel's walk over the original policy reaches with `h` inside their boxes (where
    they may log or count), in walk order: written from ir.semantics alone, not from the code under test."""
    seen = []
    for i, r in enumerate(pol.rules):
        if r.target in OBSERVING and any(b.contains(h) for b in r.boxes):
            seen.append(i)
        if rule_outcome(pol, i, h, ev):
            break
    return seen


def mismatches(plan, strategy, hdrs, ev, mark=(0xFFFFFFFF, 0), foreign=0, nic_mode="bridge", observed=True):
    """(header, want, got) for every header whose hybrid verdict, or (`observed`) whose observed rules, differ."""
    bad = []
    pol = plan.policy
    for h in hdrs:
        want = reference_verdict(pol, h, ev)
        trace: list[int] = []
        got, _, _ = hybrid_verdict(plan, strategy, h, ev, foreign, mark[0], mark[1], nic_mode=nic_mode, trace=trace)
        if got != want:
            bad.append((h, want, got))
            continue
        if not observed:
            continue
        seen = [i for i in trace if pol.rules[i].target in OBSERVING and any(b.contains(h) for b in pol.rules[i].boxes)]
        if seen != reference_observed(pol, h, ev):
            bad.append((h, ("observed", reference_observed(pol, h, ev)), ("observed", seen)))
    return bad


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(rules(), min_size=1, max_size=9),
    st.sampled_from(["ACCEPT", "DROP"]),
    st.lists(headers(), min_size=1, max_size=12),
    st.integers(0, (1 << 61) - 1),
    st.sampled_from(MARKS),
    st.integers(0, 0xFFFFFFFF),
    st.booleans(),
    st.sampled_from(["bridge", "host"]),
)
def test_hybrid_equals_reference(rs, default, hdrs, seed, mark, foreign, reads_conntrack, nic_mode):
    pol = make_policy(rs, default)
    # A policy that reads conntrack shunts entries whatever their Alg. 1 bit: every strategy must still be exact.
    pol.reads_conntrack = reads_conntrack
    ev = _callback(seed)
    config = Config(nic_mode=nic_mode)
    for mode in ("index", "selective", "exact"):
        for strategy in STRATEGIES:
            if strategy == "hsa_cut" and mode == "index":
                continue
            plan = build_plan(pol, config, mode=mode, strategy=strategy)  # mirroring depends on the strategy
            assert mismatches(plan, strategy, hdrs, ev, mark, foreign, nic_mode) == [], (mode, strategy, nic_mode)


def _all_headers():
    return [
        Header(src=s, dst=d, proto=p, dport=(q if p != 1 else 0))
        for s in ADDRS
        for d in ADDRS
        for p in (1, 6, 17)
        for q in PORTS
    ]


def test_broken_shunt_vector_is_caught():
    # Listing 1 with R6's selective bit cleared: a DNS packet matching R5's string would be accepted in hardware.
    plan = build_plan(listing1(), mode="selective")
    ev = _callback((1 << 61) - 1)  # every complex check matches
    hdrs = [Header(dst=0x01020306, proto=17, dport=53)] + _all_headers()
    assert mismatches(plan, "interval", hdrs, ev) == []
    plan.shunt[3] = False
    bad = mismatches(plan, "interval", hdrs, ev)
    assert bad and bad[0][1:] == ("DROP", "ACCEPT")


@settings(max_examples=40, deadline=None)
@given(st.lists(rules(), min_size=2, max_size=9), st.integers(0, (1 << 61) - 1))
def test_broken_vectors_are_caught_on_random_policies(rs, seed):
    """Clearing every shunt bit must break the property whenever some complex rule can decide a header."""
    pol = make_policy(rs, "ACCEPT")
    ev = _callback(seed)
    hdrs = _all_headers()
    plan = build_plan(pol, mode="selective")
    truth = mismatches(plan, "interval", hdrs, ev)
    assert truth == []
    plan.shunt[:] = False
    # With no shunting the hybrid answers with the first simple rule's action: every header whose true verdict
    # differs from that must be reported, and no other.
    simple_only = make_policy([r for r in rs if r.is_simple], "ACCEPT")
    expected = [h for h in hdrs if reference_verdict(pol, h, ev) != reference_verdict(simple_only, h)]
    assert [b[0] for b in mismatches(plan, "interval", hdrs, ev, observed=False)] == expected


@settings(max_examples=40, deadline=None)
@given(
    st.lists(rules(), min_size=2, max_size=9), st.integers(0, (1 << 61) - 1), st.sampled_from(["index", "selective"])
)
def test_cleared_mirror_bits_are_caught_on_random_policies(rs, seed, mode):
    """Clearing every mirror bit keeps the verdicts but must be reported for exactly the headers whose entry was
    mirrored and for which the reference walk reaches an observing rule that contains them."""
    pol = make_policy(rs, "ACCEPT")
    ev = _callback(seed)
    hdrs = _all_headers()
    plan = build_plan(pol, mode=mode, strategy="interval")
    assert mismatches(plan, "interval", hdrs, ev) == []
    was = plan.mirror.copy()
    plan.mirror[:] = False
    plan.refresh()
    expected = [
        h for h in hdrs if was[decision(plan, h)[0]] and not decision(plan, h)[1] and reference_observed(pol, h, ev)
    ]
    bad = mismatches(plan, "interval", hdrs, ev)
    assert [b[0] for b in bad] == expected
    assert all(b[1][0] == "observed" and b[2] == ("observed", []) for b in bad)


def test_random_mark_bits_outside_mask_are_ignored():
    plan = build_plan(listing1(), mode="index")
    rng = np.random.default_rng(3)
    ev = _callback(12345)
    for mask, shift in MARKS:
        for foreign in rng.integers(0, 1 << 32, 5):
            assert mismatches(plan, "interval", _all_headers()[:60], ev, (mask, shift), int(foreign)) == []


LIMIT = ("-m", "limit", "--limit", "3/sec")


def _reached(prog, chain, seen=None) -> set[int]:
    """Flattened policy rules a chain of the program can evaluate (through blocks, segments and jumps)."""
    seen = set() if seen is None else seen
    out: set[int] = set()
    if chain in seen or chain not in prog.chains:
        return out
    seen.add(chain)
    for r in prog.chains[chain]:
        if r.kind == "policy":
            out |= set(range(r.index, r.index + r.span))
        elif r.target in prog.chains:
            out |= _reached(prog, r.target, seen)
    return out


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(rules(), min_size=1, max_size=8),
    st.lists(st.integers(0, 7), max_size=3),
    st.sampled_from(["ACCEPT", "DROP"]),
    st.lists(headers(), min_size=1, max_size=12),
    st.integers(0, (1 << 61) - 1),
    st.sampled_from(["bridge", "host"]),
)
def test_live_chains_equal_reference_and_never_copy_per_rule_state(rs, stateful, default, hdrs, seed, nic_mode):
    """A deployment keeps the operator's chains (Plan.live): the tool's chains return to them for what they do not
    decide. The hybrid still gives the reference verdict with the same observing rules reached, and no chain a
    shunted frame or a mirror copy runs holds a copy of a base-chain rule with per-rule state (its bucket is the operator's rule)."""
    import dataclasses

    rs = list(rs)
    for i in stateful:
        if i < len(rs):  # a rate-limited rule: complex, with per-rule state at its base position
            r = rs[i]
            rs[i] = dataclasses.replace(r, complex=(*r.complex, LIMIT), stateful_pos=i)
    pol = make_policy(rs, default)
    ev = _callback(seed)
    config = Config(nic_mode=nic_mode)
    for mode in ("index", "selective", "exact"):
        for strategy in STRATEGIES:
            if strategy == "hsa_cut" and mode == "index":
                continue
            plan = build_plan(pol, config, mode=mode, strategy=strategy, live=True)
            assert mismatches(plan, strategy, hdrs, ev, nic_mode=nic_mode) == [], (mode, strategy, nic_mode)
            prog = build_program(plan, strategy, nic_mode=nic_mode)
            assert (
                not any(k.endswith("FULL") for k in prog.chains) and prog.chains[prog.name("K0")][-1].kind == "unmark"
            )
            # a frame without valid metadata (k = 0: untagged, unparsed, a stale generation) gets the live rules' verdict
            for h in hdrs:
                assert prog.run(h, mark_for(prog, 0, 0), ev)[0] == reference_verdict(pol, h, ev), (mode, strategy, h)
            for name in prog.chains:
                if name.startswith(prog.name("L")) or name == prog.name("CUT"):
                    held = [i for i in _reached(prog, name) if pol.rules[i].stateful_pos is not None]
                    assert held == [], (mode, strategy, name, held)
