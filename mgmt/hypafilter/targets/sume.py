"""Target `sume`: the core on a NetFPGA SUME board, its registers reached through the sume_riffa driver.

`build` writes the Vivado project whose bitstream runs a plan's matcher (`hw.synth.vivado_project`), and register
access (`SumeTransport`, the driver's rwaxi ioctl) works on any board that runs the core. What is not here is a
bitstream flow: nothing runs Vivado, loads a bitstream or takes a core off a board, so `start`, `standby` and
`stop` refuse, saying so. None of this can be tested on this machine (no board, no driver): it is written from
the driver's documented interface and is exercised only on a real SUME.
"""

from __future__ import annotations

import ctypes
import fcntl
import socket
import struct
from collections.abc import Iterable, Sequence
from pathlib import Path

from hypafilter.errors import HypafilterError
from hypafilter.hw import regmap
from hypafilter.hw.synth import vivado_project
from hypafilter.hw.vhdl import matcher_hash
from hypafilter.targets.base import Target
from hypafilter.targets.nic import CONTROL_ENABLE, NicError, RegRequest

DRIVER = "sume_riffa"
IFNAME = "nf0"  # the driver's first port; any of its interfaces answers the ioctl
IND_STREAM = 0x100  # IND_COMMAND bit 8: stream writes (hw/regmap.txt)


class SumeTransport:
    """NetFPGA SUME register access through the sume_riffa driver's rwaxi ioctl.

    The driver answers SIOCDEVPRIVATE+1 (write) and SIOCDEVPRIVATE+2 (read) on any socket, with an ifreq
    whose data points at struct { u32 addr; u32 val; }; addresses are absolute (output_port_lookup window at
    0x44020000).
    """

    BASE = 0x44020000
    SIOCDEVPRIVATE = 0x89F0

    def __init__(self, ifname: str = IFNAME, base: int = BASE):
        self.ifname = ifname
        self.base = base
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)

    def close(self) -> None:
        self.sock.close()

    def _ioctl(self, cmd: int, addr: int, val: int) -> int:
        data = ctypes.create_string_buffer(struct.pack("=II", addr, val))
        ifr = struct.pack("16sP", self.ifname.encode()[:15], ctypes.addressof(data))
        try:
            fcntl.ioctl(self.sock.fileno(), cmd, ifr)
        except OSError as e:
            raise NicError(f"rwaxi ioctl on {self.ifname} at 0x{addr:08x} failed: {e.strerror}") from e
        return struct.unpack("=II", data.raw)[1]

    def read(self, addr: int) -> int:
        return self._ioctl(self.SIOCDEVPRIVATE + 2, self.base + addr, 0)

    def write(self, addr: int, value: int) -> None:
        self._ioctl(self.SIOCDEVPRIVATE + 1, self.base + addr, value & 0xFFFFFFFF)

    def write_many(self, pairs: Iterable[tuple[int, int]]) -> None:
        for a, v in pairs:
            self.write(a, v)

    def read_table(self, table: int, index: int) -> int:
        self.write(regmap.REG_IND_ADDRESS, regmap.ind_address(table, index))
        self.write(regmap.REG_IND_COMMAND, 0x11)
        self._wait_ind()
        return self.read(regmap.REG_IND_REPLY)

    def write_table_many(self, table: int, start: int, values: Sequence[int]) -> None:
        # Stream writes (IND_COMMAND bit 8): the core counts the index and holds the bus while a write is busy.
        self.write(regmap.REG_IND_ADDRESS, regmap.ind_address(table, start))
        self.write(regmap.REG_IND_COMMAND, IND_STREAM)
        try:
            for v in values:
                self.write(regmap.REG_IND_WR_DATA, v & 0xFFFFFFFF)
        finally:
            self.write(regmap.REG_IND_COMMAND, 0)
        self._wait_ind()

    def request_many(self, reqs: Sequence[RegRequest]) -> list[int | None]:
        """Register accesses in order, one ioctl each: per request the value read, None for a write (as
        EmuTransport.request_many). Callers that batch requests (NicClient.flow_commands) have one path on every
        transport."""
        out: list[int | None] = []
        for r in reqs:
            if r.op == "read":
                out.append(self.read(r.addr))
            else:
                self.write(r.addr, r.value)
                out.append(None)
        return out

    def _wait_ind(self) -> None:
        for _ in range(10000):
            if not self.read(regmap.REG_IND_COMMAND) & 1:
                return
        raise NicError("indirect access did not complete (IND_COMMAND bit 0 stuck)")


class SumeTarget(Target):
    """A SUME board on this host, programmed outside the tool; `info` names the driver interface."""

    name = "sume"

    @property
    def ifname(self) -> str:
        return self.site.interfaces.get("host0", IFNAME)

    def missing(self) -> str | None:
        if not Path(f"/sys/module/{DRIVER}").exists():
            return "no board is present"
        if not Path(f"/sys/class/net/{self.ifname}").exists():
            return f"the {DRIVER} driver has no interface {self.ifname}"
        return None

    def build(self, plan) -> str:
        """The Vivado project (sources + batch Tcl) for the plan's core, one directory per matcher."""
        out = self.build_root / "sume" / matcher_hash(plan)[:20]
        tcl = vivado_project(plan, out, tdata_width=self.config.tdata_width, encoder_fanin=self.config.encoder_fanin)
        return str(tcl)

    def start(self, artifact: str, generation: int, standby: bool = True) -> dict:
        raise HypafilterError(
            f"target sume: no bitstream flow: the Vivado project for this plan is {artifact}, but running Vivado "
            "and programming the board with its bitstream is not automated"
        )

    def transport(self, info: dict, timeout: float = 30.0) -> SumeTransport:
        return SumeTransport(info.get("ifname", self.ifname))

    def activate(self, info: dict) -> None:
        """Classification on (CONTROL bit 0; off, the core shunts every frame as unparsed)."""
        with self.client(info) as c:
            c.write("CONTROL", c.read("CONTROL") | CONTROL_ENABLE)

    def standby(self, info: dict) -> None:
        raise HypafilterError(
            "target sume: a board runs one core, which cannot stand by beside another (a new core is a new bitstream)"
        )

    def alive(self, info: dict) -> bool:
        try:
            with self.client(info) as c:
                c.info()
        except (HypafilterError, OSError):
            return False
        return True

    def stop(self, info: dict) -> None:
        raise HypafilterError(
            f"target sume: taking the core off the board on {info.get('ifname', self.ifname)} is not automated "
            "(no bitstream flow): program the board with another bitstream"
        )
