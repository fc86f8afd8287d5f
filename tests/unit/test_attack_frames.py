"""Attack frames of `verify --attack` and `bench rate --attack` (docs/xdp.md "New flows"): shapes, spoofed sources,
and that the bench's flood aims only at destinations the policy drops as NEW or INVALID."""

from __future__ import annotations

import pytest
from hypafilter.analysis.decision import decision
from hypafilter.analysis.plan import build_plan
from hypafilter.config import Config
from hypafilter.errors import HypafilterError
from hypafilter.hw.model import parse_frame
from hypafilter.iptables.document import parse_policy
from hypafilter.ir import Header
from hypafilter.ops.verify import ATTACK_SHAPES, ProbeSpec
from hypafilter.tools.bench.rate import attack_probes

POLICY = """*filter
:FORWARD DROP [0:0]
-A FORWARD -m conntrack --ctstate ESTABLISHED,RELATED -j ACCEPT
-A FORWARD -p tcp -m tcp --dport 8080 -j ACCEPT
-A FORWARD -p udp -m udp --dport 5353 -j ACCEPT
-A FORWARD -p tcp -m tcp --dport 22 -j DROP
COMMIT
"""


def test_verify_attack_kinds_and_shapes():
    pol = parse_policy(POLICY, "p")
    probes = ProbeSpec(600, attack=ATTACK_SHAPES, attack_share=1.0, malformed=0.0).probes(pol)
    kinds = {p.kind for p in probes}
    assert kinds == {f"attack_{s}" for s in ATTACK_SHAPES}
    for p in probes:
        f = p.frame
        proto = f[23]
        flags = f[14 + 20 + 13] if proto == 6 and len(f) > 47 else None
        if p.kind == "attack_syn":
            assert proto == 6 and flags == 0x02
        elif p.kind == "attack_ack":
            assert proto == 6 and flags == 0x10
        elif p.kind == "attack_rst":
            assert proto == 6 and flags == 0x04
        elif p.kind == "attack_fin":
            assert proto == 6 and flags in (0x01, 0x29, 0x00)
        elif p.kind == "attack_udp":
            assert proto == 17
        elif p.kind == "attack_frag":
            assert int.from_bytes(f[20:22], "big") & 0x3FFF  # MF or an offset
        else:
            assert proto == 1 and f[34] == 3  # destination unreachable quoting a datagram
    # a share of 0 sends the frames of a run without --attack (same seed, same frames)
    a = ProbeSpec(200).probes(pol)
    b = ProbeSpec(200, attack=ATTACK_SHAPES, attack_share=0.0).probes(pol)
    assert [p.frame for p in a] == [p.frame for p in b]
    with pytest.raises(HypafilterError):
        ProbeSpec(10, attack=("smurf",), attack_share=0.5)


@pytest.mark.parametrize("shape", ["syn", "udp"])
def test_bench_attack_aims_at_what_the_policy_drops(shape):
    pol = parse_policy(POLICY, "p")
    cfg = Config()
    probes = attack_probes(pol, cfg, None, 300, 1, shape, 7)
    plan = build_plan(pol, cfg)
    srcs = set()
    for p in probes:
        h = parse_frame(p.frame, 0x01)
        assert h.proto == (6 if shape == "syn" else 17)
        srcs.add(h.src)
        assert decision(plan, Header(h.src, h.dst, h.proto, h.sport, h.dport, 0, 0, 0, h.tcp_flags, 3))[2] == 2
    assert len(srcs) <= 7
