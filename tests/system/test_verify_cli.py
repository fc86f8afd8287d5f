"""`hypafilter verify --mode exact --strategy interval_geo --kinds ...` run for real in a lab of this module's own:
the command line deploys the policy in that mode and strategy and reports zero mismatches in its JSON output
(argument handling without root: tests/unit/test_verify_cli.py)."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.system

LAB = "t-vcli"
PACKETS = 800
POLICY = """*filter
:FORWARD DROP [0:0]
-A FORWARD -p tcp -m tcp --dport 22 -j ACCEPT
-A FORWARD -p udp -m string --string "BAD" --algo bm -j DROP
-A FORWARD -p udp -m udp --dport 53 -j ACCEPT
-A FORWARD -s 10.0.1.0/24 -d 10.0.2.0/24 -p icmp -j ACCEPT
-A FORWARD -p tcp -m multiport --dports 80,443 -j REJECT --reject-with tcp-reset
COMMIT
"""


def test_verify_exact_interval_geo_bad_checksums(lab, tmp_path, capsys):
    from hypafilter.cli import main
    from hypafilter.ops import deploy

    f = tmp_path / "small.rules"
    f.write_text(POLICY)
    argv = ["verify", str(f), "--mode", "exact", "--strategy", "interval_geo", "--kinds", "bad_ip_checksum"]
    status = main([*argv, "--packets", str(PACKETS), "--malformed", "0.4", "--seed", "7", "--json"])
    out, err = capsys.readouterr()
    assert status == 0, err[-3000:]
    r = json.loads(out)
    print({k: r[k] for k in ("packets", "mismatches", "shunted", "hw_forwarded", "hw_dropped", "delivered_oracle")})
    print(r["by_kind"])
    assert r["packets"] == PACKETS and r["mismatches"] == 0, r["examples"][:3]
    # Well-formed frames and the one malformed kind asked for, nothing else; br_netfilter drops every frame with
    # a bad IPv4 checksum before any rule, so the oracle delivers none of them and neither may the hybrid.
    assert set(r["by_kind"]) == {"normal", "bad_ip_checksum"}
    assert r["by_kind"]["bad_ip_checksum"]["packets"] > PACKETS // 4
    assert r["by_kind"]["bad_ip_checksum"]["delivered"] == 0
    assert 0 < r["delivered_oracle"] < PACKETS
    assert r["hw_forwarded"] + r["hw_dropped"] > 0 and r["shunted"] > 0  # both paths of the hybrid were used
    state = deploy.read_state()
    assert (state["mode"], state["strategy"]) == ("exact", "interval_geo"), {
        k: state.get(k) for k in ("mode", "strategy")
    }
