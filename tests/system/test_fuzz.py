"""The kernel-differential fuzzer (issue #11): random policies over every shunting mode × software strategy on the
emulated NIC, per-frame comparison with the policy alone in the plain namespace, real connections for policies
that read conntrack state. Seeds are printed (`-s`) and named in every failure, so a run reproduces.

Every policy reaches its features (tools/fuzz.py draws no unconditional rule and no shadowed one), and the run
proves it from the oracle's own rule counters (`iptables-save -c` in the plain namespace after every pair):
each feature of tools.fuzz.FEATURES matched packets somewhere in the run (test_features_were_reached). Rules with
per-rule state are drawn in the forms verify can compare, and each stands exactly once in the firewall's table.

Attack shapes (verify.ATTACK_SHAPES: SYN and ACK floods, RST/FIN scans, UDP floods, fragments of new flows, ICMP
errors quoting flows sent before and invented ones) make up ATTACK_SHARE of every pair's frames, from spoofed
sources at the policy's own destinations and ports; test_attack_shapes_xdp sends them through the xdp target too.
Each policy runs on a third of the (mode, strategy) pairs in `make test-full`, the thirds taken in turn by pairs of
seeds, so that every pair meets a stateless policy and a conntrack one (with its connection checks) in a run of six;
`make test` runs each policy on a sixth of them, every pair on one policy (pairs_of);
HF_FUZZ_ALL_PAIRS=1 (`make fuzz`) runs every policy on every pair, HF_FUZZ_STRATEGY=S every policy on strategy S's pairs
(`make fuzz-tree`).

HF_FUZZ_FRAMES (total frames, default 50,000), HF_FUZZ_POLICIES (default 6) and HF_FUZZ_SEED (first policy
seed) scale it, HF_FUZZ_LAB names its lab (default hff); `make fuzz` is the long run (docs/deploy.md)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from hypafilter.ops.connections import connections_completed
from hypafilter.tools.fuzz import counted_rules  # (packets, rule) per rule of a namespace's filter table

from conftest import FULL_RUN, TEST_FULL, full_beyond, need, ns_sh

pytestmark = pytest.mark.system

LAB = os.environ.get("HF_FUZZ_LAB", "hff")  # another name lets a second run go beside this one
FRAMES = int(os.environ.get("HF_FUZZ_FRAMES", "50000"))
POLICIES = int(os.environ.get("HF_FUZZ_POLICIES", "6"))
FIRST_SEED = int(os.environ.get("HF_FUZZ_SEED", "1"))
MALFORMED = 0.5  # half the frames that are not attack frames are of one of the kinds, half well-formed
ATTACK_SHARE = 0.3  # of every pair's frames: attack shapes, each shape about 4 % of the frames
ALL_PAIRS = os.environ.get("HF_FUZZ_ALL_PAIRS", "") not in ("", "0")
# HF_FUZZ_STRATEGY=S: every policy on every mode of strategy S only (e.g. tree: `make fuzz-tree`)
ONLY_STRATEGY = os.environ.get("HF_FUZZ_STRATEGY", "")
TCP_PORTS = (22, 80, 443, 5001, 8080)
UDP_PORTS = (53, 123, 5002)
STATEFUL = ("limit", "hashlimit", "quota", "statistic", "recent", "connlimit")
# feature -> [rules carrying it in the run's policies, packets they matched], over every policy of the run
COVERAGE: dict[str, list[int]] = {}
DONE: list[int] = []
# attack kind -> [frames, delivered by the kernel] over the run
ATTACKS: dict[str, list[int]] = {}


def policy_seeds() -> list[int]:
    return list(range(FIRST_SEED, FIRST_SEED + POLICIES))


def pairs_of(seed: int) -> tuple[tuple[str, str], ...]:
    """The (mode, strategy) pairs policy `seed` runs on. `make test-full`: every third pair of QUICK_COMBOS, seeds 1-2
    (and 7-8, ...) pairs 0, 3, 6..., seeds 3-4 pairs 1, 4, 7..., seeds 5-6 pairs 2, 5, 8..., so each pair meets an odd
    (stateless) and an even (conntrack) seed in a run of six. `make test`: every sixth pair, seed 1 pairs 5, 11, seed 2
    pairs 0, 6, 12, seed 3 pairs 1, 7, 13, ..., so each pair meets one policy of the six, stateless or conntrack by
    turns, the tree pair (the 15th) a conntrack one (half the deploys, core builds and connection checks:
    docs/testing.md). All with ALL_PAIRS."""
    from hypafilter.tools.fuzz import COMBOS, QUICK_COMBOS

    if ONLY_STRATEGY:
        return tuple(p for p in COMBOS if p[1] == ONLY_STRATEGY)
    if ALL_PAIRS:
        return COMBOS
    if not FULL_RUN:
        return tuple(p for i, p in enumerate(QUICK_COMBOS) if (i + 1) % 6 == (seed - 1) % 6)
    third = ((seed - 1) // 2) % 3
    return tuple(p for i, p in enumerate(QUICK_COMBOS) if i % 3 == third)


@pytest.mark.parametrize("seed", policy_seeds())
def test_fuzz(lab, seed):
    from hypafilter.config import Config
    from hypafilter.iptables.document import parse_policy
    from hypafilter.ops.verify import ATTACK_SHAPES, FRAME_KINDS
    from hypafilter.tools.fuzz import FEATURES, Tally, fuzz_policy, random_policy, shadowed_lines

    conntrack = seed % 2 == 0  # every other policy reads conntrack state and gets real connections too
    text = random_policy(seed, conntrack=conntrack)
    assert not shadowed_lines(text)
    policy = parse_policy(text, filename=f"fuzz-seed-{seed}", base_chain="FORWARD", config=Config())
    pairs = pairs_of(seed)
    frames = -(-FRAMES // (POLICIES * len(pairs)))  # rounded up: the total reaches FRAMES
    print(f"\nfuzz: policy seed {seed} (conntrack {conntrack}), {frames} frames per pair, every kind")
    print(text)
    conn_diffs: list[str] = []
    once: list[str] = []
    hits: dict[str, int] = {}
    written = [ln for ln in text.splitlines() if ln.startswith("-A ")]

    def after(mode: str, strategy: str, n: int) -> None:
        for packets, rule in counted_rules(lab.ns_plain):
            hits[rule] = hits.get(rule, 0) + packets
        # Per-rule state loaded exactly once in the firewall, whatever the strategy's chains.
        fw = [r for _, r in counted_rules(lab.ns_fw)]
        for m in STATEFUL:
            want = sum(f"-m {m} " in ln for ln in written)
            got = sum(f"-m {m} " in ln for ln in fw)
            if want != got:
                once.append(f"{mode}/{strategy}: -m {m} in {got} rules, the policy has {want}")
        if conntrack:
            got = connections_completed(lab, TCP_PORTS, UDP_PORTS, sport=20000 + 20 * n)
            if got["hyb"] != got["plain"]:
                conn_diffs.append(f"{mode}/{strategy}: hybrid {got['hyb']}, kernel {got['plain']}")
            print(f"fuzz: seed {seed} {mode}/{strategy}: connections {got['plain']}")

    t = time.monotonic()
    tally = fuzz_policy(
        policy,
        seed,
        frames,
        FRAME_KINDS,
        MALFORMED,
        pairs=pairs,
        tally=Tally(),
        after=after,
        log=lambda s: print(f"fuzz: {s}"),
        attack=ATTACK_SHAPES,
        attack_share=ATTACK_SHARE,
    )
    print(f"fuzz: seed {seed}: {tally.frames} frames in {time.monotonic() - t:.0f} s\n{tally.table()}")
    for feature, needle in FEATURES.items():
        rules = [r for r in hits if needle in r]
        cov = COVERAGE.setdefault(feature, [0, 0])
        cov[0] += len(rules)
        cov[1] += sum(hits[r] for r in rules)
    print("fuzz: oracle rule counters (packets matched, summed over the pairs):")
    for rule, packets in sorted(hits.items(), key=lambda kv: kv[1]):
        print(f"fuzz:   {packets:>8} {rule}")
    for kind, v in tally.by_kind.items():
        if kind.startswith("attack_"):
            a = ATTACKS.setdefault(kind, [0, 0])
            a[0] += v["packets"]
            a[1] += v["delivered"]
    DONE.append(seed)
    bad = sum(v["mismatches"] for v in tally.by_kind.values())
    altered = sum(r["altered"] for r in tally.runs)
    assert tally.frames == frames * len(pairs)
    assert bad == 0 and altered == 0, (
        f"policy seed {seed}: {bad} verdict mismatches, {altered} altered frames; reproduce with "
        f"random_policy({seed}, conntrack={conntrack}) and the frame seeds below\n{tally.table()}\n{tally.examples[:6]}"
    )
    observer_bad = [r for r in tally.runs if r["observer_mismatches"]]
    assert not observer_bad, (
        f"policy seed {seed}: observing rules counted other frames than the kernel's: {observer_bad}\n"
        f"{[e for e in tally.examples if 'observer' in e][:6]}"
    )
    assert not conn_diffs, f"policy seed {seed}: connections differ: {conn_diffs}"
    assert not once, f"policy seed {seed}: per-rule state not loaded exactly once: {once}"


def test_features_were_reached():
    """Over the run's policies every feature is drawn and its rules matched packets in the kernel oracle."""
    # CI runs the whole module, so every policy ran; a selection of single seeds (-k) outside CI skips this check.
    need(sorted(DONE) == policy_seeds(), "needs every policy of the run (run the whole module)")
    print("fuzz: coverage (rules, packets matched):", COVERAGE)
    missing = [f for f, (rules, _) in COVERAGE.items() if rules == 0]
    unreached = [f for f, (rules, packets) in COVERAGE.items() if rules and packets == 0]
    assert not missing, f"features never drawn in seeds {policy_seeds()}: {missing}"
    assert not unreached, f"features whose rules never matched a packet: {unreached} ({COVERAGE})"
    # Every attack shape was sent, and the kernel let some of its frames through and dropped others: each shape met
    # the policies' decisions both ways, not only a chain policy. Fragments aside: the bridge's conntrack holds a
    # lone fragment of a new flow for reassembly, which never completes, so the kernel passes none of them.
    from hypafilter.ops.verify import ATTACK_SHAPES

    print("fuzz: attack shapes (frames, delivered by the kernel):", ATTACKS)
    assert set(ATTACKS) == {f"attack_{s}" for s in ATTACK_SHAPES}, ATTACKS
    one_way = [k for k, (n, delivered) in ATTACKS.items() if not 0 < delivered < n and k != "attack_frag"]
    assert not one_way, f"attack shapes the kernel only passed or only dropped: {one_way} ({ATTACKS})"


XDP_LAB = os.environ.get("HF_FUZZ_XDP_LAB", "vlmx")  # the xdp target's lab of this module
XDP_FRAMES = 400  # per pair
XDP_ATTACK_SHARE = 0.6


@pytest.fixture(scope="module")
def xdp_lab():
    """A lab of the xdp target beside the module's emulated one, deploy pointed at it only inside the test."""
    import shutil

    from hypafilter.ops.lab import Lab

    from conftest import need_root, need_tool

    need_root()
    need_tool("ip", "iptables-restore", "clang", "cc", "make", "tc", "ethtool", "nft")
    state = f"/run/hypafilter/test-{XDP_LAB}"
    shutil.rmtree(state, ignore_errors=True)
    lab = Lab(XDP_LAB, target="xdp")
    lab.down()
    lab.up()
    yield lab, state
    from hypafilter.ops import deploy

    was = (deploy.LAB_NAME, deploy.STATE_DIR)
    deploy.configure(lab=XDP_LAB, state_dir=state)
    try:
        deploy.undeploy()
    finally:
        deploy.configure(*was)
        lab.down()
        shutil.rmtree(state, ignore_errors=True)


@pytest.mark.parametrize("seed", full_beyond([FIRST_SEED, FIRST_SEED + 1]))  # the second: make test-full
def test_attack_shapes_xdp(xdp_lab, seed):
    """The attack shapes through the xdp target against the kernel, a third of the (mode, strategy) pairs per policy
    (every pair with HF_FUZZ_ALL_PAIRS; tests/system/test_xdp_lab.py runs the frame kinds on every pair): a
    stateless policy and one that reads conntrack (where the shapes are NEW, INVALID or RELATED to the kernel)."""
    from hypafilter.config import Config
    from hypafilter.iptables.document import parse_policy
    from hypafilter.ops import deploy
    from hypafilter.ops.verify import ATTACK_SHAPES, FRAME_KINDS
    from hypafilter.tools.fuzz import COMBOS, QUICK_COMBOS, Tally, fuzz_policy, random_policy

    _, state = xdp_lab
    conntrack = seed % 2 == 0
    pairs = COMBOS if ALL_PAIRS else tuple(p for i, p in enumerate(QUICK_COMBOS) if i % 3 == seed % 3)
    if ONLY_STRATEGY:
        pairs = tuple(p for p in COMBOS if p[1] == ONLY_STRATEGY)
    text = random_policy(seed, conntrack=conntrack)
    policy = parse_policy(text, filename=f"fuzz-seed-{seed}", base_chain="FORWARD", config=Config())
    was = (deploy.LAB_NAME, deploy.STATE_DIR)
    deploy.configure(lab=XDP_LAB, state_dir=state)
    try:
        tally = fuzz_policy(
            policy,
            seed,
            XDP_FRAMES,
            FRAME_KINDS,
            MALFORMED,
            pairs=pairs,
            tally=Tally(),
            target="xdp",
            attack=ATTACK_SHAPES,
            attack_share=XDP_ATTACK_SHARE,
            log=lambda s: print(f"fuzz xdp: {s}"),
        )
    finally:
        deploy.configure(*was)
    print(tally.table())
    assert tally.frames == XDP_FRAMES * len(pairs)
    assert {k for k in tally.by_kind if k.startswith("attack_")} == {f"attack_{s}" for s in ATTACK_SHAPES}
    bad = sum(v["mismatches"] for v in tally.by_kind.values())
    altered = sum(r["altered"] for r in tally.runs)
    observer_bad = sum(r["observer_mismatches"] for r in tally.runs)
    assert bad == 0 and altered == 0 and observer_bad == 0, (
        f"policy seed {seed} on xdp: {bad} verdict mismatches, {altered} altered, {observer_bad} observer "
        f"mismatches; reproduce with random_policy({seed}, conntrack={conntrack})\n{tally.table()}\n{tally.examples[:6]}"
    )


# ---- IPv6 (issue #25): a random ip6tables policy beside the IPv4 one, verify6's frames -----------------------------
FRAMES6 = int(os.environ.get("HF_FUZZ_FRAMES6", "300"))  # IPv6 frames of the short dual-stack case, per target
V6_V4_FRAMES = 100  # the IPv4 frames beside them (the IPv4 side is test_fuzz's)


def _dual_stack(seed: int, pair: tuple[str, str], target: str):
    """One pair of the dual stack: random_policy(seed) and random_policy6(seed) deployed together, FRAMES6 IPv6 frames
    of every verify6 kind and V6_V4_FRAMES IPv4 frames through both paths; (tally, the IPv6 rules' oracle counters,
    IPv6 frames the fast path counted unparsed)."""
    from hypafilter.config import Config
    from hypafilter.iptables.document import parse_policy
    from hypafilter.ops import deploy
    from hypafilter.ops.verify import FRAME_KINDS
    from hypafilter.tools.fuzz import Tally, fuzz_policy, policy6, random_policy, random_policy6

    conntrack = seed % 2 == 0
    text = random_policy(seed, conntrack=conntrack)
    policy = parse_policy(text, filename=f"fuzz-seed-{seed}", base_chain="FORWARD", config=Config())
    text6 = random_policy6(seed, conntrack=conntrack)
    print(f"\nfuzz ipv6 {target}: policy seed {seed} {pair[0]}/{pair[1]}, IPv6 side:\n{text6}")
    hits: list[tuple[int, str]] = []

    def after(mode: str, strategy: str, n: int) -> None:
        hits.extend(counted_rules(f"{deploy.LAB_NAME}-plain", 6))

    tally = fuzz_policy(
        policy,
        seed,
        V6_V4_FRAMES,
        FRAME_KINDS,
        MALFORMED,
        pairs=(pair,),
        tally=Tally(),
        after=after,
        target=target,
        v6=policy6(text6, f"fuzz6-seed-{seed}"),
        frames6=FRAMES6,
        log=lambda s: print(f"fuzz ipv6 {target}: {s}"),
    )
    print(tally.table())
    for packets, rule in hits:
        print(f"fuzz ipv6:   {packets:>6} {rule}")
    return tally, hits, tally.runs[0]["unparsed"]


def _check_dual_stack(tally, hits, seed: int, target: str) -> dict:
    from hypafilter.ops.verify6 import KINDS6

    v6 = {k: v for k, v in tally.by_kind.items() if k.startswith("v6_")}
    assert set(v6) == {f"v6_{k}" for k in KINDS6}, sorted(v6)
    frames6 = sum(v["packets"] for v in v6.values())
    delivered6 = sum(v["delivered"] for v in v6.values())
    assert frames6 == FRAMES6 and tally.frames == FRAMES6 + V6_V4_FRAMES
    bad = sum(v["mismatches"] for v in tally.by_kind.values())
    altered = sum(r["altered"] for r in tally.runs)
    assert bad == 0 and altered == 0, (
        f"dual stack seed {seed} on {target}: {bad} verdict mismatches, {altered} altered; reproduce with "
        f"random_policy({seed}) and random_policy6({seed})\n{tally.table()}\n{tally.examples[:6]}"
    )
    # the kernel both passed and dropped IPv6 frames, and rules of the IPv6 policy matched them (it was reached)
    assert 0 < delivered6 < frames6, v6
    assert sum(1 for packets, _ in hits if packets) >= 3, hits
    return v6


# The emulated NIC's dual stack's policy seed (stateless; its IPv6 plan in exact mode: 13 entries, 7 of its 14 rows
# decided in hardware, the IPv6 policy entry one of them; most of verify6's frames meet its complex rules first).
EMU6_SEED = 9


@TEST_FULL  # make test-full
def test_fuzz_ipv6_emu(lab):
    """The dual stack on the emulated NIC with `emu_ipv6` on (docs/ipv6.md "## emu"): a dual-stack core built with
    the random IPv6 policy's plan decides the IPv6 frames it parses (stage 1 shunted every one unparsed), ip6tables
    holds the IPv6 policy with the plan's interval chains beside the hybrid's IPv4 side; the kernel alone as oracle.
    One build of a dual-stack core. A stateless seed whose IPv6 plan leaves many rows to the hardware: a
    conntrack-reading IPv6 side sets the core's IPv6 miss forcing (CONTROL bits 6/7), which sends every IPv6 frame an
    ACCEPT or DROP row matches to the host (ct 0: the flow cache holds IPv4 tuples), so a stateful one would show
    only forced frames. A random policy puts complex rules (REJECT, LOG, ipv6header, marks) before most simple ones,
    so the share of its frames the hardware decides is small (17 of the 207 the core matched in the run this was
    written with); the share on an operator's kind of policy is measured in docs/ipv6.md "## emu"."""
    seed = EMU6_SEED
    tally, hits, unparsed = _dual_stack(seed, pairs_of(seed)[-1], "emu")
    _check_dual_stack(tally, hits, seed, "emu")
    hw6 = tally.runs[0]["hw6"] or {}
    print(f"fuzz ipv6 emu: {unparsed} unparsed, IPv6 rows matched {hw6.get('matched')}, decided {hw6.get('decided')}")
    # the core parses and matches most IPv6 frames (the rest: fragments, AH, truncations, jumbo, ... unparsed) and
    # decides some of them itself; the verdicts are the kernel's (0 mismatches above). Stage 1: all unparsed.
    assert unparsed < FRAMES6 / 2, f"{unparsed} of {FRAMES6} IPv6 frames unparsed: the core does not decide IPv6"
    assert hw6.get("matched", 0) >= FRAMES6 / 2, hw6
    assert hw6.get("decided", 0) >= FRAMES6 / 30, hw6


# The xdp dual stack's policy seed: its draws showed that a change of shunting mode could not be deployed (below).
XDP6_SEED = 9


def test_fuzz_ipv6_xdp_update(xdp_lab, tmp_path):
    """The dual stack on xdp with `xdp_ipv6` on, reached by `hypafilter update POLICY --ipv6 V6POLICY` from what the
    lab has (test_attack_shapes_xdp's IPv4 policy alone): both families change in one transaction (one generation,
    the IPv6 side loaded and the program's IPv6 table set written), then verify finds it deployed and sends the
    fuzzer's frames: the program decides the IPv6 frames it parses by the random IPv6 policy's table set (fewer
    unparsed frames than two thirds of the IPv6 frames), ip6tables the rest with k = 0, the kernel alone as oracle.
    Then the same policies in exact mode: the IPv4 change fits the running program's update buffer, the IPv6 plan
    (exact mode has other entries) does not fit its IPv6 table set — the fuzzer found this deploy refused ("the
    plan's tables do not fit the running program", rolled back) while only the IPv4 side's fit was checked. Last, an
    update without IPv6 arguments keeps the deployed IPv6 side."""
    import json

    from hypafilter.config import Config
    from hypafilter.iptables.document import parse_policy
    from hypafilter.ops import deploy
    from hypafilter.ops.policysync.follow6 import strip6, tool_prefix
    from hypafilter.ops.verify import FRAME_KINDS
    from hypafilter.tools.fuzz import FUZZ_TREE_MIN_SEGMENT, Tally, fuzz_policy, policy6, random_policy, random_policy6

    from tests.hfcli import HfCli

    _, state = xdp_lab
    hf = HfCli(XDP_LAB, state)
    seed = XDP6_SEED
    conntrack = seed % 2 == 0
    text, text6 = random_policy(seed, conntrack=conntrack), random_policy6(seed, conntrack=conntrack)
    print(f"\nfuzz ipv6 xdp: policy seed {seed}, IPv6 side:\n{text6}")
    (tmp_path / "v4.rules").write_text(text)
    (tmp_path / "v6.rules").write_text(text6)
    (tmp_path / "cfg.toml").write_text(
        f'shunt_mode = "selective"\nstrategy = "interval"\ntree_min_segment = {FUZZ_TREE_MIN_SEGMENT}\n'
        "xdp_ipv6 = true\n"
    )
    st0 = deploy.read_state(Path(state) / "state.json") or {}
    cmd = ["update"] if st0 else ["deploy", "--target", "xdp"]  # (alone, -k: nothing deployed yet)
    cfg = ["--config", str(tmp_path / "cfg.toml"), "-q"]
    hf(*cmd, str(tmp_path / "v4.rules"), "--ipv6", str(tmp_path / "v6.rules"), *cfg)
    st = json.loads((Path(state) / "state.json").read_text())
    policy = parse_policy(text, filename=f"fuzz-seed-{seed}", base_chain="FORWARD", config=Config())
    v6 = policy6(text6, f"fuzz6-seed-{seed}")
    assert st["policy_hash"] == policy.policy_hash() and st["ipv6"]["hash"] == v6.policy_hash()
    assert st["generation"] == st0.get("generation", 0) + 1 and st["xdp_ipv6"], st["history"][-2:]
    assert st["tables"]["v6"]["entries"] > 0, st["tables"]
    fw6 = ns_sh(f"{XDP_LAB}-fw", "ip6tables-save", "-t", "filter")
    assert "-j HFv6_MAIN" in fw6, fw6  # the IPv6 plan's interval chains beside the policy (docs/ipv6.md)
    own = strip6(fw6, tool_prefix(st["ipv6"]))  # the operator's part: the policy as loaded, nothing more
    assert own.count("\n-A ") == text6.count("\n-A "), fw6
    hits: list[tuple[int, str]] = []
    was = (deploy.LAB_NAME, deploy.STATE_DIR)
    deploy.configure(lab=XDP_LAB, state_dir=state)
    try:
        tally = fuzz_policy(
            policy,
            seed,
            V6_V4_FRAMES,
            FRAME_KINDS,
            MALFORMED,
            pairs=(("selective", "interval"),),
            tally=Tally(),
            after=lambda *_: hits.extend(counted_rules(f"{XDP_LAB}-plain", 6)),
            target="xdp",
            v6=v6,
            frames6=FRAMES6,
            log=lambda s: print(f"fuzz ipv6 xdp: {s}"),
        )
    finally:
        deploy.configure(*was)
    print(tally.table())
    for packets, rule in hits:
        print(f"fuzz ipv6:   {packets:>6} {rule}")
    assert json.loads((Path(state) / "state.json").read_text())["generation"] == st["generation"], (
        "verify deployed again what update had deployed"
    )
    _check_dual_stack(tally, hits, seed, "xdp")
    unparsed = tally.runs[0]["unparsed"]
    assert unparsed < FRAMES6 * 2 // 3, f"the program decided few IPv6 frames: {unparsed} of {FRAMES6} unparsed"
    # exact mode (deploy within verify): the IPv4 side through the update buffer, the IPv6 table set rewritten
    deploy.configure(lab=XDP_LAB, state_dir=state)
    try:
        exact = fuzz_policy(
            policy,
            seed,
            V6_V4_FRAMES // 2,
            FRAME_KINDS,
            MALFORMED,
            pairs=(("exact", "interval"),),
            tally=Tally(),
            target="xdp",
            v6=v6,
            frames6=FRAMES6 // 2,
            log=lambda s: print(f"fuzz ipv6 xdp: {s}"),
        )
    finally:
        deploy.configure(*was)
    assert exact.mismatches == 0 and exact.runs[0]["packets_ipv6"] == FRAMES6 // 2, (exact.table(), exact.examples)
    st_exact = json.loads((Path(state) / "state.json").read_text())
    assert st_exact["mode"] == "exact" and st_exact["tables"]["v6"]["entries"] > 0, st_exact["tables"]
    # without IPv6 arguments: the IPv4 side replaced, the IPv6 side kept as deployed
    (tmp_path / "v4b.rules").write_text(random_policy(seed + 1, conntrack=conntrack))
    hf("update", str(tmp_path / "v4b.rules"), *cfg)
    st2 = json.loads((Path(state) / "state.json").read_text())
    assert st2["policy_hash"] != st["policy_hash"] and st2["ipv6"]["hash"] == v6.policy_hash()
    assert ns_sh(f"{XDP_LAB}-fw", "ip6tables-save", "-t", "filter").count("\n-A ") == fw6.count("\n-A ")
