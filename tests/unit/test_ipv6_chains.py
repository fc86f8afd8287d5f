"""The IPv6 plan's interval chains as ip6tables-restore text (netfilter.ip6.render_chains, with_chains; docs/ipv6.md
"### Interval chains in ip6tables"): the IPv4 writer with the plan's k numbered after the IPv4 plan's largest k, the
file's own rules (real IPv6 addresses, never ranks) in the chains, the mark given back before any policy rule, and the
policy's text around them. The kernel's reading of the same text is tests/system/test_xdp_v6_chains.py's."""

from __future__ import annotations

import dataclasses
import re

import pytest
from hypafilter.analysis.plan import build_plan
from hypafilter.config import Config
from hypafilter.errors import HypafilterError, PolicyError
from hypafilter.iptables.document import parse_policy
from hypafilter.netfilter import ip6
from hypafilter.targets.xdp.v6 import plan6_for

V4 = """*filter
:FORWARD DROP [0:0]
-A FORWARD -p udp --dport 1000 -j ACCEPT
-A FORWARD -p udp --dport 3000 -m string --string BAD --algo bm -j DROP
-A FORWARD -p udp --dport 3000 -j ACCEPT
-A FORWARD -p tcp --dport 22 -j ACCEPT
COMMIT
"""

V6 = """*filter
:INPUT ACCEPT [0:0]
:FORWARD DROP [0:0]
:OUTPUT ACCEPT [0:0]
:LOGDROP - [0:0]
-A LOGDROP -j DROP
-A FORWARD -p ipv6-icmp --icmpv6-type neighbour-solicitation -j ACCEPT
-A FORWARD -s fd48:4600::/64 -p tcp --dport 80 -j ACCEPT
-A FORWARD -s 2001:db8:1::/48 -d 2001:db8:2::/48 -p udp -m hl --hl-eq 64 -j LOGDROP
-A FORWARD -s 2001:db8:1::/48 -p udp --dport 53 -j ACCEPT
-A FORWARD -d 2001:db8:3::10 -p tcp --dport 8080 -j REJECT --reject-with icmp6-port-unreachable
-A FORWARD -p udp --dport 5000:5100 -j ACCEPT
-A FORWARD -d 2001:db8:3::/64 -p tcp -j DROP
COMMIT
*raw
:PREROUTING ACCEPT [0:0]
:OUTPUT ACCEPT [0:0]
COMMIT
"""


def _config(**kw) -> Config:
    return Config(xdp_ipv6=True, nic_mode=kw.pop("nic_mode", "bridge"), **kw)


def _side(config: Config, text: str = V6, base: str = "FORWARD"):
    v4 = V4.replace("FORWARD", base)
    plan4 = build_plan(parse_policy(v4, "v4.rules", base_chain=base, config=config), config, live=True)
    ir = parse_policy(text, "v6.rules", base_chain=base, config=config, family=6)
    v6 = dataclasses.replace(ip6.parse(text, "v6.rules", base, validate=False), ir=ir, tables=("filter",))
    plan6, why = plan6_for(v6, config, plan4)
    assert why == "", why
    return plan4, v6, plan6


def _body(text: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for ln in text.splitlines():
        if ln.startswith(":"):
            out.setdefault(ln[1:].split()[0], [])
        elif ln.startswith("-A "):
            out.setdefault(ln.split()[1], []).append(ln.split(" ", 2)[2])
    return out


def _leaf(body: dict[str, list[str]], main: str, mark: int) -> str | None:
    """The chain the text's MAIN and dispatch chains send a frame with `mark` to (first matching mark test)."""
    chain = main
    for _ in range(10):
        for rule in body[chain]:
            m = re.fullmatch(r"-m mark --mark (0x[0-9a-f]+)(?:/(0x[0-9a-f]+))? -[jg] (\S+)", rule)
            if m and mark & int(m.group(2) or "0xffffffff", 16) == int(m.group(1), 16):
                chain = m.group(3)
                break
            if not m:
                return rule.split()[-1]
        else:
            return None
        if not chain.startswith(main[:-4] + "D"):
            return chain
    return None


def test_k_after_the_ipv4_plan_and_the_rules_as_written():
    config = _config()
    plan4, v6, plan6 = _side(config)
    kb = plan4.num_intervals
    assert plan6.k_base == kb > 0
    ch = ip6.render_chains(plan6, config, "HFv6_")
    assert (ch.main, ch.strategy, ch.k_base) == ("HFv6_MAIN", "interval", kb)
    body = _body(ch.text)
    shunted = [j for j in range(plan6.n + 1) if plan6.may_shunt[j]]
    assert shunted and any(int(plan6.interval[j]) for j in shunted)
    for j in shunted:
        k, a = int(plan6.interval[j]), int(plan6.actions[j])
        leaf = _leaf(body, ch.main, ((k + kb) << 4) | a)
        # the leaf named by the k the mark carries; its first rule gives the mark back before any policy rule
        assert leaf == f"HFv6_L{k + kb}A{a}", (j, k, a, leaf)
        assert body[leaf][0] == "-j MARK --set-xmark 0x0/0xffffffff"
        assert body[leaf][-1] == "-j " + {1: "ACCEPT", 2: "DROP"}.get(a, "DROP")
    # k = 0: the whole policy (MAIN goes to K0, which gives the mark back and returns to the live chain)
    assert _leaf(body, ch.main, 0) == "HFv6_K0" and body["HFv6_K0"] == ["-j MARK --set-xmark 0x0/0xffffffff"]
    # the complex rules as the file wrote them: 128-bit addresses, REJECT's argument; the jump into the user chain
    # flattened (its DROP in a helper chain)
    segs = "\n".join(r for name, rules in body.items() if re.fullmatch(r"HFv6_(C|B)\S*", name) for r in rules)
    assert "-s 2001:db8:1::/48 -d 2001:db8:2::/48 -p udp -m hl --hl-eq 64 -j HFv6_R2L2" in segs
    assert body["HFv6_R2L2"] == ["-j DROP"]
    assert "-d 2001:db8:3::10/128 -p tcp" in segs and "--reject-with icmp6-port-unreachable" in segs
    assert not re.search(r"\b\d+\.\d+\.\d+\.\d+\b", ch.text), "an IPv4-looking address (a rank?) in the chains"


def test_the_policy_text_around_the_chains():
    config = _config()
    _, v6, plan6 = _side(config)
    ch = ip6.render_chains(plan6, config, "HFv6_")
    text = ip6.with_chains(v6, ch)
    lines = text.splitlines()
    ours = [ln for ln in ch.text.splitlines() if ln.startswith(":")]
    # declared first (rules after them may jump to any of them), the file's lines all kept in order
    assert lines[: 1 + len(ours)] == ["*filter", *ours]
    assert [ln for ln in lines if ln not in ours and not ln.startswith(("-A HFv6_", "-I "))] == V6.splitlines()
    # the chains' rules and the jump first in the base chain, before the filter table's COMMIT; the raw table as it was
    end = lines.index("COMMIT")
    assert lines[end - 1] == "-I FORWARD 1 -j HFv6_MAIN"
    assert all(ln in lines[:end] for ln in ch.text.splitlines() if ln.startswith("-A "))
    assert lines[end + 1 :] == ["*raw", ":PREROUTING ACCEPT [0:0]", ":OUTPUT ACCEPT [0:0]", "COMMIT"]
    # a chain of the policy with one of the tool's names is refused at its line, not flushed
    clash = V6.replace(":LOGDROP - [0:0]", ":HFv6_MAIN - [0:0]")
    with pytest.raises(PolicyError) as e:
        ip6.with_chains(dataclasses.replace(v6, text=clash), ch)
    assert e.value.line == 5 and "HFv6_MAIN" in str(e.value)


def test_host_mode_tree_strategy_and_the_mark_bits():
    config = _config(nic_mode="host", strategy="tree", mark_mask=0xFFF00, mark_shift=8)
    host = V6.replace(":INPUT ACCEPT [0:0]\n:FORWARD DROP", ":INPUT DROP [0:0]\n:FORWARD ACCEPT")
    plan4, v6, plan6 = _side(config, host.replace("-A FORWARD", "-A INPUT"), "INPUT")
    ch = ip6.render_chains(plan6, config, "HFv6_")
    # strategy tree is written as tree (its chains here are too short for a tree: test_the_tree_strategy_... below)
    assert ch.strategy == "tree" and not any(n.startswith("HFv6_T") for n in _body(ch.text))
    body = _body(ch.text)
    # host mode: the program's ACCEPT comes with the "decided" value, accepted with the mark given back
    assert body["HFv6_MAIN"][0] == "-m mark --mark 0x100/0xfff00 -j HFv6_DA"
    assert body["HFv6_DA"] == ["-j MARK --set-xmark 0x0/0xfff00", "-j ACCEPT"]
    kb = plan4.num_intervals
    for j in [j for j in range(plan6.n + 1) if plan6.may_shunt[j]]:
        k, a = int(plan6.interval[j]), int(plan6.actions[j])
        assert _leaf(body, ch.main, (((k + kb) << 4) | a) << 8) == f"HFv6_L{k + kb}A{a}"
        assert body[f"HFv6_L{k + kb}A{a}"][0] == "-j MARK --set-xmark 0x0/0xfff00"


def test_marks_that_do_not_fit_leave_ip6tables_verbatim():
    from hypafilter.ops import deploy

    config = _config(mark_mask=0x3F)  # k up to 3: the IPv6 side's k, after the IPv4 plan's, do not fit
    plan4, v6, plan6 = _side(config)
    with pytest.raises(HypafilterError, match="does not fit mark_mask"):
        ip6.render_chains(plan6, config, "HFv6_")
    said = []
    chains, text = deploy._chains6(plan6, v6, config, said.append)
    assert chains is None and text == v6.text and plan6.verbatim  # k = 0 for every IPv6 frame: exact
    assert "IPv6 interval chains not written" in said[0] and "k = 0" in said[0]


def test_status_names_the_chains():
    from hypafilter.cli.deploy import _fmt_ipv6

    six = {"mode": "policy", "source": "v6.rules", "rules": {"filter/FORWARD": 9}, "xdp": {"entries": 10}}
    six |= {"live_rules": 40, "live_base_rules": 10, "live_base_policy": "DROP"}
    assert "interval chains" not in _fmt_ipv6(six)  # verbatim: every passed IPv6 frame with k = 0
    six["chains"] = {"main": "HFv6_MAIN", "strategy": "interval", "k_base": 3}
    line = _fmt_ipv6(six)
    assert "decided in the XDP program by its 10 entries" in line
    assert "shunted frames with their k (> 3) through the interval chains in ip6tables (HFv6_MAIN" in line


def _v6_cx(n: int) -> str:
    """n complex rules (hop limit on /64s and /96s of three /32s, LOG on 128-bit ranges no prefix states) above
    simple ones: every shunted frame's interval chain is the n rules."""
    cx = []
    for i in range(n):
        if i % 4 == 3:
            cx.append(f"-A FORWARD -m iprange --dst-range 2001:db8:ff::{i:x}-2001:db8:ff::{i + 9:x} -p udp -j LOG")
        else:
            net = f"2001:db{8 + i % 3}:0:{i:x}::/64" if i % 3 else f"2001:db{8 + i % 3}::{i:x}:0:0/96"
            act = ("ACCEPT", "DROP")[i % 2]
            cx.append(f"-A FORWARD -s {net} -p {('tcp', 'udp')[i % 2]} -m hl --hl-eq {60 + i % 5} -j {act}")
    return V6.replace("-A FORWARD -s fd48:4600::/64", "\n".join(cx) + "\n-A FORWARD -s fd48:4600::/64")


def random_headers6(amap, rng, n: int) -> list:
    """`n` headers of a ranked IPv6 plan (`amap`: its AddrMap): random source and destination ranks, TCP, UDP or
    ICMPv6, a few ports the test policies name."""
    from hypafilter.ir import Header

    return [
        Header(
            src=rng.randrange(len(amap.starts["src"])),
            dst=rng.randrange(len(amap.starts["dst"])),
            proto=rng.choice((6, 17, 58)),
            dport=rng.choice((53, 80, 443, 5050, 8080, 1)),
        )
        for _ in range(n)
    ]


def test_the_tree_strategy_writes_the_ipv6_interval_chains_as_trees_over_128_bit_addresses():
    """Strategy tree on the IPv6 side (issue #26): the long interval chain of an IPv6 plan is a tree cut on the ranks
    of its own 128-bit addresses and written back as IPv6 prefixes and ranges (never a rank, never an IPv4 address);
    through the chain interpreter, on the plan's ranked headers, every frame gets the reference verdict and passes
    the same observing rules, and a leaf with a rule taken out is caught."""
    import random

    from hypafilter.analysis.program import build_program

    from tests.unit.test_properties import _callback, mismatches

    config = _config(strategy="tree", tree_min_segment=4)
    _, _, plan6 = _side(config, _v6_cx(32))
    ch = ip6.render_chains(plan6, config, "HFv6_")
    body = _body(ch.text)
    trees = {n: rules for n, rules in body.items() if re.fullmatch(r"HFv6_T\d+", n)}
    assert ch.strategy == "tree" and len(trees) >= 4
    tests = [r for rules in trees.values() for r in rules if " -g HFv6_T" in r]
    assert any(re.match(r"-[sd] 2001:db[89a]:\S*/\d+ -g", t) for t in tests), tests
    assert not re.search(r"\b\d+\.\d+\.\d+\.\d+\b", ch.text), "an IPv4-looking address (a rank?) in the chains"
    assert "-s 2001:db9:0:1::/64 -p udp -m hl --hl-eq 61 -j DROP" in "\n".join(r for v in trees.values() for r in v)

    hdrs = random_headers6(plan6.policy.addr_map, random.Random(7), 1500)
    ev = _callback(3)
    prog = build_program(plan6, "tree", k_base=plan6.k_base)
    plan6.__dict__["_programs"] = {("tree", 0xFFFFFFFF, 0, "bridge"): prog}  # hybrid_verdict runs this very program
    assert mismatches(plan6, "tree", hdrs, ev) == []
    found = False
    for name in [n for n in prog.chains if re.fullmatch(re.escape(prog.prefix) + r"T\d+", n)]:
        rules = prog.chains[name]
        pos = next((j for j, r in enumerate(rules) if r.kind == "policy"), None)
        if pos is None:
            continue
        taken = rules.pop(pos)
        found = bool(mismatches(plan6, "tree", hdrs, ev))
        rules.insert(pos, taken)
        if found:
            break
    assert found, "taking a rule out of a tree leaf changes some frame's walk"


def test_the_ipv6_side_gets_a_live_k0_tree_where_the_xdp_program_marks_its_unparsed_frames():
    """Strategy tree, live, on xdp (plan6.k0_tree, from the IPv4 plan's): HFv6_MAIN first sends the mark value
    HF_MARK_K0_TREE to HFv6_K0T, which gives the mark back, walks the whole IPv6 policy as trees and ends with the
    chain policy; through the chain interpreter every ranked header with that mark gets the reference verdict. The
    xdp target sets CONTROL bit 7 only then (not for a verbatim IPv6 side, nor for strategy interval)."""
    import random
    from types import SimpleNamespace

    from hypafilter.analysis.program import K0_TREE, build_program, mark_for
    from hypafilter.ir import Header
    from hypafilter.ir.semantics import reference_verdict
    from hypafilter.targets.xdp.target import CONTROL_K0_TREE6, XdpTarget

    from tests.unit.test_properties import _callback

    config = _config(strategy="tree", tree_min_segment=4)
    plan4, v6, _ = _side(config, _v6_cx(32))
    plan4.k0_tree = True
    plan6, why = plan6_for(v6, config, plan4)
    assert why == "" and plan6.k0_tree
    body = _body(ip6.render_chains(plan6, config, "HFv6_").text)
    assert body["HFv6_MAIN"][0] == "-m mark --mark 0x3/0xffffffff -g HFv6_K0T"
    k0t = body["HFv6_K0T"]
    assert k0t[0] == "-j MARK --set-xmark 0x0/0xffffffff" and k0t[-1] == "-j DROP"
    assert any(re.fullmatch(r"-j HFv6_T\d+", r) for r in k0t)
    prog = build_program(plan6, "tree", prefix="HFv6_", k_base=plan6.k_base)
    pol, rng, ev = plan6.policy, random.Random(5), _callback(5)
    amap = pol.addr_map
    for _ in range(800):
        h = Header(
            src=rng.randrange(len(amap.starts["src"])),
            dst=rng.randrange(len(amap.starts["dst"])),
            proto=rng.choice((6, 17, 58, 0)),
            dport=rng.choice((53, 80, 443, 5050, 8080, 1)),
        )
        assert prog.run(h, mark_for(prog, 0, K0_TREE), ev)[0] == reference_verdict(pol, h, ev), h

    tgt = SimpleNamespace(config=config)
    assert XdpTarget.control(tgt, plan4, plan6) & CONTROL_K0_TREE6
    plan6.verbatim = True
    assert not XdpTarget.control(tgt, plan4, plan6) & CONTROL_K0_TREE6
    plan6.verbatim = False
    tgt.config = _config(strategy="interval")
    assert not XdpTarget.control(tgt, plan4, plan6) & CONTROL_K0_TREE6
