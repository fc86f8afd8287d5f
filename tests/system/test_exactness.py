"""Divergences between the hybrid and the kernel that the stateless model misses (issue: exact against the
kernel). Each test sends the same traffic through the hybrid path and through the policy loaded alone in the
plain namespace, in a lab of this module's own, and failed on the code before its fix."""

from __future__ import annotations

import pytest
from hypafilter.ops.connections import TcpServers, tcp_talk, udp_delivered

from conftest import ROOT, ns_sh

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
    """rulesets/stateful.rules on the firewall host: every limit/hashlimit/recent/connlimit/quota/statistic rule
    stands once in the table."""
    path = ROOT / "rulesets" / "stateful.rules"
    pol = parse(path.read_text(), str(path))
    deploy_both(lab, pol)
    saved = ns_sh(lab.ns_fw, "iptables-save", "-t", "filter").splitlines()
    needles = (
        "--limit 5/sec",
        "--limit 1/min",
        "--set --name ssh",
        "--update --seconds 60",
        "--quota 100000",
        "--hashlimit-name http",
        "--connlimit-above 16",
        "--mode nth --every 10",
    )
    for needle in needles:
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
    with TcpServers(lab.ns_recv, [8080]):
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
    key = "net.bridge.bridge-nf-filter-vlan-tagged"
    netns.run(["sysctl", "-qw", f"{key}=0"], lab.ns_fw)  # the kernel's default, whatever earlier tests left
    deploy_both(lab, pol)
    assert netns.run(["sysctl", "-n", key], lab.ns_fw).strip() == "1"
    netns.run(["sysctl", "-qw", f"{key}=1"], lab.ns_plain)  # the oracle: the same policy, tagged frames filtered
    probes = make_probes(pol, 400, generation=0, seed=9, malformed=1.0, kinds=("vlan",), bad_share=0.5)
    report = compare(probes, exchange({"send": lab.ns_send, "recv": lab.ns_recv, "plain": lab.ns_plain}, probes))
    assert report["mismatches"] == 0, report["examples"][:3]
    assert report["delivered_oracle"] < 400  # the policy dropped some: the comparison had something to catch


@pytest.mark.parametrize(
    ("chain", "nic_mode", "why"),
    [
        ("INPUT", "bridge", r"chain INPUT needs nic_mode = 'host'"),
        ("OUTPUT", "auto", r"chain OUTPUT cannot be deployed on a NIC"),
        ("OUTPUT", "host", r"chain OUTPUT cannot be deployed on a NIC"),
    ],
)
def test_host_chains_are_refused_on_a_bridge_nic(lab, chain, nic_mode, why):
    """A bridging NIC's frames reach FORWARD only: an INPUT policy on a NIC configured for bridge mode, and an
    OUTPUT policy on any NIC (the NIC never sees what the host sends), used to deploy and filter nothing; they are
    refused, naming the file, before anything changes (INPUT deploys in host mode: tests/system/test_host_mode.py)."""
    from hypafilter.config import Config
    from hypafilter.errors import HypafilterError
    from hypafilter.iptables.document import parse_policy
    from hypafilter.ops import deploy

    before = deploy.read_state()
    pol = parse_policy(f"*filter\n:{chain} DROP [0:0]\n-A {chain} -p tcp -j ACCEPT\nCOMMIT\n", "host.rules", chain)
    with pytest.raises(HypafilterError, match=rf"host.rules: {why}"):
        deploy.deploy(pol, Config(nic_mode=nic_mode))
    assert deploy.read_state() == before


def test_bridge_settings_drift_and_undeploy_gives_them_back(lab):
    """status names a firewall bridge that filters tagged frames no longer, or lost the table that drops two-tag
    frames; a deploy repairs both; undeploy gives the VLAN setting found before the first deploy back."""
    from hypafilter import netns
    from hypafilter.config import Config
    from hypafilter.netfilter.bridge import TABLE
    from hypafilter.ops import deploy

    key = "net.bridge.bridge-nf-filter-vlan-tagged"
    deploy.undeploy()
    netns.run(["sysctl", "-qw", f"{key}=0"], lab.ns_fw)
    pol = parse("*filter\n:FORWARD ACCEPT [0:0]\n-A FORWARD -p tcp -j DROP\nCOMMIT\n", "bridge.rules")
    deploy.deploy(pol, Config())
    assert deploy.status()["drift"] == []
    netns.run(["sysctl", "-qw", f"{key}=0"], lab.ns_fw)
    netns.run(["nft", "delete", "table", "bridge", TABLE], lab.ns_fw)
    found = deploy.status()["drift"]
    assert any(key in d for d in found) and any(TABLE in d for d in found), found
    deploy.deploy(pol, Config())  # repairs drift
    assert deploy.status()["drift"] == []
    assert netns.run(["sysctl", "-n", key], lab.ns_fw).strip() == "1"
    deploy.undeploy()
    assert netns.run(["sysctl", "-n", key], lab.ns_fw).strip() == "0"
    assert not netns.succeeds(["nft", "list", "table", "bridge", TABLE], lab.ns_fw)


# ---- frames the kernel treats apart, compared frame by frame with the kernel -----------------------------------

STATELESS = (
    "*filter\n:FORWARD DROP [0:0]\n"
    "-A FORWARD -p udp -m udp --dport 53 -j DROP\n"
    "-A FORWARD -p udp -j ACCEPT\n"
    "-A FORWARD -p tcp -j ACCEPT\n"
    "-A FORWARD -p icmp -j ACCEPT\nCOMMIT\n"
)
# The same hardware entries in selective mode (one emulator build), plus a conntrack rule: defragmentation is on.
WITH_CONNTRACK = STATELESS.replace(
    "-A FORWARD -p udp -m udp --dport 53",
    "-A FORWARD -m conntrack --ctstate INVALID -j DROP\n-A FORWARD -p udp -m udp --dport 53",
)


def kinds_verified(policy, kinds: tuple[str, ...], packets: int = 300, **cfg) -> dict:
    from hypafilter.config import Config
    from hypafilter.ops.verify import verify

    r = verify(policy, Config(**cfg), packets=packets, seed=11, malformed=1.0, kinds=kinds)
    assert r["mismatches"] == 0, f"{r['mismatches']} mismatches ({r['by_kind']}), e.g. {r['examples'][:3]}"
    return r


@pytest.mark.parametrize("text", [STATELESS, WITH_CONNTRACK], ids=["stateless", "conntrack"])
def test_fragments_against_the_kernel(lab, text):
    """Complete datagrams fragmented by the sender's stack (3,000 bytes over a 1,500-byte path) reassemble at
    the receiver exactly when the kernel lets them through; single fragments, frame by frame, too."""
    from hypafilter.ops.connections import udp_delivered

    pol = parse(text, "frag.rules")
    r = kinds_verified(pol, ("fragment_first", "fragment_later", "fragment_middle", "fragment_last"))
    assert r["hw_forwarded"] == 0  # the hardware never decides a fragment
    sends = [(53, b"d" * 3000), (54, b"e" * 3000), (55, b"f" * 2000 + b"BAD")]
    plain = udp_delivered(lab.ns_send, lab.ns_recv, lab.ip("recv", "plain"), sends)
    hyb = udp_delivered(lab.ns_send, lab.ns_recv, lab.ip("recv", "hyb"), sends)
    assert [p for p, _ in plain] == [54, 55]
    assert hyb == plain


def test_bad_ip_checksums_against_the_kernel(lab):
    """br_netfilter drops an IPv4 frame with a wrong header checksum before any rule; the hardware must not
    forward it, although the policy accepts its headers."""
    r = kinds_verified(parse(STATELESS, "csum.rules"), ("bad_ip_checksum",))
    assert r["delivered_oracle"] == 0 and r["delivered_hybrid"] == 0


@pytest.mark.parametrize("unfilterable", ["pass", "drop"])
def test_two_tag_frames_against_the_kernel(lab, unfilterable):
    """QinQ/802.1ad two-tag frames cross a bridge without any iptables rule: with unfilterable = "pass" the
    kernel (no bridge table) delivers every one and so must the hybrid; with "drop" both drop them."""
    r = kinds_verified(parse(STATELESS, "qinq.rules"), ("qinq",), packets=200, unfilterable=unfilterable)
    assert r["delivered_oracle"] == (200 if unfilterable == "pass" else 0), r["by_kind"]


def test_link_local_destinations_against_the_kernel(lab):
    """01:80:C2:00:00:0x: the bridge forwards none of them but 01:80:C2:00:00:00 (STP off)."""
    r = kinds_verified(parse(STATELESS, "ll.rules"), ("link_local_dst",))
    assert 0 < r["delivered_oracle"] < r["packets"]


def test_nft_icmp_forms_against_the_kernel(lab):
    """`! --icmp-type 3/1`, `--icmp-type any` and `! --icmp-type any` written as nftables (netfilter.nft) give
    every frame the verdict the policy gives it in iptables: the same frames through the plain namespace, first
    with the policy in iptables, then with the nft rendering alone."""
    from hypafilter.analysis.plan import build_plan
    from hypafilter.netfilter.nft import to_nft
    from hypafilter.ops.verify import exchange, load_oracle, make_probes

    pol = parse(
        "*filter\n:FORWARD DROP [0:0]\n"
        "-A FORWARD -p icmp -m icmp ! --icmp-type any -j ACCEPT\n"
        "-A FORWARD -s 10.0.0.0/9 -p icmp -m icmp ! --icmp-type 3/1 -j ACCEPT\n"
        "-A FORWARD -s 10.128.0.0/9 -p icmp -m icmp --icmp-type any -j ACCEPT\n"
        "-A FORWARD -p icmp -m icmp --icmp-type 3/1 -j ACCEPT\n"
        "-A FORWARD -p icmp -m icmp --icmp-type 3 -j DROP\n"
        "-A FORWARD -p tcp -j ACCEPT\nCOMMIT\n",
        "icmp.rules",
    )
    probes = make_probes(pol, 600, seed=4, malformed=0.0)
    ns = {"send": lab.ns_send, "recv": lab.ns_recv, "plain": lab.ns_plain}
    load_oracle(lab.ns_plain, pol)
    kernel = set(exchange(ns, probes)["plain"])
    ns_sh(lab.ns_plain, "iptables-restore", stdin="*filter\n:FORWARD ACCEPT [0:0]\nCOMMIT\n")
    text = to_nft(build_plan(pol, strategy="full"), "full", "NFT1_")
    text += "table ip nft1 {\n\tchain base_forward {\n\t\ttype filter hook forward priority 0; policy drop;\n"
    text += "\t\tjump NFT1_MAIN\n\t}\n}\n"
    ns_sh(lab.ns_plain, "nft", "-f", "-", stdin=text)
    try:
        nft = set(exchange(ns, probes)["plain"])
    finally:
        ns_sh(lab.ns_plain, "nft", "delete", "table", "ip", "nft1")
    icmp = {p.uid for p in probes if p.frame[23] == 1}
    assert kernel & icmp and icmp - kernel  # some ICMP frames delivered, some dropped
    assert nft == kernel, sorted(nft ^ kernel)[:10]
