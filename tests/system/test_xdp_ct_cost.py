"""The XDP program's per-frame cost on established flows (`bench rate --established`'s `xdp_prog`): the measure's
BPF_PROG_TEST_RUN frames must be conntrack hits decided in XDP, the entries being the kernel's own (created with
`conntrack` in the test run's namespace, looked up there by bpf_xdp_ct_lookup); without the entries the same frames
must be shunted to conntrack (miss forcing), so the check can fail."""

from __future__ import annotations

import random

import pytest

from conftest import need_root, need_tool

pytestmark = pytest.mark.system

FRAMES, REPEAT = 300, 3


@pytest.fixture
def established(shared_dir):
    need_root()
    need_tool("ip", "clang", "cc", "make", "conntrack", "sysctl")
    from hypafilter.analysis.plan import build_plan
    from hypafilter.config import Config
    from hypafilter.iptables.document import parse_policy
    from hypafilter.tools.bench.rate import established_probes
    from hypafilter.tools.classbench import classbench_policy_text

    src = shared_dir / "data" / "classbench" / "acl1_1100.filters"
    text = classbench_policy_text(src, policy="DROP")
    lines = text.splitlines(keepends=True)
    at = next(i for i, ln in enumerate(lines) if ln.startswith(("-A ", "COMMIT")))
    lines.insert(at, "-A FORWARD -m conntrack --ctstate ESTABLISHED,RELATED -j ACCEPT\n")
    cfg = Config()
    policy = parse_policy("".join(lines), "ct-first", base_chain="FORWARD", config=cfg)
    plan = build_plan(policy, cfg)
    assert plan.miss_shunt[0], "a conntrack-first policy forces misses of its ACCEPT to conntrack"
    trace = str(shared_dir / "data" / "classbench" / "acl1_1100_trace.gz")
    probes, flows = established_probes(policy, trace, FRAMES, 1)
    assert {f[0] for f in flows} == {6, 17}, "TCP and UDP flows both"
    return cfg, policy, plan, [p.frame for p in probes], flows


def _cost(cfg, policy, plan, frames, flows):
    from hypafilter.targets.xdp.target import control_of
    from hypafilter.tools.bench.xdpcost import xdp_cost

    control = control_of(cfg.unfilterable, cfg.nic_mode, plan.miss_shunt)
    return xdp_cost(plan, policy, frames=FRAMES, repeat=REPEAT, frame_list=frames, flows=flows, control=control)


def test_established_frames_hit(established):
    """Every run of every frame: looked up, found ESTABLISHED (ct 1/2), accepted and forwarded in XDP."""
    cfg, policy, plan, frames, flows = established
    c = _cost(cfg, policy, plan, frames, flows)
    runs = FRAMES * REPEAT
    assert c["established_flows"] == len(flows) and c["frames"] == FRAMES and c["ns_mean"] > 0
    assert c["counters"] == {"PKTIN": runs, "PKTOUT": runs, "CNT_FORWARDED": runs}, c["counters"]


def test_without_entries_frames_miss(established):
    """The same frames with conntrack's table empty: ct 0, none accepted in XDP (the conntrack rule cannot match;
    the rules behind it shunt them or leave them to the chain's policy)."""
    cfg, policy, plan, frames, _ = established
    c = _cost(cfg, policy, plan, frames, [])
    runs = FRAMES * REPEAT
    assert c["counters"]["PKTIN"] == runs and "CNT_FORWARDED" not in c["counters"], c["counters"]
