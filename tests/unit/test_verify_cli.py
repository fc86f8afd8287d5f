"""`hypafilter verify` arguments: --kinds, --mode and --strategy reach verify as given; a bad value is a clear error
with exit status 2 before anything is touched (no lab, no deploy, no command, no state). The real run is
tests/system/test_verify_cli.py."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypafilter.cli import main
from hypafilter.ops import verify as verify_mod
from hypafilter.ops.verify import FRAME_KINDS, MALFORMED_KINDS

ROOT = Path(__file__).resolve().parents[2]
POLICY = str(ROOT / "rulesets" / "example.rules")
REPORT = {
    "packets": 1,
    "mismatches": 0,
    "shunted": 0,
    "hw_forwarded": 0,
    "hw_dropped": 0,
    "delivered_oracle": 0,
    "duplicates": 0,
    "examples": [],
    "observers": {
        "rules": 0,
        "mismatches": 0,
        "matched_oracle": 0,
        "matched_hybrid": 0,
        "not_comparable": 0,
        "examples": [],
    },
}


@pytest.fixture
def untouched(monkeypatch, tmp_path):
    """Every way verify reaches the machine fails the test; state goes to an empty directory that must stay
    absent."""
    from hypafilter import netns
    from hypafilter.ops import deploy

    def touched(*a, **k):
        raise AssertionError(f"verify touched the machine: {a!r}")

    monkeypatch.setattr(verify_mod, "Lab", touched)
    monkeypatch.setattr(deploy, "deploy", touched)
    monkeypatch.setattr(deploy, "read_state", touched)
    monkeypatch.setattr(netns, "run", touched)
    state = tmp_path / "state"
    monkeypatch.setattr(deploy, "STATE_DIR", state)
    yield
    assert not state.exists()


@pytest.fixture
def captured(monkeypatch):
    """verify replaced by a recorder: what the command line turned into, without a lab."""
    calls = []

    def fake(policy, config, log=None, **probes):
        calls.append((policy, config, probes))
        return dict(REPORT)

    monkeypatch.setattr(verify_mod, "verify", fake)
    return calls


def exit_status(argv, capsys) -> tuple[int, str]:
    """main's status and stderr, whether argparse exits (SystemExit) or main returns."""
    try:
        status = main(argv)
    except SystemExit as e:
        status = e.code
    return status, capsys.readouterr().err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--mode", "fast"], "argument --mode: invalid choice: 'fast'"),
        (["--mode", "Exact"], "argument --mode: invalid choice: 'Exact'"),
        (["--strategy", "geo"], "argument --strategy: invalid choice: 'geo'"),
        (["--strategy", ""], "argument --strategy: invalid choice: ''"),
        (["--kinds", "vlan,nosuch"], "unknown frame kinds nosuch (choose from ip_options,"),
        (["--kinds", "normal,bad_ip_checksum"], "'normal' is not a malformed kind: well-formed frames are always"),
        (["--kinds", ","], "no frame kind given"),
        (["--kinds", ""], "no frame kind given"),
        (["--mode"], "argument --mode: expected one argument"),
    ],
)
def test_bad_values_exit_2_and_touch_nothing(untouched, capsys, args, message):
    status, err = exit_status(["verify", POLICY, *args], capsys)
    assert status == 2 and message in err, err
    assert "Traceback" not in err


def test_choices_are_listed(untouched, capsys):
    _, err = exit_status(["verify", POLICY, "--mode", "x"], capsys)
    assert all(m in err for m in ("index", "selective", "exact")), err
    _, err = exit_status(["verify", POLICY, "--strategy", "x"], capsys)
    assert all(s in err for s in ("full", "cut", "hsa_cut", "interval", "interval_geo")), err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--packets", "0"], "--packets must be between 1 and 2^32-1"),
        (["--malformed", "1.5"], "--malformed must be a share between 0 and 1"),
    ],
)
def test_values_verify_refuses_exit_2_and_touch_nothing(untouched, capsys, args, message):
    """Values argparse takes but verify refuses: refused before the lab is looked at."""
    status, err = exit_status(["verify", POLICY, *args], capsys)
    assert status == 2 and f"hypafilter: error: {message}" in err, err


def test_a_refused_policy_exits_2_and_touches_nothing(untouched, capsys, tmp_path):
    f = tmp_path / "rand.rules"
    f.write_text(
        "*filter\n:FORWARD ACCEPT [0:0]\n-A FORWARD -m statistic --mode random --probability 0.5 -j DROP\nCOMMIT\n"
    )
    status, err = exit_status(["verify", str(f), "--mode", "exact", "--strategy", "interval_geo"], capsys)
    assert status == 2 and f"{f}:3: verify refuses match 'statistic'" in err, err


def test_mode_strategy_and_kinds_reach_verify(captured, capsys):
    status = main(
        ["verify", POLICY, "--mode", "exact", "--strategy", "interval_geo", "--kinds", "bad_ip_checksum,vlan,vlan"]
    )
    assert status == 0, capsys.readouterr().err
    (policy, config, probes) = captured[0]
    assert (config.shunt_mode, config.strategy) == ("exact", "interval_geo")
    assert probes["kinds"] == ("bad_ip_checksum", "vlan")  # in order, once each
    assert policy.source.endswith("example.rules") and config.bridge  # the lab's interfaces (deploy.site_config)


@pytest.mark.parametrize(
    ("kinds", "want"),
    [
        (None, MALFORMED_KINDS),
        ("default", MALFORMED_KINDS),
        ("all", FRAME_KINDS),
        ("qinq, default", ("qinq", *MALFORMED_KINDS)),
        ("vlan,default", ("vlan", *(k for k in MALFORMED_KINDS if k != "vlan"))),  # first mention keeps its place
    ],
)
def test_kinds_groups(captured, capsys, kinds, want):
    assert main(["verify", POLICY] + (["--kinds", kinds] if kinds else [])) == 0
    assert captured[0][2]["kinds"] == want
    assert (captured[0][1].shunt_mode, captured[0][1].strategy) == ("selective", "interval")  # the defaults


def test_mismatches_exit_1(captured, monkeypatch, capsys):
    monkeypatch.setattr(verify_mod, "verify", lambda *a, **k: dict(REPORT, mismatches=3))
    assert main(["verify", POLICY, "--mode", "index"]) == 1


def test_observer_mismatches_exit_1(captured, monkeypatch, capsys):
    """Verdicts equal but an observing rule counted other frames than the kernel's: a failure, shown on stderr."""
    bad = {"rule": "-p tcp -j LOG", "oracle": 3, "hybrid": 2, "comparable": True}
    obs = dict(REPORT["observers"], rules=1, mismatches=1, matched_oracle=3, matched_hybrid=2, examples=[bad])
    monkeypatch.setattr(verify_mod, "verify", lambda *a, **k: dict(REPORT, observers=obs))
    assert main(["verify", POLICY, "--mode", "index"]) == 1
    out = capsys.readouterr()
    assert '"observers": {"rules": 1, "mismatches": 1' in out.out and "observer mismatch" in out.err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--connections", "0"], "--connections must be between 1 and 20000"),
        (["--connections", "20001"], "--connections must be between 1 and 20000"),
        (["--connections", "4", "--connection-bytes", "0"], "--connection-bytes must be between 1 and 1048576"),
        (["--connection-bytes", "100"], "--connection-bytes and --connection-kinds need --connections"),
        (["--connection-kinds", "tcp"], "--connection-kinds need --connections"),
        (["--connections", "4", "--connection-kinds", "sctp"], "--connection-kinds takes tcp and/or udp"),
        (["--connections", "4", "--connection-kinds", "tcp,tcp"], "--connection-kinds takes tcp and/or udp"),
        (["--connections", "4", "--connection-kinds", ","], "(got none)"),
        (["--connections", "x"], "argument --connections: invalid int value: 'x'"),
    ],
)
def test_bad_connection_values_exit_2_and_touch_nothing(untouched, capsys, args, message):
    status, err = exit_status(["verify", POLICY, *args], capsys)
    assert status == 2 and message in err, err


def test_connections_reach_verify(captured, capsys):
    from hypafilter.ops.connections import ConnectionSpec

    assert main(["verify", POLICY, "--connections", "6", "--connection-bytes", "100"]) == 0
    assert captured[0][2]["connections"] == ConnectionSpec(6, 100)
    assert main(["verify", POLICY, "--connections", "3"]) == 0
    assert captured[1][2]["connections"] == ConnectionSpec(3)  # the default bytes
    assert main(["verify", POLICY]) == 0
    assert captured[2][2]["connections"] is None  # frames only
    assert main(["verify", POLICY, "--connections", "4", "--connection-kinds", "udp,tcp"]) == 0
    assert captured[3][2]["connections"] == ConnectionSpec(4, kinds=("udp", "tcp"))


def test_connection_mismatches_exit_1(monkeypatch, capsys):
    conn = {"connections": 2, "bytes": 1, "mismatches": 1, "completed_oracle": 1, "hw_share": 0.5, "by_kind": {}}
    report = dict(REPORT, connections=dict(conn, examples=[{"connection": "tcp/40000->22"}]))
    monkeypatch.setattr(verify_mod, "verify", lambda *a, **k: report)
    assert main(["verify", POLICY, "--connections", "2"]) == 1
    out, err = capsys.readouterr()
    assert '"hw_share": 0.5' in out and "connection mismatch" in err


def test_connection_plan_uses_the_policys_ports():
    """TCP and UDP in turn, each through the destination ports the rules name and one they do not, from source
    ports that are the same on both paths."""
    from hypafilter.config import Config
    from hypafilter.iptables.document import parse_policy
    from hypafilter.ops.connections import SPORT_BASE, UNNAMED_PORT, ConnectionSpec, policy_ports
    from hypafilter.ops.verify import hw_share

    policy = parse_policy(Path(POLICY).read_text(), filename=POLICY, base_chain="FORWARD", config=Config())
    ports = policy_ports(policy)
    assert UNNAMED_PORT in ports["tcp"] and UNNAMED_PORT in ports["udp"] and len(ports["tcp"]) > 1
    conns = ConnectionSpec(8).conns(policy)
    assert [c.proto for c in conns] == ["tcp", "udp"] * 4
    assert [c.sport for c in conns] == list(range(SPORT_BASE, SPORT_BASE + 8))
    assert all(c.port in ports[c.proto] for c in conns)
    assert [c.proto for c in ConnectionSpec(3, kinds=("tcp",)).conns(policy)] == ["tcp"] * 3
    assert hw_share({"PKTIN": 10, "CNT_FORWARDED": 3, "CNT_DROPPED": 1}) == 0.4 and hw_share({"PKTIN": 0}) is None


def test_connection_outcomes_compared_whole():
    """Any difference in a connection's outcome (completion, bytes or datagrams either way) is one mismatch."""
    from hypafilter.ops.connections import Conn, compare

    conns = [Conn("tcp", 22, 40000), Conn("udp", 53, 40001)]
    tcp = {"completed": True, "up": 10, "down": 10, "intact": True}
    udp = {"completed": True, "up": [0], "down": [0], "intact": True}
    same = compare(conns, {"hyb": [tcp, udp], "plain": [tcp, udp]}, 10)
    assert same["mismatches"] == 0 and same["completed_oracle"] == 2
    short = dict(tcp, completed=False, down=9)
    lost = dict(udp, completed=False, down=[])
    got = compare(conns, {"hyb": [short, lost], "plain": [tcp, udp]}, 10)
    assert got["mismatches"] == 2 and got["completed_hybrid"] == 0
    assert got["by_kind"] == {k: {"connections": 1, "completed": 1, "mismatches": 1} for k in ("tcp", "udp")}
    assert got["examples"][0] == {"connection": "tcp/40000->22", "hybrid": short, "oracle": tcp}
    assert "by_direction" not in got  # bridge mode
    host = [Conn("tcp", 22, 40000, "in"), Conn("udp", 53, 40001, "out", family=6)]
    got = compare(host, {"hyb": [short, udp], "plain": [tcp, udp]}, 10)
    assert got["by_direction"] == {
        "in": {"connections": 1, "completed": 1, "mismatches": 1},
        "out": {"connections": 1, "completed": 1, "mismatches": 0},
    }
    assert got["examples"][0]["connection"] == "tcp/40000->22 (in)"


def test_cover_reaches_verify(captured, capsys):
    assert main(["verify", POLICY, "--cover"]) == 0
    assert captured[0][2]["cover"] is True
    assert main(["verify", POLICY]) == 0
    assert captured[1][2]["cover"] is False


def test_cover_frames_are_the_corners_of_every_rule_in_order():
    """`--cover`: frames 1..2k carry, in rule order, the low and the high end of every field of each box (read back
    from the frames' own bytes), well-formed; the drawn frames follow."""
    import struct

    from hypafilter.iptables.document import parse_policy

    text = (
        "*filter\n:FORWARD DROP [0:0]\n"
        "-A FORWARD -s 10.1.0.0/16 -d 192.168.7.128/25 -p udp -m udp --sport 1000:2000 --dport 53 -j ACCEPT\n"
        "-A FORWARD -p tcp -m tcp --dport 80:88 -j DROP\n"
        "-A FORWARD -d 172.16.0.1/32 -j ACCEPT\nCOMMIT\n"
    )
    policy = parse_policy(text, filename="cover.rules", base_chain="FORWARD")
    boxes = [b for r in policy.rules for b in r.boxes]
    probes = verify_mod.make_probes(policy, 2 * len(boxes) + 5, cover=True, malformed=1.0)
    assert len(probes) == 2 * len(boxes) + 5
    for k, box in enumerate(boxes):
        for end, p in zip((box.lo, box.hi), probes[2 * k : 2 * k + 2], strict=True):
            assert p.kind == "normal"
            f = p.frame
            src, dst = struct.unpack("!II", f[26:34])
            proto = f[23]
            assert (src, dst) == (end[0], end[1])
            if box.hi[2] - box.lo[2] > 16:  # a protocol the rule leaves free: TCP or UDP, so ports are read
                assert proto in (6, 17)
            else:
                assert proto == end[2]
            if proto in (6, 17):
                sport, dport = struct.unpack("!HH", f[34:38])
                assert (sport, dport) == (end[3], end[4])
    assert all(p.kind != "normal" for p in probes[2 * len(boxes) :])  # then the drawn frames (all malformed here)
