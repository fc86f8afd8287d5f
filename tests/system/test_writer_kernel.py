"""System test: text written by the one iptables writer reaches the kernel with every string unchanged.

A policy whose `-m string --string` arguments hold a backslash, double and single quotes, `#` and spaces is loaded
into a scratch network namespace twice over: as the original policy alone (`policy_restore`, what the kernel oracle
loads) and as each strategy's hybrid chains (`to_iptables_restore`). `iptables-save` then lists what the kernel
holds, and each `--string` argument must be the policy's own, the backslash included.
"""

from __future__ import annotations

import pytest
from hypafilter.analysis.plan import build_plan
from hypafilter.analysis.program import STRATEGIES
from hypafilter.iptables.document import parse_policy
from hypafilter.iptables.tokens import tokenize
from hypafilter.iptables.writer import policy_restore
from hypafilter.netfilter.restore import to_iptables_restore

from conftest import ns_sh
from tests.scratchns import scratch_netns

pytestmark = pytest.mark.system

# As a user writes it (iptables-save quoting): the first rule is the one of the issue, `a\b` in the kernel.
POLICY = r"""*filter
:FORWARD DROP [0:0]
:STRINGS - [0:0]
-A FORWARD -m string --string "a\\b" --algo bm -j DROP
-A FORWARD -p udp -j STRINGS
-A FORWARD -s 10.0.0.0/8 -j ACCEPT
-A STRINGS -m string --string "say \"hi\"" --algo bm -j DROP
-A STRINGS -m string --string "it's" --algo kmp -j DROP
-A STRINGS -m string --string "#1 two  words" --algo bm -j DROP
-A STRINGS -m string --string "\\\"both\\\"" --algo bm -j DROP
-A STRINGS -m string --string 'q' --algo bm -j DROP
-A STRINGS -m string --string x\y#z --algo bm -j DROP
COMMIT
"""
# Outside double quotes iptables-restore takes `'` and `\` literally: the kernel holds `'q'` and `x\y#z`.
STRINGS = {"a\\b", 'say "hi"', "it's", "#1 two  words", '\\"both\\"', "'q'", "x\\y#z"}
MODES = ("index", "selective", "exact")


@pytest.fixture
def netns():
    with scratch_netns("hfwt", "iptables-restore", "iptables-save") as name:
        yield name


def kernel_args(ns: str, option: str, chain_prefix: str = "") -> dict[str, list[str]]:
    """The arguments of `option` in each rule the kernel lists (iptables-save), per chain whose name starts so."""
    out: dict[str, list[str]] = {}
    for line in ns_sh(ns, "iptables-save", "-t", "filter").splitlines():
        if not line.startswith(f"-A {chain_prefix}"):
            continue
        toks = [t.text for t in tokenize(line)]
        out.setdefault(toks[1], []).extend(toks[i + 1] for i, t in enumerate(toks[:-1]) if t == option)
    return out


def test_policy_strings_are_as_written():
    """The test's own premise: the parser reads the policy's strings as iptables-restore does."""
    pol = parse_policy(POLICY, base_chain="FORWARD")
    rules = [*pol.original_rules, *pol.user_chains["STRINGS"].rules]
    assert {r[r.index("--string") + 1] for r in rules if "--string" in r} == STRINGS


def test_oracle_policy_keeps_strings(netns):
    pol = parse_policy(POLICY, base_chain="FORWARD")
    ns_sh(netns, "iptables-restore", stdin=policy_restore(pol))
    got = kernel_args(netns, "--string")
    assert got == {
        "FORWARD": ["a\\b"],
        "STRINGS": ['say "hi"', "it's", "#1 two  words", '\\"both\\"', "'q'", "x\\y#z"],
    }


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_hybrid_chains_keep_strings(netns, strategy):
    pol = parse_policy(POLICY, base_chain="FORWARD")
    for n, mode in enumerate(MODES):
        if strategy == "hsa_cut" and mode == "index":
            continue  # refused by the compiler: HSA cut is exact only with selective/exact shunting
        prefix = f"W{n}_"
        text = to_iptables_restore(
            build_plan(pol, mode=mode, strategy=strategy), strategy, prefix, mark_mask=0x0FFFFFF0, mark_shift=4
        )
        ns_sh(netns, "iptables-restore", "--noflush", stdin=text)
        got = kernel_args(netns, "--string", prefix)
        strings = {s for args in got.values() for s in args}
        assert strings == STRINGS, f"{strategy}/{mode}: the kernel holds {sorted(strings)}"


def test_saved_comment_with_single_quote_reads_back(netns):
    """iptables-save writes a comment's `'` as `\\'` (xtables_save_string); reading the listing back must undo it."""
    ns_sh(netns, "iptables-restore", stdin='*filter\n-A FORWARD -m comment --comment "it\'s" -j DROP\nCOMMIT\n')
    assert kernel_args(netns, "--comment") == {"FORWARD": ["it's"]}
