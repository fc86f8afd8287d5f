"""Builds hf_emu for a plan: vhdl.render → GHDL synth to Verilog → Verilator + driver/emu, cached by content hash."""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import sys
import time
from pathlib import Path

from hypafilter import netns
from hypafilter.errors import HypafilterError
from hypafilter.hw import vhdl
from hypafilter.paths import ROOT

HARNESS_DIR = ROOT / "driver" / "emu"
HARNESS_FILES = (
    HARNESS_DIR / "hf_emu.cpp",
    HARNESS_DIR / "hf_emu.vlt",
    HARNESS_DIR / "Makefile",
    HARNESS_DIR / "model.mk",
    ROOT / "driver" / "hypafilter_shared.h",
)
TOP = "hypafilter_core"
# The emulator's flow-cache timestamp tick, in cycles of its clock (FC_TICK_CYCLES). The emulated clock runs only
# while the emulator works (frames queued or in flight, register accesses, then --settle idle cycles), so FC_NOW
# and the last-seen times count ticks of that work, not wall time (docs/emulator.md).
EMU_TICK_CYCLES = 256
# The policy sync lease counts milliseconds of wall time, not of that work: the core takes its ticks from the
# lease_ticks input (LEASE_TICK_CYCLES = 0), which the harness drives from CLOCK_MONOTONIC (docs/emulator.md).
EMU_LEASE_GENERICS = {"LEASE_TICK_CYCLES": 0}
# [ctm] The conntrack membership structure beside the flow cache (hw/hf_ct_member.vhd): 4 banks of 2**16 counters
# (a false-positive rate under 1e-7 at 1,000 conntrack tuples, 16 % at 65,536; docs/flowsync.md "New flows on the
# NIC") and 65,536 recent-egress stamps (few collide with the keys of the frames the host sent in the last 2 s).
# HF_EMU_CTM_LOG2 overrides the banks' size (the opt-in 250,000-entry runs: 20).
EMU_CTM_LOG2, EMU_CTM_EGRESS_LOG2 = 16, 16
# Cores whose Verilog is larger than this are compiled file by file, JOBS at once (driver/emu/Makefile PARALLEL=1);
# smaller ones as two translation units, per-cycle and run-once code (every core measured so far, up to 5 MB: a
# fraction of the CPU of the ~35 files one by one, which each parse verilated.h; docs/emulator.md, "Build").
PARALLEL_BUILD_BYTES = 8 << 20


def core_generics(config) -> dict[str, int]:
    """The hypafilter_core generics of an emulator build besides the width: the flow cache (Config.flow_cache) and
    the lease's external time base."""
    geometry = config.flow_cache_geometry() if config is not None else (10, 4)
    if geometry is None:
        return {"FC_LOG2_SETS": 0, **EMU_LEASE_GENERICS}
    return {
        "FC_LOG2_SETS": geometry[0],
        "FC_WAYS": geometry[1],
        "FC_TICK_CYCLES": EMU_TICK_CYCLES,
        **EMU_LEASE_GENERICS,
        "CTM_LOG2": int(os.environ.get("HF_EMU_CTM_LOG2", EMU_CTM_LOG2)),
        "CTM_EGRESS_LOG2": EMU_CTM_EGRESS_LOG2,
    }


class EmuError(HypafilterError):
    """A step of building or running the emulated NIC failed; names the step and quotes the tool's stderr."""

    def __init__(self, step: str, message: str, stderr: str = ""):
        self.step = step
        self.stderr = stderr
        tail = "\n".join(stderr.strip().splitlines()[-15:])
        super().__init__(f"emulated NIC: step '{step}' failed: {message}" + (f"\n{tail}" if tail else ""))


def _run(step: str, argv: list[str], env: dict[str, str] | None = None) -> str:
    """stdout of a build tool (which may run for minutes); EmuError naming the step with the tool's output."""
    try:
        return netns.run(argv, timeout=None, env=env)
    except netns.CommandError as e:
        if e.returncode is None:
            raise EmuError(step, f"{argv[0]} is not installed (scripts/setup.sh sim installs it)") from e
        raise EmuError(step, f"{' '.join(argv[:3])} ... exited with {e.returncode}", e.stderr or e.stdout) from e


@functools.lru_cache(maxsize=1)
def _tool_versions() -> str:
    out = []
    for argv in (["ghdl", "--version"], ["verilator", "--version"]):
        try:
            out.append(netns.run(argv, check=False).splitlines()[0])
        except (netns.CommandError, IndexError):
            out.append(f"{argv[0]} missing")
    return "\n".join(out)


def cache_key(matcher_hash: str, sources: list[Path], tdata_width: int, generics: dict | None = None) -> str:
    """Hash of everything the binary depends on: matcher, every VHDL source, the harness, width, the other generics
    and tool versions."""
    h = hashlib.sha256()
    h.update(f"matcher {matcher_hash}\nwidth {tdata_width}\n{_tool_versions()}\n".encode())
    h.update(f"generics {sorted((generics or {}).items())}\n".encode())
    for p in list(sources) + list(HARNESS_FILES):
        h.update(f"{p.name}\n".encode())
        h.update(p.read_bytes())
    return h.hexdigest()[:20]


# Everything vhdl.render reads besides the plan: with the matcher hash, width and fan-in these determine the
# generated sources, so a lookup can skip rendering (GENERATOR_FILES + static sources + harness + tool versions).
GENERATOR_FILES = (
    Path(vhdl.__file__),
    Path(vhdl.__file__).with_name("regmap.py"),
    Path(vhdl.__file__).with_name("settable.py"),
    vhdl.HW_DIR / "regmap.txt",
    *sorted(vhdl.TEMPLATES.glob("*.j2")),
)


def quick_key(matcher_hash: str, tdata_width: int, encoder_fanin: int, generics: dict | None = None) -> str:
    """Key of the inputs of a build (not of the rendered sources): finds a cached binary without rendering."""
    h = hashlib.sha256(f"matcher {matcher_hash}\nwidth {tdata_width}\nfanin {encoder_fanin}\n".encode())
    h.update(f"generics {sorted((generics or {}).items())}\n".encode())
    h.update(_tool_versions().encode())
    static = [vhdl.HW_DIR / f for f in (*vhdl.STATIC_SOURCES, vhdl.TOP_SOURCE)]
    for p in (*GENERATOR_FILES, *static, *HARNESS_FILES):
        h.update(f"{p.name}\n".encode())
        h.update(p.read_bytes())
    return h.hexdigest()[:20]


def compiler_cache_env(root: Path) -> dict[str, str]:
    """The environment of the C++ build: ccache (when driver/emu/Makefile finds it) keeps its objects in
    <build root>/emu/ccache unless CCACHE_DIR says otherwise, and hashes paths relative to the build root, so the same
    fixed entities compiled in two scratch folders are one cache entry."""
    env = dict(os.environ)
    env.setdefault("CCACHE_DIR", str(root / "ccache"))
    env.setdefault("CCACHE_BASEDIR", str(root))
    env.setdefault("CCACHE_NOHASHDIR", "1")
    return env


def build(plan, config=None, build_root: str | Path = "build", verbose: bool = False, jobs: int | None = None) -> Path:
    """Path of an hf_emu binary running the core generated from `plan` (built once, then taken from the cache).

    `jobs`: C++ compilers run side by side (default: one per CPU)."""
    jobs = jobs or os.cpu_count() or 1
    width = getattr(config, "tdata_width", 256)
    fanin = getattr(config, "encoder_fanin", 8)
    try:
        generics = core_generics(config)
    except HypafilterError as e:
        raise EmuError("configure", str(e)) from e
    t0 = time.monotonic()
    root = Path(build_root).resolve() / "emu"
    root.mkdir(parents=True, exist_ok=True)
    # a dual-stack deployment's IPv6 side (docs/ipv6.md "## emu"): its entries are part of the matcher
    plan6 = getattr(plan, "plan6", None)
    plan6 = getattr(plan6, "static6", None) or plan6  # an IPv6 View (its buffer's contents): the static plan's core
    mhash = vhdl.matcher_hash(plan, plan6)
    index = root / "index" / quick_key(mhash, width, fanin, generics)
    if index.exists():
        binary = root / index.read_text().strip() / "hf_emu"
        if binary.exists():
            if verbose:
                print(f"emu: cached build {binary.parent} ({time.monotonic() - t0:.2f} s)", file=sys.stderr)
            return binary
    scratch = root / f".tmp-{os.getpid()}-{time.monotonic_ns()}"
    gen = scratch / "gen"
    try:
        try:
            # Power-on tables "shunt all": the binary depends on the matcher alone, so every plan with the same
            # hardware entries (any complex-only change, any shunt mode over the same simple rules) reuses it
            # and is loaded by register writes (NicClient.program).
            vhdl.render(plan, gen, tdata_width=width, encoder_fanin=fanin, power_on="shunt_all", plan6=plan6)
        except (ValueError, OSError) as e:
            raise EmuError("render VHDL", str(e)) from e
        sources = vhdl.sources(gen)
        missing = [str(p) for p in sources if not p.exists()]
        if missing:
            raise EmuError("render VHDL", "core sources missing: " + ", ".join(missing))
        key = cache_key(mhash, sources, width, generics)
        final = root / key
        binary = final / "hf_emu"
        if binary.exists():
            _write_index(index, key)
            if verbose:
                print(f"emu: cached build {final} ({time.monotonic() - t0:.2f} s)", file=sys.stderr)
            return binary
        work = scratch / "ghdl"
        work.mkdir()
        verilog = scratch / f"{TOP}.v"
        # Absolute source paths: the generated package files are referenced from the scratch directory.
        srcs = [str(p.resolve()) for p in sources]
        synthesized = _run(
            "ghdl synth",
            ["ghdl", "--synth", "--std=08", f"--workdir={work}", f"-gC_S_AXIS_DATA_WIDTH={width}", "--out=verilog"]
            + [f"-g{k}={v}" for k, v in generics.items()]
            + srcs
            + ["-e", TOP],
        )
        verilog.write_text(synthesized)
        t1 = time.monotonic()
        _run(
            "verilator build",
            [
                "make",
                "-s",
                "-C",
                str(HARNESS_DIR),
                f"VERILOG={verilog}",
                f"OUT={scratch}",
                f"TDATA_WIDTH={width}",
                f"JOBS={jobs}",
                f"PARALLEL={int(len(synthesized) > PARALLEL_BUILD_BYTES)}",
            ],
            env=compiler_cache_env(root),
        )
        shutil.rmtree(scratch / "obj", ignore_errors=True)  # the object tree is large and never reused
        try:
            scratch.rename(final)
        except OSError:
            # Someone else finished the same build first; theirs is identical.
            if not binary.exists():
                raise
        _write_index(index, key)
        if verbose:
            print(
                f"emu: built {binary} (ghdl {t1 - t0:.1f} s, verilator {time.monotonic() - t1:.1f} s, "
                f"total {time.monotonic() - t0:.1f} s)",
                file=sys.stderr,
            )
        return binary
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _write_index(index: Path, key: str) -> None:
    """index/<quick key> names the content-keyed build directory (written atomically)."""
    index.parent.mkdir(exist_ok=True)
    tmp = index.with_name(f".{index.name}.{os.getpid()}")
    tmp.write_text(key + "\n")
    tmp.replace(index)
