"""Register writes of an update on the emulated NIC, for the update-delay figure (Fig. 15).

The core is built once (like the paper's bitstream) from the first plan; each update then writes what
`NicClient.program` writes — the packed SHUNT words, the ACTION codes and GENERATION — over the real control socket.
`program` itself refuses a plan the core was not generated from (POLICY_HASH), which an insertion always changes, so
the same writes are issued through the table interface; entries beyond the core's size are not written.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable
from pathlib import Path

from ..errors import HypafilterError


class Registers:
    """Context manager: an emulated NIC for register writes, or none when the emulator is unavailable."""

    def __init__(self, build: Path, log: Callable[[str], None]):
        self.build = build
        self.log = log
        self.nic = None
        self.emu = None
        self.core_n = 0
        self.target = "none"
        self.ns = ""

    def __enter__(self) -> Registers:
        return self

    def __exit__(self, *exc) -> None:
        if self.nic is not None:
            self.nic.close()
        if self.emu is not None:
            self.emu.stop()
        if self.ns:
            subprocess.run(["ip", "netns", "del", self.ns], capture_output=True)

    def _start(self, plan) -> None:
        from ..emu import EmuNic, build  # noqa: PLC0415

        self.log("  building/starting the emulated NIC for the first plan (cached by policy hash)")
        binary = build(plan, None, build_root=self.build)
        self.ns = f"hfbn{os.getpid() % 100000}"
        subprocess.run(["ip", "netns", "add", self.ns], check=True, capture_output=True)
        ifs = {}
        for i, role in enumerate(("wire0", "wire1", "host0", "host1")):
            subprocess.run(
                ["ip", "-n", self.ns, "link", "add", f"e{i}", "type", "veth", "peer", "name", f"p{i}"],
                check=True,
                capture_output=True,
            )
            for d in (f"e{i}", f"p{i}"):
                subprocess.run(["ip", "-n", self.ns, "link", "set", d, "up"], check=True, capture_output=True)
            ifs[role] = f"e{i}"
        self.emu = EmuNic(binary, ifs, name=self.ns, netns=self.ns, run_dir=self.build / "run").start(timeout=60)
        self.nic = self.emu.client()
        self.core_n = self.nic.read("NUM_ENTRIES")
        self.target = "emu"

    def program(self, plan, generation: int) -> int:
        """Writes the plan's run-time registers; returns the number of 32-bit writes."""
        from ..nic import pack_shunt  # noqa: PLC0415

        if self.target == "none":
            try:
                self._start(plan)
            except (HypafilterError, OSError, subprocess.SubprocessError) as e:
                # Recorded in the CSV (register_target) and the page: delays then exclude the register writes.
                self.target = "unavailable"
                self.log(f"  emulated NIC unavailable, register writes counted but not timed: {str(e)[:300]}")
        n = min(len(plan.entries), self.core_n) if self.nic is not None else len(plan.entries)
        shunt = [*plan.shunt[:n], plan.shunt[-1]] if self.nic is not None else list(plan.shunt)
        words = pack_shunt(shunt)
        actions = [int(a) for a in [*plan.actions[:n], plan.actions[-1]]]
        if self.nic is not None:
            self.nic.write_table_many("SHUNT", 0, words)
            self.nic.write_table_many("ACTION", 0, actions)
            self.nic.write("GENERATION", generation & 0xFFFF)
        return len(words) + len(actions) + 1
