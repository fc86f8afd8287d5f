"""Register writes of an update on the emulated NIC, for the update-delay figure (Fig. 15).

A core is built for the initial deployment of each set (like the paper's bitstream) and each insertion is then
loaded the way `hypafilter deploy` loads it: `NicClient.program` over the real control socket, writing only the
SHUNT words and ACTION codes that differ from what the core holds. An insertion that changes the hardware entries
(exact mode: the new complex rule's reduction becomes an entry) cannot be loaded by registers at all; such steps
are recorded as needing a new core, and the time of one such build is measured once per run (`rebuild_seconds`).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from hypafilter import netns
from hypafilter.errors import HypafilterError
from hypafilter.hw.vhdl import matcher_hash
from hypafilter.paths import BUILD_ROOT as EMU_BUILD_ROOT  # the emulator cache `hypafilter deploy` uses
from hypafilter.targets.base import PORTS
from hypafilter.targets.emu import EmuNic, build


class Registers:
    """Context manager: an emulated NIC for register writes, or none when the emulator is unavailable."""

    def __init__(self, log: Callable[[str], None], build_root: Path = EMU_BUILD_ROOT):
        self.build_root = build_root
        self.log = log
        self.nic = None
        self.emu = None
        self.core_hash = ""
        self.known: dict | None = None
        self.target = "none"
        self.ns = ""
        self.rebuild_seconds: float | None = None

    def __enter__(self) -> Registers:
        return self

    def __exit__(self, *exc) -> None:
        self._stop()

    def _stop(self) -> None:
        if self.nic is not None:
            self.nic.close()
        if self.emu is not None:
            self.emu.stop()
        if self.ns:
            netns.delete(self.ns)
        self.nic = self.emu = None
        self.ns = ""
        self.known = None

    def _start(self, plan) -> None:
        self._stop()
        self.log(f"  building/starting the emulated NIC for {len(plan.entries)} entries (cached by matcher hash)")
        t0 = time.perf_counter()
        binary = build(plan, None, build_root=self.build_root)
        self.log(f"  emulated NIC ready after {time.perf_counter() - t0:.1f} s")
        self.ns = f"hfbn{os.getpid() % 100000}"
        netns.add(self.ns)
        ifs = {}
        for i, role in enumerate(PORTS):
            netns.veth(f"e{i}", self.ns, f"p{i}", self.ns)
            for d in (f"e{i}", f"p{i}"):
                netns.run(["ip", "-n", self.ns, "link", "set", d, "up"])
            ifs[role] = f"e{i}"
        self.emu = EmuNic(binary, ifs, name=self.ns, netns=self.ns, run_dir=self.build_root / "bench-run").start(
            timeout=60
        )
        self.nic = self.emu.client()
        self.core_hash = matcher_hash(plan)
        self.target = "emu"

    def deploy(self, plan, generation: int) -> int:
        """The initial deployment of a series: a core for this plan's matcher (built or cached), then its tables.
        Returns the number of register writes."""
        if self.target in ("none", "emu") and matcher_hash(plan) != self.core_hash:
            try:
                self._start(plan)
            except (HypafilterError, OSError, subprocess.SubprocessError) as e:
                # Recorded in the CSV (register_target) and the page: delays then exclude the register writes.
                self._stop()
                self.target = "unavailable"
                self.log(f"  emulated NIC unavailable, register writes not timed: {str(e)[:300]}")
        return self.update(plan, generation)[0]

    def update(self, plan, generation: int) -> tuple[int, bool]:
        """Load a plan by registers: (writes issued, True) — or (0, False) when the plan's hardware entries
        differ from the core's, so that only a new core can load it."""
        if self.nic is None:
            return 0, matcher_hash(plan) == self.core_hash or self.target == "unavailable"
        if matcher_hash(plan) != self.core_hash:
            return 0, False
        self.known = self.nic.program(plan, generation, known=self.known)
        return self.known["writes"], True

    def time_rebuild(self, plan) -> float | None:
        """Seconds to build a core for `plan` from nothing (GHDL synthesis + Verilator + g++), measured once per
        run in a scratch cache; None when the emulator is unavailable."""
        if self.rebuild_seconds is not None or self.target != "emu":
            return self.rebuild_seconds
        scratch = Path(tempfile.mkdtemp(prefix="hf-rebuild-", dir=self.build_root))
        try:
            self.log(f"  timing one core rebuild ({len(plan.entries)} entries) for the steps that need one")
            t0 = time.perf_counter()
            build(plan, None, build_root=scratch)
            self.rebuild_seconds = time.perf_counter() - t0
            self.log(f"  rebuild: {self.rebuild_seconds:.1f} s")
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        return self.rebuild_seconds
