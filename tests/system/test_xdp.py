"""System test of the XDP fast path: the loaded program (BPF_PROG_TEST_RUN, not attached) against hw.model.decide,
frame by frame: (XDP action, match_index, reason, mark value), and the counters against hw.model.Counters.

Frames: ClassBench traces and the policy-biased headers of verify's FrameGen, with every adversarial frame kind of
the fuzzer (verify.FRAME_KINDS). Policies: ClassBench sets with complex rules (shunt bits, several intervals) and
the fuzzer's random policies (prefixes, ranges, multiport, negations, ICMP, TCP flags, interfaces) in every shunt
mode. One 10,000-entry set runs every time, all three with HF_XDP_LARGE=1 (about a minute each).
"""

from __future__ import annotations

import collections
import contextlib
import os
import random
from collections.abc import Iterator

import pytest
from hypafilter import netns
from hypafilter.hw.model import Kind

from conftest import need_root, need_tool

pytestmark = pytest.mark.system

NS = "exdp-run"
PORTS = ("p0", "p1")
WIRE = (0x01, 0x04)  # one-hot src_port of iport 0 and 1


@contextlib.contextmanager
def veth_namespace(name: str, ports: tuple[str, str] = PORTS, tools: tuple[str, ...] = ()) -> Iterator[str]:
    """Namespace `name` (made afresh) holding a veth pair `ports`, both up, for a program on two ports without a
    lab; deleted after, also when the body raises. Skipped (CI: failed) without root or the tools that build the
    program and `tools`."""
    need_root()
    need_tool("ip", "clang", "make", "cc", *tools)
    netns.delete(name)
    netns.add(name)
    try:
        netns.run(["ip", "-n", name, "link", "add", ports[0], "type", "veth", "peer", "name", ports[1]])
        for p in ports:
            netns.run(["ip", "-n", name, "link", "set", p, "up"])
        yield name
    finally:
        netns.delete(name)


@pytest.fixture(scope="module")
def ns():
    with veth_namespace(NS) as name:
        yield name


def frames_for(policy, rng: random.Random, count: int, trace=None, malformed: float = 0.3):
    from hypafilter.ops.verify import FRAME_KINDS, FrameGen, build_frame, malform, read_trace

    gen = FrameGen(policy, rng)
    rows = read_trace(trace, count, rng) if trace else None
    out = []
    kinds = list(FRAME_KINDS)
    for uid in range(1, count + 1):
        h = rows[(uid - 1) % len(rows)] if rows else gen.header()
        f = build_frame(uid, h, gen.payload())
        if rng.random() < malformed:
            f = malform(kinds[uid % len(kinds)], f, rng)  # every kind, in turn
        if len(f) >= 14:  # BPF_PROG_TEST_RUN takes no frame shorter than an Ethernet header
            out.append((rng.randint(0, 1), f))
    return out


MIRROR = Kind.MIRROR
MIRROR_NAME = MIRROR.name


def ifindexes(ns) -> dict[str, int]:
    import json

    return {x["ifname"]: x["ifindex"] for x in json.loads(netns.run(["ip", "-n", ns, "-j", "link", "show"]))}


def check(
    plan, frames, ns, nic_mode="bridge", unfilterable="drop", shunt_all=False, ct=None, shape=None, pin=None, none=None
) -> collections.Counter:
    """Run the frames and compare each with the model; returns the tally of (kind, reason). `ct`: the program's
    conntrack lookup (targets.xdp.tables.CtConfig); this namespace's conntrack holds no connection, so ct stays 0,
    or is 3 for the frames the program looks up when it has HFX_CT_NONE (`ct.none`, or `none` for a started program
    given by `pin`: model.miss_ct).
    `plan` may be an analysis.overlay.View (the static entries' program with its update buffer): match_index is then
    the hardware index (slots n + 1 + b), hits are counted for every row. `shape`: a larger program than the
    plan's; `pin`: run through that started program as its maps are instead (its counters from before are
    subtracted).
    Mirror decisions (reason 4): the value (k << 4) | 0x4 | action and, for a bridge's ACCEPT, the paired port's
    ifindex for the shim's TC program to clone the frame to; every other frame carries no port."""
    from hypafilter.hw import model
    from hypafilter.targets.xdp.run import XDP_DROP, XDP_PASS, XDP_REDIRECT, run_frames

    regs = model.Regs.from_plan(plan, unfilterable=unfilterable, nic_mode=nic_mode)
    regs.generation = 7
    if shunt_all:
        regs.control |= model.CONTROL_SHUNT_ALL
    if pin is None:
        res = run_frames(plan, frames, PORTS, ns=ns, control=regs.control, generation=7, ct=ct, shape=shape)
        before = {}
    else:
        from hypafilter.targets.xdp.run import run_pinned

        before = run_pinned(pin, [], ns=ns).counters
        res = run_pinned(pin, frames, ns=ns)
    assert len(res.verdicts) == len(frames)
    rows = len(plan.shunt)  # n + 1, or n + 1 + depth for a View
    counters = model.Counters(rows - 1)
    tally: collections.Counter = collections.Counter()
    bad = []
    ifx = ifindexes(ns)
    if none is None:
        none = bool(ct is not None and ct.lookup and ct.none)
    for (iport, f), v in zip(frames, res.verdicts, strict=True):
        d = model.decide(plan, f, WIRE[iport], regs, ct=model.miss_ct(f, WIRE[iport]) if none else 0)
        counters.add(d, WIRE[iport])
        want = {model.Kind.DROP: XDP_DROP, model.Kind.SHUNT: XDP_PASS, MIRROR: XDP_PASS}.get(d.kind)
        if d.kind == model.Kind.FORWARD:
            want = XDP_PASS if nic_mode == "host" else XDP_REDIRECT
        index = v.meta & 0xFFFFFF
        reason = (v.meta >> 28) & 0xF
        peer = 0
        if d.kind == MIRROR:
            k = int(plan.interval[d.match_index])
            value = (k << 4) | 0x4 | d.action if k else 0
            if k and d.action == model.ACTION_ACCEPT and nic_mode != "host":
                peer = ifx[PORTS[iport ^ 1]]
        elif d.kind == model.Kind.SHUNT and d.reason != model.REASON_UNPARSED:
            k = int(plan.interval[d.match_index])
            value = (k << 4) | d.action if k else 0
        elif d.kind == model.Kind.FORWARD and nic_mode == "host":
            value = 0x1
        elif d.kind == model.Kind.FORWARD:
            value = (int(plan.interval[d.match_index]) << 4) | d.action  # used only if the redirect fails
        else:
            value = 0
        got = (v.retval, index, v.value if v.retval == XDP_PASS or want == XDP_REDIRECT else 0)
        exp = (want, 0xFFFFFF if d.match_index is None else d.match_index, value)
        ok = got == exp and v.cookie == 0x48465348 and ((v.meta >> 32) & 0xFFFF) == 7 and v.peer == peer
        if d.reason is not None:
            ok = ok and reason == d.reason
        if d.kind in (model.Kind.SHUNT, MIRROR):
            ok = ok and v.meta == d.meta
        if not ok:
            bad.append((f.hex(), d, v))
        tally[(d.kind.name, d.reason)] += 1
        if d.match_index is not None and len(plan.entries) < d.match_index < rows:
            tally[("SLOT", None)] += 1  # a View's buffer slot decided (hardware index n + 1 + b)
    assert not bad, f"{len(bad)} of {len(frames)} frames differ from hw.model, first: {bad[:3]}"
    want_regs = {k: v for k, v in counters.regs.items()}
    got_regs = {k: res.counters.get(k, 0) - before.get(k, 0) for k in want_regs}
    assert got_regs == want_regs
    hits = res.counters["HITS"]
    if before:
        hits = [a - b for a, b in zip(hits, before["HITS"], strict=True)]
    assert hits[:rows] == counters.hits and not any(hits[rows:]), (hits, counters.hits)
    assert res.prog["verified_insns"] > 0
    return tally


CB_SETS = ("acl1_1100", "fw1_1100", "acl3_1100", "fw4_1100")


@pytest.mark.parametrize("name", CB_SETS)
def test_classbench_1100(ns, shared_dir, name):
    from hypafilter.analysis.plan import build_plan
    from hypafilter.tools.classbench import classbench_policy

    d = shared_dir / "data" / "classbench"
    policy = classbench_policy(d / f"{name}.filters", complex_rules=40, actions="alternate", deterministic=True)
    plan = build_plan(policy)
    assert plan.shunt[:-1].any() and not plan.shunt[:-1].all()
    frames = frames_for(policy, random.Random(name), 3000, trace=d / f"{name}_trace.gz")
    tally = check(plan, frames, ns)
    kinds = {k for k, _ in tally}
    assert len(kinds) >= 2 and "SHUNT" in kinds, tally


@pytest.mark.parametrize("seed", range(1, 13))
def test_fuzz_policies(ns, seed):
    """The fuzzer's policies: negations, multiport, ICMP, TCP flags, ranges, user chains; every shunt mode."""
    from hypafilter.analysis.plan import build_plan
    from hypafilter.config import Config
    from hypafilter.iptables.document import parse_policy
    from hypafilter.tools.fuzz import random_policy

    policy = parse_policy(random_policy(seed), f"fuzz-{seed}")
    rng = random.Random(seed)
    for mode in ("index", "selective", "exact"):
        plan = build_plan(policy, Config(shunt_mode=mode))
        check(plan, frames_for(policy, rng, 600), ns)


def test_control_bits(ns, shared_dir):
    """Host mode (ACCEPT -> PASS with the decided value), unfilterable frames passed, shunt-everything."""
    from hypafilter.analysis.plan import build_plan
    from hypafilter.config import Config
    from hypafilter.iptables.document import parse_policy
    from hypafilter.tools.fuzz import random_policy

    policy = parse_policy(random_policy(3, conntrack=False), "fuzz-3", base_chain="FORWARD")
    frames = frames_for(policy, random.Random(5), 800)
    plan = build_plan(policy, Config(shunt_mode="selective"))
    check(plan, frames, ns, unfilterable="pass")
    check(plan, frames, ns, shunt_all=True)
    host = parse_policy(random_policy(3, conntrack=False).replace("FORWARD", "INPUT"), "h", base_chain="INPUT")
    hplan = build_plan(host, Config(shunt_mode="selective"))
    tally = check(hplan, frames_for(host, random.Random(6), 800), ns, nic_mode="host")
    assert tally[("FORWARD", 5)] > 0


LATE_CT = """*filter
:FORWARD DROP [0:0]
-A FORWARD -p icmp -m icmp --icmp-type echo-request -j ACCEPT
-A FORWARD -s 10.0.0.0/8 -p tcp -m tcp --dport 22 -j DROP
-A FORWARD -p udp -m udp --dport 53 -j ACCEPT
-A FORWARD -m conntrack --ctstate ESTABLISHED -j ACCEPT
-A FORWARD -p tcp -m tcp --dport 80 -j ACCEPT
COMMIT
"""


@pytest.mark.parametrize("name", ("conntrack", "late-ct", "fuzz-2", "fuzz-4"))
def test_conntrack_policies(ns, name):
    """Policies that read conntrack: the split rules' ct-restricted boxes and miss forcing (CONTROL bits 4/5,
    reason 3 keeping match_index and action) in bridge mode (ACCEPT and DROP forced) and host mode (DROP forced,
    ACCEPT decided), frame by frame against hw.model.decide with ct 0 (this namespace's conntrack holds nothing)."""
    from hypafilter.analysis.plan import build_plan
    from hypafilter.config import Config
    from hypafilter.iptables.document import parse_policy
    from hypafilter.tools.fuzz import random_policy

    from conftest import ROOT

    if name == "late-ct":
        text = LATE_CT
    elif name.startswith("fuzz-"):
        text = random_policy(int(name[5:]), conntrack=True)
    else:
        text = (ROOT / "rulesets" / f"{name}.rules").read_text()
    policy = parse_policy(text, name)
    assert policy.reads_conntrack
    tally: collections.Counter = collections.Counter()
    for mode in ("index", "exact"):
        plan = build_plan(policy, Config(shunt_mode=mode))
        assert tuple(plan.miss_shunt) == (True, True)
        tally += check(plan, frames_for(policy, random.Random(name), 800), ns)
    # With the lookup on (bpf_xdp_ct_lookup of every TCP/UDP frame): no entry here, so nothing changes.
    from hypafilter.targets.xdp.tables import CtConfig

    ct = CtConfig(lookup=True, tcp_ms=432_000_000, udp_ms=120_000, udp_unreplied_ms=30_000)
    check(plan, frames_for(policy, random.Random(name), 400), ns, ct=ct)
    htext = "".join(ln for ln in text.splitlines(keepends=True) if not ln.startswith(":INPUT "))
    host = parse_policy(htext.replace("FORWARD", "INPUT"), name, base_chain="INPUT")
    hplan = build_plan(host, Config(shunt_mode="selective", nic_mode="host"))
    assert tuple(hplan.miss_shunt) == (False, True)
    htally = check(hplan, frames_for(host, random.Random(name + "h"), 800), ns, nic_mode="host")
    print(name, dict(tally), dict(htally))
    if name == "late-ct":  # entries before its conntrack rule decide in hardware, so miss forcing applies
        assert tally[("SHUNT", 3)] > 0 and htally[("SHUNT", 3)] > 0 and htally[("FORWARD", 5)] > 0, (tally, htally)


def with_mirror(plan, rng: random.Random, share: float = 0.4, zero_k: int = 0):
    """`plan` with mirror bits set by hand on a random `share` of its entries (shunted ones included: their shunt
    bit must win) and the policy entry. The analysis sets Plan.mirror from the policy's observing rules only where
    nothing shunts; these tests give the program every combination. `zero_k`: that many mirrored entries get
    interval 0 (the mark's "no valid metadata": the full policy decides, nothing is cloned)."""
    import numpy as np

    mirror = np.array([rng.random() < share for _ in range(len(plan.entries) + 1)], dtype=bool)
    mirror[-1] = True
    plan.mirror = mirror
    for j in [j for j in np.flatnonzero(mirror) if not plan.shunt[j]][:zero_k]:
        plan.interval[j] = 0
    plan.refresh()
    return plan


def test_mirror_classbench(ns, shared_dir):
    """Mirror bits on a ClassBench plan with shunted entries: bridge mode (ACCEPT passed with the paired port for the
    clone, DROP passed as a copy), host mode (ACCEPT passed with reason 4, not 5), shunt-everything (no mirror),
    every frame and counter (CNT_MIRROR) against the model; the non-mirrored entries decide as before."""
    from hypafilter.analysis.plan import build_plan
    from hypafilter.tools.classbench import classbench_policy

    d = shared_dir / "data" / "classbench"
    policy = classbench_policy(d / "acl1_1100.filters", complex_rules=40, actions="alternate", deterministic=True)
    plan = with_mirror(build_plan(policy), random.Random(13), zero_k=3)
    frames = frames_for(policy, random.Random("mirror"), 3000, trace=d / "acl1_1100_trace.gz")
    tally = check(plan, frames, ns)
    assert tally[(MIRROR_NAME, 4)] > 0 and tally[("FORWARD", None)] > 0 and tally[("DROP", None)] > 0, tally
    # the policy entry is shunted (complex rules) and mirrored: its shunt bit wins
    assert plan.shunt[-1] and plan.mirror[-1] and tally[("SHUNT", 1)] > 0, tally
    host = check(plan, frames, ns, nic_mode="host")
    assert host[(MIRROR_NAME, 4)] > 0 and host[("FORWARD", 5)] > 0, host
    forced = check(plan, frames, ns, shunt_all=True)
    assert forced[(MIRROR_NAME, 4)] == 0, forced


def test_mirror_fuzz_and_conntrack(ns):
    """The fuzzer's policies in every shunt mode with mirror bits; a conntrack policy: miss forcing (reason 3) comes
    before mirroring in bridge mode (ACCEPT and DROP forced: no frame is mirrored) and in host mode (DROP forced,
    the ACCEPTs mirrored with reason 4)."""
    from hypafilter.analysis.plan import build_plan
    from hypafilter.config import Config
    from hypafilter.iptables.document import parse_policy
    from hypafilter.tools.fuzz import random_policy

    rng = random.Random(17)
    total: collections.Counter = collections.Counter()
    for seed in (1, 5):
        policy = parse_policy(random_policy(seed, conntrack=False), f"fuzz-{seed}")
        for mode in ("index", "selective", "exact"):
            plan = with_mirror(build_plan(policy, Config(shunt_mode=mode)), rng)
            plan.miss_shunt = (False, False)  # their connmark matches read conntrack; precedence: below
            total += check(plan, frames_for(policy, rng, 500), ns)
    assert total[(MIRROR_NAME, 4)] > 0, total
    policy = parse_policy(LATE_CT, "late-ct")
    plan = with_mirror(build_plan(policy, Config(shunt_mode="index")), rng, share=1.0)
    bridge = check(plan, frames_for(policy, random.Random("ct"), 800), ns)
    assert bridge[(MIRROR_NAME, 4)] == 0 and bridge[("SHUNT", 3)] > 0, bridge
    htext = "".join(ln for ln in LATE_CT.splitlines(keepends=True) if not ln.startswith(":INPUT "))
    host = parse_policy(htext.replace("FORWARD", "INPUT"), "late-ct", base_chain="INPUT")
    hplan = with_mirror(build_plan(host, Config(shunt_mode="selective", nic_mode="host")), rng, share=1.0)
    htally = check(hplan, frames_for(host, random.Random("cth"), 800), ns, nic_mode="host")
    assert htally[(MIRROR_NAME, 4)] > 0 and htally[("SHUNT", 3)] > 0 and htally[("FORWARD", 5)] == 0, htally


OBSERVING = """*filter
:FORWARD DROP [0:0]
-A FORWARD -p tcp -m tcp --dport 22 -j LOG --log-prefix "ssh: "
-A FORWARD -p tcp -m tcp --dport 20:30 -j ACCEPT
-A FORWARD -s 10.0.0.0/9 -p udp -j NFLOG --nflog-group 7
-A FORWARD -p udp -m udp --dport 53 -m string --string "evil" --algo bm -j DROP
-A FORWARD -p udp -m udp --dport 53 -j ACCEPT
-A FORWARD -d 10.128.0.0/9
-A FORWARD -p tcp -m tcp --dport 1000:65535 -j ACCEPT
-A FORWARD -p udp -j DROP
-A FORWARD -p icmp -j ACCEPT
COMMIT
"""


@pytest.mark.parametrize("mode", ["index", "selective"])
def test_mirror_from_the_analysis(ns, mode):
    """Observing rules (LOG, NFLOG, no target) and a deciding string match: the analysis's Plan.mirror, every frame
    and counter against hw.model (Kind.MIRROR), bridge and host mode."""
    from hypafilter.analysis.plan import build_plan
    from hypafilter.config import Config
    from hypafilter.iptables.document import parse_policy

    policy = parse_policy(OBSERVING, "observing")
    plan = build_plan(policy, Config(shunt_mode=mode))
    assert plan.mirror.any() and plan.shunt.any(), (plan.mirror, plan.shunt)
    frames = frames_for(policy, random.Random(mode), 1500)
    tally = check(plan, frames, ns)
    assert tally[(MIRROR_NAME, 4)] > 0 and tally[("SHUNT", 0)] + tally[("SHUNT", 1)] > 0, tally
    host = check(plan, frames, ns, nic_mode="host")
    assert host[(MIRROR_NAME, 4)] > 0, host


# One 10,000-rule set in every run; all three with HF_XDP_LARGE=1 (`make test-xdp-large`, about a minute a set).
SETS_10K = ("acl1_10k", "fw1_10k", "ipc1_10k") if os.environ.get("HF_XDP_LARGE") == "1" else ("acl1_10k",)


@pytest.mark.slow
@pytest.mark.parametrize("name", SETS_10K)
def test_classbench_10k(ns, shared_dir, name):
    from hypafilter.analysis.plan import build_plan
    from hypafilter.tools.classbench import classbench_policy

    d = shared_dir / "data" / "classbench"
    policy = classbench_policy(d / f"{name}.filters", complex_rules=200, actions="alternate", deterministic=True)
    plan = build_plan(policy)
    assert len(plan.entries) >= 9000
    check(plan, frames_for(policy, random.Random(name), 6000, trace=d / f"{name}_trace.gz"), ns)
