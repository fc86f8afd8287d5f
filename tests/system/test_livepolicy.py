"""The live ruleset is the policy (issue #23): after deploy the operator's chains stay in the kernel under their own
names, and what `iptables` (as fail2ban, ufw and Docker do) changes there holds on the hybrid path exactly as in the
kernel alone, through the policy sync service: `verify --live` sends the same frames through the hybrid and through
a namespace holding the live ruleset alone (the kernel as oracle)."""

from __future__ import annotations

import json
import time

import pytest
from hypafilter import netns

from conftest import ROOT, TEST_FULL
from tests.hfcli import HfCli

pytestmark = pytest.mark.system

LAB = "tlv"
STATE = f"/run/hypafilter/test-{LAB}"
FW = f"{LAB}-fw"
hf = HfCli(LAB, STATE)


# the emulated NIC's run in make test-full: its follow of a ban is in make test through test_policysync_lease[emu],
# test_lazy_rebuild[emu], test_tree_strategy's live K0 tree on it and test_emu_sets (docs/testing.md)
@pytest.fixture(scope="module", params=[pytest.param("emu", marks=TEST_FULL), "xdp"])
def lab(request):
    with hf.deployed_lab(request.param, ROOT / "rulesets" / "example.rules") as target:
        yield target


def ipt(*args: str) -> None:
    netns.run(["iptables", "-w", *args], FW)


def settled(applied: int, timeout: float = 30.0) -> dict:
    """The service's status once it applied `applied` changes in all and shunts nothing for a change any more."""
    deadline = time.monotonic() + timeout
    doc = hf.service()
    while time.monotonic() < deadline:
        doc = hf.service()
        if doc.get("applied", 0) >= applied and not doc.get("safe") and doc.get("following"):
            return doc
        time.sleep(0.1)
    raise AssertionError(f"the policy sync service did not apply {applied} changes: {doc}")


def test_bans_hold_on_the_hybrid_path_and_lift(lab):
    st = json.loads(hf("status", "--json").stdout)
    assert st["drift"] == [] and st["policysync"]["running"], st.get("drift")
    forward = netns.run(["iptables", "-S", "FORWARD"], FW).splitlines()
    assert forward[1] == f"-A FORWARD -j {st['main_chain']}" and "-A FORWARD -s 10.0.1.13/32 -j DROP" in forward
    base = hf.service().get("applied", 0)

    # a fail2ban-style ban at the top of the operator's chain
    ipt("-I", "FORWARD", "1", "-s", "10.0.1.1/32", "-j", "DROP")
    doc = settled(base + 1)
    assert doc["lag_safe_ms"]["n"] >= 1
    r = hf.verify_live()
    assert r["hw_forwarded"] + r["hw_dropped"] > 0  # the fast path still decides, with the ban in it
    live = netns.run(["iptables", "-S", "FORWARD"], FW).splitlines()
    assert live[1].startswith("-A FORWARD -j HF") and live[2] == "-A FORWARD -s 10.0.1.1/32 -j DROP", live
    assert hf("status", check=False).returncode == 0

    # a ban inside a user chain the operator's chain jumps to (ufw, Docker's DOCKER-USER)
    ipt("-N", "BANS")
    ipt("-A", "BANS", "-s", "10.0.1.0/28", "-p", "udp", "-j", "DROP")
    ipt("-I", "FORWARD", "3", "-j", "BANS")
    settled(base + 2)
    hf.verify_live()

    # lifted: both gone, the policy is the deployed one again
    ipt("-D", "FORWARD", "-s", "10.0.1.1/32", "-j", "DROP")
    ipt("-D", "FORWARD", "-j", "BANS")
    ipt("-F", "BANS")
    ipt("-X", "BANS")
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        st = json.loads(hf("status", "--json", check=False).stdout)  # exits 1 while a change is being applied
        if (
            st["policysync"].get("following")
            and not st["policysync"].get("safe")
            and "10.0.1.1" not in st.get("plain_rules", "")
        ):
            break
        time.sleep(0.2)
    r = hf.verify_live()
    assert r["hw_forwarded"] + r["hw_dropped"] > 0
    assert hf("status", check=False).returncode == 0
    doc = hf.service()
    print(
        f"policysync: {doc['applied']} changes applied, fail-safe lag {doc['lag_safe_ms']} ms, applied lag {doc['lag_apply_ms']} ms"
    )
    assert doc["own"] >= 1  # its own restores were recognised, not taken for the operator's


def test_bench_churn_follows_iptables_at_five_per_second(lab):
    """`hypafilter bench churn`: bans inserted and deleted with iptables under traffic; every command's lag is
    measured (the fast path no longer decides by the old policy), and the kernel finds no mismatch afterwards."""
    p = hf(
        "bench",
        "churn",
        str(ROOT / "rulesets" / "example.rules"),
        "--target",
        lab,
        "--rates",
        "5",
        "--seconds",
        "3",
        "--frames",
        "500",
        "--json",
    )
    r = json.loads(p.stdout.splitlines()[-1])
    print(f"bench churn ({lab}): {r}")
    assert r["target"] == lab and r["updates"] >= 12 and r["mismatches"] == 0, r
    assert r["lag_p50_ms"] is not None and r["lag_p99_ms"] < 30_000 and r["applied"] >= 1, r
    assert r["buffer_updates"] >= 1 and r["cores_built"] == 0, r  # the bans went through the update buffer
    # the share over the window, unless a new core replaced the NIC (its counters start again)
    assert (r["hw_share"] is None and r["cores_built"] > 0) or 0 <= r["hw_share"] <= 1, r
    assert hf("status", check=False).returncode == 0


def test_update_defaults_to_the_deployed_target(lab, tmp_path):
    """`update` without --target updates the deployed target (xdp included), here with one more simple rule."""
    changed = tmp_path / "changed.rules"
    text = (ROOT / "rulesets" / "example.rules").read_text()
    changed.write_text(text.replace("COMMIT", "-A FORWARD -s 10.0.1.77/32 -j DROP\nCOMMIT"))
    r = json.loads(hf("update", str(changed), "--json").stdout)
    st = json.loads(hf("status", "--json").stdout)
    assert r["changed"] and st["target"] == lab and st["policy_source"] == str(changed), (r, st["target"])
    print(f"update ({lab}) with one more simple rule: {r['duration_s']} s, steps {r['steps']}")
    hf("update", str(ROOT / "rulesets" / "example.rules"), "-q")


def test_a_deploys_commits_read_after_it_ended_are_its_own(lab):
    """An update commits twice (the load, then the removal of the previous generation's chains). A service that
    reads those events only after the deploy let go of its lock (a loaded machine; here its worker stopped during
    the update) must take both for the deploy's: no change, no fail safe, `status` clean at once."""
    import os
    import signal

    hf.followed()
    before = hf.service()
    worker = before["worker"]
    os.kill(worker, signal.SIGSTOP)
    try:
        hf("update", str(ROOT / "rulesets" / "example.rules"), "--force", "-q")
    finally:
        os.kill(worker, signal.SIGCONT)
        resumed = time.time()
    deadline = time.monotonic() + 30
    while hf.service().get("updated_at", 0) <= resumed + 0.2:  # a status written after it read the events
        assert time.monotonic() < deadline, "the resumed service wrote no status"
        time.sleep(0.05)
    doc = hf.followed()
    assert doc["changes"] == before["changes"], (before, doc)  # nothing taken for an operator's change
    assert doc["lag_safe_ms"]["n"] == before["lag_safe_ms"]["n"], (before, doc)  # no fail safe put in force
    st = json.loads(hf("status", "--json").stdout)
    assert st["drift"] == [], st["drift"]


FOREIGN = {
    # firewalld's nftables backend, an operator's own table: a chain at the forward hook
    "inet-forward": ("inet", "opfw", "add chain inet opfw opfw_fwd { type filter hook forward priority 10; }"),
    # a device's ingress: it sees the frames the kernel gets, not those the fast path forwards
    "netdev-ingress": (
        "netdev",
        "opnd",
        "add chain netdev opnd ing { type filter hook ingress device nf0 priority 0; }",
    ),
}


@pytest.mark.parametrize("kind", sorted(FOREIGN))
def test_an_nftables_chain_beside_the_policy_stops_the_fast_path(lab, kind):
    """A base chain of another nftables table at a hook a NIC frame meets filters frames the fast path would decide
    without it: the service stops deciding (fail closed) and says so in status; a deploy refuses it; removed, the
    fast path decides again."""
    family, table, chain = FOREIGN[kind]
    name = f"{family} {table} {chain.split()[4]}"
    netns.run(["nft", "add", "table", family, table], FW)
    netns.run(["nft", chain], FW)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        doc = hf.service()
        if doc.get("error") and doc.get("safe"):
            break
        time.sleep(0.1)
    assert name in doc["error"] and doc["safe"], doc
    p = hf("status", check=False)
    assert p.returncode == 1 and "cannot follow the live ruleset" in p.stdout, p.stdout[-800:]
    st = json.loads(hf("status", "--json", check=False).stdout)
    with deploy_target(st) as c:
        assert c()  # every frame to software meanwhile
    bad = hf("deploy", str(ROOT / "rulesets" / "example.rules"), "--target", lab, "--force", check=False)
    assert bad.returncode != 0 and name in bad.stderr, bad.stderr
    netns.run(["nft", "delete", "table", family, table], FW)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        doc = hf.service()
        if not doc.get("error") and not doc.get("safe"):
            break
        time.sleep(0.1)
    assert not doc.get("error") and not doc.get("safe"), doc
    assert hf("status", check=False).returncode == 0


def deploy_target(st: dict):
    """A context giving a function that reads whether the deployment's fast path shunts everything."""
    import contextlib
    from pathlib import Path

    from hypafilter.targets.bpfmap import PinnedArray

    @contextlib.contextmanager
    def ctx():
        if st["target"] == "xdp":
            with PinnedArray(Path(st["nic"]["pin"]) / "hfx_cfg") as m:
                yield lambda: int.from_bytes(m.read()[:4], "little") == 0
        else:
            from hypafilter.targets.nic import NicClient

            with NicClient.emu(st["nic"]["socket"]) as c:
                yield lambda: bool(c.read("CONTROL") & 2)

    return ctx()


def test_a_change_while_the_worker_is_dead_is_followed(lab):
    """The policy sync worker killed (SIGKILL): the supervisor makes the fast path shunt everything and starts
    another worker, whose first read of the ruleset applies a ban made meanwhile and lifts the fail safe."""
    import os
    import signal

    doc = hf.service()
    before = doc.get("restarts", 0)
    os.kill(doc["worker"], signal.SIGKILL)
    ipt("-I", "FORWARD", "1", "-s", "10.0.1.2/32", "-j", "DROP")
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        doc = hf.service()
        if doc.get("restarts", 0) > before and doc.get("running"):
            break
        time.sleep(0.1)
    assert doc.get("restarts", 0) > before, doc
    hf.followed()
    r = hf.verify_live()
    assert r["hw_forwarded"] + r["hw_dropped"] > 0
    ipt("-D", "FORWARD", "-s", "10.0.1.2/32", "-j", "DROP")
    hf.followed()
    assert hf("status", check=False).returncode == 0
