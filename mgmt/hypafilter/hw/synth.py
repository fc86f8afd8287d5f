"""Synthesis estimates of the generated core (GHDL synth -> Verilog -> yosys synth_xilinx) and Vivado project Tcl."""

from __future__ import annotations

import json
import re
import shutil
import time
from collections import defaultdict
from pathlib import Path

from hypafilter import netns
from hypafilter.errors import HypafilterError
from hypafilter.hw import vhdl
from hypafilter.paths import HW_DIR, ROOT

VIVADO_TEMPLATES = ROOT / "scripts" / "vivado"
XDC = ROOT / "constraints" / "nf_sume_hypafilter.xdc"
PART = "xc7vx690t-3-ffg1761"
LUTS = {f"LUT{i}" for i in range(1, 7)}
FFS = {"FDRE", "FDSE", "FDCE", "FDPE"}
SYNC_RAMS = {"RAMB18E1", "RAMB36E1"}
# The matcher is synthesised whole unless slices are asked for: at 9,809 entries (acl1_10k) yosys 0.23 needs about
# 390 s of CPU for it; ten slices took about twice as long in all and only bound it, loosely (+56 % LUTs on
# acl1_1100 in four slices: comparators shared across slices are repeated in each).
# The encoder is synthesised whole while its padded tree is at most this wide (the 1,100-entry sets: 4,096).
# GHDL writes every stage as a register of WIDE x IDX_W bits, and yosys 0.23's proc_dff did not get through the
# five 458,752-bit registers of the 9,809-entry encoder in 15 minutes; wider trees are estimated by subtrees.
ENC_WHOLE_WIDE = 4096
# Sources each estimated part needs (packages first); the rest of the core is not analysed for it.
_PART_SOURCES = {
    "hf_matcher": ("hf_regs_pkg.vhd", "hf_policy_pkg.vhd", "hf_pkg.vhd", "hf_matcher.vhd"),
    "hf_prio_enc": ("hf_pkg.vhd", "hf_prio_enc.vhd"),
    "hf_update_buffer": (
        "hf_regs_pkg.vhd",
        "hf_pkg.vhd",
        "hf_ram.vhd",
        "hf_prio_enc.vhd",
        "hf_update_buffer_shell.vhd",
        "hf_update_buffer.vhd",
    ),
}
FLOW_CACHE_SOURCES = ("hf_pkg.vhd", "hf_ram.vhd", "hf_flow_cache.vhd")
CT_MEMBER_SOURCES = ("hf_pkg.vhd", "hf_ram.vhd", "hf_ct_member.vhd")


def _run(cmd: list[str], cwd: Path, what: str) -> str:
    """stdout of a synthesis tool; like every build, it may run for minutes, so no time limit."""
    try:
        return netns.run(cmd, cwd=cwd, timeout=None)
    except netns.CommandError as e:
        raise HypafilterError(f"{what} failed: {e}") from e


def _need(tool: str) -> None:
    if shutil.which(tool) is None:
        raise HypafilterError(f"'{tool}' is not installed (scripts/setup.sh sim installs it)")


def render_build(plan, out_dir: Path, tdata_width: int, encoder_fanin: int, plan6=None) -> tuple[Path, Path]:
    """Render the plan's sources (a dual-stack core's with `plan6`) into out_dir/gen; (out_dir resolved, gen), the
    folders every flow here builds in."""
    out_dir = Path(out_dir).resolve()
    gen = out_dir / "gen"
    vhdl.render(plan, gen, tdata_width=tdata_width, encoder_fanin=encoder_fanin, plan6=plan6)
    return out_dir, gen


def flow_cache_generics(flow_cache: tuple[int, int] | None) -> dict[str, int]:
    """hypafilter_core generics of a flow cache (LOG2_SETS, WAYS), or of none."""
    if flow_cache is None:
        return {"FC_LOG2_SETS": 0}
    return {"FC_LOG2_SETS": flow_cache[0], "FC_WAYS": flow_cache[1]}


def ghdl_verilog(
    plan,
    out_dir: Path,
    tdata_width: int = 256,
    fifo_bytes: int = 65536,
    encoder_fanin: int = 8,
    flow_cache: tuple[int, int] | None = None,
    plan6=None,
) -> Path:
    """Render the plan, analyse every source with GHDL and write the Verilog of hypafilter_core to out_dir
    (with a flow cache of (LOG2_SETS, WAYS) inside when `flow_cache` is given; dual stack with `plan6`)."""
    _need("ghdl")
    out_dir, gen = render_build(plan, out_dir, tdata_width, encoder_fanin, plan6)
    work = out_dir / "work"
    work.mkdir(parents=True, exist_ok=True)
    _run(["ghdl", "-a", "--std=08", f"--workdir={work}", *map(str, vhdl.sources(gen))], out_dir, "GHDL analysis")
    top = "hypafilter_core"
    gargs = [f"-gC_S_AXIS_DATA_WIDTH={tdata_width}", f"-gC_FIFO_DEPTH_BYTES={fifo_bytes}"]
    gargs += [f"-g{k}={v}" for k, v in flow_cache_generics(flow_cache).items()]
    text = _run(
        ["ghdl", "--synth", "--std=08", f"--workdir={work}", *gargs, "--out=verilog", top], out_dir, "GHDL synthesis"
    )
    v = out_dir / f"{top}.v"
    v.write_text(text)
    return v


def ghdl_part_verilog(gen: Path, top: str, out_dir: Path, generics: dict | None = None) -> Path:
    """Verilog of the matcher or the encoder from a rendered build folder `gen`, written to out_dir/<top>.v.

    GHDL synthesises from the few files the part needs, without analysing (and code-generating) the rest of the
    core: the netlist is the one ghdl_verilog gives, in seconds instead of a minute at 10k entries.
    """
    _need("ghdl")
    out_dir = Path(out_dir).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    files = [str(f) for f in vhdl.sources(gen) if f.name in _PART_SOURCES[top]]
    gargs = [f"-g{k}={v}" for k, v in (generics or {}).items()]
    text = _run(
        ["ghdl", "--synth", "--std=08", f"--workdir={out_dir}", *gargs, "--out=verilog", *files, "-e", top],
        out_dir,
        "GHDL synthesis",
    )
    v = out_dir / f"{top}.v"
    v.write_text(text)
    return v


def slice_ranges(n: int, size: int) -> list[tuple[int, int]]:
    """[lo, hi) entry ranges of at most `size` entries covering 0..n, as even as possible."""
    if size < 1:
        raise HypafilterError("slice size must be at least 1")
    count = max(1, -(-n // size))
    bounds = [n * i // count for i in range(count + 1)]
    return list(zip(bounds, bounds[1:], strict=False))


def _renumber(texts: list[str], name: str) -> tuple[list[int], list[str]]:
    """The indices of `name(i)` referenced in texts (ascending) and the texts with them renumbered 0, 1, ..."""
    pat = re.compile(rf"\b{name}\((\d+)\)")
    used = sorted({int(i) for t in texts for i in pat.findall(t)})
    new = {old: k for k, old in enumerate(used)}
    return used, [pat.sub(lambda mo: f"{name}({new[int(mo.group(1))]})", t) for t in texts]


def matcher_slice_source(m: dict, lo: int, hi: int) -> dict:
    """Template variables of a matcher holding entries lo..hi-1 of the matcher `m` (vhdl.matcher_source).

    The slice keeps the whole matcher's shape (box stage, latency) and exactly the comparators and boxes its
    entries use, so the slices of a matcher together hold every match unit once and every comparator at least once.
    """
    entries = m["entries"][lo:hi]
    boxes: list[str] = []
    if m["box_stage"]:
        box_ids, entries = _renumber(entries, "box")
        boxes = [m["boxes"][j] for j in box_ids]
    cmp_ids, texts = _renumber(entries + boxes, "cmp")
    return {
        "comparators": [m["comparators"][k] for k in cmp_ids],
        "entries": texts[: len(entries)],
        "rows": [(i, e, i, "valid") for i, e in enumerate(texts[: len(entries)])],
        "boxes": texts[len(entries) :],
        "nboxes": len(boxes),
        "box_stage": m["box_stage"],
        "match_latency": m["match_latency"],
    }


def render_matcher_slice(plan, m: dict, lo: int, hi: int, gen: Path, tdata_width: int, encoder_fanin: int) -> Path:
    """Render a build folder whose hf_matcher holds entries lo..hi-1 only (packages sized for hi - lo entries)."""
    k = hi - lo
    default = int(plan.actions[-1])
    sub = vhdl.HwPlan(list(plan.entries[lo:hi]), [0] * (k + 1), [default] * (k + 1), plan.policy_hash)
    vhdl.render(sub, gen, tdata_width=tdata_width, encoder_fanin=encoder_fanin)
    origin = f"policy {plan.policy_hash}, entries {lo}..{hi - 1} (synthesis estimate slice)"
    env_vars = {"origin": origin, "n": k, "res_width": vhdl.res_width(k)}
    text = vhdl.template_env().get_template("hf_matcher.vhd.j2").render({**env_vars, **matcher_slice_source(m, lo, hi)})
    (Path(gen) / "hf_matcher.vhd").write_text(text)
    return Path(gen)


def _stat_counts(cells: dict) -> dict[str, int]:
    kinds: dict[str, int] = defaultdict(int)
    for c in cells.values():
        kinds[c["type"]] += 1
    return dict(kinds)


def _lut_depths(module: dict) -> dict[str, int]:
    """Deepest chain of LUTs ending at each register (grouped by the register's signal name), register to register.

    FFs and block RAMs (registered reads) cut paths; CARRY4 and MUXF7/8 pass depth through without adding a level.
    """
    cells = module["cells"]
    driver: dict[int, tuple[str, dict]] = {}
    for name, c in cells.items():
        for port, bits in c["connections"].items():
            if c.get("port_directions", {}).get(port) == "output":
                for b in bits:
                    if isinstance(b, int):
                        driver[b] = (name, c)
    names: dict[int, str] = {}
    for nname, n in module["netnames"].items():
        if n.get("hide_name"):
            continue
        for b in n["bits"]:
            if isinstance(b, int) and (b not in names or len(nname) < len(names[b])):
                names[b] = nname
    memo: dict[int, int] = {}

    def depth(bit) -> int:
        if not isinstance(bit, int):
            return 0
        stack = [bit]
        while stack:
            b = stack[-1]
            if b in memo:
                stack.pop()
                continue
            d = driver.get(b)
            if d is None or d[1]["type"] in FFS or d[1]["type"] in SYNC_RAMS:
                memo[b] = 0
                stack.pop()
                continue
            c = d[1]
            ins = [
                x
                for p, bits in c["connections"].items()
                if c["port_directions"].get(p) == "input"
                for x in bits
                if isinstance(x, int)
            ]
            todo = [x for x in ins if x not in memo]
            if todo:
                stack.extend(todo)
                continue
            memo[b] = max((memo[x] for x in ins), default=0) + (1 if c["type"] in LUTS else 0)
            stack.pop()
        return memo[bit]

    stages: dict[str, int] = defaultdict(int)
    for c in cells.values():
        if c["type"] in FFS or c["type"] in SYNC_RAMS:
            qs = [b for p, bits in c["connections"].items() if c["port_directions"].get(p) == "output" for b in bits]
            label = names.get(qs[0], "?") if qs else "?"
            label = re.sub(r"\[\d+\]$", "", label.lstrip("\\"))
            d = max(
                (
                    depth(b)
                    for p, bits in c["connections"].items()
                    if c["port_directions"].get(p) == "input" and p not in ("C", "CLKARDCLK", "CLKBWRCLK")
                    for b in bits
                ),
                default=0,
            )
            stages[label] = max(stages[label], d)
    return dict(stages)


def yosys_estimate(verilog: Path, top: str, work: Path) -> dict:
    """yosys synth_xilinx -family xc7 on one Verilog file: cell counts and LUT depth per register group."""
    _need("yosys")
    net = work / f"{top}.json"
    script = f"read_verilog {verilog}; synth_xilinx -family xc7 -top {top} -flatten; write_json {net}"
    _run(["yosys", "-q", "-p", script], work, "yosys")
    module = json.loads(net.read_text())["modules"][top]
    kinds = _stat_counts(module["cells"])
    stages = _lut_depths(module)
    luts = sum(v for k, v in kinds.items() if k in LUTS)
    lutram = sum(v for k, v in kinds.items() if k.startswith("RAM") and k not in SYNC_RAMS)
    deepest = sorted(stages.items(), key=lambda kv: -kv[1])[:8]
    return {
        "LUT": luts,
        "LUTRAM_cells": lutram,
        "FF": sum(v for k, v in kinds.items() if k in FFS),
        "CARRY4": kinds.get("CARRY4", 0),
        "BRAM36": kinds.get("RAMB36E1", 0),
        "BRAM18": kinds.get("RAMB18E1", 0),
        "MUXF7_8": kinds.get("MUXF7", 0) + kinds.get("MUXF8", 0),
        "max_lut_levels": max(stages.values(), default=0),
        "deepest_stages": dict(deepest),
        "cells": kinds,
    }


def flow_cache_estimate(out_dir: Path, log2_sets: int, ways: int, ts_w: int = 32, v6: bool = False) -> dict:
    """The flow cache alone (static hw/hf_flow_cache.vhd, no policy): GHDL synth -> Verilog -> yosys synth_xilinx;
    `v6`: with IPv6 tuples (a dual-stack core's cache, 304-bit keys)."""
    _need("ghdl")
    out_dir = Path(out_dir).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    gargs = [f"-gLOG2_SETS={log2_sets}", f"-gWAYS={ways}", f"-gTS_W={ts_w}", *(["-gV6=true"] if v6 else [])]
    files = [str(HW_DIR / n) for n in FLOW_CACHE_SOURCES]
    cmd = [
        "ghdl",
        "--synth",
        "--std=08",
        f"--workdir={out_dir}",
        *gargs,
        "--out=verilog",
        *files,
        "-e",
        "hf_flow_cache",
    ]
    v = out_dir / "hf_flow_cache.v"
    v.write_text(_run(cmd, out_dir, "GHDL synthesis"))
    t0 = time.monotonic()
    est = yosys_estimate(v, "hf_flow_cache", out_dir)
    est.update(entries=ways << log2_sets, log2_sets=log2_sets, ways=ways, ts_w=ts_w, v6=v6)
    est["yosys_seconds"] = round(time.monotonic() - t0, 1)
    return est


SET_TABLE_SOURCES = ("hf_pkg.vhd", "hf_set_pkg.vhd", "hf_ram.vhd", "hf_set_table.vhd")


def set_table_estimate(out_dir: Path, settype: str = "hash:net", geom=None, v6: bool = False) -> dict:
    """One set slot's table alone (static hw/hf_set_table.vhd, issue #24): GHDL synth -> Verilog -> yosys
    synth_xilinx. geom: hw.settable.Geometry (default: the NIC's); v6: an IPv6 slot's (128-bit keys)."""
    from hypafilter.hw import settable

    _need("ghdl")
    geom = geom or settable.DEFAULT_GEOMETRY
    out_dir = Path(out_dir).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    generics: dict = settable.slot_generics(settype, ("src", "dst"), geom)
    if v6:
        generics["V6"] = "true"
    files = [str(HW_DIR / n) for n in SET_TABLE_SOURCES]
    cmd = ["ghdl", "--synth", "--std=08", f"--workdir={out_dir}", *(f"-g{k}={v}" for k, v in generics.items()),
           "--out=verilog", *files, "-e", "hf_set_table"]  # fmt: skip
    v = out_dir / "hf_set_table.v"
    v.write_text(_run(cmd, out_dir, "GHDL synthesis"))
    t0 = time.monotonic()
    est = yosys_estimate(v, "hf_set_table", out_dir)
    est.update(settype=settype, banks=geom.banks, log2_buckets=geom.log2_buckets, ways=geom.ways,
               elements=geom.capacity, element_bits=settable.elem_bits(settype, v6), v6=v6)  # fmt: skip
    est["yosys_seconds"] = round(time.monotonic() - t0, 1)
    est.pop("cells", None)
    return est


def ct_member_estimate(out_dir: Path, log2: int, egress_log2: int, v6: bool = False) -> dict:
    """The conntrack membership structure alone (hw/hf_ct_member.vhd): GHDL synth -> Verilog -> yosys synth_xilinx;
    `v6`: a dual-stack core's (IPv6 keys, generic V6)."""
    _need("ghdl")
    out_dir = Path(out_dir).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    files = [str(HW_DIR / n) for n in CT_MEMBER_SOURCES]
    cmd = ["ghdl", "--synth", "--std=08", f"--workdir={out_dir}", f"-gLOG2={log2}", f"-gEGRESS_LOG2={egress_log2}"]
    cmd += [f"-gV6={'true' if v6 else 'false'}", "--out=verilog", *files, "-e", "hf_ct_member"]
    v = out_dir / "hf_ct_member.v"
    v.write_text(_run(cmd, out_dir, "GHDL synthesis"))
    t0 = time.monotonic()
    est = yosys_estimate(v, "hf_ct_member", out_dir)
    est.update(log2=log2, egress_log2=egress_log2, counter_bits=4 * 4 << log2, stamp_bits=32 << egress_log2, v6=v6)
    est["yosys_seconds"] = round(time.monotonic() - t0, 1)
    return est


_SUMMED = ("LUT", "LUTRAM_cells", "FF", "CARRY4", "BRAM36", "BRAM18", "MUXF7_8")


def _sum_estimates(parts: list[dict]) -> dict:
    """Resources of several separately synthesised netlists: counts add up, LUT depth is the deepest of any."""
    total: dict = {k: sum(p[k] for p in parts) for k in _SUMMED}
    total["max_lut_levels"] = max((p["max_lut_levels"] for p in parts), default=0)
    stages: dict[str, int] = {}
    for p in parts:
        for label, d in p["deepest_stages"].items():
            stages[label] = max(stages.get(label, 0), d)
    total["deepest_stages"] = dict(sorted(stages.items(), key=lambda kv: -kv[1])[:8])
    cells: dict[str, int] = defaultdict(int)
    for p in parts:
        for kind, c in p.get("cells", {}).items():
            cells[kind] += c
    total["cells"] = dict(cells)
    return total


def slice_size_for(n: int, slices: int | None) -> int:
    """Entries per matcher slice: `slices` when given, 0 (the whole matcher) when not or when one slice holds all."""
    if slices is None:
        return 0
    if slices < 0:
        raise HypafilterError(f"--slices must be 0 (whole matcher) or a number of entries, not {slices}")
    return 0 if slices >= n else slices


def matcher_estimate(plan, out_dir: Path, gen: Path, tdata_width: int, encoder_fanin: int, size: int) -> dict:
    """yosys estimate of the matcher: the whole matcher when size == 0, else the sum over slices of `size` entries."""
    t0 = time.monotonic()
    n = len(plan.entries)
    mdir = Path(out_dir) / "matcher"
    if size == 0:
        est = yosys_estimate(ghdl_part_verilog(gen, "hf_matcher", mdir), "hf_matcher", mdir)
        est["method"] = "whole"
    else:
        m = vhdl.matcher_source(plan)
        parts, rows = [], []
        for i, (lo, hi) in enumerate(slice_ranges(n, size)):
            t1 = time.monotonic()
            sdir = mdir / f"slice{i:03d}"
            sgen = render_matcher_slice(plan, m, lo, hi, sdir / "gen", tdata_width, encoder_fanin)
            e = yosys_estimate(ghdl_part_verilog(sgen, "hf_matcher", sdir), "hf_matcher", sdir)
            parts.append(e)
            rows.append({"entries": [lo, hi], **_row(e), "seconds": round(time.monotonic() - t1, 1)})
        est = _sum_estimates(parts)
        est["method"] = "slices"
        est["slice_entries"] = size
        est["slices"] = rows
    est["seconds"] = round(time.monotonic() - t0, 1)
    return est


def _clog2(x: int) -> int:
    return max(0, (x - 1).bit_length())


def top_stage_bound(groups: int, fanin: int, sub_stages: int) -> dict:
    """Upper bound of the last encoder stage, which picks the first valid of `groups` (valid, index) pairs.

    Every index bit below the group number is a priority mux: a LUT6 takes three (valid, bit) pairs, each further
    LUT6 takes the previous result, "one of the earlier groups was valid" (one LUT per step, shared by all bits)
    and two more pairs. The group-number bits and `any` are functions of the valid bits alone (one LUT6 up to six
    groups, three LUTs up to eleven, as wide as FANIN goes at 8).
    """
    if not 2 <= groups <= fanin:
        raise ValueError("the top stage combines 2..FANIN groups")
    low = _clog2(fanin) * sub_stages  # index bits coming from the subtrees
    high = _clog2(groups)  # bits of the group number (the rest are constant 0)
    chain = 1 if groups <= 3 else 1 + -(-(groups - 3) // 2)
    per_valid = 1 if groups <= 6 else 3
    return {
        "LUT": low * chain + (chain - 1) + high * per_valid + per_valid,
        "FF": 1 + low + high,
        "max_lut_levels": max(chain, 1 if groups <= 6 else 2),
    }


def encoder_estimate(out_dir: Path, gen: Path, n_in: int, fanin: int, idx_w: int, split: bool | None = None) -> dict:
    """yosys estimate of the priority encoder: whole, or (split, default when wider than ENC_WHOLE_WIDE) the sum of
    the subtrees under the last stage, each a real hf_prio_enc, plus an upper bound of the last stage."""
    t0 = time.monotonic()
    edir = Path(out_dir) / "encoder"
    stages = vhdl.enc_stages(n_in, fanin)
    if split is None:
        split = fanin**stages > ENC_WHOLE_WIDE
    if not split or stages < 2:
        v = ghdl_part_verilog(gen, "hf_prio_enc", edir, vhdl.encoder_generics(n_in, fanin, idx_w))
        est = yosys_estimate(v, "hf_prio_enc", edir)
        est["method"] = "whole"
        est["seconds"] = round(time.monotonic() - t0, 1)
        return est
    sub = fanin ** (stages - 1)
    full, rest = divmod(n_in, sub)
    # a short last subtree still runs through stages - 1 stages in the real tree: give it enough inputs to get them
    # (the extra inputs are live ports here, constant 0 in the core, so this can only overestimate)
    sizes = [sub] * full + ([max(rest, fanin ** (stages - 2) + 1)] if rest else [])
    done: dict[int, dict] = {}
    for size in sorted(set(sizes)):
        sdir = edir / f"subtree{size}"
        v = ghdl_part_verilog(gen, "hf_prio_enc", sdir, vhdl.encoder_generics(size, fanin, idx_w))
        done[size] = yosys_estimate(v, "hf_prio_enc", sdir)
    top = top_stage_bound(len(sizes), fanin, stages - 1)
    top_part = {k: 0 for k in _SUMMED} | {
        "LUT": top["LUT"],
        "FF": top["FF"],
        "max_lut_levels": top["max_lut_levels"],
        "deepest_stages": {"last stage (bound)": top["max_lut_levels"]},
    }
    est = _sum_estimates([done[size] for size in sizes] + [top_part])
    est["method"] = "subtrees"
    est["subtrees"] = [{"inputs": size, "count": sizes.count(size), **_row(done[size])} for size in sorted(done)]
    est["last_stage_bound"] = {"groups": len(sizes), **top}
    est["seconds"] = round(time.monotonic() - t0, 1)
    return est


def shape(plan, plan6=None) -> tuple[int, int]:
    """(result vector width, index bits) of the core generated for `plan` (and `plan6`, dual stack): the encoder's
    N_IN and IDX_W, as vhdl.render sizes them."""
    n, depth = len(plan.entries), vhdl.buffer_depth(plan)
    if plan6 is None:
        return vhdl.res_width(n), vhdl.idx_width(n, depth)
    n6 = len(plan6.entries)
    return (vhdl.v6_base(plan) + n6 if n6 else vhdl.res_width(n)), vhdl.idx_width(n + n6 + 1, depth)


def buffer_generics(plan, encoder_fanin: int, plan6=None) -> dict[str, int]:
    """hf_update_buffer's generics in the core generated for `plan` (its I_DELAY: matcher and encoder stages)."""
    n, depth = len(plan.entries), vhdl.buffer_depth(plan)
    res_w, idx_w = shape(plan, plan6)
    return {
        "N_STATIC": n,
        "DEPTH": depth,
        "IDX_W": idx_w,
        "I_DELAY": vhdl.matcher_source(plan, plan6)["match_latency"] + vhdl.enc_stages(res_w, encoder_fanin),
        "FANIN": vhdl.BUF_FANIN,
        "STAGES": vhdl.buffer_stages(depth),
    }


def buffer_estimate(plan, out_dir: Path, gen: Path, encoder_fanin: int, plan6=None) -> dict:
    """yosys estimate of the update buffer as the core instantiates it for `plan` (valid mask over its entries,
    Config.update_buffer slots, the slot encoder, the VALID/BUF register access), and the cycles it adds."""
    t0 = time.monotonic()
    g = buffer_generics(plan, encoder_fanin, plan6)
    bdir = Path(out_dir) / "update_buffer"
    est = yosys_estimate(ghdl_part_verilog(gen, "hf_update_buffer", bdir, g), "hf_update_buffer", bdir)
    est["slots"] = g["DEPTH"]
    est["added_latency_cycles"] = vhdl.buffer_latency(g["DEPTH"])
    est["seconds"] = round(time.monotonic() - t0, 1)
    return est


def _row(e: dict) -> dict:
    return {k: e[k] for k in ("LUT", "FF", "CARRY4", "max_lut_levels")}


def estimate(
    plan,
    out_dir: Path,
    tdata_width: int = 256,
    encoder_fanin: int = 8,
    fifo_bytes: int = 65536,
    core: bool = True,
    slices: int | None = None,
    encoder_split: bool | None = None,
    flow_cache: tuple[int, int] | None = None,
    plan6=None,
) -> dict:
    """Estimates for matcher+encoder (the policy-specific part) and, when `core`, for the whole core.
    plan6: the IPv6 side of a dual-stack core (docs/ipv6.md "The NIC's core"); its matcher is synthesised whole.

    slices: entries per matcher slice (see slice_size_for). A sliced estimate is the sum of the slices, an upper
    bound of the whole matcher: comparators that entries of different slices share are counted in each slice.
    encoder_split: estimate the encoder by subtrees (True), whole (False) or by its width (None; encoder_estimate).
    flow_cache: (LOG2_SETS, WAYS) of a flow cache inside the whole core (its estimate only).
    """
    n = len(plan.entries)
    res_w, idx_w = shape(plan, plan6)
    size = slice_size_for(n, slices)
    if size and plan6 is not None:
        raise HypafilterError("a dual-stack matcher is estimated whole (--slices is for IPv4-only plans)")
    method: dict = {"matcher": "slices" if size else "whole", "encoder": "whole"}
    if size:
        method["slice_entries"] = size
        method["slices"] = len(slice_ranges(n, size))
        method["note"] = (
            "matcher = sum of separately synthesised slices: an upper bound (comparators shared by entries of "
            "different slices are counted once per slice); LUT levels = deepest slice"
        )
    result: dict = {
        "entries": n,
        **({"entries_ipv6": len(plan6.entries)} if plan6 is not None else {}),
        "policy_hash": plan.policy_hash,
        "tdata_width": tdata_width,
        "encoder_fanin": encoder_fanin,
        "update_buffer": vhdl.buffer_depth(plan),
        "tool": "yosys synth_xilinx -family xc7 (GHDL synth -> Verilog)",
        "method": method,
    }
    m_lat = vhdl.matcher_source(plan, plan6)["match_latency"]
    e_lat = vhdl.enc_stages(res_w, encoder_fanin)
    out_dir, gen = render_build(plan, out_dir, tdata_width, encoder_fanin, plan6)
    parts = {"matcher": matcher_estimate(plan, out_dir, gen, tdata_width, encoder_fanin, size)}
    parts["encoder"] = encoder_estimate(out_dir, gen, res_w, encoder_fanin, idx_w, encoder_split)
    method["encoder"] = parts["encoder"]["method"]
    if method["encoder"] == "subtrees":
        method["encoder_note"] = (
            "encoder = sum of the synthesised subtrees under its last stage (each a real hf_prio_enc) plus an "
            "upper bound of the last stage (last_stage_bound), not a synthesis result"
        )
    me = {k: parts["matcher"][k] + parts["encoder"][k] for k in ("LUT", "FF", "CARRY4", "BRAM36", "BRAM18")}
    me["max_lut_levels"] = max(parts["matcher"]["max_lut_levels"], parts["encoder"]["max_lut_levels"])
    me["pipeline_cycles"] = m_lat + e_lat
    result["matcher_encoder"] = me
    result["matcher"] = parts["matcher"]
    result["encoder"] = parts["encoder"]
    result["buffer"] = buffer_estimate(plan, out_dir, gen, encoder_fanin, plan6)
    if core:
        t0 = time.monotonic()
        cdir = out_dir / "core"
        v = ghdl_verilog(plan, cdir, tdata_width, fifo_bytes, encoder_fanin, flow_cache, plan6)
        result["core"] = yosys_estimate(v, "hypafilter_core", cdir)
        if flow_cache is not None:
            result["core"]["flow_cache"] = {
                "log2_sets": flow_cache[0],
                "ways": flow_cache[1],
                "entries": flow_cache[1] << flow_cache[0],
            }
        result["core"]["seconds"] = round(time.monotonic() - t0, 1)
    for part in ("matcher", "encoder", "buffer", "core"):
        if part in result:
            result[part].pop("cells", None)
    return result


# The policy sync lease's tick on the board: 1 ms of the datapath clock the XDC constrains (axis_aclk, 5 ns: 200 MHz;
# a 160 MHz build, SUME release 1.8, takes 160,000). The host writes LEASE in milliseconds (hw/regmap.txt).
SUME_LEASE_TICK_CYCLES = 200_000


def vivado_project(
    plan,
    out_dir: Path,
    tdata_width: int = 256,
    encoder_fanin: int = 8,
    fifo_bytes: int = 65536,
    flow_cache: tuple[int, int] | None = None,
) -> Path:
    """Write the sources and a Vivado batch Tcl script (synthesis + implementation + timing/utilisation reports)."""
    out_dir, gen = render_build(plan, out_dir, tdata_width, encoder_fanin)
    tmpl = (VIVADO_TEMPLATES / "hypafilter_core.tcl.in").read_text()
    fcg = flow_cache_generics(flow_cache)
    files = "\n".join(f"  {{{p}}}" for p in vhdl.sources(gen))
    tcl = (
        tmpl.replace("@PART@", PART)
        .replace("@SOURCES@", files)
        .replace("@XDC@", str(XDC))
        .replace("@OUT@", str(out_dir))
        .replace("@WIDTH@", str(tdata_width))
        .replace("@FIFO@", str(fifo_bytes))
        .replace("@FC_LOG2_SETS@", str(fcg["FC_LOG2_SETS"]))
        .replace("@FC_WAYS@", str(fcg.get("FC_WAYS", 4)))
        .replace("@LEASE_TICK_CYCLES@", str(SUME_LEASE_TICK_CYCLES))
    )
    path = out_dir / "hypafilter_core.tcl"
    path.write_text(tcl)
    return path


def run_vivado(tcl: Path) -> int | None:
    """Run Vivado in batch mode on the script; None when Vivado is not on PATH."""
    if shutil.which("vivado") is None:
        return None
    try:
        netns.run(["vivado", "-mode", "batch", "-source", str(tcl)], cwd=tcl.parent, timeout=None, echo=True)
    except netns.CommandError as e:
        return e.returncode
    return 0
