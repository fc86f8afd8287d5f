"""ip6tables policies (-6, issue #25): addresses, protocols, icmpv6, multiport, iprange, the matches only ip6tables has,
REJECT, sets, errors naming file/line/token; canonical text as ip6tables 1.8.9 prints it (docs/ipv6.md)."""

from __future__ import annotations

import ipaddress
import random
import socket
from pathlib import Path

import pytest
from hypafilter.errors import PolicyError
from hypafilter.iptables.canonical import ip6_str, rule_tokens
from hypafilter.iptables.document import parse_policy, read_table
from hypafilter.iptables.parser import parse_rule
from hypafilter.iptables.sets import SetEnv
from hypafilter.iptables.writer import rule_line, tokens_text
from hypafilter.ir import Header
from hypafilter.ir.family import address_space
from hypafilter.ir.sets import SetInfo

TOP = (1 << 128) - 1
REAL6 = sorted((Path(__file__).resolve().parents[2] / "rulesets" / "real").glob("*.rules6"))


def a6(s: str) -> int:
    return int(ipaddress.IPv6Address(s))


def one(text: str):
    (r,) = parse_rule(text, family=6)
    return r


def canon(text: str) -> str:
    return tokens_text(rule_tokens(one(text)))


def hit(r, **h) -> bool:
    return any(b.contains(Header(**h)) for b in r.boxes)


def policy(*rules: str, default: str = "DROP", **kw):
    text = "*filter\n:INPUT ACCEPT [0:0]\n:FORWARD " + default + " [0:0]\n:OUTPUT ACCEPT [0:0]\n"
    text += "".join(f"-A FORWARD {r}\n" for r in rules) + "COMMIT\n"
    return parse_policy(text, filename="v6.rules", family=6, **kw)


# What `ip6tables -A FORWARD <rule>; ip6tables -S FORWARD` (1.8.9, nf_tables) prints for each rule.
IP6TABLES_S = [
    ("-s 2001:DB8::1/64 -j ACCEPT", "-s 2001:db8::/64 -j ACCEPT"),
    ("-s 2001:db8:0:0:1:0:0:1 -j ACCEPT", "-s 2001:db8::1:0:0:1/128 -j ACCEPT"),
    ("-s 2001:db8:0:1:0:0:0:0/128 -j ACCEPT", "-s 2001:db8:0:1::/128 -j ACCEPT"),
    ("-d ::ffff:1.2.3.4 -j ACCEPT", "-d ::ffff:1.2.3.4/128 -j ACCEPT"),
    ("-s ::1.2.3.4 -j ACCEPT", "-s ::1.2.3.4/128 -j ACCEPT"),
    ("-s 2001:db8::/ffff:ffff:: -j ACCEPT", "-s 2001:db8::/32 -j ACCEPT"),
    ("-s 2001:db8::/ffff:0:ffff:: -j ACCEPT", "-s 2001::/ffff:0:ffff:: -j ACCEPT"),
    ("-s ::/0 -j ACCEPT", "-j ACCEPT"),
    ("-p all ! -s 2001:db8::/32 -j ACCEPT", "! -s 2001:db8::/32 -j ACCEPT"),
    ("-p 0 -j DROP", "-j DROP"),
    ("-p 44 -j DROP", "-p ipv6-frag -j DROP"),
    ("! -p 60 -j DROP", "! -p ipv6-opts -j DROP"),
    ("-p 59 -j DROP", "-p ipv6-nonxt -j DROP"),
    ("-p icmpv6 --icmpv6-type echo-request -j ACCEPT", "-p ipv6-icmp -m icmp6 --icmpv6-type 128 -j ACCEPT"),
    ("-p ipv6-icmp -m icmp6 --icmpv6-type 1/3 -j ACCEPT", "-p ipv6-icmp -m icmp6 --icmpv6-type 1/3 -j ACCEPT"),
    ("-p icmpv6 --icmpv6-type dest -j ACCEPT", "-p ipv6-icmp -m icmp6 --icmpv6-type 1 -j ACCEPT"),
    ("-p icmpv6 --icmpv6-type beyond-scope -j ACCEPT", "-p ipv6-icmp -m icmp6 --icmpv6-type 1/2 -j ACCEPT"),
    ("-p icmpv6 --icmpv6-type Echo-Request -j ACCEPT", "-p ipv6-icmp -m icmp6 --icmpv6-type 128 -j ACCEPT"),
    ("-p icmpv6 --icmpv6-type 1/0:255 -j ACCEPT", "-p ipv6-icmp -m icmp6 --icmpv6-type 1 -j ACCEPT"),
    ("-p ipv6-icmp -m icmpv6 --icmpv6-type 2 -j ACCEPT", "-p ipv6-icmp -m icmp6 --icmpv6-type 2 -j ACCEPT"),
    ("-p 58 --icmpv6-type 2 -j ACCEPT", "-p ipv6-icmp -m icmp6 --icmpv6-type 2 -j ACCEPT"),
    (
        "-p icmpv6 -m icmp6 --icmpv6-type neighbor-solicitation -j ACCEPT",
        "-p ipv6-icmp -m icmp6 --icmpv6-type 135 -j ACCEPT",
    ),
    ("-p icmpv6 --icmpv6-type 255 -j DROP", "-p ipv6-icmp -m icmp6 --icmpv6-type 255 -j DROP"),
    (
        "-m iprange --src-range 2001:db8::1-2001:db8::ff -j DROP",
        "-m iprange --src-range 2001:db8::1-2001:db8::ff -j DROP",
    ),
    ("-m hl --hl-eq 5 -j DROP", "-m hl --hl-eq 5 -j DROP"),
    ("-p 0 -m hl --hl-lt 3 -j ACCEPT", "-m hl --hl-lt 3 -j ACCEPT"),
    ("-m ipv6header --header ipv6-frag --soft -j ACCEPT", "-m ipv6header --header ipv6-frag --soft -j ACCEPT"),
    ("-m hbh --hbh-len 8 -j ACCEPT", "-m hbh --hbh-len 8 -j ACCEPT"),
    ("-p tcp -j REJECT --reject-with tcp-reset", "-p tcp -j REJECT --reject-with tcp-reset"),
    ("-6 -j ACCEPT", "-j ACCEPT"),
]


@pytest.mark.parametrize(("rule", "printed"), IP6TABLES_S)
def test_canonical_text_is_what_ip6tables_prints(rule, printed):
    assert canon(rule) == printed


def test_addresses_are_printed_as_glibc_inet_ntop_writes_them():
    rnd = random.Random(25)
    cases = [0, 1, TOP, a6("::ffff:1.2.3.4"), a6("::1.2.3.4"), a6("::0.0.1.2"), a6("1:0:0:1::"), a6("::ffff:0:0")]
    for _ in range(3000):
        cases.append(sum(rnd.choice([0, 0, 0, 1, 0xFFFF, rnd.randrange(1 << 16)]) << (16 * i) for i in range(8)))
    for v in cases:
        assert ip6_str(v) == socket.inet_ntop(socket.AF_INET6, v.to_bytes(16, "big")), hex(v)


def test_prefixes_and_inversions_are_128_bit_intervals():
    r = one("-s 2001:db8::/32 -d 2001:db8:1::5 -j ACCEPT")
    (b,) = r.boxes
    assert b.interval("src") == (a6("2001:db8::"), a6("2001:db8:ffff:ffff:ffff:ffff:ffff:ffff"))
    assert b.interval("dst") == (a6("2001:db8:1::5"),) * 2
    r = one("! -s 2001:db8::/32 -j ACCEPT")
    assert sorted(b.interval("src") for b in r.boxes) == [
        (0, a6("2001:db7:ffff:ffff:ffff:ffff:ffff:ffff")),
        (a6("2001:db9::"), TOP),
    ]
    assert hit(r, src=TOP) and hit(r, src=0) and not hit(r, src=a6("2001:db8::1"))
    (b,) = one("-j ACCEPT").boxes  # no address check: every 128-bit address
    assert b.interval("src") == (0, TOP) and b.interval("dst") == (0, TOP)
    r = one("-s 2001:db8::/ffff:0:ffff:: -j ACCEPT")  # a non-contiguous mask: software decides it
    assert r.complex == [("-s", "2001::/ffff:0:ffff::")]


def test_an_ipv6_policy_keeps_its_full_box_outside_the_parser():
    p = policy("-p tcp -j ACCEPT")
    assert p.family == 6 and p.rules[0].boxes[0].interval("src") == (0, TOP)
    with address_space(6):
        pass
    r = parse_rule("-p tcp -j ACCEPT")[0]  # an IPv4 rule after it: 32-bit again
    assert r.boxes[0].interval("src") == (0, 0xFFFFFFFF)


def test_a_list_of_addresses_makes_one_rule_each():
    rs = parse_rule("-s 2001:db8::1,2001:db8::2 -d fe80::/10 -j ACCEPT", family=6)
    assert [r.boxes[0].interval("src")[0] for r in rs] == [a6("2001:db8::1"), a6("2001:db8::2")]


def test_protocols_of_extension_headers_never_match_as_ipv6_find_hdr_reads_them():
    p = policy(
        "-p 44 -j DROP", "-p ah -j DROP", "! -p 60 -j DROP", "-p 59 -j DROP", "-p all -j ACCEPT", "-p esp -j DROP"
    )
    never_frag, ah, not_opts, nonxt, every, esp = p.rules
    assert never_frag.boxes == ()  # ipv6_find_hdr never returns 43/44/60
    assert ah.boxes[0].interval("proto") == (51, 51)  # nf_tables: the walk stops at AH (IP6_FH_F_AUTH)
    assert not_opts.boxes[0].interval("proto") == (0, 255)  # `! -p 60`: every frame
    assert nonxt.boxes[0].interval("proto") == (59, 59)  # No Next Header is returned as the protocol
    assert every.boxes[0].interval("proto") == (0, 255)
    assert esp.boxes[0].interval("proto") == (50, 50)
    assert [(o.line, "never matches" in n, "reaches AH" in n) for o, n in p.notes] == [
        (5, True, False),
        (6, False, True),
    ]
    assert one("-p ipv6-route -m rt --rt-type 0 -j DROP").boxes == []  # as ip6tables warns: use -m rt alone
    with pytest.raises(PolicyError, match="would never match protocol"):
        one("! -p all -j DROP")


def test_icmpv6_types_and_codes():
    r = one("-p icmpv6 --icmpv6-type port-unreachable -j ACCEPT")
    assert hit(r, proto=58, icmp_type=1, icmp_code=4) and not hit(r, proto=58, icmp_type=1, icmp_code=3)
    assert not hit(r, proto=1, icmp_type=1, icmp_code=4)
    r = one("-p icmpv6 --icmpv6-type 255 -j ACCEPT")  # icmp6_match has no "any" type (IPv4's 255)
    assert hit(r, proto=58, icmp_type=255) and not hit(r, proto=58, icmp_type=128)
    r = one("-p icmpv6 ! --icmpv6-type 1/3 -j ACCEPT")
    assert hit(r, proto=58, icmp_type=1, icmp_code=4) and hit(r, proto=58, icmp_type=128)
    assert not hit(r, proto=58, icmp_type=1, icmp_code=3)
    r = one("-p icmpv6 --icmpv6-type ping -j ACCEPT")
    assert hit(r, proto=58, icmp_type=128, icmp_code=9)


def test_multiport_and_iprange():
    r = one("-p tcp -m multiport --dports 22,80:90 -j ACCEPT")
    assert hit(r, proto=6, dport=85) and not hit(r, proto=6, dport=91)
    r = one("-m iprange ! --dst-range 2001:db8::1-2001:db8::ff -j DROP")
    assert hit(r, dst=a6("2001:db8::100")) and not hit(r, dst=a6("2001:db8::80")) and hit(r, dst=TOP)


@pytest.mark.parametrize(
    "rule",
    [
        "-m hl --hl-eq 5 -j DROP",
        "-m frag --fragid 5 -j DROP",
        "-m ipv6header --header hop --soft -j DROP",
        "-m hbh --hbh-len 8 -j DROP",
        "-m dst --dst-len 8 -j DROP",
        "-m rt --rt-type 0 -j DROP",
        "-m ah --ahspi 5 -j DROP",
        "-m conntrack --ctstate INVALID -j LOG",
        "-m mac --mac-source 00:11:22:33:44:55 -j DROP",
    ],
)
def test_matches_only_netfilter_decides_make_the_rule_complex(rule):
    r = one(rule)
    assert r.complex and r.boxes


def test_reject_with_icmp6_types_is_complex_and_checked():
    p = policy("-p tcp -j REJECT --reject-with icmp6-adm-prohibited", "-j REJECT --reject-with port-unreach")
    assert [r.is_simple for r in p.rules] == [False, False]
    assert p.rules[1].target_args == ("--reject-with", "port-unreach")  # kept as written: ip6tables reads it so
    with pytest.raises(PolicyError, match="icmp-\\* types are IPv4's") as e:
        one("-j REJECT --reject-with icmp-port-unreachable")
    assert e.value.token == "REJECT"
    with pytest.raises(PolicyError, match="tcp-reset needs -p tcp"):
        one("-j REJECT --reject-with tcp-reset")


@pytest.mark.parametrize(
    ("rule", "message", "token"),
    [
        ("-s 2001:db8::/255.255.0.0 -j DROP", "invalid mask '255.255.0.0'", "2001:db8::/255.255.0.0"),
        ("-s 2001:db8::/129 -j DROP", "bad prefix length \\(0..128\\)", "2001:db8::/129"),
        ("-s 1.2.3.4 -j DROP", "an IPv4 address in an IPv6 policy", "1.2.3.4"),
        ("-s fe80::1%eth0 -j DROP", "zone index", "fe80::1%eth0"),
        ("-s example.org -j DROP", "host names are not accepted", "example.org"),
        ("-s 2001:db8:::1 -j DROP", "bad IPv6 address", "2001:db8:::1"),
        ("-m iprange --src-range 10.0.0.1-10.0.0.9 -j DROP", "an IPv4 address in an IPv6 policy", "10.0.0.1-10.0.0.9"),
        ("-f -j DROP", "-f is not supported in IPv6", "-f"),
        ("-4 -j DROP", "an IPv4 rule in an IPv6 policy", "-4"),
        ("-p icmp -m icmp --icmp-type 8 -j DROP", "-m icmp is IPv4's", "icmp"),
        ("-p icmp --icmp-type 8 -j DROP", "unknown option", "--icmp-type"),
        ("-p icmpv6 --icmpv6-type neighbo -j DROP", "ambiguous ICMPv6 type 'neighbo'", "neighbo"),
        ("-p icmpv6 --icmpv6-type 1:3 -j DROP", "type ranges are not supported", "1:3"),
        ("-p icmpv6 --icmpv6-type 1/0:3 -j DROP", "code ranges other than 0:255", "1/0:3"),
        ("-p icmpv6 --icmpv6-type any -j DROP", "unknown ICMPv6 type 'any'", "any"),
        ("-m icmp6 --icmpv6-type 2 -j DROP", "-m icmp6 needs -p ipv6-icmp", "icmp6"),
        ("-p tcp -j CLUSTERIP", "target CLUSTERIP is IPv4's", "CLUSTERIP"),
    ],
)
def test_errors_name_line_and_token(rule, message, token):
    with pytest.raises(PolicyError, match=message) as e:
        policy("-p udp -j ACCEPT", rule)
    assert (e.value.file, e.value.line, e.value.token) == ("v6.rules", 6, token)


def test_an_ipv6_input_in_an_ipv4_policy_points_at_the_ipv6_options():
    with pytest.raises(PolicyError, match="an IPv6 address in an IPv4 policy.*-6 FILE.*--ipv6 FILE") as e:
        parse_rule("-s 2001:db8::1 -j DROP")
    assert e.value.column == 4 and e.value.token == "2001:db8::1"
    with pytest.raises(PolicyError, match="-6: an IPv6 rule in an IPv4 policy.*--ipv6") as e:
        parse_rule("-6 -s 10.0.0.1 -j DROP")
    assert e.value.token == "-6"
    with pytest.raises(PolicyError, match="an ip6tables command in an IPv4 policy") as e:
        parse_policy("ip6tables -A FORWARD -j DROP\n", filename="plain.rules")
    assert (e.value.line, e.value.token) == (1, "ip6tables")


def test_a_plain_file_of_ip6tables_commands():
    p = parse_policy(
        "ip6tables -P FORWARD DROP\nip6tables -A FORWARD -s 2001:db8::/48 -p tcp --dport 22 -j ACCEPT\n",
        filename="plain6.rules",
        family=6,
    )
    assert p.family == 6 and p.default == "DROP" and p.rules[0].is_simple
    assert p.original_rules == [("-s", "2001:db8::/48", "-p", "tcp", "-m", "tcp", "--dport", "22", "-j", "ACCEPT")]


def test_family_is_part_of_the_policy_identity_and_ipv4_hashes_stay():
    text = "*filter\n:FORWARD DROP [0:0]\n-A FORWARD -p tcp -j ACCEPT\nCOMMIT\n"
    p4, p6 = parse_policy(text), parse_policy(text, family=6)
    assert p4.family == 4 and "family" not in p4.canonical_text()
    assert p6.canonical_text() == p4.canonical_text().replace("policy DROP\n", "policy DROP\nfamily 6\n")
    assert p4.policy_hash() != p6.policy_hash()


def test_sets_in_an_ipv6_policy():
    env = SetEnv(
        {
            "bad6": SetInfo("bad6", "hash:net", family="inet6", netmask=128),
            "bad4": SetInfo("bad4", "hash:net", family="inet"),
            "ports": SetInfo("ports", "bitmap:port", family="inet"),
        }
    )
    p = policy(
        "-m set --match-set bad6 src -j DROP", "-m set --match-set ports dst -j DROP", "-p tcp -j ACCEPT", sets=env
    )
    # inet6 sets and the family-less bitmap:port are set slots of the IPv6 plan (docs/sets.md "IPv6 sets") ...
    assert [r.is_simple for r in p.rules] == [True, True, True]
    assert [(n.slot, n.why) for n in p.set_notes] == [(0, ""), (1, "")]
    assert [s.name for s in p.set_slots] == ["bad6", "ports"]
    # ... except on a target without IPv6 set slots (one whose set tables key IPv4 addresses alone)
    env.target, env.v6_slots = "emu", False
    p = policy("-m set --match-set bad6 src -j DROP", "-p tcp -j ACCEPT", sets=env)
    assert not p.rules[0].is_simple and not p.set_slots
    assert "target emu has no IPv6 set slots" in p.set_notes[0].why
    env.target, env.v6_slots = "", True
    with pytest.raises(PolicyError, match="set bad4 is family inet") as e:
        policy("-p tcp -j ACCEPT", "-m set --match-set bad4 src -j DROP", sets=env)
    assert (e.value.line, e.value.token) == (6, "bad4")


@pytest.mark.parametrize("path", REAL6, ids=lambda p: p.name)
def test_real_ip6tables_dumps_parse_and_print_back_as_ip6tables_save_wrote_them(path):
    """The IPv6 sides of ufw, firewalld and Docker (rulesets/real/*.rules6, written by the real tools): every filter
    rule's canonical text is the line ip6tables-save wrote, and FORWARD and INPUT, where the tool filled them,
    flatten into family-6 policies (ufw's with simple rules too; Docker's and firewalld's FORWARD tests
    interfaces and conntrack first, all complex)."""
    text = path.read_text()
    table = read_table(text, str(path), family=6)
    mine = sorted(rule_line(c.name, rule_tokens(r)) for c in table.chains.values() for r in c.rules)
    filter_table = text.split("*filter\n", 1)[1].split("COMMIT\n", 1)[0]
    assert mine == sorted(ln for ln in filter_table.splitlines() if ln.startswith("-A "))
    filled = [c for c in ("FORWARD", "INPUT") if f"\n-A {c} " in filter_table]
    assert "FORWARD" in filled
    for chain in filled:
        p = parse_policy(text, str(path), chain, family=6)
        assert p.family == 6 and p.complex_indices
        assert p.simple_indices or not path.name.startswith("ufw-")
