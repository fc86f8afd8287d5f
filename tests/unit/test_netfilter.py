"""Unit tests for hypafilter.netfilter: chain structure, dispatch, mark mask, refusals (text only; loading is
tests/system/test_netfilter_load.py)."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import pytest
from hypafilter.analysis.decision import match_index
from hypafilter.analysis.hybrid import hybrid_verdict
from hypafilter.analysis.plan import MODES, build_plan
from hypafilter.analysis.program import STRATEGIES, build_program, dispatch_cost, mark_for
from hypafilter.errors import HypafilterError
from hypafilter.ir import Header
from hypafilter.netfilter.nft import to_nft
from hypafilter.netfilter.restore import to_iptables_restore

from tests.irbuild import listing1, make_policy, make_rule

STRING = [("-m", "string", "--string", "X", "--algo", "bm")]


def _many_intervals(n=40):
    rules = []
    for i in range(n):
        rules.append(make_rule("DROP", dst=f"10.0.{i}.0/24", proto="udp", complex=STRING))
        rules.append(make_rule("ACCEPT" if i % 2 else "DROP", dst=f"10.0.{i}.0/24", proto="udp", dport=(53, 53)))
    return make_policy(rules, "DROP")


def test_every_chain_is_owned_and_main_ends_in_verdicts():
    plan = build_plan(listing1(), mode="selective")
    for s in STRATEGIES:
        text = to_iptables_restore(plan, s, prefix="HF7_")
        for ln in text.splitlines():
            if ln.startswith((":", "-A")):
                assert ln.split()[1 if ln.startswith("-A") else 0].lstrip(":").startswith("HF7_")
        assert "-A FORWARD" not in text and text.rstrip().endswith("COMMIT")
        # (strategy tree too: a policy of 5 rules has no run long enough for a tree)
        assert "-A HF7_K0 -j HF7_FULL\n-A HF7_K0 -j ACCEPT\n" in text


def test_full_chain_is_the_original_policy_verbatim():
    pol = listing1()
    text = to_iptables_restore(build_plan(pol), "full")
    full = [ln[len("-A HF1_FULL ") :] for ln in text.splitlines() if ln.startswith("-A HF1_FULL ")]
    assert len(full) == len(pol.original_rules)
    assert full[0] == "-d 1.2.3.4/32 -p tcp -m tcp --dport 80 -j ACCEPT"


def test_dispatch_is_a_binary_search_with_exact_leaves():
    plan = build_plan(_many_intervals(), mode="selective")
    prog = build_program(plan, "interval")
    leaves = {(int(plan.interval[j]), int(plan.actions[j])) for j in range(plan.n + 1) if plan.shunt[j]}
    assert len(leaves) > 30
    # log2-ish cost instead of linear, for every leaf.
    assert max(dispatch_cost(prog, mark_for(prog, k, a)) for k, a in leaves) <= 16
    text = to_iptables_restore(plan, "interval")
    assert text.count("-j HF1_D") >= 4
    # Unknown marks fall back to the full policy.
    assert prog.chains["HF1_MAIN"][-1].target == "HF1_K0"


def test_interval_chains_share_prefixes_so_size_stays_linear():
    plan = build_plan(_many_intervals(), mode="index")
    text = to_iptables_restore(plan, "interval")
    c_rules = [ln for ln in text.splitlines() if ln.startswith(("-A HF1_C", "-A HF1_B")) and "string" in ln]
    # Each complex rule is written at most twice (a level-1 block and its segment C<k>), not once per interval.
    assert 40 <= len(c_rules) <= 2 * 40


def test_mark_mask_and_shift_are_honoured():
    plan = build_plan(listing1(), mode="index")
    text = to_iptables_restore(plan, "interval", mark_mask=0x00FFFF00, mark_shift=8)
    assert "--mark 0x0/0xfff000" in text  # k = 0 test: the k bits inside the mask
    assert "--mark 0x2100/0xffff00" in text
    with pytest.raises(HypafilterError, match="does not fit mark_mask"):
        to_iptables_restore(build_plan(_many_intervals(), mode="index"), "interval", mark_mask=0xF0, mark_shift=0)


def test_hsa_cut_with_index_shunting_is_refused():
    with pytest.raises(HypafilterError, match="not exact with index-based"):
        to_iptables_restore(build_plan(listing1(), mode="index"), "hsa_cut")
    with pytest.raises(HypafilterError, match="unknown strategy"):
        to_iptables_restore(build_plan(listing1()), "magic")


def test_cut_lists_follow_the_paper():
    plan = build_plan(listing1(), mode="selective")
    text = to_iptables_restore(plan, "cut")
    cut = [ln for ln in text.splitlines() if ln.startswith("-A HF1_CUT")]
    assert cut[0] == "-A HF1_CUT -j MARK --set-xmark 0x0/0xffffffff"  # the shim's mark bits given back first
    assert len(cut[1:]) == 4  # R3, R5, R6 and the chain policy
    idx = to_iptables_restore(build_plan(listing1(), mode="index"), "cut")
    assert len([ln for ln in idx.splitlines() if ln.startswith("-A HF1_CUT")][1:]) == 5  # R3..R6 + policy


def test_multi_level_rules_use_return_guards():
    from hypafilter.ir import Level, Rule

    base = make_rule("ACCEPT", src="10.0.0.0/8")
    r = Rule(
        boxes=base.boxes,
        target="ACCEPT",
        complex=(("-m", "conntrack", "--ctstate", "NEW"),),
        levels=(Level(("-s", "10.0.0.0/8")), Level(("-m", "conntrack", "--ctstate", "NEW"), unless=(("-p", "tcp"),))),
    )
    pol = make_policy([base])
    pol.rules = [r, make_rule("DROP", src="10.1.0.0/16")]
    text = to_iptables_restore(build_plan(pol, mode="selective"), "interval")
    assert "-A HF1_R0L2 -p tcp -j RETURN\n-A HF1_R0L2 -m conntrack --ctstate NEW -j ACCEPT" in text
    assert "-s 10.0.0.0/8 -j HF1_R0L2" in text


def test_nft_output_uses_a_verdict_map_and_refuses_string():
    pol = make_policy(
        [
            make_rule("DROP", proto="tcp", dport=(22, 22), complex=[("-m", "conntrack", "--ctstate", "NEW")]),
            make_rule("ACCEPT", src="10.0.0.0/8", proto="tcp", dports=[22, 80]),
            make_rule("LOG", target_args=("--log-prefix", "x: "), proto="udp"),
        ],
        "DROP",
    )
    text = to_nft(build_plan(pol, mode="selective"), "interval")
    assert "vmap {" in text and "ct state { new }" in text and 'log prefix "x: "' in text
    assert "tcp dport { 22, 80 }" in text and text.count("table ip hf1") == 3
    with pytest.raises(HypafilterError, match="no nftables equivalent"):
        to_nft(build_plan(listing1()), "interval")


@pytest.mark.parametrize(
    "rule, nft",
    [
        ("-p icmp -m icmp ! --icmp-type 3/1 -j DROP", "icmp type . icmp code != { 3 . 1 } drop"),
        ("-p icmp -m icmp --icmp-type 3/1 -j DROP", "icmp type 3 icmp code 1 drop"),
        ("-p icmp -m icmp ! --icmp-type 8 -j DROP", "icmp type != 8 drop"),
        ("-p icmp -m icmp --icmp-type any -j DROP", "drop"),
        ("-p icmp -m icmp ! --icmp-type any -j DROP", "icmp type != 0-255 drop"),
    ],
)
def test_nft_icmp_types(rule, nft):
    """A negated type/code pair is one negated test of the pair; `any` is every ICMP packet, as in the kernel."""
    from hypafilter.iptables.document import parse_policy

    pol = parse_policy(f"*filter\n:FORWARD ACCEPT [0:0]\n-A FORWARD {rule}\nCOMMIT\n")
    full = to_nft(build_plan(pol), "full").split("chain HF1_FULL {\n")[1].split("\n\t}")[0]
    assert [ln.strip() for ln in full.splitlines()] == [f"meta l4proto icmp {nft}"]


def test_program_run_counts_rules():
    plan = build_plan(listing1(), mode="index")
    prog = build_program(plan, "full")
    verdict, count = prog.run(Header(dst=0x01020306, proto=17, dport=53), 0, lambda *a: False)
    assert (verdict, count) == ("ACCEPT", 6)


def _deep_policy(n=300):
    """n intervals; every third complex rule needs helper chains (a RETURN guard and a second level)."""
    from hypafilter.ir import Level, Rule

    rules = []
    for i in range(n):
        a, b = divmod(i, 250)
        dst = f"10.{a}.{b}.0/24"
        r = make_rule("DROP", dst=dst, proto="udp", complex=STRING)
        if i % 3 == 0:
            r = Rule(
                boxes=r.boxes,
                target="DROP",
                complex=(("-m", "conntrack", "--ctstate", "NEW"),),
                levels=(Level(("-d", dst)), Level(("-m", "conntrack", "--ctstate", "NEW"), unless=(("-p", "tcp"),))),
            )
        rules.append(r)
        rules.append(make_rule("ACCEPT" if i % 2 else "DROP", dst=dst, proto="udp", dport=(53, 53)))
    return make_policy(rules, "DROP")


def test_nesting_depth_is_bounded_for_hundreds_of_intervals():
    from hypafilter.analysis.program import MAX_DEPTH, NFT_MAX_DEPTH
    from hypafilter.ir.semantics import reference_verdict
    from hypafilter.netfilter.restore import chain_depth

    pol = _deep_policy()
    for mode in ("index", "selective", "exact"):
        plan = build_plan(pol, mode=mode)
        assert plan.num_intervals >= 300
        for s in STRATEGIES:
            if s == "hsa_cut" and mode == "index":
                continue
            depth, path = chain_depth(to_iptables_restore(plan, s))
            # + 1: the base chain's jump to MAIN; strategy tree's trees nest up to nf_tables' own limit (as optimize's)
            assert depth + 1 <= (NFT_MAX_DEPTH if s == "tree" else MAX_DEPTH), (mode, s, path)
            for i in range(0, 300, 37):
                h = Header(dst=0x0A000000 | (i // 250) << 16 | (i % 250) << 8 | 7, proto=17, dport=53 + i % 2)
                for ev in (lambda *a: False, lambda *a: True):
                    assert hybrid_verdict(plan, s, h, ev)[0] == reference_verdict(pol, h, ev), (mode, s, i)


def test_block_chains_write_each_complex_rule_once_and_count_jumps():
    from hypafilter.analysis.hybrid import hybrid_verdict as hv

    plan = build_plan(_deep_policy(), mode="index")
    text = to_iptables_restore(plan, "interval")
    n = text.count("--string X")
    assert 2 * 200 <= n <= 3 * 200  # FULL + at most a level-1 block and a segment (100 rules are conntrack ones)
    prog = build_program(plan, "interval")
    h = Header(dst=0x0A01000B, proto=17, dport=53)  # rule 250's group: many complex rules above it
    _, shunted, count = hv(plan, "interval", h)
    mi = match_index(plan, h)
    assert mi < len(plan.entries)
    assert shunted and count == prog.path_cost(mark_for(prog, int(plan.interval[mi]), int(plan.actions[mi])))
    assert count > len(plan.chains[int(plan.interval[mi])])  # block jumps are tested rules too


STATEFUL_MATCHES = ("limit", "hashlimit", "recent", "statistic", "quota", "connlimit")
RULESETS = Path(__file__).resolve().parents[2] / "rulesets"
REAL_CASES = [
    (p, chain)
    for p in sorted((RULESETS / "real").glob("*.rules"))
    for chain in ("FORWARD", "INPUT")
    if re.search(rf"^-A {chain} ", p.read_text().split("*filter\n", 1)[-1], re.M)
]


def _stateful_tail(toks) -> tuple[str, ...] | None:
    """A rule's tokens from its first match with per-rule state to the end, or None without one (the generated
    copy may spell the checks before it canonically, never the verbatim group and what follows)."""
    return next(
        (
            tuple(toks[i:])
            for i in range(len(toks) - 1)
            if toks[i] in ("-m", "--match") and toks[i + 1] in STATEFUL_MATCHES
        ),
        None,
    )


def assert_per_rule_state_loaded_once(policy, mode: str, prefix: str = "HF1_") -> int:
    """Every rule of `policy` with per-rule state (limit, recent, quota, ...; base chain or reachable user chain)
    stands exactly once in what each strategy loads: as many generated lines end with its stateful tail (a jump
    to a user chain renamed as the tool names its copy) as the policy has rules with that tail. Returns how many
    strategies compiled."""
    from hypafilter.analysis.program import user_chain_names
    from hypafilter.iptables.tokens import tokenize

    copies = user_chain_names(prefix, policy.user_chains)
    rules = [*policy.original_rules, *(toks for uc in policy.user_chains.values() for toks in uc.rules)]
    tails = (_stateful_tail(toks) for toks in rules)
    wanted = Counter(
        tuple(copies.get(x, x) if i and t[i - 1] in ("-j", "-g") else x for i, x in enumerate(t)) for t in tails if t
    )
    plan = build_plan(policy, mode=mode)
    compiled = 0
    for strategy in STRATEGIES:
        try:
            text = to_iptables_restore(plan, strategy, prefix)
        except HypafilterError:
            continue  # a pair refused by design (hsa_cut with index); test_real_rulesets counts them
        compiled += 1
        lines = [tuple(t.text for t in tokenize(ln))[2:] for ln in text.splitlines() if ln.startswith("-A ")]
        for key, n in wanted.items():
            hits = [ln for ln in lines if ln[len(ln) - len(key) :] == key]
            assert len(hits) == n, (policy.source, mode, strategy, key, hits)
    return compiled


@pytest.mark.parametrize("mode", MODES)
def test_rules_with_per_rule_state_are_loaded_once(mode):
    """limit, quota, recent, ... keep state per loaded rule: every such rule of rulesets/stateful.rules (each of
    the six matches, in the base chain and in a user chain jumped to twice) stands exactly once in what any
    strategy loads (the other chains jump to that copy)."""
    from hypafilter.iptables.document import parse_policy

    path = RULESETS / "stateful.rules"
    policy = parse_policy(path.read_text(), filename=str(path))
    tails = [t for t in map(_stateful_tail, [*policy.original_rules, *policy.user_chains["LOGDROP"].rules]) if t]
    assert len(tails) == 8 and {t[1] for t in tails} == set(STATEFUL_MATCHES)
    assert assert_per_rule_state_loaded_once(policy, mode) == len(STRATEGIES) - (mode == "index")


@pytest.mark.parametrize(("path", "chain"), REAL_CASES, ids=[f"{p.stem}-{c}" for p, c in REAL_CASES])
def test_real_rulesets_load_per_rule_state_once(path, chain):
    """The same over the dumps of real firewall tools (rulesets/real: ufw and shorewall rate-limit their logging
    with limit, ufw limits connections with recent), for every mode and strategy that compiles."""
    from hypafilter.config import Config
    from hypafilter.iptables.document import parse_policy

    policy = parse_policy(path.read_text(), str(path), chain, Config())
    compiled = sum(assert_per_rule_state_loaded_once(policy, mode) for mode in MODES)
    assert compiled == len(MODES) * len(STRATEGIES) - 1


def test_user_chains_of_any_legal_length_and_name():
    """Chain names of 25-28 characters (ufw, firewalld) and names of the tool's own chains (MAIN, K0, S0, ...)
    get copies that fit iptables' 28 characters and collide with nothing."""
    from hypafilter.analysis.program import MAX_CHAIN_NAME, user_chain_names
    from hypafilter.iptables.document import parse_policy

    from tests.irbuild import CHAIN_NAMES, chain_names_policy_text

    pol = parse_policy(chain_names_policy_text())
    assert set(pol.user_chains) == set(CHAIN_NAMES)
    for strategy in STRATEGIES:
        out = to_iptables_restore(build_plan(pol), strategy, prefix="HF65535_")
        declared = [ln[1:].split()[0] for ln in out.splitlines() if ln.startswith(":")]
        assert len(declared) == len(set(declared)) and max(map(len, declared)) <= MAX_CHAIN_NAME, declared
    copies = user_chain_names("HF65535_", CHAIN_NAMES)
    assert len(set(copies.values())) == len(CHAIN_NAMES) and all(len(c) <= MAX_CHAIN_NAME for c in copies.values())


def test_host_mode_main_accepts_the_decided_mark_first():
    """Host mode: MAIN's first rule sends the "decided ACCEPT" value (k = 0, action ACCEPT, under mask and shift)
    to DA, which gives back the shim's mark bits and accepts; every other value is dispatched as in bridge mode,
    whose chains are unchanged (no DA). The interpreter, iptables and nft texts agree."""
    from hypafilter.analysis.program import DECIDED_ACCEPT
    from hypafilter.ir.semantics import reference_verdict
    from hypafilter.shared import C

    assert DECIDED_ACCEPT == (C["HF_K_NONE"] << C["HF_MARK_K_SHIFT"]) | C["HF_ACTION_ACCEPT"] == 0x1
    pol = _many_intervals(12)
    for mode in ("index", "selective", "exact"):
        plan = build_plan(pol, mode=mode)
        for s in STRATEGIES:
            if s == "hsa_cut" and mode == "index":
                continue
            for mask, shift in ((0xFFFFFFFF, 0), (0x0FFFFFF0, 4)):
                bridge = build_program(plan, s, "HF3_", mask, shift)
                host = build_program(plan, s, "HF3_", mask, shift, nic_mode="host")
                assert "HF3_DA" not in bridge.chains
                first = host.chains["HF3_MAIN"][0]
                assert (first.kind, first.target, first.value, first.mask) == ("mark", "HF3_DA", 1 << shift, mask)
                assert [r.kind for r in host.chains["HF3_DA"]] == ["unmark", "always"]
                assert host.chains["HF3_DA"][-1].target == "ACCEPT"
                assert {n: c for n, c in host.chains.items() if n != "HF3_DA"}["HF3_MAIN"][1:] == bridge.chains[
                    "HF3_MAIN"
                ]
                foreign = 0xA0000005 & ~mask
                mark = mark_for(host, 0, 1, foreign)
                assert host.run(Header(dst=0x0A000107, proto=17, dport=53), mark, lambda *a: True)[0] == "ACCEPT"
                # bridge mode never sees the value; it would run the whole policy (k = 0), never a wrong leaf
                h = Header(dst=0x0A000207, proto=17, dport=9)
                assert bridge.run(h, mark, lambda *a: False)[0] == reference_verdict(pol, h, lambda *a: False)
            text = to_iptables_restore(plan, s, "HF3_", nic_mode="host")
            assert text.splitlines()[[ln.startswith("-A HF3_MAIN") for ln in text.splitlines()].index(True)] == (
                "-A HF3_MAIN -m mark --mark 0x1/0xffffffff -j HF3_DA"
            )
            assert "-A HF3_DA -j MARK --set-xmark 0x0/0xffffffff\n-A HF3_DA -j ACCEPT" in text
            assert "HF3_DA" not in to_iptables_restore(plan, s, "HF3_")
    ct = [("-m", "conntrack", "--ctstate", "NEW")]
    small = make_policy([make_rule("DROP", dst="10.0.0.0/24", complex=ct), make_rule("ACCEPT", proto="udp")], "DROP")
    for s in ("full", "interval"):
        nft = to_nft(build_plan(small), s, "HF3_", nic_mode="host")
        assert "meta mark & 0xffffffff vmap { 0x1 : jump HF3_DA" in nft
        assert "chain HF3_DA {\n\t\tmeta mark set meta mark & 0x0\n\t\taccept" in nft
    with pytest.raises(HypafilterError, match="NIC mode"):
        build_program(build_plan(pol), "full", nic_mode="switch")


def test_host_mode_hybrid_equals_the_policy():
    """The whole hybrid in host mode (hardware ACCEPT → decided mark → MAIN) gives the policy's verdict, and the
    hardware-accepted packets cost one mark test."""
    from hypafilter.ir.semantics import reference_verdict

    pol = _many_intervals(8)
    for mode in ("index", "selective", "exact"):
        plan = build_plan(pol, mode=mode)
        for s in ("full", "cut", "interval", "interval_geo"):
            for i in range(8):
                for dport in (53, 54):
                    h = Header(dst=0x0A000005 | i << 8, proto=17, dport=dport)
                    for ev in (lambda *a: False, lambda *a: True):
                        v, shunted, count = hybrid_verdict(plan, s, h, ev, nic_mode="host")
                        assert v == reference_verdict(pol, h, ev), (mode, s, i, dport)
                        if not shunted and v == "ACCEPT":
                            assert count == 1


def test_live_chains_never_name_an_operator_chain_or_copy_per_rule_state():
    """A deployment's chains (Plan.live) return to the operator's rules instead of jumping into the operator's
    chains or copying a rule with per-rule state: `iptables -X` of an operator chain and the kernel's one bucket of a
    limit stay the operator's. The same policy compiled for a file keeps its copies (FULL, renamed chains)."""
    from hypafilter.config import Config
    from hypafilter.iptables.document import parse_policy

    text = (
        "*filter\n:FORWARD DROP [0:0]\n:LIM - [0:0]\n"
        "-A FORWARD -p udp --dport 53 -j LIM\n"
        "-A FORWARD -p tcp --dport 22 -m limit --limit 3/sec -j ACCEPT\n"
        "-A FORWARD -p udp -j ACCEPT\n-A FORWARD -p tcp -j DROP\n"
        "-A LIM -m limit --limit 1/hour -j LOG\n-A LIM -j DROP\nCOMMIT\n"
    )
    pol = parse_policy(text, "lim.rules", config=Config())
    for mode in ("index", "selective", "exact"):
        for strategy in STRATEGIES:
            if strategy == "hsa_cut" and mode == "index":
                continue
            live = to_iptables_restore(build_plan(pol, mode=mode, strategy=strategy, live=True), strategy, "HF3_")
            body = [ln for ln in live.splitlines() if ln.startswith("-A ")]
            assert not any(re.search(r"-[jg] LIM\b", ln) for ln in body), (mode, strategy, body)
            assert not any("--limit" in ln for ln in body), (mode, strategy, body)
            filed = to_iptables_restore(build_plan(pol, mode=mode, strategy=strategy), strategy, "HF3_")
            assert "--limit 3/sec" in filed and "HF3_U0_LIM" in filed
