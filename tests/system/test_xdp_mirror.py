"""Log mirroring on the xdp lab (docs/xdp.md "Log mirroring"): the policies of test_mirror.py (observing rules:
LOG, NFLOG, no target; one with a deciding string match) through the XDP fast path. A bridge's mirrored ACCEPT
reaches the receiver exactly once and unchanged (cloned to the paired port by the shim's TC program), every copy
reaches netfilter once; the kernel is the oracle twice: every frame's verdict against the policy alone (verify:
duplicates and altered frames count too) and each observing rule's packet counter against the same rule's in the
plain namespace.
"""

from __future__ import annotations

import pytest
from hypafilter.ops import deploy
from test_mirror import FORWARD_POLICY, MIXED_POLICY, observed, run

pytestmark = pytest.mark.system

LAB = "xmv"
TARGET = "xdp"  # conftest's lab fixture brings up an xdp lab; test_mirror.run deploys on it


def test_observers_are_mirrored_not_shunted(lab):
    """The stateless observers' frames are decided in XDP and mirrored; the mirrored ACCEPTs arrive once, and the
    host's observing rules count exactly what the kernel's count (a -m limit's burst included)."""
    r = run(lab, FORWARD_POLICY, seed=3, target=TARGET)
    nic = r["nic"]
    fw, plain = observed(lab.ns_fw), observed(lab.ns_plain)
    print(f"mirrored {nic['CNT_MIRROR']}, forwarded {nic['CNT_FORWARDED']}, observed {plain}")
    assert fw == plain
    assert all(v > 0 for v in plain.values()), plain
    assert plain["obs3"] == 5
    # obs3's limit has one bucket, the operator's rule in the live ruleset: its frames are shunted to it, not copied
    assert nic.get("CNT_SHUNT_POLICY", 0) == 0 and 0 < nic.get("CNT_SHUNT_OVERRULE", 0) < r["packets"] // 2, nic
    assert 0.5 < r["hw_share"] < 1.0


def test_mirrored_and_shunted_frames_together(lab):
    """A deciding string match among the observers: its frames are shunted, the rest mirrored."""
    r = run(lab, MIXED_POLICY, seed=4, target=TARGET)
    assert observed(lab.ns_fw) == observed(lab.ns_plain)
    assert r["nic"].get("CNT_SHUNT_OVERRULE", 0) > 0 and r["hw_share"] < 1.0


HOST_POLICY = """*filter
:INPUT DROP [0:0]
:FORWARD ACCEPT [0:0]
:OUTPUT ACCEPT [0:0]
-A INPUT -p tcp -m tcp --dport 22 -m comment --comment obs1 -j LOG --log-prefix "ssh: "
-A INPUT -p tcp -m tcp --dport 20:30 -j ACCEPT
-A INPUT -p udp -m comment --comment obs2 -j NFLOG --nflog-group 7
-A INPUT -p udp -m udp --dport 53 -j ACCEPT
-A INPUT -p icmp -m comment --comment obs3
-A INPUT -p icmp -m icmp --icmp-type 8 -j DROP
-A INPUT -m comment --comment obs4
-A INPUT -p tcp -m tcp --dport 1000:65535 -j ACCEPT
-A INPUT -p udp -j DROP
-A INPUT -p icmp -j ACCEPT
COMMIT
"""


def test_host_mode(lab):
    """Host mode: a mirrored ACCEPT passes itself with reason 4 (no clone) and INPUT's leaf accepts it after the
    observing rules; a mirrored DROP's copy is dropped after them."""
    deploy.undeploy()  # bridge -> host mode
    r = run(lab, HOST_POLICY, seed=5, chain="INPUT", packets=600, target=TARGET)
    assert r["nic_mode"] == "host"
    assert observed(lab.ns_fw) == observed(lab.ns_plain)
    deploy.undeploy()
