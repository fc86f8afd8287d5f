"""The sliced matcher estimate of `hypafilter synth`: slice ranges, slice sources, and the method in the JSON."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from hypafilter import cli
from hypafilter.errors import HypafilterError
from hypafilter.hw import synth, vhdl
from hypafilter.ir import Box

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = str(ROOT / "rulesets" / "example.rules")


def _plan(boxes_per_entry: list[list[Box]]) -> vhdl.HwPlan:
    n = len(boxes_per_entry)
    return vhdl.HwPlan([vhdl.HwEntry(tuple(b)) for b in boxes_per_entry], [0] * (n + 1), [0] * (n + 1), "ab" * 32)


def _box(i: int) -> Box:
    # a /24 source, a port range and a proto: comparators shared by some entries, not by others
    return (
        Box.full()
        .with_field("src", (10 << 24) | ((i % 5) << 8), (10 << 24) | ((i % 5) << 8) | 0xFF)
        .with_field("dport", 1000 + i % 3, 2000 + i % 7)
        .with_field("proto", 6, 6)
    )


def _expand(m: dict, expr: str) -> str:
    """An entry expression with box(j) and cmp(k) replaced by what they stand for (index-free)."""
    if m["box_stage"]:
        expr = re.sub(r"\bbox\((\d+)\)", lambda mo: "[" + m["boxes"][int(mo.group(1))] + "]", expr)
    return re.sub(r"\bcmp\((\d+)\)", lambda mo: "{" + m["comparators"][int(mo.group(1))] + "}", expr)


def test_slice_ranges_cover_every_entry_once():
    for n, size in ((1, 1), (10, 3), (1100, 275), (9809, 1024), (5, 8)):
        ranges = synth.slice_ranges(n, size)
        assert ranges[0][0] == 0 and ranges[-1][1] == n
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:], strict=False))
        sizes = [hi - lo for lo, hi in ranges]
        assert max(sizes) <= size and max(sizes) - min(sizes) <= 1
    assert len(synth.slice_ranges(9809, 1024)) == 10
    with pytest.raises(HypafilterError):
        synth.slice_ranges(10, 0)


def test_slice_size_default_and_explicit():
    assert synth.slice_size_for(1100, None) == 0 and synth.slice_size_for(9809, None) == 0
    assert synth.slice_size_for(9809, 0) == 0
    assert synth.slice_size_for(100, 100) == 0  # one slice is the whole matcher
    assert synth.slice_size_for(100, 30) == 30
    with pytest.raises(HypafilterError, match="--slices"):
        synth.slice_size_for(100, -1)


@pytest.mark.parametrize("boxes", [1, 6], ids=["flat", "box_stage"])
def test_slices_partition_the_matcher(boxes):
    plan = _plan([[_box(i + j) for j in range(boxes)] for i in range(23)])
    m = vhdl.matcher_source(plan)
    assert m["box_stage"] == (boxes > vhdl.BOX_STAGE_ABOVE)
    full = [_expand(m, e) for e in m["entries"]]
    joined = []
    for lo, hi in synth.slice_ranges(len(plan.entries), 5):
        s = synth.matcher_slice_source(m, lo, hi)
        assert s["box_stage"] == m["box_stage"] and s["match_latency"] == m["match_latency"]
        assert len(s["entries"]) == hi - lo and s["nboxes"] == len(s["boxes"])
        # exactly the comparators (and boxes) the slice's entries use, each once
        text = " ".join(s["entries"] + s["boxes"])
        used = {int(k) for k in re.findall(r"\bcmp\((\d+)\)", text)}
        assert used == set(range(len(s["comparators"])))
        assert len(set(s["comparators"])) == len(s["comparators"])
        if s["box_stage"]:
            used_boxes = {int(k) for k in re.findall(r"\bbox\((\d+)\)", " ".join(s["entries"]))}
            assert used_boxes == set(range(s["nboxes"])) and s["nboxes"] == (hi - lo) * boxes
        joined += [_expand(s, e) for e in s["entries"]]
    assert joined == full


def test_slice_of_everything_is_the_matcher():
    plan = _plan([[_box(i)] for i in range(9)])
    m = vhdl.matcher_source(plan)
    s = synth.matcher_slice_source(m, 0, 9)
    assert s == {k: m[k] for k in s}


def test_bad_slice_count_is_an_error(tmp_path, capsys):
    out = tmp_path / "build"
    assert cli.main(["synth", EXAMPLE, "--tool", "yosys", "--matcher-only", "--slices", "-2", "--out", str(out)]) != 0
    assert "--slices must be 0" in capsys.readouterr().err
    assert not out.exists()  # refused before anything was generated


def test_last_stage_bound():
    # 9,809 entries at fan-in 8: three 4,096-input subtrees (12 index bits each) under the last stage
    assert synth.top_stage_bound(3, 8, 4) == {"LUT": 12 + 2 + 1, "FF": 1 + 12 + 2, "max_lut_levels": 1}
    wide = synth.top_stage_bound(8, 8, 4)
    assert wide["LUT"] > synth.top_stage_bound(4, 8, 4)["LUT"] > 15 and wide["max_lut_levels"] == 4
    with pytest.raises(ValueError):
        synth.top_stage_bound(1, 8, 4)
