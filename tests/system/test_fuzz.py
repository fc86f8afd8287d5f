"""The kernel-differential fuzzer (issue #11): random policies over every shunting mode × software strategy on the
emulated NIC, per-frame comparison with the policy alone in the plain namespace, real connections for policies
that read conntrack state. Seeds are printed (`-s`) and named in every failure, so a run reproduces.

HF_FUZZ_FRAMES (total frames, default 100,000), HF_FUZZ_POLICIES (default 2), HF_FUZZ_SEED (first policy seed)
and HF_FUZZ_DIET=full (also the kinds excluded below, to measure them) scale and steer it; `make fuzz` is the
long run (docs/deploy.md)."""

from __future__ import annotations

import os
import time

import pytest

from tests.netconn import connections_completed

pytestmark = pytest.mark.system

LAB = "hff"
FRAMES = int(os.environ.get("HF_FUZZ_FRAMES", "100000"))
POLICIES = int(os.environ.get("HF_FUZZ_POLICIES", "2"))
FIRST_SEED = int(os.environ.get("HF_FUZZ_SEED", "1"))
MALFORMED = 0.5  # half the frames are of one of the kinds, half well-formed
TCP_PORTS = (22, 80, 443, 5001, 8080)
UDP_PORTS = (53, 123, 5002)


def diet(conntrack: bool) -> tuple[str, ...]:
    """Every frame kind, well-formed and adversarial: none is left out (the hardware is exact on all of them)."""
    from hypafilter.ops.verify import FRAME_KINDS

    return FRAME_KINDS


def policy_seeds() -> list[int]:
    return list(range(FIRST_SEED, FIRST_SEED + POLICIES))


@pytest.mark.parametrize("seed", policy_seeds())
def test_fuzz(lab, seed):
    from hypafilter.config import Config
    from hypafilter.iptables.document import parse_policy
    from hypafilter.tools.fuzz import COMBOS, Tally, fuzz_policy, random_policy

    conntrack = seed % 2 == 0  # every other policy reads conntrack state and gets real connections too
    text = random_policy(seed, conntrack=conntrack)
    policy = parse_policy(text, filename=f"fuzz-seed-{seed}", base_chain="FORWARD", config=Config())
    kinds = diet(conntrack)
    frames = -(-FRAMES // (POLICIES * len(COMBOS)))  # rounded up: the total reaches FRAMES
    print(f"\nfuzz: policy seed {seed} (conntrack {conntrack}), {frames} frames per pair, kinds {','.join(kinds)}")
    print(text)
    conn_diffs: list[str] = []

    def connections(mode: str, strategy: str, n: int) -> None:
        if not conntrack:
            return
        got = connections_completed(lab, TCP_PORTS, UDP_PORTS, sport=20000 + 20 * n)
        if got["hyb"] != got["plain"]:
            conn_diffs.append(f"{mode}/{strategy}: hybrid {got['hyb']}, kernel {got['plain']}")
        print(f"fuzz: seed {seed} {mode}/{strategy}: connections {got['plain']}")

    t = time.monotonic()
    tally = fuzz_policy(
        policy, seed, frames, kinds, MALFORMED, tally=Tally(), after=connections, log=lambda s: print(f"fuzz: {s}")
    )
    print(f"fuzz: seed {seed}: {tally.frames} frames in {time.monotonic() - t:.0f} s\n{tally.table()}")
    bad = sum(v["mismatches"] for v in tally.by_kind.values())
    altered = sum(r["altered"] for r in tally.runs)
    assert tally.frames == frames * len(COMBOS)
    assert bad == 0 and altered == 0, (
        f"policy seed {seed}: {bad} verdict mismatches, {altered} altered frames; reproduce with "
        f"random_policy({seed}, conntrack={conntrack}) and the frame seeds below\n{tally.table()}\n{tally.examples[:6]}"
    )
    assert not conn_diffs, f"policy seed {seed}: connections differ: {conn_diffs}"
