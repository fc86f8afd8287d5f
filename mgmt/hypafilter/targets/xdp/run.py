"""Runs the fast path on frames without attaching it (BPF_PROG_TEST_RUN through `hf_xdp run`): the tests' and the
benchmarks' way to ask the loaded program what it decides, and how long it takes."""

from __future__ import annotations

import json
import struct
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from hypafilter import netns
from hypafilter.errors import HypafilterError
from hypafilter.paths import BUILD_ROOT
from hypafilter.targets.xdp.build import build_loader, build_program
from hypafilter.targets.xdp.tables import CtConfig, _record, build_tables, build_tables6, shape6, tables_file

XDP_ABORTED, XDP_DROP, XDP_PASS, XDP_TX, XDP_REDIRECT = range(5)


@dataclass(frozen=True)
class Verdict:
    retval: int  # XDP_* action
    value: int  # the shim's mark value left in the metadata
    cookie: int
    meta: int  # M
    ns: int  # BPF_PROG_TEST_RUN duration per run (ns)
    peer: int = 0  # mirrored ACCEPT in bridge mode: ifindex the shim's TC program clones the frame to


@dataclass
class RunResult:
    verdicts: list[Verdict]
    counters: dict
    prog: dict  # verified_insns, xlated_insns, jited_bytes
    shape: dict


def frames_file(frames: Sequence[tuple[int, bytes]]) -> bytes:
    return b"".join(struct.pack("<II", iport, len(f)) + f for iport, f in frames)


def run_frames(
    plan,
    frames: Sequence[tuple[int, bytes]],
    ports: Sequence[str],
    *,
    ns: str | None = None,
    control: int = 1,
    generation: int = 0,
    repeat: int = 1,
    build_root: Path = BUILD_ROOT,
    paired: bool = True,
    shape: dict | None = None,
    ct: CtConfig | None = None,
    lease_ns: int = 0,
    plan6=None,
    control6: int | None = None,
    ct6: CtConfig | None = None,
    view6=None,
) -> RunResult:
    """Each (iport, frame) through the program built for `plan` (a Plan, or an analysis.overlay.View: the static
    entries' program with its update buffer and valid mask written); `ports[i]` is the interface of iport i in `ns`
    (it must exist there: the kernel resolves the ingress ifindex), paired 0<->1, 2<->3 for the devmap. `shape`:
    a larger program than the plan needs (fields and capacities, update-buffer slots; the tables must fit it).
    `lease_ns`: the lease word (hfx_lease; 0 disarmed, else the CLOCK_MONOTONIC ns it holds until). `plan6`: a
    family-6 plan whose table set decides the IPv6 frames (docs/ipv6.md "## xdp"); without it they are unparsed;
    `control6`/`ct6`: its miss forcing bits and conntrack lookup (default: `control`'s and `ct`). `view6`: the IPv6
    update buffer's contents over `plan6`'s table set (analysis.overlay.align6; the program gets its depth)."""
    t = build_tables(plan)
    t6 = build_tables6(plan6) if plan6 is not None else None
    depth6 = view6.overlay.depth if view6 is not None else 0
    shape = shape or ({**t.shape(), "v6": shape6(t6, depth6)} if t6 is not None else t.shape())
    obj = build_program(shape, build_root)
    tool = build_loader(build_root)
    with tempfile.TemporaryDirectory(prefix="hfx-") as d:
        tf, ff = Path(d) / "tables", Path(d) / "frames"
        lease = _record("hfx_lease", 8, 1, struct.pack("<Q", lease_ns)) if lease_ns else b""
        tf.write_bytes(
            lease + tables_file(t, shape, control, generation, ct, t6=t6, control6=control6, ct6=ct6, view6=view6)
        )
        ff.write_bytes(frames_file(frames))
        argv = [str(tool), "run", "--obj", str(obj), "--tables", str(tf), "--frames", str(ff), "--repeat", str(repeat)]
        for i, name in enumerate(ports):
            mate = i ^ 1
            spec = f"{name}={i}" + (f":{ports[mate]}" if paired and mate < len(ports) else "")
            argv += ["--port", spec]
        if ns:
            argv += ["--netns", ns]
        try:
            out = netns.run(argv, timeout=None)
        except netns.CommandError as e:
            raise HypafilterError(f"hf_xdp run failed: {e}") from e
    return _result(out, shape)


def run_pinned(
    pin: str | Path,
    frames: Sequence[tuple[int, bytes]],
    *,
    ns: str | None = None,
    repeat: int = 1,
    build_root: Path = BUILD_ROOT,
) -> RunResult:
    """Each (iport, frame) through a started program (`XdpTarget.start`'s pin) with the tables, overlay and ports it
    has; its counters are cumulative (frames before these included). `ns`: the namespace of its ports."""
    tool = build_loader(build_root)
    with tempfile.TemporaryDirectory(prefix="hfx-") as d:
        ff = Path(d) / "frames"
        ff.write_bytes(frames_file(frames))
        argv = [str(tool), "run", "--pin", str(pin), "--frames", str(ff), "--repeat", str(repeat)]
        if ns:
            argv += ["--netns", ns]
        try:
            out = netns.run(argv, timeout=None)
        except netns.CommandError as e:
            raise HypafilterError(f"hf_xdp run failed: {e}") from e
    return _result(out, {})


def _result(out: str, shape: dict) -> RunResult:
    lines = out.splitlines()
    prog = json.loads(lines[0])
    counters = json.loads(lines[-1])
    verdicts = []
    for line in lines[1:-1]:
        r, v, c, m, dur, peer = line.split()
        verdicts.append(Verdict(int(r), int(v), int(c), int(m, 16), int(dur), int(peer)))
    return RunResult(verdicts, counters, prog, shape)
