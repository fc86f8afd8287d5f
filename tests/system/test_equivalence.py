"""Kernel as oracle: every example policy, strategies, user chains and ClassBench-derived policies give the hybrid
path exactly the verdicts of the original policy alone (hypafilter.ops.verify, in a lab of this module's own)."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import ROOT, TEST_FULL

pytestmark = pytest.mark.system

LAB = "hfe"
RULESETS = sorted((ROOT / "rulesets").glob("*.rules"))
# Rulesets whose verdicts depend on more than the frame (token buckets, quotas, recent lists): verify refuses
# them; test_exactness.py checks them (each stateful rule loaded once, equal deliveries on both paths).
NOT_FRAME_BY_FRAME = {"stateful"}
VERIFIED = [p for p in RULESETS if p.stem not in NOT_FRAME_BY_FRAME]
# ClassBench: the first CB_RULES rules of acl1_1100 for the sweep over K complex rules (one emulator build each), and
# the whole set once (test_classbench_whole_set: one cold build of 1,100 entries, about 2 minutes here).
CB_RULES = 60


def check(policy, packets: int = 800, trace=None, cover: bool = False, **cfg) -> dict:
    from hypafilter.config import Config
    from hypafilter.ops.verify import verify

    config = Config(**cfg)
    r = verify(policy, config, packets=packets, trace=trace, seed=11, cover=cover)
    assert r["mismatches"] == 0, f"{r['mismatches']} mismatches, e.g. {r['examples'][:3]}"
    # every frame the NIC tagged for the host: the shunted ones and the mirror copies (LOG/NFLOG rules)
    nic = r["nic"]
    assert r["packets"] == packets
    assert r["shim"]["tagged"] == r["shunted"] + nic.get("CNT_SHUNT_FORCED", 0) + nic.get("CNT_MIRROR", 0)
    assert r["observers"]["mismatches"] == 0, r["observers"]["examples"]
    return r


def parse_file(path: Path, **cfg):
    from hypafilter.config import Config
    from hypafilter.iptables.document import parse_policy

    return parse_policy(path.read_text(), filename=str(path), base_chain="FORWARD", config=Config(**cfg))


def test_rulesets_present():
    from hypafilter.errors import HypafilterError
    from hypafilter.ops.verify import refuse_nondeterministic

    assert VERIFIED, "rulesets/*.rules is empty"
    assert NOT_FRAME_BY_FRAME <= {p.stem for p in RULESETS}
    for path in RULESETS:  # the split above is exactly what verify accepts
        try:
            refuse_nondeterministic(parse_file(path))
            refused = False
        except HypafilterError:
            refused = True
        assert refused == (path.stem in NOT_FRAME_BY_FRAME), path


@pytest.mark.parametrize("path", VERIFIED, ids=[p.stem for p in VERIFIED])
def test_ruleset(lab, path):
    check(parse_file(path))


@pytest.mark.parametrize("strategy", ["full", "cut"])
def test_strategies_rewrite_in_place(lab, strategy):
    """Another strategy for the same policy keeps the hardware (registers rewritten, no new NIC)."""
    from hypafilter.config import Config
    from hypafilter.ops import deploy

    path = ROOT / "rulesets" / "example.rules"
    pol = parse_file(path)
    deploy.deploy(pol, Config())
    nic_before = deploy.read_state()["nic"]
    st = deploy.deploy(pol, Config(strategy=strategy))
    assert st["strategy"] == strategy and st["nic"] == nic_before
    assert not st["history"][-1]["replaced_nic"]
    check(pol, strategy=strategy)


def test_user_chains(lab, tmp_path):
    f = tmp_path / "uc.rules"
    f.write_text(
        "*filter\n:FORWARD ACCEPT [0:0]\n:WEB - [0:0]\n:GUARD - [0:0]\n"
        "-A FORWARD -p tcp -j WEB\n-A FORWARD -p udp -m udp --dport 53 -j GUARD\n-A FORWARD -p icmp -j DROP\n"
        "-A WEB -s 10.0.0.0/8 -j RETURN\n-A WEB -p tcp -m tcp --dport 80 -j ACCEPT\n"
        "-A WEB -p tcp -m tcp --dport 443 -m string --string BAD --algo bm -j DROP\n-A WEB -j DROP\n"
        "-A GUARD -m string --string BAD --algo kmp -j DROP\n-A GUARD -j ACCEPT\nCOMMIT\n"
    )
    check(parse_file(f))


@pytest.mark.slow
@pytest.mark.parametrize("k", [0, 1, 10, 50])
def test_classbench(lab, shared_dir, tmp_path, k):
    from hypafilter.config import Config
    from hypafilter.iptables.document import parse_policy
    from hypafilter.tools.classbench import classbench_policy_text

    src = shared_dir / "data" / "classbench" / "acl1_1100.filters"
    sub = tmp_path / f"acl1_{CB_RULES}.filters"
    sub.write_text("".join(src.read_text().splitlines(keepends=True)[:CB_RULES]))
    text = classbench_policy_text(sub, complex_rules=k, policy="DROP", actions="alternate", deterministic=True)
    pol = parse_policy(text, filename=str(sub), base_chain="FORWARD", config=Config())
    assert len(pol.complex_indices) == k
    r = check(pol, packets=1000)
    assert r["delivered_oracle"] > 0


# (also alone: `make test-equivalence-whole`) test_classbench runs a ClassBench core with complex rules among them
@TEST_FULL  # make test-full
@pytest.mark.slow
def test_classbench_whole_set(lab, shared_dir):
    """The whole acl1_1100 set on the emulated NIC with every rule in hardware (the `bench rate` set: DROP policy,
    actions alternating): both corners of every rule's ranges (verify --cover), then headers from its ClassBench
    trace, get the verdicts of the policy alone in the kernel. Complex rules among ClassBench rules:
    test_classbench. The corners caught Verilator 5.006's DFG pass building entry 1064 of this core as never
    matching (driver/emu/Makefile: -fno-dfg)."""
    from hypafilter.config import Config
    from hypafilter.iptables.document import parse_policy
    from hypafilter.tools.classbench import classbench_policy_text

    src = shared_dir / "data" / "classbench" / "acl1_1100.filters"
    text = classbench_policy_text(src, policy="DROP", actions="alternate")
    pol = parse_policy(text, filename=str(src), base_chain="FORWARD", config=Config())
    assert len(pol.rules) >= 1000 and not pol.complex_indices
    corners = 2 * sum(len(r.boxes) for r in pol.rules)
    r = check(pol, packets=corners + 1000, trace=src.with_name("acl1_1100_trace.gz"), cover=True)
    print(f"acl1_1100 whole set: {r['packets']} frames ({corners} corners), hw share {r['hw_share']}, 0 mismatches")
    assert r["delivered_oracle"] > 0 and r["nic"]["PKTIN"] >= r["packets"]


def test_truncated_l4_headers(lab, tmp_path):
    from hypafilter.config import Config
    from hypafilter.ops.verify import verify

    f = tmp_path / "l4.rules"
    f.write_text(
        "*filter\n:FORWARD DROP [0:0]\n-A FORWARD -p icmp -j ACCEPT\n-A FORWARD -p udp -m udp --dport 0:65535 -j ACCEPT\n"
        "-A FORWARD -p tcp -m tcp --dport 0:65535 -j ACCEPT\n-A FORWARD -p tcp -m string --string BAD --algo bm -j DROP\n"
        "COMMIT\n"
    )
    r = verify(parse_file(f), Config(), packets=300, seed=5, malformed=1.0, kinds=("truncated_l4",))
    assert r["mismatches"] == 0, f"{r['mismatches']} of 300 truncated-L4 frames differ, e.g. {r['examples'][:2]}"
