"""The set table as the emulator runs it: GHDL's Verilog netlist under Verilator, with the RTL testbench. GHDL 2.0's
Verilog writer differs from its VHDL netlist (a constant wider than 32 bits became a quoted string: every key hashed
to a wrong bucket in the emulator while both VHDL runs were right), so this path is tested on its own (it also stands for the post-synthesis run: the VHDL netlist under GHDL passed the
same bench, the default geometry included, when it was written)."""

from __future__ import annotations

import os

import pytest
from cocotb.runner import get_results, get_runner
from hypafilter import netns
from hypafilter.hw import settable
from hypafilter.paths import ROOT

from conftest import TEST_FULL, need_tool
from sim.hf_set_table.test_hf_set_table import GENERICS, SOURCES
from sim.hftb import SIM_DIR, fresh_build, hw

TOP = "hf_set_table"


@TEST_FULL  # make test-full
@pytest.mark.sim
def test_set_table_verilog():
    need_tool("ghdl", "verilator")
    values = [settable.SETTYPES["hash:net,port"], 1, 0, 8, 3, 2]
    out = fresh_build(TOP, "verilog")
    gargs = [f"-g{k}={v}" for k, v in zip(GENERICS, values, strict=True)]
    argv = ["ghdl", "--synth", "--std=08", f"--workdir={out}", *gargs, "--out=verilog", *map(str, hw(*SOURCES)),
            "-e", TOP]  # fmt: skip
    verilog = out / "hf_set_table.v"
    verilog.write_text(netns.run(argv, cwd=out, timeout=None))
    runner = get_runner("verilator")
    runner.build(
        verilog_sources=[str(verilog)],
        hdl_toplevel=TOP,
        build_dir=out / "obj",
        build_args=["-Wno-fatal", "-Wno-lint", "-Wno-style", "-Wno-INITIALDLY", "-Wno-COMBDLY", "-Wno-MULTIDRIVEN"],
        always=True,
    )
    path = os.pathsep.join([str(ROOT), str(SIM_DIR / TOP), str(ROOT / "mgmt")])
    results = runner.test(
        hdl_toplevel=TOP,
        test_module="test_hf_set_table",
        build_dir=out / "obj",
        test_dir=out / "obj",
        extra_env={"HF_ST_GENERICS": ",".join(map(str, values)), "PYTHONPATH": path},
    )
    total, failed = get_results(results)
    assert total == 1 and failed == 0, f"{failed} of {total} cocotb tests failed (log under {out})"
