"""inet6 ipsets in the emulated NIC's dual-stack core (hf_set_table with V6, docs/sets.md "IPv6 sets", issue #25),
against the kernel: an ip6tables policy reading a `family inet6` hash:net blocklist with a nomatch hole and a `family
inet6` hash:ip,port allow list (TCP, UDP and ICMPv6 elements) beside an IPv4 policy: `lint -6` makes both matches
set slots on emu; `verify` deploys the dual stack with the sets and finds 0 mismatches among IPv6 frames aimed at the
sets, the set rules' IPv6 rows hit in the core (HITS) and frames decided there; then an `ipset add` to the blocklist
is followed into the core's IPv6 table by the policy sync service's set follower (the listed source's frames dropped
by the core itself) and an `ipset del` too (forwarded again).

A dual-stack core build of its own (~1 min cold): opt-in outside CI as test_ipv6_deploy's
test_dual_stack_emu_hardware (HF_EMU_V6_FULL=1, `make test-emu-v6`)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from conftest import TEST_FULL
from tests.hfcli import HfCli

pytestmark = [pytest.mark.system, TEST_FULL]  # make test-full

LAB = "w2a"
STATE = f"/run/hypafilter/test-{LAB}"
FW = f"{LAB}-fw"
hf = HfCli(LAB, STATE)
FULL = os.environ.get("HF_EMU_V6_FULL", "") not in ("", "0") or os.environ.get("CI") == "true"
NEW_SRC = "fd48:4600::1:5"  # in bl6's nomatch hole fd48:4600::1:0/124, accepted by svc6 until listed
RECEIVER = "fd48:4600::2:1"

SETS = """create bl6 hash:net family inet6 hashsize 1024 maxelem 65536
add bl6 2001:db8:bad::/48
add bl6 2001:db8:bad:1::/64 nomatch
add bl6 fd48:4600::1:0/120
add bl6 fd48:4600::1:0/124 nomatch
add bl6 fd48:4601::1:0/120
add bl6 fd48:4600::2:80/121
create svc6 hash:ip,port family inet6 hashsize 1024 maxelem 65536
add svc6 fd48:4600::2:1,tcp:80
add svc6 fd48:4601::2:1,tcp:80
add svc6 fd48:4600::2:1,udp:53
add svc6 fd48:4601::2:1,udp:53
add svc6 fd48:4600::2:1,ipv6-icmp:echo-request
"""
V4 = """*filter
:INPUT ACCEPT [0:0]
:FORWARD ACCEPT [0:0]
:OUTPUT ACCEPT [0:0]
-A FORWARD -p tcp --dport 23 -j DROP
COMMIT
"""
V6 = """*filter
:INPUT ACCEPT [0:0]
:FORWARD ACCEPT [0:0]
:OUTPUT ACCEPT [0:0]
-A FORWARD -m set --match-set bl6 src -j DROP
-A FORWARD -m set --match-set svc6 dst,dst -j ACCEPT
-A FORWARD -p tcp -j DROP
COMMIT
"""


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    if not FULL:
        pytest.skip("opt-in outside CI (a dual-stack core build): HF_EMU_V6_FULL=1, make test-emu-v6")
    from conftest import need_root, need_tool

    need_root()
    need_tool("ghdl", "verilator", "make", "ipset")
    d = tmp_path_factory.mktemp(LAB)
    (d / "sets.save").write_text(SETS)
    (d / "v4.rules").write_text(V4)
    (d / "v6.rules").write_text(V6)
    hf("lab", "down", "--name", LAB, check=False)
    shutil.rmtree(STATE, ignore_errors=True)
    hf("lab", "up", "--name", LAB)
    try:
        yield d
    finally:
        hf("undeploy", "-q", check=False)
        hf("lab", "down", "--name", LAB, check=False)
        shutil.rmtree(STATE, ignore_errors=True)


def _state() -> dict:
    from hypafilter.ops import deploy

    return deploy.read_state(Path(STATE) / "state.json")


def _send(count: int, src: str) -> tuple[int, int]:
    """`count` IPv6 UDP frames from `src` to the allow list's udp:53 (~1,000 a second): (sent, received)."""
    from hypafilter.ops.verify import DST_MAC, ID_MAC_PREFIX, frame_id, raw_socket, receive
    from hypafilter.ops.verify6 import _scapy

    sc = _scapy()
    send = raw_socket(f"{LAB}-send", "hyb0")
    recv = raw_socket(f"{LAB}-recv", "hyb0")
    try:
        for uid in range(1, count + 1):
            src_mac = (ID_MAC_PREFIX + uid.to_bytes(4, "big")).hex(":")
            pkt = (
                sc.Ether(dst=DST_MAC.hex(":"), src=src_mac)
                / sc.IPv6(src=src, dst=RECEIVER)
                / sc.UDP(sport=4000, dport=53)
            )
            send.send(bytes(pkt / (b"x" * 16)))
            time.sleep(0.001)
        got = {u for u in (frame_id(f) for f in receive(recv, quiet=0.3)) if u is not None}
    finally:
        send.close()
        recv.close()
    return count, len(got)


def _syncs() -> int:
    return int((hf.service().get("sets") or {}).get("syncs", 0))


def _followed(syncs0: int, timeout: float = 10.0) -> None:
    """Wait until the set follower has synced the tables after an ipset command (its sync count moved past syncs0)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        doc = hf.service().get("sets") or {}
        if doc.get("following") and int(doc.get("syncs", 0)) > syncs0:
            return
        time.sleep(0.02)
    raise AssertionError(f"the set follower did not follow: {hf.service().get('sets')}")


def test_inet6_sets_in_the_emulated_nics_core(lab):
    from hypafilter.ops import deploy
    from hypafilter.targets.emu.target import EmuTarget

    args = ["-6", str(lab / "v6.rules"), "--ipsets", str(lab / "sets.save"), "--no-kernel"]
    out = hf("lint", *args, "--target", "emu").stdout
    assert "set matches: 2 set slot(s)" in out and "complex:" not in out.split("set matches:")[1], out
    p = hf("verify", str(lab / "v4.rules"), "--ipv6", str(lab / "v6.rules"), "--ipsets", str(lab / "sets.save"),
           "--target", "emu", "--packets", "300", "--json", check=False)  # fmt: skip
    assert p.stdout, p.stderr[-3000:]
    r = json.loads(p.stdout)
    six = r["ipv6"]
    assert p.returncode == 0 and r["mismatches"] == 0 and six["mismatches"] == 0, (r["examples"][:3], six)
    assert six["hw"]["decided"] > 0, six["hw"]
    st = _state()
    assert [row[3:] for row in st["tables"]["sets"]] == [[6], [6]], st["tables"]["sets"]
    assert [len(i["cells"]) for i in st["tables"]["set_images"]] == [6, 5], st["tables"].get("set_errors")
    assert "[IPv6]" in hf("status").stdout
    # the set rules' IPv6 rows (hardware index V6_BASE + entry) decided frames in the core
    base = st["tables"]["v6"]["index_base"]
    tgt = EmuTarget(deploy.deployed_config(st))
    with tgt.client(st["nic"]) as c:
        hits = [c.read_table("HITS", base + j) for j in range(2)]
    assert hits[0] > 0 and hits[1] > 0, hits

    # run time: `ipset add` lists the source (the follower writes the element into the core's IPv6 table), then
    # `ipset del` removes it again
    assert _send(200, NEW_SRC)[1] >= 190  # accepted by svc6 (bl6's nomatch hole)
    with tgt.client(st["nic"]) as c:
        d0 = c.read("CNT_DROPPED")
    s0 = _syncs()
    subprocess.run(["ip", "netns", "exec", FW, "ipset", "add", "bl6", f"{NEW_SRC}/128"], check=True)
    _followed(s0)
    sent, got = _send(300, NEW_SRC)
    with tgt.client(st["nic"]) as c:
        d1 = c.read("CNT_DROPPED")
    assert got == 0 and d1 - d0 >= sent, (got, d1 - d0)  # dropped by the core itself
    s0 = _syncs()
    subprocess.run(["ip", "netns", "exec", FW, "ipset", "del", "bl6", f"{NEW_SRC}/128"], check=True)
    _followed(s0)
    assert _send(200, NEW_SRC)[1] >= 190
    r = hf.verify_live(packets=300)
    assert r["ipv6"]["mismatches"] == 0, r["ipv6"]
