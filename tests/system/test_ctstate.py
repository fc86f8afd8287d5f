"""A conntrack-first policy on the emulated NIC (its state rules split into hit and miss parts, miss forcing on
CONTROL bits 4/5): `hypafilter verify` with frames and real connections finds no difference from the policy loaded
alone in netfilter. The core has no flow cache yet, so every frame has ct = 0: miss forcing sends every frame the
hardware would decide to conntrack, and the hardware decides none."""

from __future__ import annotations

import json

import pytest

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


@pytest.mark.parametrize("mode", ["selective", "exact"])
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
    # ct is 0 for every frame (no flow cache in the core yet): the hardware forwards and drops nothing by a rule
    # (frames netfilter cannot filter, two VLAN tags, are still dropped by the NIC, as for every policy).
    assert c["hw_share"] in (None, 0.0)
    assert r["hw_forwarded"] == 0 and r["hw_dropped"] == 0 and r["shunted"] > 0
