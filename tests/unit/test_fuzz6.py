"""The fuzzer's IPv6 policies (tools/fuzz.py random_policy6): the same text from the same seed, read by the IPv6
front end, no rule shadowed by an earlier one, none unconditional, and every IPv6 feature drawn over a few seeds
(tests/system/test_fuzz.py loads them into ip6tables and runs them against the kernel)."""

from __future__ import annotations

import shlex

from hypafilter.config import Config
from hypafilter.iptables.document import parse_policy
from hypafilter.tools.fuzz import FEATURES6, random_policy, random_policy6, shadowed_lines6

SEEDS = range(1, 25)


def test_same_seed_same_policy_and_not_the_ipv4_one():
    assert random_policy6(3) == random_policy6(3) != random_policy6(4)
    assert random_policy6(3, conntrack=True) != random_policy6(3, conntrack=False)
    assert "-m icmp " not in random_policy6(3) and random_policy6(3) != random_policy(3)


def test_policies_read_as_ipv6_none_shadowed_none_unconditional():
    for seed in SEEDS:
        text = random_policy6(seed)
        pol = parse_policy(text, filename=f"s{seed}", base_chain="FORWARD", config=Config(), family=6)
        assert pol.family == 6 and pol.rules, seed
        assert not shadowed_lines6(text), (seed, text)
        for ln in text.splitlines():
            if not ln.startswith("-A "):
                continue
            toks = shlex.split(ln)[2:]
            target = toks.index("-j") if "-j" in toks else toks.index("-g") if "-g" in toks else len(toks)
            checks = toks[:target]
            assert checks and checks != ["-p", "0"], f"seed {seed}: a rule that tests nothing: {ln}"


def test_every_ipv6_feature_drawn():
    texts = [random_policy6(s, conntrack=s % 2 == 0) for s in SEEDS]
    missing = [f for f, needle in FEATURES6.items() if not any(needle in t for t in texts)]
    assert not missing, missing
    assert any("-m conntrack" in t for t in texts) and any("-m conntrack" not in t for t in texts)
