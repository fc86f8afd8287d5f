"""Post-synthesis simulation: the GHDL-synthesised VHDL netlist of the core under the core testbench's checks."""

from __future__ import annotations

import random
import re
from pathlib import Path

import pytest
from hypafilter import netns
from hypafilter.hw import model as hwmodel
from hypafilter.hw import vhdl

from conftest import TEST_FULL, need_tool
from sim.hftb import fresh_build, run_ghdl, save_obj
from sim.hftraffic import frames_for
from sim.hypafilter_core.test_hypafilter_core import mirror_some, random_policy

TOP = "hypafilter_core"
WIDTH = 256
COUNTS = (250, 80, 80, 50, 40, 60)  # frames per phase of core_traffic (the last: host mode)
MIN_ENTRIES_HIT = 12


def covering_plan():
    """The first random policy whose first-phase traffic reaches many entries with every kind of verdict.

    random_policy often puts a catch-all early, after which the traffic tests one entry only; a post-synthesis test
    that few packets pass through must still exercise most of the matcher, so the seed is chosen by coverage. Some
    entries have the mirror bit (ACTION bit 3), so every verdict kind includes Kind.MIRROR.
    """
    for seed in range(1, 200):
        plan = mirror_some(vhdl.minimal_plan(random_policy(random.Random(seed), 40)), random.Random(seed + 1000))
        regs = hwmodel.Regs.from_plan(plan)
        frames = frames_for(plan, random.Random(seed), COUNTS[0])
        hit, kinds = set(), set()
        for f, tuser in frames:
            d = hwmodel.decide(plan, f, (tuser >> 16) & 0xFF, regs)
            kinds.add(d.kind)
            if d.match_index is not None and d.match_index < len(plan.entries):
                hit.add(d.match_index)
        if len(hit) >= MIN_ENTRIES_HIT and kinds == set(hwmodel.Kind):
            return plan, seed
    raise AssertionError(f"no seed below 200 gives traffic that hits {MIN_ENTRIES_HIT} entries and every verdict kind")


def synth_netlist(plan, out: Path, width: int, generics: dict | None = None) -> list[Path]:
    """Render the plan, synthesise the top with GHDL; the VHDL netlist and the packages it names, in compile order.

    GHDL keeps the top entity's use clauses in the netlist, so the packages (declarations only) are compiled before
    it; every entity and architecture that simulates is the synthesised one.
    """
    gen, work = out / "gen", out / "work"
    work.mkdir(parents=True)
    vhdl.render(plan, gen, tdata_width=width)
    steps = (
        ["ghdl", "-a", "--std=08", f"--workdir={work}", *map(str, vhdl.sources(gen))],
        # the FIFO keeps its default depth (64 kB), as in the emulator's GHDL synthesis (emu/build.py)
        [
            "ghdl",
            "--synth",
            "--std=08",
            f"--workdir={work}",
            "--out=vhdl",
            f"-gC_S_AXIS_DATA_WIDTH={width}",
            *(f"-g{k}={v}" for k, v in (generics or {}).items()),
            TOP,
        ],
    )
    for argv in steps:
        text = netns.run(argv, cwd=out, timeout=None)
    netlist = out / "core_synth.vhd"
    netlist.write_text(text)
    packages = [s for s in vhdl.sources(gen) if not re.search(r"^\s*entity\s", s.read_text(), re.M | re.I)]
    assert packages, "no VHDL package among the sources"
    return [*packages, netlist]


@TEST_FULL  # make test-full
@pytest.mark.sim
def test_core_postsynth():
    """Synthesis must not change behaviour: the netlist gets the RTL's frame, TUSER, counter and power-on checks."""
    need_tool("ghdl")
    tag = f"postsynth_w{WIDTH}"
    out = fresh_build(TOP, tag)
    plan, seed = covering_plan()
    sources = synth_netlist(plan, out / "synth", WIDTH)
    rng = random.Random(seed)  # the first phase is the traffic covering_plan measured
    phases = [frames_for(plan, rng, c) for c in COUNTS]
    cfg = save_obj({"plan": plan, "phases": phases, "seed": seed, "rate_frames": []}, out / "cfg.pkl")
    # the generics are fixed in the netlist, so none are passed; each cocotb test needs a simulation of its own
    # because core_power_on checks the state the netlist's initial values give, before any reset
    for testcase in ("core_traffic", "core_power_on"):
        run_ghdl(
            TOP,
            sources,
            f"{tag}_{testcase}",
            {},
            env={"HF_TB_CFG": str(cfg), "HF_TB_OUT": str(out / "unused.txt")},
            testcase=testcase,
        )
