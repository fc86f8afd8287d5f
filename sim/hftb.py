"""Shared cocotb testbench parts for the hypafilter core: GHDL build/run, AXI-Stream and AXI-Lite drivers, frames."""

from __future__ import annotations

import os
import pickle
import random
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SIM_BUILD = ROOT / "build" / "sim"
WIRE = (0x01, 0x04, 0x10, 0x40)
HOST = (0x02, 0x08, 0x20, 0x80)


# ---------------------------------------------------------------- building and running (pytest side)


def run_ghdl(
    entity: str,
    sources: list[Path],
    test_module: str,
    tag: str,
    parameters: dict,
    env: dict | None = None,
    test_dir: Path | None = None,
    testcase: str | list[str] | None = None,
    build_args: list[str] | None = None,
) -> None:
    """Build `entity` with GHDL (VHDL-2008) into build/sim/<entity>/<tag> and run the cocotb tests of test_module.

    build_args are added to the analysis options: `-O0` makes ghdl-llvm skip LLVM's optimiser, which takes
    minutes on a 10,000-entry matcher (one process of ~11,000 assignments) and costs only ~25 % of simulation speed.
    """
    from cocotb.runner import get_runner  # noqa: PLC0415 (only the pytest side needs it)

    build_dir = SIM_BUILD / entity / tag
    build_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    runner = get_runner("ghdl")
    runner.build(
        vhdl_sources=[str(s) for s in sources],
        hdl_toplevel=entity,
        build_args=["--std=08", *(build_args or [])],
        build_dir=build_dir,
        always=True,
    )
    t1 = time.monotonic()
    import sys  # noqa: PLC0415

    path = [str(ROOT / "sim"), str(test_dir or build_dir), *sys.path]
    # the LLVM backend runs the elaborated binary from the build folder, so the tests run there too
    results = runner.test(
        hdl_toplevel=entity,
        test_module=test_module,
        test_args=["--std=08"],
        parameters=parameters,
        build_dir=build_dir,
        test_dir=build_dir,
        extra_env={"PYTHONPATH": os.pathsep.join(path), **(env or {})},
        testcase=testcase,
    )
    from cocotb.runner import get_results  # noqa: PLC0415

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


def _cocotb():
    import cocotb  # noqa: PLC0415
    from cocotb.triggers import ReadOnly, RisingEdge  # noqa: PLC0415

    return cocotb, ReadOnly, RisingEdge


def _edge(period_ns: int) -> int:
    from cocotb.utils import get_sim_time  # noqa: PLC0415

    return round(get_sim_time("ns") / period_ns)


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
        _, ReadOnly, RisingEdge = _cocotb()
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
                while True:
                    await ReadOnly()
                    ready = int(d.s_axis_tready.value)
                    await RisingEdge(self.clk)
                    if ready:
                        break
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

    async def run(self) -> None:
        _, ReadOnly, RisingEdge = _cocotb()
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
    """AXI4-Lite master on s_axi_* (one transaction at a time)."""

    def __init__(self, dut, clk):
        self.dut, self.clk = dut, clk
        for s in ("awvalid", "wvalid", "arvalid"):
            getattr(dut, f"s_axi_{s}").value = 0
        dut.s_axi_bready.value = 1
        dut.s_axi_rready.value = 1
        dut.s_axi_wstrb.value = 0xF
        dut.s_axi_awaddr.value = 0
        dut.s_axi_araddr.value = 0
        dut.s_axi_wdata.value = 0

    async def write(self, addr: int, value: int) -> None:
        _, ReadOnly, RisingEdge = _cocotb()
        d = self.dut
        d.s_axi_awaddr.value = addr
        d.s_axi_wdata.value = value & 0xFFFFFFFF
        d.s_axi_awvalid.value = 1
        d.s_axi_wvalid.value = 1
        while True:
            await ReadOnly()
            ok = int(d.s_axi_awready.value)
            await RisingEdge(self.clk)
            if ok:
                break
        d.s_axi_awvalid.value = 0
        d.s_axi_wvalid.value = 0
        while True:
            await ReadOnly()
            ok = int(d.s_axi_bvalid.value)
            await RisingEdge(self.clk)
            if ok:
                break

    async def read(self, addr: int) -> int:
        _, ReadOnly, RisingEdge = _cocotb()
        d = self.dut
        d.s_axi_araddr.value = addr
        d.s_axi_arvalid.value = 1
        while True:
            await ReadOnly()
            ok = int(d.s_axi_arready.value)
            await RisingEdge(self.clk)
            if ok:
                break
        d.s_axi_arvalid.value = 0
        while True:
            await ReadOnly()
            ok = int(d.s_axi_rvalid.value)
            val = int(d.s_axi_rdata.value)
            await RisingEdge(self.clk)
            if ok:
                return val

    async def table_access(self, regs, table: int, index: int, value: int | None = None) -> int:
        """The SUME indirect-access protocol of hw/regmap.txt; returns IND_REPLY (reads) or 0."""
        await self.write(regs.REG_IND_ADDRESS, (table << 24) | index)
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


def header_frame(h, rng: random.Random, vlans: int = 0, options: int = 0, pad: int = 0) -> bytes:
    """A frame (scapy) carrying header point h (ir.Header fields)."""
    from scapy.layers.inet import ICMP, IP, TCP, UDP  # noqa: PLC0415
    from scapy.layers.l2 import Dot1AD, Dot1Q, Ether  # noqa: PLC0415
    from scapy.packet import Raw  # noqa: PLC0415

    def addr(v: int) -> str:
        return ".".join(str((v >> s) & 0xFF) for s in (24, 16, 8, 0))

    pkt = Ether(src="02:00:00:00:00:01", dst="02:00:00:00:00:02")
    for i in range(vlans):
        pkt = pkt / (
            Dot1AD(vlan=rng.randrange(4096)) if i == 0 and rng.random() < 0.5 else Dot1Q(vlan=rng.randrange(4096))
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
    frame = bytes(pkt / ip / l4 / Raw(bytes(rng.randrange(256) for _ in range(pad))))
    return frame.ljust(60, b"\0")
