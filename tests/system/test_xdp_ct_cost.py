"""The XDP program's per-frame cost on established flows (`bench rate --established`'s `xdp_prog`): the measure's
BPF_PROG_TEST_RUN frames must be conntrack hits decided in XDP, the entries being the kernel's own (created with
`conntrack` in the test run's namespace, looked up there by bpf_xdp_ct_lookup); without the entries the same frames
must be shunted to conntrack (miss forcing), so the check can fail."""

from __future__ import annotations

import collections
import random

import pytest

from conftest import need_root, need_tool
from tests.system.test_xdp import veth_namespace

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


NS = "xct-run"
PORTS = ("x0", "x1")
WIRE = (0x01, 0x04)  # one-hot src_port of iport 0 and 1
LATE_CT = """*filter
:FORWARD DROP [0:0]
-A FORWARD -s 10.0.0.0/8 -p tcp -m tcp --dport 22 -j DROP
-A FORWARD -p udp -m udp --dport 53 -j ACCEPT
-A FORWARD -m conntrack --ctstate ESTABLISHED -j ACCEPT
-A FORWARD -p tcp -m tcp --dport 80 -j ACCEPT
COMMIT
"""


@pytest.fixture
def ct_ns():
    with veth_namespace(NS, PORTS, ("conntrack", "sysctl")) as name:
        yield name


@pytest.mark.parametrize("name", ("ct-first", "late-ct", "fuzz-2", "fuzz-4"))
def test_established_decisions(ct_ns, shared_dir, name):
    """Frames of connections conntrack holds as established, half of them in the reply direction: the program
    (its conntrack lookup in this namespace, the address searches skipped where its shortcut applies) decides each
    as hw.model does with ct 1 (original) or 2 (reply), match_index included; the ct-first policy's frames all take
    the shortcut (its conntrack box restricts no address), late-ct's boxes before its conntrack rule do not."""
    from hypafilter.analysis.plan import build_plan
    from hypafilter.config import Config
    from hypafilter.hw import model
    from hypafilter.iptables.document import parse_policy
    from hypafilter.ops.verify import FrameGen, build_frame
    from hypafilter.targets.xdp.run import XDP_DROP, XDP_PASS, XDP_REDIRECT, run_frames
    from hypafilter.targets.xdp.target import read_ct_config
    from hypafilter.tools.bench.ctflows import open_flows
    from hypafilter.tools.classbench import classbench_policy_text
    from hypafilter.tools.fuzz import random_policy

    if name == "ct-first":
        lines = classbench_policy_text(shared_dir / "data" / "classbench" / "acl1_1100.filters", policy="DROP")
        lines = lines.splitlines(keepends=True)
        at = next(i for i, ln in enumerate(lines) if ln.startswith(("-A ", "COMMIT")))
        lines.insert(at, "-A FORWARD -m conntrack --ctstate ESTABLISHED,RELATED -j ACCEPT\n")
        text = "".join(lines)
    elif name == "late-ct":
        text = LATE_CT
    else:
        text = random_policy(int(name[5:]), conntrack=True)
    policy = parse_policy(text, name, base_chain="FORWARD")
    rng = random.Random(name)
    gen = FrameGen(policy, rng)
    frames, flows, cts = [], set(), []
    while len(frames) < 400:
        h = gen.header()
        if h["proto"] not in (6, 17):
            continue
        h["flags"] = rng.choice((0x10, 0x18))
        reply = rng.random() < 0.5
        key = (h["proto"], h["src"], h["dst"], h["sport"], h["dport"])
        flow = (h["proto"], h["dst"], h["src"], h["dport"], h["sport"]) if reply else key
        rev = (key[0], key[2], key[1], key[4], key[3])
        if flow in flows or (flow != key and key in flows) or (flow == key and rev in flows) or h["src"] == h["dst"]:
            continue  # one entry per connection, its direction as drawn
        flows.add(flow)
        frames.append((rng.randint(0, 1), build_frame(len(frames) + 1, h, b"")))
        cts.append(2 if reply else 1)
    open_flows(ct_ns, sorted(flows))
    ct = read_ct_config(ct_ns)
    assert ct.lookup
    tally = collections.Counter()
    for mode in ("index", "selective"):
        plan = build_plan(policy, Config(shunt_mode=mode))
        regs = model.Regs.from_plan(plan, unfilterable="drop", nic_mode="bridge")
        res = run_frames(plan, frames, PORTS, ns=ct_ns, control=regs.control, ct=ct)
        bad = []
        for (iport, f), c, v in zip(frames, cts, res.verdicts, strict=True):
            d = model.decide(plan, f, WIRE[iport], regs, ct=c)
            want = {model.Kind.DROP: XDP_DROP, model.Kind.FORWARD: XDP_REDIRECT}.get(d.kind, XDP_PASS)
            if (v.retval, v.meta & 0xFFFFFF) != (want, d.match_index):
                bad.append((f.hex(), c, d, v))
            tally[(d.kind.name, c)] += 1
        assert not bad, f"{name}/{mode}: {len(bad)} of {len(frames)} frames differ from hw.model, first: {bad[:3]}"
        assert "CNT_SHUNT_STATE" not in {k for k, x in res.counters.items() if x}, res.counters  # all were hits
    if name in ("ct-first", "late-ct"):
        assert tally[("FORWARD", 1)] > 0 and tally[("FORWARD", 2)] > 0, tally
    if name == "ct-first":
        assert set(tally) <= {("FORWARD", 1), ("FORWARD", 2)}, tally
    print(name, dict(tally))
