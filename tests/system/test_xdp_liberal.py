"""Established TCP decided in XDP with conntrack's default window tracking (nf_conntrack_tcp_be_liberal = 0): on the
xdp target deploy runs the flow sync service in its liberal mode (docs/flowsync.md, "The xdp target: liberal
marks"), which sets IP_CT_TCP_FLAG_BE_LIBERAL on the conntrack entry of every TCP flow that reaches an offloadable
state, so that the XDP program's lookups find them established and liberal (docs/xdp.md, "Conntrack state from the
kernel"). Real TCP connections of 1 MB each way through a conntrack-first policy, compared with the policy alone in
the kernel (`verify --connections`); the flags read back with pyroute2's dump (conntrack -L does not print them);
status, drift and undeploy of the service."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
from hypafilter import netns
from hypafilter.netns import inside
from test_xdp_lab import CT_FIRST  # the conntrack-first policy of the xdp lab's tests

from tests.hfcli import HfCli

pytestmark = pytest.mark.system

LAB = "lxl"
STATE = f"/run/hypafilter/test-{LAB}"
LIBERAL = "net.netfilter.nf_conntrack_tcp_be_liberal"
IP_CT_TCP_FLAG_BE_LIBERAL = 0x08
IPS_SEEN_REPLY = 0x2

STATELESS = "*filter\n:FORWARD DROP [0:0]\n-A FORWARD -p tcp -m tcp --dport 8080 -j ACCEPT\nCOMMIT\n"


hf = HfCli(LAB, STATE)


def set_liberal_sysctl(value: int) -> None:
    for ns in (f"{LAB}-fw", f"{LAB}-plain"):
        netns.run(["sysctl", "-qw", f"{LIBERAL}={value}"], ns)
        assert netns.run(["sysctl", "-n", LIBERAL], ns).strip() == str(value)


@pytest.fixture(scope="module")
def lab():
    with hf.xdp_lab():
        set_liberal_sysctl(0)  # the kernel's default: conntrack tracks TCP windows
        yield LAB


def tcp_entries(ns: str) -> list[dict]:
    """Every IPv4 TCP conntrack entry of `ns` as pyroute2's dump decodes it (not the code under test): ports, status,
    TCP state and the TCP flags of each direction."""
    from pyroute2.netlink.nfnetlink.nfctsocket import NFCTSocket

    with inside(ns):
        s = NFCTSocket()
        s.asyncore.socket  # noqa: B018  (pyroute2 opens its socket lazily: here, inside `ns`)
    out = []
    try:
        for m in s.dump():
            t = m.get_attr("CTA_TUPLE_ORIG").get_attr("CTA_TUPLE_PROTO")
            if t.get_attr("CTA_PROTO_NUM") != 6:
                continue
            tcp = m.get_attr("CTA_PROTOINFO").get_attr("CTA_PROTOINFO_TCP")
            out.append(
                {
                    "sport": t.get_attr("CTA_PROTO_SRC_PORT"),
                    "dport": t.get_attr("CTA_PROTO_DST_PORT"),
                    "status": m.get_attr("CTA_STATUS"),
                    "state": tcp.get_attr("CTA_PROTOINFO_TCP_STATE"),
                    "flags": (
                        tcp.get_attr("CTA_PROTOINFO_TCP_FLAGS_ORIGINAL")[0],
                        tcp.get_attr("CTA_PROTOINFO_TCP_FLAGS_REPLY")[0],
                    ),
                }
            )
    finally:
        s.close()
    return out


def liberal(e: dict) -> bool:
    return all(f & IP_CT_TCP_FLAG_BE_LIBERAL for f in e["flags"])


def service_pid() -> int | None:
    try:
        return int(Path(STATE, "flowsync.pid").read_text())
    except (OSError, ValueError):
        return None


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_established_tcp_is_decided_in_xdp_without_the_sysctl(lab, tmp_path):
    """8 TCP connections of 1 MB each way, nf_conntrack_tcp_be_liberal = 0 on both paths: every connection the
    kernel alone completes completes on the hybrid path, no difference, and a large share of their frames is decided
    in XDP (docs/xdp.md measured 0.0 here before the service marked the entries); the entries of the connections the
    firewall let through carry the liberal flag in both directions, the kernel alone's (plain namespace) none."""
    f = tmp_path / "ctfirst.rules"
    f.write_text(CT_FIRST)
    set_liberal_sysctl(0)
    hf("undeploy", "-q", check=False)
    args = ["--connections", "8", "--connection-kinds", "tcp", "--connection-bytes", "1000000"]
    r = json.loads(hf("verify", str(f), "--target", "xdp", "--packets", "100", *args, "--json").stdout)
    c = r["connections"]
    print("hw_share", c["hw_share"], "nic", c["nic"])
    assert r["mismatches"] == 0 and c["mismatches"] == 0, (r["examples"][:2], c["examples"][:2])
    assert c["completed_oracle"] == c["completed_hybrid"] > 0, c
    assert c["nic"]["CNT_FORWARDED"] > 0 and c["hw_share"] > 0.2, c["nic"]

    fw, plain = tcp_entries(f"{LAB}-fw"), tcp_entries(f"{LAB}-plain")
    replied = [e for e in fw if e["status"] & IPS_SEEN_REPLY]
    assert len(replied) >= c["completed_hybrid"] > 0, fw  # the connections' entries are still there (TIME_WAIT)
    assert all(liberal(e) for e in replied), [e for e in replied if not liberal(e)]
    assert not any(liberal(e) for e in fw if not e["status"] & IPS_SEEN_REPLY)  # never established: not marked
    assert plain and not any(liberal(e) for e in plain), plain

    st = json.loads(hf("status", "--json").stdout)
    fs = st["flowsync"]
    assert fs["wanted"] and fs["running"] and fs["mode"] == "liberal", fs
    assert fs["liberal"] >= len(replied) and fs["errors"] == 0, fs
    assert fs["refreshes"] == fs["evictions"] == 0, fs  # the program refreshes timeouts itself
    assert st["drift"] == [], st["drift"]


def test_service_drift_and_undeploy(lab, tmp_path):
    """A killed service is drift, and deploying the same policy again starts it; undeploy stops it."""
    f = tmp_path / "ctfirst.rules"
    f.write_text(CT_FIRST)
    set_liberal_sysctl(0)
    hf("deploy", str(f), "--target", "xdp", "-q")
    pid = service_pid()
    assert pid and alive(pid)
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    st = json.loads(hf("status", "--json", check=False).stdout)
    assert any(d.startswith("flowsync:") for d in st["drift"]), st["drift"]
    assert st["flowsync"]["wanted"] and not st["flowsync"]["running"]
    hf("deploy", str(f), "--target", "xdp", "-q")  # drift: redeployed
    st = json.loads(hf("status", "--json").stdout)
    assert st["flowsync"]["running"] and st["flowsync"]["mode"] == "liberal" and st["drift"] == [], st
    pid = service_pid()
    assert pid and alive(pid)
    hf("undeploy", "-q")
    deadline = time.monotonic() + 10
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(pid) and service_pid() is None
    assert json.loads(Path(STATE, "flowsync.json").read_text())["running"] is False


def test_sysctl_changed_after_deploy(lab, tmp_path):
    """Deployed while nf_conntrack_tcp_be_liberal = 1, then set to 0 on both paths (conntrack reads it per packet):
    the program decides established TCP only on entries the service marked, never by the sysctl it saw at deploy
    (which it once did: then the hybrid's conntrack tracked windows XDP had hidden from it, and its connections
    failed where the kernel alone completed them). `verify` keeps the deployment (the same policy is live)."""
    f = tmp_path / "ctfirst.rules"
    f.write_text(CT_FIRST)
    hf("undeploy", "-q", check=False)
    try:
        set_liberal_sysctl(1)
        hf("deploy", str(f), "--target", "xdp", "-q")
        st = json.loads(hf("status", "--json").stdout)
        assert st["flowsync"]["wanted"] and st["flowsync"]["mode"] == "liberal" and service_pid(), st["flowsync"]
        set_liberal_sysctl(0)
        args = ["--connections", "8", "--connection-kinds", "tcp", "--connection-bytes", "1000000"]
        r = json.loads(hf("verify", str(f), "--target", "xdp", "--packets", "100", *args, "--json").stdout)
        c = r["connections"]
        print(f"\nsysctl 1 at deploy, 0 after: {c}")
        assert r["mismatches"] == 0 and c["mismatches"] == 0, c["examples"][:2]
        assert c["completed_oracle"] == c["completed_hybrid"] > 0, c
        assert c["hw_share"] > 0.2, c
    finally:
        set_liberal_sysctl(0)
        hf("undeploy", "-q", check=False)


def test_no_service_without_a_conntrack_policy(lab, tmp_path):
    """A policy that reads no conntrack state: deploy starts no service and says why."""
    g = tmp_path / "stateless.rules"
    g.write_text(STATELESS)
    hf("undeploy", "-q", check=False)
    hf("deploy", str(g), "--target", "xdp", "-q")
    st = json.loads(hf("status", "--json").stdout)
    assert st["drift"] == [] and not st["flowsync"]["wanted"] and "conntrack" in st["flowsync"]["reason"], st[
        "flowsync"
    ]
    assert service_pid() is None
    hf("undeploy", "-q")
