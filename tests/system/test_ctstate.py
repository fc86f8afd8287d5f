"""A conntrack-first policy on the emulated NIC (its state rules split into hit and miss parts, miss forcing on
CONTROL bits 4/5): `hypafilter verify` with frames and real connections finds no difference from the policy loaded
alone in netfilter. Frames the flow cache does not know (ct = 0) go to conntrack (miss forcing); the frames of
established connections, which the flow sync service puts into the NIC's flow cache, are decided in hardware: issue #13
asks for 90 % of the wire frames of 20 TCP connections of 200 KB each; under load the test guards 80 % (below)."""

from __future__ import annotations

import json

import pytest

from conftest import TEST_FULL

pytestmark = pytest.mark.system

LAB = "cst"
CONNECTIONS = 8
POLICY = """*filter
:FORWARD DROP [0:0]
-A FORWARD -m conntrack --ctstate INVALID -j DROP
-A FORWARD -m conntrack --ctstate ESTABLISHED,RELATED -j ACCEPT
-A FORWARD -p tcp -m tcp --dport 8080 -j ACCEPT
-A FORWARD -p tcp -m tcp --dport 8081 -j DROP
-A FORWARD -p udp -m udp --dport 5353 -m state --state NEW -j ACCEPT
-A FORWARD -p udp -m udp --dport 5354 -j DROP
-A FORWARD -p icmp -m icmp --icmp-type 8 -j ACCEPT
COMMIT
"""


def test_policy_splits_as_expected():
    from hypafilter.analysis.plan import build_plan
    from hypafilter.config import Config
    from hypafilter.iptables.document import parse_policy

    pol = parse_policy(POLICY)
    assert [r.ct_part for r in pol.rules] == ["miss", "hit", "miss", "", "", "miss", "", ""]
    assert build_plan(pol, Config()).miss_shunt == (True, True)


@pytest.mark.parametrize("mode", [pytest.param("selective", marks=TEST_FULL), "exact"])
def test_conntrack_first_policy_verifies(lab, tmp_path, capsys, mode):
    from hypafilter.cli import main

    f = tmp_path / "policy.rules"
    f.write_text(POLICY)
    args = ["verify", str(f), "--packets", "300", "--connections", str(CONNECTIONS), "--mode", mode, "--json"]
    status = main(args)
    out, err = capsys.readouterr()
    r = json.loads(out)
    c = r["connections"]
    with capsys.disabled():
        print(
            mode, {k: r[k] for k in ("packets", "mismatches") if k in r}, {k: c[k] for k in ("mismatches", "hw_share")}
        )
    assert status == 0 and r["mismatches"] == 0 and c["mismatches"] == 0, (err[-2000:], c["examples"][:3])
    assert c["connections"] == CONNECTIONS
    # (connections of 4 KB are mostly handshake and sync lag: their share is measured below, at 200 KB)
    assert c["completed_oracle"] == c["completed_hybrid"] > 0
    assert c["hw_share"] is not None and r["shunted"] > 0


# Conntrack-first, every new TCP connection allowed: all 20 connections of the measure below complete.
POLICY_TCP = """*filter
:FORWARD DROP [0:0]
-A FORWARD -m conntrack --ctstate INVALID -j DROP
-A FORWARD -m conntrack --ctstate ESTABLISHED,RELATED -j ACCEPT
-A FORWARD -p tcp -m conntrack --ctstate NEW -j ACCEPT
COMMIT
"""


@pytest.mark.solo  # the 90 % reads the sync service's lag: no other worker's test beside it (conftest)
def test_established_tcp_is_decided_in_hardware(lab, tmp_path, capsys):
    """Issue #13's measure: 20 TCP connections of 200 KB each way through a conntrack-first policy; every one completes
    as on the kernel alone, and the NIC decides at least 90 % of their wire frames itself."""
    from hypafilter.cli import main

    f = tmp_path / "policy.rules"
    f.write_text(POLICY_TCP)
    args = ["verify", str(f), "--packets", "50", "--connections", "20", "--connection-kinds", "tcp"]
    status = main([*args, "--connection-bytes", str(200 * 1024), "--json"])
    out, err = capsys.readouterr()
    r = json.loads(out)
    c = r["connections"]
    with capsys.disabled():
        print("20 TCP x 200 KB:", {k: c[k] for k in ("mismatches", "completed_hybrid", "hw_share", "seconds")})
    assert status == 0 and r["mismatches"] == 0 and c["mismatches"] == 0, (err[-2000:], c["examples"][:3])
    assert c["connections"] == 20 and c["completed_oracle"] == c["completed_hybrid"] == 20
    # The measure, 90 %. What is left in software is each connection's handshake and teardown and the
    # frames before the sync service installed its flow (about a millisecond); a flow that conntrack takes to
    # LAST_ACK by a FIN sent twice comes back at TIME_WAIT. Measured 0.951-0.986 with stress-ng beside the test,
    # 0.960-0.975 without (docs/flowsync.md, "Measured"); the test prints the figure.
    assert c["hw_share"] >= 0.9, c["nic"]
