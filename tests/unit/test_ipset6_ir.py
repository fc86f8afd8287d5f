"""inet6 ipsets as set slots of an IPv6 plan (docs/sets.md "IPv6 sets"): `ipset save` of family inet6 sets, the
front end's slots for family-6 policies (xdp) and why they stay complex elsewhere, the ranked IR (set membership is
its own ternary bit: the sets' addresses add no ranks), the xdp program's IPv6 set maps (shape, key layouts)."""

from __future__ import annotations

import ipaddress
import struct

import pytest
from hypafilter.analysis.plan import build_plan
from hypafilter.config import Config
from hypafilter.errors import PolicyError
from hypafilter.iptables.document import parse_policy
from hypafilter.iptables.sets import SetEnv
from hypafilter.ir.family import compress
from hypafilter.ir.sets import frame_ports6, member
from hypafilter.netfilter import ipset
from hypafilter.targets import set_capability6
from hypafilter.targets.xdp import sets as setmaps
from hypafilter.targets.xdp.tables import build_tables6, fits6, shape6

SAVE = """create bl6 hash:net family inet6 hashsize 1024 maxelem 65536
add bl6 2001:db8:bad::/48
add bl6 2001:db8:bad:1::/64 nomatch
add bl6 2001:db8:bad:1:8000::/65 timeout 0
create svc6 hash:ip,port family inet6 hashsize 1024 maxelem 65536
add svc6 2001:db8::2,tcp:80
add svc6 2001:db8::2,udp:53
create h6 hash:ip family inet6 hashsize 1024 maxelem 65536 timeout 300
add h6 2001:db8::77 timeout 250
create bp bitmap:port range 0-1024
add bp 25
create bl4 hash:net family inet hashsize 1024 maxelem 65536
add bl4 10.0.0.0/8
"""
V6 = """*filter
:FORWARD ACCEPT [0:0]
-A FORWARD -m set --match-set bl6 src -j DROP
-A FORWARD -m set --match-set svc6 dst,dst -j ACCEPT
-A FORWARD -m set ! --match-set h6 src -p udp -j DROP
-A FORWARD -m set --match-set bp dst -j ACCEPT
-A FORWARD -s 2001:db8:1::/48 -j DROP
COMMIT
"""


def a(text: str) -> int:
    return int(ipaddress.IPv6Address(text))


def env(target: str = "xdp") -> SetEnv:
    sets = ipset.parse_save(SAVE)
    return SetEnv(sets, 8, 1 << 20, target, "sets.save", text=SAVE, v6_slots=set_capability6(target))


def test_ipset_save_reads_inet6_elements():
    s = ipset.parse_save(SAVE)
    bl = s["bl6"]
    assert bl.family == "inet6" and bl.netmask == 128
    e0, e1, e2 = bl.entries
    assert (e0.addr_lo, e0.addr_hi, e0.prefix, e0.nomatch) == (
        a("2001:db8:bad::"),
        a("2001:db8:bad:ffff:ffff:ffff:ffff:ffff"),
        48,
        False,
    )
    assert e1.prefix == 64 and e1.nomatch and e2.prefix == 65 and e2.timeout_s is None
    svc = s["svc6"].entries
    assert [(e.addr_lo, e.proto, e.port) for e in svc] == [(a("2001:db8::2"), 6, 80), (a("2001:db8::2"), 17, 53)]
    assert s["h6"].entries[0].timeout_s == 250 and s["h6"].entries[0].prefix == 128


@pytest.mark.parametrize(
    "line,token",
    [
        ("add x 2001:db8::/129", "2001:db8::/129"),
        ("add x 10.0.0.0/8", "10.0.0.0/8"),
        ("add x 2001:db8:::1/64", "2001:db8:::1/64"),
    ],
)
def test_a_malformed_inet6_element_names_line_and_token(line, token):
    with pytest.raises(PolicyError) as e:
        ipset.parse_save(f"create x hash:net family inet6\n{line}\n", "s.save")
    assert (e.value.line, e.value.token) == (2, token)


def test_inet6_set_matches_are_slots_of_the_ipv6_plan_on_xdp():
    p = parse_policy(V6, "v6.rules", "FORWARD", Config(), sets=env("xdp"), family=6)
    assert [(s.name, s.dirs) for s in p.set_slots] == [
        ("bl6", ("src",)),
        ("svc6", ("dst", "dst")),
        ("h6", ("src",)),
        ("bp", ("dst",)),
    ]
    assert all(r.is_simple for r in p.rules)
    assert p.rules[2].boxes[0].sets_mask == 4 and p.rules[2].boxes[0].sets_value == 0  # `!`: bit 0


def test_on_the_emulated_nic_they_are_slots_too_and_complex_where_no_ipv6_slots():
    # the emulated NIC's dual-stack core has IPv6 set tables (hf_set_table with V6): the same slots as on xdp
    p = parse_policy(V6, "v6.rules", "FORWARD", Config(), sets=env("emu"), family=6)
    assert [s.name for s in p.set_slots] == ["bl6", "svc6", "h6", "bp"] and all(r.is_simple for r in p.rules)
    # a target with IPv4 set slots alone keeps them complex, with the reason
    e = env("emu")
    e.v6_slots = False
    p = parse_policy(V6, "v6.rules", "FORWARD", Config(), sets=e, family=6)
    assert not p.set_slots and [r.is_simple for r in p.rules][:4] == [False] * 4
    assert all("target emu has no IPv6 set slots" in n.why for n in p.set_notes)
    # a set larger than the NIC's table (emu: 65,536 element cells a slot) makes its rule complex again
    e = env("emu")
    e.capacity = 1000
    p = parse_policy(V6, "v6.rules", "FORWARD", Config(), sets=e, family=6)
    assert "bl6" not in [s.name for s in p.set_slots]
    assert any("maxelem" in n.why and "bl6" in n.why for n in p.set_notes if n.slot < 0)


def test_an_inet6_set_in_an_ipv4_policy_and_a_netmask_stay_complex():
    p4 = parse_policy(
        "*filter\n:FORWARD ACCEPT [0:0]\n-A FORWARD -m set --match-set bl6 src -j DROP\nCOMMIT\n",
        "p.rules",
        "FORWARD",
        Config(),
        sets=env(),
    )
    assert not p4.set_slots and "family inet6 in an IPv4 policy" in p4.set_notes[0].why
    text = "create m6 hash:ip family inet6 netmask 64\nadd m6 2001:db8::\n"
    e = SetEnv(ipset.parse_save(text), 8, 1 << 20, "xdp", "m", text=text)
    p = parse_policy(
        "*filter\n:FORWARD ACCEPT [0:0]\n-A FORWARD -m set --match-set m6 src -j DROP\nCOMMIT\n",
        "p6",
        "FORWARD",
        Config(),
        sets=e,
        family=6,
    )
    assert not p.set_slots and "netmask 64" in p.set_notes[0].why


def test_a_set_too_big_for_a_slot_makes_its_rule_complex():
    e = env()
    e.capacity = 1000
    p = parse_policy(V6, "v6.rules", "FORWARD", Config(), sets=e, family=6)
    assert [s.name for s in p.set_slots] == []  # bitmap:port's maxelem is its range: 1,025 ports
    assert any("maxelem" in n.why for n in p.set_notes if n.slot < 0)


def test_set_addresses_add_no_ranks():
    """Set membership is its own ternary bit: only the policy's own address tests cut the rank space."""
    p = parse_policy(V6, "v6.rules", "FORWARD", Config(), sets=env(), family=6)
    ranked, amap = compress(p)
    assert amap.starts["src"] == (0, a("2001:db8:1::"), a("2001:db8:2::"))
    assert amap.starts["dst"] == (0,)
    assert ranked.set_slots == p.set_slots
    assert ranked.rules[0].boxes[0].sets_mask == 1


def test_kernel_membership_model_for_ipv6_frames():
    s = ipset.parse_save(SAVE)
    bl, svc = s["bl6"], s["svc6"]
    assert member(bl, ("src",), a("2001:db8:bad:2::1"), 0, 17, (1, 2))
    assert not member(bl, ("src",), a("2001:db8:bad:1::1"), 0, 17, (1, 2))  # the nomatch /64
    assert member(bl, ("src",), a("2001:db8:bad:1:8000::1"), 0, 17, (1, 2))  # the /65 inside it
    ports = frame_ports6(6, 1234, 80, 0, 0)
    assert member(svc, ("dst", "dst"), 0, a("2001:db8::2"), 6, ports)
    assert frame_ports6(59, 0, 0, 0, 0) is None and frame_ports6(58, 0, 0, 128, 0) == (128 << 8, 128 << 8)


def test_ipv6_plan_tables_carry_their_own_set_maps():
    p = parse_policy(V6, "v6.rules", "FORWARD", Config(), sets=env(), family=6)
    plan = build_plan(p, Config())
    t6 = build_tables6(plan)
    assert [(m["name"], m["map"], m["family"]) for m in t6.sets] == [
        ("bl6", "hfx6_set0", 6),
        ("svc6", "hfx6_set1", 6),
        ("h6", "hfx6_set2", 6),
        ("bp", "hfx6_set3", 6),
    ]
    assert "sets" in t6.fields
    sh = shape6(t6)
    assert sh["sets"] == t6.sets and fits6(t6, sh)
    assert not fits6(t6, {**sh, "sets": sh["sets"][:3]})  # other set slots: another program
    assert setmaps.slots_of({"sets": [{"name": "x"}], "v6": sh})[1:] == t6.sets


def test_ipv6_map_keys():
    s = ipset.parse_save(SAVE)
    net = s["bl6"].entries[1]
    k = setmaps.key_of("hash:net", net, 6)
    assert k == struct.pack("<I", 64) + ipaddress.IPv6Address("2001:db8:bad:1::").packed
    assert setmaps.describe_key("hash:net", k, 6) == "2001:db8:bad:1::/64"
    e = s["svc6"].entries[0]
    k = setmaps.key_of("hash:ip,port", e, 6)
    assert len(k) == 20 and setmaps.describe_key("hash:ip,port", k, 6) == "2001:db8::2,6:80"
    k = setmaps.key_of("hash:net,port", e, 6)
    assert len(k) == 24 and setmaps.describe_key("hash:net,port", k, 6) == "2001:db8::2/128,6:80"
    assert setmaps.key_of("hash:ip", s["h6"].entries[0], 6) == ipaddress.IPv6Address("2001:db8::77").packed
    assert setmaps.key_of("bitmap:port", s["bp"].entries[0], 6) == struct.pack("<I", 25)


def test_icmpv6_elements_are_keyed_as_the_kernel_keys_them():
    """`ipv6-icmp:NAME` (the names `ipset save` prints, read back from the tool) and `ipv6-icmp:TYPE/CODE`: the kernel
    keys an ICMPv6 element of a hash:*,port set as type << 8 | code, as ICMP's."""
    s = ipset.parse_save(
        "create i6 hash:ip,port family inet6 hashsize 1024 maxelem 65536\n"
        "add i6 2001:db8::2,ipv6-icmp:echo-request\n"
        "add i6 2001:db8::2,ipv6-icmp:port-unreachable\n"
        "add i6 2001:db8::2,ipv6-icmp:43/1\n"
        "add i6 2001:db8::2,ipv6-icmp:neighbour-solicitation\n",
        "s.save",
    )
    assert [(e.proto, e.port) for e in s["i6"].entries] == [
        (58, 128 << 8),
        (58, 1 << 8 | 4),
        (58, 43 << 8 | 1),
        (58, 135 << 8),
    ]
    with pytest.raises(PolicyError) as e:
        ipset.parse_save("create i6 hash:ip,port family inet6\nadd i6 2001:db8::2,ipv6-icmp:no-such-type\n", "s.save")
    assert (e.value.line, e.value.token) == (2, "2001:db8::2,ipv6-icmp:no-such-type")
