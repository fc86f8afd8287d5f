"""`hypafilter optimize -6` against the kernel: the same IPv6 frames (ops.verify6's: aimed at the edges of the policy's
128-bit boxes, ports and ICMPv6 types; extension-header chains, AH, first and later fragments, truncated headers,
neighbour discovery, ICMPv6 errors) through an ip6tables policy and through its rewrite, each loaded alone with
ip6tables-nft in the bench's bridged namespaces; every verdict and every moved rule's packet count must agree. A
rewrite with one rule left out of its leaves must not."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from hypafilter.netfilter import ip6
from hypafilter.ops.verify import ID_MAC_PREFIX
from hypafilter.ops.verify6 import probes6
from hypafilter.optimize.emit import optimize
from hypafilter.optimize.tree import Params
from hypafilter.paths import BUILD_ROOT
from hypafilter.tools.bench import optimize as bench
from hypafilter.tools.bench import pktrate

from conftest import ROOT, need_root, need_tool
from tests.unit.test_optimize6 import random_policy6

pytestmark = [pytest.mark.system]

COMPLEX = [
    "-A FORWARD -m conntrack --ctstate ESTABLISHED,RELATED -j ACCEPT",
    "-A FORWARD -p ipv6-icmp -m icmp6 --icmpv6-type 135 -m hl --hl-eq 255 -j ACCEPT",
    "-A FORWARD -m ipv6header --header frag --soft -j DROP",
    "-A FORWARD -p udp -m hl --hl-eq 1 -j DROP",
    "-A FORWARD -s 2001:db8::/32 -p tcp -j LOG --log-prefix w4",
]


def _policy() -> str:
    """A random ip6tables policy (tests/unit/test_optimize6) with complex rules among its header checks, FORWARD's
    policy ACCEPT (the probes aim at its DROP rules' edges too)."""
    text, _ = random_policy6(random.Random(11), 70)
    lines = text.replace(":FORWARD DROP", ":FORWARD ACCEPT").splitlines()
    first = next(i for i, ln in enumerate(lines) if ln.startswith("-A FORWARD"))
    for k, rule in enumerate(COMPLEX):
        lines.insert(first + 1 + 12 * k, rule)
    return "\n".join(lines) + "\n"


def _probes(text: str, n: int, seed: int) -> list[tuple[int, bytes]]:
    pol = ip6.parse(text, "p.rules6", validate=False)
    return [(u, f) for u, _, f in probes6(pol, 1, n, seed, pktrate.DST_MAC, ID_MAC_PREFIX)]


def test_ipv6_rewrites_get_the_kernel_verdicts_and_counts_of_the_policy_and_a_wrong_leaf_shows():
    need_root()
    need_tool("gcc", "ip6tables-restore", "conntrack", "ip")
    text = _policy()
    res = optimize(text, "random.rules6", Params(binth=2), min_segment=4, family=6)
    assert sum(len(s.rules) for s in res.segments if s.tree) >= 60  # trees over most of it, complex rules included
    assert "--u32" in res.text and "-m iprange" in res.text  # port cuts below the IPv6 guard; 128-bit ranges
    ufw_text = Path(ROOT, "rulesets/real/ufw-dual-stack-v6.rules6").read_text()
    ufw = optimize(ufw_text, "ufw-dual-stack-v6.rules6", Params(binth=2), min_segment=4, family=6)
    assert len(ufw.segments) >= 5 and ufw.kept["per-rule state"] >= 5
    # the rewrite with every copy of one rule left out (the DROP rule with the most copies: a wide one)
    lines = res.text.splitlines()
    copies: dict[str, int] = {}
    for ln in lines:
        if ln.startswith("-A ht-") and ln.endswith("-j DROP") and " rule " in ln:
            lab = ln.split('--comment "', 1)[1].split('"')[0]
            copies[lab] = copies.get(lab, 0) + 1
    gone = max(copies, key=lambda k: (copies[k], k))
    broken = bench.Result(
        "\n".join(ln for ln in lines if not (ln.startswith("-A ht-") and f'"{gone}"' in ln)) + "\n",
        res.rules_in,
        res.rules_out,
        res.segments,
    )
    blaster = pktrate.build_blaster(BUILD_ROOT / "bench")
    with pktrate.RateBench(blaster, "w4o", family=6) as rb:
        got = bench.compare(rb, text, res, _probes(text, 900, 1))
        got_ufw = bench.compare(rb, ufw_text, ufw, _probes(ufw_text, 500, 2))
        got_broken = bench.compare(rb, text, broken, _probes(text, 900, 1))
    assert got["mismatches"] == 0 and got["counter_mismatches"] == [], got
    assert 100 < got["delivered"] < got["probes"] - 100, got  # both verdicts were given
    assert got_ufw["mismatches"] == 0 and got_ufw["counter_mismatches"] == [], got_ufw
    assert got_ufw["delivered"] > 20, got_ufw
    assert got_broken["mismatches"] > 0 and got_broken["counter_mismatches"], (gone, got_broken)
