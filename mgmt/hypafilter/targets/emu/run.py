"""EmuNic: starts an hf_emu process (optionally inside a network namespace, optionally in standby) and controls it."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import time
from pathlib import Path

from hypafilter import netns
from hypafilter.hw import regmap
from hypafilter.targets.base import PORTS
from hypafilter.targets.emu.build import EmuError
from hypafilter.targets.nic import EmuTransport, NicClient

RUN_DIR = Path("/run/hypafilter")


class EmuNic:
    """One running emulated NIC. `interfaces` maps wire0/wire1/host0/host1 to interface names."""

    def __init__(
        self,
        binary: str | Path,
        interfaces: dict[str, str],
        name: str = "hf",
        netns: str | None = None,
        standby: bool = False,
        run_dir: str | Path = RUN_DIR,
        settle_cycles: int | None = None,
        disable_offloads: bool = True,
    ):
        missing = [r for r in PORTS if r not in interfaces]
        if missing:
            raise EmuError("start", f"no interface given for {', '.join(missing)}")
        self.binary = Path(binary)
        self.interfaces = dict(interfaces)
        self.name = name
        self.netns = netns
        self.standby = standby
        self.run_dir = Path(run_dir)
        self.ctl_path = self.run_dir / f"{name}.sock"
        self.pid_path = self.run_dir / f"{name}.pid"
        self.log_path = self.run_dir / f"{name}.log"
        self.settle_cycles = settle_cycles
        self.disable_offloads = disable_offloads
        self.proc: subprocess.Popen | None = None
        self.ready_line = ""

    def argv(self) -> list[str]:
        argv = [str(self.binary)]
        for role in PORTS:
            argv += [f"--{role}", self.interfaces[role]]
        argv += ["--ctl", str(self.ctl_path), "--pidfile", str(self.pid_path)]
        for t in regmap.MAP.tables:
            argv += ["--table", f"{t.name}={t.id}"]
        if self.standby:
            argv.append("--standby")
        if self.settle_cycles is not None:
            argv += ["--settle", str(self.settle_cycles)]
        return argv

    def start(self, timeout: float = 15.0) -> EmuNic:
        if not self.binary.exists():
            raise EmuError("start", f"{self.binary} does not exist (build it with hypafilter.targets.emu.build)")
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if self.disable_offloads:
            for ifname in self.interfaces.values():
                netns.offloads_off(ifname, self.netns)
        log = open(self.log_path, "w")
        try:
            self.proc = netns.popen(
                self.argv(), self.netns, stdout=subprocess.PIPE, stderr=log, stdin=subprocess.DEVNULL
            )
        finally:
            log.close()
        self._wait_ready(timeout)
        return self

    def _stderr_tail(self) -> str:
        try:
            return self.log_path.read_text()[-3000:]
        except OSError:
            return ""

    def _wait_ready(self, timeout: float) -> None:
        assert self.proc and self.proc.stdout
        deadline = time.monotonic() + timeout
        buf = b""
        fd = self.proc.stdout.fileno()
        while b"\n" not in buf:
            left = deadline - time.monotonic()
            if left <= 0:
                self.kill()
                raise EmuError("start", f"no ready line within {timeout:.0f} s", self._stderr_tail())
            r, _, _ = select.select([fd], [], [], left)
            if r:
                chunk = os.read(fd, 4096)
                if not chunk:
                    self.proc.wait()
                    raise EmuError("start", f"hf_emu exited with {self.proc.returncode}", self._stderr_tail())
                buf += chunk
        self.ready_line = buf.split(b"\n", 1)[0].decode()
        if not self.ready_line.startswith("READY "):
            self.kill()
            raise EmuError("start", f"unexpected first line {self.ready_line!r}", self._stderr_tail())

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def client(self, timeout: float = 30.0) -> NicClient:
        return NicClient(EmuTransport(self.ctl_path, timeout))

    def _command(self, word: str) -> str:
        t = EmuTransport(self.ctl_path)
        try:
            return t.request(word)
        finally:
            t.close()

    def activate(self) -> None:
        self._command("ACTIVATE")
        self.standby = False

    def deactivate(self) -> None:
        """Standby: stop taking frames (frames already inside the core still leave)."""
        self._command("STANDBY")
        self.standby = True

    def stats(self) -> dict:
        t = EmuTransport(self.ctl_path)
        try:
            return t.stats()
        finally:
            t.close()

    def stop(self, timeout: float = 10.0) -> int | None:
        """SIGTERM, wait, then SIGKILL if it hangs; returns the exit status."""
        if not self.proc:
            return None
        if self.proc.poll() is None:
            # With `ip netns exec` the binary is exec'd in place, so the pid is hf_emu itself.
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        if self.proc.stdout:
            self.proc.stdout.close()
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def __enter__(self) -> EmuNic:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
