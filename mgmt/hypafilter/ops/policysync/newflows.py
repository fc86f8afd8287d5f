"""New flows followed live (docs/xdp.md "New flows", docs/flowsync.md "New flows on the NIC"): whether a frame that
conntrack holds no entry for may be decided as NEW or INVALID (ct 3) depends on the firewall namespace having no
helper, expectation, notrack rule or zone (`targets.xdp.newflows.why_not`). Deploy decides that once; the policy sync
worker keeps it true while the deployment runs, with a `NewFlows` watch:

- **at once** (fail safe): a foreign nf_tables commit that adds a rule or an object (the only messages that can bring
  `ct helper set`, `notrack`, `ct zone set`, a ct helper/expectation object or an xt CT/NOTRACK target), and a
  conntrack expectation's NEW event (ctnetlink NFNLGRP_CONNTRACK_EXP_NEW), withdraw the permission before anything is
  read: xdp: HFX_CT_NONE cleared in the program's hfx_config (one map write); the emulated NIC: the hold file
  (`HOLD_FILE`), which the flow sync service's COMPLETE renewal honours, and CTM_CONTROL cleared (COMPLETE off),
  under the hold's lock so that no renewal slips between;
- **then** the whole check runs (a few processes, tens of ms), after every foreign commit and every expectation's
  DESTROY event too, and after every sync of the worker (a follow wrote new tables); it restores the permission when
  it passes and the deployment allows it (the program looks conntrack up; the NIC's service keeps its structure);
- **polled** (no events): the legacy xtables raw table (iptables-legacy sends nothing to nf_tables; CT and NOTRACK
  are raw-only targets): its presence (/proc/net/ip_tables_names) and, when present, its entry count and size
  (IPT_SO_GET_INFO), every POLL_S; `net.netfilter.nf_conntrack_helper` where the kernel still has it (gone since
  Linux 6.0). `nf_conntrack_tcp_loose` needs nothing: it only chooses between NEW and INVALID, and ct 3 is decided
  only where both readings drop.

On xdp the withdrawal is the second line: the host's watcher (driver/xdp/setwatch.bpf.c) counts a legacy raw table's
replacement and an nf_tables batch that adds a rule or an object as it enters the kernel, and the program reads no
miss as ct 3 while that count differs from the one its permission was granted at (targets.xdp.newflows.Gate). A
grant is therefore made with the count read, every counted change returned, before the check began; a count that
moved (seen in the poll) asks for the check again, which grants anew. The emulated NIC cannot read the counts: there
the withdrawal is all (docs/flowsync.md).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import socket
import struct
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

from hypafilter import netns
from hypafilter.errors import HypafilterError
from hypafilter.ops.flowsync.hold import HOLD_FILE, held, hold_lock
from hypafilter.ops.locks import flock_now
from hypafilter.ops.netlink import NETLINK_NETFILTER, Netlink, NetlinkError

# include/uapi/linux/netfilter/nfnetlink.h, nfnetlink_conntrack.h
NFNLGRP_CONNTRACK_EXP_NEW, NFNLGRP_CONNTRACK_EXP_DESTROY = 4, 6
EXP_GROUPS = (1 << NFNLGRP_CONNTRACK_EXP_NEW - 1) | (1 << NFNLGRP_CONNTRACK_EXP_DESTROY - 1)
NFNL_SUBSYS_CTNETLINK_EXP = 2
IPCTNL_MSG_EXP_NEW, IPCTNL_MSG_EXP_DELETE = 0, 2

POLL_S = 0.05  # the legacy raw table and the helper sysctl are read this often
CT_LOOKUP, CT_NONE = 1, 2  # hfx_config.ct_flags (driver/xdp/hf_fastpath.h HFX_CT_LOOKUP, HFX_CT_NONE)
CFG_CT_FLAGS = 9  # the word of hfx_config that holds ct_flags

# linux/netfilter_ipv4/ip_tables.h: struct ipt_getinfo (name[32], valid_hooks, hook_entry[5], underflow[5],
# num_entries, size)
IPT_SO_GET_INFO = 64
IPT_GETINFO = struct.Struct("=32sI5I5III")
_libc = ctypes.CDLL(None, use_errno=True)


class ExpError(NetlinkError):
    peer = "ctnetlink (expectations)"


def parse_exp(data: bytes, off: int) -> str | None:
    """'new' or 'destroy' for an expectation event at data[off:] (None: another message)."""
    mtype = struct.unpack_from("=H", data, off + 4)[0]
    if mtype >> 8 != NFNL_SUBSYS_CTNETLINK_EXP:
        return None
    return {IPCTNL_MSG_EXP_NEW: "new", IPCTNL_MSG_EXP_DELETE: "destroy"}.get(mtype & 0xFF)


class ExpEvents(Netlink):
    """Conntrack's expectation events in a namespace: an expectation created (by a helper, or through ctnetlink:
    `conntrack -I expect`) or gone (matched, timed out, deleted)."""

    error = ExpError
    EVENTS_RCVBUF = 1 << 20

    def __init__(self, ns: str | None):
        super().__init__(ns, NETLINK_NETFILTER, EXP_GROUPS)

    def read_events(self) -> list[str]:
        return self.read(parse_exp)


class LegacyRaw:
    """The legacy xtables raw table of a namespace, read without a process: None while it does not exist (it is
    not created by looking: IPT_SO_GET_INFO would instantiate it, so it is asked only once the table is listed),
    else (entries, size)."""

    def __init__(self, ns: str | None):
        self.names_fd: int | None = None
        self.sock: socket.socket | None = None
        with netns.inside(ns):
            with contextlib.suppress(OSError):  # no ip_tables in this kernel: no legacy tables at all
                self.names_fd = os.open("/proc/thread-self/net/ip_tables_names", os.O_RDONLY)
            with contextlib.suppress(OSError):
                self.sock = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_RAW)

    def read(self) -> tuple[int, int] | None:
        if self.names_fd is None:
            return None
        names = os.pread(self.names_fd, 4096, 0).split()
        if b"raw" not in names:
            return None
        if self.sock is None:
            return (0, 0)
        # the table's name goes in and its info comes back in the same buffer (Python's getsockopt sends none)
        buf = ctypes.create_string_buffer(IPT_GETINFO.pack(b"raw", 0, *(0,) * 10, 0, 0), IPT_GETINFO.size)
        size = ctypes.c_uint32(IPT_GETINFO.size)
        if _libc.getsockopt(self.sock.fileno(), socket.IPPROTO_IP, IPT_SO_GET_INFO, buf, ctypes.byref(size)) != 0:
            return (-1, ctypes.get_errno())
        return IPT_GETINFO.unpack(buf.raw)[-2:]

    def close(self) -> None:
        if self.names_fd is not None:
            os.close(self.names_fd)
        if self.sock is not None:
            self.sock.close()


class HelperSysctl:
    """`net.netfilter.nf_conntrack_helper` of a namespace (automatic helper assignment), read through an fd opened
    there; None on kernels without it (Linux 6.0 removed it)."""

    def __init__(self, ns: str | None):
        self.fd: int | None = None
        with netns.inside(ns), contextlib.suppress(OSError):
            self.fd = os.open("/proc/sys/net/netfilter/nf_conntrack_helper", os.O_RDONLY)

    def read(self) -> str | None:
        return None if self.fd is None else os.pread(self.fd, 64, 0).decode().strip()

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)


def _pct(xs) -> dict:
    """p50, max and count of a series (ms), as the worker's status file gives its lags."""
    if not xs:
        return {"n": 0}
    s = sorted(xs)
    return {"n": len(s), "p50": round(s[len(s) // 2], 3), "max": round(s[-1], 3)}


# ---- the permission, per target ------------------------------------------------------------------------------------


class XdpPermission:
    """HFX_CT_NONE in the running program's hfx_config (its pin directory `pin`), read-modified-written under the
    deployment's lock (`deploy_lock_now`), and the count it is granted at (targets.xdp.newflows.Gate)."""

    def __init__(self, pin: str, ns: str | None = None):
        from hypafilter.targets.xdp.newflows import Gate

        self.path = Path(pin) / "hfx_cfg"
        self.gate = Gate(pin, ns)

    def settled(self) -> int | None:
        """The watcher's count of changes now, if every one counted has returned (None: not, or not counted)."""
        return self.gate.settled()

    def started(self) -> int | None:
        return self.gate.counts()[0] if self.gate.linked() else None

    def current(self) -> bool:
        """The program reads misses as ct 3 as far as the count goes (granted at the count now)."""
        return self.gate.linked() and self.gate.current()

    def _flags(self) -> int:
        from hypafilter.targets.bpfmap import PinnedArray

        with PinnedArray(self.path) as m:
            return struct.unpack_from("=I", m.read(), 4 * CFG_CT_FLAGS)[0]

    def allowed(self) -> bool:
        """The program looks conntrack up (its tables were written with HFX_CT_LOOKUP)."""
        return bool(self._flags() & CT_LOOKUP)

    def on(self) -> bool:
        return bool(self._flags() & CT_NONE)

    def set(self, on: bool, seq: int | None = None) -> None:
        """HFX_CT_NONE set (granted at count `seq`, written first) or cleared."""
        from hypafilter.targets.bpfmap import PinnedArray

        if on:
            if seq is None:
                return
            self.gate.grant(seq)
        with PinnedArray(self.path) as m:
            cur = bytearray(m.read())
            flags = struct.unpack_from("=I", cur, 4 * CFG_CT_FLAGS)[0]
            new = (flags | CT_NONE) if on and flags & CT_LOOKUP else flags & ~CT_NONE
            if new != flags:
                struct.pack_into("=I", cur, 4 * CFG_CT_FLAGS, new)
                m.write(bytes(cur))


@contextlib.contextmanager
def deploy_lock_now(state_dir: Path):
    """The deployment's lock (ops.deploy's deploy.lock), taken without waiting: yields whether it is held. The
    permission is written only under it: a deploy writes the program's whole configuration with its own check's
    answer, and a read-modify-write racing it would put back the old tables' configuration."""
    with flock_now(Path(state_dir) / "deploy.lock") as free:
        yield free


class NicPermission:
    """The emulated NIC's ct 3: COMPLETE, which the flow sync service sets and renews (ops.flowsync.members) while its
    conntrack membership structure is complete, and which it does not renew while the hold file exists."""

    def __init__(self, state_dir: Path, tgt, nic: dict):
        self.state_dir, self.tgt, self.nic = Path(state_dir), tgt, nic

    def allowed(self) -> bool:
        """The flow sync service keeps the structure (it runs with --members)."""
        from hypafilter.ops.flowsync.service import SERVICE as FLOWSYNC

        doc = FLOWSYNC.read_status_file(self.state_dir) or {}
        return bool(doc.get("running") and doc.get("members"))

    def on(self) -> bool:
        return not held(self.state_dir)

    def settled(self) -> int | None:
        return 0  # a NIC cannot read the watcher's counts: the withdrawal is all

    def started(self) -> int | None:
        return None

    def current(self) -> bool:
        return True

    def set(self, on: bool, seq: int | None = None) -> None:
        path = self.state_dir / HOLD_FILE
        with hold_lock(self.state_dir):
            if on:
                path.unlink(missing_ok=True)
                return
            tmp = path.with_suffix(".tmp")
            tmp.write_text("new flows withheld by the policy sync service\n")
            tmp.replace(path)
            with self.tgt.client(self.nic) as c:
                c.ctm_complete(0)


# ---- the watch -------------------------------------------------------------------------------------------------------


class NewFlows:
    """The deployment's new-flow permission followed live (module docstring). `busy()` says whether a deploy holds
    the deployment's lock (the permission is then written after it)."""

    def __init__(
        self,
        ns: str | None,
        state_dir: Path,
        log: Callable[[str], None],
        busy: Callable[[], bool],
        *,
        check: Callable[[str | None], str] | None = None,
        sources: tuple | None = None,
        permission=None,
    ):
        """`check`, `sources` (the expectation events, legacy raw table and sysctl readers) and `permission` (one
        fixed permission instead of the deployment's) are the namespace's own unless given (tests/unit)."""
        self.ns, self.state_dir, self.log, self.busy = ns, Path(state_dir), log, busy
        self.check = check
        self.fixed = permission
        self.exp, self.legacy, self.sysctl = sources or (ExpEvents(ns), LegacyRaw(ns), HelperSysctl(ns))
        self.seen_legacy = self.legacy.read()
        self.seen_sysctl = self.sysctl.read()
        self.next_poll = time.monotonic() + POLL_S
        self.perm = None
        self.pin = ""
        self.why = ""  # the last check's answer ("": nothing against ct 3)
        self.want_check = True  # run the check at the next step
        self.want_off = False  # withdraw at the next chance (a deploy held the lock)
        self.t_off: float | None = None  # when the pending withdrawal's cause was read
        self.error = ""
        self.counts = {"checks": 0, "withdrawals": 0, "restores": 0, "exp_events": 0, "polled_changes": 0}
        self.counts["regrants"] = 0  # the permission granted again at a newer count (xdp: a counted change passed)
        self.check_seq: int | None = None  # the count read before the running check began (None: not settled)
        self.grant_seq: int | None = None  # the count the last check's clean answer holds at
        self.seen_started: int | None = None  # the count at the last poll
        self.lag_withdraw: deque[float] = deque(maxlen=2000)  # ms: the cause read -> the permission withdrawn
        self.check_ms: deque[float] = deque(maxlen=2000)
        self.checking: threading.Thread | None = None  # the check running now
        self.result: tuple[str, float] = ("", 0.0)  # its answer and duration (ms)

    def fileno(self) -> int:
        return self.exp.events.fileno()

    def close(self) -> None:
        self.exp.close()
        self.legacy.close()
        self.sysctl.close()

    def _permission(self, st: dict | None):
        """The permission of the deployment `st` (None: nothing to follow: no conntrack lookup, not a target with
        ct 3)."""
        from hypafilter.ops import deploy

        if self.fixed is not None:
            return self.fixed
        if not st:
            return None
        key = st.get("target", "") + ":" + str(st.get("generation")) + ":" + str((st.get("nic") or {}).get("pin"))
        if key == self.pin and self.perm is not None:
            return self.perm
        self.pin, self.perm = key, None
        if st.get("target") == "xdp" and (st.get("nic") or {}).get("pin"):
            perm = XdpPermission(st["nic"]["pin"], self.ns)
            with contextlib.suppress(HypafilterError, OSError):  # unreadable: a program being replaced, next time
                self.perm = perm if perm.allowed() else None
        elif st.get("target") == "emu" and (st.get("flowsync") or {}).get("new_flows") == "decided":
            self.perm = NicPermission(self.state_dir, deploy.target_of(st, deploy.state_config(st)), st["nic"])
        return self.perm

    def withdraw(self, t0: float, st: dict | None) -> None:
        """Clear the permission now (a cause read at `t0`), and check again at the next step."""
        self.want_check = True
        self.want_off = True
        if self.t_off is None:
            self.t_off = t0
        self._apply(st)

    def intake(self, t0: float, st: dict | None) -> None:
        """The expectation events queued now: a NEW withdraws at once, a DESTROY asks for the check."""
        try:
            evs = self.exp.read_events()
        except OSError as e:
            if e.errno != errno.ENOBUFS:
                raise
            evs = ["new"]  # lost: one may have been a NEW
        self.counts["exp_events"] += len(evs)
        if "new" in evs:
            self.withdraw(t0, st)
        elif evs:
            self.want_check = True

    def poll(self, t0: float, st: dict | None) -> float:
        """The legacy raw table and the helper sysctl when due; returns the seconds until the next poll."""
        if t0 < self.next_poll:
            return self.next_poll - t0
        self.next_poll = t0 + POLL_S
        perm = self._permission(st)
        if perm is not None:  # the watcher's count: a change counted asks for the check (the program already holds)
            with contextlib.suppress(HypafilterError, OSError):
                started = perm.started()
                if started != self.seen_started:
                    self.seen_started = started
                    self.want_check = self.want_check or bool(self.why)  # it may have lifted the reason
                covered = self.grant_seq == started or (self.checking is not None and self.check_seq == started)
                if not self.why and not covered and not perm.current():
                    self.want_check = True  # no check answers for the count now (one began before it, or unsettled)
        legacy, sysctl = self.legacy.read(), self.sysctl.read()
        if legacy != self.seen_legacy or sysctl != self.seen_sysctl:
            self.seen_legacy, self.seen_sysctl = legacy, sysctl
            self.counts["polled_changes"] += 1
            if legacy is not None or sysctl == "1":
                self.withdraw(t0, st)  # a legacy raw table changed (it may now hold a CT rule), or helpers automatic
            else:
                self.want_check = True
        return self.next_poll - t0

    def step(self, st: dict | None) -> None:
        """Collect a finished check, start one if asked for (in a thread: it runs a few processes, and the worker's
        loop must not wait for them), and set the permission as they say (not while a deploy holds the lock)."""
        if self.checking is not None and not self.checking.is_alive():
            self.checking = None
            why, ms = self.result
            self.check_ms.append(ms)
            self.counts["checks"] += 1
            if why != self.why:
                self.log(f"new flows: {why or 'nothing against deciding them (ct 3)'}")
            self.why = why
            self.grant_seq = None if why else self.check_seq
            if why:
                self.want_off = True
        if self.busy():
            return
        if self._permission(st) is None:  # nothing to follow (no lookup on xdp, no structure on the NIC)
            self.want_check = self.want_off = False
            self.t_off = None
            return
        if self.want_check and self.checking is None:
            self.want_check = False
            try:  # read before the check begins: what it grants holds while no change is counted after it
                self.check_seq = self._permission(st).settled()
            except (HypafilterError, OSError):
                self.check_seq = None
            self.checking = threading.Thread(target=self._run_check, name="newflows", daemon=True)
            self.checking.start()
        self._apply(st)

    def _run_check(self) -> None:
        from hypafilter.targets.xdp import newflows

        t = time.monotonic()
        try:
            why = (self.check or newflows.why_not)(self.ns)
        except Exception as e:  # unreadable: withheld
            why = f"the check failed: {e}"
        self.result = (why, (time.monotonic() - t) * 1000)

    def pending(self) -> bool:
        """Work for the next `step`: a check to start or to collect, a withdrawal deferred."""
        return self.want_check or self.want_off or self.checking is not None

    def _apply(self, st: dict | None) -> None:
        try:
            perm = self._permission(st)
            if perm is None:
                self.want_off, self.t_off = False, None
                return
            with deploy_lock_now(self.state_dir) as free:
                if not free:  # a deploy (or this worker's own follow) writes the configuration now: after it
                    self.want_check = True
                    return
                if self.want_off or self.why:
                    if perm.on():
                        perm.set(False)
                        self.counts["withdrawals"] += 1
                        if self.t_off is not None:
                            self.lag_withdraw.append((time.monotonic() - self.t_off) * 1000)
                    self.t_off, self.want_off = None, False  # withdrawn; the check to come decides whether it stays
                elif (
                    not self.want_check
                    and self.checking is None
                    and self.grant_seq is not None
                    and not (perm.on() and perm.current())
                    and perm.started() in (None, self.grant_seq)  # else stale: the poll asks for a check
                    and perm.allowed()
                ):
                    was = perm.on()
                    perm.set(True, self.grant_seq)
                    if was:
                        self.counts["regrants"] += 1
                    else:
                        self.counts["restores"] += 1
                        self.log("new flows: decided again (ct 3)")
            self.error = ""
        except (HypafilterError, OSError) as e:
            if str(e) != self.error:
                self.log(f"new flows: {e}")
            self.error = str(e)

    def decided(self, st: dict | None) -> bool | None:
        perm = self._permission(st)
        if perm is None:
            return None
        try:
            return perm.on() and perm.allowed() and perm.current()
        except (HypafilterError, OSError):
            return None

    def doc(self, st: dict | None) -> dict:
        return {
            "decided": self.decided(st),
            "why_not": self.why,
            "error": self.error,
            **self.counts,
            "lag_withdraw_ms": _pct(self.lag_withdraw),
            "check_ms": _pct(self.check_ms),
        }
