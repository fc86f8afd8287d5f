"""Post-synthesis simulation of the flow cache: the GHDL-synthesised VHDL netlist (4,096 entries) under the RTL
testbench's model test (thousands of lookups at up to one per cycle beside host commands, exact statistics) and
its full-set test."""

from __future__ import annotations

import pytest
from hypafilter import netns

from conftest import TEST_FULL, need_tool
from sim.hftb import fresh_build, hw, run_ghdl

TOP = "hf_flow_cache"
LOG2_SETS, WAYS, TS_W = 10, 4, 16


@TEST_FULL  # make test-full
@pytest.mark.sim
def test_flow_cache_postsynth():
    need_tool("ghdl")
    tag = f"postsynth_s{LOG2_SETS}_w{WAYS}"
    work = fresh_build(TOP, tag) / "synth"
    work.mkdir()
    sources = hw("hf_pkg.vhd", "hf_ram.vhd", "hf_flow_cache.vhd")
    generics = [f"-gLOG2_SETS={LOG2_SETS}", f"-gWAYS={WAYS}", f"-gTS_W={TS_W}", "-gTICK_CYCLES=3"]
    argv = ["ghdl", "--synth", "--std=08", f"--workdir={work}", *generics, "--out=vhdl", *map(str, sources), "-e", TOP]
    text = netns.run(argv, cwd=work, timeout=None)
    netlist = work / "flow_cache_synth.vhd"
    netlist.write_text(text)
    # the netlist keeps the entity's use clause of hf_pkg, so the package is compiled before it
    run_ghdl(
        TOP,
        [*hw("hf_pkg.vhd"), netlist],
        tag,
        {},
        env={"HF_FC_GENERICS": f"{LOG2_SETS},{WAYS},{TS_W}"},
        testcase=["lookups_follow_the_model", "full_sets_and_bad_commands"],
        test_module="test_hf_flow_cache",
        build_args=["-O0"],  # LLVM's optimiser on the gate-level netlist costs more than it saves here
    )
