"""Commands run on this host or inside a network namespace, and this thread moved into one: the tool's one
subprocess helper. Every command the tool (and its sim tests) waits for goes through `run` (`ip netns exec`,
iptables, ethtool, GHDL, yosys, Verilator, Vivado, make), every background process through `popen`."""

from __future__ import annotations

import collections
import contextlib
import ctypes
import os
import shlex
import subprocess
import sys
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

from hypafilter.errors import HypafilterError

NETNS_DIR = Path("/run/netns")
CLONE_NEWNET = 0x40000000
# A command the tool runs in a namespace (ip, iptables, sysctl, ethtool, its own loaders) ends in seconds; a hung
# one must not hang a deploy or a test. Builds and benchmarks pass timeout=None.
TIMEOUT = 60.0
STDERR_TAIL = 2000  # characters of a failed command's output quoted in the error
# Offloads that make veth hand AF_PACKET merged super-frames or frames without a valid checksum.
OFFLOADS = ("gro", "gso", "tso", "tx", "rx", "sg", "rxvlan", "txvlan", "lro")

_libc = ctypes.CDLL(None, use_errno=True)


class CommandError(HypafilterError):
    """A command could not start, timed out or exited non-zero; quotes the command line and its stderr.

    `returncode` is None when the command never ran to an exit status (not installed, timed out)."""

    def __init__(
        self, argv: Sequence[str], why: str, returncode: int | None = None, stderr: str = "", stdout: str = ""
    ):
        self.argv = list(argv)
        self.returncode = returncode
        self.stderr = stderr
        self.stdout = stdout
        tail = (stderr.strip() or stdout.strip())[-STDERR_TAIL:]
        super().__init__(f"{shlex.join(self.argv)}: {why}" + (f"\n{tail}" if tail else ""))


# The pids of the last commands this process ran (`run`): an nf_tables change event names the process that committed
# it, so a service that both follows the ruleset and writes to it knows its own changes (ops.policysync).
SPAWNED: collections.deque[int] = collections.deque(maxlen=256)


def argv_in(ns: str | None, argv: Sequence[str]) -> list[str]:
    """argv run inside namespace `ns` (None: here) by `ip netns exec`, which execs it in place (same pid)."""
    return ["ip", "netns", "exec", ns, *argv] if ns else list(argv)


def run(
    argv: Sequence[str],
    ns: str | None = None,
    *,
    input: str | None = None,
    check: bool = True,
    timeout: float | None = TIMEOUT,
    cwd: str | Path | None = None,
    env: Mapping[str, str] | None = None,
    echo: bool = False,
) -> str:
    """Run argv (inside namespace `ns` if given, in directory `cwd`, with environment `env` if given) with `input`
    on stdin; returns its stdout. With `echo` its output goes to our stderr as it runs (a long build) instead.

    CommandError when it is not installed or exceeds `timeout`, and with `check` when it exits non-zero."""
    full = argv_in(ns, argv)
    pipe = None if echo else subprocess.PIPE
    try:
        with subprocess.Popen(
            full,
            stdin=subprocess.PIPE if input is not None else None,
            stdout=sys.stderr if echo else pipe,
            stderr=pipe,
            text=True,
            cwd=cwd,
            env=env,
        ) as p:
            SPAWNED.append(p.pid)
            try:
                out, err = p.communicate(input, timeout=timeout)
            except subprocess.TimeoutExpired as e:
                p.kill()
                _, err = p.communicate()
                raise CommandError(full, f"no exit within {timeout:g} s", stderr=_text(err)) from e
    except FileNotFoundError as e:
        raise CommandError(full, "not installed (scripts/setup.sh system installs it)") from e
    except OSError as e:
        raise CommandError(full, f"cannot run it: {e.strerror or e}") from e
    if check and p.returncode != 0:
        raise CommandError(full, f"exit status {p.returncode}", p.returncode, err or "", out or "")
    return out or ""


def sysctl(key: str, ns: str | None = None) -> str:
    """A sysctl's value as namespace `ns` sees it, read from /proc/sys without a helper process (the net.* files
    answer for the network namespace the reader is in when it opens them)."""
    path = "/proc/sys/" + key.replace(".", "/")
    with inside(ns), open(path) as f:
        return f.read().strip()


def succeeds(argv: Sequence[str], ns: str | None = None, timeout: float | None = TIMEOUT) -> bool:
    """Whether argv exits 0 (a check such as `iptables -C`); False also when it cannot run."""
    try:
        run(argv, ns, timeout=timeout)
    except CommandError:
        return False
    return True


def popen(argv: Sequence[str], ns: str | None = None, **kw) -> subprocess.Popen:
    """A background process inside namespace `ns` (its pid is the command's own, see argv_in)."""
    return subprocess.Popen(argv_in(ns, argv), **kw)


def reap(proc: subprocess.Popen) -> None:
    """A process started with pipes (popen) gone for good: killed and waited for if it still runs, its pipes closed."""
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    for f in (proc.stdin, proc.stdout, proc.stderr):
        try:
            if f is not None:
                f.close()
        except (OSError, ValueError):
            pass


def _text(b: bytes | str | None) -> str:
    return b.decode(errors="replace") if isinstance(b, bytes) else (b or "")


# ---- namespaces ---------------------------------------------------------------------------------------------------


def exists(ns: str) -> bool:
    return (NETNS_DIR / ns).exists()


def names() -> list[str]:
    """Named namespaces of this host (`ip netns list` prints `name (id: N)`)."""
    return [line.split()[0] for line in run(["ip", "netns", "list"]).splitlines() if line.strip()]


def add(ns: str) -> None:
    run(["ip", "netns", "add", ns])


def delete(ns: str) -> None:
    """Remove namespace `ns` if it exists (its interfaces go with it)."""
    run(["ip", "netns", "del", ns], check=False)


def pids(ns: str) -> list[int]:
    return [int(p) for p in run(["ip", "netns", "pids", ns], check=False).split()]


def veth(a: str, a_ns: str | None, b: str, b_ns: str | None, mtu: int | None = None) -> None:
    """A veth pair: end `a` in namespace `a_ns`, end `b` in `b_ns` (None: this namespace), both at `mtu`."""
    opts = ["mtu", str(mtu)] if mtu else []
    a_at = ["netns", a_ns] if a_ns else []
    b_at = ["netns", b_ns] if b_ns else []
    run(["ip", "link", "add", a, *a_at, *opts, "type", "veth", "peer", "name", b, *b_at, *opts])


def offloads_off(ifname: str, ns: str | None = None) -> None:
    """Turn off the offloads that would change what a frame mover or capture sees (features a driver lacks are
    skipped: ethtool refuses them one by one)."""
    for feature in OFFLOADS:
        run(["ethtool", "-K", ifname, feature, "off"], ns, check=False)


@contextlib.contextmanager
def inside(ns: str | None) -> Iterator[None]:
    """Run the body with this thread in network namespace `ns` (None: stay); always switches back.

    Sockets opened in the body stay in `ns` after it, which is how a process talks on several namespaces."""
    if not ns:
        yield
        return
    back = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    try:
        target = os.open(NETNS_DIR / ns, os.O_RDONLY)
    except OSError:
        os.close(back)
        raise
    try:
        if _libc.setns(target, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into network namespace {ns}")
        try:
            yield
        finally:
            if _libc.setns(back, CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), "setns back to the original network namespace")
    finally:
        os.close(back)
        os.close(target)
