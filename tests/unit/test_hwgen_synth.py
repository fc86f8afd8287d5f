"""The synthesis path of hwgen output: `hypafilter synth` with yosys on a small policy, and the Vivado script."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypafilter import cli

from conftest import need_tool

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = str(ROOT / "rulesets" / "example.rules")


@pytest.mark.slow
def test_yosys_estimate_is_sane(capsys):
    need_tool("ghdl", "yosys")
    assert cli.main(["synth", EXAMPLE, "--tool", "yosys", "--json", "--matcher-only"]) == 0
    est = json.loads(capsys.readouterr().out)
    me = est["matcher_encoder"]
    assert est["entries"] > 0
    assert me["LUT"] > 0 and me["FF"] > 0 and 1 <= me["max_lut_levels"] <= 6
    assert me["pipeline_cycles"] >= 3
    assert est["matcher"]["deepest_stages"] and est["encoder"]["LUT"] > 0


def test_vivado_script_written_without_vivado(tmp_path, capsys):
    assert cli.main(["synth", EXAMPLE, "--tool", "vivado", "--out", str(tmp_path)]) == 0
    tcl = (tmp_path / "hypafilter_core.tcl").read_text()
    assert "xc7vx690t-3-ffg1761" in tcl and "nf_sume_hypafilter.xdc" in tcl
    assert "hf_matcher.vhd" in tcl and "synth_design -top hypafilter_core" in tcl
    assert "not on PATH" in capsys.readouterr().out
