"""`deploy --target xdp --ports IF0,IF1`: the fast path on two given interfaces (a bridge port pair) outside the lab.
A scratch site: sender -- h0 [bridge br0 in exp-h, br_netfilter] h1 -- receiver; deploy, frames through it
(one the fast path forwards, one it drops, one it shunts to netfilter's complex rule), status, update refusals,
undeploy leaving nothing."""

from __future__ import annotations

import json
import os
import shutil

import pytest
from hypafilter import netns

from conftest import need_root, need_tool
from tests.hfcli import HfCli

pytestmark = pytest.mark.system

S, H, R = "exp-s", "exp-h", "exp-r"
LAB = "exp"  # names the pins (/sys/fs/bpf/hypafilter-xdp/exp); no lab of that name is ever built
STATE = f"/run/hypafilter/test-{LAB}"
POLICY = """*filter
:FORWARD DROP [0:0]
-A FORWARD -p udp -m udp --dport 53 -j ACCEPT
-A FORWARD -p udp -m udp --dport 99 -j DROP
-A FORWARD -p icmp -j DROP
-A FORWARD -p udp -m udp --dport 7000 -m string --string "BAD" --algo bm -j DROP
-A FORWARD -p udp -m udp --dport 7000 -j ACCEPT
COMMIT
"""


hf = HfCli(LAB, STATE)


def teardown() -> None:
    for n in (S, H, R):
        netns.delete(n)
    shutil.rmtree(f"/sys/fs/bpf/hypafilter-xdp/{LAB}", ignore_errors=True)
    shutil.rmtree(f"/sys/fs/bpf/hypafilter/{H}", ignore_errors=True)
    shutil.rmtree(STATE, ignore_errors=True)


@pytest.fixture(scope="module")
def site():
    need_root()
    need_tool("ip", "iptables-restore", "clang", "cc", "make", "tc", "ethtool", "nft")
    teardown()
    for n in (S, H, R):
        netns.add(n)
        netns.run(["sysctl", "-qw", "net.ipv6.conf.all.disable_ipv6=1"], n)
    netns.veth("s0", S, "h0", H)
    netns.veth("r0", R, "h1", H)
    netns.run(["ip", "-n", H, "link", "add", "br0", "type", "bridge", "stp_state", "0", "forward_delay", "0"])
    for i in ("h0", "h1"):
        netns.run(["ip", "-n", H, "link", "set", i, "master", "br0"])
    netns.run(["sysctl", "-qw", "net.bridge.bridge-nf-call-iptables=1"], H)
    for n, i in ((S, "s0"), (R, "r0"), (H, "h0"), (H, "h1"), (H, "br0")):
        netns.run(["ip", "-n", n, "link", "set", i, "up"])
    for n, i in ((S, "s0"), (R, "r0")):  # a native redirect into a veth needs NAPI at its peer (docs/xdp.md, Lab)
        netns.run(["ethtool", "-K", i, "gro", "on"], n)
    yield
    hf("undeploy", "-q", check=False)
    teardown()


def through(frames: list[bytes]) -> set[int]:
    from hypafilter.ops.verify import drain, frame_id, raw_socket, receive, send

    tx, rx = raw_socket(S, "s0"), raw_socket(R, "r0")
    try:
        drain(rx)
        send(tx, frames)
        return {frame_id(f) for f in receive(rx, quiet=0.5, limit=5.0)} - {None}
    finally:
        tx.close()
        rx.close()


def test_ports_deploy_frames_undeploy(site, tmp_path):
    from hypafilter.ops.verify import build_frame

    pol = tmp_path / "p.rules"
    pol.write_text(POLICY)
    bad = hf("deploy", str(pol), "--ports", "h0,h1", "--netns", H, check=False)  # the configuration's target: emu
    assert bad.returncode != 0 and "--ports needs --target xdp" in bad.stderr
    hf("deploy", str(pol), "--target", "xdp", "--ports", "h0,h1", "--netns", H, "--json")
    link = json.loads(netns.run(["ip", "-j", "-d", "link", "show", "dev", "h0"], H))[0]
    assert link["xdp"]["prog"]["name"] == "hfx_fastpath"
    h = {"src": 0x0A000001, "dst": 0x0A000002, "proto": 17, "sport": 1000}
    frames = [
        build_frame(1, dict(h, dport=53), b"ok"),  # forwarded by the fast path
        build_frame(2, dict(h, dport=99), b"no"),  # dropped by the fast path
        build_frame(3, dict(h, dport=7000), b"fine"),  # shunted: netfilter accepts
        build_frame(4, dict(h, dport=7000), b"BAD!"),  # shunted: netfilter's string match drops
        build_frame(5, dict(h, dport=1234), b"none"),  # the chain policy DROP, decided in the fast path
    ]
    assert through(frames) == {1, 3}
    st = json.loads(hf("status", "--json").stdout)
    nic = st["nic_counters"]
    assert st["drift"] == [] and st["site"]["ifaces"] == ["h0", "h1"] and st["site"]["netns"] == H
    assert nic["PKTIN"] == 5 and nic["CNT_FORWARDED"] == 1 and nic["CNT_DROPPED"] == 2, nic
    assert nic["CNT_SHUNT_OVERRULE"] == 2, nic
    # A deploy on other interfaces (here: the lab's) is refused while this one runs.
    other = hf("deploy", str(pol), "--target", "xdp", check=False)
    assert other.returncode != 0 and "undeploy it first" in other.stderr
    hf("undeploy", "-q")
    link = json.loads(netns.run(["ip", "-j", "-d", "link", "show", "dev", "h0"], H))[0]
    assert "xdp" not in link
    assert "HF" not in netns.run(["iptables-save"], H)
    assert not os.path.exists(f"/sys/fs/bpf/hypafilter-xdp/{LAB}")
