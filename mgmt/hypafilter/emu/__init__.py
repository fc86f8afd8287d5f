"""The emulated FPGA NIC (target `emu`): build the Verilator model of the generated core, and run it."""

from .build import EmuError, build, cache_key
from .run import EmuNic

__all__ = ["EmuError", "EmuNic", "build", "cache_key"]
