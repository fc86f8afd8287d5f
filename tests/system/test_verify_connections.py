"""`hypafilter verify --connections`: real TCP and UDP connections with payload both ways on the hybrid path and
on the plain one, compared per connection, with the share of wire frames the NIC decided (argument handling
without root: tests/unit/test_verify_cli.py)."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.system

LAB = "t-vconn"
CONNECTIONS = 10
CONNTRACK_FIRST = """*filter
:FORWARD DROP [0:0]
-A FORWARD -m conntrack --ctstate ESTABLISHED,RELATED -j ACCEPT
-A FORWARD -p tcp -m tcp --dport 8080 -j ACCEPT
-A FORWARD -p tcp -m tcp --dport 8081 -j REJECT --reject-with tcp-reset
-A FORWARD -p udp -m udp --dport 5353 -j ACCEPT
-A FORWARD -p udp -m udp --dport 5354 -j DROP
COMMIT
"""
# No conntrack: replies need rules of their own (source ports), and the hardware decides every rule.
STATELESS = """*filter
:FORWARD DROP [0:0]
-A FORWARD -p tcp -m tcp --dport 8080 -j ACCEPT
-A FORWARD -p tcp -m tcp --sport 8080 -j ACCEPT
-A FORWARD -p udp -m udp --dport 5353 -j ACCEPT
-A FORWARD -p udp -m udp --sport 5353 -j ACCEPT
-A FORWARD -p tcp -m tcp --dport 8081 -j DROP
COMMIT
"""


def run_verify(tmp_path, capsys, text: str, *extra: str) -> dict:
    from hypafilter.cli import main

    f = tmp_path / "policy.rules"
    f.write_text(text)
    status = main(["verify", str(f), "--packets", "200", "--connections", str(CONNECTIONS), *extra, "--json"])
    out, err = capsys.readouterr()
    r = json.loads(out)
    c = r["connections"]
    with capsys.disabled():  # printed past capsys, so the next run's output is its JSON alone
        print({k: c[k] for k in ("connections", "mismatches", "completed_oracle", "hw_share", "by_kind", "seconds")})
    assert status == 0 and r["mismatches"] == 0 and c["mismatches"] == 0, (err[-2000:], c["examples"][:3])
    assert c["connections"] == CONNECTIONS and sum(k["connections"] for k in c["by_kind"].values()) == CONNECTIONS
    assert c["hw_share"] is None or 0.0 <= c["hw_share"] <= 1.0
    return c


def allowed(text: str) -> int:
    """How many of the run's connections the policies let through: TCP to 8080 and UDP to 5353."""
    from hypafilter.config import Config
    from hypafilter.iptables.document import parse_policy
    from hypafilter.ops.connections import ConnectionSpec

    policy = parse_policy(text, filename="p.rules", base_chain="FORWARD", config=Config())
    return sum((c.proto, c.port) in (("tcp", 8080), ("udp", 5353)) for c in ConnectionSpec(CONNECTIONS).conns(policy))


def test_conntrack_first_policy(lab, tmp_path, capsys):
    c = run_verify(tmp_path, capsys, CONNTRACK_FIRST, "--connection-bytes", "3000")
    assert isinstance(c["hw_share"], float)
    # Both kinds ran, and exactly the allowed ones completed, on both paths (the others were refused).
    assert set(c["by_kind"]) == {"tcp", "udp"}
    assert 0 < allowed(CONNTRACK_FIRST) < CONNECTIONS
    assert c["completed_oracle"] == c["completed_hybrid"] == allowed(CONNTRACK_FIRST)


def test_stateless_policy_is_decided_in_hardware(lab, tmp_path, capsys):
    c = run_verify(tmp_path, capsys, STATELESS)
    assert c["hw_share"] is not None and c["hw_share"] > 0
    assert c["completed_oracle"] == c["completed_hybrid"] == allowed(STATELESS)


def test_a_second_run_starts_clean(lab, tmp_path, capsys):
    """The same run twice gives the same outcomes: nothing of the first (conntrack entries, sockets, ports)
    decides the second."""
    first = run_verify(tmp_path, capsys, CONNTRACK_FIRST)
    again = run_verify(tmp_path, capsys, CONNTRACK_FIRST)
    assert (first["completed_oracle"], first["by_kind"]) == (again["completed_oracle"], again["by_kind"])


@pytest.fixture
def host_lab(request):
    """A lab of its own per target for host mode (INPUT), with deploy pointed at it; down afterwards."""
    from conftest import deployed_lab

    with deployed_lab(f"vhc{request.param[0]}", request.param) as lab:
        yield lab


@pytest.mark.parametrize("host_lab", ["emu", "xdp"], indirect=True)
def test_host_mode_connections(host_lab):
    """Host mode (an INPUT policy): real TCP and UDP connections into the host (servers in the firewall and in the
    plain namespace) and out of it (the host the client, INPUT judging the replies), compared per connection with
    the kernel's; some complete and some are refused (the chain policy DROP), on both targets."""
    import re

    from hypafilter.config import Config
    from hypafilter.iptables.document import parse_policy
    from hypafilter.ops.connections import ConnectionSpec
    from hypafilter.ops.verify import verify

    from conftest import ROOT

    src = (ROOT / "tests" / "system" / "test_host_mode.py").read_text()
    text = re.search(r'HOST_POLICY = """(.*?)"""', src, re.S).group(1)
    pol = parse_policy(text, filename="host.rules", base_chain="INPUT", config=Config())
    spec = ConnectionSpec(16, nbytes=2000)
    r = verify(pol, Config(target=host_lab.target), packets=300, seed=3, connections=spec)
    c = r["connections"]
    print({k: c[k] for k in ("connections", "mismatches", "completed_oracle", "completed_hybrid", "by_kind")})
    assert r["nic_mode"] == "host" and r["mismatches"] == 0, r["examples"][:3]
    assert c["mismatches"] == 0, c["examples"][:3]
    conns = spec.conns(pol, host=True)
    assert {x.direction for x in conns} == {"in", "out"} and {x.proto for x in conns} == {"tcp", "udp"}
    assert c["completed_oracle"] == c["completed_hybrid"] and 0 < c["completed_oracle"] < len(conns)
