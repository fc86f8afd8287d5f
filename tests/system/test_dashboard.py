"""Dashboard acceptance: `hypafilter dashboard` on a deployed emulated system carrying traffic, checked against the
NIC registers and netfilter counters read independently, and the page in headless Debian Chromium."""

from __future__ import annotations

import json
import os
import socket
import sys
import time

import httpx
import pytest
from hypafilter import netns
from hypafilter.ir import FIELDS

from conftest import ROOT, need
from tests.dashserver import chromium, dashboard_server, deploy_example

pytestmark = [pytest.mark.system, pytest.mark.slow]

LAB = "hfdb"

EXAMPLE = ROOT / "rulesets" / "example.rules"
OUTPUT = ROOT / "build" / "test-output"
PY = sys.executable
COPIES = 10  # frames per generated header

SENDER = r"""
import json, sys
from scapy.all import Ether, IP, TCP, UDP, ICMP, Raw, sendp
spec = json.load(sys.stdin)
frames = []
for h in spec["headers"]:
    ip = IP(src=h["src"], dst=h["dst"], proto=h["proto"])
    if h["proto"] == 6:
        l4 = TCP(sport=h["sport"], dport=h["dport"], flags=h["flags"])
    elif h["proto"] == 17:
        l4 = UDP(sport=h["sport"], dport=h["dport"])
    elif h["proto"] == 1:
        l4 = ICMP(type=h["icmp_type"], code=h["icmp_code"])
    else:
        l4 = None
    pkt = Ether(src=spec["src_mac"], dst=spec["dst_mac"]) / (ip / l4 if l4 is not None else ip) / Raw(h["payload"].encode())
    frames += [pkt] * spec["copies"]
sendp(frames, iface=spec["iface"], verbose=False)
print(len(frames))
"""


def _ip(v: int) -> str:
    return socket.inet_ntoa(v.to_bytes(4, "big"))


LAB_SRC, LAB_DST = 0x0A000101, 0x0A000201  # the lab's sender and receiver (10.0.1.1, 10.0.2.1)


def headers_for(policy) -> list[dict]:
    """One header inside each rule's first box (with and without a BAD payload), so every rule can be hit;
    addresses as close to the lab's own as the box allows."""
    out = []
    for rule in policy.rules:
        for box in rule.boxes[:1]:
            lo = dict(zip(FIELDS, box.lo, strict=True))
            hi = dict(zip(FIELDS, box.hi, strict=True))
            if lo["iport"] > 0:
                continue  # the sender is on MAC0
            proto = (
                lo["proto"] if lo["proto"] == hi["proto"] else (17 if lo["proto"] <= 17 <= hi["proto"] else lo["proto"])
            )
            for payload in ("hello", "BAD BAD BAD"):
                out.append(
                    {
                        "src": _ip(min(max(LAB_SRC, lo["src"]), hi["src"])),
                        "dst": _ip(min(max(LAB_DST, lo["dst"]), hi["dst"])),
                        "proto": proto,
                        "sport": max(lo["sport"], 1),
                        "dport": max(lo["dport"], 1),
                        "icmp_type": lo["icmp_type"],
                        "icmp_code": lo["icmp_code"],
                        "flags": box.flags_value or 0x10,
                        "payload": payload,
                    }
                )
    # Traffic of the lab's own addresses that no particular rule was written for (the chain policy's share).
    for dport in (9, 4242):
        out.append(
            {
                "src": "10.0.1.1",
                "dst": "10.0.2.1",
                "proto": 17,
                "sport": 5555,
                "dport": dport,
                "icmp_type": 0,
                "icmp_code": 0,
                "flags": 0,
                "payload": "x",
            }
        )
    return out


def send_traffic(lab, policy) -> int:
    from hypafilter.ops.lab import Lab

    spec = {
        "headers": headers_for(policy),
        "copies": COPIES,
        "iface": "hyb0",
        "src_mac": Lab.mac("send"),
        "dst_mac": Lab.mac("recv"),
    }
    return int(lab.exec_in("send", [PY, "-c", SENDER], input=json.dumps(spec), timeout=120).strip())


@pytest.fixture(scope="module")
def system(lab):
    """The module's own lab (LAB) with rulesets/example.rules deployed on the emulated NIC (undeployed afterwards)."""
    need(EXAMPLE.is_file(), f"{EXAMPLE} is missing")
    policy, state = deploy_example(EXAMPLE)
    yield lab, policy, state


@pytest.fixture(scope="module")
def dashboard(system):
    """`hypafilter dashboard` as an operator starts it (pointed at this module's lab), on a free loopback port."""
    from hypafilter.ops import deploy

    with dashboard_server(LAB, str(deploy.STATE_DIR), OUTPUT / "dashboard-server.log") as base:
        yield base


def settled(base: str, at_least: int, timeout: float = 60.0) -> dict:
    """The summary once the hardware counters reached `at_least` classified frames and stopped moving."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        s = httpx.get(f"{base}/api/summary", timeout=5).json()
        t = s["totals"]
        if t and t["classified"] >= at_least and last and last["seq"] != s["seq"] and last["totals"] == t:
            return s
        last = s
        time.sleep(0.6)
    pytest.fail(f"counters did not settle at >= {at_least} classified frames: {last}")


def nic_counters(state) -> tuple[dict, dict]:
    from hypafilter.targets.nic import NicClient

    with NicClient.emu(state["nic"]["socket"]) as nic:
        counters = nic.counters(hits=True)
    return counters, counters["HITS"]


def main_jump_packets(state) -> int:
    """Packets the base chain sent to the tool's MAIN chain, read with `iptables -L -v -x` (not iptables-save)."""
    out = netns.run(["iptables", "-w", "-t", "filter", "-L", state["base_chain"], "-v", "-x", "-n"], f"{LAB}-fw")
    total = 0
    for line in out.splitlines()[2:]:
        cols = line.split()
        if len(cols) >= 3 and cols[2] == state["main_chain"]:
            total += int(cols[0])
    return total


def test_api_and_metrics_match_independent_reads(system, dashboard):
    lab, policy, state = system
    # Start from counters that have stopped moving: frames queued in the lab from earlier tests can still reach
    # a freshly deployed NIC for a moment after it starts.
    before = settled(dashboard, 0)["totals"]["classified"]
    sent = send_traffic(lab, policy)
    assert sent >= COPIES * len(policy.rules)
    s = settled(dashboard, before + sent)
    t = s["totals"]
    assert s["generation"] == state["generation"] and not s["errors"]

    counters, hits = nic_counters(state)
    assert t["forwarded"] == counters["CNT_FORWARDED"]
    assert t["dropped"] == counters["CNT_DROPPED"]
    by_reason = dict(t["shunted_by_reason"])
    # The lab's own non-IP frames (ARP and the like) are shunted as unparsed at any moment, so the direct read,
    # taken after the snapshot, may count a few more; IPv4 traffic comes only from this test and must agree exactly.
    assert by_reason.pop("unparsed") <= counters["CNT_SHUNT_UNPARSED"]
    assert by_reason == {
        "overrule": counters["CNT_SHUNT_OVERRULE"],
        "policy": counters["CNT_SHUNT_POLICY"],
        "state": counters["CNT_SHUNT_STATE"],
        "forced": counters["CNT_SHUNT_FORCED"],
    }
    # The traffic exercised every path the policy has, and the hardware saw every frame we sent — plus whatever the
    # receiver's own IP stack answers to frames addressed to it (ICMP replies, TCP resets), which come back on wire1.
    assert t["classified"] - before >= sent, (t, counters, before, sent)
    assert t["forwarded"] + t["dropped"] > 0 and t["shunted"] > 0
    assert t["shunt_ratio"] == pytest.approx(t["shunted"] / t["classified"])

    # Every shunted frame reached the firewall's FORWARD chain and its jump into the tool's chains.
    # (Non-IP frames, e.g. ARP, are shunted as unparsed but never traverse the iptables FORWARD chain.)
    main = main_jump_packets(state)
    assert t["netfilter_main_packets"] == main
    assert t["shunted"] - counters["CNT_SHUNT_UNPARSED"] <= main <= t["shunted"]

    rules = httpx.get(f"{dashboard}/api/rules", timeout=5).json()
    assert rules["generation"] == state["generation"] and len(rules["rules"]) == len(policy.rules)
    for row in rules["rules"]:
        assert row["kind"] == ("simple" if policy.rules[row["index"]].is_simple else "complex")
        if row["entry"] is not None:
            assert row["hw_hits"] == hits[row["entry"]], row
    assert rules["policy_entry"]["hw_hits"] == hits[len(hits) - 1]
    assert sum(r["hits"] for r in rules["rules"]) > 0
    complex_rows = [r for r in rules["rules"] if r["kind"] == "complex"]
    if complex_rows and any(not r.is_simple and r.target in ("ACCEPT", "DROP") for r in policy.rules):
        assert sum(r["nf_packets"] for r in complex_rows) > 0, "shunted traffic met no complex rule"

    dep = httpx.get(f"{dashboard}/api/deployment", timeout=5).json()
    assert dep["generation"] == state["generation"] and dep["policy_hash"] == state["policy_hash"]
    assert dep["partition"]["rules"] == state["partition"]["rules"]
    assert dep["partition"]["hardware_entries"] == state["partition"]["entries"]
    assert dep["history"][-1]["duration"] == state["history"][-1]["duration_s"] > 0

    from prometheus_client.parser import text_string_to_metric_families

    fams = {f.name: f for f in text_string_to_metric_families(httpx.get(f"{dashboard}/metrics", timeout=5).text)}
    frames = {(x.labels["decision"], x.labels["reason"]): x.value for x in fams["hypafilter_wire_frames"].samples}
    assert frames[("forwarded", "rule")] >= counters["CNT_FORWARDED"]  # scraped later: never less
    assert frames[("shunted", "overrule")] >= counters["CNT_SHUNT_OVERRULE"]
    assert fams["hypafilter_generation"].samples[0].value == state["generation"]
    assert any(x.name.endswith("_count") and x.value >= 1 for x in fams["hypafilter_update_duration_seconds"].samples)


def test_page_in_headless_chromium_shows_the_api_numbers(system, dashboard):
    from selenium.webdriver.support.ui import WebDriverWait

    lab, policy, _ = system
    # Start from counters that have stopped moving: frames queued in the lab from earlier tests can still reach
    # a freshly deployed NIC for a moment after it starts.
    before = settled(dashboard, 0)["totals"]["classified"]
    sent = send_traffic(lab, policy)

    driver = chromium()
    try:
        driver.get(dashboard + "/")
        # Live data: the page shows the frames just sent, rendered from one snapshot.
        WebDriverWait(driver, 60, poll_frequency=0.3).until(
            lambda d: d.find_element("id", "status").text == "live"
            and int(d.find_element("id", "total-forwarded").get_attribute("data-value") or -1) >= 0
            and sum(
                int(d.find_element("id", i).get_attribute("data-value") or 0)
                for i in ("total-forwarded", "total-dropped", "total-shunted")
            )
            >= before + sent
        )
        settled(dashboard, before + sent)
        time.sleep(1.5)  # one more refresh after the counters settled
        shown = driver.execute_script(
            """
            const v = (id) => document.getElementById(id).dataset.value;
            const rows = {};
            for (const tr of document.querySelectorAll('#rules tbody tr')) {
              rows[tr.dataset.rule] = {hw: tr.querySelector('.hw').dataset.value,
                                       nf: tr.querySelector('.nf').dataset.value,
                                       text: tr.querySelector('.hw').textContent};
            }
            return {seq: document.body.dataset.seq, rulesSeq: document.body.dataset.rulesSeq,
                    fwd: v('total-forwarded'), drop: v('total-dropped'), shunt: v('total-shunted'),
                    fwdText: document.getElementById('total-forwarded').textContent,
                    overrule: v('total-shunt-overrule'), policy: v('total-shunt-policy'),
                    ratio: v('ratio-total'), generation: document.getElementById('generation').textContent,
                    lines: document.querySelectorAll('#chart-rates polyline').length,
                    rows};
            """
        )
        OUTPUT.mkdir(parents=True, exist_ok=True)
        driver.save_screenshot(str(OUTPUT / "dashboard.png"))
    finally:
        driver.quit()

    # Compare with the snapshot the page rendered, fetched from /api by its sequence number.
    snap = httpx.get(f"{dashboard}/api/snapshot", params={"seq": shown["seq"]}, timeout=5).json()
    hw = snap["hw"]
    assert int(shown["fwd"]) == hw["CNT_FORWARDED"]
    assert shown["fwdText"] == f"{hw['CNT_FORWARDED']:,}"
    assert int(shown["drop"]) == hw["CNT_DROPPED"]
    # Forced shunts are also counted under their reason by the core, so they are not added again.
    shunted = sum(hw[c] for c in ("CNT_SHUNT_OVERRULE", "CNT_SHUNT_POLICY", "CNT_SHUNT_UNPARSED"))
    assert int(shown["shunt"]) == shunted
    assert int(shown["overrule"]) == hw["CNT_SHUNT_OVERRULE"] and int(shown["policy"]) == hw["CNT_SHUNT_POLICY"]
    assert float(shown["ratio"]) == pytest.approx(shunted / (hw["CNT_FORWARDED"] + hw["CNT_DROPPED"] + shunted))
    assert shown["generation"] == str(snap["generation"])
    assert shown["lines"] >= 2
    # Counters had settled, so the per-rule table agrees with the settled snapshot too.
    rules = httpx.get(f"{dashboard}/api/rules", timeout=5).json()["rules"]
    assert len(shown["rows"]) == len(rules)
    for r in rules:
        row = shown["rows"][str(r["index"])]
        assert int(row["hw"]) == r["hw_hits"] and int(row["nf"]) == r["nf_packets"]
    assert (OUTPUT / "dashboard.png").stat().st_size > 10_000
    assert os.path.getsize(OUTPUT / "dashboard.png") > 0
