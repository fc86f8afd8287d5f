"""The IPv6 attack mix of `bench rate -6 --attack` (tools/bench/attack.py, tools/bench/rate.py): the inet6 blocklist
(its networks, its ipset and nft forms, its rules ahead of an ip6tables policy), the spoofed IPv6 sources and the
frames aimed at what the IPv6 policy drops, the legitimate IPv6 flow, --ct-first for the mapped ClassBench set, and
the combinations refused (text and generation only; the kernel's verdicts are tests/system/test_bench_attack6.py's)."""

from __future__ import annotations

import argparse
import dataclasses
import ipaddress
import random

import pytest
from hypafilter.analysis.decision import decision
from hypafilter.analysis.plan import build_plan
from hypafilter.config import Config
from hypafilter.errors import HypafilterError
from hypafilter.iptables.document import parse_policy
from hypafilter.ir import ACTION_DROP, Header
from hypafilter.ir.box import CT_NONE
from hypafilter.netfilter import ip6
from hypafilter.tools.bench import attack
from hypafilter.tools.bench.rate import attack_probes, attacker_pool, headers6, nft_text6, rate

HEAD = "*filter\n:INPUT ACCEPT [0:0]\n:FORWARD DROP [0:0]\n:OUTPUT ACCEPT [0:0]\n"
# A mapped ClassBench import's shape, conntrack first: UDP accepted between two IPv6 prefixes.
UDP_ONLY6 = (
    HEAD + "-A FORWARD -m conntrack --ctstate ESTABLISHED,RELATED -j ACCEPT\n"
    "-A FORWARD -s 2001:db8:3d00::/40 -d 2001:db8:5db8::/48 -p udp -m udp --dport 1000:2000 -j ACCEPT\n"
    "-A FORWARD -p tcp -m tcp --dport 22 -j DROP\nCOMMIT\n"
)
SITE6 = ipaddress.ip_network("2001:db8::/32")


def _v6(text: str) -> ip6.V6Policy:
    v6 = ip6.parse(text, "v6", validate=False)
    return dataclasses.replace(v6, ir=parse_policy(text, filename="v6", config=Config(), allow_empty=True, family=6))


def _nets(networks):
    return [ipaddress.ip_network(attack.net_text(n)) for n in networks]


def test_blocklist_networks6_disjoint_in_sites_of_their_own():
    avoid = {int(ipaddress.ip_address("2001:db8:3d02:304::1")), int(ipaddress.ip_address("2001:db8:5db8:101::9"))}
    nets = attack.blocklist_networks(3000, 1, avoid, family=6)
    assert len(set(nets)) == 3000 and attack.blocklist_networks(3000, 1, avoid, family=6) == nets
    objs = _nets(nets)
    assert {n.version for n in objs} == {6} and {n.prefixlen for n in objs} == {48, 52, 56, 64, 128}
    sites = {int(n.network_address) >> 80 for n in objs}
    assert len(sites) == 3000  # one network per /48
    for n in objs:
        assert n.subnet_of(SITE6), n
        block = (int(n.network_address) >> 80) & 0xFFFF  # the /16 of the IPv4 space the /48 maps
        assert block >> 8 not in (0, 10, 127) and block < 0xE000, n
        assert not any(a >> 80 == int(n.network_address) >> 80 for a in avoid)
    # the IPv4 list of a seed is what it was
    assert all(n.version == 4 for n in _nets(attack.blocklist_networks(50, 1)))


def test_ipset_restore_and_rules6():
    nets = [(int(ipaddress.ip_address("2001:db8:102::")), 48), (int(ipaddress.ip_address("2001:db8:506:7::8")), 128)]
    assert attack.ipset_restore(nets, attack.BLOCKLIST_SET6, 6).splitlines() == [
        f"create {attack.BLOCKLIST_SET6} hash:net family inet6 hashsize 16384 maxelem 65536",
        f"add {attack.BLOCKLIST_SET6} 2001:db8:102::/48",
        f"add {attack.BLOCKLIST_SET6} 2001:db8:506:7::8/128",
    ]
    assert attack.blocklist_rules(nets, "ipset", "FORWARD", 6) == [
        f"-A FORWARD -m set --match-set {attack.BLOCKLIST_SET6} src -j DROP"
    ]
    assert attack.blocklist_rules(nets, "rules", "FORWARD", 6)[1] == "-A FORWARD -s 2001:db8:506:7::8/128 -j DROP"
    decl, drop = attack.nft_blocklist(nets, 6)
    assert "type ipv6_addr; flags interval;" in decl and "2001:db8:102::/48, 2001:db8:506:7::8/128" in decl
    assert drop == f"ip6 saddr @{attack.NFT_SET} drop"


def test_blocklist_set6_fits_an_xdp_set_slot():
    """The inet6 blocklist set at its largest is an IPv6 set slot of the xdp program: its rule simple."""
    from hypafilter.iptables.sets import SetEnv
    from hypafilter.netfilter.ipset import parse_save
    from hypafilter.targets import set_capability

    nets = attack.blocklist_networks(attack.MAX_BLOCKLIST, 3, family=6)
    text = attack.ipset_restore(nets, attack.BLOCKLIST_SET6, 6)
    slots, capacity = set_capability("xdp")
    env = SetEnv(parse_save(text, "bench"), slots, capacity, "xdp", "bench", text=text, v6_slots=True)
    doc = (
        HEAD
        + "\n".join(attack.blocklist_rules(nets, "ipset", "FORWARD", 6))
        + "\n-A FORWARD -p udp -j ACCEPT\nCOMMIT\n"
    )
    pol = parse_policy(doc, "p", config=Config(target="xdp"), family=6, sets=env)
    assert not pol.rules[0].complex, pol.rules[0]


@pytest.mark.parametrize("as_", attack.BLOCKLIST_AS)
def test_blocklist_goes_ahead_of_the_ip6tables_policy(as_, monkeypatch):
    # (the kernel's check of the text, ip6tables-restore in a scratch namespace, needs root: the system test runs it)
    monkeypatch.setattr(ip6, "check", lambda *a, **k: None)
    v6 = _v6(UDP_ONLY6.replace("*filter\n", "*raw\n:PREROUTING ACCEPT [0:0]\nCOMMIT\n*filter\n"))
    nets = attack.blocklist_networks(20, 2, family=6)
    both = attack.with_blocklist(v6, Config(), nets, as_)
    assert isinstance(both, ip6.V6Policy) and both.ir is not None and both.ir.family == 6
    rules = [ln for ln in both.text.splitlines() if ln.startswith("-A FORWARD ")]
    extra = 1 if as_ == "ipset" else 20
    assert rules[extra:] == [ln for ln in v6.text.splitlines() if ln.startswith("-A FORWARD ")]
    if as_ == "ipset":
        assert rules[0] == f"-A FORWARD -m set --match-set {attack.BLOCKLIST_SET6} src -j DROP"
    else:
        assert rules[0] == f"-A FORWARD -s {attack.net_text(nets[0])} -j DROP"
        assert both.ir.rules[0].boxes and not both.ir.rules[0].complex
    assert both.rules["filter/FORWARD"] == v6.rules["filter/FORWARD"] + extra
    assert attack.with_blocklist(v6, Config(), [], as_) is v6


def test_nft_text6_blocklist_set():
    nets = attack.blocklist_networks(5, 4, family=6)
    text = nft_text6(_v6(UDP_ONLY6), Config(), blocklist=nets)
    hook = text[text.rindex(f"table ip6 {'hfrate'} {{") :]
    assert f"set {attack.NFT_SET} {{" in hook and "type ipv6_addr" in hook and attack.net_text(nets[0]) in hook
    assert hook.index(f"ip6 saddr @{attack.NFT_SET} drop") < hook.index("jump ")
    assert "table ip " not in text


def test_attacker_pool6_maps_the_ipv4_pool():
    four, six = attacker_pool(3, 50), attacker_pool(3, 50, 6)
    assert [(a >> 64) & 0xFFFFFFFF for a in six] == four  # 2001:db8:(a >> 16):(a & 0xffff):<64 random bits>
    assert all(ipaddress.ip_address(a) in SITE6 for a in six)


@pytest.mark.parametrize("shape", ["syn", "udp"])
def test_attack_probes6_aim_at_what_the_ipv6_policy_drops(shape):
    from scapy.layers.inet import TCP, UDP
    from scapy.layers.inet6 import IPv6
    from scapy.layers.l2 import Ether

    v6 = _v6(UDP_ONLY6)
    pool = attacker_pool(5, 30, 6)
    nets = attack.blocklist_networks(40, 5, set(pool), family=6)
    probes = attack_probes(None, Config(), None, 200, 5, shape, 30, nets, 0.25, v6=v6)
    assert [p.kind for p in probes] == [f"v6_attack_{shape}"] * 150 + [f"v6_blocklist_{shape}"] * 50
    plan = build_plan(v6.ir, Config())
    objs = _nets(nets)
    for p in probes:
        pkt = Ether(p.frame)
        ip = pkt[IPv6]
        l4 = pkt[TCP] if shape == "syn" else pkt[UDP]
        if shape == "syn":
            assert int(l4.flags) == 0x02 and not bytes(l4.payload)
        src, dst = int(ipaddress.ip_address(ip.src)), int(ipaddress.ip_address(ip.dst))
        listed = any(ipaddress.ip_address(ip.src) in n for n in objs)
        assert listed == p.kind.startswith("v6_blocklist")
        if not listed:
            assert src in pool
            hdr = Header(src, dst, ip.nh, l4.sport, l4.dport, 0, 0, 0, 0x02 if shape == "syn" else 0, CT_NONE)
            assert decision(plan, plan.addr_map.header(hdr))[2] == ACTION_DROP  # as NEW
    # the trace mapped into IPv6 is what the frames are drawn from when given
    mapped = [{"src": "2001:db8:3d01::1", "dst": "2001:db8:77::2", "proto": 17, "sport": 9, "dport": 7, "flags": 0}]
    got = attack_probes(None, Config(), None, 10, 5, shape, 30, v6=v6, v6_headers=mapped)
    assert {Ether(p.frame)[IPv6].dst for p in got} == {"2001:db8:77::2"}


def test_legit_flow6_udp_between_the_prefixes():
    v6 = _v6(UDP_ONLY6)
    headers = headers6(v6, None, 5000, random.Random(5))
    assert all(isinstance(h["src"], int) and isinstance(h["dst"], int) for h in headers)
    f = attack.legit_flow(v6.ir, Config(), headers, 10, 1)
    assert f.family == 6 and f.proto == "udp" and 1000 <= f.port <= 2000 and len(set(f.sports)) == 10
    assert ipaddress.ip_address(f.client) in ipaddress.ip_network("2001:db8:3d00::/40")
    assert ipaddress.ip_address(f.server) in ipaddress.ip_network("2001:db8:5db8::/48")
    assert f.summary()["client"] == str(ipaddress.ip_address(f.client))


def test_ct_first_text_of_the_mapped_set():
    from hypafilter.cli.bench import ct_first_text

    text = ct_first_text(HEAD + "-A FORWARD -s 2001:db8::/32 -j DROP\nCOMMIT\n", "FORWARD")
    rules = [ln for ln in text.splitlines() if ln.startswith("-A ")]
    assert rules == [
        "-A FORWARD -m conntrack --ctstate ESTABLISHED,RELATED -j ACCEPT",
        "-A FORWARD -s 2001:db8::/32 -j DROP",
    ]


def test_refused_combinations():
    from hypafilter.cli.bench import _rate_ipv6

    v6 = _v6(UDP_ONLY6)
    for kw in ({"v6_frames": 0.5}, {"v6_frames": 1.0, "target": "emu"}):
        with pytest.raises(HypafilterError, match="--attack with IPv6"):
            rate(
                parse_policy(HEAD + "COMMIT\n", "p4", allow_empty=True),
                Config(),
                attack="syn",
                v6=v6,
                **{"target": "xdp", **kw},
            )
    with pytest.raises(HypafilterError, match="--established"):
        rate(
            parse_policy(HEAD + "COMMIT\n", "p4", allow_empty=True),
            Config(),
            established=True,
            trace="t",
            v6=v6,
            v6_frames=1.0,
        )
    for family6, classbench, ipv6 in ((False, "f", "x.rules6"), (True, None, None)):
        args = argparse.Namespace(ct_first=True, family6=family6, classbench=classbench, ipv6=ipv6, policy="p")
        with pytest.raises(HypafilterError, match="--ct-first with IPv6"):
            _rate_ipv6(args, Config())
