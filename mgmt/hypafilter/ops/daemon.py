"""A supervised service of a deployment, whatever it does: `Service` is its files in the state directory (pid
file, status file, log), its start (`python -m hypafilter NAME run ...` in a new session, ready once it wrote its
first status file), its stop, whether it runs and its status, and its supervisor, which runs the service's worker in
a forked child and starts another when one ends abnormally.

A service is a subclass (the flow sync service, ops.flowsync.service.SERVICE, is the first) that gives its name and
worker and answers what deploy asks of it (`why_not`, `record`, `launch`, `down`; ops.services runs the list).
"""

from __future__ import annotations

import abc
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from hypafilter.errors import HypafilterError

READY_TIMEOUT = 20.0  # seconds `start` waits for the service's first status file
PR_SET_PDEATHSIG = 1
EXIT_NOT_READY = 3  # a worker that failed before it was opened (no table to write, no access to the kernel)


def write_json(path: Path, data: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    tmp.replace(path)


def with_reaped(pid: int) -> None:
    """Reap `pid` if it is our child (started by `start` in this process)."""
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass


@dataclass(frozen=True)
class Service(abc.ABC):
    """A service called `name`: its files NAME.pid, NAME.json (status) and NAME.log in the state directory, its
    command `hypafilter NAME run`, its messages; `noun` is what messages call it ("flow sync service")."""

    name: str
    noun: str

    @property
    def title(self) -> str:
        return f"the {self.noun}"

    def state_path(self, state_dir: Path) -> Path:
        return Path(state_dir) / f"{self.name}.json"

    def pid_path(self, state_dir: Path) -> Path:
        return Path(state_dir) / f"{self.name}.pid"

    def log_path(self, state_dir: Path) -> Path:
        return Path(state_dir) / f"{self.name}.log"

    def write_status_file(self, state_dir: Path, doc: dict) -> None:
        write_json(self.state_path(state_dir), doc)

    def read_status_file(self, state_dir: Path) -> dict | None:
        try:
            return json.loads(self.state_path(Path(state_dir)).read_text())
        except (OSError, ValueError):
            return None

    # ---- what deploy asks (ops.services) -----------------------------------------------------------------------

    @abc.abstractmethod
    def why_not(self, policy, plan, tgt, nic: dict) -> str:
        """Why the service does not run for this deployment ("": it runs)."""

    @abc.abstractmethod
    def record(self, tgt) -> dict:
        """What the deployment's record of the service keeps besides wanted, pid and reason (how it runs)."""

    @abc.abstractmethod
    def launch(self, ns: str | None, state_dir: Path, tgt) -> int:
        """Start the service for the deployment on `tgt` (`start` with its options); its pid."""

    @abc.abstractmethod
    def down(self, tgt) -> str:
        """What is left undone while the service does not run (the drift wording)."""

    # ---- start, stop, status ---------------------------------------------------------------------------------------

    def problems(self, state_dir: Path) -> list[str]:
        """Drift the running service reports itself (status exits 1 on any): none by default."""
        return []

    def alive(self, pid: int) -> bool:
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return False
        return self.name.encode() in cmdline and stat.rsplit(")", 1)[1].split()[0] != "Z"

    def running_pid(self, state_dir: Path) -> int | None:
        """The supervisor's pid while it runs (its worker may be restarting: `not_serving` tells), else None."""
        try:
            pid = int(self.pid_path(state_dir).read_text().strip())
        except (OSError, ValueError):
            return None
        return pid if self.alive(pid) else None

    def not_serving(self, state_dir: Path) -> str:
        """Why the service does not serve now ("": it does): its supervisor is not running; or it runs but its
        worker does not: the supervisor is restarting one (after an abnormal end; the status file says so, or still
        names a worker that is gone, before the supervisor has noticed), or the first one has not finished its
        start (the status file names no worker of this supervisor yet)."""
        pid = self.running_pid(state_dir)
        if pid is None:
            return "is not running"
        doc = self.read_status_file(state_dir) or {}
        if doc.get("restarting"):
            return f"is restarting its worker (the last one exited {doc.get('last_exit')})"
        worker = doc.get("worker")
        if doc.get("pid") != pid or not doc.get("running") or not worker:
            return "is starting (its worker has not finished its start)"
        if not self.alive(worker):
            return f"is restarting its worker (worker {worker} is gone)"
        return ""

    def start(
        self, ns: str | None, state_dir: Path, options: Sequence[str] = (), timeout: float = READY_TIMEOUT
    ) -> int:
        """Start `hypafilter NAME run --ns NS --state-dir DIR OPTIONS` (a running one is stopped first); returns
        its pid once it wrote its first status file, raises HypafilterError if it exits before."""
        state_dir = Path(state_dir)
        self.stop(state_dir)
        self.state_path(state_dir).unlink(missing_ok=True)
        log = open(self.log_path(state_dir), "ab")  # the child keeps it
        argv = [sys.executable, "-m", "hypafilter", self.name, "run", "--ns", ns, "--state-dir", str(state_dir)]
        argv += options
        p = subprocess.Popen(argv, stdout=log, stderr=log, stdin=subprocess.DEVNULL, start_new_session=True)
        log.close()
        self.pid_path(state_dir).write_text(f"{p.pid}\n")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if p.poll() is not None:
                tail = self.log_path(state_dir).read_text(errors="replace")[-800:]
                self.pid_path(state_dir).unlink(missing_ok=True)
                raise HypafilterError(f"{self.title} exited ({p.returncode}): {tail.strip()}")
            doc = self.read_status_file(state_dir)
            if doc and doc.get("running") and doc.get("pid") == p.pid:
                return p.pid
            time.sleep(0.05)
        self.stop(state_dir)
        raise HypafilterError(f"{self.title} did not get ready within {timeout:g} s")

    def stop(self, state_dir: Path, timeout: float = 10.0) -> bool:
        """Stop the service if it runs (SIGTERM: its worker cleans up and exits); True if one was running."""
        state_dir = Path(state_dir)
        pid = self.running_pid(state_dir)
        self.pid_path(state_dir).unlink(missing_ok=True)
        if pid is None:
            return False
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.alive(pid):
                break
            time.sleep(0.02)
        else:
            os.kill(pid, signal.SIGKILL)
        with_reaped(pid)
        return True

    def status(self, state_dir: Path, wanted: dict | None = None) -> dict:
        """The service as `status` shows it: wanted (from the deployment's record, whose other fields, such as how
        it runs, fill in what the status file lacks), running (its worker serves: `not_serving`), why not, and its
        counters."""
        doc = self.read_status_file(state_dir) or {}
        why = self.not_serving(state_dir)
        out = {**doc, "running": not why, "down": why}
        if wanted is not None:
            for k, v in wanted.items():
                if k not in ("wanted", "reason", "pid"):
                    out.setdefault(k, v)
            out["wanted"] = bool(wanted.get("wanted"))
            out["reason"] = wanted.get("reason", "")
        return out

    # ---- the supervisor ----------------------------------------------------------------------------------------

    def supervise(
        self,
        state_dir: Path,
        open_worker: Callable[[], Callable[[int, int], None]],
        recover: tuple[str, Callable[[], None]] | None = None,
        ident: dict | None = None,
        keepalive: tuple[float, Callable[[], None]] | None = None,
    ) -> int:
        """The service process: runs a worker in a forked child and, when the child ends other than by a stop (an
        exception, a kill), recovers and starts another. The child gets SIGTERM if the supervisor dies
        (PR_SET_PDEATHSIG), so it never runs unsupervised. Returns the exit status: 0 after a stop, 1 when the
        first child failed before it was ready (nothing to supervise).

        `open_worker()` runs in the child and opens what the worker needs; the worker it returns is called with
        the supervisor's pid (the one its status file names, which `stop` signals) and the number of children
        that ended abnormally before, and runs until SIGTERM; it is ready once its status file names its pid as
        `worker`. `recover`: (what, fn), run between an abnormal end and the next child (what: for the log);
        `ident`: what the status file says of the service meanwhile besides its state; `keepalive`: (period, fn), run
        every period seconds from the abnormal end until the next child starts (the policy sync service renews its
        lease: a worker renews it while it runs)."""
        import ctypes

        state_dir = Path(state_dir)
        me = os.getpid()
        stopping: list[int] = []
        child: list[int] = []

        def on_stop(*_):
            stopping.append(1)
            for pid in child:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGTERM)

        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, on_stop)
        restarts, delay, ever_ready = 0, 0.5, False
        while not stopping:
            t0 = time.monotonic()
            pid = os.fork()
            if pid == 0:  # the worker
                code = EXIT_NOT_READY
                try:
                    for sig in (signal.SIGTERM, signal.SIGINT):
                        signal.signal(sig, signal.SIG_DFL)
                    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
                    if os.getppid() != me:  # the supervisor died before the prctl
                        os._exit(0)
                    work = open_worker()
                    code = 1
                    work(me, restarts)
                    code = 0
                except BaseException:
                    import traceback

                    traceback.print_exc()
                    sys.stderr.flush()
                os._exit(code)
            child[:] = [pid]
            _, status = os.waitpid(pid, 0)
            child.clear()
            code = os.waitstatus_to_exitcode(status)
            doc = self.read_status_file(state_dir) or {}
            ever_ready |= doc.get("worker") == pid
            if stopping:
                break
            what, fn = recover or ("", None)
            print(
                f"{self.name}: worker {pid} ended ({code})" + (f"; {what}" if what else ""),
                file=sys.stderr,
                flush=True,
            )
            if not ever_ready and code == EXIT_NOT_READY:
                return 1
            self.write_status_file(
                state_dir,
                {"running": False, "restarting": True, "pid": me, "last_exit": code, **(ident or {})},
            )
            if fn is not None:
                try:
                    fn()
                except Exception as e:  # what it recovers from is gone: the next worker fails and says so
                    print(f"{self.name}: {what}: {e}", file=sys.stderr, flush=True)
            restarts += 1
            delay = 1.0 if time.monotonic() - t0 > 30 else min(delay * 2, 30.0)
            deadline = time.monotonic() + delay
            kept = 0.0
            while not stopping and time.monotonic() < deadline:
                if keepalive is not None and time.monotonic() - kept >= keepalive[0]:
                    kept = time.monotonic()
                    try:
                        keepalive[1]()
                    except Exception as e:  # said in the log; the next worker tries again
                        print(f"{self.name}: keepalive: {e}", file=sys.stderr, flush=True)
                time.sleep(0.05)
        return 0
