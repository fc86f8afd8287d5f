"""The kernel-differential fuzzer (issue #11): random policies over every shunting mode × software strategy on the
emulated NIC, per-frame comparison with the policy alone in the plain namespace, real connections for policies
that read conntrack state. Seeds are printed (`-s`) and named in every failure, so a run reproduces.

Every policy reaches its features (tools/fuzz.py draws no unconditional rule and no shadowed one), and the run
proves it from the oracle's own rule counters (`iptables-save -c` in the plain namespace after every pair):
each feature of tools.fuzz.FEATURES matched packets somewhere in the run (test_features_were_reached). Rules with
per-rule state are drawn in the forms verify can compare, and each stands exactly once in the firewall's table.

HF_FUZZ_FRAMES (total frames, default 100,000), HF_FUZZ_POLICIES (default 6) and HF_FUZZ_SEED (first policy
seed) scale it, HF_FUZZ_LAB names its lab (default hff); `make fuzz` is the long run (docs/deploy.md)."""

from __future__ import annotations

import os
import re
import time

import pytest
from hypafilter.ops.connections import connections_completed

from conftest import need, ns_sh

pytestmark = pytest.mark.system

LAB = os.environ.get("HF_FUZZ_LAB", "hff")  # another name lets a second run go beside this one
FRAMES = int(os.environ.get("HF_FUZZ_FRAMES", "100000"))
POLICIES = int(os.environ.get("HF_FUZZ_POLICIES", "6"))
FIRST_SEED = int(os.environ.get("HF_FUZZ_SEED", "1"))
MALFORMED = 0.5  # half the frames are of one of the kinds, half well-formed
TCP_PORTS = (22, 80, 443, 5001, 8080)
UDP_PORTS = (53, 123, 5002)
STATEFUL = ("limit", "hashlimit", "quota", "statistic", "recent", "connlimit")
# feature -> [rules carrying it in the run's policies, packets they matched], over every policy of the run
COVERAGE: dict[str, list[int]] = {}
DONE: list[int] = []


def policy_seeds() -> list[int]:
    return list(range(FIRST_SEED, FIRST_SEED + POLICIES))


def counted_rules(ns: str) -> list[tuple[int, str]]:
    """(packets, rule text) of every rule in the namespace's filter table, from iptables-save -c."""
    out = []
    for ln in ns_sh(ns, "iptables-save", "-c", "-t", "filter").splitlines():
        m = re.match(r"\[(\d+):\d+\] (-A .*)", ln)
        if m:
            out.append((int(m.group(1)), m.group(2)))
    return out


@pytest.mark.parametrize("seed", policy_seeds())
def test_fuzz(lab, seed):
    from hypafilter.config import Config
    from hypafilter.iptables.document import parse_policy
    from hypafilter.ops.verify import FRAME_KINDS
    from hypafilter.tools.fuzz import COMBOS, FEATURES, Tally, fuzz_policy, random_policy, shadowed_lines

    conntrack = seed % 2 == 0  # every other policy reads conntrack state and gets real connections too
    text = random_policy(seed, conntrack=conntrack)
    assert not shadowed_lines(text)
    policy = parse_policy(text, filename=f"fuzz-seed-{seed}", base_chain="FORWARD", config=Config())
    frames = -(-FRAMES // (POLICIES * len(COMBOS)))  # rounded up: the total reaches FRAMES
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
        policy, seed, frames, FRAME_KINDS, MALFORMED, tally=Tally(), after=after, log=lambda s: print(f"fuzz: {s}")
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
    DONE.append(seed)
    bad = sum(v["mismatches"] for v in tally.by_kind.values())
    altered = sum(r["altered"] for r in tally.runs)
    assert tally.frames == frames * len(COMBOS)
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
