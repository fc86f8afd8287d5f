"""System tests of log mirroring (issue #13): rules whose target only observes (LOG, NFLOG, no target) do not make
the emulated NIC shunt. The NIC decides the verdict and sends the host a copy (metadata reason 4), on which netfilter
runs the observing rules and which it never forwards.

The kernel is the oracle twice: every frame's verdict is compared with the policy loaded alone in netfilter (verify),
and each observing rule's packet counter in the firewall namespace (summed over every chain of the tool's program that
holds a copy of it) must equal the same rule's counter in the plain namespace, where the policy runs alone: the host
saw exactly the frames the kernel logs, no more, no fewer, including a `-m limit` that lets only its burst through.
"""

from __future__ import annotations

import re

import pytest
from hypafilter.config import Config
from hypafilter.iptables.document import parse_policy
from hypafilter.ops import deploy
from hypafilter.ops.verify import verify

from conftest import ns_sh

pytestmark = pytest.mark.system

LAB = "t-mir"
PACKETS = 1500

# Every complex rule only observes: with mirroring, no frame needs the host to decide its verdict.
FORWARD_POLICY = """*filter
:FORWARD DROP [0:0]
-A FORWARD -p tcp -m tcp --dport 22 -m comment --comment obs1 -j LOG --log-prefix "ssh: "
-A FORWARD -p tcp -m tcp --dport 20:30 -j ACCEPT
-A FORWARD -s 10.0.0.0/9 -p udp -m comment --comment obs2 -j NFLOG --nflog-group 7 --nflog-prefix udp
-A FORWARD -p udp -m udp --dport 53 -j ACCEPT
-A FORWARD -p icmp -m limit --limit 1/hour --limit-burst 5 -m comment --comment obs3 -j LOG --log-prefix "icmp: "
-A FORWARD -p icmp -m icmp --icmp-type 8 -j DROP
-A FORWARD -d 10.128.0.0/9 -m comment --comment obs4
-A FORWARD -p tcp -m tcp --dport 1000:65535 -j ACCEPT
-A FORWARD -p udp -m udp --dport 1000:2000 -j DROP
-A FORWARD -p udp -j ACCEPT
-A FORWARD -p icmp -j ACCEPT
COMMIT
"""
OBSERVERS = ("obs1", "obs2", "obs3", "obs4")

# The same observers, plus one deciding complex rule (a string match): frames it may claim are shunted (reason 0),
# the others mirrored, and the two kinds of host work share the interval chains.
MIXED_POLICY = FORWARD_POLICY.replace(
    "-A FORWARD -p udp -m udp --dport 53 -j ACCEPT\n",
    '-A FORWARD -p udp -m udp --dport 53 -m string --string "evil" --algo bm -j DROP\n'
    "-A FORWARD -p udp -m udp --dport 53 -j ACCEPT\n",
)


def parse(text: str, chain: str = "FORWARD"):
    return parse_policy(text, filename="mirror.rules", base_chain=chain, config=Config())


def observed(ns: str, table: str = "filter") -> dict[str, int]:
    """Packet counter of each observing rule (by its comment), summed over every rule in `ns` that carries it."""
    out = dict.fromkeys(OBSERVERS, 0)
    for line in ns_sh(ns, "iptables-save", "-c", "-t", table).splitlines():
        m = re.match(r"\[(\d+):\d+\] -A \S+ .*--comment (obs\d)\b", line)
        if m:
            out[m.group(2)] += int(m.group(1))
    return out


def zero_counters(lab) -> None:
    for ns in (lab.ns_fw, lab.ns_plain):
        ns_sh(ns, "iptables", "-w", "-Z")


def run(lab, text: str, seed: int, chain: str = "FORWARD", packets: int = PACKETS, target: str = "emu") -> dict:
    """The policy deployed on `target` (the lab's: emu here, xdp in test_xdp_mirror.py) with selective shunting
    and the interval strategy, the observers' counters zeroed, then verified: every verdict the kernel's, no
    mirrored frame forwarded twice or changed, the observers' counts the kernel's. On xdp also: every copy was
    marked once by the shim's TC program."""
    pol = parse(text, chain)
    cfg = Config(shunt_mode="selective", strategy="interval", target=target)
    deploy.deploy(pol, cfg, target=target)  # the configuration verify deploys with: its own deploy is then a no-op
    zero_counters(lab)
    r = verify(pol, cfg, packets=packets, seed=seed, malformed=0.0)
    assert r["mismatches"] == 0, f"{r['mismatches']} mismatches, e.g. {r['examples'][:3]}"
    assert r["duplicates"] == 0 and r["altered"] == 0, "a mirrored frame was forwarded twice or changed"
    assert r["observers"]["mismatches"] == 0, r["observers"]["examples"]
    assert 0 < r["delivered_oracle"] < packets
    if target == "xdp":  # a failed clone would clear the mirror bit
        assert r["shim"]["mirror"] == r["nic"]["CNT_MIRROR"] > 0, (r["shim"], r["nic"])
    return r


def test_observers_are_mirrored_not_shunted(lab):
    """The frames a stateless observing rule may see are decided by the NIC and reach the host as copies
    (CNT_MIRROR), and the host's observing rules count exactly what the kernel's count."""
    r = run(lab, FORWARD_POLICY, seed=3)
    nic = r["nic"]
    fw, plain = observed(lab.ns_fw), observed(lab.ns_plain)
    print(f"mirrored {nic.get('CNT_MIRROR')}, shunted {r['shunted']}, hw share {r['hw_share']}, observed {plain}")
    assert fw == plain
    assert all(plain[o] > 0 for o in OBSERVERS), plain  # every observer met frames (else the test proves nothing)
    assert plain["obs3"] == 5  # the limit's burst, then nothing: the bucket saw the frames the kernel's saw
    # The stateless observers mirror. obs3's limit has one bucket, the operator's rule in the live ruleset, so the
    # frames its reduction (icmp) meets are shunted to it, not copied (docs/deploy.md, Live policy); nothing else is.
    assert nic.get("CNT_SHUNT_POLICY", 0) == 0, nic
    assert 0 < nic.get("CNT_SHUNT_OVERRULE", 0) < r["packets"] // 2, nic
    assert nic.get("CNT_MIRROR", 0) >= sum(plain[o] for o in ("obs1", "obs2", "obs4"))
    assert 0.5 < r["hw_share"] < 1.0


def test_mirrored_and_shunted_frames_together(lab):
    """A deciding complex rule among the observers: its frames are shunted and decided by netfilter, the rest
    mirrored; verdicts and observer counters equal the kernel's."""
    r = run(lab, MIXED_POLICY, seed=4)
    nic = r["nic"]
    assert observed(lab.ns_fw) == observed(lab.ns_plain)
    assert nic.get("CNT_MIRROR", 0) > 0
    assert nic.get("CNT_SHUNT_OVERRULE", 0) > 0  # the string rule's udp/53 frames
    assert r["hw_share"] < 1.0


def test_full_strategy_does_not_mirror(lab):
    """With strategy full a copy would run the whole policy and could be forwarded: nothing mirrors, observers shunt
    as before, and the verdicts and counters still equal the kernel's."""
    pol = parse(FORWARD_POLICY)
    cfg = Config(shunt_mode="selective", strategy="full")
    deploy.deploy(pol, cfg)  # the configuration verify deploys with: its own deploy is then a no-op
    zero_counters(lab)
    r = verify(pol, cfg, packets=600, seed=5, malformed=0.0)
    assert r["mismatches"] == 0 and r["duplicates"] == 0
    assert r["nic"].get("CNT_MIRROR", 0) == 0
    assert r["nic"].get("CNT_SHUNT_OVERRULE", 0) > 0
    assert observed(lab.ns_fw) == observed(lab.ns_plain)


def test_host_mode_mirrors_into_input(lab):
    """Host mode (INPUT): a mirrored ACCEPT is the frame itself, delivered with reason 4 (not 5): INPUT runs the
    observing rules above its interval and accepts it; a mirrored DROP runs them and drops it. Verdicts and observer
    counters equal the kernel's."""
    deploy.undeploy()  # the NIC changes mode: deploy refuses to switch a running bridge deployment
    r = run(lab, FORWARD_POLICY.replace("FORWARD", "INPUT"), seed=6, chain="INPUT", packets=900)
    nic = r["nic"]
    assert r["nic_mode"] == "host"
    assert observed(lab.ns_fw) == observed(lab.ns_plain)
    assert nic.get("CNT_MIRROR", 0) > 0 and 0 < nic.get("CNT_SHUNT_OVERRULE", 0) < r["packets"] // 2, nic
