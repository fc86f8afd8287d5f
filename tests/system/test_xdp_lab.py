"""The xdp target end to end: the lab's xdp topology (the fast path on the firewall's wire-facing bridge ports), deploy,
updates that replace the program atomically, verify against the kernel oracle (the same frames through the plain
namespace), status without drift, undeploy leaving nothing behind."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from hypafilter import netns

from conftest import ROOT, TEST_FULL, full_beyond
from tests.hfcli import HfCli

pytestmark = pytest.mark.system

LAB = "exv"
STATE = f"/run/hypafilter/test-{LAB}"
RULESETS = ("example", "listing1", "userchains", "conntrack", "interfaces")


hf = HfCli(LAB, STATE)


@pytest.fixture(scope="module")
def lab():
    with hf.xdp_lab():
        yield LAB


def xdp_prog(ifname: str) -> str | None:
    link = json.loads(netns.run(["ip", "-j", "-d", "link", "show", "dev", ifname], f"{LAB}-fw"))[0]
    return ((link.get("xdp") or {}).get("prog") or {}).get("name")


def test_verify_rulesets_bridge_mode(lab):
    """Each policy in turn (each an update of the one before: a new program swapped in on the bpf_links)."""
    decided = 0
    for name in RULESETS:
        toml = ROOT / "rulesets" / f"{name}.toml"  # interfaces.rules: compiled for the lab's bridge and ports
        extra = ["--config", str(toml)] if toml.exists() else []
        p = hf(
            "verify", str(ROOT / "rulesets" / f"{name}.rules"), *extra, "--target", "xdp", "--packets", "1200", "--json"
        )
        r = json.loads(p.stdout)
        assert r["packets"] == 1200 and r["mismatches"] == 0, (name, r["examples"][:3])
        assert 0 < r["delivered_oracle"] < 1200, name
        assert r["nic"]["PKTIN"] == 1200, (name, r["nic"])
        decided += r["hw_forwarded"] + r["hw_dropped"]
        assert xdp_prog("nf0") == xdp_prog("nf1") == "hfx_fastpath"
        hf.followed()  # status exits 1 while the policy sync service applies a change (loud): settled first
        st = json.loads(hf("status", "--json").stdout)
        assert st["target"] == "xdp" and st["drift"] == [], st["drift"]
    assert decided > 0  # the fast path decided frames itself, not only shunted them
    pins = sorted(p.name for p in (Path("/sys/fs/bpf/hypafilter-xdp") / LAB).iterdir())
    assert pins[-1] == "links" and len(pins) == 2, pins  # the replaced programs were stopped


def test_update_that_keeps_the_shape_is_a_map_update(lab, tmp_path):
    """A complex rule's string and a simple rule's action changed: the same program, new map contents."""
    text = (ROOT / "rulesets" / "example.rules").read_text()
    changed = text.replace('9999 -m string --string "BAD"', '9999 -m string --string "EVIL"', 1)
    changed = changed.replace("-d 10.0.2.0/25 -p udp -j DROP", "-d 10.0.2.0/25 -p udp -j ACCEPT", 1)
    assert changed.count("EVIL") == 1 and changed != text
    (tmp_path / "b.rules").write_text(changed)
    hf("deploy", str(ROOT / "rulesets" / "example.rules"), "--target", "xdp", "--json")
    r = json.loads(hf("verify", str(tmp_path / "b.rules"), "--target", "xdp", "--packets", "1200", "--json").stdout)
    assert r["mismatches"] == 0, r["examples"][:3]
    st = json.loads(hf("status", "--json").stdout)
    assert st["history"][-1]["replaced_nic"] is False and st["drift"] == []


# two steps in make test (the emulated NIC's test_deploy fails every step of its own), all four in make test-full
@pytest.mark.parametrize("step", full_beyond(["netfilter", "registers", "activate", "standby-old"], keep=2))
def test_failed_update_keeps_the_previous_program(lab, step, tmp_path):
    """An update to a new program that fails at `step` rolls back: the previous program on every link, its
    tables and CONTROL, the previous chains; verify still agrees with the oracle. (A program without an update
    buffer: the running one's buffer would take this change without a new program.)"""
    example = str(ROOT / "rulesets" / "example.rules")
    hf("deploy", example, "--target", "xdp", "--json")
    before = json.loads(hf("status", "--json").stdout)
    nobuf = tmp_path / "nobuf.toml"
    nobuf.write_text("update_buffer = 0\n")
    p = hf(
        "deploy",
        str(ROOT / "rulesets" / "listing1.rules"),
        "--target",
        "xdp",
        "--config",
        str(nobuf),
        "-q",
        check=False,
        fail=step,
    )
    assert p.returncode != 0 and step in p.stderr, p.stderr[-2000:]
    st = json.loads(hf("status", "--json").stdout)
    assert st["generation"] == before["generation"] and st["drift"] == [], st["drift"]
    assert sorted(x.name for x in (Path("/sys/fs/bpf/hypafilter-xdp") / LAB).iterdir())[-1] == "links"
    assert len(list((Path("/sys/fs/bpf/hypafilter-xdp") / LAB).iterdir())) == 2  # the new program is gone
    r = json.loads(hf("verify", example, "--target", "xdp", "--packets", "600", "--json").stdout)
    assert r["mismatches"] == 0 and r["generation"] == before["generation"]


@TEST_FULL  # make test-full
@pytest.mark.parametrize("seed", [1, 2])
def test_fuzz_policies(lab, seed):
    """The kernel-differential fuzzer's policies (every shunting mode x software strategy, every frame kind, half of
    them malformed) through the xdp path against the oracle; seed 2 reads conntrack state."""
    from hypafilter.config import Config
    from hypafilter.iptables.document import parse_policy
    from hypafilter.ops import deploy
    from hypafilter.ops.verify import FRAME_KINDS
    from hypafilter.tools.fuzz import Tally, fuzz_policy, random_policy

    hf("undeploy", "-q", check=False)
    text = random_policy(seed, conntrack=seed % 2 == 0)
    policy = parse_policy(text, filename=f"fuzz-{seed}", base_chain="FORWARD", config=Config())
    was = (deploy.LAB_NAME, deploy.STATE_DIR)
    deploy.configure(LAB, STATE)
    try:
        tally = fuzz_policy(policy, seed, 300, FRAME_KINDS, 0.5, tally=Tally(), target="xdp")
    finally:
        deploy.configure(*was)
    bad = sum(v["mismatches"] for v in tally.by_kind.values())
    altered = sum(r["altered"] for r in tally.runs)
    assert bad == 0 and altered == 0, f"seed {seed}: {bad} mismatches, {altered} altered\n{tally.examples[:4]}"


def test_host_mode(lab, tmp_path):
    """An INPUT policy: the fast path's ACCEPT passes the frame up with the decided value (mark 0x1), INPUT takes it."""
    import re

    src = (ROOT / "tests" / "system" / "test_host_mode.py").read_text()
    f = tmp_path / "host.rules"
    f.write_text(re.search(r'HOST_POLICY = """(.*?)"""', src, re.S).group(1))
    hf("undeploy", "-q", check=False)  # a deployment is not moved between modes by an update
    p = hf("verify", str(f), "--chain", "INPUT", "--target", "xdp", "--packets", "1200", "--json")
    r = json.loads(p.stdout)
    assert r["nic_mode"] == "host" and r["mismatches"] == 0, r["examples"][:3]
    assert r["hw_forwarded"] > 0 and 0 < r["delivered_oracle"] < 1200


CT_FIRST = """*filter
:FORWARD DROP [0:0]
-A FORWARD -m conntrack --ctstate ESTABLISHED,RELATED -j ACCEPT
-A FORWARD -p tcp -m tcp --dport 8080 -m conntrack --ctstate NEW -j ACCEPT
-A FORWARD -p udp -m udp --dport 5353 -j ACCEPT
-A FORWARD -p icmp -j ACCEPT
-A FORWARD -p tcp -j DROP
COMMIT
"""

LATE_CT = """*filter
:FORWARD DROP [0:0]
-A FORWARD -p icmp -m icmp --icmp-type echo-request -j ACCEPT
-A FORWARD -p tcp -m tcp --dport 22 -j DROP
-A FORWARD -m conntrack --ctstate ESTABLISHED,RELATED -j ACCEPT
-A FORWARD -p tcp -m tcp --dport 8080 --tcp-flags FIN,SYN,RST,ACK SYN -j ACCEPT
-A FORWARD -p udp -m udp --dport 5353 -j ACCEPT
-A FORWARD -p tcp -j DROP
COMMIT
"""


def test_conntrack_connections(lab, tmp_path):
    """Real TCP and UDP connections through a conntrack-first policy (the lab's two paths have different
    addresses, so the policy names none): every connection the oracle completes completes on the hybrid path."""
    hf("undeploy", "-q", check=False)  # after test_host_mode's INPUT policy (a FORWARD one needs bridge mode)
    f = tmp_path / "ctfirst.rules"
    f.write_text(CT_FIRST)
    p = hf("verify", str(f), "--target", "xdp", "--packets", "300", "--connections", "8", "--json")
    r = json.loads(p.stdout)
    c = r["connections"]
    assert r["mismatches"] == 0 and c["mismatches"] == 0, (r["examples"][:3], c["examples"][:3])
    assert c["completed_oracle"] == c["completed_hybrid"] > 0, c
    assert c["by_kind"]["tcp"]["completed"] > 0 and c["by_kind"]["udp"]["completed"] > 0, c
    # UDP replies and later datagrams of connections conntrack holds as replied: decided in XDP (ct from the kernel's
    # table); TCP once the flow sync service has marked the entry liberal (docs/xdp.md, test_xdp_liberal.py).
    assert c["nic"]["CNT_FORWARDED"] > 0, c["nic"]


def test_conntrack_tcp_liberal(lab, tmp_path):
    """With nf_conntrack_tcp_be_liberal = 1 (in both namespaces: the oracle alike) established TCP segments are
    decided in XDP as with 0 (the flow sync service's marks decide, not the sysctl: test_xdp_liberal.py); 1 MB each
    way per connection, every connection completing as on the oracle path."""
    f = tmp_path / "ctfirst.rules"
    f.write_text(CT_FIRST)
    key = "net.netfilter.nf_conntrack_tcp_be_liberal"
    spaces = (f"{LAB}-fw", f"{LAB}-plain")
    for ns in spaces:
        netns.run(["sysctl", "-qw", f"{key}=1"], ns)
    try:
        hf("undeploy", "-q", check=False)  # deploy reads the sysctls
        args = ["--connections", "8", "--connection-kinds", "tcp", "--connection-bytes", "1000000"]
        r = json.loads(hf("verify", str(f), "--target", "xdp", "--packets", "100", *args, "--json").stdout)
    finally:
        for ns in spaces:
            netns.run(["sysctl", "-qw", f"{key}=0"], ns)
        hf("undeploy", "-q", check=False)
    c = r["connections"]
    assert r["mismatches"] == 0 and c["mismatches"] == 0, c["examples"][:2]
    assert c["completed_oracle"] == c["completed_hybrid"] > 0, c
    assert c["hw_share"] > 0.2, c


def test_miss_forcing(lab, tmp_path):
    """Entries before a conntrack rule would decide in the fast path; miss forcing (CONTROL bits 4/5) sends every
    such frame to software with reason 3 instead, and nothing differs from the kernel oracle."""
    f = tmp_path / "latect.rules"
    f.write_text(LATE_CT)
    r = json.loads(hf("verify", str(f), "--target", "xdp", "--packets", "1200", "--json").stdout)
    assert r["mismatches"] == 0, r["examples"][:3]
    assert r["nic"]["CNT_SHUNT_STATE"] > 0 and r["nic"]["CNT_FORWARDED"] == 0, r["nic"]
    st = json.loads(hf("status", "--json").stdout)
    assert st["drift"] == [], st["drift"]


def test_undeploy_leaves_nothing(lab):
    hf("undeploy", "-q", check=False)
    hf("deploy", str(ROOT / "rulesets" / "example.rules"), "--target", "xdp", "--json")
    hf("undeploy", "-q")
    assert xdp_prog("nf0") is None and xdp_prog("nf1") is None
    tc = netns.run(["tc", "filter", "show", "dev", "nf0", "ingress"], f"{LAB}-fw")
    assert "hf_tc" not in tc
    assert not os.path.exists(f"/sys/fs/bpf/hypafilter-xdp/{LAB}")
