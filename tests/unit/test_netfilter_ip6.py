"""The IPv6 side of a deployment without the kernel (docs/ipv6.md, "Deploy and verify"): the ip6tables-save file's
structure and its errors at their lines, --ipv6-default drop's policy, what verify aims at, and verify's IPv6 frames
(every kind built, its id in the source MAC, the same frames for the same seed). What the kernel does with them is
tests/system/test_ipv6_deploy.py's."""

from __future__ import annotations

import ipaddress

import pytest
from hypafilter.errors import PolicyError
from hypafilter.netfilter import ip6
from hypafilter.ops import verify6

V6 = """# a comment
*filter
:INPUT ACCEPT [0:0]
:FORWARD DROP [0:0]
:OUTPUT ACCEPT [0:0]
-A FORWARD -s 2001:db8:1::/48 -d 2001:db8:2::10 -p tcp -m multiport --dports 22,443 -j ACCEPT
-A FORWARD -p ipv6-icmp --icmpv6-type echo-request -j ACCEPT
-A FORWARD -p udp --dport 5000:5100 -j ACCEPT
COMMIT
*raw
:PREROUTING ACCEPT [0:0]
:OUTPUT ACCEPT [0:0]
-A PREROUTING -p udp --dport 53 -j NOTRACK
COMMIT
"""


def test_structure_tables_rules_policies():
    p = ip6.parse(V6, "v6.rules", validate=False)
    assert p.tables == ("filter", "raw") and p.family == 6 and p.kind == "policy"
    assert p.rules["filter/FORWARD"] == 3 and p.rules["raw/PREROUTING"] == 1 and p.rule_count == 4
    assert p.default == "DROP" and p.policies["filter/INPUT"] == "ACCEPT"
    assert "4 rules, family 6" in p.describe()
    assert ip6.V6Policy.from_state(p.state()) == p  # what the state file keeps gives back the same policy


@pytest.mark.parametrize(
    "text, line, words",
    [
        (":FORWARD DROP\n", 1, "before any *table"),
        ("*filter\n:FORWARD DROP\n", 2, "no COMMIT"),
        ("*nosuch\nCOMMIT\n", 1, "unknown ip6tables table"),
        ("*filter\n:FORWARD DROP\n-A FORWARD -4 -j DROP\nCOMMIT\n", 3, "IPv4-only rule"),
        ("*filter\n:FORWARD DROP\nhello\nCOMMIT\n", 3, "not an ip6tables-save line"),
        ("*filter\n:INPUT ACCEPT\nCOMMIT\n", 1, "does not declare :FORWARD"),
        ("*raw\n:PREROUTING ACCEPT\nCOMMIT\n", 1, "no *filter table"),
    ],
)
def test_structure_errors_name_the_line(text, line, words):
    with pytest.raises(PolicyError) as e:
        ip6.parse(text, "bad.rules6", validate=False)
    assert e.value.file == "bad.rules6" and e.value.line == line and words in e.value.message, str(e.value)


def test_drop_policy_is_the_base_chain_dropping_everything():
    for base in ("FORWARD", "INPUT"):
        d = ip6.drop_policy(base)
        assert d.kind == "drop" and d.rule_count == 0 and d.default == "DROP"
        assert f":{base} DROP" in d.text and "-A " not in d.text
        assert all(d.policies[f"filter/{c}"] == "ACCEPT" for c in ip6.BUILTIN["filter"] if c != base)
        assert ip6.parse(d.text, "drop", base, validate=False).policies == d.policies
        assert "DROP" in d.describe() and d.policy_hash() != ip6.drop_policy("OUTPUT").policy_hash()


def test_aims():
    a = ip6.aims(ip6.parse(V6, "v6.rules", validate=False))
    assert ipaddress.IPv6Network("2001:db8:1::/48") in a.nets and ipaddress.IPv6Network("2001:db8:2::10/128") in a.nets
    assert {22, 443, 5000, 5100, 53} <= set(a.ports)
    assert {6, 17, 58} <= set(a.protos) and (128, -1) in a.icmp


def test_frames_every_kind_with_its_id():
    pol = ip6.parse(V6, "v6.rules", validate=False)
    dst = bytes.fromhex("0e48fffffffe")
    frames = verify6.probes6(pol, 101, 120, 3, dst, b"\x0e\x48")
    assert [uid for uid, _, _ in frames] == list(range(101, 221))
    assert {k for _, k, _ in frames} == {verify6.PREFIX + k for k in verify6.KINDS6}
    for uid, kind, f in frames:
        assert f[6:8] == b"\x0e\x48" and int.from_bytes(f[8:12], "big") == uid, kind
        assert f[12:14] == b"\x86\xdd" and f[14] >> 4 == 6, kind
        if kind in ("v6_trunc_ext", "v6_trunc_len"):
            assert len(f) - 54 < int.from_bytes(f[18:20], "big"), kind  # the payload length claims more
        if kind == "v6_jumbo":
            assert f[18:20] == b"\0\0" and f[20] == 0, kind  # payload length 0, hop-by-hop first
        if kind.startswith("v6_frag"):
            assert f[20] == 44 and int.from_bytes(f[58:62], "big") == uid, kind  # a fragment header, its id ours
    again = verify6.probes6(pol, 101, 120, 3, dst, b"\x0e\x48")
    assert again == frames  # the same seed, the same frames on every run and both paths


def test_ipv6_connections_aim_at_the_policy_ports():
    from hypafilter.ops.connections import UNNAMED_PORT, ConnectionSpec

    pol = ip6.parse(V6, "v6.rules", validate=False)
    conns = verify6.conns6(pol, ConnectionSpec(8))
    assert all(c.family == 6 for c in conns) and {c.proto for c in conns} == {"tcp", "udp"}
    assert len({c.sport for c in conns}) == 8
    assert {c.port for c in conns} <= {22, 443, 5000, 5100, 53, UNNAMED_PORT}
    assert "(IPv6)" in conns[0].name
    assert {c.direction for c in conns} == {""}  # bridge mode: sender to receiver


def test_ipv6_connections_in_host_mode_go_both_ways():
    """Host mode: every kind into the host, then every kind out of it, in turn (as IPv4's); each end at the lab's
    IPv6 address on its path, the host at its own address in the sender's /64 on that path."""
    import ipaddress

    from hypafilter.ops.connections import HOST_ADDRESS6, ConnectionSpec, Ends, ends
    from hypafilter.ops.lab import Lab

    pol = ip6.parse(V6, "v6.rules", validate=False)
    conns = verify6.conns6(pol, ConnectionSpec(8), host=True)
    assert [c.direction for c in conns] == ["in", "in", "out", "out"] * 2
    assert [c.proto for c in conns] == ["tcp", "udp"] * 4
    lab = Lab("u6")
    for path, role in (("hyb", "fw"), ("plain", "plain")):
        sender, host = Lab.ip6("send", path), HOST_ADDRESS6[path]
        assert ipaddress.ip_address(host) in ipaddress.ip_network(f"{sender}/64", strict=False)
        assert ends(lab, path, "in", 6) == Ends(lab.ns_send, lab.ns(role), host, sender)
        assert ends(lab, path, "out", 6) == Ends(lab.ns(role), lab.ns_send, sender, host)
    assert HOST_ADDRESS6["hyb"] != HOST_ADDRESS6["plain"]  # the paths' own addresses, as in bridge mode


def test_sets_read_by_the_policy_are_aimed_at():
    text = V6.replace("COMMIT\n*raw", "-A FORWARD -m set --match-set bl6 src -j DROP\nCOMMIT\n*raw")
    sets = "create bl6 hash:net family inet6\nadd bl6 2001:db8:77::/64\n"
    assert ip6.uses_sets(text) and not ip6.uses_sets(V6.replace("udp --dport 53", "udp -j MARK --set-xmark 1"))
    p = ip6.parse(text, "v6.rules", validate=False, sets_text=sets)
    assert ipaddress.IPv6Network("2001:db8:77::/64") in ip6.aims(p).nets
    assert ip6.parse(V6, "v6.rules", validate=False, sets_text=sets).sets_text == ""  # no set match: not kept
