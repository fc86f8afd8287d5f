"""Log mirroring with strategy tree against the kernel (docs/compiler.md "Log mirroring", docs/optimize.md "The
hybrid's software side").

A LOG-heavy policy: 300 rules of acl1_1100 with an observing rule (NFLOG, a counter without target, LOG) on the
headers of every sixth, deployed on xdp with strategy tree. The frames an observer may see are decided in XDP and
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
RULES, EVERY = 300, 6


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
    config = Config(shunt_mode="selective", strategy="tree", target=TARGET)
    deploy.deploy(policy, config, target=TARGET)  # verify's own deploy is then a no-op
    for ns in (lab.ns_fw, lab.ns_plain):
        ns_sh(ns, "iptables", "-w", "-Z")
    report = verify(policy, config, packets=1500, seed=11, malformed=0.0)
    nic, shim = report["nic"], report["shim"]
    print(
        f"tree+mirror: {report['packets']} frames, {report['mismatches']} mismatches, mirrored {nic.get('CNT_MIRROR')},"
        f" shunted {report['shunted']}, observers {report['observers']}"
    )
    assert report["mismatches"] == 0, report["examples"][:3]
    assert report["duplicates"] == 0 and report["altered"] == 0, "a mirrored frame was forwarded twice or changed"
    assert report["observers"]["mismatches"] == 0, report["observers"]["examples"]
    assert shim["mirror"] == nic["CNT_MIRROR"] > 50, (shim, nic)  # every copy marked once by the shim
    listing = ns_sh(lab.ns_fw, "iptables-save", "-c", "-t", "filter")
    # a copy's leaf (action nibble 5/6: HF_MARK_MIRROR) jumps into a tree, and copies walked it
    leaves = re.findall(r"^\[(\d+):\d+\] -A (HF\d+_L\d+A[56]) -j (HF\d+_T\d+)$", listing, re.M)
    assert leaves, "the copies' interval chains are trees"
    print("copies into trees", sum(int(n) for n, _, _ in leaves), len(leaves))
    assert sum(int(n) for n, _, _ in leaves) > 20, leaves
    gotos = [ln for ln in listing.splitlines() if re.search(r"-A HF\d+_T\d+ .* -g ", ln)]
    assert sum(int(ln[1 : ln.index(":")]) for ln in gotos) > 20, "copies went through the trees' dispatch"


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
