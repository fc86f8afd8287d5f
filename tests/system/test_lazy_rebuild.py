"""The lazy rebuild (SFL, issue #23): changes of the live ruleset fill the update buffer beside the running matcher;
once it is half full the policy sync service builds the master rule set's core (xdp: program) in the background and
swaps it in make-before-break, and the buffer is empty again. Frames get the live ruleset's verdicts before, during
and after (the kernel as oracle: `verify --live`)."""

from __future__ import annotations

import json
import time

import pytest
from hypafilter import netns

from conftest import ROOT
from tests.hfcli import HfCli

pytestmark = pytest.mark.system

LAB = "tlr"
STATE = f"/run/hypafilter/test-{LAB}"
FW = f"{LAB}-fw"
hf = HfCli(LAB, STATE)
BANS = [f"10.0.1.{40 + i}" for i in range(8)]  # half of the default buffer depth (Config.update_buffer = 16)


@pytest.fixture(scope="module", params=["emu", "xdp"])
def lab(request):
    with hf.deployed_lab(request.param, ROOT / "rulesets" / "example.rules") as target:
        yield target


def state() -> dict:
    with open(f"{STATE}/state.json") as f:
        return json.load(f)


def test_a_half_full_buffer_is_rebuilt_into_a_new_core(lab):
    hf.followed()
    first = state()
    assert first["overlay"] is None or not first["overlay"]["slots"], first["overlay"]
    nic0 = first["nic"]
    rebuilds0 = hf.service().get("rebuilds", 0)

    # bans one after the other, each followed through the buffer (no core built), verified on the way
    for i, addr in enumerate(BANS):
        netns.run(["iptables", "-w", "-I", "FORWARD", "1", "-s", f"{addr}/32", "-j", "DROP"], FW)
        hf.followed()
        st = state()
        if hf.service().get("rebuilds", 0) == rebuilds0:  # the rebuild may already have swapped after the last
            assert st["nic"] == nic0, "a ban built a new core instead of using the buffer"
            assert len(st["overlay"]["slots"]) == i + 1, st["overlay"]
        if i == 3:
            r = hf.verify_live()
            assert r["hw_forwarded"] + r["hw_dropped"] > 0  # the fast path decides with the buffer in use

    # half full: the service builds the master rule set's core and swaps it in
    deadline = time.monotonic() + 240
    doc = hf.service()
    while time.monotonic() < deadline:
        doc = hf.service()
        if doc.get("rebuilds", 0) > rebuilds0 and not doc.get("rebuilding"):
            break
        time.sleep(0.5)
    assert doc.get("rebuilds", 0) > rebuilds0, f"no lazy rebuild swapped a core within 240 s: {doc}"
    assert not doc.get("error"), doc
    hf.followed()
    st = state()
    last = st["history"][-1]
    assert last["kind"] == "follow" and last["replaced_nic"], last
    assert st["nic"] != nic0  # a new core (program) runs the master rule set
    assert not (st["overlay"] or {}).get("slots"), st["overlay"]  # ... and the buffer is empty again
    assert all(f"-s {a}/32 -j DROP" in st["plain_rules"] for a in BANS)
    r = hf.verify_live()
    assert r["hw_forwarded"] + r["hw_dropped"] > 0
    st_cli = json.loads(hf("status", "--json").stdout)
    assert st_cli["drift"] == [], st_cli["drift"]
    print(f"lazy rebuild ({lab}): built in {doc.get('rebuild_s')} s, {doc.get('rebuilds')} rebuild(s)")

    # the bans lifted: through the new core's (empty) buffer again, no core built
    for addr in BANS:
        netns.run(["iptables", "-w", "-D", "FORWARD", "-s", f"{addr}/32", "-j", "DROP"], FW)
    hf.followed()
    assert state()["nic"] == st["nic"]
    hf.verify_live()
