"""The emulated NIC's IPv6 update buffer rebuilt when idle (docs/ipv6.md "## emu", issue #25), with the kernel as
oracle: an operator's IPv6 ban on a dual-stack deployment goes into the running core's IPv6 update buffer (the same
emulator process); with the buffer in use and no change for HF_REBUILD6_IDLE_S the policy sync service builds the
master rule set's core in a thread and swaps it in make-before-break (ops.policysync.worker's lazy rebuild): a new
core whose IPv6 matcher holds the ban, its IPv6 buffer empty, `status` without drift and `verify --live` (the live
rulesets of both families alone as oracle) 0 mismatches. Opt-in outside CI as test_ipv6_buffer_emu.py (a dual-stack
core build, and the rebuild's: HF_EMU_V6_FULL=1, `make test-emu-v6`)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
from hypafilter import netns
from hypafilter.hw.updatebuffer import Image6

from conftest import TEST_FULL
from tests.hfcli import HfCli
from tests.system.test_deploy import POLICY_A
from tests.system.test_ipv6_deploy import FULL, HW6

pytestmark = [pytest.mark.system, TEST_FULL]  # make test-full

LAB = "w3a"
hf = HfCli(LAB, f"/run/hypafilter/test-{LAB}")
PACKETS = 150
IDLE_S = 3  # the service's idle time before the IPv6 buffer's lazy rebuild (its default: 60 s)
BAN = "2001:db8:1::1:77"  # inside HW6's 2001:db8:1::/48 (its UDP DROP) and outside its iprange; echo-requests ACCEPTed


def _state() -> dict:
    return json.loads((Path(hf.state) / "state.json").read_text())


def _wait(cond, timeout: float, what: str) -> dict:
    deadline = time.monotonic() + timeout
    doc = {}
    while time.monotonic() < deadline:
        doc = hf.service()
        if cond(doc):
            return doc
        time.sleep(0.1)
    raise AssertionError(f"{what} within {timeout:g} s: {doc}")


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    d = tmp_path_factory.mktemp(LAB)
    (d / "a.rules").write_text(POLICY_A)
    (d / "hw6.rules").write_text(HW6)
    os.environ["HF_REBUILD6_IDLE_S"] = str(IDLE_S)  # the service started by the deploy inherits it
    try:
        with hf.deployed_lab("emu", d / "a.rules"):
            yield d
    finally:
        os.environ.pop("HF_REBUILD6_IDLE_S", None)  # (later modules' services keep the default)


@pytest.mark.skipif(not FULL, reason="opt-in outside CI (a dual-stack core build): HF_EMU_V6_FULL=1, make test-emu-v6")
def test_an_idle_ipv6_buffer_is_rebuilt_into_a_new_core(lab):
    hf("deploy", str(lab / "a.rules"), "--ipv6", str(lab / "hw6.rules"), "-q")
    st = _state()
    v6 = st["tables"]["v6"]
    assert v6["depth"] == 16 and Image6.from_dict(v6["overlay"]).pristine, {k: v6[k] for k in v6 if k != "overlay"}
    doc = hf.service()
    applied, rebuilds = (doc.get("ipv6") or {}).get("applied", 0), doc.get("rebuilds", 0)

    netns.run(["ip6tables", "-w", "-I", "FORWARD", "1", "-s", f"{BAN}/128", "-j", "DROP"], f"{LAB}-fw")
    _wait(
        lambda d: (d.get("ipv6") or {}).get("applied", 0) > applied and not d["ipv6"].get("safe") and not d.get("safe"),
        120,
        "the ban was not followed",
    )
    st2 = _state()
    img = Image6.from_dict(st2["tables"]["v6"]["overlay"])
    # into the IPv6 buffer of the same process: one slot (the rebuild's core takes at least a build to come)
    assert st2["nic"] == st["nic"] and [b for b in range(img.depth) if img.enabled(b)] == [0], st2["history"][-1]

    t0 = time.monotonic()
    doc = _wait(
        lambda d: d.get("rebuilds", 0) > rebuilds and not d.get("rebuilding") and not d.get("safe"),
        900,  # a cold core build: about a minute here, ten under another session's load
        "no lazy rebuild swapped a core",
    )
    assert not doc.get("error") and not (doc.get("ipv6") or {}).get("error"), doc
    st3 = _state()
    last = st3["history"][-1]
    print(
        f"idle rebuild of the IPv6 buffer: swapped {time.monotonic() - t0 + IDLE_S:.1f} s after the ban's follow "
        f"(built in {doc.get('rebuild_s')} s, the swap {last.get('duration_s')} s)"
    )
    # a new core whose IPv6 matcher holds the ban (the master rule set), its IPv6 buffer empty again
    assert last["kind"] == "follow" and last["replaced_nic"] and st3["nic"] != st["nic"], last
    assert st3["tables"]["v6"]["matcher"] != v6["matcher"], st3["tables"]["v6"]["matcher"]
    assert Image6.from_dict(st3["tables"]["v6"]["overlay"]).pristine
    assert st3["ipv6"]["hash"] == st2["ipv6"]["hash"]  # the IPv6 policy is the one followed (with the ban)
    p = hf("status", check=False)
    assert p.returncode == 0 and "DRIFT" not in p.stdout, p.stdout
    r = hf.verify_live(packets=PACKETS)
    six = r["ipv6"]
    assert six["mismatches"] == 0 and six["hw"]["decided"] > 0, six
