"""Chain flattening: jumps, RETURN, goto, loops, the expansion bound, and a property test against a chain walker."""

from __future__ import annotations

import pytest
from hypafilter.config import Config
from hypafilter.errors import PolicyError
from hypafilter.iptables.document import parse_policy
from hypafilter.iptables.parser import parse_rule
from hypafilter.ir import Box, Header
from hypafilter.ir.box import box_minus, boxes_minus
from hypafilter.ir.semantics import reference_verdict
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st


def ip(s: str) -> int:
    a, b, c, d = (int(x) for x in s.split("."))
    return (a << 24) | (b << 16) | (c << 8) | d


def flat(*lines: str, policy: str = "ACCEPT", chains=(), **parse_options):
    """The flattened policy of FORWARD (policy `policy`) with these rule lines and these user chains declared."""
    head = ["*filter", f":FORWARD {policy} [0:0]"] + [f":{c} - [0:0]" for c in chains]
    return parse_policy("\n".join(head + list(lines) + ["COMMIT"]) + "\n", **parse_options)


# --- box difference -------------------------------------------------------------------------------------------


def test_box_minus_disjoint_cover():
    a = Box.full().with_field("dport", 0, 100).with_field("proto", 6, 6)
    b = Box.full().with_field("dport", 10, 20)
    parts = box_minus(a, b)
    for port in (0, 9, 10, 15, 20, 21, 100):
        h = Header(proto=6, dport=port)
        inside = sum(p.contains(h) for p in parts)
        assert inside == (0 if 10 <= port <= 20 else 1)


def test_box_minus_flags():
    a = Box.full().with_field("proto", 6, 6)
    b = Box(Box.full().lo, Box.full().hi, 0x12, 0x02)  # SYN without ACK
    parts = box_minus(a, b)
    for flags in range(64):
        h = Header(proto=6, tcp_flags=flags)
        want = (flags & 0x12) != 0x02
        assert sum(p.contains(h) for p in parts) == (1 if want else 0)


def test_boxes_minus_limit():
    a = [Box.full()]
    b = [Box.full().with_field("dport", i * 10, i * 10 + 1) for i in range(50)]
    assert boxes_minus(a, b, limit=10) is None


# --- jumps, RETURN, goto ----------------------------------------------------------------------------------------


def test_jump_conjunction_and_fallthrough():
    p = flat(
        "-A FORWARD -s 10.0.0.0/8 -j SUB",
        "-A FORWARD -p tcp -j ACCEPT",
        "-A SUB -p tcp -m tcp --dport 22 -j DROP",
        chains=["SUB"],
        policy="DROP",
    )
    assert [r.target for r in p.rules] == ["DROP", "ACCEPT"]
    assert p.rules[0].levels[0].options == ("-s", "10.0.0.0/8")
    assert p.rules[0].levels[1].options == ("-p", "tcp", "-m", "tcp", "--dport", "22")
    assert reference_verdict(p, Header(src=ip("10.1.1.1"), proto=6, dport=22)) == "DROP"
    assert reference_verdict(p, Header(src=ip("11.1.1.1"), proto=6, dport=22)) == "ACCEPT"
    assert reference_verdict(p, Header(src=ip("10.1.1.1"), proto=6, dport=23)) == "ACCEPT"
    assert reference_verdict(p, Header(src=ip("10.1.1.1"), proto=17)) == "DROP"
    assert p.original_rules == [("-s", "10.0.0.0/8", "-j", "SUB"), ("-p", "tcp", "-j", "ACCEPT")]
    assert p.user_chains["SUB"].rules == (("-p", "tcp", "-m", "tcp", "--dport", "22", "-j", "DROP"),)


def returning_sub(condition: str):
    """A policy whose FORWARD jumps to SUB, which RETURNs on `condition` and else drops UDP (default ACCEPT)."""
    return flat("-A FORWARD -j SUB", f"-A SUB {condition} -j RETURN", "-A SUB -p udp -j DROP", chains=["SUB"])


def test_simple_return_is_subtracted():
    p = returning_sub("-s 10.0.0.0/8")
    (r,) = p.rules
    assert r.is_simple and not r.approximate
    assert r.levels[1].unless == (("-s", "10.0.0.0/8"),)
    assert reference_verdict(p, Header(src=ip("10.0.0.1"), proto=17)) == "ACCEPT"
    assert reference_verdict(p, Header(src=ip("12.0.0.1"), proto=17)) == "DROP"


def test_complex_return_marks_approximate():
    (r,) = returning_sub("-m conntrack --ctstate INVALID").rules
    assert r.approximate and not r.is_simple
    assert r.levels[1].unless == (("-m", "conntrack", "--ctstate", "INVALID"),)


def test_return_in_base_chain_is_policy():
    p = flat("-A FORWARD -p udp -j RETURN", "-A FORWARD -j ACCEPT", policy="DROP")
    assert [r.target for r in p.rules] == ["DROP", "ACCEPT"]
    assert p.original_rules[0] == ("-p", "udp", "-j", "RETURN")


def test_goto_from_base_ends_in_policy():
    p = flat(
        "-A FORWARD -p tcp -g SUB",
        "-A FORWARD -j ACCEPT",
        "-A SUB -m tcp -p tcp --dport 80 -j ACCEPT",
        chains=["SUB"],
        policy="DROP",
    )
    assert [r.target for r in p.rules] == ["ACCEPT", "DROP", "ACCEPT"]
    assert reference_verdict(p, Header(proto=6, dport=80)) == "ACCEPT"
    assert reference_verdict(p, Header(proto=6, dport=81)) == "DROP"  # goto: no return to FORWARD
    assert reference_verdict(p, Header(proto=17)) == "ACCEPT"
    assert p.original_rules[0] == ("-p", "tcp", "-g", "SUB")


def test_goto_from_user_chain_returns_to_grandparent():
    p = flat(
        "-A FORWARD -j A",
        "-A FORWARD -j DROP",
        "-A A -p tcp -g B",
        "-A A -j ACCEPT",
        "-A B -p tcp -m tcp --dport 80 -j ACCEPT",
        chains=["A", "B"],
    )
    assert reference_verdict(p, Header(proto=6, dport=80)) == "ACCEPT"
    assert reference_verdict(p, Header(proto=6, dport=81)) == "DROP"  # back in FORWARD after the jump to A
    assert reference_verdict(p, Header(proto=17)) == "ACCEPT"


def test_loop_is_an_error():
    with pytest.raises(PolicyError, match="loop") as e:
        flat("-A FORWARD -j A", "-A A -j B", "-A B -j A", chains=["A", "B"], filename="f.rules")
    assert e.value.file == "f.rules" and e.value.token in ("A", "B")


def test_loop_through_goto_is_an_error():
    with pytest.raises(PolicyError, match="loop"):
        flat("-A FORWARD -j A", "-A A -g B", "-A B -p tcp -j A", chains=["A", "B"])


def test_bound_keeps_jump_verbatim():
    lines = ["-A FORWARD -s 10.0.0.0/8 -j BIG", "-A FORWARD -j DROP"]
    lines += [f"-A BIG -p tcp -m tcp --dport {i} -j ACCEPT" for i in range(1, 6)]
    p = flat(*lines, chains=["BIG"], config=Config(flatten_bound=3))
    assert [r.target for r in p.rules] == ["BIG", "DROP"]
    kept = p.rules[0]
    assert not kept.is_simple and kept.levels[0].options == ("-s", "10.0.0.0/8")
    assert kept.boxes[0].interval("src") == (ip("10.0.0.0"), ip("10.255.255.255"))
    assert len(p.user_chains["BIG"].rules) == 5
    p2 = flat(*lines, chains=["BIG"], config=Config(flatten_bound=5))
    assert len(p2.rules) == 6


def test_stateful_jump_not_duplicated():
    p = flat(
        "-A FORWARD -m limit --limit 5/sec -j SUB", "-A SUB -p tcp -j ACCEPT", "-A SUB -p udp -j ACCEPT", chains=["SUB"]
    )
    assert [r.target for r in p.rules] == ["SUB"]


def test_unreachable_chain_not_listed_and_input_ignored():
    p = flat("-A FORWARD -j A", "-A INPUT -j B", "-A A -j ACCEPT", "-A B -j DROP", chains=["A", "B"])
    assert list(p.user_chains) == ["A"]


def test_undefined_chain_error_position():
    with pytest.raises(PolicyError) as e:
        flat("-A FORWARD -p tcp -j NOPE", filename="x.rules")
    assert (e.value.line, e.value.column, e.value.token) == (3, 22, "NOPE")


def test_stateful_goto_in_base_refused():
    with pytest.raises(PolicyError, match="stateful"):
        flat("-A FORWARD -m limit --limit 1/sec -g A", "-A A -j DROP", chains=["A"])


def test_nonterminal_target_stays():
    p = flat("-A FORWARD -j LOG --log-prefix x", "-A FORWARD -j DROP")
    assert p.rules[0].target == "LOG" and p.rules[0].target_args == ("--log-prefix", "x")
    assert reference_verdict(p, Header()) == "DROP"


# --- property: flattened first match == walking the original chains ---------------------------------------------

CHAINS = ["FORWARD", "C1", "C2", "C3"]
NETS = [("10.0.0.0", 8), ("10.1.0.0", 16), ("10.1.2.0", 24), ("192.168.0.0", 16)]
SRCS = [ip(a) for a in ("10.0.0.1", "10.1.0.1", "10.1.2.3", "10.2.0.0", "192.168.1.1", "8.8.8.8")]


@st.composite
def policies(draw):
    chains = {}
    cx_id = 0
    for ci, name in enumerate(CHAINS):
        rules = []
        for _ in range(draw(st.integers(0, 4))):
            spec = {}
            # Unconditional rules are frequent on purpose: they let the chain structure decide the result.
            if draw(st.integers(0, 2)) == 0:
                spec["src"] = (draw(st.sampled_from(NETS)), draw(st.booleans()))
            if draw(st.integers(0, 2)) == 0:
                spec["proto"] = draw(st.sampled_from([6, 17]))
                if draw(st.booleans()):
                    lo = draw(st.integers(0, 8))
                    spec["dport"] = (lo, draw(st.integers(lo, 10)), draw(st.booleans()))
            if draw(st.integers(0, 3)) == 0:
                cx_id += 1
                spec["cx"] = (cx_id, draw(st.booleans()))  # (id, stateful)
            later = CHAINS[ci + 1 :]
            jumps = [f"-j {c}" for c in later] + [f"-g {c}" for c in later]
            choices = ["ACCEPT", "DROP", "RETURN", "LOG", "REJECT"] + jumps * 2
            spec["target"] = draw(st.sampled_from(choices))
            if name == "FORWARD" and spec["target"].startswith("-g") and "cx" in spec:
                spec["cx"] = (spec["cx"][0], False)  # a stateful goto in the base chain is refused (tested apart)
            rules.append(spec)
        chains[name] = rules
    return chains, cx_id


def spec_text(s) -> str:
    out = []
    if "src" in s:
        (net, plen), inv = s["src"]
        out.append(f"{'! ' if inv else ''}-s {net}/{plen}")
    if "proto" in s:
        out.append("-p " + ("tcp" if s["proto"] == 6 else "udp"))
        if "dport" in s:
            lo, hi, inv = s["dport"]
            out.append(f"{'! ' if inv else ''}--dport {lo}:{hi}")
    if "cx" in s:
        n, stateful = s["cx"]
        out.append(f"-m limit --limit {n}/sec" if stateful else f"-m mark --mark {n}")
    t = s["target"]
    out.append(t if t.startswith("-") else f"-j {t}")
    return " ".join(out)


def spec_match(s, h: Header, k) -> bool:
    if "src" in s:
        (net, plen), inv = s["src"]
        lo = ip(net)
        hi = lo | ((1 << (32 - plen)) - 1)
        if (lo <= h.src <= hi) == inv:
            return False
    if "proto" in s:
        if h.proto != s["proto"]:
            return False
        if "dport" in s:
            lo, hi, inv = s["dport"]
            if (lo <= h.dport <= hi) == inv:
                return False
    return not ("cx" in s and not k[s["cx"][0]])


def walk(chains, name, h, k, log):
    """The kernel's chain walk: returns a verdict, or None to return to the caller."""
    for i, s in enumerate(chains[name]):
        if not spec_match(s, h, k):
            continue
        t = s["target"]
        if t == "RETURN":
            return None
        if t.startswith("-"):
            v = walk(chains, t[3:], h, k, log)
            if v is not None:
                return v
            if t.startswith("-g"):
                return None
            continue
        if t == "LOG":
            log.append((name, i))
            continue
        return t
    return None


def group_ok(group, k) -> bool:
    if group[:2] == ("-m", "mark"):
        return k[int(group[3])]
    if group[:2] == ("-m", "limit"):
        return k[int(group[3].split("/")[0])]
    raise AssertionError(group)


def guard_holds(tokens, h, k) -> bool:
    (r,) = parse_rule(" ".join(tokens))
    return any(b.contains(h) for b in r.boxes) and all(group_ok(g, k) for g in r.complex)


def run_flat(policy, chains, h, k, log, line_of):
    for r in policy.rules:
        if not any(b.contains(h) for b in r.boxes) or not all(group_ok(g, k) for g in r.complex):
            continue
        if r.approximate and any(guard_holds(g, h, k) for lv in r.levels for g in lv.unless):
            continue
        if r.target in policy.user_chains:
            v = walk(chains, r.target, h, k, log)
            if v is not None:
                return v
            continue
        if r.target == "LOG":
            log.append(line_of[r.origin.line])
            continue
        return r.target
    return policy.default


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(policies(), st.data(), st.sampled_from([0, 3, 4096]))
def test_flattening_matches_chain_walk(spec, data, bound):
    chains, n_cx = spec
    lines = ["*filter", f":FORWARD {data.draw(st.sampled_from(['ACCEPT', 'DROP']))} [0:0]"]
    lines += [f":{c} - [0:0]" for c in CHAINS[1:]]
    line_of = {}
    for c in CHAINS:
        for i, s in enumerate(chains[c]):
            lines.append(f"-A {c} {spec_text(s)}")
            line_of[len(lines)] = (c, i)
    lines.append("COMMIT")
    policy = parse_policy("\n".join(lines) + "\n", config=Config(flatten_bound=bound), allow_empty=True)
    for _ in range(12):
        h = Header(
            src=data.draw(st.sampled_from(SRCS)),
            proto=data.draw(st.sampled_from([1, 6, 17])),
            dport=data.draw(st.integers(0, 11)),
        )
        if h.proto == 1:
            h = Header(src=h.src, proto=1)
        k = {i: data.draw(st.booleans()) for i in range(1, n_cx + 1)}
        log_orig, log_flat = [], []
        want = walk(chains, "FORWARD", h, k, log_orig) or policy.default
        got = run_flat(policy, chains, h, k, log_flat, line_of)
        assert got == want, (h, k, "\n".join(lines))
        assert log_flat == log_orig, (h, k, "\n".join(lines))  # the same LOG rules, in the same order
