"""The policy sync worker: follows nf_tables' change events in the firewall namespace and keeps the fast path in
step with the live ruleset (docs/deploy.md, "Live policy").

On a committed transaction that touches the deployed table and that this process did not make (its NEWGEN names
another pid than the commands it ran, `netns.SPAWNED`):

1. **fail safe**: the NIC shunts everything (CONTROL bit 1, one register write; the xdp target's control word) and
   the shim's generation moves on, so every tag is stale: k = 0, and the tool's MAIN returns every frame to the
   operator's chains, which already hold the change. From here every frame gets the new policy's verdict (by
   software).
2. **read**: the table's listing between two reads of the same generation, the tool's chains stripped, parsed as
   the deployed base chain's policy (`live.live_policy`).
3. **apply**: `ops.deploy.follow` — the transaction of an update, through the update buffer when the running
   matcher can hold the change, ending with shunt-all cleared under the new generation. Unchanged policy (a
   change elsewhere in the table, counters zeroed): only the two writes of step 1 are undone.

A listing that cannot be parsed or an update that fails leaves step 1 in force (fail closed) and the error in the
status file, which `status` reports as drift. Lost events (ENOBUFS) lead to the same read and apply.

While it runs, the worker renews the fast path's lease (the deployment's `lease_ms`, every
POLICYSYNC_LEASE_RENEW_S, from its main loop: a worker stuck anywhere stops renewing it); a service killed for good
leaves the lease to run out, and the fast path then decides nothing (fail closed).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import select
import signal
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

from hypafilter import netns
from hypafilter.config import POLICYSYNC_LEASE_RENEW_S
from hypafilter.errors import HypafilterError
from hypafilter.hw.updatebuffer import Image6
from hypafilter.netfilter.bridge import TABLE as BRIDGE_TABLE
from hypafilter.ops import deploy
from hypafilter.ops.lab import HOST_TABLE
from hypafilter.ops.policysync import live
from hypafilter.ops.policysync.follow6 import REBUILD6_IDLE_S, Follower6, Legacy6
from hypafilter.ops.policysync.live import percentiles as _pct
from hypafilter.ops.policysync.newflows import NewFlows
from hypafilter.ops.policysync.nftevents import NfTables, NftEvent
from hypafilter.ops.policysync.service import SERVICE
from hypafilter.targets.bpfmap import PinnedRingbuf

COALESCE_S = 0.002  # after a change, events arriving this soon join it (a tool's several commands)
RETRY_S = 2.0  # a sync that failed (the fast path shunting everything meanwhile) is tried again this often
REBUILD_IDLE_S = 60.0  # a buffer in use and no change for this long: the lazy rebuild starts (SFL's idle link)
STATUS_EVERY = 1.0  # seconds between two status files while nothing happens
SERVICE_NICE = -10


class Rebuild:
    """The lazy rebuild (SFL): the core (program) of the master rule set built in a thread while the buffer
    serves; `done` once built (or failed), for `policy_hash` (and, on the NIC's dual-stack core, the deployed IPv6
    side, whose entries are part of the core: deploy.rebuild_plan)."""

    def __init__(self, policy, st: dict):
        self.policy = policy
        self.policy_hash = policy.policy_hash()
        # the deployment's policies when the build began: the core is swapped in only if they are still those (a
        # deploy's policy, parsed from the live listing here, may hash apart from the file it came from)
        self.deployed_hash = st["policy_hash"]
        self.deployed6 = ipv6_hash(st)
        self.error = ""
        self.seconds = 0.0
        cfg = deploy.deployed_config(st)
        tgt = deploy.target_of(st, cfg)

        def work() -> None:
            t = time.monotonic()
            try:
                tgt.build(deploy.rebuild_plan(policy, st, cfg))
            except Exception as e:  # reported in the status file; the buffer keeps serving
                self.error = str(e)
            self.seconds = round(time.monotonic() - t, 3)

        self.thread = threading.Thread(target=work, name="rebuild", daemon=True)
        self.thread.start()

    @property
    def done(self) -> bool:
        return not self.thread.is_alive()


class Follower(deploy.FollowWatch):
    """The fast path of the deployment in `state_dir`, kept in step with the live ruleset of `ns`; while it applies
    a change (deploy.follow) it keeps watching the ruleset (the FollowWatch calls)."""

    def __init__(self, ns: str, state_dir: Path, nft: NfTables, log: Callable[[str], None]):
        self.ns, self.state_dir, self.nft, self.log = ns, Path(state_dir), nft, log
        self.safe = False  # step 1 in force
        self.error = ""
        self.counts = {
            "events": 0,
            "changes": 0,
            "own": 0,
            "applied": 0,
            "unchanged": 0,
            "failed": 0,
            "resyncs": 0,
            "retries": 0,
            # the applied changes by how they reached the fast path (what `bench churn` reports)
            "applied_buffer": 0,
            "applied_registers": 0,
            "applied_new_core": 0,
        }
        self.lag_safe: deque[float] = deque(maxlen=2000)  # ms: events read -> fail safe in force
        self.lag_apply: deque[float] = deque(maxlen=2000)  # ms: events read -> the fast path decides again
        self.generation = 0  # the nf_tables generation last read
        self.seen = 0  # the newest generation whose commit the service has judged (its NEWGEN event read)
        self._st: dict | None = None
        self._mtime: int | None = None
        self._tgt = self._shim = None
        self.policy = None  # the live policy last applied (what a lazy rebuild builds)
        self.table = "filter"
        self.dirty = False  # a message of the transaction being read touched the deployed table
        self.elsewhere = False  # ... or another nftables table (whose base chains may filter NIC frames)
        self.pending = False  # a foreign change not applied yet
        self.pending_since: float | None = None
        self.lost = False  # events were lost: read the ruleset again
        self.after_deploy = False  # a deploy held the lock during a commit: read the ruleset once it is done
        self.in_follow = False  # inside its own deploy.follow (which holds the lock)
        self.applying: dict | None = None  # the NIC and generation a running follow made live (not in the state yet)
        self.released = False  # the running follow let the fast path decide again
        self.stopping: Callable[[], bool] = lambda: False
        self.last_try = 0.0  # when the last sync began (a failed one is tried again every RETRY_S)
        self.rebuild: Rebuild | None = None
        self.last_change = time.monotonic()
        self.counts["rebuilds"] = 0
        self.rebuild_s = 0.0
        self.last_kind = ""
        self.lease_due = 0.0  # when the lease is renewed next
        self.lease_error = ""
        self.lease_ms = 0  # the lease last written (the deployment's lease_ms)
        self.counts["lease_renewals"] = 0
        self.lag_lease: deque[float] = deque(maxlen=2000)  # ms: time between two renewals
        self.lease_last: float | None = None
        self.newflows = None  # the new-flow permission's watch (ops.policysync.newflows), set by `serve`
        self.six = None  # ip6tables followed (ops.policysync.follow6.Follower6), set by `serve`
        self.adds = False  # a message of the transaction being read adds a rule or an object (any table)

    def state(self, fresh: bool = True) -> dict:
        """The deployment's state (`fresh`: read again; else as last read unless the file changed since, what the
        fail safe needs: a deploy may have replaced the NIC)."""
        try:
            mtime = deploy.state_file().stat().st_mtime_ns
        except OSError:
            mtime = None
        if fresh or self._st is None or mtime != self._mtime:
            self._mtime = mtime
            st = deploy.read_state()
            if not st:
                raise HypafilterError("nothing is deployed")
            self._st = st
            self._tgt = deploy.target_of(st, deploy.state_config(st))
            self._shim = deploy.shim_of(st)
        return self._st

    def fail_safe(self) -> None:
        """Everything to software, every tag stale (the live rules decide): two writes, no helper process."""
        if self.safe:
            return
        st = self.applying or self.state(fresh=False)
        self._tgt.shunt_all_now(st["nic"])
        self._shim.set_generation(deploy.stale_generation(st["generation"]))
        self.safe = True

    def renew_lease(self, force: bool = False) -> float:
        """Renew the fast path's lease when due (`force`: now): the deployment's `lease_ms` (0: it stays disarmed).
        Returns the seconds until the next renewal is due. A failure is kept for the status file and tried again at
        the next renewal; the lease then runs out, which is the point."""
        now = time.monotonic()
        if not force and now < self.lease_due:
            return self.lease_due - now
        self.lease_due = now + POLICYSYNC_LEASE_RENEW_S
        try:
            st = self.state(fresh=False)
            ms = int(st.get("lease_ms") or 0)
            self._tgt.set_lease(st["nic"], ms)
        except Exception as e:  # a NIC being replaced, a transport error: said in the status file
            if str(e) != self.lease_error:
                self.log(f"lease: {e}")
            self.lease_error = str(e)
            return POLICYSYNC_LEASE_RENEW_S
        self.lease_error, self.lease_ms = "", ms
        self.counts["lease_renewals"] += 1
        if self.lease_last is not None:
            self.lag_lease.append((now - self.lease_last) * 1000)
        self.lease_last = now
        return POLICYSYNC_LEASE_RENEW_S

    def applied(self, generation: int, nic: dict) -> None:
        """The running follow made the new policy live on `nic` under `generation`: a newer change is failed safe
        there from now on."""
        self.applying = {"generation": generation, "nic": nic}
        self.safe = False
        self.released = True

    def poll(self) -> None:
        """Between the steps of the running follow's tidying up: a newer change read and failed safe now."""
        if self.released and select.select([self.nft.events], [], [], 0)[0]:
            self.intake(time.monotonic())

    def starting(self, nic: dict) -> None:
        """A follow's new NIC (program), before it decides: the IPv6 hold written to it while in force."""
        if self.six is not None:
            self.six.starting(nic)

    def release(self) -> None:
        """Undo `fail_safe` when the live ruleset turned out to be the deployed policy."""
        st = self.state()
        deploy.shim_of(st).update(generation=st["generation"])
        deploy.target_of(st, deploy.state_config(st)).shunt_all(st["nic"], False)
        self.safe = False

    def sync(self, reason: str, t0: float | None = None) -> None:
        """Read the live ruleset and bring the fast path into step with it."""
        self.last_try = time.monotonic()
        st = self.state()
        cfg = deploy.deployed_config(st)
        # what arrives from here on is read by the hold check or the next round
        self.pending, self.pending_since, self.lost = False, None, False
        try:
            others = live.foreign_chains(self.ns, cfg.table, st.get("nic_mode", "bridge"))
            if others:
                raise HypafilterError(
                    "nftables base chains besides iptables' filter the frames the fast path decides: "
                    + "; ".join(others)
                )
            text, self.generation = live.listing(self.ns, cfg.table, self.nft.generation)
            digest = live.digest(text, cfg.chain_prefix)
            same = digest == st.get("live_digest")
            policy = None if same else live.live_policy(text, st, cfg)
            if same or policy.policy_hash() == st["policy_hash"]:
                self.policy = policy or self.policy
                self.counts["unchanged"] += 1
                if self.safe and not self.hold():
                    self.release()
            else:
                self.fail_safe()
                self.in_follow, self.released = True, False
                try:
                    new = deploy.follow(policy, self.log, watch=self, abort=self.stopping, digest=digest)
                finally:
                    self.in_follow = False
                    self.applying = None
                self.policy = policy
                self.state()  # the new generation, tables and perhaps NIC: what the next fail safe writes to
                if new.get("held"):  # a newer change came during the update: still fail-safe
                    self.safe = True
                elif not self.released:  # nothing to apply after all (the deployed policy): lift step 1
                    self.release()
                # else: as `applied` and the polls of the tidying up left it (fail-safe again for a newer change)
                self.counts["applied"] += 1
                last = (new.get("history") or [{}])[-1]
                self.last_kind = (
                    "buffer"
                    if last.get("overlay_slots") is not None and not last.get("replaced_nic")
                    else ("new core" if last.get("replaced_nic") else "registers")
                )
                self.counts["applied_" + self.last_kind.replace(" ", "_")] += 1
                self.log(f"{reason}: generation {new['generation']} ({self.last_kind}, {last.get('duration_s')} s)")
            if t0 is not None:
                self.lag_apply.append((time.monotonic() - t0) * 1000)
            self.error = ""
        except (HypafilterError, OSError) as e:
            self.counts["failed"] += 1
            self.error = f"{reason}: {e}"
            self.log(f"cannot follow: {self.error}")
            with contextlib.suppress(HypafilterError, OSError):
                self.fail_safe()

    def intake(self, t0: float) -> bool:
        """Read the events queued now: a transaction of another process that touched the deployed table makes a
        change pending and puts the fail safe in force at once; lost events (ENOBUFS) mark a resync. True when
        something is pending (the caller waits COALESCE_S for more before it reads the ruleset)."""
        try:
            events = self.nft.read_events()
        except OSError as e:
            if e.errno != errno.ENOBUFS:
                raise
            self.lost = True
            events = []
        for e in events:
            self.counts["events"] += 1
            if e.kind != "newgen":
                self.adds |= e.kind in ("newrule", "newobj")
                self.dirty |= relevant(e, self.table)
                # an ip6 table filters no IPv4 frame: ip6tables is the IPv6 side's (follow6), not IPv4's business
                self.elsewhere |= not relevant(e, self.table) and e.table not in OWN_TABLES and e.family != "ip6"
                if self.six is not None:
                    self.six.dirty |= e.family == "ip6"
                continue
            self.seen = max(self.seen, e.gen)
            if self.newflows is not None and e.pid not in netns.SPAWNED:
                # a rule or object may bring a helper, notrack or zone: ct 3 withdrawn before anything is read;
                # any other commit (a rule deleted) is checked, and may let it back. A deploy's commits are checked
                # once it ends (it made its own check; a change made meanwhile is found then)
                if self.adds and not self.deployed(e.gen):
                    self.newflows.withdraw(t0, self.state(fresh=False))
                self.newflows.want_check = True
            self.adds = False
            if self.elsewhere and e.pid not in netns.SPAWNED:
                self.dirty = True  # another table changed: its base chains are read with the ruleset
            self.elsewhere = False
            if self.dirty and e.pid not in netns.SPAWNED and not self.deployed(e.gen):
                if not self.pending:
                    self.pending, self.pending_since = True, t0
                if not self.safe:  # step 1 at once, before the listing
                    try:
                        self.fail_safe()
                        self.lag_safe.append((time.monotonic() - t0) * 1000)
                    except (HypafilterError, OSError) as ex:
                        self.error = f"fail safe: {ex}"
            elif self.dirty:
                self.counts["own"] += 1
            self.dirty = False
            if self.six is not None and self.six.dirty:
                if e.pid not in netns.SPAWNED and not self.deployed(e.gen):
                    self.six.commit(t0)  # the IPv6 hold at once; IPv4 goes on deciding
                self.six.dirty = False
        if self.lost and not self.safe:
            with contextlib.suppress(HypafilterError, OSError):
                self.fail_safe()
        if self.lost and self.six is not None:
            self.six.lost = True
        return self.pending or self.lost or (self.six is not None and self.six.pending)

    def deployed(self, gen: int) -> bool:
        """A commit a deploy made (its generation at most the one the deployment recorded after its own commits), or
        one made while a deploy holds the lock (the deploy writes the state the next sync reads: pending then)."""
        if self.in_follow or not deploy_busy(self.state_dir):  # its own follow holds the lock: not a deploy's
            st = self.state(fresh=False)
            recorded = st.get("nft_generation")
            return recorded is not None and gen <= recorded
        self.after_deploy = True
        return True

    def hold(self) -> bool:
        """Asked by the update just before it lets the fast path decide again: whether a change arrived meanwhile
        (then the update leaves everything to software, every tag stale, and the next sync applies it)."""
        if select.select([self.nft.events], [], [], 0)[0]:
            self.intake(time.monotonic())
        # (the emulated NIC's IPv6 hold is this fail safe: an ip6 change pending keeps it too)
        return self.pending or self.lost or (self.six is not None and self.six.holds_all())

    def buffer_use(self) -> tuple[int, int]:
        """(slots in use, depth) of the running matcher's update buffer ((0, 0): none in use)."""
        ov = (self._st or {}).get("overlay")
        return (len(ov["slots"]), ov["depth"]) if ov else (0, 0)

    def buffer6_use(self) -> tuple[int, int, bool]:
        """(slots in use, depth, in use: a slot or a masked static entry) of the NIC's IPv6 update buffer, in a
        dual-stack core (docs/ipv6.md "## emu"); (0, 0, False) without one (xdp's is Follower6's)."""
        st = self._st or {}
        v6 = (st.get("tables") or {}).get("v6") or {}
        if st.get("target", "emu") != "emu" or not v6.get("overlay") or not v6.get("depth"):
            return 0, 0, False
        img = Image6.from_dict(v6["overlay"])
        return sum(img.enabled(b) for b in range(img.depth)), int(v6["depth"]), not img.pristine

    def maybe_rebuild(self) -> None:
        """The lazy rebuild: start building the master rule set's core once the buffer (or the NIC's IPv6 buffer) is
        half full or has been in use for REBUILD_IDLE_S (REBUILD6_IDLE_S) without a change; swap it in
        make-before-break once built, if the policy is still the one it was built for (else build again)."""
        used, depth = self.buffer_use()
        used6, depth6, busy6 = self.buffer6_use()
        if self.six is not None and self.six.safe:
            return  # an ip6tables change not applied yet: a new program now would decide IPv6 by the old tables
        if self.rebuild is not None and self.rebuild.done:
            with deploy.unmeasured() as free:
                if free:  # else a verify reads the NIC's counters across a window: swap in a later round
                    self.swap_rebuild(bool(used or busy6))
            return
        if self.rebuild is not None or not (used or busy6) or self.safe:
            return
        self.start_rebuild(used, depth, used6, depth6, busy6)

    def swap_rebuild(self, used: bool) -> None:
        """The finished lazy rebuild's core swapped in (deploy.follow(rebuild=True)) if the deployment's policies
        are still the ones it was built for and a buffer is in use; dropped otherwise (the next round builds
        again)."""
        rb, self.rebuild = self.rebuild, None
        st = self.state(fresh=False)
        if rb.error:
            self.log(f"lazy rebuild failed: {rb.error}")
        elif rb.deployed_hash == st["policy_hash"] and rb.deployed6 == ipv6_hash(st) and used:
            try:
                self.in_follow = True
                try:
                    new = deploy.follow(rb.policy, self.log, rebuild=True, abort=self.stopping)
                finally:
                    self.in_follow = False
                self.state()
                self.counts["rebuilds"] += 1
                self.rebuild_s = rb.seconds
                self.log(f"lazy rebuild: generation {new['generation']} on a new core (built in {rb.seconds} s)")
            except (HypafilterError, OSError) as e:
                self.error = f"lazy rebuild: {e}"
                self.log(self.error)

    def start_rebuild(self, used: int, depth: int, used6: int = 0, depth6: int = 0, busy6: bool = False) -> None:
        """The lazy rebuild started once the buffer is half full or in use and idle for REBUILD_IDLE_S, or the NIC's
        IPv6 buffer half full or in use and idle (no change of either family) for REBUILD6_IDLE_S."""
        now = time.monotonic()
        last6 = max(self.last_change, getattr(self.six, "last_apply_t", 0.0))
        if rebuild_due(used, depth, now - self.last_change, REBUILD_IDLE_S) or rebuild_due(
            used6, depth6, now - last6, REBUILD6_IDLE_S, busy6
        ):
            st = self.state(fresh=False)
            if self.policy is None or self.policy.policy_hash() != st["policy_hash"]:
                # a service started over a buffer in use, or a deploy (not this service) replaced the policy since
                # this service last applied one: the deployed policy is the live ruleset, read now
                st = self.state()
                cfg = deploy.deployed_config(st)
                try:
                    text, _ = live.listing(self.ns, cfg.table, self.nft.generation)
                    self.policy = live.live_policy(text, st, cfg)
                except (HypafilterError, OSError) as e:
                    self.log(f"lazy rebuild: reading the ruleset: {e}")
                    return
            six = (
                f", IPv6 {used6}/{depth6} slots{' and masked entries' if busy6 and not used6 else ''}" if busy6 else ""
            )
            self.log(f"lazy rebuild: {used}/{depth} buffer slots in use{six}; building the next core")
            self.rebuild = Rebuild(self.policy, self.state(fresh=False))

    def doc(self) -> dict:
        return {
            "following": not self.error,
            "error": self.error,
            "safe": self.safe,
            "nft_generation": self.generation,
            # every commit up to this generation has been judged (own, a deploy's, or a change read and applied)
            "seen_generation": max(self.seen, self.generation),
            **self.counts,
            "lag_safe_ms": _pct(self.lag_safe),
            "lag_apply_ms": _pct(self.lag_apply),
            "last_kind": self.last_kind,
            "rebuilding": self.rebuild is not None,
            "rebuild_s": self.rebuild_s,
            "lease_ms": self.lease_ms,
            "lease_error": self.lease_error,
            "lease_interval_ms": _pct(self.lag_lease),
        }


def rebuild_due(used: int, depth: int, idle_s: float, limit_s: float, masked: bool = False) -> bool:
    """SFL's lazy rebuild is due for a buffer with `used` of its `depth` slots in use (`masked`: static entries
    masked off, in use too): half full, or in use and no change for `limit_s`."""
    return (used > 0 and used * 2 >= depth) or ((used > 0 or masked) and idle_s >= limit_s)


def ipv6_hash(st: dict) -> str | None:
    """The deployed IPv6 side's policy hash (None: ip6tables as the operator has it)."""
    return (st.get("ipv6") or {}).get("hash")


OWN_TABLES = (BRIDGE_TABLE, HOST_TABLE)  # the tool's bridge table and the lab's recorder: no policy in them


def deploy_busy(state_dir: Path) -> bool:
    """Whether a deploy, update or undeploy holds the deployment's lock now."""
    import fcntl

    try:
        with open(Path(state_dir) / "deploy.lock") as f:
            try:
                fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                return True
            fcntl.flock(f, fcntl.LOCK_UN)
    except OSError:
        return False
    return False


def relevant(e: NftEvent, table: str) -> bool:
    """A message that can change the deployed policy: the iptables table's (family ip)."""
    return e.kind != "newgen" and e.family == "ip" and e.table == table


def serve(ns: str, state_dir: Path, service_pid: int | None = None, restarts: int = 0) -> None:
    """Run until SIGTERM/SIGINT: the live ruleset once (it may have changed while nobody followed it), then
    events."""
    state_dir = Path(state_dir)
    service_pid = service_pid or os.getpid()
    deploy.configure(state_dir=state_dir)
    deploy.configure_from_state()
    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PROCESS, 0, SERVICE_NICE)
    stopping: list[int] = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stopping.append(1))
    nft = NfTables(ns)  # subscribed before the first listing: nothing between the two is lost
    started = time.time()

    def log(msg: str) -> None:
        now = time.time()
        stamp = time.strftime("%H:%M:%S", time.localtime(now)) + f".{int(now % 1 * 1000):03d}"
        print(f"{stamp} policysync: {msg}", flush=True)

    f = Follower(ns, state_dir, nft, log)
    f.stopping = lambda: bool(stopping)
    sets = SetFollower(log)  # the kernel's ipsets into the xdp program's set tables (docs/sets.md)
    f.safe = restarts > 0  # after an abnormal end the supervisor left the fail safe in force: the first sync lifts it
    f.table = deploy.deployed_config(f.state()).table
    six = f.six = Follower6(f)  # ip6tables, the IPv6 side's policy (ops.policysync.follow6)
    legacy6 = six.legacy = Legacy6(ns)  # ... and the legacy ip6tables tables beside it, polled in a thread
    # conntrack's expectation events, subscribed before the first check (docs/xdp.md "New flows")
    watch = f.newflows = NewFlows(ns, state_dir, log, lambda: deploy_busy(state_dir))

    def status() -> None:
        SERVICE.write_status_file(
            state_dir,
            {
                "running": True,
                "pid": service_pid,
                "worker": os.getpid(),
                "restarts": restarts,
                "ns": ns,
                "started_at": started,
                "updated_at": time.time(),
                **f.doc(),
                "ipv6": six.doc(),
                "sets": sets.doc(),
                "new_flows": watch.doc(f.state(fresh=False)),
            },
        )

    sets.start()
    try:
        f.renew_lease(force=True)  # first: a deploy armed the fast path only for the time this start may take
        status()  # ready: subscribed; the first listing below may take a while on a large ruleset
        # ip6tables first: after a worker's abnormal end the supervisor's fail safe (CONTROL 0) covers IPv6 too, and
        # the IPv4 sync lifts it; an ip6tables change made meanwhile is held and applied before that
        six.sync("start")
        f.sync("start")
        f.renew_lease()
        status()
        next_status = time.monotonic() + STATUS_EVERY
        while not stopping:
            lease_in = f.renew_lease()
            poll_in = watch.poll(time.monotonic(), f.state(fresh=False))
            if watch.checking is not None:
                poll_in = min(poll_in, 0.005)
            wait = (
                0.0
                if f.pending or f.lost or six.pending
                else 0.05
                if f.after_deploy
                else max(0.0, next_status - time.monotonic())
            )
            r, _, _ = select.select([nft.events, watch, legacy6], [], [], min(wait, lease_in, poll_in))
            t0 = time.monotonic()
            if watch in r:
                watch.intake(t0, f.state(fresh=False))
            if legacy6 in r:  # a legacy ip6tables table changed: the IPv6 hold at once, then read again
                legacy6.drain()
                six.commit(t0)
            r = [x for x in r if x is nft.events]
            if watch.pending():
                watch.step(f.state(fresh=False))
            # a wake-up only to renew the lease changes nothing else: the rest of the round (the lazy rebuild's
            # checks included) keeps the pace it has without the lease (events, or the status interval)
            lease_only = not r and t0 < next_status and not (f.pending or f.lost or f.after_deploy or f.error)
            lease_only = lease_only and not six.pending
            if lease_only:
                continue
            while r:
                if not f.intake(t0):
                    break
                r, _, _ = select.select([nft.events], [], [], COALESCE_S)
            if f.after_deploy and not deploy_busy(state_dir):
                f.after_deploy = False
                f.lost = True  # what the deploy left, and anything made meanwhile: read it once
            change, lost = f.pending, f.lost
            # a change that could not be followed (the fast path shunting everything meanwhile): read it again
            retry = bool(f.error) and not (change or lost) and time.monotonic() - f.last_try >= RETRY_S
            if change or lost or retry:
                f.last_change = time.monotonic()
                why = "change" if change else "events lost (ENOBUFS)" if lost else "retry"
                f.counts["changes" if change else "resyncs" if lost else "retries"] += 1
                # the fail safe in force, said before the read and apply (a new core takes seconds): the status
                # file must not show the last change's "safe": false meanwhile
                status()
                f.sync(why, f.pending_since or t0)
                watch.want_check = True  # a follow writes the tables with its own check's answer
            if six.due():  # after IPv4's: a new program for IPv6 is built on the IPv4 side as now deployed
                why6 = "change" if six.pending else "events lost (ENOBUFS)" if six.lost else "retry"
                status()
                six.sync(why6)
                change = True
            watch.step(f.state(fresh=False))
            f.maybe_rebuild()
            six.maybe_rebuild()
            if change or lost or retry or time.monotonic() >= next_status:
                status()
                next_status = time.monotonic() + STATUS_EVERY
    finally:
        sets.close()
        legacy6.close()
        watch.close()
        nft.close()
        SERVICE.write_status_file(
            state_dir, {"running": False, "pid": service_pid, "stopped_at": time.time(), "ns": ns}
        )


def fail_safe_now(state_dir: Path) -> None:
    """Everything to software, every tag stale, for the deployment in `state_dir`: what the supervisor does when a
    worker ended abnormally (a change it missed meanwhile must not be decided by the old tables), before the next
    worker reads the ruleset again and lifts it."""
    deploy.configure(state_dir=state_dir)
    deploy.configure_from_state()
    st = deploy.read_state()
    if not st:
        return
    deploy.target_of(st, deploy.state_config(st)).shunt_all_now(st["nic"])
    deploy.shim_of(st).set_generation(deploy.stale_generation(st["generation"]))


def renew_lease_now(state_dir: Path) -> None:
    """Renew the lease of the deployment in `state_dir` once: what the supervisor does while it restarts a worker
    (the fast path shunts everything meanwhile, `fail_safe_now`; the lease keeps status from calling it expired)."""
    deploy.configure(state_dir=state_dir)
    deploy.configure_from_state()
    st = deploy.read_state()
    if not st:
        return
    deploy.target_of(st, deploy.state_config(st)).set_lease(st["nic"], int(st.get("lease_ms") or 0))


def supervise(ns: str, state_dir: Path) -> int:
    """The service process: `serve` in a supervised worker (ops.daemon). A worker that ends abnormally leaves no
    change unfollowed: the supervisor makes the fast path shunt everything (`fail_safe_now`) before it starts the
    next worker, whose first read of the ruleset lifts it."""

    def open_worker():
        return lambda me, restarts: serve(ns, state_dir, service_pid=me, restarts=restarts)

    recover = (
        "the fast path shunts everything until the next worker has read the ruleset",
        lambda: fail_safe_now(state_dir),
    )
    keepalive = (POLICYSYNC_LEASE_RENEW_S, lambda: renew_lease_now(state_dir))
    return SERVICE.supervise(Path(state_dir), open_worker, recover, {"ns": ns}, keepalive=keepalive)


def setmaps_lock():
    from hypafilter.targets.xdp import sets as setmaps

    return setmaps.host_lock()


def _ensure_watcher(build_root: Path) -> Path:
    from hypafilter.targets.xdp import sets as setmaps

    return setmaps.ensure_watcher(build_root)


class SetFollower:
    """The kernel's ipsets followed into the xdp program's set tables (docs/sets.md, "Following the kernel's sets"),
    in a thread of the worker: woken by the ipset watcher's ring buffer when an ipset command returns (and every
    POLL_S in any case: another reader may consume a wake-up first), it compares the watcher's counts with the
    tables'; when a command ran since the tables were read (the program already leaves every frame to the stack: it
    compares the same counts) or an element's expiry window has passed, the tables are read again and released
    (SetMaps.sync)."""

    POLL_S = 0.02
    STATE_S = 0.5  # how often the deployment's state is looked at (a deploy may have started another program)
    RETRY_S = 1.0

    def __init__(self, log: Callable[[str], None]):
        self.log = log
        self.maps = None
        self.wake = None
        self.pin = ""
        self.error = ""
        self.next_expiry: int | None = None
        self.counts = {"syncs": 0, "expiries": 0, "failed": 0}
        self.lag_release: deque[float] = deque(maxlen=2000)  # ms: a command seen -> the tables released again
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, name="sets", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def close(self) -> None:
        self.stop.set()
        if self.thread.is_alive():
            self.thread.join(timeout=5)
        self._close()

    def _refresh(self) -> None:
        from hypafilter.targets.xdp import sets as setmaps
        from hypafilter.targets.xdp.target import _shape_of

        st = deploy.read_state() or {}
        nic = st.get("nic") or {}
        pin = nic.get("pin", "") if st.get("target") == "xdp" else ""
        if st.get("target") == "emu" and (st.get("tables") or {}).get("sets"):
            # a NIC core's set tables (ops.policysync.nicsets), and which set each slot holds: a follower of other
            # slots starts anew (deploy gives a plan that numbers them otherwise a new core anyway)
            rows = json.dumps(st["tables"]["sets"], sort_keys=True)
            pin = "emu:" + nic.get("socket", "") + ":" + hashlib.sha256(rows.encode()).hexdigest()[:16]
        if pin == self.pin:
            return
        if pin.startswith("emu:"):
            self._refresh_nic(st, pin)
            return
        self._close()
        self.pin, self.next_expiry = pin, None
        if not pin:
            return
        slots = setmaps.slots_of(_shape_of(nic))
        if slots:
            self.maps = setmaps.SetMaps(pin, slots, st["site"].get("netns"))
            self.wake = PinnedRingbuf(self.maps.watcher / "hfx_setwake")
            self.next_expiry = 0  # read them once now: whatever happened while nobody followed them

    def _refresh_nic(self, st: dict, pin: str) -> None:
        from hypafilter.ops.policysync.nicsets import NicSets
        from hypafilter.paths import BUILD_ROOT
        from hypafilter.targets.emu.target import EmuTarget

        self._close()
        self.pin, self.next_expiry = pin, None
        with setmaps_lock():  # loaded and registered as used in one step: no xdp stop releases it in between
            watcher = _ensure_watcher(BUILD_ROOT)
            self.maps = NicSets(EmuTarget(deploy.deployed_config(st)), st["nic"], st["tables"],
                                st["site"].get("netns"), watcher)  # fmt: skip
        self.wake = PinnedRingbuf(watcher / "hfx_setwake")
        self.next_expiry = 0  # read them once now: whatever happened while nobody followed them

    def _close(self) -> None:
        for m in (self.maps, self.wake):
            if m is not None:
                m.close()
        self.maps = self.wake = None

    def run(self) -> None:
        next_state = 0.0
        while not self.stop.is_set():
            now = time.monotonic()
            try:
                if now >= next_state:
                    self._refresh()
                    next_state = now + self.STATE_S
                if self.maps is None:
                    self.stop.wait(self.STATE_S)
                    continue
                started, _ = self.maps.counts()
                changed = started != self.maps.synced()
                due = self.next_expiry is not None and time.monotonic_ns() >= self.next_expiry
                if not changed and not due:
                    wait = self.POLL_S
                    if self.next_expiry is not None:
                        wait = min(wait, max(0.0, (self.next_expiry - time.monotonic_ns()) / 1e9))
                    self.wake.wait(wait)
                    continue
                t0 = time.monotonic()
                r = self.maps.sync()
                if changed:
                    self.lag_release.append((time.monotonic() - t0) * 1e3)
                self.counts["syncs"] += 1
                self.counts["expiries"] += int(due)
                self.next_expiry = r.next_expiry_ns
                self.error = ""
            except (HypafilterError, OSError) as e:
                if str(e) != self.error:
                    self.log(f"sets: {e}")
                self.error = str(e)
                self.counts["failed"] += 1
                self.stop.wait(self.RETRY_S)

    def doc(self) -> dict:
        return {
            "following": self.maps is not None and not self.error,
            "error": self.error,
            **self.counts,
            "lag_release_ms": _pct(self.lag_release),
        }
