"""System tests of host mode: a policy of the INPUT chain deployed on the emulated NIC (CONTROL bit 3: a hardware
ACCEPT reaches the host marked "decided") and verified against the kernel terminating the same frames."""

from __future__ import annotations

import pytest
from hypafilter.config import Config
from hypafilter.errors import HypafilterError
from hypafilter.hw.model import CONTROL_HOST_MODE
from hypafilter.iptables.document import parse_policy
from hypafilter.ops import deploy
from hypafilter.ops.lab import HOST_TABLE
from hypafilter.ops.verify import verify

from conftest import ns_sh

pytestmark = pytest.mark.system

LAB = "thost"

# Simple rules first (decided by the hardware: in host mode conntrack still sees every frame the host accepts),
# then conntrack, simple rules after complex ones, a user chain with RETURN, REJECT and LOG (complex targets), and
# a policy DROP.
HOST_POLICY = """*filter
:INPUT DROP [0:0]
:FORWARD ACCEPT [0:0]
:OUTPUT ACCEPT [0:0]
:svc - [0:0]
-A INPUT -s 10.9.0.0/16 -j DROP
-A INPUT -p icmp -m icmp --icmp-type 8 -j ACCEPT
-A INPUT -p tcp -m tcp --dport 22 -j ACCEPT
-A INPUT -p udp -m multiport --dports 53,123 -j ACCEPT
-A INPUT -i lo -j ACCEPT
-A INPUT -m conntrack --ctstate INVALID -j DROP
-A INPUT -m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT
-A INPUT -d 10.254.0.1/32 -p tcp -m tcp --dport 80:90 -j svc
-A INPUT -p tcp -m tcp --dport 443 -m string --string "BAD" --algo bm -j REJECT --reject-with tcp-reset
-A INPUT -p tcp -m tcp --dport 443 -j ACCEPT
-A INPUT -s 10.0.0.0/8 -p udp -j LOG --log-prefix "in: "
-A INPUT -s 10.0.0.0/8 -p udp -m udp --dport 1000:2000 -j ACCEPT
-A svc -s 192.168.0.0/16 -j RETURN
-A svc -p tcp -m tcp --dport 85 -j DROP
-A svc -j ACCEPT
COMMIT
"""


def policy(text: str = HOST_POLICY, chain: str = "INPUT"):
    return parse_policy(text, filename="host.rules", base_chain=chain, config=Config())


def test_deploy_verify_status_undeploy(lab):
    """INPUT deployed in host mode (NIC CONTROL bit 3, the jump in INPUT, fail-closed INPUT policy), verified with
    zero mismatches and a non-zero hardware share in every shunting mode; status without drift; undeploy clean."""
    pol = policy()
    total_hw = 0
    for mode, strategy in (("selective", "interval"), ("index", "cut"), ("exact", "full")):
        r = verify(pol, Config(shunt_mode=mode, strategy=strategy), packets=1500, seed=5)
        print(
            f"{mode}/{strategy}: {r['packets']} frames, {r['delivered_oracle']} accepted by the kernel, "
            f"{r['shunted']} shunted, hardware accepted {r['hw_forwarded']} and dropped {r['hw_dropped']}, "
            f"{r['mismatches']} mismatches"
        )
        assert r["nic_mode"] == "host"
        assert r["mismatches"] == 0, r["examples"][:3]
        assert 0 < r["delivered_oracle"] < r["packets"]
        total_hw += r["hw_forwarded"] + r["hw_dropped"]
        assert r["hw_forwarded"] > 0  # hardware ACCEPTs delivered with reason 5 and accepted by the DA chain
    assert total_hw > 0
    st = deploy.read_state()
    assert st["base_chain"] == "INPUT" and st["nic_mode"] == "host"
    fw = lab.ns_fw
    assert f"-A INPUT -j {st['main_chain']}" in ns_sh(fw, "iptables", "-S", "INPUT")
    assert "-P INPUT DROP" in ns_sh(fw, "iptables", "-S", "INPUT")
    assert deploy.drift(st) == []
    with deploy.target_of(st, Config()).client(st["nic"]) as nic:
        assert nic.read("CONTROL") & CONTROL_HOST_MODE  # the NIC delivers its ACCEPTs to the host
    # OUTPUT is refused before anything changes; a FORWARD policy needs bridge mode: undeploy first.
    with pytest.raises(HypafilterError, match="never sees the packets the host itself generates"):
        deploy.deploy(policy(chain="OUTPUT", text=HOST_POLICY.replace("-A INPUT", "-A OUTPUT")), Config())
    with pytest.raises(HypafilterError, match="undeploy first"):
        deploy.deploy(policy(HOST_POLICY.replace("-A INPUT", "-A FORWARD"), "FORWARD"), Config())
    with pytest.raises(HypafilterError, match="needs nic_mode = 'host'"):
        deploy.deploy(pol, Config(nic_mode="bridge"))
    assert deploy.undeploy()
    assert st["main_chain"] not in ns_sh(fw, "iptables-save")
    # the policy stays the firewall's live ruleset under its own names, its chain policy included
    live = ns_sh(fw, "iptables", "-S", "INPUT")
    assert "-P INPUT DROP" in live and "-A INPUT -s 10.9.0.0/16 -j DROP" in live, live
    ns_sh(fw, "iptables", "-F", "INPUT")
    ns_sh(fw, "iptables", "-P", "INPUT", "ACCEPT")
    lab.host_mode(False)
    assert HOST_TABLE not in ns_sh(fw, "nft", "list", "tables")
