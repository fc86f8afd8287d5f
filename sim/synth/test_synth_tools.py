"""The hardware tool flows of the generated sources (GHDL analysis and synthesis, yosys estimates, matcher
slices, encoder subtrees): the sim tier, where GHDL and yosys are installed (tests/unit keeps the pure parts)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypafilter import cli, netns
from hypafilter.analysis.plan import build_plan
from hypafilter.config import Config
from hypafilter.hw import synth, vhdl
from hypafilter.iptables.document import parse_policy
from hypafilter.ir import Box

from conftest import TEST_FULL, need_tool

pytestmark = pytest.mark.sim
ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = str(ROOT / "rulesets" / "example.rules")


def _plan(n: int) -> vhdl.HwPlan:
    """n entries, one destination port each."""
    entries = [vhdl.HwEntry((Box.full().with_field("dport", 100 + i, 100 + i),)) for i in range(n)]
    return vhdl.HwPlan(entries, [0] * (n + 1), [0] * (n + 1), "cd" * 32)


def test_rendered_slice_is_a_matcher_of_its_entries(tmp_path):
    need_tool("ghdl")
    plan = _plan(12)
    m = vhdl.matcher_source(plan)
    gen = synth.render_matcher_slice(plan, m, 4, 9, tmp_path / "gen", 256, 8)
    vhd = (gen / "hf_matcher.vhd").read_text()
    assert "entries 4..8" in vhd.splitlines()[0]
    assert "RES_WIDTH     : natural := 5;" in (gen / "hf_policy_pkg.vhd").read_text()
    v = synth.ghdl_part_verilog(gen, "hf_matcher", tmp_path / "v").read_text()
    assert "output [4:0] res" in v


@TEST_FULL  # make test-full
@pytest.mark.slow
def test_json_names_the_method_and_slices_add_up(tmp_path, capsys):
    need_tool("ghdl", "yosys")
    # no buffer slots: the matcher's methods are what this checks (the buffer: test_yosys_estimate_is_sane)
    args = [
        "synth",
        EXAMPLE,
        "--tool",
        "yosys",
        "--json",
        "--matcher-only",
        "--update-buffer",
        "0",
        "--out",
        str(tmp_path),
    ]
    assert cli.main([*args, "--slices", "0"]) == 0
    whole = json.loads(capsys.readouterr().out)
    assert whole["method"] == {"matcher": "whole", "encoder": "whole"}
    n = whole["entries"]
    assert n >= 3
    assert cli.main([*args, "--slices", str(n // 2)]) == 0
    sliced = json.loads(capsys.readouterr().out)
    how, mt = sliced["method"], sliced["matcher"]
    assert how["matcher"] == "slices" and how["encoder"] == "whole" and how["slice_entries"] == n // 2
    assert how["slices"] == len(mt["slices"]) >= 2 and "upper bound" in how["note"]
    assert [r["entries"] for r in mt["slices"]] == [list(r) for r in synth.slice_ranges(n, n // 2)]
    for key in ("LUT", "FF", "CARRY4"):
        assert mt[key] == sum(r[key] for r in mt["slices"])
    assert mt["max_lut_levels"] == max(r["max_lut_levels"] for r in mt["slices"])
    # the encoder does not depend on the matcher method; a slice repeats comparators, so it never saves FFs
    assert sliced["encoder"]["LUT"] == whole["encoder"]["LUT"]
    assert mt["FF"] >= whole["matcher"]["FF"] and mt["LUT"] > 0


@TEST_FULL  # make test-full
@pytest.mark.slow
def test_encoder_by_subtrees_is_close_to_the_whole_encoder(tmp_path):
    need_tool("ghdl", "yosys")
    gen = tmp_path / "gen"
    vhdl.render(_plan(1), gen)  # only hf_pkg and hf_prio_enc are read for the encoder
    n, idx_w = 100, 7  # fan-in 8: three stages; 64 + 36 inputs under the last one
    whole = synth.encoder_estimate(tmp_path / "w", gen, n, 8, idx_w, split=False)
    split = synth.encoder_estimate(tmp_path / "s", gen, n, 8, idx_w, split=True)
    assert whole["method"] == "whole" and split["method"] == "subtrees"
    assert [(t["inputs"], t["count"]) for t in split["subtrees"]] == [(36, 1), (64, 1)]
    assert split["LUT"] == sum(t["LUT"] * t["count"] for t in split["subtrees"]) + split["last_stage_bound"]["LUT"]
    # close to the whole encoder: on acl1_1100 1,588 vs 1,590 LUTs, equal FFs (yosys packs the whole encoder, whose
    # stages hold only their live groups, within a LUT or two of the sum of its subtrees, either side)
    assert 0.98 * whole["LUT"] - 2 <= split["LUT"] <= 1.25 * whole["LUT"] + 5
    assert whole["FF"] <= split["FF"] <= whole["FF"] + 8
    assert split["max_lut_levels"] >= whole["max_lut_levels"] - 1


def test_real_plan_renders_and_analyses(tmp_path):
    """The Plan of plan.build_plan (parsed from rulesets/example.rules) goes through render and GHDL analysis."""
    need_tool("ghdl")
    text = (ROOT / "rulesets" / "example.rules").read_text()
    policy = parse_policy(text, "example.rules", "FORWARD", Config())
    plan = build_plan(policy, Config())
    vhdl.render(plan, tmp_path / "gen")
    work = tmp_path / "work"
    work.mkdir()
    netns.run(["ghdl", "-a", "--std=08", f"--workdir={work}", *map(str, vhdl.sources(tmp_path / "gen"))], timeout=None)
    netns.run(
        ["ghdl", "-e", "--std=08", f"--workdir={work}", "-o", str(tmp_path / "core"), "hypafilter_core"],
        cwd=tmp_path,
        timeout=None,
    )


@pytest.mark.slow
def test_yosys_estimate_is_sane(capsys):
    need_tool("ghdl", "yosys")
    assert cli.main(["synth", EXAMPLE, "--tool", "yosys", "--json", "--matcher-only", "--update-buffer", "2"]) == 0
    est = json.loads(capsys.readouterr().out)
    buf = est["buffer"]  # hf_update_buffer alone, with the generics the core gives it
    assert est["update_buffer"] == buf["slots"] == 2 and buf["added_latency_cycles"] == 2
    assert buf["LUT"] > 0 and buf["FF"] > est["entries"] and 1 <= buf["max_lut_levels"] <= 6
    me = est["matcher_encoder"]
    assert est["entries"] > 0
    assert me["LUT"] > 0 and me["FF"] > 0 and 1 <= me["max_lut_levels"] <= 6
    assert me["pipeline_cycles"] >= 3
    assert est["matcher"]["deepest_stages"] and est["encoder"]["LUT"] > 0
