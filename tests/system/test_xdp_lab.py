"""The xdp target end to end: the lab's xdp topology (the fast path on the firewall's wire-facing bridge ports), deploy,
updates that replace the program atomically, verify against the kernel oracle (the same frames through the plain
namespace), status without drift, undeploy leaving nothing behind."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from hypafilter import netns

from conftest import ROOT, need_root, need_tool

pytestmark = pytest.mark.system

LAB = "exv"  # helper E's lab names start with "e"
STATE = f"/run/hypafilter/test-{LAB}"
HF = [sys.executable, "-m", "hypafilter"]
RULESETS = ("example", "listing1", "userchains", "conntrack")


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


def xdp_prog(ifname: str) -> str | None:
    link = json.loads(netns.run(["ip", "-j", "-d", "link", "show", "dev", ifname], f"{LAB}-fw"))[0]
    return ((link.get("xdp") or {}).get("prog") or {}).get("name")


def test_verify_rulesets_bridge_mode(lab):
    """Each policy in turn (each an update of the one before: a new program swapped in on the bpf_links)."""
    decided = 0
    for name in RULESETS:
        p = hf("verify", str(ROOT / "rulesets" / f"{name}.rules"), "--target", "xdp", "--packets", "1200", "--json")
        r = json.loads(p.stdout)
        assert r["packets"] == 1200 and r["mismatches"] == 0, (name, r["examples"][:3])
        assert 0 < r["delivered_oracle"] < 1200, name
        assert r["nic"]["PKTIN"] == 1200, (name, r["nic"])
        decided += r["hw_forwarded"] + r["hw_dropped"]
        assert xdp_prog("nf0") == xdp_prog("nf1") == "hfx_fastpath"
        st = json.loads(hf("status", "--json").stdout)
        assert st["target"] == "xdp" and st["drift"] == [], st["drift"]
    assert decided > 0  # the fast path decided frames itself, not only shunted them
    pins = sorted(p.name for p in (Path("/sys/fs/bpf/hypafilter-xdp") / LAB).iterdir())
    assert pins[-1] == "links" and len(pins) == 2, pins  # the replaced programs were stopped


def test_undeploy_leaves_nothing(lab):
    hf("deploy", str(ROOT / "rulesets" / "example.rules"), "--target", "xdp", "--json")
    hf("undeploy", "-q")
    assert xdp_prog("nf0") is None and xdp_prog("nf1") is None
    tc = netns.run(["tc", "filter", "show", "dev", "nf0", "ingress"], f"{LAB}-fw")
    assert "hf_tc" not in tc
    assert not os.path.exists(f"/sys/fs/bpf/hypafilter-xdp/{LAB}")
