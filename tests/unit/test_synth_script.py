"""The synthesis path of hw.vhdl output: `hypafilter synth` with yosys on a small policy, and the Vivado script."""

from __future__ import annotations

from pathlib import Path

from hypafilter import cli

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = str(ROOT / "rulesets" / "example.rules")


def test_vivado_script_written_without_vivado(tmp_path, capsys):
    assert cli.main(["synth", EXAMPLE, "--tool", "vivado", "--out", str(tmp_path)]) == 0
    tcl = (tmp_path / "hypafilter_core.tcl").read_text()
    assert "xc7vx690t-3-ffg1761" in tcl and "nf_sume_hypafilter.xdc" in tcl
    assert "hf_matcher.vhd" in tcl and "synth_design -top hypafilter_core" in tcl
    # the policy sync lease ticks once a millisecond of the XDC's 200 MHz axis_aclk
    assert (
        "-generic LEASE_TICK_CYCLES=200000" in tcl
        and "-period 5.000" in (ROOT / "constraints").joinpath("nf_sume_hypafilter.xdc").read_text()
    )
    assert "not on PATH" in capsys.readouterr().out


def test_vivado_script_with_a_flow_cache_lists_its_source_and_generics(tmp_path, capsys):
    assert cli.main(["synth", EXAMPLE, "--tool", "vivado", "--out", str(tmp_path), "--core-flow-cache", "14:4"]) == 0
    tcl = (tmp_path / "hypafilter_core.tcl").read_text()
    assert "hf_flow_cache.vhd" in tcl and "-generic FC_LOG2_SETS=14 -generic FC_WAYS=4" in tcl
    assert cli.main(["synth", EXAMPLE, "--tool", "vivado", "--out", str(tmp_path)]) == 0
    assert "-generic FC_LOG2_SETS=0 " in (tmp_path / "hypafilter_core.tcl").read_text()


def test_bad_flow_cache_geometry_is_refused(tmp_path, capsys):
    for bad in ("14", "8:4", "14:8", "x:y"):
        assert cli.main(["synth", EXAMPLE, "--tool", "vivado", "--out", str(tmp_path), "--core-flow-cache", bad]) != 0
        assert "--core-flow-cache" in capsys.readouterr().err
