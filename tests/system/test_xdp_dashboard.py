"""The dashboard, /metrics, status and verify's counter window on the xdp target (issue #14): the XDP program's
per-CPU counters and per-entry hits reach them through the target's counter source.

Frames of known kinds go through the hybrid path (the fast path on the firewall's bridge ports) and the plain path
(the policy alone in netfilter, the oracle), the receive window closing on the fast path's counters. The kernel
decides the verdicts: every hybrid verdict equals the oracle's, and the frames the fast path forwarded are the
frames the oracle delivered (no shunted frame of this policy is delivered). The per-entry hits are checked against
what was sent to each entry: every frame of a kind counts once, on the first entry its header matches."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import httpx
import pytest

from conftest import ROOT
from tests.hfcli import HfCli

pytestmark = pytest.mark.system

LAB = "dxd"
STATE = f"/run/hypafilter/test-{LAB}"
OUTPUT = ROOT / "build" / "test-output"

POLICY = """*filter
:FORWARD DROP [0:0]
-A FORWARD -p udp -m udp --dport 53 -j ACCEPT
-A FORWARD -p tcp -m tcp --dport 22 -j DROP
-A FORWARD -p udp -m udp --dport 9999 -m string --string "BAD" --algo bm -j DROP
-A FORWARD -p tcp -m tcp --dport 80 -j ACCEPT
COMMIT
"""
# kind: (rule index whose hardware entry the frames hit first, None: the policy entry), header, payload, count.
# The string rule is complex: it has no entry of its own, its frames hit the policy entry (which shunts them).
KINDS = {
    "dns": (0, {"proto": 17, "sport": 5353, "dport": 53}, b"q", 40),
    "ssh": (1, {"proto": 6, "sport": 40000, "dport": 22, "flags": 0x02}, b"", 30),
    "bad": (None, {"proto": 17, "sport": 4000, "dport": 9999}, b"xxBADxx", 20),
    "fine": (None, {"proto": 17, "sport": 4000, "dport": 9999}, b"harmless", 10),
    "web": (3, {"proto": 6, "sport": 40001, "dport": 80, "flags": 0x02}, b"", 25),
    "ping": (None, {"proto": 1, "icmp_type": 8, "icmp_code": 0}, b"", 15),
}


hf = HfCli(LAB, STATE)


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    with hf.xdp_lab():
        policy = tmp_path_factory.mktemp("xdpdash") / "known.rules"
        policy.write_text(POLICY)
        hf("deploy", str(policy), "--target", "xdp", "-q")
        yield policy


def metrics(base: str) -> dict[tuple[str, tuple], float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{base}/metrics", timeout=10).text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def wire(m: dict, decision: str) -> float:
    return sum(
        v
        for (name, labels), v in m.items()
        if name == "hypafilter_wire_frames_total" and dict(labels)["decision"] == decision
    )


def rule_hits(m: dict) -> dict:
    """Per policy rule index: hardware first matches; None: the policy entry."""
    ids = {dict(lb)["rule"]: int(dict(lb)["index"]) for (n, lb), _ in m.items() if n == "hypafilter_rule_info"}
    out = {ids[dict(lb)["rule"]]: v for (n, lb), v in m.items() if n == "hypafilter_rule_hardware_hits_total"}
    out[None] = m[("hypafilter_policy_entry_hits_total", ())]
    return out


def exchange_known(policy_file) -> dict:
    """Every kind's frames through both paths, the window closing on the xdp program's counters; compared."""
    from hypafilter.config import Config
    from hypafilter.iptables.document import parse_policy
    from hypafilter.ops import deploy
    from hypafilter.ops.lab import Lab
    from hypafilter.ops.verify import CounterWindow, Probe, build_frame, compare, exchange, load_oracle, quiet_stacks

    lab = Lab(LAB, target="xdp")
    policy = parse_policy(POLICY, str(policy_file), "FORWARD", Config())
    load_oracle(lab.ns_plain, policy)
    state = json.loads((Path(STATE) / "state.json").read_text())
    was = (deploy.LAB_NAME, deploy.STATE_DIR)
    deploy.configure(LAB, STATE)
    try:
        tgt = deploy.target_of(state, Config())
    finally:
        deploy.configure(*was)
    src, dst = (int.from_bytes(bytes(int(x) for x in ip.split(".")), "big") for ip in ("10.0.1.1", "10.0.2.1"))
    probes, uid = [], 1
    for kind, (_, h, payload, count) in KINDS.items():
        for _ in range(count):
            probes.append(Probe(uid, kind, build_frame(uid, {"src": src, "dst": dst, **h}, payload)))
            uid += 1
    ns = {"send": lab.ns_send, "recv": lab.ns_recv, "fw": lab.ns_fw, "plain": lab.ns_plain, "nic": lab.ns_nic}
    for role in ("fw", "plain"):
        lab.flush_conntrack(role)
    with quiet_stacks(ns):
        window = CounterWindow.of(tgt, state["nic"], ns)
        try:
            got = exchange(ns, probes, window=window)
            closed = window.reading()
        finally:
            window.close()
    return {**compare(probes, got), "window": closed}


def test_dashboard_and_metrics_follow_the_fast_path(lab):
    from tests.dashserver import dashboard_server

    sent = sum(k[3] for k in KINDS.values())
    with dashboard_server(LAB, STATE, OUTPUT / "xdp-dashboard-server.log") as base:
        # The baseline: what the dashboard shows once its readings settled (the per-rule reading arrives on a
        # thread of its own), read the same twice a second apart.
        deadline, last = time.monotonic() + 60, None
        while True:
            m0 = metrics(base)
            summary = httpx.get(f"{base}/api/summary", timeout=10).json()
            counts = {k: v for k, v in m0.items() if k[0].endswith("_total")}
            if m0.get(("hypafilter_deployed", ())) == 1.0 and summary["errors"] == [] and counts == last:
                break
            assert time.monotonic() < deadline, f"the dashboard never settled on the xdp deployment: {summary}"
            last = counts
            time.sleep(1.0)
        hits0 = rule_hits(m0)
        r = exchange_known(lab)
        assert r["mismatches"] == 0, r["examples"][:3]
        assert r["delivered_oracle"] == 40 + 25  # the kernel delivers dns and web only
        w = r["window"]
        assert w["nic"]["PKTIN"] == sent and w["tapped"]["plain.nf0.ours"] == sent, w
        # The dashboard's counters move with the traffic: every frame once in the wire partition.
        deadline = time.monotonic() + 30
        while True:
            m1 = metrics(base)
            moved = {d: wire(m1, d) - wire(m0, d) for d in ("forwarded", "dropped", "shunted")}
            hits = {i: v - hits0.get(i, 0) for i, v in rule_hits(m1).items()}
            if sum(moved.values()) == sent and sum(hits.values()) == sent:
                break
            assert time.monotonic() < deadline, (moved, hits)
            time.sleep(0.5)
    print(f"\nxdp dashboard: {moved}, hits per rule {hits}")
    assert moved["forwarded"] == r["delivered_oracle"]  # what the kernel delivered, the fast path forwarded
    assert moved["shunted"] >= 30  # the string rule's frames reach netfilter
    want = {}
    for rule, _, _, count in KINDS.values():
        want[rule] = want.get(rule, 0) + count
    assert hits == want, (hits, want)

    st = json.loads(hf("status", "--json").stdout)
    assert st["target"] == "xdp" and st["drift"] == [], st["drift"]
    c = st["nic_counters"]
    assert c["PKTIN"] >= sent and sum(c["HITS"].values()) >= sent, c


def test_verify_window_closes_on_the_fast_path_counters(lab):
    """`hypafilter verify --target xdp`: the receive window closes on counters (the report says which)."""
    p = hf("verify", str(ROOT / "rulesets" / "example.rules"), "--target", "xdp", "--packets", "600", "--json")
    r = json.loads(p.stdout)
    assert r["mismatches"] == 0, r["examples"][:3]
    w = r["window"]
    assert w["closed_by"] == "counters" and w["nic"]["PKTIN"] == 600 == w["sent"], w
    assert r["nic"]["PKTIN"] == 600


def test_undeploy_then_status(lab):
    hf("undeploy", "-q")
    st = json.loads(hf("status", "--json").stdout)
    assert st == {"deployed": False}
    assert not os.path.exists(f"/sys/fs/bpf/hypafilter-xdp/{LAB}")
