"""The NIC's conntrack membership structure kept complete (docs/flowsync.md, "New flows on the NIC"): every conntrack
entry's tuples go in on its first event or dump line, out on its destroy; a full load at start and after lost events;
COMPLETE set, and its lease renewed, only while the service has caught up with conntrack's events recently enough that
the NIC's recent-egress window covers every reply it has not inserted yet (`Members.renew`), and never before a load's
clear and inserts are done (the load does not wait for the clear's sweep: the service is ready first). Pure: the NIC
client and the clock are parameters."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from hypafilter.hw import ctmember
from hypafilter.hw.flowcache import PROTO_TCP, PROTO_UDP, Flow, Flow6
from hypafilter.ops.flowsync.events import CtEvent, _ipv4, _ipv6
from hypafilter.ops.flowsync.hold import held, hold_lock

# COMPLETE's lease (ms): the hardware drops COMPLETE this long after the last renewal. The service renews it every
# RENEW_EVERY seconds, only at a moment it has caught up with conntrack's events (`caught_up`), and only when that
# moment plus the lease stays within the egress window less MARGIN_MS (the sync-lag argument, docs/flowsync.md).
LEASE_MS = 500
RENEW_EVERY = 0.1
MARGIN_MS = 200
LOAD_CHUNK = 2048  # inserts a `load_step` sends (about 0.5 s on the emulated NIC) before the service looks at events


def entry_keys(ev: CtEvent, v6: bool = False) -> tuple[int, ...]:
    """The keys of an entry's tuples as seen on the wire (original, and reply when NAT makes it another key); () for
    what the structure does not hold (not TCP/UDP: such frames never get ct 3; IPv6 unless the structure takes IPv6
    keys, `v6`: a dual-stack core's, whose other IPv6 frames then never get ct 3)."""
    if ev.flow is None or ev.proto not in (PROTO_TCP, PROTO_UDP):
        return ()
    if ev.family == socket.AF_INET6 and v6:
        keys = [ctmember.key_of(ev.flow)]
        if ev.reply is not None:
            rs, rd, rsp, rdp = ev.reply
            k = ctmember.key_of(Flow6(_ipv6(rs), _ipv6(rd), ev.proto, rsp, rdp))
            if k != keys[0]:
                keys.append(k)
        return tuple(keys)
    if ev.family != socket.AF_INET:
        return ()
    keys = [ctmember.key_of(ev.flow)]
    if ev.reply is not None:
        rs, rd, rsp, rdp = ev.reply
        k = ctmember.key_of(Flow(_ipv4(rs), _ipv4(rd), ev.proto, rsp, rdp))
        if k != keys[0]:
            keys.append(k)
    return tuple(keys)


_key_flow = ctmember.key_flow  # a flow whose key is `key` (the hardware canonicalises the command's tuple itself)


@dataclass
class Members:
    """The entries the structure holds (by their original tuple and zone), and COMPLETE's state."""

    nic: object  # NicClient: ctm_commands, ctm_complete, ctm_counters, ctm_config
    clock: Callable[[], float] = time.monotonic
    lease_ms: int = LEASE_MS
    window_ms: int = ctmember.DEFAULT_WINDOW_MS
    # the structure takes IPv6 keys (NicClient.ctm_v6: a dual-stack core): IPv6 entries go in too, before COMPLETE
    v6: bool = False
    held: dict[tuple, tuple[int, ...]] = field(default_factory=dict)
    # a full load's entries not inserted yet (`load_step` puts them in, a chunk at a time, between the events): no
    # COMPLETE until none is left
    pending: dict[tuple, tuple[int, ...]] = field(default_factory=dict)
    complete: bool = False
    # a load's clear is to be made or is sweeping (`load_step` asks the NIC between the events; nothing is written to
    # CTM_CMD while a sweep runs, the write would wait on the bus for the rest of it: 9-44 s on a large emulated core)
    clearing: bool = False
    clear_sent: bool = False
    # wall-clock moments of the last load, of its sweep seen done and of its first COMPLETE (status, docs)
    load_at: float | None = None
    cleared_at: float | None = None
    complete_at: float | None = None
    caught_up_at: float | None = None  # the last moment no conntrack event was waiting
    renewed_at: float = 0.0
    # the deployment's state directory: while its new-flows hold exists (the policy sync service found a helper,
    # expectation, notrack or zone: ops.policysync.newflows) COMPLETE is not set, looked at under the hold's lock
    state_dir: Path | None = None
    counters: dict[str, int] = field(
        default_factory=lambda: dict.fromkeys(("inserts", "deletes", "loads", "renewals", "withheld", "held"), 0)
    )

    @staticmethod
    def ident(ev: CtEvent) -> tuple:
        return (ev.family, ev.proto, ev.src, ev.dst, ev.sport, ev.dport, ev.zone or 0)

    def _ops(self, evs: Iterable[CtEvent]) -> list[tuple[int, Flow]]:
        ops = []
        for ev in evs:
            ident = self.ident(ev)
            if ev.kind == "destroy":
                if self.pending.pop(ident, None) is not None:
                    continue  # never inserted: nothing to take out
                for k in self.held.pop(ident, ()):
                    ops.append((ctmember.OP_DELETE, _key_flow(k)))
                    self.counters["deletes"] += 1
            elif ident not in self.held and ident not in self.pending:
                keys = entry_keys(ev, self.v6)
                if keys and self.clearing:
                    self.pending[ident] = keys  # inserted after the sweep, with the load's entries
                elif keys:
                    self.held[ident] = keys
                    for k in keys:
                        ops.append((ctmember.OP_INSERT, _key_flow(k)))
                        self.counters["inserts"] += 1
        return ops

    def events(self, evs: Iterable[CtEvent]) -> None:
        """Apply conntrack events (in order): a new entry's tuples in, a destroyed one's out."""
        ops = self._ops(evs)
        if ops:
            self.nic.ctm_commands(ops)

    def load(self, entries: Iterable[CtEvent]) -> None:
        """A full load (start, lost events): COMPLETE off, every entry of the dump pending, a clear to make. Returns
        without making it or waiting for its sweep (2**LOG2 cycles: 9-44 s on an 11,100-entry emulated core, which
        held the service's start past its readiness limit): `load_step`, between the events, makes the clear, waits
        for its sweep and then inserts the pending entries a chunk at a time, so that the service goes on with its
        events (and its start is not held up: 250,000 entries take about a minute on the emulated NIC). COMPLETE
        comes back with the first renewal after the last chunk, once the service has caught up."""
        self.withdraw()
        self.held.clear()
        self.pending.clear()
        # the clear and its sweep (`load_step`): lookups answer "member" meanwhile (only share is lost), and
        # COMPLETE waits for its end
        self.clearing, self.clear_sent = True, False
        self.load_at, self.cleared_at, self.complete_at = time.time(), None, None
        for ev in entries:
            if ev.kind != "destroy" and (keys := entry_keys(ev, self.v6)):
                self.pending[self.ident(ev)] = keys
        self.counters["loads"] += 1

    def load_step(self, limit: int = LOAD_CHUNK) -> bool:
        """A load's clear: once the structure is idle (one status read burst, `NicClient.ctm_idle`; a sweep may run
        already, the one after the core's reset) the clear command, then whether its sweep is over yet; after it,
        insert up to `limit` pending entries. Whether the load has more to do."""
        if self.clearing:
            if not self.nic.ctm_idle():
                return True
            if not self.clear_sent:
                self.nic.ctm_commands([(ctmember.OP_CLEAR, None)])
                self.clear_sent = True
                return True
            self.clearing = False
            self.cleared_at = time.time()
        ops = []
        while self.pending and len(ops) < limit:
            ident, keys = next(iter(self.pending.items()))
            del self.pending[ident]
            self.held[ident] = keys
            ops += [(ctmember.OP_INSERT, _key_flow(k)) for k in keys]
            self.counters["inserts"] += len(keys)
        if ops:
            self.nic.ctm_commands(ops)
        return bool(self.pending)

    def withdraw(self) -> None:
        self.nic.ctm_complete(0)
        self.complete = False
        self.caught_up_at = None

    def caught_up(self, t: float | None = None) -> None:
        """No conntrack event waits now (every event read so far is applied)."""
        self.caught_up_at = self.clock() if t is None else t

    def renew(self) -> None:
        """Set COMPLETE with a fresh lease when the last catch-up is recent enough: until the lease runs out, every
        entry confirmed after that catch-up has its first frame out through the NIC at most lease + (now - catch-up)
        ago, which the egress window (less a margin) covers. Otherwise leave the lease to run out."""
        now = self.clock()
        if now - self.renewed_at < RENEW_EVERY and self.complete:
            return
        if self.caught_up_at is None or self.pending or self.clearing:
            return
        behind_ms = (now - self.caught_up_at) * 1000.0
        if behind_ms + self.lease_ms > self.window_ms - MARGIN_MS:
            self.counters["withheld"] += 1
            return
        if self.state_dir is not None:
            with hold_lock(self.state_dir):
                if held(self.state_dir):
                    self.counters["held"] += 1
                    self.complete = False
                    return
                self.nic.ctm_complete(self.lease_ms)
        else:
            self.nic.ctm_complete(self.lease_ms)
        self.complete = True
        if self.complete_at is None:
            self.complete_at = time.time()
        self.renewed_at = now
        self.counters["renewals"] += 1

    def phase(self) -> str:
        """Where the structure stands: "clearing" (a load's sweep), "loading" (inserts pending), "loaded" (waiting
        for a renewal: caught up, within the window, no hold), "complete" (a miss is NEW: ct 3)."""
        if self.clearing:
            return "clearing"
        if self.pending:
            return "loading"
        return "complete" if self.complete else "loaded"

    def stats(self) -> dict:
        return {
            "entries": len(self.held),
            "families": ["ipv4", "ipv6"] if self.v6 else ["ipv4"],
            "pending": len(self.pending),
            "complete": self.complete,
            "phase": self.phase(),
            "load_at": self.load_at,
            "cleared_at": self.cleared_at,
            "complete_at": self.complete_at,
            **self.counters,
        }
