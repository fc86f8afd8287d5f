"""System tests: the ip6tables parser against the kernel (issue #25, docs/ipv6.md "Input and IR").

- the canonical text of rules read with -6 is what ip6tables-save prints after loading them;
- `-p` as the kernel reads it for frames with extension headers: crafted IPv6 frames sent over a veth into a
  namespace whose INPUT chain counts one `-p` rule each; the rules the IR's boxes say the frame's header hits (its
  upper-layer protocol as ipv6_find_hdr under nf_tables finds it, written down per frame below) are exactly the
  rules whose counters moved.
"""

from __future__ import annotations

import time

import pytest
from hypafilter import netns
from hypafilter.iptables.canonical import rule_tokens
from hypafilter.iptables.parser import parse_rule
from hypafilter.iptables.writer import tokens_text
from hypafilter.ir import Header

from tests.scratchns import scratch_netns
from tests.unit.test_ipv6_parse import IP6TABLES_S

pytestmark = pytest.mark.system

PREFIX = "v6i"


def _save_rules(ns: str) -> list[str]:
    out = netns.run(["ip6tables-save", "-t", "filter"], ns)
    return [ln.split(" ", 2)[2] for ln in out.splitlines() if ln.startswith("-A FORWARD ")]


def test_canonical_text_is_what_ip6tables_save_prints():
    rules = [r for r, _ in IP6TABLES_S]
    text = "*filter\n:FORWARD ACCEPT [0:0]\n" + "".join(f"-A FORWARD {r}\n" for r in rules) + "COMMIT\n"
    with scratch_netns(PREFIX, "ip6tables-restore") as ns:
        netns.run(["ip6tables-restore"], ns, input=text)
        saved = _save_rules(ns)
    mine = [tokens_text(rule_tokens(r)) for rule in rules for r in parse_rule(rule, family=6)]
    assert saved == mine


# (name, scapy layers between the IPv6 header and the end, the header the IR gives the frame)
FRAMES = [
    ("udp", "UDP(sport=1, dport=9) / Raw(b'x' * 8)", Header(proto=17, sport=1, dport=9)),
    ("dstopt-udp", "IPv6ExtHdrDestOpt() / UDP(sport=1, dport=9) / Raw(b'x' * 8)", Header(proto=17, sport=1, dport=9)),
    (
        "hbh-routing-udp",
        "IPv6ExtHdrHopByHop() / IPv6ExtHdrRouting(segleft=0) / UDP(sport=1, dport=9) / Raw(b'x' * 8)",
        Header(proto=17, sport=1, dport=9),
    ),
    ("ah-udp", "AH(spi=1, seq=1, icv=b'\\0' * 12) / UDP(sport=1, dport=9) / Raw(b'x' * 8)", Header(proto=51)),
    ("nonxt", "IPv6ExtHdrDestOpt(nh=59)", Header(proto=59)),
    ("esp", "ESP(spi=7, seq=1) / Raw(b'x' * 16)", Header(proto=50)),
    ("echo", "ICMPv6EchoRequest(id=1, seq=1)", Header(proto=58, icmp_type=128)),
]
RULES = [
    "-p ah",
    "-p 44",
    "-p ipv6-opts",
    "-p ipv6-route",
    "! -p 44",
    "-p 59",
    "-p udp",
    "-p udp --dport 9",
    "-p 0",
    "-p esp",
    "! -p ah",
    "-p icmpv6 --icmpv6-type echo-request",
    "-p icmpv6 ! --icmpv6-type 1",
]
SENDER = """
import sys
from scapy.all import AH, ESP, UDP, Ether, IPv6, IPv6ExtHdrDestOpt, IPv6ExtHdrHopByHop, IPv6ExtHdrRouting, Raw, sendp
from scapy.layers.inet6 import ICMPv6EchoRequest
for i, layers in enumerate(sys.argv[2:]):
    base = Ether(dst=sys.argv[1]) / IPv6(src=f"2001:db8::{100 + i:x}", dst="2001:db8::2", hlim=64)
    sendp(base / eval(layers), iface="v6ia", verbose=False)
"""


def test_protocol_of_frames_with_extension_headers_is_the_kernels():
    """Frame i comes from 2001:db8::(100 + i) (hex) and meets its own copy of every rule (`-s` of its source)."""
    import sys

    irules = [parse_rule(f"{r} -j ACCEPT", family=6)[0] for r in RULES]
    # neighbour discovery (hop limit 255) is let through first
    policy = "*filter\n:INPUT ACCEPT [0:0]\n-A INPUT -p icmpv6 -m hl --hl-eq 255 -j ACCEPT\n"
    for i in range(len(FRAMES)):
        policy += "".join(f"-A INPUT -s 2001:db8::{100 + i:x} {r}\n" for r in RULES)
    policy += "COMMIT\n"
    with scratch_netns(PREFIX, "ip6tables-restore") as a, scratch_netns(PREFIX, "ip6tables-restore") as b:
        netns.run(["ip", "link", "add", "v6ia", "netns", a, "type", "veth", "peer", "name", "v6ib", "netns", b], None)
        for ns, dev, addr in ((a, "v6ia", "2001:db8::1/64"), (b, "v6ib", "2001:db8::2/64")):
            netns.run(["ip", "link", "set", dev, "up"], ns)
            netns.run(["ip", "addr", "add", addr, "dev", dev, "nodad"], ns)
        netns.run(["ip6tables-restore"], b, input=policy)
        mac = netns.run(["cat", "/sys/class/net/v6ib/address"], b).strip()
        netns.run([sys.executable, "-c", SENDER, mac, *(layers for _, layers, _ in FRAMES)], a)
        time.sleep(0.1)
        out = netns.run(["ip6tables", "-L", "INPUT", "-v", "-n", "-x"], b).splitlines()[3:]
    counted = [int(ln.split()[0]) for ln in out if ln.strip()]
    assert len(counted) == len(FRAMES) * len(RULES)
    for i, (name, _, header) in enumerate(FRAMES):
        kernel = [c > 0 for c in counted[i * len(RULES) : (i + 1) * len(RULES)]]
        hit = [any(bx.contains(header) for bx in r.boxes) for r in irules]
        unexpected = [RULES[j] for j, (h, k) in enumerate(zip(hit, kernel, strict=True)) if h != k]
        assert not unexpected, (name, unexpected)


def test_sets_ip6tables_refuses_are_errors_and_the_others_are_read():
    """An inet set in an IPv6 rule: ip6tables refuses it ("The protocol family of set ... is IPv4"), and so does the
    parser, at the rule; an inet6 set and a family-free bitmap:port set load, and the parser reads them (set slots on
    a target with IPv6 set slots, complex on one without)."""
    from hypafilter.errors import PolicyError
    from hypafilter.iptables.document import parse_policy
    from hypafilter.iptables.sets import SetEnv
    from hypafilter.netfilter import ipset

    save = "create s4 hash:net\ncreate s6 hash:net family inet6\ncreate p bitmap:port range 0-1024\n"
    sets = ipset.parse_save(save, "sets6")
    with scratch_netns(PREFIX, "ip6tables", "ipset") as ns:
        netns.run(["ipset", "restore"], ns, input=save)
        for name, ok in (("s4", False), ("s6", True), ("p", True)):
            rule = f"-m set --match-set {name} {'dst' if name == 'p' else 'src'} -j DROP"
            try:
                netns.run(["ip6tables", "-A", "FORWARD", *rule.split()], ns)
                loaded = True
            except netns.CommandError as e:
                assert "protocol family of set" in str(e)
                loaded = False
            assert loaded == ok, name
            text = f"*filter\n:FORWARD ACCEPT [0:0]\n-A FORWARD {rule}\nCOMMIT\n"
            try:
                p = parse_policy(text, "sets6.rules", family=6, sets=SetEnv(sets))
                assert p.rules[0].is_simple, name  # a set slot of the IPv6 plan (docs/sets.md "IPv6 sets")
                p = parse_policy(text, "sets6.rules", family=6, sets=SetEnv(sets, v6_slots=False))
                assert not p.rules[0].is_simple, name  # a target without IPv6 set slots: complex
                parsed = True
            except PolicyError as e:
                assert (e.line, e.token) == (3, name)
                parsed = False
            assert parsed == ok, name
