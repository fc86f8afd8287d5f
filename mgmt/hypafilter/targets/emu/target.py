"""Target `emu`: the emulated NIC (a Verilator model of the generated core) on veths of this host."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from hypafilter.hw import regmap, settable
from hypafilter.hw.model import CONTROL_SHUNT_ALL
from hypafilter.ir.sets import MAX_SET_SLOTS
from hypafilter.targets.base import DECISIONS, PORTS, SHUNTED, Expected, Target, WindowStages
from hypafilter.targets.emu.build import build
from hypafilter.targets.emu.run import RUN_DIR, EmuNic
from hypafilter.targets.nic import EmuTransport, NicError


def window_balance(r: dict, host: bool) -> dict[str, tuple[int, Expected]]:
    """verify's counter window on the emulated NIC's lab (WindowStages.balance): the NIC's namespace took all N
    frames (by id) from the sender; the NIC classified every frame that reached its wire ports (PKTIN) and decided
    each (DECISIONS); it sent out every frame it decided or took back from the host (PKTOUT = forwarded + shunted +
    CNT_FROM_HOST, plus the mirrored DROPs) and its veths carried each of them (log mirroring: in bridge mode a
    mirrored ACCEPT twice, the wire veths carrying forwarded + CNT_FROM_HOST and the host veths shunted + CNT_MIRROR;
    the core's counters do not tell mirrored ACCEPTs from DROPs, so PKTOUT is only bounded by them, the veths count
    exactly); the firewall took every frame the NIC gave it; the NIC took
    back every frame the firewall's bridge forwarded (CNT_FROM_HOST); the receiver captured every frame the NIC
    sent it (not in host mode, where the frames end at the firewall's bridge)."""
    n, nic, tap = r["sent"], r["nic"], r["tapped"]
    tx = {k: v["tx"] for k, v in r["dev"].items()}
    shunted = sum(nic[k] for k in SHUNTED)
    # a mirrored frame (CNT_MIRROR, also counted as forwarded or dropped) leaves the core once (PKTOUT); a mirrored
    # DROP goes to the host alone, a mirrored ACCEPT to its wire port AND the host (bridge) or the host alone (host)
    mirrored = nic.get("CNT_MIRROR", 0)
    sent = nic["CNT_FORWARDED"] + shunted + nic["CNT_FROM_HOST"]
    wire_tx, host_tx = tx["nic.wire0"] + tx["nic.wire1"], tx["nic.host0"] + tx["nic.host1"]
    want = {
        "NIC took ours": (tap["nic.wire0.ours"], n),
        "NIC classified": (nic["PKTIN"], tap["nic.wire0"] + tap["nic.wire1"]),
        "NIC decided": (sum(nic[k] for k in DECISIONS), nic["PKTIN"]),
        "NIC sent": (nic["PKTOUT"], (sent, sent + mirrored)),
        "NIC veths carried": (wire_tx + host_tx, nic["PKTOUT"] if host else sent + mirrored),
        "firewall took": (tap["fw.nf0"] + tap["fw.nf1"], host_tx),
        "NIC took back": (nic["CNT_FROM_HOST"], tx["fw.nf0"] + tx["fw.nf1"]),
    }
    if not host:
        want["NIC wire veths carried"] = (wire_tx, nic["CNT_FORWARDED"] + nic["CNT_FROM_HOST"])
        want["receiver captured, hybrid"] = (r["captured"]["hybrid"], tx["nic.wire1"])
    return want


WINDOW = WindowStages(
    tx=(
        ("send", "hyb0"),
        ("nic", "wire0"),
        ("nic", "wire1"),
        ("nic", "host0"),
        ("nic", "host1"),
        ("fw", "nf0"),
        ("fw", "nf1"),
    ),
    taps=(
        ("nic", "wire0", True),
        ("nic", "wire0", False),
        ("nic", "wire1", False),
        ("fw", "nf0", False),
        ("fw", "nf1", False),
    ),
    counters=("PKTIN", "PKTOUT", *DECISIONS, "CNT_MIRROR", "CNT_FROM_HOST", "CNT_FIFO_DROP"),
    lost=("CNT_FIFO_DROP",),
    balance=window_balance,
)


class EmuTarget(Target):
    """Builds, starts and stops hf_emu processes; `info` names the process (pid) and its control socket."""

    name = "emu"
    window_stages = WINDOW
    # the core's set membership tables (hw/hf_set_table.vhd, docs/hardware.md "Set tables"): one per slot, the
    # default geometry's element cells each
    set_slots = MAX_SET_SLOTS
    set_capacity = settable.DEFAULT_GEOMETRY.capacity
    # a dual-stack core's IPv6 slots: tables with 128-bit keys (hf_set_table's V6, tables SET6_*), the same geometry
    set_slots6 = True
    # NICs started by this process, by pid, so that stopping one also reaps it.
    started: dict[int, EmuNic] = {}

    def build(self, plan) -> str:
        return str(build(plan, self.config, build_root=self.build_root))

    def start(self, artifact: str, generation: int, standby: bool = True) -> dict:
        name = f"{self.site.name}-g{generation}"
        interfaces = dict(self.site.interfaces) or {p: p for p in PORTS}
        run_dir = self.site.run_dir or RUN_DIR
        nic = EmuNic(artifact, interfaces, name=name, netns=self.site.netns, standby=standby, run_dir=run_dir)
        nic.start()
        assert nic.pid is not None
        EmuTarget.started[nic.pid] = nic
        return {"binary": artifact, "name": name, "pid": nic.pid, "socket": str(nic.ctl_path)}

    def transport(self, info: dict, timeout: float = 30.0) -> EmuTransport:
        return EmuTransport(info["socket"], timeout)

    def _command(self, info: dict, word: str) -> None:
        t = self.transport(info)
        try:
            t.command(word)
        finally:
            t.close()

    # control connections kept open for `shunt_all_now` (the policy sync service's fail safe), by socket path
    _fast: dict[str, EmuTransport] = {}

    def shunt_all_now(self, info: dict) -> None:
        """CONTROL bit 1 set by one `S` request (the harness reads and writes the register) on a connection kept
        open for it: the fail safe costs one round trip of the control socket, no connect. A connection the NIC
        closed (a replaced NIC, a restart) is opened again once."""
        path = info["socket"]
        for gone in [p for p in EmuTarget._fast if p != path and not Path(p).exists()]:  # NICs stopped since
            EmuTarget._fast.pop(gone).close()
        line = f"S 0x{regmap.MAP.reg('CONTROL').offset:x} 0x{CONTROL_SHUNT_ALL:x}"
        for attempt in (0, 1):
            t = EmuTarget._fast.get(path)
            if t is None:
                t = EmuTarget._fast[path] = EmuTransport(path, timeout=10.0)
            try:
                t.request(line)
                return
            except (NicError, OSError):
                EmuTarget._fast.pop(path, None)
                t.close()
                if attempt:
                    raise

    def activate(self, info: dict) -> None:
        self._command(info, "ACTIVATE")

    def standby(self, info: dict) -> None:
        self._command(info, "STANDBY")

    @staticmethod
    def _ours(info: dict) -> bool:
        """Whether the pid of `info` is still that NIC (pids are reused)."""
        try:
            cmdline = Path(f"/proc/{int(info['pid'])}/cmdline").read_bytes()
        except (OSError, KeyError, ValueError):
            return False
        return info.get("socket", "").encode() in cmdline

    def alive(self, info: dict) -> bool:
        return self._ours(info) and Path(info["socket"]).exists()

    def stop(self, info: dict, timeout: float = 10.0) -> None:
        """Stop the NIC and remove what it left behind (socket, pid file, log)."""
        try:
            self._stop(info, timeout)
        finally:
            sock = Path(info.get("socket", ""))
            if sock.name.endswith(".sock"):
                for suffix in (".sock", ".pid", ".log"):
                    sock.with_suffix(suffix).unlink(missing_ok=True)

    def _stop(self, info: dict, timeout: float) -> None:
        pid = int(info["pid"])
        nic = EmuTarget.started.pop(pid, None)
        if nic is not None:
            nic.stop()
            return
        if not self._ours(info):  # started by an earlier command and gone since
            return
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                st = Path(f"/proc/{pid}/stat").read_text()
            except OSError:
                return
            if st.rsplit(")", 1)[1].split()[0] == "Z":
                return
            time.sleep(0.02)
        os.kill(pid, signal.SIGKILL)
