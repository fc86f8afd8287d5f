"""Post-synthesis simulation of the set table: the GHDL-synthesised VHDL netlist under the RTL testbench (a header
every cycle, inserts, deletes, nomatch, uncertain, full table, read-back), for a hash:net and a hash:ip,port slot."""

from __future__ import annotations

import pytest
from hypafilter import netns
from hypafilter.hw import settable

from conftest import need_tool
from sim.hf_set_table.test_hf_set_table import GENERICS, SOURCES
from sim.hftb import fresh_build, hw, run_ghdl

TOP = "hf_set_table"
# a small table (filled up by the test); the NIC's default geometry ("hash:net", 1, 0, 16, 9, 8) passes too (43 s)
CASES = [("hash:net", 0, 0, 8, 3, 2)]


@pytest.mark.sim
@pytest.mark.parametrize("case", CASES, ids=["net_small"])
def test_set_table_postsynth(case):
    need_tool("ghdl")
    settype, *rest = case
    values = [settable.SETTYPES[settype], *rest]
    tag = "postsynth_" + "_".join(map(str, values))
    work = fresh_build(TOP, tag) / "synth"
    work.mkdir()
    gargs = [f"-g{k}={v}" for k, v in zip(GENERICS, values, strict=True)]
    argv = ["ghdl", "--synth", "--std=08", f"--workdir={work}", *gargs, "--out=vhdl", *map(str, hw(*SOURCES)),
            "-e", TOP]  # fmt: skip
    netlist = work / "set_table_synth.vhd"
    netlist.write_text(netns.run(argv, cwd=work, timeout=None))
    run_ghdl(
        TOP,
        [*hw("hf_pkg.vhd", "hf_set_pkg.vhd"), netlist],
        tag,
        {},
        env={"HF_ST_GENERICS": ",".join(map(str, values))},
        test_module="test_hf_set_table",
        build_args=["-O0"],
    )
