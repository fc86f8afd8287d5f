"""Post-synthesis simulation of the update buffer: the GHDL-synthesised VHDL netlist (40 static entries, 16 slots)
under the RTL testbench's model test (a header every cycle, host writes between them, every index, mask and word)."""

from __future__ import annotations

import pytest
from hypafilter import netns
from hypafilter.hw import regmap

from conftest import TEST_FULL, need_tool
from sim.hf_update_buffer.test_hf_update_buffer import SOURCES, generics
from sim.hftb import fresh_build, hw, run_ghdl

TOP = "hf_update_buffer"
N, DEPTH, I_DELAY, FANIN = 40, 16, 4, 8


@TEST_FULL  # make test-full
@pytest.mark.sim
def test_update_buffer_postsynth():
    need_tool("ghdl")
    tag = f"postsynth_n{N}_d{DEPTH}"
    work = fresh_build(TOP, tag) / "synth"
    work.mkdir()
    regmap.write_all(work)
    sources = [work / "hf_regs_pkg.vhd", *hw(*SOURCES)]
    gargs = [f"-g{k}={v}" for k, v in generics(N, DEPTH, I_DELAY, FANIN).items()]
    argv = ["ghdl", "--synth", "--std=08", f"--workdir={work}", *gargs, "--out=vhdl", *map(str, sources), "-e", TOP]
    netlist = work / "update_buffer_synth.vhd"
    netlist.write_text(netns.run(argv, cwd=work, timeout=None))
    # the netlist keeps the entity's use clauses, so the packages are compiled before it
    run_ghdl(
        TOP,
        [*hw("hf_pkg.vhd"), work / "hf_regs_pkg.vhd", netlist],
        tag,
        {},
        env={"HF_UB_GENERICS": f"{N},{DEPTH},{I_DELAY},{FANIN}"},
        test_module="test_hf_update_buffer",
        build_args=["-O0"],
    )
