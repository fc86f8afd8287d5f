"""Divergences between the hybrid and the kernel that the stateless model misses (issue: exact against the
kernel). Each test sends the same traffic through the hybrid path and through the policy loaded alone in the
plain namespace, in a lab of this module's own, and failed on the code before its fix."""

from __future__ import annotations

import pytest

from conftest import ROOT, ns_sh
from tests.netconn import tcp_servers, tcp_talk, udp_delivered

pytestmark = pytest.mark.system

LAB = "hfx"


def parse(text: str, name: str):
    from hypafilter.config import Config
    from hypafilter.iptables.document import parse_policy

    return parse_policy(text, filename=name, base_chain="FORWARD", config=Config())


def verified(policy, packets: int = 600, **cfg) -> dict:
    from hypafilter.config import Config
    from hypafilter.ops.verify import verify

    r = verify(policy, Config(**cfg), packets=packets, seed=5, malformed=0.0)
    assert r["mismatches"] == 0, f"{r['mismatches']} mismatches, e.g. {r['examples'][:3]}"
    return r


def deploy_both(lab, policy, **cfg) -> None:
    """The policy on the hybrid path (deployed) and alone in the plain namespace (the oracle)."""
    from hypafilter.config import Config
    from hypafilter.ops import deploy
    from hypafilter.ops.verify import load_oracle

    deploy.deploy(policy, Config(**cfg))
    load_oracle(lab.ns_plain, policy)


@pytest.mark.parametrize("strategy", ["full", "interval"])
def test_policy_sees_the_mark_it_would_see(lab, strategy):
    """The shim writes the mark before any policy rule runs; the tool's chains give the bits back, so a rule that
    tests the mark sees 0 on both paths (before: every shunted UDP datagram missed the ACCEPT and was dropped)."""
    pol = parse(
        "*filter\n:FORWARD DROP [0:0]\n"
        "-A FORWARD -p udp -m mark --mark 0x0 -j ACCEPT\n"
        "-A FORWARD -p udp -j DROP\n"
        "-A FORWARD -p tcp -m tcp --dport 80 -j ACCEPT\n"
        "-A FORWARD -m mark ! --mark 0x0 -j ACCEPT\nCOMMIT\n",
        "mark.rules",
    )
    r = verified(pol, strategy=strategy)
    assert r["shunted"] > 0


def test_flattening_stops_at_state_changes(lab):
    """A user chain that sets the mark its own RETURN guard tests: flattened, the guard was re-tested after the
    MARK for every later rule, so UDP/53 was delivered; the kernel drops it."""
    pol = parse(
        "*filter\n:FORWARD ACCEPT [0:0]\n:C - [0:0]\n"
        "-A FORWARD -p tcp -m tcp --dport 22 -j ACCEPT\n"
        "-A FORWARD -j C\n"
        "-A C -m mark --mark 0x1/0x1 -j RETURN\n"
        "-A C -j MARK --set-xmark 0x1/0x1\n"
        "-A C -p udp -m udp --dport 53 -j DROP\nCOMMIT\n",
        "markchain.rules",
    )
    assert not any(r.target == "DROP" for r in pol.rules), "chain C must stay one verbatim jump"
    deploy_both(lab, pol)
    sends = [(53, b"dns%d" % i) for i in range(3)] + [(54, b"other%d" % i) for i in range(3)]
    hyb = udp_delivered(lab.ns_send, lab.ns_recv, lab.ip("recv", "hyb"), sends)
    plain = udp_delivered(lab.ns_send, lab.ns_recv, lab.ip("recv", "plain"), sends)
    assert [p for p, _ in plain] == [54, 54, 54]
    assert hyb == plain


def test_rules_with_per_rule_state_exist_once(lab):
    """A rate-limited chain jumped to from two rules is one token bucket in the kernel; expanded twice by
    flattening it was two buckets, and twice as many datagrams passed."""
    pol = parse(
        "*filter\n:FORWARD ACCEPT [0:0]\n:LIM - [0:0]\n"
        "-A FORWARD -p udp -m udp --dport 53 -j LIM\n"
        "-A FORWARD -p udp -m udp --dport 54 -j LIM\n"
        "-A FORWARD -p udp -j ACCEPT\n"
        "-A LIM -m limit --limit 1/hour --limit-burst 3 -j ACCEPT\n"
        "-A LIM -j DROP\nCOMMIT\n",
        "limit.rules",
    )
    deploy_both(lab, pol)
    saved = ns_sh(lab.ns_fw, "iptables-save", "-t", "filter")
    assert sum("-m limit" in ln for ln in saved.splitlines()) == 1, saved
    sends = [(53, b"a%d" % i) for i in range(3)] + [(54, b"b%d" % i) for i in range(3)]
    plain = udp_delivered(lab.ns_send, lab.ns_recv, lab.ip("recv", "plain"), sends)
    hyb = udp_delivered(lab.ns_send, lab.ns_recv, lab.ip("recv", "hyb"), sends)
    assert len(plain) == 3 and len(hyb) == 3, (plain, hyb)


def test_stateful_ruleset_loads_each_stateful_rule_once(lab):
    """rulesets/stateful.rules on the firewall host: every limit/recent/quota rule stands once in the table."""
    path = ROOT / "rulesets" / "stateful.rules"
    pol = parse(path.read_text(), str(path))
    deploy_both(lab, pol)
    saved = ns_sh(lab.ns_fw, "iptables-save", "-t", "filter").splitlines()
    for needle in ("--limit 5/sec", "--limit 1/min", "--set --name ssh", "--update --seconds 60", "--quota 100000"):
        assert sum(needle in ln for ln in saved) == 1, (needle, [ln for ln in saved if needle in ln])


def test_conntrack_sees_every_accepted_packet(lab):
    """`--dport 8080 -j ACCEPT` above the ESTABLISHED rule: the hardware used to forward the SYN itself, conntrack
    never saw it, and the SYN-ACK was INVALID: no connection completed through the hybrid."""
    pol = parse(
        "*filter\n:FORWARD DROP [0:0]\n"
        "-A FORWARD -p tcp -m tcp --dport 8080 -j ACCEPT\n"
        "-A FORWARD -m conntrack --ctstate ESTABLISHED,RELATED -j ACCEPT\n"
        "-A FORWARD -p icmp -j ACCEPT\nCOMMIT\n",
        "ctlate.rules",
    )
    deploy_both(lab, pol)
    with tcp_servers(lab.ns_recv, [8080]):
        got = {path: [tcp_talk(lab.ns_send, lab.ip("recv", path), 8080) for _ in range(3)] for path in ("plain", "hyb")}
    want = b"retlifapyh olleh" * 50
    assert got["plain"] == [want] * 3
    assert got["hyb"] == got["plain"]


def test_tagged_frames_are_filtered_after_deploy(lab):
    """deploy left net.bridge.bridge-nf-filter-vlan-tagged at the kernel's 0 (only verify set 1), so an 802.1Q
    frame the hardware shunted crossed the firewall bridge without any iptables rule: a datagram the policy drops
    reached the receiver. Now deploy sets it (and the oracle is the policy with the same setting)."""
    from hypafilter import netns
    from hypafilter.ops.verify import compare, exchange, make_probes

    pol = parse(
        "*filter\n:FORWARD ACCEPT [0:0]\n"
        "-A FORWARD -p udp -m string --string BAD --algo bm -j DROP\n"
        "-A FORWARD -p udp -j ACCEPT\n"
        "-A FORWARD -p tcp -j DROP\nCOMMIT\n",
        "vlan.rules",
    )
    deploy_both(lab, pol)
    key = "net.bridge.bridge-nf-filter-vlan-tagged"
    assert netns.run(["sysctl", "-n", key], lab.ns_fw).strip() == "1"
    netns.run(["sysctl", "-qw", f"{key}=1"], lab.ns_plain)  # the oracle: the same policy, tagged frames filtered
    probes = make_probes(pol, 400, generation=0, seed=9, malformed=1.0, kinds=("vlan",), bad_share=0.5)
    report = compare(probes, exchange({"send": lab.ns_send, "recv": lab.ns_recv, "plain": lab.ns_plain}, probes))
    assert report["mismatches"] == 0, report["examples"][:3]
    assert report["delivered_oracle"] < 400  # the policy dropped some: the comparison had something to catch


@pytest.mark.parametrize("chain", ["INPUT", "OUTPUT"])
def test_host_chains_are_refused_on_a_bridge_nic(lab, chain):
    """The NIC bridges its ports: INPUT/OUTPUT see none of its frames. Deploying such a policy used to succeed
    and filter nothing; now it is refused before anything changes."""
    from hypafilter.config import Config
    from hypafilter.errors import HypafilterError
    from hypafilter.iptables.document import parse_policy
    from hypafilter.ops import deploy

    before = deploy.read_state()
    pol = parse_policy(f"*filter\n:{chain} DROP [0:0]\n-A {chain} -p tcp -j ACCEPT\nCOMMIT\n", "host.rules", chain)
    with pytest.raises(HypafilterError, match=rf"host.rules: chain {chain} on target 'emu'.*--chain FORWARD"):
        deploy.deploy(pol, Config())
    assert deploy.read_state() == before
