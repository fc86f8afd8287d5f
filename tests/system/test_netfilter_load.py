"""System tests: every strategy's netfilter output loads into a fresh network namespace with the real kernel,
and afterwards only the tool's chains differ (iptables-restore --noflush, nft -f)."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
from hypafilter.analysis.plan import build_plan
from hypafilter.analysis.program import STRATEGIES
from hypafilter.config import Config
from hypafilter.errors import HypafilterError
from hypafilter.iptables.document import parse_policy
from hypafilter.netfilter.nft import to_nft
from hypafilter.netfilter.restore import to_iptables_restore
from hypafilter.tools.classbench import classbench_policy_text

from conftest import full_beyond, ns_sh
from tests.irbuild import listing1
from tests.scratchns import scratch_netns

pytestmark = pytest.mark.system
RULESETS = Path(__file__).resolve().parents[2] / "rulesets"


@pytest.fixture
def netns():
    with scratch_netns("hft", "iptables-restore", "iptables-save", "nft") as name:
        # Something of the site's own that must survive: a user chain and a rule in FORWARD jumping to it.
        ns_sh(
            name,
            "iptables-restore",
            "--noflush",
            stdin="*filter\n:SITE - [0:0]\n-A FORWARD -p tcp --dport 2222 -j SITE\n-A SITE -j ACCEPT\nCOMMIT\n",
        )
        yield name


def _policies():
    yield "listing1", listing1()
    cfg = Config()
    for f in sorted(RULESETS.glob("*.rules")):
        try:
            yield f.name, parse_policy(f.read_text(), str(f), "FORWARD", cfg)
        except HypafilterError as e:  # a ruleset meant to be rejected is not this test's subject
            if "error" in f.name or "bad" in f.name:
                continue
            raise AssertionError(f"{f}: {e}") from e


def _classbench(shared: Path, deterministic: bool):
    f = shared / "data" / "classbench" / "acl1_1100.filters"
    text = classbench_policy_text(f, complex_rules=40, actions="alternate", deterministic=deterministic)
    return parse_policy(text, str(f), "FORWARD", Config())


def _tool_lines(save: str, prefixes) -> tuple[list[str], list[str]]:
    """iptables-save lines split into (the tool's, everything else), counters and comments dropped."""
    mine, other = [], []
    for ln in save.splitlines():
        if ln.startswith("#"):
            continue
        ln = ln.split(" [")[0] if ln.startswith(":") else ln
        (mine if any(p in ln for p in prefixes) else other).append(ln)
    return mine, other


def _load_all(ns: str, policy) -> None:
    before = ns_sh(ns, "iptables-save", "-t", "filter")
    prefixes = []
    loaded = 0
    for n, (mode, strategy) in enumerate(itertools.product(("index", "selective", "exact"), STRATEGIES)):
        if strategy == "hsa_cut" and mode == "index":
            continue
        plan = build_plan(policy, mode=mode, strategy=strategy)  # log mirroring depends on the strategy
        prefix = f"T{n}_"
        prefixes.append(prefix)
        text = to_iptables_restore(plan, strategy, prefix, mark_mask=0x0FFFFFF0, mark_shift=4)
        ns_sh(ns, "iptables-restore", "--noflush", stdin=text)
        ns_sh(ns, "iptables-restore", "--noflush", stdin=text)  # reloading replaces, never duplicates
        loaded += 1
        want = sorted(ln for ln in text.splitlines() if ln.startswith("-A "))
        got = sorted(
            ln for ln in ns_sh(ns, "iptables-save", "-t", "filter").splitlines() if ln.startswith(f"-A {prefix}")
        )
        assert len(got) == len(want), (mode, strategy)
        try:
            nft_text = to_nft(plan, strategy, prefix, mark_mask=0x0FFFFFF0, mark_shift=4)
        except HypafilterError as e:
            assert "nftables" in str(e)  # only the documented refusal is allowed
        else:
            ns_sh(ns, "nft", "-f", "-", stdin=nft_text)
            ns_sh(ns, "nft", "-f", "-", stdin=nft_text)
            assert f"chain {prefix}MAIN" in ns_sh(ns, "nft", "list", "table", "ip", prefix.rstrip("_").lower())
    after = ns_sh(ns, "iptables-save", "-t", "filter")
    _, other_before = _tool_lines(before, prefixes)
    mine, other_after = _tool_lines(after, prefixes)
    assert other_after == other_before  # nothing outside the tool's chains changed
    assert mine and loaded >= 14


@pytest.mark.parametrize("name", [n for n, _ in _policies()])
def test_rulesets_load(netns, name):
    _load_all(netns, dict(_policies())[name])


@pytest.mark.parametrize("deterministic", full_beyond([False, True]))  # the deterministic import: make test-full
def test_classbench_policy_loads(netns, shared_dir, deterministic):
    _load_all(netns, _classbench(shared_dir, deterministic))


@pytest.mark.parametrize("strategy", ["interval", "interval_geo"])
def test_classbench_k50_index_mode_loads_under_forward(netns, shared_dir, strategy):
    """acl1_1100 with 50 complex rules in index mode nested 55 chains deep before the block hierarchy (nf_tables
    allows 16 and answers "Too many links"); reached from FORWARD, so the kernel validates the whole depth."""
    f = shared_dir / "data" / "classbench" / "acl1_1100.filters"
    pol = parse_policy(classbench_policy_text(f, complex_rules=50), str(f), "FORWARD", Config())
    plan = build_plan(pol, mode="index", strategy=strategy)
    assert plan.num_intervals >= 50
    text = to_iptables_restore(plan, strategy, "HF9_", mark_mask=0x0FFFFFF0, mark_shift=4)
    ns_sh(netns, "iptables-restore", "--noflush", stdin=text)
    ns_sh(netns, "iptables", "-A", "FORWARD", "-j", "HF9_MAIN")
    saved = ns_sh(netns, "iptables-save", "-t", "filter")
    assert "-A FORWARD -j HF9_MAIN" in saved
    assert sum(ln.startswith("-A HF9_") for ln in saved.splitlines()) == text.count("\n-A ")
