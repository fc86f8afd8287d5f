"""Log mirroring with strategy tree against the kernel (docs/compiler.md "Log mirroring", docs/optimize.md "The
hybrid's software side").

A LOG-heavy policy: 150 rules of acl1_1100 with an observing rule (NFLOG, a counter without target, LOG) on the
headers of every fourth, deployed on xdp with strategy tree. The frames an observer may see are decided in XDP and
mirrored; each copy walks the interval chain above its entry, for the longest chains as a decision tree, and is
never forwarded. The kernel is the oracle twice (verify): every frame's verdict against the policy alone (duplicates
and altered frames count), and every observing rule's packet counter against the same rule's in the plain namespace.
"""

from __future__ import annotations

import re

import pytest

from conftest import ns_sh

pytestmark = [pytest.mark.system, pytest.mark.shared]

LAB = "w6a"
TARGET = "xdp"
CB = "acl1_1100"
RULES, EVERY = 150, 4


def _policy_text(shared_dir) -> str:
    from hypafilter.tools.classbench import classbench_policy_text

    text = classbench_policy_text(shared_dir / "data/classbench" / f"{CB}.filters", policy="DROP", actions="alternate")
    lines = text.splitlines()
    first = next(i for i, ln in enumerate(lines) if ln.startswith("-A FORWARD"))
    rules = [ln for ln in lines if ln.startswith("-A FORWARD")][:RULES]
    out = []
    for j, r in enumerate(rules):
        if j % EVERY == 0:  # an observer on the rule's own header, ahead of it
            tgt = ("-j NFLOG --nflog-group 9", "", f'-j LOG --log-prefix "obs{j}: "')[j // EVERY % 3]
            out.append(f"{r.rsplit(' -j ', 1)[0]} -m comment --comment obs{j} {tgt}".rstrip())
        out.append(r)
    return "\n".join(lines[:first] + out + [ln for ln in lines[first:] if not ln.startswith("-A FORWARD")]) + "\n"


def test_mirror_copies_walk_tree_chains_and_the_observers_count_what_the_kernel_counts(lab, shared_dir):
    from hypafilter.config import Config
    from hypafilter.iptables.document import parse_policy
    from hypafilter.ops import deploy
    from hypafilter.ops.verify import verify

    policy = parse_policy(
        _policy_text(shared_dir), filename=f"{CB}[:{RULES}]+obs", base_chain="FORWARD", config=Config()
    )
    config = Config(shunt_mode="selective", strategy="tree", target=TARGET, tree_min_segment=8)
    deploy.deploy(policy, config, target=TARGET)  # verify's own deploy is then a no-op
    for ns in (lab.ns_fw, lab.ns_plain):
        ns_sh(ns, "iptables", "-w", "-Z")
    report = verify(policy, config, packets=800, seed=11, malformed=0.0)
    nic, shim = report["nic"], report["shim"]
    print(
        f"tree+mirror: {report['packets']} frames, {report['mismatches']} mismatches, mirrored {nic.get('CNT_MIRROR')},"
        f" shunted {report['shunted']}, observers {report['observers']}"
    )
    assert report["mismatches"] == 0, report["examples"][:3]
    assert report["duplicates"] == 0 and report["altered"] == 0, "a mirrored frame was forwarded twice or changed"
    assert report["observers"]["mismatches"] == 0, report["observers"]["examples"]
    assert shim["mirror"] == nic["CNT_MIRROR"] > 40, (shim, nic)  # every copy marked once by the shim
    listing = ns_sh(lab.ns_fw, "iptables-save", "-c", "-t", "filter")
    # a copy's leaf (action nibble 5/6: HF_MARK_MIRROR) jumps into a tree, and copies walked it
    leaves = re.findall(r"^\[(\d+):\d+\] -A (HF\d+_L\d+A[56]) -j (HF\d+_T\d+)$", listing, re.M)
    assert leaves, "the copies' interval chains are trees"
    print("copies into trees", sum(int(n) for n, _, _ in leaves), len(leaves))
    assert sum(int(n) for n, _, _ in leaves) >= 8, leaves
    gotos = [ln for ln in listing.splitlines() if re.search(r"-A HF\d+_T\d+ .* -g ", ln)]
    assert sum(int(ln[1 : ln.index(":")]) for ln in gotos) >= 8, "copies went through the trees' dispatch"


SHARED_START = """*filter
:FORWARD ACCEPT [0:0]
-A FORWARD -m comment --comment obs0
-A FORWARD -s 10.0.0.0/8 -j ACCEPT
-A FORWARD -s 10.0.0.0/8 -m string --string X --algo bm -j DROP
-A FORWARD -s 10.0.0.0/8 -j ACCEPT
-A FORWARD ! -s 10.0.0.0/8 -p udp -j DROP
-A FORWARD ! -s 10.0.0.0/8 -j ACCEPT
COMMIT
"""


def test_a_live_copy_meets_the_counter_once_where_its_chain_starts_with_a_shunted_one(lab):
    """The live deployment's copies walk an explicit list of the chain's rules, the shunted frames a prefix view of
    the complex list: both families' first segments are interval 2's. Before each family had its own C<k>, the
    copies of the !10/8 frames jumped to the shunted frames' C2 too and met the counter rule twice (main: verify's
    observers: obs0 513 packets in the firewall, 300 in the plain namespace). Strategy interval (tree writes the same
    segments: tests/unit/test_mirror.py checks both through the chain interpreter)."""
    strategy = "interval"
    from hypafilter.config import Config
    from hypafilter.iptables.document import parse_policy
    from hypafilter.ops import deploy
    from hypafilter.ops.verify import verify

    policy = parse_policy(SHARED_START, filename="shared-start.rules", base_chain="FORWARD", config=Config())
    config = Config(shunt_mode="selective", strategy=strategy, target=TARGET)
    deploy.deploy(policy, config, target=TARGET)
    for ns in (lab.ns_fw, lab.ns_plain):
        ns_sh(ns, "iptables", "-w", "-Z")
    report = verify(policy, config, packets=300, seed=5, malformed=0.0)
    print(f"{strategy}: mirrored {report['nic'].get('CNT_MIRROR')}, observers {report['observers']}")
    assert report["mismatches"] == 0 and report["duplicates"] == 0, report["examples"][:3]
    assert report["nic"]["CNT_MIRROR"] > 20
    assert report["observers"]["mismatches"] == 0, report["observers"]["examples"]


def _v6_text(n: int = 24) -> str:
    """An ip6tables policy whose simple rules sit below n complex ones (hop-limit checks on /64s and /80s of the lab's
    prefixes, LOG on 128-bit ranges): every shunted IPv6 frame's interval chain is the n rules, a tree."""
    cx = []
    for i in range(n):
        if i % 4 == 3:
            cx.append(f"-A FORWARD -m iprange --dst-range fd48:4601::{i:x}-fd48:4601::{i + 9:x} -p udp -j LOG")
        else:
            net = f"fd48:460{i % 2}:0:{i:x}::/64" if i % 3 else f"fd48:460{i % 2}::{i:x}:0:0/96"
            act = ("ACCEPT", "DROP")[i % 2]
            cx.append(f"-A FORWARD -s {net} -p {('tcp', 'udp')[i % 2]} -m hl --hl-eq {60 + i % 5} -j {act}")
    return "\n".join(
        [
            "*filter",
            ":INPUT ACCEPT [0:0]",
            ":FORWARD DROP [0:0]",
            ":OUTPUT ACCEPT [0:0]",
            "-A FORWARD -p ipv6-icmp --icmpv6-type neighbour-solicitation -j ACCEPT",
            *cx,
            "-A FORWARD -s fd48:4600::/32 -p tcp --dport 80 -j ACCEPT",
            "-A FORWARD -s fd48:4600::/32 -p udp --dport 53 -j ACCEPT",
            "-A FORWARD -p udp --dport 5000:5100 -j ACCEPT",
            "-A FORWARD -d fd48:4601::2:1 -p tcp --dport 443 -j ACCEPT",
            "COMMIT",
            "",
        ]
    )


def test_the_ipv6_side_walks_its_interval_chain_as_a_tree_over_128_bit_addresses(lab):
    """A dual-stack deployment with strategy tree (`--ipv6`, xdp_ipv6): the IPv6 plan's interval chain of complex
    rules is written as a tree over the ranks of its 128-bit addresses, tested with IPv6 prefixes and ranges and the
    IPv6 port guard, and the IPv6 frames the program passes unparsed walk the IPv6 K0 tree (HFv6_K0T); verify's IPv6
    frames (extension headers, fragments, truncated headers among them) through the hybrid and through both
    policies alone: 0 mismatches, and the trees' gotos counted packets."""
    import dataclasses

    from hypafilter.config import Config
    from hypafilter.iptables.document import parse_policy
    from hypafilter.netfilter import ip6
    from hypafilter.ops.verify import Six, verify

    config = Config(shunt_mode="selective", strategy="tree", target=TARGET, xdp_ipv6=True, tree_min_segment=4)
    policy = parse_policy(SHARED_START, filename="shared-start.rules", base_chain="FORWARD", config=config)
    text = _v6_text()
    ir = parse_policy(text, "v6tree.rules", base_chain="FORWARD", config=config, family=6)
    v6 = dataclasses.replace(ip6.parse(text, "v6tree.rules", "FORWARD"), ir=ir)
    report = verify(policy, config, packets=50, seed=9, malformed=0.0, six=Six(v6, packets=400))
    six = report["ipv6"]
    print(f"ipv6 tree: {six['packets']} frames, {six['mismatches']} mismatches, by kind {six.get('by_kind')}")
    assert report["mismatches"] == 0 and six["mismatches"] == 0, (report["examples"][:3], six.get("examples"))
    assert six["packets"] == 400 and 0 < six["delivered_oracle"] < 400
    saved = ns_sh(lab.ns_fw, "ip6tables-save", "-c", "-t", "filter")
    tests = re.findall(r"^\[(\d+):\d+\] -A HFv6_T\d+ (.*) -g HFv6_T\d+$", saved, re.M)
    assert len(tests) >= 6, saved
    # the dispatch tests 128-bit prefixes or ranges of the file's addresses (never a rank, never an IPv4 address)
    assert any(re.fullmatch(r"-[sd] fd48:460[01]:\S+/\d+", t) for _, t in tests), tests
    assert not re.search(r"\b\d+\.\d+\.\d+\.\d+\b", "\n".join(t for _, t in tests)), tests
    assert sum(int(n) for n, _ in tests) > 30, "shunted IPv6 frames went through the tree's dispatch"
    # k = 0: the IPv6 frames the program passes unparsed (extension headers, fragments, truncated ones) walk the IPv6
    # K0 tree (CONTROL bit 7), whose tree is the whole IPv6 policy's
    from hypafilter.ops import deploy

    assert (deploy.read_state().get("tables") or {}).get("k0_tree6") is True
    k0t = re.search(r"^\[(\d+):\d+\] -A HFv6_MAIN -m mark --mark 0x3(?:/0xffffffff)? -g HFv6_K0T$", saved, re.M)
    assert k0t and int(k0t.group(1)) >= 20, saved
    assert re.search(r"^\[\d+:\d+\] -A HFv6_K0T -j HFv6_T\d+$", saved, re.M), saved
