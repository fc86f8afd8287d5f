"""Synthesis estimates of the generated core (GHDL synth -> Verilog -> yosys synth_xilinx) and Vivado project Tcl."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

from . import hwgen
from .errors import HypafilterError

ROOT = Path(__file__).resolve().parents[2]
VIVADO_TEMPLATES = ROOT / "scripts" / "vivado"
XDC = ROOT / "constraints" / "nf_sume_hypafilter.xdc"
PART = "xc7vx690t-3-ffg1761"
LUTS = {f"LUT{i}" for i in range(1, 7)}
FFS = {"FDRE", "FDSE", "FDCE", "FDPE"}
SYNC_RAMS = {"RAMB18E1", "RAMB36E1"}


def _run(cmd: list[str], cwd: Path, what: str) -> str:
    r = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    if r.returncode != 0:
        raise HypafilterError(f"{what} failed ({' '.join(cmd[:3])} ...): {(r.stderr or r.stdout)[-2000:]}")
    return r.stdout


def _need(tool: str) -> None:
    if shutil.which(tool) is None:
        raise HypafilterError(f"'{tool}' is not installed (scripts/setup.sh sim installs it)")


def ghdl_verilog(
    plan,
    out_dir: Path,
    tdata_width: int = 256,
    fifo_bytes: int = 65536,
    encoder_fanin: int = 8,
    top: str = "hypafilter_core",
    generics: dict | None = None,
) -> Path:
    """Render the plan, analyse every source with GHDL and write the Verilog of `top` to out_dir/<top>.v."""
    _need("ghdl")
    out_dir = Path(out_dir).resolve()
    gen = out_dir / "gen"
    hwgen.render(plan, gen, tdata_width=tdata_width, encoder_fanin=encoder_fanin)
    work = out_dir / "work"
    work.mkdir(parents=True, exist_ok=True)
    _run(["ghdl", "-a", "--std=08", f"--workdir={work}", *map(str, hwgen.sources(gen))], out_dir, "GHDL analysis")
    if generics is None:
        generics = (
            {"C_S_AXIS_DATA_WIDTH": tdata_width, "C_FIFO_DEPTH_BYTES": fifo_bytes} if top == "hypafilter_core" else {}
        )
    gargs = [f"-g{k}={v}" for k, v in generics.items()]
    text = _run(
        ["ghdl", "--synth", "--std=08", f"--workdir={work}", *gargs, "--out=verilog", top], out_dir, "GHDL synthesis"
    )
    v = out_dir / f"{top}.v"
    v.write_text(text)
    return v


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


def estimate(
    plan, out_dir: Path, tdata_width: int = 256, encoder_fanin: int = 8, fifo_bytes: int = 65536, core: bool = True
) -> dict:
    """Estimates for matcher+encoder (the policy-specific part) and, when `core`, for the whole core."""
    from .hwgen import enc_stages, matcher_source  # noqa: PLC0415

    out_dir = Path(out_dir).resolve()
    n = len(plan.entries)
    res_w = max(n, 1)
    idx_w = max(1, (n).bit_length()) if n else 1
    result: dict = {
        "entries": n,
        "policy_hash": plan.policy_hash,
        "tdata_width": tdata_width,
        "encoder_fanin": encoder_fanin,
        "tool": "yosys synth_xilinx -family xc7 (GHDL synth -> Verilog)",
    }
    m_lat = matcher_source(plan)["match_latency"]
    e_lat = enc_stages(res_w, encoder_fanin)
    parts = {}
    mdir = out_dir / "matcher"
    v = ghdl_verilog(plan, mdir, tdata_width, fifo_bytes, encoder_fanin, top="hf_matcher")
    parts["matcher"] = yosys_estimate(v, "hf_matcher", mdir)
    edir = out_dir / "encoder"
    edir.mkdir(parents=True, exist_ok=True)
    v = ghdl_verilog(
        plan,
        edir,
        tdata_width,
        fifo_bytes,
        encoder_fanin,
        top="hf_prio_enc",
        generics={"N_IN": res_w, "FANIN": encoder_fanin, "IDX_W": idx_w},
    )
    parts["encoder"] = yosys_estimate(v, "hf_prio_enc", edir)
    me = {k: parts["matcher"][k] + parts["encoder"][k] for k in ("LUT", "FF", "CARRY4", "BRAM36", "BRAM18")}
    me["max_lut_levels"] = max(parts["matcher"]["max_lut_levels"], parts["encoder"]["max_lut_levels"])
    me["pipeline_cycles"] = m_lat + e_lat
    result["matcher_encoder"] = me
    result["matcher"] = parts["matcher"]
    result["encoder"] = parts["encoder"]
    if core:
        cdir = out_dir / "core"
        v = ghdl_verilog(plan, cdir, tdata_width, fifo_bytes, encoder_fanin)
        result["core"] = yosys_estimate(v, "hypafilter_core", cdir)
    for part in ("matcher", "encoder", "core"):
        if part in result:
            result[part].pop("cells", None)
    return result


def vivado_project(
    plan, out_dir: Path, tdata_width: int = 256, encoder_fanin: int = 8, fifo_bytes: int = 65536
) -> Path:
    """Write the sources and a Vivado batch Tcl script (synthesis + implementation + timing/utilisation reports)."""
    out_dir = Path(out_dir).resolve()
    gen = out_dir / "gen"
    hwgen.render(plan, gen, tdata_width=tdata_width, encoder_fanin=encoder_fanin)
    tmpl = (VIVADO_TEMPLATES / "hypafilter_core.tcl.in").read_text()
    files = "\n".join(f"  {{{p}}}" for p in hwgen.sources(gen))
    tcl = (
        tmpl.replace("@PART@", PART)
        .replace("@SOURCES@", files)
        .replace("@XDC@", str(XDC))
        .replace("@OUT@", str(out_dir))
        .replace("@WIDTH@", str(tdata_width))
        .replace("@FIFO@", str(fifo_bytes))
    )
    path = out_dir / "hypafilter_core.tcl"
    path.write_text(tcl)
    return path


def run_vivado(tcl: Path) -> int | None:
    """Run Vivado in batch mode on the script; None when Vivado is not on PATH."""
    if shutil.which("vivado") is None:
        return None
    r = subprocess.run(["vivado", "-mode", "batch", "-source", str(tcl)], cwd=tcl.parent, stdout=sys.stderr)
    return r.returncode
