"""Shared cocotb testbench parts of the hypafilter entities: GHDL build/run, AXI-Stream and AXI-Lite drivers, frames.

Testbenches import it as `sim.hftb` (the repository root is on sys.path under pytest, and run_ghdl puts it on the
simulator's path), so no testbench edits sys.path.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

from cocotb.runner import get_results, get_runner
from cocotb.triggers import ReadOnly, RisingEdge
from cocotb.utils import get_sim_time
from hypafilter.paths import HW_DIR, ROOT
from scapy.layers.inet import ICMP, IP, TCP, UDP
from scapy.layers.l2 import Dot1AD, Dot1Q, Ether
from scapy.packet import Raw

from conftest import need_tool

SIM_DIR = ROOT / "sim"
SIM_BUILD = ROOT / "build" / "sim"
WIRE = (0x01, 0x04, 0x10, 0x40)
HOST = (0x02, 0x08, 0x20, 0x80)


# ---------------------------------------------------------------- building and running (pytest side)


def fresh_build(top: str, tag: str) -> Path:
    """SIM_BUILD/<top>/<tag>, emptied: a post-synthesis build starts from nothing."""
    out = SIM_BUILD / top / tag
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    return out


def hw(*names: str) -> list[Path]:
    """Static sources of hw/ by file name, in the order given (compile order)."""
    return [HW_DIR / n for n in names]


def _ghdl_version() -> str:
    global _GHDL_VERSION
    if _GHDL_VERSION is None:
        _GHDL_VERSION = subprocess.run(["ghdl", "--version"], check=True, capture_output=True, text=True).stdout
    return _GHDL_VERSION


_GHDL_VERSION: str | None = None
SEEDS = SIM_BUILD / ".seeds"


def _seed_key(entity: str, names: list[str], args: list[str]) -> str:
    """What a seed library is valid for: GHDL's version, the options, the top level, the source names in order and
    the content of every source outside the build folder (an edited hw/*.vhd makes a new seed)."""
    h = hashlib.sha256()
    for part in (_ghdl_version(), entity, *args, *names):
        h.update(part.encode() + b"\0")
    for n in names:
        if os.path.isabs(n):
            h.update(Path(n).read_bytes())
    return h.hexdigest()[:24]


def _library_files(folder: Path) -> list[Path]:
    """GHDL's library index and the analysed units' objects (not the elaborated top level: built every time)."""
    return [p for p in folder.iterdir() if p.suffix == ".cf" or (p.suffix == ".o" and not p.name.startswith("e~"))]


def ghdl_build(entity: str, sources: list[Path], build_dir: Path, args: list[str]) -> None:
    """ghdl -i and ghdl -m (analysis of what is out of date, elaboration) of `entity` in build_dir, the library
    seeded from an earlier build of the same sources.

    Most builds of a session analyse the same static hw/*.vhd files; only the files generated per build (inside
    build_dir: named relative to it, so a library is valid in any build folder) differ. A build folder without a
    library starts from a copy of the seed of its key (_seed_key); GHDL's make then re-analyses every file whose
    content differs from what the library recorded (GHDL keeps each file's SHA-1 and compares it whatever the
    file's time) and every unit that depends on one, as in a folder it had built before. The first finished build
    of a key publishes its library as the seed (copied, then renamed into place: a worker sees a whole seed or none).
    """
    build_dir = build_dir.resolve()
    names = [os.path.relpath(s, build_dir) if s.resolve().is_relative_to(build_dir) else str(s) for s in sources]
    seed = SEEDS / _seed_key(entity, names, args)
    cmds = [["ghdl", "-i", "--work=top", *args, *names], ["ghdl", "-m", "--work=top", *args, entity]]
    if seed.is_dir() and not any(p.suffix == ".cf" for p in build_dir.iterdir()):
        for f in seed.iterdir():
            shutil.copyfile(f, build_dir / f.name)
        del cmds[0]  # the seed holds every file of the list; `ghdl -i` would mark all its units unanalysed again
    for cmd in cmds:
        print(f"INFO: Running command {' '.join(cmd)} in directory {build_dir}")
        if subprocess.run(cmd, cwd=build_dir).returncode:
            raise AssertionError(f"{cmd[1]} failed (output above): {' '.join(cmd)} in {build_dir}")
    if not seed.exists():
        tmp = SEEDS / f"{seed.name}.{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        for f in _library_files(build_dir):
            shutil.copyfile(f, tmp / f.name)
        try:
            tmp.rename(seed)
        except OSError:  # another worker published it first
            shutil.rmtree(tmp)


def run_ghdl(
    entity: str,
    sources: list[Path],
    tag: str,
    parameters: dict,
    env: dict | None = None,
    testcase: str | list[str] | None = None,
    build_args: list[str] | None = None,
    test_module: str | None = None,
) -> None:
    """Build `entity` with GHDL (VHDL-2008) into build/sim/<entity>/<tag> (ghdl_build) and run the cocotb tests of
    sim/<entity>/<test_module> (default test_<entity>).

    build_args are added to the analysis options: `-O0` makes ghdl-llvm skip LLVM's optimiser, which takes
    minutes on a 10,000-entry matcher (one process of ~11,000 assignments) and costs only ~25 % of simulation speed.
    """
    need_tool("ghdl")
    build_dir = SIM_BUILD / entity / tag
    build_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    ghdl_build(entity, sources, build_dir, ["--std=08", *(build_args or [])])
    t1 = time.monotonic()
    path = [str(ROOT), str(SIM_DIR / entity), *sys.path]
    # the LLVM backend runs the elaborated binary from the build folder, so the tests run there too
    results = get_runner("ghdl").test(
        hdl_toplevel=entity,
        hdl_toplevel_lang="vhdl",
        test_module=test_module or f"test_{entity}",
        test_args=["--std=08"],
        parameters=parameters,
        build_dir=build_dir,
        test_dir=build_dir,
        extra_env={"PYTHONPATH": os.pathsep.join(path), **(env or {})},
        testcase=testcase,
    )
    total, failed = get_results(results)
    # wall times on stdout (pytest -s shows them): the figures docs/hardware.md quotes for large builds
    print(f"TIME {entity}/{tag}: ghdl build {t1 - t0:.1f} s, simulation {time.monotonic() - t1:.1f} s")
    assert total > 0, "no cocotb test ran"
    assert failed == 0, f"{failed} of {total} cocotb tests failed (log under {build_dir})"


def save_obj(obj, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(pickle.dumps(obj))
    return path


def load_obj(env_name: str):
    return pickle.loads(Path(os.environ[env_name]).read_bytes())


# ---------------------------------------------------------------- cocotb side


def _edge(period_ns: int) -> int:
    return round(get_sim_time("ns") / period_ns)


def cycle(period_ns: int = 4) -> int:
    """The current clock edge's number (sim time / period), as AxisSource and AxisSink record theirs."""
    return _edge(period_ns)


async def handshake(clk, ready) -> None:
    """Wait for the clock edge that completes a transfer the caller offers (valid held at 1): `ready` sampled 1."""
    while True:
        await ReadOnly()
        ok = int(ready.value)
        await RisingEdge(clk)
        if ok:
            return


class Free:
    """A stand-in port: takes any value written, reads as `value` (ports an entity does not have)."""

    def __init__(self, value: int = 0):
        self.value = value


class Ports:
    """A view of dut under other names: Ports(dut, s_axis_tdata="tdata", s_axis_tready=Free(1), ...)."""

    def __init__(self, dut, **names):
        for alias, port in names.items():
            setattr(self, alias, getattr(dut, port) if isinstance(port, str) else port)


class AxisSource:
    """Drives s_axis_* with frames (bytes, tuser); random idle cycles between beats."""

    def __init__(self, dut, clk, width: int, rng: random.Random, idle: float = 0.2):
        self.dut, self.clk, self.bytes, self.rng, self.idle = dut, clk, width // 8, rng, idle
        self.accepted_first: list[int] = []  # clock edge (sim time / period) of each frame's first transfer
        self.period_ns = 4
        dut.s_axis_tvalid.value = 0
        dut.s_axis_tlast.value = 0
        dut.s_axis_tdata.value = 0
        dut.s_axis_tkeep.value = 0
        dut.s_axis_tuser.value = 0

    async def send(self, frames) -> None:
        d, n = self.dut, self.bytes
        for data, tuser in frames:
            beats = [data[i : i + n] for i in range(0, max(len(data), 1), n)]
            for k, beat in enumerate(beats):
                while self.idle and self.rng.random() < self.idle:
                    d.s_axis_tvalid.value = 0
                    await RisingEdge(self.clk)
                d.s_axis_tdata.value = int.from_bytes(beat.ljust(n, b"\0"), "little")
                d.s_axis_tkeep.value = (1 << len(beat)) - 1
                d.s_axis_tlast.value = int(k == len(beats) - 1)
                d.s_axis_tuser.value = tuser if k == 0 else 0
                d.s_axis_tvalid.value = 1
                await handshake(self.clk, d.s_axis_tready)
                if k == 0:
                    self.accepted_first.append(_edge(self.period_ns))
        d.s_axis_tvalid.value = 0


class AxisSink:
    """Collects m_axis_* frames as (bytes, tuser of the first beat, cycle of the first beat)."""

    def __init__(self, dut, clk, width: int, rng: random.Random, ready: float = 0.8):
        self.dut, self.clk, self.bytes, self.rng, self.ready = dut, clk, width // 8, rng, ready
        self.frames: list[tuple[bytes, int, int]] = []  # (data, tuser, clock edge of the first transfer)
        self.period_ns = 4
        self.cycles = 0
        self.beats_out = 0
        self._cur = bytearray()
        self._tuser = 0
        self._first = 0
        dut.m_axis_tready.value = 0

    @property
    def mid_frame(self) -> bool:
        return bool(self._cur)

    async def run(self) -> None:
        d = self.dut
        while True:
            await RisingEdge(self.clk)
            self.cycles += 1
            r = 1 if self.ready >= 1 else int(self.rng.random() < self.ready)
            d.m_axis_tready.value = r
            await ReadOnly()
            if r and int(d.m_axis_tvalid.value):
                keep = int(d.m_axis_tkeep.value)
                raw = int(d.m_axis_tdata.value).to_bytes(self.bytes, "little")
                nbytes = bin(keep).count("1")
                if not self._cur:
                    self._tuser = int(d.m_axis_tuser.value)
                    self._first = _edge(self.period_ns) + 1  # the transfer happens at the next edge
                self._cur += raw[:nbytes]
                self.beats_out += 1
                if int(d.m_axis_tlast.value):
                    self.frames.append((bytes(self._cur), self._tuser, self._first))
                    self._cur = bytearray()


class AxiLite:
    """AXI4-Lite master on s_axi_* (one transaction at a time); `stall` is the chance per cycle that it holds
    bready/rready low while a response waits (0: always ready), and of an idle cycle before a request."""

    def __init__(self, dut, clk, rng: random.Random | None = None, stall: float = 0.0):
        self.dut, self.clk, self.rng, self.stall = dut, clk, rng or random.Random(0), stall
        for s in ("awvalid", "wvalid", "arvalid"):
            getattr(dut, f"s_axi_{s}").value = 0
        dut.s_axi_bready.value = int(not stall)
        dut.s_axi_rready.value = int(not stall)
        dut.s_axi_wstrb.value = 0xF
        dut.s_axi_awaddr.value = 0
        dut.s_axi_araddr.value = 0
        dut.s_axi_wdata.value = 0

    def _hold(self) -> bool:
        return bool(self.stall) and self.rng.random() < self.stall

    async def _response(self, valid, ready, data=None) -> int:
        """Take one response, holding `ready` low on random cycles; returns `data` as it was taken."""
        while True:
            ready.value = int(not self._hold())
            await ReadOnly()
            ok = int(valid.value) and int(ready.value)
            val = int(data.value) if ok and data is not None else 0
            await RisingEdge(self.clk)
            if ok:
                ready.value = int(not self.stall)
                return val

    async def write(self, addr: int, value: int) -> None:
        d = self.dut
        while self._hold():
            await RisingEdge(self.clk)
        d.s_axi_awaddr.value = addr
        d.s_axi_wdata.value = value & 0xFFFFFFFF
        d.s_axi_awvalid.value = 1
        d.s_axi_wvalid.value = 1
        await handshake(self.clk, d.s_axi_awready)
        d.s_axi_awvalid.value = 0
        d.s_axi_wvalid.value = 0
        await self._response(d.s_axi_bvalid, d.s_axi_bready)

    async def read(self, addr: int) -> int:
        d = self.dut
        while self._hold():
            await RisingEdge(self.clk)
        d.s_axi_araddr.value = addr
        d.s_axi_arvalid.value = 1
        await handshake(self.clk, d.s_axi_arready)
        d.s_axi_arvalid.value = 0
        return await self._response(d.s_axi_rvalid, d.s_axi_rready, d.s_axi_rdata)

    async def table_access(self, regs, table: int, index: int, value: int | None = None) -> int:
        """The SUME indirect-access protocol of hw/regmap.txt; returns IND_REPLY (reads) or 0."""
        await self.write(regs.REG_IND_ADDRESS, regs.ind_address(table, index))
        if value is not None:
            await self.write(regs.REG_IND_WR_DATA, value)
        await self.write(regs.REG_IND_COMMAND, 0x11 if value is None else 0x01)
        for _ in range(10000):
            if not (await self.read(regs.REG_IND_COMMAND)) & 1:
                break
        else:
            raise AssertionError("indirect access never completed")
        return 0 if value is not None else await self.read(regs.REG_IND_REPLY)


# ---------------------------------------------------------------- frames


def tuser_for(frame: bytes, src_port: int) -> int:
    return len(frame) | (src_port << 16)


def header_frame(h, rng: random.Random, vlans: int = 0, options: int = 0, pad: int = 0, ad_share: float = 0.5) -> bytes:
    """A frame (scapy) carrying header point h (ir.Header fields); the outer of `vlans` tags is 802.1ad with
    probability ad_share (two tags of any kind make the frame unfilterable)."""

    def addr(v: int) -> str:
        return ".".join(str((v >> s) & 0xFF) for s in (24, 16, 8, 0))

    pkt = Ether(src="02:00:00:00:00:01", dst="02:00:00:00:00:02")
    for i in range(vlans):
        pkt = pkt / (
            Dot1AD(vlan=rng.randrange(4096)) if i == 0 and rng.random() < ad_share else Dot1Q(vlan=rng.randrange(4096))
        )
    ip = IP(src=addr(h.src), dst=addr(h.dst), proto=h.proto, options=[] if not options else b"\x01" * (4 * options))
    if h.proto == 6:
        l4 = TCP(sport=h.sport, dport=h.dport, flags=h.tcp_flags)
    elif h.proto == 17:
        l4 = UDP(sport=h.sport, dport=h.dport)
    elif h.proto == 1:
        l4 = ICMP(type=h.icmp_type, code=h.icmp_code)
    else:
        l4 = Raw(b"\x00" * 8)
    body = bytes(rng.randrange(256) for _ in range(pad))
    frame = bytes(pkt / ip / l4 / Raw(body))
    if len(frame) < 60:  # the minimum Ethernet frame, filled inside the datagram: padding after it is unparsed
        frame = bytes(pkt / ip / l4 / Raw(body + bytes(60 - len(frame))))
    return frame
