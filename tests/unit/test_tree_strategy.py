"""Strategy tree (analysis.trees): the k = 0 path and long chains of complex rules as decision trees in the Program.

The model side of the kernel-differential tests: Program.run interprets exactly the chains the emitters write, and
on random policies (trees forced small) every frame gets the flattened policy's first-match verdict and passes the
same observing rules, on the k = 0 path (any mark with k = 0) and through the hardware model (hybrid_verdict).
The kernel checks the loaded form: tests/system/test_tree_strategy.py, verify and the fuzzer.
"""

from __future__ import annotations

import re

from hypafilter.analysis.plan import build_plan
from hypafilter.analysis.program import K0_TREE, NFT_MAX_DEPTH, build_program, mark_for
from hypafilter.config import Config
from hypafilter.ir import Header
from hypafilter.ir.semantics import reference_verdict
from hypafilter.netfilter.nft import to_nft
from hypafilter.netfilter.restore import chain_depth, render_iptables
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.irbuild import make_policy, make_rule
from tests.unit.test_properties import OBSERVING, _callback, headers, mismatches, reference_observed, rules


def _k0_mismatches(prog, pol, hdrs, ev, foreign=0):
    bad = []
    for h in hdrs:
        want = reference_verdict(pol, h, ev)
        trace: list[int] = []
        got, _ = prog.run(h, mark_for(prog, 0, 0, foreign), ev, trace)
        seen = [i for i in trace if pol.rules[i].target in OBSERVING and any(b.contains(h) for b in pol.rules[i].boxes)]
        if (got, seen) != (want, reference_observed(pol, h, ev)):
            bad.append((h, want, got))
    return bad


def _tree_chains(prog) -> list[str]:
    return [n for n in prog.chains if n.startswith(prog.name("T"))]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(rules(), min_size=4, max_size=24),
    st.sampled_from(["ACCEPT", "DROP"]),
    st.lists(headers(), min_size=4, max_size=16),
    st.integers(0, (1 << 61) - 1),
    st.sampled_from(["bridge", "host"]),
)
def test_tree_program_equals_reference(rs, default, hdrs, seed, nic_mode):
    pol = make_policy(rs, default)
    ev = _callback(seed)
    config = Config(nic_mode=nic_mode, tree_min_segment=2)  # trees on runs of 2 rules, leaves of 1
    for mode in ("index", "selective", "exact"):
        plan = build_plan(pol, config, mode=mode, strategy="tree")
        prog = build_program(plan, "tree", nic_mode=nic_mode)
        assert prog.tree_stats["trees"] >= 1, "K0 walks the policy as a tree"
        assert not prog.verbatim_full
        assert _k0_mismatches(prog, pol, hdrs, ev, foreign=seed & 0xFFFFFFFF) == [], (mode, nic_mode)
        assert mismatches(plan, "tree", hdrs, ev, nic_mode=nic_mode) == [], (mode, nic_mode)
        depth, path = chain_depth(prog)
        assert depth + 1 <= NFT_MAX_DEPTH, path


def _policy(n: int, complex_every: int = 0):
    rs = []
    for i in range(n):
        kw = {"src": f"10.{i % 7}.{i % 5}.0/24", "proto": ("tcp", "udp")[i % 2], "dport": (i, i + 3)}
        if complex_every and i % complex_every == 0:
            kw["complex"] = [("-m", "mark", "--mark", f"{i:#x}/0xff")]
        rs.append(make_rule(("ACCEPT", "DROP", "LOG")[i % 3], **kw))
    return make_policy(rs, "DROP")


def _headers():
    from hypafilter.ir import Header

    return [
        Header(src=(10 << 24) | (a << 16) | (b << 8) | 9, dst=1, proto=p, dport=d)
        for a in range(8)
        for b in range(6)
        for p in (6, 17, 1)
        for d in (0, 3, 40, 120)
    ]


def test_k0_and_long_complex_chains_walk_trees_and_render():
    pol = _policy(200, complex_every=1)  # every rule complex: the interval chains are long lists of complex rules
    plan = build_plan(pol, Config(), mode="selective", strategy="tree")
    prog = build_program(plan, "tree")
    k0 = prog.chains[prog.name("K0")]
    assert any(r.kind == "always" and r.target.startswith(prog.name("T")) for r in k0)
    assert not any(r.kind == "policy" for r in k0), "every rule movable: K0 holds only the tree's jump"
    # a chain of complex rules of the interval structure got a tree too
    jumps = {r.target for n, ch in prog.chains.items() if not n.startswith(prog.name("T")) for r in ch}
    assert len({t for t in jumps if t.startswith(prog.name("T"))}) >= 2
    hdrs = _headers()
    ev = _callback(12345)
    assert _k0_mismatches(prog, pol, hdrs, ev) == []
    assert mismatches(plan, "tree", hdrs, ev) == []
    text = render_iptables(prog)
    assert "-g " + prog.name("T") in text and "-m u32 ! --u32" in text  # gotos between nodes, the port guard
    assert chain_depth(text)[0] + 1 <= NFT_MAX_DEPTH
    nft = to_nft(plan, "tree", "HF1_", table="t")
    assert "ip saddr 10." in nft and "ip frag-off & 0x1fff != 0" in nft


def test_a_broken_tree_is_caught():
    """The comparison can fail: drop one rule from one tree leaf and some k = 0 frame gets another verdict."""
    pol = _policy(120)
    plan = build_plan(pol, Config(), mode="selective", strategy="tree")
    prog = build_program(plan, "tree")
    ev = _callback(1)
    hdrs = _headers()[::3]
    assert _k0_mismatches(prog, pol, hdrs, ev) == []
    found = 0
    for name in _tree_chains(prog):
        ch = prog.chains[name]
        pos = next((j for j, r in enumerate(ch) if r.kind == "policy" and pol.rules[r.index].target != "LOG"), None)
        if pos is None:
            continue
        saved = list(ch)
        del ch[pos]
        found += bool(_k0_mismatches(prog, pol, hdrs, ev))
        prog.chains[name] = saved
        if found:
            break
    assert found


def test_per_rule_state_and_resolved_interfaces_stay_linear():
    pol = _policy(60)
    st_rule = make_rule("ACCEPT", proto="tcp", complex=[("-m", "limit", "--limit", "1/s")])
    from dataclasses import replace

    pol.rules.insert(30, replace(st_rule, stateful_pos=30))
    prog = build_program(build_plan(pol, Config(), mode="selective", strategy="tree"), "tree")
    k0 = prog.chains[prog.name("K0")]
    kinds = [(r.kind, r.index if r.kind == "policy" else r.target[len(prog.prefix) :]) for r in k0[1:-1]]
    assert ("policy", 30) in kinds and sum(k == "always" for k, _ in kinds) == 2, kinds
    pol.resolved = [(None, ("-i", "eth0"), "true for every NIC frame")]
    prog = build_program(build_plan(pol, Config(), mode="selective", strategy="tree"), "tree")
    assert prog.verbatim_full and prog.chains[prog.name("K0")][1].target == prog.verbatim_full


# ---------------------------------------------------------------- the live K0 tree, lazily rebuilt


def _live_prog(pol, nic_mode="bridge", fresh=True, min_segment=2):
    plan = build_plan(pol, Config(nic_mode=nic_mode, tree_min_segment=min_segment), live=True, strategy="tree")
    plan.trees_fresh, plan.k0_tree = fresh, True
    return build_program(plan, "tree", nic_mode=nic_mode)


def _k0t_mismatches(prog, pol, hdrs, ev, foreign=0):
    """Frames marked HF_MARK_K0_TREE (the K0 tree, or the live rules for a diverted one) against the reference."""
    bad = []
    for h in hdrs:
        want = reference_verdict(pol, h, ev)
        trace: list[int] = []
        got, _ = prog.run(h, mark_for(prog, 0, K0_TREE, foreign), ev, trace)
        seen = [i for i in trace if pol.rules[i].target in OBSERVING and any(b.contains(h) for b in pol.rules[i].boxes)]
        if (got, seen) != (want, reference_observed(pol, h, ev)):
            bad.append((h, want, got))
    return bad


def _stateless(rs):
    return [r for r in rs if r.stateful_pos is None]


def _changed(rs, ins, dels) -> list:
    """`rs` with the rules at `dels` (modulo the length) deleted, then `ins` inserted at positions drawn from `dels`."""
    changed = list(rs)
    for j in dels:
        if changed:
            changed.pop(j % len(changed))
    for j, r in zip(dels + [0] * len(ins), ins, strict=False):
        changed.insert(j % (len(changed) + 1), r)
    return changed


def _live_changes(min_rules: int):
    """The live-tree property tests' draws: a policy of `min_rules`..20 rules, up to 4 inserted and 4 deleted, the
    default policy, frames, a seed and the NIC mode."""
    return lambda f: settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])(
        given(
            st.lists(rules(), min_size=min_rules, max_size=20),
            st.lists(rules(), min_size=0, max_size=4),
            st.lists(st.integers(0, 40), min_size=0, max_size=4),
            st.sampled_from(["ACCEPT", "DROP"]),
            st.lists(headers(), min_size=4, max_size=16),
            st.integers(0, (1 << 61) - 1),
            st.sampled_from(["bridge", "host"]),
        )(f)
    )


@_live_changes(4)
def test_live_k0_tree_equals_the_live_policy_after_inserts_and_deletes(rs, ins, dels, default, hdrs, seed, nic_mode):
    """A live deployment's K0 tree, built for one policy, then reused for a changed one (rules inserted and deleted):
    frames with the K0-tree mark get the changed policy's verdict and pass its observing rules, before and after the
    rebuild."""
    rs, ins = _stateless(rs), _stateless(ins)
    base = make_policy(rs, default)
    ev = _callback(seed)
    prog = _live_prog(base, nic_mode)
    if prog.name("K0T") not in prog.chains:
        return  # no run of movable rules long enough (or K0 stays live: tree_stats says why)
    assert _k0t_mismatches(prog, base, hdrs, ev, seed & 0xFFFFFFFF) == []
    live = make_policy(_changed(rs, ins, dels), default)
    lazy = _live_prog(live, nic_mode, fresh=False)
    assert _k0t_mismatches(lazy, live, hdrs, ev, seed & 0xFFFFFFFF) == [], lazy.tree_stats
    rebuilt = _live_prog(live, nic_mode, fresh=True)
    assert _k0t_mismatches(rebuilt, live, hdrs, ev, seed & 0xFFFFFFFF) == []


_LIVE_TEXT = "*filter\n:FORWARD DROP [0:0]\n" + "".join(
    f"-A FORWARD -s 10.{i}.0.0/16 -p {('tcp', 'udp')[i % 2]} -m {('tcp', 'udp')[i % 2]} --dport {i + 1} -j "
    f"{('ACCEPT', 'DROP')[i % 3 == 0]}\n"
    for i in range(12)
)


def _live_text_prog(text, prefix, fresh=True, nic_mode="bridge", k0_tree=True):
    from hypafilter.iptables.document import parse_policy

    cfg = Config(strategy="tree", tree_min_segment=2, nic_mode=nic_mode)
    pol = parse_policy(text + "COMMIT\n", filename="live.rules", base_chain="FORWARD", config=cfg)
    plan = build_plan(pol, cfg, live=True)
    plan.trees_fresh, plan.k0_tree = fresh, k0_tree
    return plan, build_program(plan, "tree", prefix=prefix, nic_mode=nic_mode)


def _chain(text: str, name: str) -> list[str]:
    return [ln for ln in text.splitlines() if ln.startswith(f"-A {name} ")]


def test_live_k0_tree_chain_text_before_and_after_a_change():
    """MAIN sends the K0-tree mark value (k = 0, action 3, whole mask) to K0T before its k = 0 test (which still
    takes that value when no K0T exists); K0T gives back the mark bits, walks the tree, ends with the chain policy.
    After a rule is inserted, the follow's K0T keeps the tree and first sends frames in the new rule's -s/-p to a
    chain of the live rules that can act there, in iptables and in nft."""
    from hypafilter.analysis.program import k0_tree_wanted

    plan, prog = _live_text_prog(_LIVE_TEXT, "HF1_")
    assert k0_tree_wanted(plan, "tree") and prog.tree_stats["k0_tree"] == "built", prog.tree_stats
    text = render_iptables(prog)
    assert _chain(text, "HF1_MAIN")[:2] == [
        "-A HF1_MAIN -m mark --mark 0x3/0xffffffff -g HF1_K0T",
        "-A HF1_MAIN -m mark --mark 0x0/0xfffffff0 -g HF1_K0",
    ]
    k0t = _chain(text, "HF1_K0T")
    assert k0t[0] == "-A HF1_K0T -j MARK --set-xmark 0x0/0xffffffff" and k0t[-1] == "-A HF1_K0T -j DROP", k0t
    assert not any("K0D" in ln for ln in k0t) and any(ln.startswith("-A HF1_K0T -j HF1_T") for ln in k0t), k0t

    changed = _LIVE_TEXT.replace(
        "-A FORWARD -s 10.5.", "-A FORWARD -s 10.99.0.0/16 -p udp -j DROP\n-A FORWARD -s 10.5."
    )
    lazy_plan, lazy = _live_text_prog(changed, "HF2_", fresh=False)
    assert lazy.tree_stats["k0_tree"] == "lazy" and lazy.tree_stats["k0_changed"] == 1, lazy.tree_stats
    k0t = _chain(render_iptables(lazy), "HF2_K0T")
    assert k0t[1] == "-A HF2_K0T -p 17 -m iprange --src-range 10.99.0.0-10.99.255.255 -g HF2_K0D0", k0t
    assert any(ln.startswith("-A HF2_K0T -j HF2_T") for ln in k0t) and k0t[-1] == "-A HF2_K0T -j DROP"
    # the affected part: the live policy's rules that can act on UDP from 10.99.0.0/16 (the new one), then the policy
    assert _chain(render_iptables(lazy), "HF2_K0D0") == [
        "-A HF2_K0D0 -s 10.99.0.0/16 -p udp -j DROP",
        "-A HF2_K0D0 -j DROP",
    ]
    assert "meta l4proto 17 ip saddr 10.99.0.0-10.99.255.255 goto HF2_K0D0" in to_nft(lazy_plan, "tree", "HF2_")

    # a rebuild: the same policy, fresh: no diversion left
    _, rebuilt = _live_text_prog(changed, "HF3_")
    assert rebuilt.tree_stats["k0_tree"] == "built"
    assert not any("K0D" in ln for ln in render_iptables(rebuilt).splitlines())


def test_live_k0_tree_rebuilds_past_delta_and_stays_live_where_it_cannot_be_exact():
    from hypafilter.analysis.program import k0_tree_wanted
    from hypafilter.analysis.trees import LAZY_DELTA

    _live_text_prog(_LIVE_TEXT, "HF1_")
    more = "".join(f"-A FORWARD -s 10.{200 + i}.0.0/16 -j DROP\n" for i in range(LAZY_DELTA + 1))
    _, prog = _live_text_prog(
        _LIVE_TEXT.replace(":FORWARD DROP [0:0]\n", ":FORWARD DROP [0:0]\n" + more), "HF2_", False
    )
    assert prog.tree_stats["k0_tree"] == "built" and prog.tree_stats["k0_changed"] == 0  # past δ: built anew

    # host mode: the decided-ACCEPT value first, then the K0 tree's
    _, host = _live_text_prog(_LIVE_TEXT, "HF4_", nic_mode="host")
    assert [ln.split()[-1] for ln in _chain(render_iptables(host), "HF4_MAIN")[:2]] == ["HF4_DA", "HF4_K0T"]

    # per-rule state only the live chain may run: K0 stays the live list, and the fast path does not mark for it
    limited = _LIVE_TEXT + "-A FORWARD -p udp -m limit --limit 5/sec -j ACCEPT\n"
    plan, prog = _live_text_prog(limited, "HF5_")
    assert "per-rule state" in prog.tree_stats["k0_tree"] and prog.name("K0T") not in prog.chains
    assert not k0_tree_wanted(plan, "tree")
    # a fast path that cannot mark (the emulated NIC): no K0T
    plan, prog = _live_text_prog(_LIVE_TEXT, "HF6_", k0_tree=False)
    assert prog.name("K0T") not in prog.chains and not k0_tree_wanted(plan, "tree")


# ---------------------------------------------------------------- the interval chains' trees, lazily rebuilt


def _live_plan(pol, fresh, min_segment=2, k0_tree=False, nic_mode="bridge"):
    plan = build_plan(pol, Config(nic_mode=nic_mode, tree_min_segment=min_segment), live=True, strategy="tree")
    plan.trees_fresh, plan.k0_tree = fresh, k0_tree
    return plan


@_live_changes(6)
def test_live_interval_trees_equal_the_live_policy_after_inserts_and_deletes(
    rs, ins, dels, default, hdrs, seed, nic_mode
):
    """A live deployment's interval chains written as trees for one policy, then followed to a changed one (rules
    inserted and deleted): each chain's tree is its base's with the changes diverted ahead of it, and the hybrid
    (hardware model, mark, the chains as written) gives the changed policy's verdicts and observed rules, with the
    K0 tree too."""
    rs, ins = _stateless(rs), _stateless(ins)
    ev = _callback(seed)
    base = make_policy(rs, default)
    plan = _live_plan(base, True, nic_mode=nic_mode, k0_tree=True)
    assert mismatches(plan, "tree", hdrs, ev, nic_mode=nic_mode) == []
    live = make_policy(_changed(rs, ins, dels), default)
    lazy = _live_plan(live, False, nic_mode=nic_mode, k0_tree=True)
    prog = build_program(lazy, "tree", nic_mode=nic_mode)
    assert mismatches(lazy, "tree", hdrs, ev, nic_mode=nic_mode) == [], prog.tree_stats
    assert _k0t_mismatches(prog, live, hdrs, ev) == [], prog.tree_stats


def _cx_text(n: int, extra: str = "") -> str:
    """n complex rules (string matches) on distinct /16 sources ahead of two simple ones: every shunted frame's
    interval chain is the n rules, long enough for a tree with runs of 4."""
    cx = "".join(
        f"-A FORWARD -s 10.{i}.0.0/16 -p {('tcp', 'udp')[i % 2]} -m string --string BAD{i} --algo bm "
        f"-j {('ACCEPT', 'DROP')[i % 3 == 0]}\n"
        for i in range(n)
    )
    return f"*filter\n:FORWARD DROP [0:0]\n{extra}{cx}-A FORWARD -p tcp -j ACCEPT\n-A FORWARD -p udp -j DROP\nCOMMIT\n"


def _cx_prog(text: str, prefix: str, fresh: bool, recorded=None):
    from hypafilter.iptables.document import parse_policy

    cfg = Config(strategy="tree", tree_min_segment=4)
    plan = build_plan(parse_policy(text, filename="cx.rules", base_chain="FORWARD", config=cfg), cfg, live=True)
    plan.trees_fresh, plan.k0_tree, plan.tree_bases = fresh, False, recorded
    return plan, build_program(plan, "tree", prefix=prefix)


def _tree_lines(text: str, prefix: str) -> list[str]:
    """The tree chains' rules (T<n>), their generation's prefix taken out."""
    return sorted(ln.replace(prefix, "P_") for ln in text.splitlines() if re.match(rf"-A {prefix}T\d+ ", ln))


def test_a_live_interval_chain_tree_is_kept_for_a_small_change_and_rebuilt_past_delta():
    """A follow of one inserted complex rule writes the interval chain's tree of the last rebuild, rule for rule (the
    new rule in no tree chain), and a diversion ahead of it in every leaf: the new rule's -s/-p to a chain TD<n> of
    the live chain's rules that can act there (one for all the leaves of the chain), then the same test with the
    leaf's verdict. A rebuild (a deploy) and more than LAZY_DELTA changes build the tree of the live chain."""
    from hypafilter.analysis.trees import LAZY_DELTA

    base_text = _cx_text(40)
    plan, prog = _cx_prog(base_text, "HF1_", True)
    text1 = render_iptables(prog)
    trees1 = _tree_lines(text1, "HF1_")
    assert prog.tree_stats["trees"] >= 1 and trees1 and plan.tree_bases_built["chains"], prog.tree_stats
    assert "TD" not in text1

    ban = "-A FORWARD -s 10.99.0.0/16 -p udp -m string --string EVIL --algo bm -j DROP\n"
    changed = base_text.replace("-A FORWARD -s 10.7.", ban + "-A FORWARD -s 10.7.")
    plan2, lazy = _cx_prog(changed, "HF2_", False)
    text2 = render_iptables(lazy)
    assert lazy.tree_stats["lazy_trees"] >= 1 and lazy.tree_stats["lazy_changed"] == 1, lazy.tree_stats
    assert _tree_lines(text2, "HF2_") == trees1  # the tree as deployed: not rebuilt
    leaves = {ln.split()[1] for ln in text2.splitlines() if re.match(r"-A HF2_L\d+A\d+ ", ln)}
    box = "-p 17 -m iprange --src-range 10.99.0.0-10.99.255.255"
    for leaf in leaves:
        chain = _chain(text2, leaf)
        verdict = chain[-1].split()[-1]
        assert chain[1:3] == [f"-A {leaf} {box} -j HF2_TD0", f"-A {leaf} {box} -j {verdict}"], chain
    td = [ln for ln in text2.splitlines() if re.match(r"-A HF2_TD\d+ ", ln)]
    assert any("EVIL" in ln for ln in td) and not any("10.98." in ln for ln in td), td  # only rules acting there
    assert not any(ln.endswith(("-j ACCEPT", "-j DROP")) and "string" not in ln for ln in td), td  # back to the leaf
    assert getattr(plan2, "tree_bases_built", None) is None  # the bases stay the deployment's
    # another process (the policy sync worker after a deploy) with the bases as the deployment recorded them
    import json

    from hypafilter.analysis import trees

    recorded = trees.bases_of_json(json.loads(json.dumps(plan.tree_bases_built)))
    trees._POOLS.clear()
    _, again = _cx_prog(changed, "HF2_", False, recorded)
    assert render_iptables(again) == text2
    hdrs = [h for h in _headers() if (h.src >> 16) in range(0x0A00, 0x0A64)] + _headers()[::7]
    hdrs += [Header(src=0x0A630001, dst=1, proto=17, sport=1, dport=2)]
    ev = _callback(9)
    assert mismatches(plan2, "tree", hdrs, ev) == []

    _, rebuilt = _cx_prog(changed, "HF3_", True)
    text3 = render_iptables(rebuilt)
    assert "TD" not in text3 and any("EVIL" in ln for ln in _tree_lines(text3, "HF3_"))

    _cx_prog(base_text, "HF4_", True)
    many = "".join(f"-A FORWARD -s 10.{200 + i}.0.0/16 -m string --string X --algo bm -j DROP\n" for i in range(9))
    assert LAZY_DELTA < 9
    _, past = _cx_prog(_cx_text(40, many), "HF5_", False)
    assert past.tree_stats["lazy_trees"] == 0 and "TD" not in render_iptables(past), past.tree_stats


def test_analyze_costs_strategy_tree_by_the_walk_of_its_trees():
    """`analyze` with strategy tree: the software rules a shunted frame walks are the tree's path — the mark tests
    to its leaf, then what `bench optimize` reports as a tree's path (analysis.dtree.path: each dispatch test, the
    guard, the rules of the one tree leaf the header reaches) — not the whole list; every frame here is shunted to a
    leaf whose chain is the 40 complex rules, one tree."""
    import numpy as np
    from hypafilter.analysis.decision import match_indices
    from hypafilter.analysis.dtree import Params, build, path
    from hypafilter.analysis.program import dispatch_cost
    from hypafilter.analysis.traffic import analyze
    from hypafilter.analysis.trees import TREE_MAX_EXPANSION, flat_regions
    from hypafilter.iptables.document import parse_policy
    from hypafilter.ir import FIELD_INDEX, NDIM

    cfg = Config(strategy="tree", tree_min_segment=4)
    pol = parse_policy(_cx_text(40), filename="cx.rules", base_chain="FORWARD", config=cfg)
    rng = np.random.default_rng(3)
    n = 600
    pts = np.zeros((n, NDIM), dtype=np.int64)
    pts[:, FIELD_INDEX["src"]] = (10 << 24) | (rng.integers(0, 48, n) << 16) | rng.integers(0, 1 << 16, n)
    pts[:, FIELD_INDEX["dst"]] = rng.integers(0, 1 << 32, n)
    pts[:, FIELD_INDEX["proto"]] = rng.choice([6, 17], n)
    pts[:, FIELD_INDEX["sport"]] = rng.integers(0, 1 << 16, n)
    pts[:, FIELD_INDEX["dport"]] = rng.integers(0, 1 << 16, n)
    res = analyze(pol, cfg, pts)
    assert res["shunted_packets_index_based"] == n

    plan = build_plan(pol, cfg, mode="index")
    prog = build_program(plan, "tree")
    assert {len(c) for c in plan.chains.values()} == {40}
    regs = flat_regions(pol)
    tree = build([regs[i] for i in range(40)], Params(binth=2, max_expansion=TREE_MAX_EXPANSION))
    want = 0
    for p, j in zip(pts, match_indices(plan, pts), strict=True):
        mark = mark_for(prog, int(plan.interval[j]), int(plan.actions[j]))
        walk, _ = path(
            tree, tuple(int(p[FIELD_INDEX[d]]) for d in ("src", "dst", "proto", "sport", "dport")), lambda r: None
        )
        want += dispatch_cost(prog, mark) + walk
    assert res["traversed_rules"]["tree"] == want
    assert res["traversed_rules"]["tree"] < 0.7 * res["traversed_rules"]["interval"], res["traversed_rules"]
    assert "tree" not in analyze(pol, Config(tree_min_segment=4), pts)["traversed_rules"]  # interval: as before


def test_status_says_which_trees_a_follow_kept():
    from hypafilter.cli.deploy import _fmt_trees

    kept = {"trees": 4, "rules_in_trees": 55, "lazy_trees": 3, "lazy_changed": 5, "k0_tree": "lazy", "k0_changed": 1}
    line = _fmt_trees(kept)
    assert line.startswith("trees    4 interval-chain trees over 55 rules, 3 kept from the last rebuild")
    assert "(5 over all of them); K0T lazy (1 changed rules diverted)" in line
    built = _fmt_trees({"trees": 2, "rules_in_trees": 9, "lazy_trees": 0, "k0_tree": "built"})
    assert "kept" not in built and built.endswith("; K0T built")
    assert "K0 stays the live list: the policy has no rules" in _fmt_trees({"k0_tree": "the policy has no rules"})


def test_the_first_follow_in_a_new_process_writes_the_deployed_trees_from_the_tree_cache():
    """The deployment keeps its built trees (`tree_cache.json`: analysis.trees.cache_json) beside their bases: the
    policy sync worker's first follow after a deploy or a restart (a new process, no trees in memory) builds no tree
    and writes what a follow that built them again writes; without the cache, or with one another version of the
    code wrote, it builds them."""
    import json

    from hypafilter.analysis import trees
    from hypafilter.iptables.document import parse_policy

    def prog(text, prefix, fresh, recorded=None, cache=None):
        cfg = Config(strategy="tree", tree_min_segment=4)
        plan = build_plan(parse_policy(text, filename="cx.rules", base_chain="FORWARD", config=cfg), cfg, live=True)
        plan.trees_fresh, plan.k0_tree, plan.tree_bases = fresh, True, recorded
        if cache is not None:
            plan.tree_cache = cache
        return plan, build_program(plan, "tree", prefix=prefix)

    base_text = _cx_text(40)
    plan, deployed = prog(base_text, "HF1_", True)
    assert deployed.tree_stats["trees_built"] >= 2 and deployed.tree_stats["k0_tree"] == "built"
    recorded = trees.bases_of_json(json.loads(json.dumps(plan.tree_bases_built)))
    cache_text = json.dumps(plan.tree_cache_built)  # what the deployment writes
    ban = "-A FORWARD -s 10.99.0.0/16 -p udp -m string --string EVIL --algo bm -j DROP\n"
    changed = base_text.replace("-A FORWARD -s 10.7.", ban + "-A FORWARD -s 10.7.")

    trees._POOLS.clear()  # a new process, without the cache: the bases' trees are built again
    plan_b, built = prog(changed, "HF2_", False, recorded)
    assert built.tree_stats["trees_built"] == deployed.tree_stats["trees_built"], built.tree_stats
    assert built.tree_stats["lazy_trees"] >= 1 and built.tree_stats["k0_tree"] == "lazy"
    assert json.loads(json.dumps(plan_b.tree_cache_built)) == json.loads(cache_text)  # deterministic: the same trees

    trees._POOLS.clear()  # a new process with the cache: no tree built, the same chains
    reads = []

    def cache():
        reads.append(1)
        return trees.cache_of_json(json.loads(cache_text))

    plan_c, reused = prog(changed, "HF2_", False, recorded, cache)
    assert reused.tree_stats["trees_built"] == 0 and reads == [1], reused.tree_stats
    assert render_iptables(reused) == render_iptables(built)
    assert getattr(plan_c, "tree_cache_built", None) is None  # nothing new to keep
    _, next_follow = prog(changed, "HF3_", False, recorded, cache)  # the process holds them now: no read
    assert next_follow.tree_stats["trees_built"] == 0 and reads == [1]
    ev = _callback(9)
    hdrs = [h for h in _headers() if (h.src >> 16) in range(0x0A00, 0x0A64)] + _headers()[::7]
    assert mismatches(plan_c, "tree", hdrs, ev) == []

    other = json.loads(cache_text)
    other["code"] = "0" * 16  # written by another version of the builder: not used
    trees._POOLS.clear()
    _, rebuilt = prog(changed, "HF2_", False, recorded, lambda: trees.cache_of_json(other))
    assert rebuilt.tree_stats["trees_built"] == deployed.tree_stats["trees_built"]
    assert render_iptables(rebuilt) == render_iptables(built)


# ------------------------------------------------------------------------------- log mirroring with strategy tree


def _observing_policy(n: int, deciding_every: int = 0):
    """Simple ACCEPT/DROP rules with an observing rule (NFLOG, LOG, no target) every third rule, and (if asked) a
    deciding complex rule every `deciding_every` rules: the frames the observers may see are mirrored, the others'
    shunted, and the mirrored entries' interval chains are long lists of observing rules."""
    rs = []
    for i in range(n):
        kw = {"src": f"10.{i % 7}.{i % 5}.0/24", "proto": ("tcp", "udp")[i % 2], "dport": (i, i + 3)}
        if i % 3 == 1:  # an observer sees a /16 of one protocol: the later rules it meets are mirrored
            rs.append(make_rule(("NFLOG", "LOG", "")[i % 9 // 3], src=f"10.{i % 7}.0.0/16", proto=kw["proto"]))
        elif deciding_every and i % deciding_every == 0:
            rs.append(make_rule("DROP", complex=[("-m", "mark", "--mark", f"{i:#x}/0xff")], **kw))
        else:
            rs.append(make_rule(("ACCEPT", "DROP")[i % 2], **kw))
    return make_policy(rs, "DROP")


def _mirror_leaves(prog) -> dict[str, list]:
    """The mirror copies' leaves L<k>A<a> (a with HF_MARK_MIRROR) that walk a tree, with their chains."""
    from hypafilter.analysis.program import MARK_MIRROR

    tree = prog.name("T")

    def reaches_tree(name: str) -> bool:  # directly, or through the segment and block chains it jumps to
        inner = [r.target for r in prog.chains[name] if r.target in prog.chains]
        return any(t.startswith(tree) or reaches_tree(t) for t in inner)

    out = {}
    for name, ch in prog.chains.items():
        m = re.fullmatch(re.escape(prog.prefix) + r"L\d+A(\d+)", name)
        if m and int(m.group(1)) & MARK_MIRROR and reaches_tree(name):
            out[name] = ch
    return out


def _rule_headers(n: int) -> list:
    """A header inside each rule of _observing_policy(n) (its first simple entries' too), and _headers()."""
    return [
        Header(src=(10 << 24) | (i % 7 << 16) | (i % 5 << 8) | 9, dst=1, proto=(6, 17)[i % 2], dport=i + 1)
        for i in range(n)
    ] + _headers()


def _copies(plan, hdrs) -> int:
    from hypafilter.analysis.decision import decision, mirrored

    return sum(mirrored(plan, *decision(plan, h)) for h in hdrs)


def test_mirror_copies_walk_trees_and_meet_the_observers_the_policy_gives_them():
    """Strategy tree mirrors (config.mirrors): an entry an observing rule may see is decided by the fast path and its
    copy walks the interval chain above it as a tree; through Program.run every frame gets the reference verdict
    and passes exactly the observing rules the flattened policy gives it, copies included, in every NIC mode."""
    from hypafilter.config import mirrors

    assert mirrors("selective", "tree") and mirrors("index", "tree") and not mirrors("exact", "tree")
    hdrs = _rule_headers(150)
    for deciding_every, mode in ((0, "index"), (0, "selective"), (10, "selective")):
        pol = _observing_policy(150, deciding_every)
        ev = _callback(deciding_every + 1)
        for nic_mode in ("bridge", "host"):
            plan = build_plan(pol, Config(nic_mode=nic_mode, tree_min_segment=4), mode=mode, strategy="tree")
            assert plan.mirror.any(), mode
            prog = build_program(plan, "tree", nic_mode=nic_mode)
            assert _mirror_leaves(prog), "the copies' long chains of observing rules are trees"
            assert _copies(plan, hdrs) > 50
            assert mismatches(plan, "tree", hdrs, ev, nic_mode=nic_mode) == [], (mode, nic_mode, deciding_every)
            depth, path = chain_depth(prog)
            assert depth + 1 <= NFT_MAX_DEPTH, path
            if nic_mode == "bridge":
                text = render_iptables(prog)
                assert re.search(r"-A HF1_L\d+A[56] .*-j HF1_T\d+", text), "a copy's leaf jumps into a tree"


def test_a_copy_that_misses_an_observer_in_a_tree_is_caught():
    """The comparison can fail: take one observing rule out of a tree leaf that copies reach, and some copy passes
    fewer observing rules than the policy alone gives its frame."""
    pol = _observing_policy(150)
    plan = build_plan(pol, Config(tree_min_segment=4), mode="selective", strategy="tree")
    prog = build_program(plan, "tree")
    plan.__dict__["_programs"] = {("tree", 0xFFFFFFFF, 0, "bridge"): prog}  # hybrid_verdict runs this very program
    hdrs = _rule_headers(150)
    ev = _callback(3)
    assert mismatches(plan, "tree", hdrs, ev) == []
    reached, seen = set(), list(_mirror_leaves(prog))
    while seen:
        for r in prog.chains[seen.pop()]:
            if r.target in prog.chains and r.target not in reached:
                reached.add(r.target)
                seen.append(r.target)
    found = 0
    for name in sorted(n for n in reached if n.startswith(prog.name("T"))):
        ch = prog.chains[name]
        pos = next((j for j, r in enumerate(ch) if r.kind == "policy" and pol.rules[r.index].target in OBSERVING), None)
        if pos is None:
            continue
        saved = list(ch)
        del ch[pos]
        bad = mismatches(plan, "tree", hdrs, ev)
        prog.chains[name] = saved
        if bad:
            assert all(want[0] == "observed" for _, want, _ in bad), "verdicts stay the hardware's"
            found += 1
            break
    assert found
