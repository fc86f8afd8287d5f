"""The policy sync lease (issue #23, "with the service down the fast path shunts what it can no longer vouch for"):
the service renews a lease on the fast path (the core's LEASE register; the xdp program's hfx_lease word) while it
runs; killed for good (supervisor and worker, SIGKILL), it renews nothing, the lease runs out and the fast path
decides nothing: a ban made afterwards with iptables holds for every frame, with the kernel as oracle (`verify --live
--unfollowed`: the same frames through the hybrid and through the live ruleset alone). Without the lease (main
before it) the fast path kept deciding by the last tables and let the banned sender through."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import time
from pathlib import Path

import pytest
from hypafilter import netns

from conftest import ROOT, need_root
from tests.hfcli import HfCli

pytestmark = pytest.mark.system

LAB = "tls"
STATE = f"/run/hypafilter/test-{LAB}"
FW = f"{LAB}-fw"
hf = HfCli(LAB, STATE)
BANNED = "10.0.1.1"  # the lab's sender


@pytest.fixture(scope="module", params=["emu", "xdp"])
def lab(request):
    need_root()
    target = request.param
    hf("lab", "down", "--name", LAB, check=False)
    shutil.rmtree(STATE, ignore_errors=True)
    hf("lab", "up", "--name", LAB, *(["--target", "xdp"] if target == "xdp" else []))
    hf("deploy", str(ROOT / "rulesets" / "example.rules"), "--target", target, "-q")
    yield target
    hf("undeploy", "-q", check=False)
    hf("lab", "down", "--name", LAB, check=False)
    shutil.rmtree(STATE, ignore_errors=True)


def state() -> dict:
    return json.loads((Path(STATE) / "state.json").read_text())


def lease() -> dict:
    """The fast path's lease as the deployment's target reads it: {armed, expired, left_ms, ...}."""
    from hypafilter.ops import deploy

    st = state()
    return deploy.target_of(st, deploy.state_config(st)).lease(st["nic"])


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def test_the_lease_is_renewed_while_the_service_runs(lab):
    """Over a few seconds of normal running the lease never runs out: armed, at most its length left, renewed about
    every 150 ms, `status` clean, and the fast path still decides frames (verify --live)."""
    hf.followed()
    want = state()["lease_ms"]
    assert want == 1000
    before = hf.service()["lease_renewals"]
    seen, t0 = [], time.monotonic()
    while time.monotonic() - t0 < 3.0:
        seen.append(lease())
        time.sleep(0.05)
    assert all(x["armed"] and not x["expired"] for x in seen), [x for x in seen if x["expired"] or not x["armed"]]
    # xdp reads the time left against the program's coarse clock, up to a kernel tick (4 ms at HZ 250) behind
    slack = 10 if lab == "xdp" else 0
    assert all(0 < x["left_ms"] <= want + slack for x in seen), [x["left_ms"] for x in seen]
    lows = sorted(x["left_ms"] for x in seen)
    print(f"lease ({lab}): {len(seen)} readings over 3 s, left_ms min {lows[0]}, median {lows[len(lows) // 2]}")
    doc = hf.service()
    assert doc["lease_renewals"] - before >= 10, (before, doc["lease_renewals"])  # ~20 in 3 s at one per 150 ms
    assert doc["lease_interval_ms"]["p99"] < want / 2, doc["lease_interval_ms"]
    print(f"lease renewal interval ({lab}): {doc['lease_interval_ms']}")
    r = hf.verify_live()
    assert r["hw_forwarded"] + r["hw_dropped"] > 0  # the fast path decides
    assert hf("status", check=False).returncode == 0


def test_a_worker_restart_keeps_the_lease(lab):
    """A worker killed alone (SIGKILL): its supervisor makes the fast path fail safe and renews the lease while it
    starts the next worker, which renews it from its start: the lease never runs out meanwhile."""
    hf.followed()
    doc = hf.service()
    restarts = doc.get("restarts", 0)
    os.kill(doc["worker"], signal.SIGKILL)
    t0, seen = time.monotonic(), []
    while time.monotonic() - t0 < 3.0:
        with contextlib.suppress(Exception):  # the NIC is busy with the supervisor's writes: read again
            seen.append(lease())
        time.sleep(0.02)
    assert seen and not any(x["expired"] for x in seen), [x for x in seen if x["expired"]][:3]
    doc = hf.followed()
    assert doc.get("restarts", 0) > restarts, doc
    assert hf("status", check=False).returncode == 0


def test_a_deployment_without_a_lease_disarms_it(lab, tmp_path):
    """policysync_lease_ms = 0: the update disarms the lease (the fast path decides as before the lease, and the
    service keeps it disarmed); a deploy with the default arms it again."""
    cfg = tmp_path / "nolease.toml"
    cfg.write_text("policysync_lease_ms = 0\n")
    example = str(ROOT / "rulesets" / "example.rules")
    hf("deploy", example, "--target", lab, "--config", str(cfg), "-q")
    assert state()["lease_ms"] == 0
    time.sleep(0.5)  # a few of the service's renewals: it must keep it disarmed
    assert lease()["armed"] is False
    assert hf("status", check=False).returncode == 0
    hf("deploy", example, "--target", lab, "-q")
    assert state()["lease_ms"] == 1000
    time.sleep(0.3)
    x = lease()
    assert x["armed"] and not x["expired"] and x["left_ms"] <= 1000 + (10 if lab == "xdp" else 0), x
    hf.followed()


def test_a_ban_made_after_the_service_died_holds(lab):
    """kill -9 of the service's supervisor and worker, then `iptables -I FORWARD 1 -s SENDER -j DROP`: once the lease
    has run out the fast path decides nothing, the ban holds for every frame (0 mismatches against the live
    ruleset alone), `status` says why and exits 1; a deploy repairs it."""
    hf.followed()
    doc = hf.service()
    supervisor = int((Path(STATE) / "policysync.pid").read_text())
    worker = doc["worker"]
    assert alive(supervisor) and alive(worker) and supervisor != worker
    for pid in (supervisor, worker):
        os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 5
    while alive(supervisor) or alive(worker):
        assert time.monotonic() < deadline, "the service survived SIGKILL"
        time.sleep(0.02)
    killed = time.monotonic()
    netns.run(["iptables", "-w", "-I", "FORWARD", "1", "-s", f"{BANNED}/32", "-j", "DROP"], FW)
    lease_s = state().get("lease_ms", 1000) / 1000
    # how long the fast path went on deciding: the lease read back every 10 ms until it says expired (the emulated
    # core's LEASE_STATUS, the xdp word against the program's clock); at most the lease after the kill, less the
    # time since the last renewal, plus the time base's delay (1 ms + 16 cycles; one kernel tick on xdp)
    gone = None
    while time.monotonic() < killed + lease_s + 1.0:
        with contextlib.suppress(Exception):  # a reading that fails is taken again
            if lease()["expired"]:
                gone = time.monotonic() - killed
                break
        time.sleep(0.01)
    assert gone is not None and gone <= lease_s + 0.05, f"the lease ran out {gone} s after the kill (lease {lease_s} s)"
    print(f"lease ({lab}): expired {gone * 1000:.0f} ms after the kill (lease {lease_s * 1000:.0f} ms)")
    time.sleep(max(0.0, killed + lease_s + 0.3 - time.monotonic()))  # past the lease
    r = hf.verify_live(unfollowed=True)  # the kernel with the live ruleset (the ban in it) alone as oracle
    assert r["hw_forwarded"] + r["hw_dropped"] == 0, r  # the fast path decided nothing it could not vouch for
    assert r["delivered_hybrid"] == r["delivered_oracle"] and r["delivered_oracle"] > 0, r
    x = lease()
    assert x["armed"] and x["expired"], x
    p = hf("status", check=False)
    assert p.returncode == 1, p.stdout[-800:]
    assert "the fast path shunts everything: policy sync lease expired" in p.stdout, p.stdout[-800:]
    assert "policysync: the policy sync service is not running" in p.stdout, p.stdout[-800:]
    # repaired: the ban lifted, a deploy restarts the service, which renews the lease
    netns.run(["iptables", "-w", "-D", "FORWARD", "-s", f"{BANNED}/32", "-j", "DROP"], FW)
    hf("deploy", str(ROOT / "rulesets" / "example.rules"), "--target", lab, "-q")
    hf.followed()
    assert not lease()["expired"]
    r = hf.verify_live()
    assert r["hw_forwarded"] + r["hw_dropped"] > 0
    assert hf("status", check=False).returncode == 0


def test_the_xdp_programs_lease_word():
    """The xdp program alone (BPF_PROG_TEST_RUN in a scratch namespace, `bench xdp-cost --lease`): disarmed and armed
    (far ahead) it decides the same frames alike; expired, every frame passes as unparsed (value 0), none decided."""
    need_root()
    from hypafilter.analysis.plan import build_plan
    from hypafilter.config import Config
    from hypafilter.iptables.document import parse_policy
    from hypafilter.tools.bench.xdpcost import xdp_cost

    example = ROOT / "rulesets" / "example.rules"
    policy = parse_policy(example.read_text(), str(example))
    plan = build_plan(policy, Config())
    runs = {w: xdp_cost(plan, policy, frames=300, repeat=1, lease=w)["counters"] for w in ("off", "armed", "expired")}
    assert runs["off"] == runs["armed"], runs
    assert runs["off"].get("CNT_FORWARDED", 0) + runs["off"].get("CNT_DROPPED", 0) > 0, runs["off"]
    assert runs["expired"] == {"PKTIN": 300, "PKTOUT": 300, "CNT_SHUNT_UNPARSED": 300}, runs["expired"]
