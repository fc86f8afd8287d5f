"""The nft verdict-map peer of `bench optimize` (tools.bench.nftsets) without the kernel: which rules it takes, the
key each is looked up on, and the lookups it groups elements into — pairwise disjoint within one map (what the
kernel's pipapo set requires), overlapping elements in their original order — and the nft text it writes. The kernel
check (every probe's verdict against the policy in iptables-nft) is tests/system/test_nftsets.py."""

from __future__ import annotations

import random

import numpy as np
import pytest
from hypafilter.errors import HypafilterError
from hypafilter.tools.bench.nftsets import Shape, group, nft_sets, rule_shape, to_nft


def policy(*rules: str, default: str = "DROP") -> str:
    return "\n".join(["*filter", f":FORWARD {default} [0:0]", *(f"-A FORWARD {r}" for r in rules), "COMMIT"]) + "\n"


def test_the_key_holds_the_fields_the_rule_tests():
    assert rule_shape(("-s", "10.0.0.0/8"), "r") == Shape(False, "")
    assert rule_shape(("-p", "udp"), "r") == Shape(True, "")
    assert rule_shape(("-p", "udp", "-m", "udp", "--sport", "53"), "r") == Shape(True, "s")
    assert rule_shape(("-p", "tcp", "-m", "tcp", "--dport", "1:9", "--sport", "2"), "r") == Shape(True, "sd")
    # a sport-only key loads 2 bytes of the transport header, as iptables-nft's `udp sport` does
    assert Shape(True, "s").key() == "ip saddr . ip daddr . meta l4proto . th sport"
    assert Shape(True, "sd").types() == "ipv4_addr . ipv4_addr . inet_proto . inet_service . inet_service"


@pytest.mark.parametrize(
    "rule, said",
    [
        ("! -s 10.0.0.0/8 -j ACCEPT", "negation"),
        ("-p udp -m multiport --dports 1,2 -j ACCEPT", "multiport"),
        ("-i eth0 -j ACCEPT", "-i eth0"),
        ("-p tcp -m conntrack --ctstate NEW -j ACCEPT", "not a header rule"),
        ("-p tcp -j REJECT", "not a header rule"),
        ("-p icmp -m icmp --icmp-type 8 -j ACCEPT", "icmp"),
        ("-m iprange --dst-range 10.0.0.1-10.0.0.6 -j DROP", "iprange"),
    ],
)
def test_what_it_cannot_write_is_refused_with_the_rule_named(rule, said):
    with pytest.raises(HypafilterError, match="nft sets peer: rule 2") as e:
        nft_sets(policy("-s 1.2.3.4 -j ACCEPT", rule))
    assert said in str(e.value)


def _boxes(rows):
    lo = np.array([r[0] for r in rows], dtype=np.int64)
    hi = np.array([r[1] for r in rows], dtype=np.int64)
    return lo, hi


UDP_D = Shape(True, "d")


def test_overlapping_rules_keep_their_order_and_disjoint_ones_share_a_map():
    # 0: dport 10-20 accept; 1: dport 15-30 drop (overlaps 0: a later map); 2: dport 40-50 (disjoint from both: the
    # first map); 3: dport 18 (inside 0: dead)
    rows = [
        ((0, 0, 17, 0, 10), (2**32 - 1, 2**32 - 1, 17, 65535, 20)),
        ((0, 0, 17, 0, 15), (2**32 - 1, 2**32 - 1, 17, 65535, 30)),
        ((0, 0, 17, 0, 40), (2**32 - 1, 2**32 - 1, 17, 65535, 50)),
        ((0, 0, 17, 0, 18), (2**32 - 1, 2**32 - 1, 17, 65535, 18)),
    ]
    groups, dead = group(*_boxes(rows), [UDP_D] * 4, ["accept", "drop", "drop", "accept"])
    assert dead == 1
    assert [[(e[0][4], e[2]) for e in g.elements] for g in groups] == [[(10, "accept"), (40, "drop")], [(15, "drop")]]


def test_a_rule_without_ports_is_not_dead_below_a_rule_with_them():
    # `-p udp --dport 0:65535` misses a frame whose UDP header is cut short; `-p udp` after it still matches it
    full = ((0, 0, 17, 0, 0), (2**32 - 1, 2**32 - 1, 17, 65535, 65535))
    groups, dead = group(*_boxes([full, full]), [UDP_D, Shape(True, "")], ["accept", "drop"])
    assert dead == 0 and [g.shape for g in groups] == [UDP_D, Shape(True, "")]
    groups, dead = group(*_boxes([full, full]), [Shape(True, ""), UDP_D], ["accept", "drop"])
    assert dead == 1 and len(groups) == 1


def _first(lo, hi, verdicts, p):
    hit = np.flatnonzero(np.all((lo <= p) & (p <= hi), axis=1))
    return verdicts[hit[0]] if len(hit) else None


@pytest.mark.parametrize("seed", range(4))
def test_the_lookups_give_every_point_the_first_match_of_the_list(seed):
    """Random overlapping boxes (one key shape, small ranges so that they meet often): within a map no two elements
    meet, and looking the maps up in order gives each point the verdict of the list's first match."""
    rng = random.Random(seed)
    rows, verdicts = [], []
    for _ in range(60):
        lo = [rng.randrange(16) for _ in range(5)]
        rows.append((tuple(lo), tuple(v + rng.randrange(6) for v in lo)))
        verdicts.append(rng.choice(["accept", "drop"]))
    lo, hi = _boxes(rows)
    groups, _ = group(lo, hi, [UDP_D] * len(rows), verdicts)
    for g in groups:
        el = g.elements
        for a in range(len(el)):
            for b in range(a + 1, len(el)):
                assert not all(el[a][0][d] <= el[b][1][d] and el[b][0][d] <= el[a][1][d] for d in range(5))
    assert len(groups) < len(rows)  # something was merged
    maps = [(*_boxes([(e[0], e[1]) for e in g.elements]), [e[2] for e in g.elements]) for g in groups]
    for _ in range(1500):
        p = np.array([rng.randrange(22) for _ in range(5)])
        got = next((v for v in (_first(*m, p) for m in maps) if v), None)
        assert got == _first(lo, hi, verdicts, p), p


def test_the_ruleset_text():
    text = nft_sets(
        policy(
            "-s 10.0.0.0/8 -d 192.168.1.0/24 -p udp -m udp --dport 53 -j ACCEPT",
            "-s 11.0.0.0/8 -p udp -m udp --dport 53 -j DROP",
            "-p udp -m udp --sport 7 -j ACCEPT",
            "-d 10.0.0.4/30 -j DROP",
            default="ACCEPT",
        )
    )
    assert (text.rules_in, text.elements, text.lookups, text.maps, text.dead) == (4, 4, 3, 1, 0)
    t = text.text
    assert "type filter hook forward priority filter; policy accept;" in t
    assert "type ipv4_addr . ipv4_addr . inet_proto . inet_service : verdict\n\t\tflags interval" in t
    assert "10.0.0.0/8 . 192.168.1.0/24 . 17 . 53 : accept,\n\t\t\t11.0.0.0/8 . 0.0.0.0/0 . 17 . 53 : drop }" in t
    assert "ip saddr . ip daddr . meta l4proto . th dport vmap @m0" in t
    assert "\t\tmeta l4proto 17 th sport 7 accept\n" in t  # one element: a plain rule, wildcard addresses left out
    assert "\t\tip daddr 10.0.0.4/30 drop\n" in t
    assert to_nft([], "DROP").count("policy drop;") == 1
