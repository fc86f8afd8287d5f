"""Log mirroring on the xdp lab (docs/xdp.md "Log mirroring"): a bridge's mirrored ACCEPT reaches the receiver exactly
once and unchanged (cloned by the shim's TC program to the paired port), its copy and a mirrored DROP's copy reach
netfilter (counted there), every verdict as the kernel's alone (verify's oracle, duplicates and altered frames
counted as mismatches).

The mirror bits are set by hand (the analysis that sets Plan.mirror from observing rules is helper M's, merged
separately): deploy's build_plan is wrapped to mirror the entries of the first two rules. The chains' mirror leaves
are M's too; here two rules at the top of FORWARD stand in for them: a copy's mark (k << 4) | 0x4 | action is
counted and dropped. After the merge the policy gets a real LOG rule and the test its counter.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
from hypafilter import netns

from conftest import need_root, need_tool

pytestmark = pytest.mark.system

LAB = "xmv"  # helper XM's lab names start with "x"
STATE = f"/run/hypafilter/test-{LAB}"
HF = [sys.executable, "-m", "hypafilter"]

POLICY = """*filter
:FORWARD DROP [0:0]
-A FORWARD -p udp -m udp --dport 7001 -j ACCEPT
-A FORWARD -p udp -m udp --dport 7002 -j DROP
-A FORWARD -p udp -j ACCEPT
-A FORWARD -p tcp -m tcp --dport 80 -j ACCEPT
COMMIT
"""
MIRRORED_RULES = (0, 1)  # rule positions whose entries get the mirror bit (by hand)


def hf(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    env = dict(os.environ, HF_LAB=LAB, HF_STATE_DIR=STATE)
    p = subprocess.run(HF + list(args), capture_output=True, text=True, env=env)
    if check:
        assert p.returncode == 0, f"hypafilter {' '.join(args)}: {p.stderr[-3000:]}"
    return p


@pytest.fixture(scope="module")
def lab():
    need_root()
    need_tool("ip", "iptables-restore", "clang", "cc", "make", "tc", "ethtool", "nft")
    hf("lab", "down", "--name", LAB, check=False)
    shutil.rmtree(STATE, ignore_errors=True)
    hf("lab", "up", "--target", "xdp", "--name", LAB)
    yield LAB
    hf("undeploy", "-q", check=False)
    hf("lab", "down", "--name", LAB, check=False)
    shutil.rmtree(STATE, ignore_errors=True)


def leaf_counts(chain: str, leaves: dict[int, str]) -> dict[int, int]:
    """Packets counted by the stand-in leaf rules (mark value -> packets)."""
    out = netns.run(["iptables", "-w", "-t", "filter", "-L", chain, "-v", "-x", "-n"], f"{LAB}-fw")
    got = {}
    for line in out.splitlines():
        for v, target in leaves.items():
            if f"mark match 0x{v:x}" in line and target in line:
                got[v] = int(line.split()[0])
    assert set(got) == set(leaves), out
    return got


def mirrored_verify(monkeypatch, text: str, chain: str, packets: int) -> tuple[dict, dict[int, int]]:
    """Deploy `text` with the entries of MIRRORED_RULES mirrored, the stand-in leaves at the top of `chain` (a copy
    of an ACCEPT: ACCEPT in host mode, where it is the frame itself, else DROP; a copy of a DROP: DROP), then
    verify; returns verify's report and the copies each leaf counted."""
    import numpy as np
    from hypafilter.config import Config
    from hypafilter.iptables.document import parse_policy
    from hypafilter.ops import deploy, verify

    plans = []
    real = deploy.build_plan

    def build_plan(policy, config=None):
        plan = real(policy, config)
        mirror = np.array([e.rule_index in MIRRORED_RULES for e in plan.entries] + [False], dtype=bool)
        plan.mirror = mirror & ~np.asarray(plan.shunt, dtype=bool)
        plans.append(plan)
        return plan

    monkeypatch.setattr(deploy, "build_plan", build_plan)
    was = (deploy.LAB_NAME, deploy.STATE_DIR)
    deploy.configure(LAB, STATE)
    try:
        hf("undeploy", "-q", check=False)
        policy = parse_policy(text, "mirror.rules", base_chain=chain)
        config = Config(target="xdp")
        deploy.deploy(policy, config, target="xdp")
        plan = plans[-1]
        mirrored = [j for j in range(len(plan.entries)) if plan.mirror[j]]
        assert {plan.entries[j].rule_index for j in mirrored} == set(MIRRORED_RULES), plan.entries
        values = sorted({(int(plan.interval[j]) << 4) | 0x4 | int(plan.actions[j]) for j in mirrored})
        assert {v & 0xF for v in values} == {0x5, 0x6}
        host = chain == "INPUT"
        leaves = {v: "ACCEPT" if host and v & 0xF == 0x5 else "DROP" for v in values}
        for v, target in leaves.items():  # stand-ins for the chains' mirror leaves (helper M)
            netns.run(["iptables", "-w", "-I", chain, "1", "-m", "mark", "--mark", hex(v), "-j", target], f"{LAB}-fw")
        before = leaf_counts(chain, leaves)
        r = verify.verify(policy, config, packets=packets)
        after = leaf_counts(chain, leaves)
    finally:
        deploy.configure(*was)
    copies = {v: after[v] - before[v] for v in values}
    print(json.dumps({k: r[k] for k in ("packets", "mismatches", "duplicates", "altered", "nic", "shim")}), copies)
    return r, copies


def check_copies(r: dict, copies: dict[int, int], exact: bool = True) -> None:
    assert r["mismatches"] == 0 and r["duplicates"] == 0 and r["altered"] == 0, r["examples"][:3]
    nic = r["nic"]
    accept_copies = sum(c for v, c in copies.items() if v & 0xF == 0x5)
    drop_copies = sum(c for v, c in copies.items() if v & 0xF == 0x6)
    assert accept_copies > 0 and drop_copies > 0, copies
    # every mirrored frame's copy reached netfilter exactly once (host mode: those the stack delivers locally reach
    # INPUT, the kernel's alone as well; the others end at routing)
    if exact:
        assert nic["CNT_MIRROR"] == accept_copies + drop_copies, (nic, copies)
    else:
        assert nic["CNT_MIRROR"] >= accept_copies + drop_copies, (nic, copies)
    assert nic["CNT_FORWARDED"] > accept_copies and nic["CNT_DROPPED"] >= drop_copies, nic


def test_bridge_mirrored_accept_arrives_once_and_copies_reach_netfilter(lab, monkeypatch):
    """Bridge mode: the mirrored ACCEPT is cloned to nf1 by TC (arrives once, unchanged: no duplicate, nothing
    altered) and its copy, like a mirrored DROP's, is counted by the leaf and dropped."""
    r, copies = mirrored_verify(monkeypatch, POLICY, "FORWARD", 1200)
    check_copies(r, copies)
    assert r["nic_mode"] == "bridge"


HOST_POLICY = """*filter
:INPUT DROP [0:0]
:FORWARD ACCEPT [0:0]
:OUTPUT ACCEPT [0:0]
-A INPUT -p udp -m udp --dport 7001 -j ACCEPT
-A INPUT -p udp -m udp --dport 7002 -j DROP
-A INPUT -p udp -j ACCEPT
-A INPUT -p tcp -m tcp --dport 80 -j ACCEPT
COMMIT
"""


def test_host_mode_mirrored_accept_is_the_frame(lab, monkeypatch):
    """Host mode: a mirrored ACCEPT is passed itself with reason 4 (no clone; INPUT's leaf accepts it), a mirrored
    DROP's copy is dropped by its leaf; delivery as the kernel's."""
    r, copies = mirrored_verify(monkeypatch, HOST_POLICY, "INPUT", 600)
    check_copies(r, copies, exact=False)
    assert r["nic_mode"] == "host"
    hf("undeploy", "-q", check=False)
