"""System test of interface checks resolved against the deployment: a policy naming the bridge, wildcards, `lo`, a
bridge port with -i, physdev in/out with the lab's real port names, and negations, deployed on the emulated NIC
and verified frame by frame against the kernel (the oracle's bridge and ports carry the firewall's names); with
the lab's interfaces known those rules are hardware entries and nothing is shunted, where without them every one
of them was complex."""

from __future__ import annotations

import pytest

from conftest import ns_sh

pytestmark = pytest.mark.system

LAB = "t-if"
PACKETS = 800

# Frames of the lab enter the firewall by nf0 (MAC0) and leave by nf1 (MAC1), through bridge br0. Each rule whose
# interface check is false for them would change the verdict of the frames it names if the kernel held it true
# (DROP before an ACCEPT, or the other way), so 0 mismatches says the kernel agrees with every resolution.
POLICY = """*filter
:FORWARD DROP [0:0]
:LOCAL - [0:0]
-A FORWARD -i lo -j LOCAL
-A FORWARD -i nf0 -p icmp -j DROP
-A FORWARD ! -i br0 -p tcp -j DROP
-A FORWARD -i eth+ -p udp -j DROP
-A FORWARD -m physdev --physdev-in nf1 -p udp -m udp --dport 53 -j DROP
-A FORWARD -m physdev --physdev-out nf0 -p tcp -j DROP
-A FORWARD -m physdev ! --physdev-is-bridged -p udp -j DROP
-A FORWARD -i br0 -p tcp -m tcp --dport 22 -j DROP
-A FORWARD -m physdev --physdev-in nf0 --physdev-out nf1 -p udp -m udp --dport 53:60 -j DROP
-A FORWARD -o br+ -p tcp -m tcp --dport 20:30 -j ACCEPT
-A FORWARD -m physdev --physdev-is-bridged -p icmp -j ACCEPT
-A FORWARD -m physdev --physdev-in nf+ -p udp -m udp --dport 1000:2000 -j DROP
-A FORWARD ! -o lo -s 10.0.0.0/8 -p udp -j ACCEPT
-A FORWARD -m physdev ! --physdev-out nf1 -p tcp -j DROP
-A FORWARD -p tcp -j ACCEPT
-A LOCAL -j ACCEPT
COMMIT
"""
NEVER_LINES = {4, 5, 6, 7, 10}  # false for every NIC frame: out of the hardware analysis


def parse(config):
    from hypafilter.iptables.document import parse_policy

    return parse_policy(POLICY, filename="ifaces.rules", base_chain="FORWARD", config=config)


def verified(policy, config) -> dict:
    from hypafilter.ops.verify import verify

    r = verify(policy, config, packets=PACKETS, seed=11, malformed=0.0)
    assert r["mismatches"] == 0, f"{r['mismatches']} mismatches, e.g. {r['examples'][:3]}"
    assert r["delivered_oracle"] and r["delivered_oracle"] < PACKETS  # both verdicts occur
    return r


def test_oracle_has_the_firewalls_interface_names(lab):
    """The plain namespace's bridge and ports carry the firewall's names, so interface checks mean the same there."""
    for role in ("fw", "plain"):
        for port in ("nf0", "nf1"):
            assert "master br0" in ns_sh(lab.ns(role), "ip", "-o", "link", "show", "dev", port), (role, port)


def test_lab_deploy_knows_its_interfaces(lab):
    from hypafilter.config import Config
    from hypafilter.errors import HypafilterError
    from hypafilter.ops import deploy

    cfg = deploy.site_config(Config())
    assert (cfg.bridge, cfg.hw_ports) == ("br0", {"nf0": 0, "nf1": 1})
    assert deploy.site_config(Config(hw_ports={"nf0": 0, "nf1": 1})).bridge == "br0"
    with pytest.raises(HypafilterError, match="not this deployment's"):
        deploy.site_config(Config(bridge="br9", hw_ports={"nf0": 0, "nf1": 1}))
    other = parse(Config(bridge="sw0", hw_ports={"a": 0, "b": 1}))
    with pytest.raises(HypafilterError, match="resolved against bridge sw0"):
        deploy.deploy(other, cfg)


def test_interface_rules_become_hardware_entries_and_verify(lab):
    """Resolved: every rule is simple or out of the hardware analysis, nothing is shunted, and the kernel agrees
    frame by frame; unresolved (nothing known, today's default) the same policy is all complex and shunts."""
    from hypafilter.config import Config
    from hypafilter.ops import deploy

    cfg = deploy.site_config(Config())
    pol = parse(cfg)
    assert {o.line for o, _, out in pol.resolved if out.startswith("false")} == NEVER_LINES
    assert not pol.complex_indices and len(pol.rules) == 15 - len(NEVER_LINES)
    resolved = verified(pol, cfg)
    state = deploy.read_state()
    assert state["interfaces"] == {"bridge": "br0", "ports": {"nf0": 0, "nf1": 1}}
    assert state["partition"]["complex"] == 0 and state["partition"]["shunted_entries"] == 0
    assert resolved["shunted"] <= PACKETS // 100 and resolved["hw_forwarded"] + resolved["hw_dropped"] >= PACKETS * 0.99

    plain = parse(Config())
    assert len(plain.complex_indices) == 14 and not plain.resolved
    before = verified(plain, Config())
    print(f"shunted of {PACKETS} frames: {before['shunted']} with nothing known, {resolved['shunted']} resolved")
    assert before["shunted"] > PACKETS // 2 > resolved["shunted"]
    assert deploy.read_state()["interfaces"] == {"bridge": "", "ports": {}}


# Real connections cross the NIC both ways: requests enter by nf0, replies by nf1. A rule on --physdev-in nf1 must
# keep judging only the frames that entered there.
IPORT_POLICY = """*filter
:FORWARD ACCEPT [0:0]
-A FORWARD -m physdev --physdev-in nf1 -p udp -m udp --dport 53 -j DROP
COMMIT
"""


def test_each_frame_is_judged_by_the_port_it_entered(lab):
    """UDP connections to port 53 on both paths: each request enters by nf0 and passes, each reply enters by nf1.
    GHDL 2.0's Verilog of the header parser's ingress-port case had no default (a latch in the emulator's model:
    docs/hardware.md, "Known GHDL 2.0 synthesis traps"), so after a reply the next request was taken as entering by
    nf1 and dropped by the rule, where the kernel alone passes it."""
    from hypafilter.config import Config
    from hypafilter.iptables.document import parse_policy
    from hypafilter.ops import deploy
    from hypafilter.ops.connections import ConnectionSpec
    from hypafilter.ops.verify import verify

    config = deploy.site_config(Config())  # the lab's ports known: the physdev rule is a hardware entry
    policy = parse_policy(IPORT_POLICY, filename="iport.rules", base_chain="FORWARD", config=config)
    assert not policy.complex_indices  # the rule is a hardware entry: the core decides it
    r = verify(policy, config, packets=50, seed=3, malformed=0.0, connections=ConnectionSpec(4, 4096, ("udp",)))
    c = r["connections"]
    assert r["mismatches"] == 0 and c["mismatches"] == 0, (r["examples"][:3], c)
    assert c["completed_oracle"] == 4, c  # the kernel passes every request and every reply
