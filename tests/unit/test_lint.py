"""`hypafilter lint`: summary on success, file:line:column error and non-zero exit on bad input, no files written."""

from __future__ import annotations

from pathlib import Path

from hypafilter.cli import main

ROOT = Path(__file__).resolve().parents[2]


def test_lint_summary(capsys):
    assert main(["lint", str(ROOT / "rulesets/listing1.rules")]) == 0
    out = capsys.readouterr().out
    assert "6 rules in FORWARD" in out and "4 simple, 2 complex" in out
    assert "complex: match -m string --string SELECT --algo bm" in out


def test_lint_error(tmp_path, capsys):
    bad = tmp_path / "bad.rules"
    bad.write_text("-p tcp -j ACCEPT\n-p udp --dport 9:1 -j DROP\n")
    before = sorted(tmp_path.iterdir())
    assert main(["lint", str(bad)]) != 0
    err = capsys.readouterr().err
    assert f"{bad}:2:16: invalid port range (min > max) (at '9:1')" in err
    assert sorted(tmp_path.iterdir()) == before


def test_lint_chain_option(tmp_path, capsys):
    f = tmp_path / "in.rules"
    f.write_text("*filter\n:INPUT DROP [0:0]\n-A INPUT -p tcp -m tcp --dport 22 -j ACCEPT\nCOMMIT\n")
    assert main(["lint", str(f), "--chain", "INPUT"]) == 0
    assert "policy DROP" in capsys.readouterr().out


def test_binary_input_names_file_line_and_column(tmp_path, capsys):
    pol = tmp_path / "bin.rules"
    pol.write_bytes(b"*filter\n:FORWARD ACCEPT [0:0]\n-A FORWARD -s \xff\xfe -j DROP\nCOMMIT\n")
    assert main(["lint", str(pol)]) == 2
    err = capsys.readouterr().err
    assert f"{pol}:3:15: not UTF-8 text: byte 0xff" in err and "Traceback" not in err


def test_a_huge_token_is_not_echoed_whole(tmp_path, capsys):
    pol = tmp_path / "big.rules"
    pol.write_text("*filter\n:FORWARD ACCEPT [0:0]\n-A FORWARD -s " + "a" * 1_000_000 + " -j DROP\nCOMMIT\n")
    assert main(["lint", str(pol)]) == 2
    err = capsys.readouterr().err
    assert len(err) < 500 and "(1000000 characters)" in err


BIG = (
    "*filter\n:FORWARD DROP [0:0]\n-A FORWARD -p tcp -m string --algo {0} --string x -j ACCEPT\n"
    "-A FORWARD -p tcp -m {1} -j ACCEPT\nCOMMIT\n"
)


def test_a_huge_match_name_or_value_is_not_listed_whole(tmp_path, capsys):
    """Tokens the parser leaves to the kernel (a match name, a string match's --algo) are listed cut, in the
    complex-rule reasons and in the -v listing alike."""
    pol = tmp_path / "big.rules"
    pol.write_text(BIG.format("b" * 1_000_000, "n" * 1_000_000))
    assert main(["lint", "--no-kernel", "-v", str(pol)]) == 0
    out = capsys.readouterr().out
    assert len(out) < 2000 and out.count("... (1000000 characters)") == 4, out
    assert 'match -m string --algo "' + "b" * 80 + '... (1000000 characters)" --string x' in out


def test_a_closed_pipe_ends_lint_quietly():
    import subprocess
    import sys

    r = subprocess.run(
        f"{sys.executable} -m hypafilter lint -v rulesets/example.rules | head -1",
        shell=True,
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert r.stdout.startswith("rulesets/example.rules:") and "Traceback" not in r.stderr, r.stderr


def test_a_jump_loop_names_the_jump_target_column(tmp_path, capsys):
    pol = tmp_path / "loop.rules"
    pol.write_text(
        "*filter\n:FORWARD ACCEPT [0:0]\n:A - [0:0]\n:B - [0:0]\n-A FORWARD -j A\n-A A -p tcp -j B\n-A B -p udp -j A\nCOMMIT\n"
    )
    assert main(["lint", str(pol)]) == 2
    assert f"{pol}:7:16: chain loop: A is reached from itself" in capsys.readouterr().err
