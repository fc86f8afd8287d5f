"""The flow sync service as a process: `serve`, its worker, runs the Syncer against conntrack's sockets in the
firewall namespace and the table (the NIC's flow cache through NicClient, or the xdp target's `LiberalMarks`);
`SERVICE` is its place in the generic runner (ops.daemon: files flowsync.{pid,json,log}, start, stop, status, the
supervisor that clears the flow table after a worker's abnormal end) and what it answers deploy (ops.services)."""

from __future__ import annotations

import contextlib
import errno
import gc
import os
import select
import signal
import socket
import time
from collections.abc import Callable
from pathlib import Path

from hypafilter.errors import HypafilterError
from hypafilter.ops.daemon import READY_TIMEOUT, Service
from hypafilter.ops.flowsync.ctnetlink import Conntrack
from hypafilter.ops.flowsync.marks import LiberalMarks
from hypafilter.ops.flowsync.members import RENEW_EVERY, Members
from hypafilter.ops.flowsync.policy import decides_established, read_timeouts
from hypafilter.ops.flowsync.syncer import Syncer

SERVICE_NICE = -10  # the worker's scheduling priority (serve): the sync lag is time a new flow spends in software
INTERVAL = 1.0  # seconds between two polls of the hardware table (timeout refresh, eviction, counters)
MODES = ("flowcache", "liberal")  # the NIC's flow cache (NicClient), or LiberalMarks (the xdp target)


class FlowSync(Service):
    """The flow sync service: wanted when the policy's hardware entries decide established frames and the target
    can serve them (`Target.flowsync_why_not`: a NIC with a flow cache, or the xdp target's conntrack lookup), in
    the target's `flowsync_mode`. Deploy starts it after the commit: until it runs every frame misses the flow
    cache (ct = 0), or on the xdp target established TCP goes to conntrack, which only sends more frames to
    software."""

    # [ctm] of the last why_not: why the NIC's misses are not ct 3 (Target.new_flows_why_not; "": decided; None: the
    # service does not run for the flow cache)
    new_flows: str | None = None

    def why_not(self, policy, plan, tgt, nic: dict) -> str:
        """Why the service does not run for the deployment ("" when it does): wanted when the plan's entries, or
        those of its IPv6 side (`plan.plan6`, the xdp target's family-6 plan: docs/ipv6.md "## xdp"), decide
        established frames by conntrack and the target can serve them."""
        self.new_flows = None
        why = _plan_why_not(policy, plan, tgt, nic)
        plan6 = getattr(plan, "plan6", None)
        if why and plan6 is not None:
            why6 = _plan_why_not(None, plan6, tgt, nic)
            why = "" if not why6 else f"{why}; IPv6 side: {why6}"
        if not why and tgt.flowsync_mode == "flowcache":
            self.new_flows = getattr(tgt, "new_flows_why_not", lambda *_: "not on this target")(plan, nic)
        return why

    def record(self, tgt) -> dict:
        """The mode, and for a service that runs for the flow cache whether it keeps the conntrack membership
        structure complete (`new_flows`: "decided", or why not)."""
        if self.new_flows is None:
            return {"mode": tgt.flowsync_mode}
        return {"mode": tgt.flowsync_mode, "new_flows": self.new_flows or "decided"}

    def problems(self, state_dir: Path) -> list[str]:
        """[ctm] A service keeping the conntrack membership structure complete (the NIC's misses are NEW) while the
        firewall namespace now has what can make a frame without an entry RELATED or UNTRACKED (a helper, an
        expectation, notrack, a zone: targets.xdp.newflows, as the xdp target's drift says): drift, until a redeploy
        keeps the structure incomplete."""
        doc = self.read_status_file(state_dir) or {}
        if not (doc.get("running") and doc.get("members")):
            return []
        from hypafilter.ops.flowsync.hold import held
        from hypafilter.targets.xdp import newflows

        why = newflows.why_not(doc.get("ns"))
        if why and not held(state_dir):  # withheld by the policy sync service: followed, not drift
            return [f"{self.name}: the NIC decides new flows (ct 3), but {why}: redeploy (misses then go to conntrack)"]
        return []

    def launch(self, ns: str | None, state_dir: Path, tgt) -> int:
        members = tgt.flowsync_mode == "flowcache" and self.new_flows == ""
        return start(ns, state_dir, mode=tgt.flowsync_mode, timeout=ready_timeout(conntrack_count(ns)), members=members)

    def down(self, tgt) -> str:
        return tgt.flowsync_down


def _plan_why_not(policy, plan, tgt, nic: dict) -> str:
    if not decides_established(policy, plan):
        return "the policy's hardware entries do not read conntrack state"
    return tgt.flowsync_why_not(plan, nic)


SERVICE = FlowSync("flowsync", "flow sync service")

# The start's wait grows with conntrack's table: the service is ready once it has dumped the table and reconciled
# the flow cache with it (`serve`). Measured at 250,000 entries on the 2-core development machine under other
# sessions' load (docs/flowsync.md, "Conntrack at real scale"): 10-17 s from the start until ready.
READY_PER_100K = 10.0  # seconds the start may wait beyond READY_TIMEOUT per 100,000 conntrack entries


def conntrack_count(ns: str | None) -> int:
    """How many entries conntrack of `ns` holds now (nf_conntrack_count; 0 when it cannot be read)."""
    from hypafilter import netns

    try:
        return int(netns.run(["sysctl", "-n", "net.netfilter.nf_conntrack_count"], ns).strip())
    except (netns.CommandError, OSError, ValueError):
        return 0


def ready_timeout(entries: int) -> float:
    """Seconds the start waits for a service that resyncs over `entries` conntrack entries."""
    return READY_TIMEOUT + READY_PER_100K * entries / 100_000


def serve(
    ns: str,
    table,
    state_dir: Path,
    interval: float = INTERVAL,
    stop: Callable[[], bool] = lambda: False,
    nic: str = "",
    service_pid: int | None = None,
    restarts: int = 0,
    members: bool = False,
) -> None:
    """Run until `stop()` or SIGTERM/SIGINT: resync, then events and polls. The table is cleared on the way out:
    without the service nothing evicts a flow conntrack has destroyed. `service_pid`: the pid the state file
    names (the supervisor's, which `stop` signals), `restarts`: how many workers ended abnormally before."""
    state_dir = Path(state_dir)
    service_pid = service_pid or os.getpid()
    # The sync lag is what a new flow spends in software: ahead of ordinary work (the emulated NIC spins a core
    # while frames flow) the service installs a flow within milliseconds. Unprivileged, it keeps its priority.
    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PROCESS, 0, SERVICE_NICE)
    stopping = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stopping.append(1))
    if not hasattr(table, "flow_config"):
        raise HypafilterError("this NicClient has no flow cache API (flow_config, flow_insert, ...)")
    if table.flow_config() is None:
        raise HypafilterError(f"{nic or 'the NIC'} has no flow cache (FC_CONFIG reads 0): nothing to synchronise")
    ct = Conntrack(ns)
    started = time.time()
    mem = None
    if members:
        v6 = bool(getattr(table, "ctm_v6", lambda: False)())
        mem = Members(table, window_ms=table.read("CTM_WINDOW"), state_dir=state_dir, v6=v6)
    try:
        syncer = Syncer(table, ct, read_timeouts(ns))
        entries = ct.dump()
        syncer.resync(entries, ct.stash)
        if mem is not None:
            mem.load(entries)
        del entries
        # Python's full (generation 2) collection walked every object of the worker (then pyroute2's modules too):
        # 70-110 ms under load, once in a run of the established measure, and no flow was installed meanwhile.
        # What is left after this collection (modules, sockets, the syncer) lives as long as the worker: frozen,
        # collections no longer walk it.
        gc.collect()
        gc.freeze()
        next_poll = time.monotonic()
        ready_at = None  # the first status file (deploy's readiness): before a load's clear is over, if any

        def drain() -> None:
            """Apply the conntrack events queued now, together."""
            t = time.monotonic()
            try:
                events = ct.read_events()
            except OSError as e:
                if e.errno != errno.ENOBUFS:
                    raise
                syncer.last_error = "conntrack events lost (ENOBUFS): resynchronised from a dump"
                if mem is not None:
                    mem.withdraw()
                entries = ct.dump()
                syncer.resync(entries, ct.stash)
                if mem is not None:
                    mem.load(entries)
                return
            syncer.events(events, t)
            if mem is not None:
                mem.events(events)

        def keep_complete() -> None:
            """[ctm] Caught up (no event read and not applied, none waiting): renew COMPLETE's lease."""
            if mem is None:
                return
            t = time.monotonic()
            if not (ct.backlog or ct.lost or select.select([ct.events], [], [], 0)[0]):
                mem.caught_up(t)
                mem.renew()

        def between() -> None:
            """Within a poll: the events queued now, if any; then COMPLETE's lease (a poll took up to 858 ms under
            load, longer than the lease: COMPLETE lapsed and new flows went to software meanwhile)."""
            if ct.backlog or ct.lost or select.select([ct.events], [], [], 0)[0]:
                drain()
            keep_complete()

        while not stopping and not stop():
            now = time.monotonic()
            if now >= next_poll:
                if ready_at is not None:  # the first status file (ready) right after the resync, before a poll
                    syncer.poll(between)  # (512 slots: 6 s of an 11,100-entry emulated core under load)
                doc = _status_doc(syncer, table, ns, nic, started, interval)
                doc["ready_at"] = ready_at = ready_at or doc["updated_at"]
                if mem is not None:
                    doc["members"] = {**mem.stats(), "hw": _ctm_counters(table)}
                SERVICE.write_status_file(
                    state_dir, {**doc, "pid": service_pid, "worker": os.getpid(), "restarts": restarts}
                )
                next_poll = now + interval
            if ct.backlog or ct.lost:  # taken off the socket while the service waited for a reply
                drain()
                continue
            if mem is not None and (mem.clearing or mem.pending):  # a full load: its sweep, then chunks, between events
                mem.load_step()
                wait = 0.0
            else:
                keep_complete()
                wait = min(next_poll - time.monotonic(), 0.2 if mem is None else RENEW_EVERY)
            r, _, _ = select.select([ct.events], [], [], max(0.0, wait))
            if r:
                drain()
    finally:
        gc.unfreeze()
        try:
            if mem is not None:
                mem.withdraw()
            table.flow_clear()
        finally:
            ct.close()
            doc = {"running": False, "pid": service_pid, "stopped_at": time.time(), "ns": ns, "nic": nic}
            SERVICE.write_status_file(state_dir, doc)


def _status_doc(syncer: Syncer, table, ns: str, nic: str, started: float, interval: float) -> dict:
    try:
        hw = dict(table.flow_counters())
    except Exception as e:  # the counters are for display; the sync goes on
        hw = {"error": str(e)}
    return {
        "running": True,
        "pid": os.getpid(),
        "mode": table.mode,
        # the address families whose entries the service offloads (the NIC's flow cache: IPv6 on a dual-stack core)
        "families": ["ipv6" if f == socket.AF_INET6 else "ipv4" for f in getattr(table, "families", (socket.AF_INET,))],
        "ns": ns,
        "nic": nic,
        "started_at": started,
        "updated_at": time.time(),
        "interval": interval,
        "timeouts": syncer.timeouts,
        **syncer.stats(),
        "echoes": syncer.ct.echoes,  # events skipped as echoes of the service's own updates
        "occupancy": hw.get("occupancy"),
        "hw": hw,
    }


def _ctm_counters(table) -> dict:
    try:
        return table.ctm_counters()
    except Exception as e:  # for display
        return {"error": str(e)}


def supervise(
    ns: str,
    open_table: Callable[[], object],
    state_dir: Path,
    interval: float = INTERVAL,
    nic: str = "",
    members: bool = False,
) -> int:
    """The service process (`SERVICE.supervise`): runs `serve` in a forked worker and, when the worker ends other
    than by a stop (an exception, a kill), clears the flow table (the worker may have left flows conntrack has
    destroyed since) and starts another, which resyncs from a dump. Returns the exit status: 0 after a stop, 1 when
    the first worker failed before it was ready (nothing to supervise)."""

    def open_worker() -> Callable[[int, int], None]:
        table = open_table()
        return lambda me, restarts: serve(
            ns, table, state_dir, interval, nic=nic, service_pid=me, restarts=restarts, members=members
        )

    def clear() -> None:
        t = open_table()
        try:
            if members:
                t.ctm_complete(0)  # the worker that kept it complete is gone
            t.flow_clear()
        finally:
            t.close()

    return SERVICE.supervise(state_dir, open_worker, ("clearing the flow table", clear), {"ns": ns, "nic": nic})


def table_opener(mode: str, tgt, nic: dict) -> Callable[[], object]:
    """What opens the table of `mode` for the deployment's NIC `nic` on target `tgt`: a NicClient on its flow cache,
    or (liberal: the xdp target, conntrack's entries marked, no flow cache) `LiberalMarks`."""
    if mode == "liberal":
        return LiberalMarks
    from hypafilter.targets.nic import NicClient

    return lambda: NicClient(tgt.transport(nic))


def start(
    ns: str,
    state_dir: Path,
    interval: float = INTERVAL,
    timeout: float = READY_TIMEOUT,
    mode: str = "flowcache",
    members: bool = False,
) -> int:
    """Start the service for the deployment in `state_dir` (it reads the NIC from state.json) in `mode` (MODES);
    returns its pid once it has resynchronised (its first state file), raises HypafilterError if it exits
    before."""
    if mode not in MODES:
        raise HypafilterError(f"flow sync mode {mode!r}: not one of {', '.join(MODES)}")
    args = ["--interval", str(interval), "--mode", mode] + (["--members"] if members else [])
    return SERVICE.start(ns, state_dir, args, timeout)
