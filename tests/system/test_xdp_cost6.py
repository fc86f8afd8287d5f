"""`bench xdp-cost` with IPv6 (issue #25; docs/results.md "The program's own cost with IPv6"): `POLICY --ipv6
V6POLICY` gives the program the IPv6 side's table set and sends verify6's IPv6 frames beside the IPv4 ones through
BPF_PROG_TEST_RUN. The IPv6 frames must have gone through the program's IPv6 path: its own per-entry counters
(hfx6_hits, `counters.HITS6`) count every well-formed IPv6 frame of every run (each matches an IPv6 entry or the
IPv6 policy entry), and the JSON report carries ns per frame by family and by frame kind. Without the IPv6 side
(main) the frames are unparsed and the report has neither."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT, need_root, need_tool

pytestmark = pytest.mark.system

FRAMES, REPEAT = 300, 1  # (a BPF_PROG_TEST_RUN call with repeat > 1 took 25-30 ms here, whatever the repeat)
V6 = """*filter
:INPUT ACCEPT [0:0]
:FORWARD DROP [0:0]
:OUTPUT ACCEPT [0:0]
-A FORWARD -p ipv6-icmp --icmpv6-type echo-request -j ACCEPT
-A FORWARD -s 2001:db8:1::/48 -p tcp --dport 80 -j ACCEPT
-A FORWARD -s 2001:db8:1:5::/64 -d 2001:db8:2::/48 -j DROP
-A FORWARD -p udp --dport 5000:5100 -j ACCEPT
-A FORWARD -p tcp --dport 8080 -j REJECT --reject-with icmp6-port-unreachable
COMMIT
"""


def test_ipv6_frames_through_the_ipv6_path(tmp_path):
    need_root()
    need_tool("ip", "clang", "cc", "make", "ip6tables-restore")
    (tmp_path / "v6.rules").write_text(V6)
    argv = [sys.executable, "-m", "hypafilter", "bench", "xdp-cost", str(ROOT / "rulesets" / "example.rules")]
    argv += ["--ipv6", str(tmp_path / "v6.rules"), "--frames", str(FRAMES), "--repeat", str(REPEAT)]
    env = dict(os.environ, HF_LAB="w9c", HF_STATE_DIR=str(tmp_path / "state"))
    p = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == 0, p.stderr
    r = json.loads(p.stdout.splitlines()[-1])
    six, kinds, fam = r.get("ipv6") or {}, r.get("by_kind") or {}, r.get("by_family") or {}
    print({k: r[k] for k in ("ns_mean", "by_family", "counters")})
    assert six.get("entries", 0) >= 3 and six.get("frames") == FRAMES // 2, six  # --ipv6-share 0.5
    assert fam["4"]["frames"] == fam["6"]["frames"] == FRAMES // 2 and fam["6"]["ns_mean"] > 0, fam
    assert kinds["v4"]["frames"] == FRAMES // 2 and sum(v["frames"] for v in kinds.values()) == FRAMES, kinds
    normal = kinds["v6_normal"]["frames"]
    assert normal > 0 and kinds["v6_normal"]["ns_median"] > 0, kinds
    # the program's IPv6 path matched every well-formed IPv6 frame in every run (and the malformed kinds it parses:
    # extension-header chains, ND, ICMPv6 errors), never more than the IPv6 frames sent
    hits6 = r["counters"].get("HITS6", 0)
    assert normal * REPEAT <= hits6 <= FRAMES // 2 * REPEAT and hits6 % REPEAT == 0, (normal, r["counters"])
    assert r["counters"]["PKTIN"] == FRAMES * REPEAT, r["counters"]
