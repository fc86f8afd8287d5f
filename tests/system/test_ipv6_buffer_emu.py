"""The emulated NIC's IPv6 update buffer (docs/ipv6.md "## emu", issue #25), with the kernel as oracle: an operator's
IPv6 ban (`ip6tables -I FORWARD 1 -s ADDR/128 -j DROP`) on a dual-stack deployment is followed by the policy sync
service into the running core's IPv6 update buffer — register writes on the same emulator process, no new core —
and `verify --live` (the live rulesets of both families alone as oracle) finds 0 mismatches among its IPv6 frames.
Opt-in outside CI as test_ipv6_deploy.py's test_dual_stack_emu_hardware (a dual-stack core build: HF_EMU_V6_FULL=1,
`make test-emu-v6`)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from hypafilter import netns

from conftest import TEST_FULL
from tests.hfcli import HfCli
from tests.system.test_deploy import POLICY_A
from tests.system.test_ipv6_deploy import FULL, HW6

pytestmark = [pytest.mark.system, TEST_FULL]  # make test-full

LAB = "w8a"
hf = HfCli(LAB, f"/run/hypafilter/test-{LAB}")
PACKETS = 150
BAN = "2001:db8:1::1:66"  # inside HW6's 2001:db8:1::/48 (its UDP DROP) and outside its iprange; echo-requests ACCEPTed


def _state() -> dict:
    return json.loads((Path(hf.state) / "state.json").read_text())


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    d = tmp_path_factory.mktemp("w8")
    (d / "a.rules").write_text(POLICY_A)
    (d / "hw6.rules").write_text(HW6)
    with hf.deployed_lab("emu", d / "a.rules"):
        yield d


@pytest.mark.skipif(not FULL, reason="opt-in outside CI (a dual-stack core build): HF_EMU_V6_FULL=1, make test-emu-v6")
def test_ipv6_ban_goes_into_the_cores_update_buffer(lab):
    a = str(lab / "a.rules")
    hf("deploy", a, "--ipv6", str(lab / "hw6.rules"), "-q")
    st = _state()
    v6 = st["tables"]["v6"]
    assert v6["depth"] == 16 and v6["static"], {k: v6[k] for k in v6 if k != "overlay"}
    applied = (hf.service().get("ipv6") or {}).get("applied", 0)
    t0 = time.monotonic()
    netns.run(["ip6tables", "-w", "-I", "FORWARD", "1", "-s", f"{BAN}/128", "-j", "DROP"], f"{LAB}-fw")
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        six = hf.service().get("ipv6") or {}
        if six.get("applied", 0) > applied and not six.get("safe") and not hf.service().get("safe"):
            break
        time.sleep(0.05)
    wall = time.monotonic() - t0
    assert six.get("last_how") == "update" and not six.get("error"), six
    st2 = _state()
    last = st2["history"][-1]
    print(f"ban followed: {wall:.2f} s from the ip6tables insert to the release; the update {last.get('duration_s')} s")
    # the same emulator process and binary: register writes, no new core; one IPv6 slot in use
    assert st2["nic"] == st["nic"] and not last["replaced_nic"], last
    img = st2["tables"]["v6"]["overlay"]
    enabled = [b for b in range(len(img["buf"]) // 23) if img["buf"][b * 23 + 21] >> 31]
    assert enabled == [0] and st2["tables"]["v6"]["matcher"] == v6["matcher"], img
    # status reads the IPv6 buffer back (drift): as written
    p = hf("status", check=False)
    assert p.returncode == 0 and "DRIFT" not in p.stdout, p.stdout
    r = hf.verify_live(packets=PACKETS)
    six = r["ipv6"]
    assert six["mismatches"] == 0 and six["hw"]["decided"] > 0, six
