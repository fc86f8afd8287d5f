"""What a follow loads (ops.ruleset.reuse_chains, docs/optimize.md "What a follow loads"): only the tool's chains whose
content the kernel does not hold yet; every other chain of the new generation stays under its earlier name.

The check is structural: the kernel's chains after the load (the earlier generation's plus those loaded), walked from
the new MAIN with every jump and goto replaced by the rules of the chain it names, are the new generation's chains
walked the same way: a frame meets the same rules in the same order (the hybrid's own model of those chains is
tests/unit/test_tree_strategy.py; the kernel's verdicts tests/system/test_tree_strategy.py)."""

from __future__ import annotations

import re

from hypafilter.analysis.plan import build_plan
from hypafilter.analysis.program import build_program
from hypafilter.config import Config
from hypafilter.iptables.document import parse_policy
from hypafilter.iptables.writer import body_of
from hypafilter.netfilter.restore import render_iptables
from hypafilter.ops.ruleset import reuse_chains

from tests.unit.test_tree_strategy import _cx_text


def _chains(body: list[str]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for ln in body:
        if ln.startswith(":"):
            out.setdefault(ln[1:].split()[0], [])
        elif ln.startswith("-A "):
            name, _, rest = ln[3:].partition(" ")
            out[name].append(rest)
    return out


def _walk(chains: dict[str, list[str]], entry: str) -> str:
    """The rules reached from `entry`, every jump and goto to a chain replaced by its rules: names left out."""
    memo: dict[str, str] = {}

    def inline(name: str) -> str:
        if name not in memo:
            lines = []
            for r in chains[name]:
                toks = r.split(" ")
                for i in range(len(toks) - 1):
                    if toks[i] in ("-j", "-g") and toks[i + 1] in chains:
                        toks[i + 1] = "{" + inline(toks[i + 1]) + "}"
                lines.append(" ".join(toks))
            memo[name] = "; ".join(lines)
        return memo[name]

    return inline(entry)


def _body(text: str, gen: int, fresh: bool) -> list[str]:
    cfg = Config(strategy="tree", tree_min_segment=4)
    plan = build_plan(parse_policy(text, filename="cx.rules", base_chain="FORWARD", config=cfg), cfg, live=True)
    plan.trees_fresh, plan.k0_tree = fresh, True
    return body_of(render_iptables(build_program(plan, "tree", prefix=f"HF{gen}_")))


def _load(kernel: dict[str, list[str]], loaded: dict[str, str], body: list[str], gen: int):
    """ops.deploy's follow on a model kernel: the chains loaded beside the kernel's, then those not in use deleted."""
    r = reuse_chains(body, f"HF{gen}_MAIN", loaded)
    after = {**kernel, **_chains(r.body)}
    return r, {n: after[n] for n in r.in_use}


def test_a_follow_loads_only_the_chains_whose_content_changed():
    """example-sized: 40 complex rules (one interval chain written as a tree) and K0T. An inserted complex rule (the
    trees kept, the change diverted ahead of them) loads MAIN, the leaves with their diversion, the diversion chains
    and K0T; a deleted one also the tree chains from the root to each leaf that held its copies. Each time the kernel
    walks from the new MAIN exactly the rules the new generation's chains give, and no chain in use is missing."""
    base = _cx_text(40)
    dep = _body(base, 1, True)
    r1, kernel = _load({}, {}, dep, 1)
    assert r1.rules_loaded == sum(ln.startswith("-A ") for ln in dep) and not r1.kept  # a deploy loads everything

    ban = "-A FORWARD -s 10.99.0.0/16 -p udp -m string --string EVIL --algo bm -j DROP\n"
    changed = base.replace("-A FORWARD -s 10.7.", ban + "-A FORWARD -s 10.7.")
    new = _body(changed, 2, False)
    r2, kernel2 = _load(kernel, r1.in_use, new, 2)
    total = sum(ln.startswith("-A ") for ln in new)
    print(f"insert: {r2.rules_loaded} of {total} rules loaded, {len(r2.kept)} chains kept")
    assert "HF2_MAIN" in r2.created and r2.kept and r2.rules_loaded < total / 3
    assert not any(re.match(r"HF2_T\d+$", c) for c in r2.created)  # the kept trees: not loaded again
    assert _walk(kernel2, "HF2_MAIN") == _walk(_chains(new), "HF2_MAIN")
    refs = {t for rules in kernel2.values() for r in rules for t in re.findall(r"-[jg] (HF\d+_\S+)", r)}
    assert refs <= set(kernel2)

    # the inserted rule deleted again and another deployed one deleted: the trees' leaves with its copies change
    gone = changed.replace(ban, "").replace(
        "-A FORWARD -s 10.3.0.0/16 -p udp -m string --string BAD3 --algo bm -j DROP\n", ""
    )
    assert gone != base
    new3 = _body(gone, 3, False)
    r3, kernel3 = _load(kernel2, r2.in_use, new3, 3)
    print(f"delete: {r3.rules_loaded} of {sum(ln.startswith('-A ') for ln in new3)} rules loaded")
    assert any(re.match(r"HF3_T\d+$", c) for c in r3.created) and r3.kept
    assert _walk(kernel3, "HF3_MAIN") == _walk(_chains(new3), "HF3_MAIN")
    assert _walk(kernel3, "HF3_MAIN") != _walk(kernel2, "HF2_MAIN")

    # nothing changed in the tool's chains (a change the policy's own names hold): MAIN alone is loaded
    r4, kernel4 = _load(kernel3, r3.in_use, _body(gone, 4, False), 4)
    assert r4.created == ["HF4_MAIN"] and _walk(kernel4, "HF4_MAIN") == _walk(kernel3, "HF3_MAIN")


def test_a_chain_is_kept_only_with_everything_below_it():
    """A chain is kept when its rules and every chain below it are the same: a change in a leaf loads the leaf and
    every chain above it, its siblings stay; a chain of the same rules under another name is kept too (trees renumbered
    by an insert above them); the entry chain is always loaded."""
    gen1 = [":G1_MAIN", ":G1_A", ":G1_B", ":G1_C", ":G1_D"]
    gen1 += ["-A G1_MAIN -j G1_A", "-A G1_MAIN -g G1_D", "-A G1_A -s 10.0.0.0/8 -g G1_B", "-A G1_A -j G1_C"]
    gen1 += ["-A G1_B -j DROP", "-A G1_C -p tcp -j ACCEPT", "-A G1_D -j ACCEPT"]
    gen1 = [ln + " - [0:0]" if ln.startswith(":") else ln for ln in gen1]
    r1, kernel = _load({}, {}, gen1, 1)
    gen2 = [ln.replace("G1_", "G2_") for ln in gen1]
    gen2 = [ln.replace("-p tcp", "-p udp") for ln in gen2]  # C changed: C, A (above it) and MAIN loaded
    r2, kernel2 = _load(kernel, r1.in_use, [ln.replace("G2_", "HF2_") for ln in gen2], 2)
    assert r2.created == ["HF2_MAIN", "HF2_A", "HF2_C"] and r2.kept == {"HF2_B": "G1_B", "HF2_D": "G1_D"}
    assert kernel2["HF2_A"] == ["-s 10.0.0.0/8 -g G1_B", "-j HF2_C"]
    # renumbered: B's rules under the name E, D's under B
    gen3 = [ln.replace("HF2_B", "HF3_E").replace("HF2_D", "HF3_B").replace("HF2_", "HF3_") for ln in r2.body]
    gen3 += [":HF3_E - [0:0]", ":HF3_B - [0:0]", "-A HF3_E -j DROP", "-A HF3_B -j ACCEPT"]
    gen3 = [ln.replace("G1_B", "HF3_E").replace("G1_D", "HF3_B") for ln in gen3]
    r3, kernel3 = _load(kernel2, r2.in_use, gen3, 3)
    assert r3.created == ["HF3_MAIN"] and r3.kept == {
        "HF3_A": "HF2_A",
        "HF3_C": "HF2_C",
        "HF3_E": "G1_B",
        "HF3_B": "G1_D",
    }
    assert _walk(kernel3, "HF3_MAIN") == _walk(_chains(gen3), "HF3_MAIN") == _walk(kernel2, "HF2_MAIN")


def test_a_follow_loads_no_more_than_a_rebuild():
    """The cheaper of diverting and rebuilding, by rules loaded: one ban diverted loads far fewer rules than the trees
    built anew would; eight changes whose boxes each meet the whole chain (a destination no rule names, any source)
    would write a diversion larger than the trees, so the follow builds them anew (`rebuilt_cheaper`) and loads no
    more than a rebuild. Either way the hybrid model through the follow's chains gives the live policy's verdicts."""
    from hypafilter.analysis import trees

    from tests.unit.test_properties import _callback, mismatches
    from tests.unit.test_tree_strategy import _cx_prog, _headers

    base = _cx_text(40)
    r1, _ = _load({}, {}, _body(base, 1, True), 1)
    one = "-A FORWARD -s 10.99.0.0/16 -p udp -m string --string EVIL --algo bm -j DROP\n"
    wide = "".join(f"-A FORWARD -d 192.168.{i}.0/24 -m string --string W{i} --algo bm -j DROP\n" for i in range(8))
    for extra, rebuilt in ((one, 0), (wide, 1)):
        text = base.replace("-A FORWARD -s 10.7.", extra + "-A FORWARD -s 10.7.")
        trees._POOLS.clear()
        _load({}, {}, _body(base, 1, True), 1)  # the deployment's trees, this process's bases
        follow = reuse_chains(_body(text, 2, False), "HF2_MAIN", r1.in_use)
        fresh = reuse_chains(_body(text, 2, True), "HF2_MAIN", r1.in_use)
        print(f"{len(extra.splitlines())} changes: follow {follow.rules_loaded}, rebuild {fresh.rules_loaded} rules")
        assert follow.rules_loaded <= fresh.rules_loaded
        trees._POOLS.clear()
        _cx_prog(base, "HF1_", True)
        plan, prog = _cx_prog(text, "HF2_", False)
        assert prog.tree_stats["rebuilt_cheaper"] == rebuilt, prog.tree_stats
        if not rebuilt:
            assert follow.rules_loaded * 2 < fresh.rules_loaded and prog.tree_stats["lazy_trees"] >= 1
        hdrs = _headers()[::3] + [h for h in _headers() if h.proto == 17][::2]
        assert mismatches(plan, "tree", hdrs, _callback(9)) == []


def test_chains_of_the_same_rules_under_two_names_are_kept():
    """Two chains of the same rules (leaves of two trees) are one content: the chains above either are kept too."""
    gen1 = [":G1_MAIN - [0:0]", ":G1_P - [0:0]", ":G1_Q - [0:0]", ":G1_X - [0:0]", ":G1_Y - [0:0]"]
    gen1 += ["-A G1_MAIN -s 10.0.0.0/8 -j G1_P", "-A G1_MAIN -j G1_Q", "-A G1_P -p tcp -g G1_X", "-A G1_Q -g G1_Y"]
    gen1 += ["-A G1_X -j DROP", "-A G1_Y -j DROP"]
    r1, kernel = _load({}, {}, gen1, 1)
    r2, kernel2 = _load(kernel, r1.in_use, [ln.replace("G1_", "HF2_") for ln in gen1], 2)
    assert r2.created == ["HF2_MAIN"] and r2.rules_loaded == 2, r2.body
    assert _walk(kernel2, "HF2_MAIN") == _walk(kernel, "G1_MAIN")


# ---- the IPv6 side: a follow of ip6tables (ops.deploy._load_chains6) ------------------------------------------------


def _restore6(kernel: dict[str, list[str]], text: str) -> dict[str, list[str]]:
    """`ip6tables-restore --noflush` of `text` (netfilter.ip6.chains_text) on a model filter table: a declaration
    creates or flushes its chain, -F flushes, -X deletes, -A appends, -D deletes the rule, -I inserts."""
    out = {c: list(rules) for c, rules in kernel.items()}
    for ln in text.splitlines():
        if ln.startswith(":"):
            out[ln[1:].split()[0]] = []
        elif ln.startswith(("-F ", "-X ")):
            name = ln.split()[1]
            assert name in out, ln
            if ln.startswith("-X "):
                del out[name]
            else:
                out[name] = []
        elif ln.startswith(("-A ", "-D ")):
            name, _, rest = ln[3:].partition(" ")
            (out[name].append if ln.startswith("-A ") else out[name].remove)(rest)
        elif ln.startswith("-I "):
            name, pos, rest = ln[3:].split(" ", 2)
            out[name].insert(int(pos) - 1, rest)
    return out


def _listing6(kernel: dict[str, list[str]]) -> str:
    """The model table as ip6tables-save lists it."""
    decl = [f":{c} {'DROP' if c == 'FORWARD' else '-'} [0:0]" for c in kernel]
    return "\n".join(["*filter", *decl, *(f"-A {c} {r}" for c, rs in kernel.items() for r in rs), "COMMIT", ""])


def _follow6(kernel: dict[str, list[str]], c6, loaded: dict[str, list], keep: bool = True):
    """ops.deploy._load_chains6 on a model kernel: the chains reuse_chains leaves to load, in one restore of
    ip6.chains_text that keeps the chains in use (`keep` False: the text as it was before, which keeps none)."""
    from hypafilter.netfilter import ip6

    r = reuse_chains(ip6.body_lines(c6), c6.main, loaded)
    body = ip6.Chains6("\n".join(r.body) + "\n", c6.main, c6.strategy, c6.k_base)
    text = ip6.chains_text(body, "FORWARD", _listing6(kernel), r.in_use if keep else ())
    return r, _restore6(kernel, text)


def test_a_follow_of_ip6tables_loads_only_the_ipv6_chains_whose_content_changed():
    """The IPv6 side of a dual-stack deployment (strategy tree, live: 32 complex rules written as trees, HFv6_K0T):
    the follow of an inserted ban loads under a new generation's names (`HFv6_2_…`) only the chains whose content
    ip6tables does not hold, rewrites HFv6_MAIN in place and deletes the chains no longer in use, in one restore. The
    kernel's chains after it, walked from HFv6_MAIN with every jump inlined, are the new plan's chains walked the same
    way; so after a second follow (the ban deleted). Keeping no chain in the restore (the text of before) leaves
    jumps to deleted chains: caught."""
    import dataclasses

    from hypafilter.netfilter import ip6
    from hypafilter.targets.xdp.v6 import plan6_for

    from tests.unit.test_ipv6_chains import _config, _side, _v6_cx

    config = _config(strategy="tree", tree_min_segment=4)
    text = _v6_cx(32)
    plan4, _, _ = _side(config, text)
    plan4.k0_tree = True

    def chains(t: str, gen: int | None):
        ir = parse_policy(t, "v6.rules", base_chain="FORWARD", config=config, family=6)
        v6 = dataclasses.replace(ip6.parse(t, "v6.rules", "FORWARD", validate=False), ir=ir, tables=("filter",))
        plan6, why = plan6_for(v6, config, plan4, k_base=plan4.num_intervals)
        assert why == "", why
        return ip6.render_chains(plan6, config, "HFv6_", gen)

    dep = chains(text, None)
    r1, kernel = _follow6({"FORWARD": ["-s 2001:db8:7::/48 -j DROP"]}, dep, {})
    assert r1.rules_loaded == sum(ln.startswith("-A ") for ln in ip6.body_lines(dep)) and not r1.kept
    assert kernel["FORWARD"][0] == "-j HFv6_MAIN" and "HFv6_K0T" in kernel

    ban = "-A FORWARD -s 2001:db8:0:5::/64 -p tcp -m hl --hl-eq 3 -j DROP\n"
    banned = text.replace("-A FORWARD -s fd48:4600::/64", ban + "-A FORWARD -s fd48:4600::/64")
    new = chains(banned, 2)
    r2, kernel2 = _follow6(kernel, new, r1.in_use)
    total = sum(ln.startswith("-A ") for ln in ip6.body_lines(new))
    print(f"IPv6 ban: {r2.rules_loaded} of {total} rules loaded, {len(r2.kept)} chains kept")
    assert new.main == "HFv6_MAIN" and "HFv6_MAIN" in r2.created and r2.rules_loaded < total / 2
    assert all(re.fullmatch(r"HFv6_2_\S+", c) for c in r2.created if c != "HFv6_MAIN") and r2.kept
    assert _walk(kernel2, "HFv6_MAIN") == _walk(_chains(ip6.body_lines(new)), "HFv6_MAIN")
    assert _walk(kernel2, "HFv6_MAIN") != _walk(kernel, "HFv6_MAIN")
    assert {c for c in kernel2 if c.startswith("HFv6_")} == set(r2.in_use)  # nothing stale, nothing missing
    assert kernel2["FORWARD"] == kernel["FORWARD"]  # the operator's rules and the jump as they were

    # the ban deleted: a third generation, HFv6_2_ chains kept where their content stays
    again = chains(text, 3)
    r3, kernel3 = _follow6(kernel2, again, r2.in_use)
    assert r3.kept and _walk(kernel3, "HFv6_MAIN") == _walk(_chains(ip6.body_lines(again)), "HFv6_MAIN")
    assert {c for c in kernel3 if c.startswith("HFv6_")} == set(r3.in_use)

    # the restore's text of before (the chains the new plan does not name deleted) would delete the kept ones
    _, broken = _follow6(kernel, new, r1.in_use, keep=False)
    refs = {t for rules in broken.values() for r in rules for t in re.findall(r"-[jg] (HFv6_\S+)", r)}
    assert not refs <= set(broken)


def test_a_chain_in_place_of_main_is_never_kept_as_main():
    """MAIN keeps its name across the IPv6 side's follows: a new chain whose content is the old MAIN's is loaded,
    not kept as HFv6_MAIN (whose rules the same restore replaces: MAIN would jump to itself)."""
    gen1 = [":HFv6_MAIN - [0:0]", ":HFv6_A - [0:0]", "-A HFv6_MAIN -j HFv6_A", "-A HFv6_A -j DROP"]
    r1 = reuse_chains(gen1, "HFv6_MAIN", {})
    gen2 = [":HFv6_MAIN - [0:0]", ":HFv6_2_X - [0:0]", ":HFv6_2_A - [0:0]"]
    gen2 += ["-A HFv6_MAIN -p tcp -j HFv6_2_X", "-A HFv6_2_X -j HFv6_2_A", "-A HFv6_2_A -j DROP"]
    r2 = reuse_chains(gen2, "HFv6_MAIN", r1.in_use)
    assert r2.kept == {"HFv6_2_A": "HFv6_A"} and r2.created == ["HFv6_MAIN", "HFv6_2_X"], (r2.kept, r2.created)
    kernel = {**_chains(gen1), **_chains(r2.body)}
    assert _walk(kernel, "HFv6_MAIN") == _walk(_chains(gen2), "HFv6_MAIN")


def _plan6_maker(config, text4: str):
    """(plan6(text, fresh), plan4): the family-6 plan of an ip6tables text beside the IPv4 side of `text4` (its K0 a
    tree), as deploy and a follow build it (`fresh`: the trees built anew, else kept from the recorded bases)."""
    import dataclasses

    from hypafilter.netfilter import ip6
    from hypafilter.targets.xdp.v6 import plan6_for

    from tests.unit.test_ipv6_chains import _side

    plan4, _, _ = _side(config, text4)
    plan4.k0_tree = True

    def plan6(t: str, fresh: bool):
        ir = parse_policy(t, "v6.rules", base_chain="FORWARD", config=config, family=6)
        v6 = dataclasses.replace(ip6.parse(t, "v6.rules", "FORWARD", validate=False), ir=ir, tables=("filter",))
        p, why = plan6_for(v6, config, plan4, k_base=plan4.num_intervals)
        assert why == "", why
        p.trees_fresh = fresh
        return p

    return plan6, plan4


def _tree_wrong(p, extra, n: int = 1500) -> int:
    """Wrong verdicts of a tree-strategy IPv6 plan through the chain interpreter: `n` random ranked headers and those
    `extra(amap)` gives, shunted (the hybrid) and on the K0-tree mark, against the reference (complex matches: half)."""
    import random

    from hypafilter.analysis.program import K0_TREE, build_program, mark_for
    from hypafilter.ir.semantics import reference_verdict

    from tests.unit.test_ipv6_chains import random_headers6
    from tests.unit.test_properties import _callback, mismatches

    prog = build_program(p, "tree", k_base=p.k_base)
    p.__dict__["_programs"] = {("tree", 0xFFFFFFFF, 0, "bridge"): prog}  # hybrid_verdict runs this program
    pol, ev = p.policy, _callback(0x5A5A5A5A5A5A5A5)
    hdrs = random_headers6(pol.addr_map, random.Random(7), n) + extra(pol.addr_map)
    k0 = sum(prog.run(h, mark_for(prog, 0, K0_TREE), ev)[0] != reference_verdict(pol, h, ev) for h in hdrs)
    return len(mismatches(p, "tree", hdrs, ev)) + k0


def test_the_ipv6_sides_trees_are_kept_with_the_changes_diverted_ahead_of_them(monkeypatch):
    """The IPv6 side's trees are lazy as the IPv4 side's (docs/optimize.md "Lazy trees"): a follow of ip6tables
    (`trees_fresh` False) writes the interval chain's trees and HFv6_K0T as the deployment built them, with TD<n>/K0D<n>
    diversions on the inserted ban's IPv6 source (ip6tables `-m iprange` over 128-bit addresses) ahead of them, and
    loads a fraction of what the trees built anew load. Through the chain interpreter on the plan's ranked headers the
    follow's chains give the changed policy's verdicts, shunted (the hybrid) and on the K0-tree mark; without the
    diversions they do not."""
    import ipaddress

    from hypafilter.analysis import trees
    from hypafilter.ir import Header
    from hypafilter.netfilter import ip6

    from tests.unit.test_ipv6_chains import _config, _v6_cx

    config = _config(strategy="tree", tree_min_segment=4)
    text = _v6_cx(32)
    plan6, _ = _plan6_maker(config, text)

    ban = "-A FORWARD -s 2001:db8:0:5::/64 -p udp -m hl --hl-eq 3 -j DROP\n"  # UDP 5000:5100 is accepted below
    banned = text.replace("-A FORWARD -s fd48:4600::/64", ban + "-A FORWARD -s fd48:4600::/64")
    trees._POOLS.clear()
    dep = ip6.render_chains(plan6(text, True), config, "HFv6_")  # the deploy: its trees are the bases
    loaded = reuse_chains(ip6.body_lines(dep), dep.main, {}).in_use
    lazy6 = plan6(banned, False)
    lazy = ip6.render_chains(lazy6, config, "HFv6_", 2)
    stats = lazy6.tree_stats
    assert stats["lazy_trees"] >= 1 and stats["k0_tree"] == "lazy" and stats["trees_built"] == 0, stats
    body = ip6.body_lines(lazy)
    src = "-p 17 -m iprange --src-range 2001:db8:0:5::-2001:db8:0:5:ffff:ffff:ffff:ffff"
    assert any(re.fullmatch(rf"-A HFv6_2_K0T {src} -g HFv6_2_K0D\d+", ln) for ln in body), body
    assert any(re.fullmatch(rf"-A HFv6_2_L\d+A\d+ {src} -j HFv6_2_TD\d+", ln) for ln in body), body
    fresh = ip6.render_chains(plan6(banned, True), config, "HFv6_", 2)
    n_lazy = reuse_chains(body, lazy.main, loaded).rules_loaded
    n_fresh = reuse_chains(ip6.body_lines(fresh), fresh.main, loaded).rules_loaded
    print(f"IPv6 ban: {n_lazy} rules loaded with the trees kept, {n_fresh} with the trees built anew")
    assert n_lazy * 3 < n_fresh

    def wrong(p) -> int:
        def ban_udp(amap):  # UDP from the ban's source
            banned_src = amap.rank("src", int(ipaddress.IPv6Address("2001:db8:0:5::")))
            return [Header(src=banned_src, dst=d, proto=17, dport=5000 + d) for d in range(len(amap.starts["dst"]))]

        return _tree_wrong(p, ban_udp)

    trees._POOLS.clear()  # the deploy's bases, as the follow's process holds them
    ip6.render_chains(plan6(text, True), config, "HFv6_")
    assert wrong(plan6(banned, False)) == 0
    monkeypatch.setattr(trees, "_diversions", lambda *a, **k: [])
    trees._POOLS.clear()
    ip6.render_chains(plan6(text, True), config, "HFv6_")
    assert wrong(plan6(banned, False)) > 0


def test_recorded_ipv6_bases_without_the_tree_cache_are_read_as_ipv6():
    """A follow in a new process (the policy sync worker after a restart or an upgrade, whose tree cache is gone or
    written by other code) takes the deployment's recorded IPv6 bases from their rules' keys alone and reads their
    regions again. They are ip6tables rules: a rule without an address spans the 128-bit space. Read as IPv4 (the
    bug), such a rule spanned 0..2**32-1, the trees over those regions and the diversions that leave the rule out of a
    box at real IPv6 addresses gave wrong verdicts (DROP for ACCEPT). The chain interpreter on the plan's ranked headers
    gives the changed policy's verdicts, shunted and on the K0-tree mark, with the cache and without it."""
    import ipaddress
    import json

    from hypafilter.analysis import trees
    from hypafilter.ir import Header
    from hypafilter.netfilter import ip6

    from tests.unit import test_ipv6_chains as v6c

    config = v6c._config(strategy="tree", tree_min_segment=4)
    anchor = "-A FORWARD -s fd48:4600::/64"
    no_addr = [
        f"-A FORWARD -p tcp --dport {2000 + i} -m hl --hl-eq 3 -j {('DROP', 'ACCEPT')[i % 2]}" for i in range(32)
    ]
    text = v6c.V6.replace(anchor, "\n".join(no_addr) + "\n" + anchor)
    plan6, _ = _plan6_maker(config, text)

    bans = (
        "-A FORWARD -s 2001:db8:0:5::/64 -p tcp -m hl --hl-eq 3 -j ACCEPT\n"
        "-A FORWARD -s 2001:db8:0:6::/64 -p tcp -m hl --hl-eq 3 -j DROP\n"
    )
    banned = text.replace(anchor, bans + anchor)
    trees._POOLS.clear()
    dep = plan6(text, True)
    ip6.render_chains(dep, config, "HFv6_")  # the deploy: what it records, as the state files keep it
    bases = json.loads(json.dumps(dep.tree_bases_built))
    cache = json.loads(json.dumps(dep.tree_cache_built))

    def wrong(read_cache) -> int:
        trees._POOLS.clear()  # a new process: nothing held
        p = plan6(banned, False)
        p.tree_bases, p.tree_cache = trees.bases_of_json(bases), read_cache
        from hypafilter.analysis.program import build_program

        assert build_program(p, "tree", k_base=p.k_base).tree_stats["k0_tree"] == "lazy"

        def bans_to_ports(amap):  # the bans' sources, to the address-less rules' ports
            out = []
            for a in ("2001:db8:0:5::", "2001:db8:0:6::"):
                r = amap.rank("src", int(ipaddress.IPv6Address(a)))
                out += [Header(src=r, dst=d, proto=6, dport=2000 + i) for i in range(0, 32, 3) for d in range(len(amap.starts["dst"]))]  # fmt: skip
            return out

        return _tree_wrong(p, bans_to_ports, 600)

    assert wrong(lambda: trees.cache_of_json(cache)) == 0
    assert wrong(lambda: {}) == 0
