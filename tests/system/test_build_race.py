"""Builds that several deployments start at once (pytest-xdist workers, two labs deployed together) never hand a
half-written loader or object to a process: each caller builds into a fresh build folder at the same moment, then
runs the loaders it got and checks the objects. A fresh clone's `make test` once failed a deploy with
"hf_shim ... cannot run it: Text file busy" (one worker ran hf_shim while another's linker was writing it)."""

from __future__ import annotations

import multiprocessing
import subprocess
from pathlib import Path

from conftest import need_tool

CALLERS, ROUNDS = 4, 2


def _build_and_run(args) -> str:
    root, barrier = args
    from hypafilter.targets import shim
    from hypafilter.targets.xdp import build

    barrier.wait()
    try:
        obj, loader = shim.build(root)
        xdp_loader = build.build_loader(Path(root))
        for binary in (loader, xdp_loader):
            # no arguments: the loader prints its usage and exits 1; the point is that it runs
            subprocess.run([str(binary)], capture_output=True, timeout=10)
        with open(obj, "rb") as f:
            if f.read(4) != b"\x7fELF":
                return f"{obj}: not a complete object"
        # The bench's senders and XDP objects (tools/bench/pktrate.build_cached): no arguments, a sender prints its
        # usage and exits 2.
        from hypafilter.tools.bench import pktrate, rate

        bench = Path(root) / "bench"
        for snd in (rate.build_sender("live", bench), rate.build_sender("packet", bench), rate.build_xsk(bench)):
            p = subprocess.run(list(snd.argv0), capture_output=True, timeout=10)
            if p.returncode != 2 or b"usage" not in p.stderr:
                return f"{snd.argv0}: exit {p.returncode} {p.stderr[-200:]!r}"
        for bpf in (rate.build_sink(bench), pktrate.build_cached(rate.PASS_SRC, bench, rate.BPF_CC, suffix=".o")):
            with open(bpf, "rb") as f:
                if f.read(4) != b"\x7fELF":
                    return f"{bpf}: not a complete object"
    except Exception as e:  # every failure of a caller is the finding
        return f"{type(e).__name__}: {e}"
    return ""


def test_concurrent_builds_never_hand_out_a_half_written_file(tmp_path):
    need_tool("make", "cc", "clang")
    ctx = multiprocessing.get_context("fork")
    failures = []
    for r in range(ROUNDS):
        root = tmp_path / f"round{r}"
        with ctx.Manager() as m:
            barrier = m.Barrier(CALLERS)
            with ctx.Pool(CALLERS) as pool:
                failures += [f for f in pool.map(_build_and_run, [(str(root), barrier)] * CALLERS) if f]
    assert not failures, failures
