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
"""

from __future__ import annotations

import contextlib
import errno
import os
import select
import signal
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

from hypafilter import netns
from hypafilter.errors import HypafilterError
from hypafilter.ops import deploy
from hypafilter.ops.policysync import live
from hypafilter.ops.policysync.nftevents import NfTables, NftEvent
from hypafilter.ops.policysync.service import SERVICE

COALESCE_S = 0.002  # after a change, events arriving this soon join it (a tool's several commands)
STATUS_EVERY = 1.0  # seconds between two status files while nothing happens
SERVICE_NICE = -10


def _pct(xs) -> dict:
    if not xs:
        return {"n": 0}
    s = sorted(xs)
    return {
        "n": len(s),
        "p50": round(s[len(s) // 2], 3),
        "p99": round(s[min(len(s) - 1, int(len(s) * 0.99))], 3),
        "max": round(s[-1], 3),
        "last": round(xs[-1], 3),
    }


class Follower:
    """The fast path of the deployment in `state_dir`, kept in step with the live ruleset of `ns`."""

    def __init__(self, ns: str, state_dir: Path, nft: NfTables, log: Callable[[str], None]):
        self.ns, self.state_dir, self.nft, self.log = ns, Path(state_dir), nft, log
        self.safe = False  # step 1 in force
        self.error = ""
        self.counts = {"events": 0, "changes": 0, "own": 0, "applied": 0, "unchanged": 0, "failed": 0, "resyncs": 0}
        self.lag_safe: deque[float] = deque(maxlen=2000)  # ms: events read -> fail safe in force
        self.lag_apply: deque[float] = deque(maxlen=2000)  # ms: events read -> the fast path decides again
        self.generation = 0  # the nf_tables generation last read
        self._st: dict | None = None
        self._tgt = self._shim = None
        self.last_kind = ""

    def state(self, fresh: bool = True) -> dict:
        """The deployment's state (`fresh`: read again; else as last read, what the fail safe needs)."""
        if fresh or self._st is None:
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
        st = self.state(fresh=False)
        self._tgt.shunt_all_now(st["nic"])
        self._shim.set_generation(st["generation"] + 1 if st["generation"] < 0xFFFF else 1)
        self.safe = True

    def release(self) -> None:
        """Undo `fail_safe` when the live ruleset turned out to be the deployed policy."""
        st = self.state()
        deploy.shim_of(st).update(generation=st["generation"])
        deploy.target_of(st, deploy.state_config(st)).shunt_all(st["nic"], False)
        self.safe = False

    def sync(self, reason: str, t0: float | None = None) -> None:
        """Read the live ruleset and bring the fast path into step with it."""
        st = self.state()
        cfg = deploy.deployed_config(st)
        try:
            text, self.generation = live.listing(self.ns, cfg.table, self.nft.generation)
            policy = live.live_policy(text, st, cfg)
            if policy.policy_hash() == st["policy_hash"]:
                self.counts["unchanged"] += 1
                if self.safe:
                    self.release()
            else:
                self.fail_safe()
                new = deploy.follow(policy, self.log)
                self.safe = False
                self.state()  # the new generation, tables and perhaps NIC: what the next fail safe writes to
                self.counts["applied"] += 1
                last = (new.get("history") or [{}])[-1]
                self.last_kind = (
                    "buffer"
                    if last.get("overlay_slots") is not None and not last.get("replaced_nic")
                    else ("new core" if last.get("replaced_nic") else "registers")
                )
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

    def doc(self) -> dict:
        return {
            "following": not self.error,
            "error": self.error,
            "safe": self.safe,
            "nft_generation": self.generation,
            **self.counts,
            "lag_safe_ms": _pct(self.lag_safe),
            "lag_apply_ms": _pct(self.lag_apply),
            "last_kind": self.last_kind,
        }


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
        print(f"policysync: {msg}", flush=True)

    f = Follower(ns, state_dir, nft, log)
    table = deploy.deployed_config(f.state()).table

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
            },
        )

    try:
        f.sync("start")
        status()
        next_status = time.monotonic() + STATUS_EVERY
        dirty = False
        while not stopping:
            r, _, _ = select.select([nft.events], [], [], max(0.0, next_status - time.monotonic()))
            t0 = time.monotonic()
            change = False
            lost = False
            while r:
                try:
                    events = nft.read_events()
                except OSError as e:
                    if e.errno != errno.ENOBUFS:
                        raise
                    lost = True
                    events = []
                for e in events:
                    f.counts["events"] += 1
                    if e.kind != "newgen":
                        dirty |= relevant(e, table)
                        continue
                    if dirty and e.pid not in netns.SPAWNED:
                        change = True
                        if not f.safe:  # step 1 at once, before the listing
                            try:
                                f.fail_safe()
                                f.lag_safe.append((time.monotonic() - t0) * 1000)
                            except (HypafilterError, OSError) as ex:
                                f.error = f"fail safe: {ex}"
                    elif dirty:
                        f.counts["own"] += 1
                    dirty = False
                if not (change or lost):
                    break
                r, _, _ = select.select([nft.events], [], [], COALESCE_S)
            if lost:
                f.counts["resyncs"] += 1
                with contextlib.suppress(HypafilterError, OSError):
                    f.fail_safe()
            elif change:
                f.counts["changes"] += 1
            if lost or change:
                # the fail safe in force, said before the read and apply (a new core takes seconds): the status
                # file must not show the last change's "safe": false meanwhile
                status()
                f.sync("events lost (ENOBUFS)" if lost else "change", t0)
            if change or lost or time.monotonic() >= next_status:
                status()
                next_status = time.monotonic() + STATUS_EVERY
    finally:
        nft.close()
        SERVICE.write_status_file(
            state_dir, {"running": False, "pid": service_pid, "stopped_at": time.time(), "ns": ns}
        )


def supervise(ns: str, state_dir: Path) -> int:
    """The service process: `serve` in a supervised worker (ops.daemon); a worker that ends abnormally leaves the
    fast path as it was (shunting everything if it had begun a change), and the next one reads the ruleset again."""

    def open_worker():
        return lambda me, restarts: serve(ns, state_dir, service_pid=me, restarts=restarts)

    return SERVICE.supervise(Path(state_dir), open_worker, None, {"ns": ns})
