"""An IPv6 policy alone, and IPv6 drift after a follow (docs/ipv6.md "An IPv6 policy alone", "Following ip6tables").

- `deploy -6 V6POLICY` without an IPv4 policy: the IPv4 side is iptables' live ruleset as it is (the policy is the
  kernel's live ruleset), said in deploy's log and in status; `verify -6` takes the same IPv4 side and finds 0
  mismatches against the kernel; `update -6` replaces the IPv6 side only (the IPv4 side kept under its name), one
  whose ip6tables load fails changes nothing; undeploy gives ip6tables back and leaves iptables as it was. Stage 1 on
  the emulated NIC (`emu_ipv6 = false`): an IPv4-only core, the one test_deploy's POLICY_A builds.
- Opt-in (CI, or HF_EMU_V6_FULL=1 / `make test-emu-v6`; a dual-stack core, cached with test_ipv6_deploy's): after the
  policy sync service followed an ip6tables change on the NIC's dual-stack core, a later change the service has not
  applied (its worker stopped) is drift in `status` again, and no longer once the service applied it. On main
  (1094066) status said nothing: the follow recorded no fingerprint of ip6tables there.

- Opt-in (HF_XDP_V6_FULL=1, `make test-xdp-v6`; lab `w2e`, 13 s): the same on xdp from a dual-stack deployment.

Lab `w2a`."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import time
from pathlib import Path

import pytest
from hypafilter import netns

from conftest import TEST_FULL
from tests.hfcli import HfCli
from tests.system.test_deploy import POLICY_A
from tests.system.test_ipv6_deploy import HW6, V6

pytestmark = pytest.mark.system

LAB = "w2a"
hf = HfCli(LAB, f"/run/hypafilter/test-{LAB}")
FW = f"{LAB}-fw"
PACKETS = 60
FULL = os.environ.get("HF_EMU_V6_FULL", "") not in ("", "0") or os.environ.get("CI") == "true"


def _save6() -> str:
    text = netns.run(["ip6tables-save"], FW)
    return "\n".join(re.sub(r"\[\d+:\d+\]", "", ln) for ln in text.splitlines() if not ln.startswith("#"))


def _ops4() -> str:
    """iptables' filter table without counters, comments and the tool's chains and jumps: the operator's ruleset."""
    text = netns.run(["iptables-save", "-t", "filter"], FW)
    return "\n".join(
        re.sub(r"\[\d+:\d+\]", "", ln)
        for ln in text.splitlines()
        if not ln.startswith("#") and not re.search(r"(^:| )HF\d+_", ln)
    )


def _state() -> dict | None:
    f = Path(hf.state) / "state.json"
    return json.loads(f.read_text()) if f.exists() else None


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("w2a")
    (d / "a.rules").write_text(POLICY_A)
    (d / "v6.rules").write_text(V6)
    (d / "v6b.rules").write_text(V6.replace("--dport 80", "--dport 81"))
    (d / "hw6.rules").write_text(HW6)
    (d / "stage1.toml").write_text("emu_ipv6 = false\n")
    return d


@pytest.fixture(scope="module")
def lab(files):
    """The emu lab, nothing deployed, the operator's IPv4 ruleset (POLICY_A) in the firewall's iptables."""
    from conftest import need_root

    need_root()
    hf("lab", "down", "--name", LAB, check=False)
    shutil.rmtree(hf.state, ignore_errors=True)
    hf("lab", "up", "--name", LAB)
    netns.run(["iptables-restore", "-w"], FW, input=POLICY_A)
    yield LAB
    if _state():
        hf("undeploy", "-q", check=False)
    hf("lab", "down", "--name", LAB, check=False)
    shutil.rmtree(hf.state, ignore_errors=True)


def test_ipv6_policy_alone(lab, files):
    stage1 = ("--config", str(files / "stage1.toml"))
    ops4, ops6 = _ops4(), _save6()
    p = hf("deploy", "-6", str(files / "v6.rules"), *stage1)
    said = f"-6: the IPv4 side is the firewall's live IPv4 ruleset as it is (iptables-save -t filter ({FW}))"
    assert said in p.stderr, p.stderr
    st = _state()
    assert st["policy_source"] == f"iptables-save -t filter ({FW})" and st["ipv6"]["source"].endswith("v6.rules")
    assert st["partition"]["rules"] == 5  # POLICY_A's rules
    assert _ops4() == ops4  # the IPv4 filtering as the operator had it (the tool's jump first)
    status = hf("status").stdout  # exits 0: no drift
    assert f"policy   iptables-save -t filter ({FW})" in status and "ipv6     IPv6 policy" in status, status
    p = hf("verify", "-6", str(files / "v6.rules"), *stage1, "--packets", str(PACKETS), "--json", check=False)
    r = json.loads(p.stdout)
    assert p.returncode == 0 and r["mismatches"] == 0 and r["ipv6"]["packets"] == r["packets"] == PACKETS, r["ipv6"]
    assert r["generation"] == st["generation"]  # verify -6 took the same IPv4 side: nothing redeployed
    assert 0 < r["ipv6"]["delivered_oracle"] < PACKETS
    # update -6: one whose ip6tables load fails changes nothing; then the IPv6 side replaced, the IPv4 side kept
    before = (_ops4(), _save6())
    p = hf("update", "-6", str(files / "v6b.rules"), *stage1, "-q", check=False, fail="netfilter6")
    assert p.returncode != 0 and "netfilter6" in p.stderr, p.stderr[-2000:]
    assert (_ops4(), _save6()) == before
    assert (_state()["generation"], _state()["ipv6"]) == (st["generation"], st["ipv6"])
    p = hf("update", "-6", str(files / "v6b.rules"), *stage1)
    assert f"the IPv4 side is the deployed IPv4 policy iptables-save -t filter ({FW})" in p.stderr, p.stderr
    st2 = _state()
    assert (st2["policy_hash"], st2["policy_source"]) == (st["policy_hash"], st["policy_source"])
    assert st2["ipv6"]["source"].endswith("v6b.rules") and "--dport 81" in _save6()
    hf("undeploy", "-q")
    assert _save6() == ops6 and _ops4() == ops4


@TEST_FULL  # make test-full
@pytest.mark.skipif(not FULL, reason="opt-in outside CI (a dual-stack core): HF_EMU_V6_FULL=1, make test-emu-v6")
def test_ipv6_drift_after_follow_emu(lab, files):
    a = str(files / "a.rules")
    hf("deploy", a, "--ipv6", str(files / "hw6.rules"), "-q")
    assert _state()["tables"].get("v6"), "the NIC's dual-stack core decides IPv6 frames"

    def applied_after(n: int) -> dict:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            six = hf.service().get("ipv6") or {}
            if six.get("applied", 0) > n and not six.get("safe") and not hf.service().get("safe"):
                return six
            time.sleep(0.1)
        raise AssertionError(f"the service did not apply the ip6tables change: {hf.service().get('ipv6')}")

    # a complex rule (the same core: register writes), followed by the service: the deployment's IPv6 side, no drift
    n = (hf.service().get("ipv6") or {}).get("applied", 0)
    netns.run(["ip6tables", "-w", "-I", "FORWARD", "1", "-p", "tcp", "--dport", "8443", "-j", "REJECT"], FW)
    six = applied_after(n)
    assert six.get("last_how") == "update" and not six.get("error"), six
    assert hf("status", check=False).returncode == 0
    # the worker stopped: a later change is not applied, and status says the IPv6 side drifted
    worker = hf.service()["worker"]
    os.kill(worker, signal.SIGSTOP)
    try:
        netns.run(["ip6tables", "-w", "-I", "FORWARD", "1", "-p", "tcp", "--dport", "8444", "-j", "REJECT"], FW)
        p = hf("status", check=False)
        assert p.returncode == 1 and "DRIFT    ip6tables: changed" in p.stdout, p.stdout[:2000]
        n = (hf.service().get("ipv6") or {}).get("applied", 0)
    finally:
        os.kill(worker, signal.SIGCONT)
    applied_after(n)  # applied: the live ip6tables is the deployment's IPv6 side again
    p = hf("status", check=False)
    assert p.returncode == 0 and "ip6tables: changed" not in p.stdout, p.stdout[:2000]


XDP_LAB = "w2e"


@pytest.mark.optin("HF_XDP_V6_FULL")  # make test-xdp-v6
def test_ipv6_policy_alone_xdp(files):
    """The same on xdp, the IPv6 side decided in the XDP program: with a dual-stack deployment, `deploy -6` replaces
    the IPv6 side only (the IPv4 policy's hash and name kept); `verify -6` finds it deployed and 0 mismatches."""
    from conftest import need_root

    need_root()
    x = HfCli(XDP_LAB, f"/run/hypafilter/test-{XDP_LAB}")
    x("lab", "down", "--name", XDP_LAB, check=False)
    shutil.rmtree(x.state, ignore_errors=True)
    try:
        x("lab", "up", "--target", "xdp", "--name", XDP_LAB)
        x("deploy", str(files / "a.rules"), "--ipv6", str(files / "v6.rules"), "--target", "xdp", "-q")
        st = json.loads((Path(x.state) / "state.json").read_text())
        p = x("deploy", "-6", str(files / "hw6.rules"), "--target", "xdp")
        assert f"the IPv4 side is the deployed IPv4 policy {files / 'a.rules'}" in p.stderr, p.stderr
        st2 = json.loads((Path(x.state) / "state.json").read_text())
        assert (st2["policy_hash"], st2["policy_source"]) == (st["policy_hash"], st["policy_source"])
        assert st2["ipv6"]["source"].endswith("hw6.rules") and st2["tables"]["v6"]["entries"] > 0
        p = x("verify", "-6", str(files / "hw6.rules"), "--target", "xdp", "--packets", "100", "--json", check=False)
        r = json.loads(p.stdout)
        assert p.returncode == 0 and r["mismatches"] == 0 and r["generation"] == st2["generation"], r["ipv6"]
        assert r["nic"]["CNT_SHUNT_UNPARSED"] < 50, r["nic"]  # the program decided most IPv6 frames
    finally:
        x("undeploy", "-q", check=False)
        x("lab", "down", "--name", XDP_LAB, check=False)
        shutil.rmtree(x.state, ignore_errors=True)
