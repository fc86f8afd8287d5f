"""The emulated FPGA NIC (target `emu`): build the Verilator model of the generated core, run it, deploy on it."""

from hypafilter.targets.emu.build import EmuError, build, cache_key
from hypafilter.targets.emu.run import EmuNic
from hypafilter.targets.emu.target import EmuTarget

__all__ = ["EmuError", "EmuNic", "EmuTarget", "build", "cache_key"]
