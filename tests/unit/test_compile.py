"""Unit tests for `hypafilter compile`: artifacts, manifest, and nothing written on error."""

from __future__ import annotations

import json

from hypafilter.cli import main

POLICY = """*filter
:FORWARD DROP [0:0]
-A FORWARD -d 1.2.3.4/32 -p tcp -m tcp --dport 80 -j ACCEPT
-A FORWARD -s 1.2.3.0/24 -p tcp -j ACCEPT
-A FORWARD -d 1.2.3.5/32 -p udp -m udp --dport 3306 -m string --string SELECT --algo bm -j DROP
-A FORWARD -d 1.2.3.4/32 -p tcp -m tcp --dport 443 -j ACCEPT
-A FORWARD -d 1.2.3.6/32 -p udp -m udp --dport 53 -m statistic --mode random --probability 0.5 -j DROP
-A FORWARD -d 1.2.3.6/32 -p udp -m udp --dport 53 -j ACCEPT
COMMIT
"""


def test_compile_writes_every_artifact(tmp_path, capsys):
    pol = tmp_path / "p.rules"
    pol.write_text(POLICY)
    out = tmp_path / "out"
    assert main(["compile", str(pol), "-o", str(out)]) == 0
    man = json.loads((out / "manifest.json").read_text())
    assert sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file()) == man["files"]
    assert man["rules"] == 6 and man["complex"] == 2 and man["mode"] == "selective"
    assert json.loads((out / "shunt.json").read_text())["selective"] == "00011"
    shim = json.loads((out / "shim_intervals.json").read_text())
    assert shim["intervals"] == [1, 1, 2, 3, 4] and shim["num_entries"] == 5
    regs = json.loads((out / "registers.json").read_text())
    assert regs[0] == {"table": "SHUNT", "offset": 0, "value": 0b11000}
    assert {"table": "ACTION", "offset": 4, "value": 2} in regs
    assert "netfilter/interval.nft" not in man["files"] and "netfilter/interval.nft" in man["skipped"]
    assert (out / "netfilter" / "interval.iptables").read_text().startswith("# hypafilter")
    assert "complex" in (out / "partition.txt").read_text()
    # Recompiling in another mode replaces the directory as a whole.
    assert main(["compile", str(pol), "-o", str(out), "--mode", "index"]) == 0
    man = json.loads((out / "manifest.json").read_text())
    assert man["mode"] == "index" and not (out / "netfilter" / "hsa_cut.iptables").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_compile_error_writes_nothing(tmp_path, capsys):
    pol = tmp_path / "bad.rules"
    pol.write_text(POLICY.replace("--dport 443", "--dport 99999"))
    out = tmp_path / "out"
    assert main(["compile", str(pol), "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert "bad.rules:" in err
    assert not out.exists() and list(tmp_path.iterdir()) == [pol]


def test_a_huge_token_is_not_echoed_in_skipped_lines(tmp_path, capsys):
    """nft has no form for an unknown match: each skipped .nft file says so with the match name cut."""
    from tests.unit.test_lint import BIG

    pol = tmp_path / "big.rules"
    pol.write_text(BIG.format("bm", "n" * 1_000_000))
    assert main(["compile", str(pol), "-o", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert out.count("skipped netfilter/") >= 5 and len(out) < 3000, out[:3000]
    assert "n" * 81 not in str(json.loads((tmp_path / "out" / "manifest.json").read_text())["skipped"])
