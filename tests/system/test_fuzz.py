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
FULL_DIET = os.environ.get("HF_FUZZ_DIET") == "full"
MALFORMED = 0.5  # half the frames are of one of the kinds, half well-formed
# Frame kinds on which the hardware still departs from the kernel: excluded until the hardware fix (the VHDL
# parser and hw.model) lands; remove a kind here when its fix is in. The value says when it diverges.
EXCLUDED_UNTIL_HW_FIX = {
    "bad_ip_checksum": "always: the hardware forwards frames the kernel drops",
    "vlan_8021ad": "always: the kernel pops the one tag and filters the IPv4 inside; the hardware drops the frame",
    "qinq": "always: the kernel passes two-tag frames unfiltered; the hardware drops them",
    "link_local_dst": "always: the hardware forwards 01:80:C2:00:00:0X, the bridge does not",
    "fragment_first": "with conntrack: defragmentation holds a lone first fragment, the hardware forwards it",
}
TCP_PORTS = (22, 80, 443, 5001, 8080)
UDP_PORTS = (53, 123, 5002)


def diet(conntrack: bool) -> tuple[str, ...]:
    from hypafilter.ops.verify import FRAME_KINDS

    if FULL_DIET:
        return FRAME_KINDS
    skip = {k for k, when in EXCLUDED_UNTIL_HW_FIX.items() if when.startswith("always") or conntrack}
    return tuple(k for k in FRAME_KINDS if k not in skip)


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
    counted = {k: v for k, v in tally.by_kind.items() if not (FULL_DIET and k in EXCLUDED_UNTIL_HW_FIX)}
    bad = sum(v["mismatches"] for v in counted.values())
    altered = sum(r["altered"] for r in tally.runs)
    assert tally.frames == frames * len(COMBOS)
    assert bad == 0 and (FULL_DIET or altered == 0), (
        f"policy seed {seed}: {bad} verdict mismatches, {altered} altered frames; reproduce with "
        f"random_policy({seed}, conntrack={conntrack}) and the frame seeds below\n{tally.table()}\n{tally.examples[:6]}"
    )
    assert not conn_diffs, f"policy seed {seed}: connections differ: {conn_diffs}"
