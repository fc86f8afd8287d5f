#!/usr/bin/env python3
"""Measures frames per second through the emulated NIC (wire0 → core → any port) and prints the figure and command.

Usage (root): .venv/bin/python scripts/bench-emu.py [--frames N] [--size BYTES] [--binary hf_emu]
Without --binary it builds (or takes from the cache) the emulator of a small fixed policy and prints both times.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import socket
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "mgmt"))
# namespaces: HF_BENCH_EMU_NS (default hfbe) + -nic / -out, so that runs side by side do not meet
NS_NIC, NS_OUT = (os.environ.get("HF_BENCH_EMU_NS", "hfbe") + s for s in ("-nic", "-out"))
PORTS = {"wire0": "w0p", "wire1": "w1p", "host0": "h0p", "host1": "h1p"}


def small_plan():
    from hypafilter.analysis.plan import build_plan
    from hypafilter.config import Config
    from hypafilter.ir import PROTO_TCP, PROTO_UDP, Box, Policy, Rule

    def box(**kw):
        b = Box.full()
        for k, (lo, hi) in kw.items():
            b = b.with_field(k, lo, hi)
        return b

    rules = [
        Rule((box(proto=(PROTO_TCP, PROTO_TCP), dport=(22, 22)),), "DROP"),
        Rule((box(src=(0x0A000100, 0x0A0001FF), proto=(PROTO_UDP, PROTO_UDP)),), "ACCEPT"),
    ]
    orig = [("-p", "tcp", "--dport", "22", "-j", "DROP"), ("-s", "10.0.1.0/24", "-p", "udp", "-j", "ACCEPT")]
    cfg = Config()
    return build_plan(Policy(rules, "ACCEPT", source="bench-emu", original_rules=orig), cfg), cfg


def setns(name: str) -> None:
    fd = os.open(f"/run/netns/{name}", os.O_RDONLY)
    if ctypes.CDLL(None, use_errno=True).setns(fd, 0x40000000) != 0:
        raise OSError(ctypes.get_errno(), "setns")
    os.close(fd)


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of process `pid` so far (/proc/PID/stat fields 14 and 15)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--frames", type=int, default=20000)
    ap.add_argument("--size", type=int, default=64, help="frame size in bytes (without FCS), 60..1514")
    ap.add_argument("--binary", help="an existing hf_emu (default: build the fixed small policy)")
    args = ap.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("bench-emu: needs root (network namespaces)")
    from hypafilter.targets.emu import EmuNic, build
    from hypafilter.targets.emu.ports import remove, veth_ports

    if args.binary:
        binary = Path(args.binary)
    else:
        plan, cfg = small_plan()
        t0 = time.monotonic()
        binary = build(plan, cfg, build_root=ROOT / "build", verbose=True)
        print(f"build: {time.monotonic() - t0:.1f} s -> {binary}")
    veth_ports(NS_NIC, NS_OUT, PORTS.items(), mtu=1600)
    run = Path(tempfile.mkdtemp(prefix="hfbe-"))
    nic = EmuNic(binary, {k: k for k in PORTS}, name="bench", netns=NS_NIC, run_dir=run).start()
    try:
        from scapy.layers.inet import IP, UDP
        from scapy.layers.l2 import Ether

        pkt = (
            Ether(src="02:00:00:00:00:01", dst="02:00:00:00:00:02")
            / IP(src="10.0.1.5", dst="10.9.0.2")
            / UDP(sport=1, dport=53)
        )
        frame = bytes(pkt / bytes(max(0, args.size - len(pkt))))
        setns(NS_OUT)
        tx = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(3))
        tx.bind(("w0p", 3))
        tx.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
        base = nic.stats()["fed"]
        cyc0, cpu0 = nic.stats()["cycles"], cpu_s(nic.proc.pid)
        window = 400  # frames in flight at most: the NIC's socket queue never overflows, so none is lost
        sent = 0
        t0 = time.monotonic()
        while sent < args.frames:
            done = nic.stats()["fed"] - base
            while sent < args.frames and sent - done < window:
                tx.send(frame)
                sent += 1
            time.sleep(0.0005)
        while nic.stats()["fed"] - base < args.frames and time.monotonic() - t0 < 120:
            time.sleep(0.001)
        dt = time.monotonic() - t0
        st = nic.stats()
        cpu = cpu_s(nic.proc.pid) - cpu0
        fed = st["fed"] - base
        print(
            f"frames {fed}/{args.frames} of {len(frame)} B in {dt:.2f} s: {fed / dt:,.0f} frames/s through the core "
            f"({st['cycles']:,} cycles, {st['cycles'] / dt / 1e6:.2f} M cycles/s)"
        )
        # the model is clocked only while frames are queued or in flight: its cycles per CPU second of the emulator
        # process are the model's speed whatever share of the machine other processes take meanwhile
        print(f"emulator: {(st['cycles'] - cyc0) / 1e6 / max(cpu, 1e-9):.3f} M cycles per CPU second ({cpu:.2f} s CPU)")
        print(f"command: {' '.join(sys.argv)}")
    finally:
        nic.stop()
        remove(NS_NIC, NS_OUT)
    return 0


if __name__ == "__main__":
    sys.exit(main())
