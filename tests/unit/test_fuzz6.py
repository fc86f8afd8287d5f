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


def test_conntrack_policies_treat_both_lab_paths_alike():
    """Policies that get real connections (conntrack) must decide the hybrid path's and the plain path's addresses
    alike (fd48:4600::/64, fd48:4601::/64: they differ in the second group): every address match holds both or
    neither, else the connection checks compare two different policies."""
    import ipaddress

    paths = [ipaddress.ip_network(n) for n in ("fd48:4600::/64", "fd48:4601::/64")]
    for seed in SEEDS:
        for ln in random_policy6(seed, conntrack=True).splitlines():
            toks = shlex.split(ln)
            for i, t in enumerate(toks[:-1]):
                if t in ("-s", "-d"):
                    net = ipaddress.ip_network(toks[i + 1])
                    held = [p.subnet_of(net) for p in paths]
                    touched = [p.overlaps(net) for p in paths]
                elif t in ("--src-range", "--dst-range"):
                    lo, hi = (ipaddress.ip_address(a) for a in toks[i + 1].split("-"))
                    held = [lo <= p[0] and p[-1] <= hi for p in paths]
                    touched = [not (hi < p[0] or lo > p[-1]) for p in paths]
                else:
                    continue
                assert held in ([True, True], [False, False]) and touched in ([True, True], [False, False]), (
                    f"seed {seed}: {ln}"
                )
