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
