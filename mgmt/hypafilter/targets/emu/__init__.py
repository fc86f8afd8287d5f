"""The emulated FPGA NIC (target `emu`): build the Verilator model of the generated core, and run it."""

from hypafilter.targets.emu.build import EmuError, build, cache_key
from hypafilter.targets.emu.run import EmuNic

__all__ = ["EmuError", "EmuNic", "build", "cache_key"]
