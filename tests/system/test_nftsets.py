"""The nft verdict-map peer of `bench optimize --peers` against the kernel: the same probes (trace headers, TCP and
ICMP twins, UDP headers cut to 1–7 bytes, first and later fragments, IP options) through the policy loaded alone with
iptables-nft and through the peer loaded alone with nft; every verdict must agree. And the check has teeth: the same
maps looked up in the wrong order give other verdicts."""

from __future__ import annotations

import random

import pytest
from hypafilter.optimize.emit import optimize
from hypafilter.optimize.tree import Params
from hypafilter.paths import BUILD_ROOT
from hypafilter.tools.bench import optimize as bench
from hypafilter.tools.bench import pktrate
from hypafilter.tools.bench.nftsets import _entries, group, nft_sets, to_nft

from conftest import need_root, need_tool

pytestmark = [pytest.mark.system]
LAB = "w8a"


def _policy() -> str:
    """Overlapping rules of both verdicts on one key (they must stay in order), a rule without ports ahead of port
    rules (it matches a cut-short UDP header, they do not), a sport-only rule (2 bytes of header read) and rules
    on addresses alone."""
    lines = ["*filter", ":FORWARD DROP [0:0]", "-A FORWARD -s 10.0.0.0/8 -p udp -j ACCEPT"]
    lines += ["-A FORWARD -p udp -m udp --sport 53 -j ACCEPT", "-A FORWARD -d 192.168.7.0/24 -j DROP"]
    for i in range(80):
        lo = 1000 + 25 * i
        act = "ACCEPT" if i % 2 else "DROP"
        src = f"-s 11.{i % 4}.0.0/16 " if i % 3 else ""
        lines.append(f"-A FORWARD {src}-p udp -m udp --sport 1024:65535 --dport {lo}:{lo + 40} -j {act}")
    lines += ["-A FORWARD -d 192.168.0.0/16 -j ACCEPT"]
    return "\n".join([*lines, "COMMIT"]) + "\n"


def _rows(n: int = 3000):
    rng = random.Random(8)
    out = []
    for _ in range(n):
        src = rng.choice([0x0A000001, 0x0B000000, 0x0B010000, 0x0B030000, 0x0C000001]) + rng.randrange(256)
        dst = 0xC0A80000 + rng.randrange(2048)  # 192.168.0.0 – 192.168.7.255
        out.append((src, dst, rng.choice([53, 80, 5000, 40000]), rng.randrange(900, 3200)))
    return out


def test_the_verdict_maps_give_every_probe_the_policy_verdict():
    """~12 s: probes only (--repeats 0), the policy, its rewrite, plain nft and the maps."""
    need_root()
    need_tool("gcc", "iptables-restore", "iptables-restore-translate", "nft", "ip")
    text = _policy()
    peer = nft_sets(text)
    assert peer.maps >= 1 and peer.lookups < peer.rules_in / 4  # merged: not one lookup per rule
    res = optimize(text, "w8a.rules", Params(), min_segment=16)
    rep = bench.run(text, res, _rows(), repeats=0, probes=3000, seed=8, peers=True, tag=LAB, log=lambda m: None)
    assert rep["nft_sets_error"] is None, rep
    assert rep["nft_sets_lookups"] == peer.lookups and rep["nft_sets_elements"] == peer.elements
    assert rep["mismatches"] == 0 and rep["nft_mismatches"] == 0, rep
    assert rep["nft_sets_mismatches"] == 0, rep
    assert 0 < rep["delivered"] < rep["probes"]  # both verdicts occur


def test_the_maps_in_the_wrong_order_are_caught():
    """~8 s: the same maps with their lookups reversed disagree with the policy on some probes."""
    need_root()
    need_tool("gcc", "iptables-restore", "nft", "ip")
    text = _policy()
    pol, lo, hi, shapes, verdicts, _ = _entries(text, "w8b.rules")
    groups, _ = group(lo, hi, shapes, verdicts)
    probes = bench.probe_frames(_rows(), 3000, 8)
    blaster = pktrate.build_blaster(BUILD_ROOT / "bench")
    with pktrate.RateBench(blaster, "w8b") as rb:
        rb.load_restore(text)
        want = bench.delivered(rb, probes)
        got = {}
        for name, g in (("right", groups), ("reversed", groups[::-1])):
            bench._nft_load(rb, to_nft(g, pol.default))  # the ruleset flushed first: the maps alone
            got[name] = bench.delivered(rb, probes)
    assert got["right"] == want
    assert got["reversed"] != want
