"""The synchroniser (pure: the table and conntrack are parameters): `Syncer` keeps a table with NicClient's flow
API equal to the offloadable entries of conntrack, from its events, a dump at start and polls of the table."""

from __future__ import annotations

import bisect
import socket
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from hypafilter.hw.flowcache import OP_DELETE, OP_INSERT, PROTO_TCP, ST_EXISTS, ST_FULL, ST_NOT_FOUND, ST_OK, Flow
from hypafilter.ops.flowsync.events import (
    IPS_ASSURED,
    TCP_CONNTRACK_TIME_WAIT,
    TCP_OFFLOAD_STATES,
    CtEvent,
    offload_reason,
)

# Polls without a hit after which a TIME_WAIT flow leaves the hardware (conntrack keeps its entry; its frames miss
# and go to software, which is always right): a closed connection's TIME_WAIT entry does not hold a flow-cache way
# for the state's two minutes.
TIME_WAIT_IDLE_POLLS = 2
POLL_CHUNK = 512  # flow-cache slots a poll reads besides those of the flows it installed (the table in turn)
# A poll reads the slots of the flows it installed, all of them while there are at most POLL_CHUNK, else in turn so
# that each is read once every POLL_CYCLE polls (8 s at the default interval; a held flow's shortest conntrack
# timeout is UDP's 30 s): with the cache full (4,096 flows) every poll read every slot, took 1 s of the 1 s interval
# (p50 985 ms) and kept the emulated NIC busy with register reads half of a core, without a frame.
POLL_CYCLE = 8
POLL_PIECE = 32  # slots a poll reads before it looks at the conntrack events again (Syncer.poll's `between`)
# ... or fewer, as many as the last piece's pace reads in this long: on a slow NIC (an 11,100-entry emulated core at
# load 20: ~180 ms a slot) 32 slots kept `between`, and with it COMPLETE's renewal (a 500 ms lease), away for seconds
POLL_PIECE_S = 0.05
RESYNC_PIECE = 4096  # entries a resync goes through before its `between` (the service: events off their socket)
LAG_SAMPLES = 4096  # sync lag: the last this many event -> hardware-write times
LAG_PHASES = ("read", "liberal", "nic")  # the parts of the lag (Syncer.phases)


def refresh_due(last_hits: int | None, counted: bool, hits: int) -> bool:
    """Whether a hardware flow was hit since the last poll: its counter moved (it wraps, so any change), or it
    was hit for the first time (FLOW_KEY's counted bit: hits read 0 until then)."""
    if not counted:
        return False
    return last_hits is None or hits != last_hits


def percentile(values: Iterable[float], q: float) -> float | None:
    v = sorted(values)
    if not v:
        return None
    return v[min(len(v) - 1, int(q * len(v)))]


@dataclass
class Installed:
    proto: int
    assured: bool
    last_hits: int | None = None
    tcp_state: int | None = None  # the TCP state conntrack last reported (its timeout is the one a refresh sets)
    slot: int | None = None  # where the flow cache put it (entries do not move)
    idle_polls: int = 0  # polls in a row that found no hit (a TIME_WAIT flow leaves after TIME_WAIT_IDLE_POLLS)
    set_: int | None = None  # the flow-cache set it takes a way of (`table.flow_set`; None: a table without sets)


@dataclass
class Waiting:
    """A flow that belongs in the table but whose set has no free way: not inserted, not marked liberal (its frames
    go to software); it takes the next way of its set that frees, the most recently active of the set's waiting
    flows first (`stamp`: the clock time of its last known activity)."""

    ev: CtEvent
    stamp: float
    set_: int


@dataclass
class Syncer:
    """Keeps `table` (NicClient's flow API: flow_config, flow_commands, flow_entries, flow_counters, flow_clear)
    equal to the offloadable entries of conntrack `ct` (set_liberal_many(evs): per entry True, or False when
    conntrack no longer has it; refresh(flow, proto, seconds): True when the entry is there and still
    offloadable and its timeout is set, else False).

    Properties of the table, which every table declares (NicClient, `LiberalMarks`), say what it is:
    `protocols` and `families`, the protocols and address families of the flows it holds, and `hit_counters`,
    whether it counts hits that the poll reads. A table without hit counters (`LiberalMarks`, the xdp target's) gets no poll: nothing to refresh from,
    nothing another writer could leave in it."""

    table: object
    ct: object
    timeouts: dict[str, int]
    clock: Callable[[], float] = time.monotonic
    installed: dict[Flow, Installed] = field(default_factory=dict)
    counters: dict[str, int] = field(
        default_factory=lambda: dict.fromkeys(
            (
                "events",
                "inserts",
                "deletes",
                "evictions",
                "insert_failures",
                "refreshes",
                "liberal",
                "errors",
                "resyncs",
            ),
            0,
        )
    )
    lag: deque = field(default_factory=lambda: deque(maxlen=LAG_SAMPLES))
    # Where the lag of an event batch with inserts goes (seconds each): reading and parsing the events, the
    # liberal-flag batch until its acks, the flow-cache batch until its last status.
    phases: dict = field(default_factory=lambda: {k: deque(maxlen=LAG_SAMPLES) for k in LAG_PHASES})
    # Per poll: its duration, and the longest stretch of it in which no events were read (seconds).
    poll_times: deque = field(default_factory=lambda: deque(maxlen=LAG_SAMPLES))
    poll_blocks: deque = field(default_factory=lambda: deque(maxlen=LAG_SAMPLES))
    scan_at: int = 0  # the first slot of the next poll's part of the table
    piece: int = POLL_PIECE  # slots the next piece of a poll reads (Syncer.poll: by the last piece's pace)
    held_at: int = 0  # the first of the installed flows' slots (in slot order) the next poll reads, when in turn
    last_error: str = ""
    # Flows whose set is full (`Waiting`), and per set the waiting flows and the ways taken (of installed flows).
    waiting: dict[Flow, Waiting] = field(default_factory=dict)
    queues: dict[int, set[Flow]] = field(default_factory=dict)
    fill: dict[int, int] = field(default_factory=dict)

    def _ways(self) -> int:
        return self.table.flow_config().ways

    def _wait(self, ev: CtEvent, stamp: float, set_: int) -> None:
        self.waiting[ev.flow] = Waiting(ev, stamp, set_)
        self.queues.setdefault(set_, set()).add(ev.flow)

    def _unwait(self, flow: Flow) -> Waiting | None:
        w = self.waiting.pop(flow, None)
        if w is not None:
            q = self.queues[w.set_]
            q.discard(flow)
            if not q:
                del self.queues[w.set_]
        return w

    def _fit(self, ops: list[tuple], between: Callable[[], None] = lambda: None) -> list[tuple]:
        """The ops without the inserts whose set has no free way once the deletes before them are done: those
        flows wait (`Waiting`) instead, counted as insert failures. The ways are counted from the flows installed,
        so a flow that cannot go in is neither sent to the table nor marked liberal (a resync over 250,000 entries
        sends the table 4,096 inserts, not 250,000 of which all but 4,096 fail). A table without sets
        (`flow_set` None: `LiberalMarks`) takes every insert it has room for."""
        if not self.table.set_limited:
            return ops
        ways = self._ways()
        fill = dict(self.fill)
        out = []
        for k, op in enumerate(ops):
            if k % RESYNC_PIECE == RESYNC_PIECE - 1:
                between()
            if op[0] == "delete":
                inst = self.installed.get(op[1])
                if inst is not None and inst.set_ is not None:
                    fill[inst.set_] -= 1
            else:
                s = self.table.flow_set(op[1].flow)
                if fill.get(s, 0) >= ways:
                    self._wait(op[1], op[3], s)
                    self.counters["insert_failures"] += 1
                    continue
                fill[s] = fill.get(s, 0) + 1
            out.append(op)
        return out

    def _refill(self, sets: Iterable[int]) -> list[tuple]:
        """Inserts of waiting flows into the free ways of `sets`, the most recently active first."""
        if not self.table.set_limited or not self.waiting:
            return []
        ways = self._ways()
        ops = []
        for s in sorted(set(sets)):
            room = ways - self.fill.get(s, 0)
            while room > 0 and s in self.queues:
                flow = max(self.queues[s], key=lambda f: self.waiting[f].stamp)
                w = self._unwait(flow)
                ops.append(("insert", w.ev, None, w.stamp))  # no event to measure a lag from
                room -= 1
        return ops

    def _installed(self, flow: Flow, inst: Installed) -> None:
        self.installed[flow] = inst
        if inst.set_ is not None:
            self.fill[inst.set_] = self.fill.get(inst.set_, 0) + 1

    def _uninstalled(self, flow: Flow) -> int | None:
        """Forget an installed flow; the set whose way it frees (None: none)."""
        inst = self.installed.pop(flow, None)
        if inst is None or inst.set_ is None:
            return None
        self.fill[inst.set_] -= 1
        return inst.set_

    def _apply(self, ops: list[tuple], between: Callable[[], None] = lambda: None) -> None:
        """Flow-cache changes, in order: ("insert", CtEvent, t_event, stamp) and ("delete", Flow, counter,
        t_event); an insert whose set has no free way waits instead (`_fit`), and the ways that deletes free go to
        the waiting flows of their sets (`_refill`), in further rounds. See `_apply_round`."""
        freed = self._apply_round(self._fit(ops, between))
        while ops := self._refill(freed):
            freed = self._apply_round(self._fit(ops, between))

    def _apply_round(self, ops: list[tuple]) -> set[int]:
        """Flow-cache changes, in order, as one flow-cache batch (NicClient.flow_commands: one round trip on the
        emulated NIC); the sets in which a way is free after them (a delete done, an insert not). The liberal flags
        of the TCP flows to insert are set first, in one conntrack batch: from the insert on conntrack misses the
        flow's established frames, and without it its window tracking would call the frames it sees later (FIN,
        RST, a shunted one) INVALID. An entry the event or dump already reports liberal in both directions (the
        mark is never taken back: after a worker restart, every entry the last one offloaded) is not updated again.
        A flow whose flag could not be set (conntrack no longer has it: its destroy event follows) is not inserted.
        t_event None: no event to measure a lag from."""
        t_apply = self.clock()
        t_first = min((op[2] for op in ops if op[0] == "insert" and op[2] is not None), default=None)
        tcp = [op[1] for op in ops if op[0] == "insert" and op[1].proto == PROTO_TCP and not op[1].liberal]
        ok = dict(zip(tcp, self.ct.set_liberal_many(tcp), strict=True)) if tcp else {}
        t_liberal = self.clock()
        self.counters["liberal"] += sum(ok.values())
        freed = {self.table.flow_set(op[1].flow) for op in ops if op[0] == "insert" and not ok.get(op[1], True)}
        ops = [op for op in ops if op[0] != "insert" or ok.get(op[1], True)]
        if not ops:
            return freed - {None}
        flows = [op[1].flow if op[0] == "insert" else op[1] for op in ops]
        results = self.table.flow_commands(
            [(OP_INSERT if op[0] == "insert" else OP_DELETE, f) for op, f in zip(ops, flows, strict=True)]
        )
        # An insert that finds its key is not one of ours (we insert a flow once): a leftover, maybe stored with
        # the other orientation, which would swap ORIGINAL and REPLY. Replace it.
        again = [k for k, op in enumerate(ops) if op[0] == "insert" and results[k][0] == ST_EXISTS]
        if again:
            redo = self.table.flow_commands([c for k in again for c in ((OP_DELETE, flows[k]), (OP_INSERT, flows[k]))])
            for j, k in enumerate(again):
                results[k] = redo[2 * j + 1]
        now = self.clock()
        if t_first is not None:
            for k, v in zip(LAG_PHASES, (t_apply - t_first, t_liberal - t_apply, now - t_liberal), strict=True):
                self.phases[k].append(v)
        for op, flow, (status, slot) in zip(ops, flows, results, strict=True):
            if op[0] == "delete":
                t_event = op[3]
                freed.add(self._uninstalled(flow))
                if status == ST_OK:
                    self.counters[op[2]] += 1
                    if t_event is not None:
                        self.lag.append(now - t_event)
                elif status != ST_NOT_FOUND:
                    self._error(f"flow_delete {flow}: status {status}")
                continue
            ev, t_event, stamp = op[1], op[2], op[3]
            if status == ST_OK:
                inst = Installed(ev.proto, bool(ev.status & IPS_ASSURED), tcp_state=ev.tcp_state, slot=slot)
                inst.set_ = self.table.flow_set(flow)
                self._installed(flow, inst)
                self.counters["inserts"] += 1
                if t_event is not None:
                    self.lag.append(now - t_event)
            elif status == ST_FULL:
                # the flow stays a miss (its frames go to software); in a table with sets it waits for a way
                self.counters["insert_failures"] += 1
                if (s := self.table.flow_set(flow)) is not None:
                    self._wait(ev, stamp, s)
            else:
                self._error(f"flow_insert {flow}: status {status}")
        return freed - {None}

    def _error(self, text: str) -> None:
        self.counters["errors"] += 1
        self.last_error = text

    def event(self, ev: CtEvent, t_event: float | None = None) -> str | None:
        """Apply one conntrack event; returns "install", "remove" or None (nothing to do)."""
        return self.events([ev], t_event)[0]

    def events(self, evs: Iterable[CtEvent], t_event: float | None = None) -> list[str | None]:
        """Apply conntrack events in order (those read off the socket together); per event "install", "remove"
        or None. The changes they call for go to the hardware together at the end, in event order (`_apply`: one
        conntrack batch for the liberal flags, one flow-cache batch), so the last of many flows that became
        established together, or of flows set up while others end, does not wait a round trip per flow. A flow
        to be installed that a later event of the batch removes is not inserted at all."""
        t_event = self.clock() if t_event is None else t_event
        out: list[str | None] = []
        ops: list[tuple | None] = []
        pending: dict[Flow, int] = {}  # flow -> index of its insert in ops
        removing: set[Flow] = set()  # installed flows this batch deletes
        for ev in evs:
            self.counters["events"] += 1
            flow = ev.flow
            if flow is None:
                out.append(None)
                continue
            if ev.kind in ("new", "update") and ev.proto == PROTO_TCP and ev.tcp_state is None:
                # The kernel puts protoinfo in an event only when it changed (IPCT_PROTOINFO): an update of the
                # status, mark or timeout alone leaves the TCP state as the last event said.
                out.append(None)
                continue
            want = self.wants(ev)
            if flow in self.waiting:
                if want:  # still waiting for a way, now as active as this event says
                    self.waiting[flow].ev, self.waiting[flow].stamp = ev, t_event
                    out.append(None)
                else:
                    self._unwait(flow)
                    out.append("remove")
                continue
            if flow in pending:
                k = pending[flow]
                if want:
                    ops[k] = ("insert", ev, t_event, t_event)  # installed with what conntrack said last
                    out.append(None)
                else:
                    ops[k] = None
                    del pending[flow]
                    out.append("remove")
                continue
            have = flow in self.installed and flow not in removing
            if want and not have:
                pending[flow] = len(ops)
                ops.append(("insert", ev, t_event, t_event))
                out.append("install")
            elif want and have:
                self.installed[flow].assured |= bool(ev.status & IPS_ASSURED)
                if ev.tcp_state is not None:
                    self.installed[flow].tcp_state = ev.tcp_state
                out.append(None)
            elif have:
                removing.add(flow)
                ops.append(("delete", flow, "deletes", t_event))
                out.append("remove")
            else:
                out.append(None)
        self._apply([op for op in ops if op is not None])
        return out

    def wants(self, ev: CtEvent) -> bool:
        """Whether the entry's flow belongs in the table: offloadable (`offload_reason`) and of a protocol and an
        address family the table holds (`families`; a table that does not say holds IPv4 only: the NIC's flow
        cache holds IPv6 tuples on a dual-stack core only, `LiberalMarks` holds both)."""
        return (
            offload_reason(ev) is None
            and ev.proto in self.table.protocols
            and ev.family in getattr(self.table, "families", (socket.AF_INET,))
        )

    def resync(self, entries: Iterable[CtEvent], between: Callable[[], None] = lambda: None) -> None:
        """Reconcile the table with a full conntrack dump: insert what should be there, delete the rest. When more
        flows belong in the table than its sets hold, the flows whose entries are marked liberal win (an earlier
        worker of the service held them: the mark is never taken back), then the most recently active
        (`last_active`): the inserts go in that order, and the flows left over wait for a way of their set
        (`_fit`). `between()` runs every RESYNC_PIECE entries (the service takes the events that come meanwhile
        off their socket there: a resync over 250,000 entries takes seconds)."""
        self.counters["resyncs"] += 1
        now = self.clock()
        want: dict[Flow, CtEvent] = {}
        for k, ev in enumerate(entries):
            if (flow := ev.flow) is not None and self.wants(ev):
                want[flow] = ev
            if k % RESYNC_PIECE == RESYNC_PIECE - 1:
                between()
        # an empty table (a new NIC at deploy, the supervisor's clear before a restart) is not read slot by slot:
        # every slot of the flow cache took 12-53 s of an 11,100-entry emulated core's time (issue #24)
        empty = self.table.flow_counters().get("occupancy") == 0
        present = {} if empty else {r.flow: r for r in self.table.flow_entries()}
        self.installed, self.fill, self.waiting, self.queues = {}, {}, {}, {}
        ops: list[tuple] = []
        inserts = []
        for flow, rec in present.items():
            ev = want.get(flow)
            if ev is None:  # held until its delete (below) frees its way
                inst = Installed(flow.proto, False, slot=rec.slot)
                ops.append(("delete", flow, "evictions", None))
            else:
                hits = rec.hits if rec.counted else None
                inst = Installed(ev.proto, bool(ev.status & IPS_ASSURED), hits, ev.tcp_state, rec.slot)
            inst.set_ = self.table.flow_set(flow)
            self._installed(flow, inst)
        for flow, ev in want.items():
            if flow not in present:
                inserts.append(("insert", ev, None, self.last_active(ev, now)))  # no event to measure a lag from
        # entries already marked liberal first (the flows an earlier worker held: a restart keeps its choice, and
        # marks no flow it will not hold), then the most recently active
        inserts.sort(key=lambda op: (not op[1].liberal, -op[3]))
        between()
        self._apply(ops + inserts, between)

    def last_active(self, ev: CtEvent, now: float) -> float:
        """When the entry last saw a frame, on the Syncer's clock: conntrack sets an entry's timeout to its
        state's full timeout at every frame, so the time since is the full timeout less what is left (the
        firewall's timeouts as read at start: `timeouts`). An entry without a timeout counts as active now."""
        if ev.timeout is None:
            return now
        if ev.proto == PROTO_TCP:
            full = self.timeout_for(Installed(ev.proto, False, tcp_state=ev.tcp_state))
        else:
            full = self.timeout_for(Installed(ev.proto, bool(ev.status & IPS_ASSURED)))
        return now - max(0, full - ev.timeout)

    def timeout_for(self, inst: Installed) -> int:
        if inst.proto == PROTO_TCP:
            name = TCP_OFFLOAD_STATES.get(inst.tcp_state, "established")
            return self.timeouts["tcp" if name == "established" else f"tcp_{name}"]
        return self.timeouts["udp_stream"] if inst.assured else self.timeouts["udp"]

    def poll(self, between: Callable[[], None] = lambda: None) -> None:
        """Refresh the conntrack timeout of every flow the hardware saw since the last poll; evict hardware flows
        whose conntrack entry is gone and flows this service did not install. A poll reads the slots of the flows
        it installed (all of them up to POLL_CHUNK flows, else the next max(POLL_CHUNK, flows / POLL_CYCLE) in
        turn) and the next POLL_CHUNK slots of the table in turn (all of it every entries / POLL_CHUNK polls: 8
        with 4,096 entries), not the whole table: reading 4,096 slots took 70-130 ms of the emulated NIC's time
        every poll, which new flows waited for; only another writer can leave a flow it did not install once the
        resync at start has read everything. TIME_WAIT_IDLE_POLLS counts the polls that read a flow.

        `between()` runs after every piece of slots read (POLL_PIECE, or as many as the last piece's pace reads in
        POLL_PIECE_S, at least one) and every refresh: the service applies the conntrack
        events that came meanwhile there, so a flow established during a poll (40-110 ms of it under load when it
        was read in one piece) does not wait for its end. An eviction decided before such events is applied only
        if the flow's record is still the one it was decided on (an event may have removed it, or installed it
        anew).

        A table without hit counters (`hit_counters` False: `LiberalMarks`) is not polled at all: whoever decides
        its flows' frames refreshes their conntrack timeouts itself, and only this service writes it."""
        if not self.table.hit_counters:
            return
        t0 = block = self.clock()
        longest = 0.0

        def gap() -> None:
            nonlocal block, longest
            longest = max(longest, self.clock() - block)
            between()
            block = self.clock()

        entries = self.table.flow_config().entries
        first = self.scan_at % entries
        window = range(first, min(first + POLL_CHUNK, entries))
        self.scan_at = window.stop % entries
        held = sorted(i.slot for i in self.installed.values() if i.slot is not None)
        if len(held) > POLL_CHUNK:
            take = max(POLL_CHUNK, -(-len(held) // POLL_CYCLE))
            start = bisect.bisect_left(held, self.held_at)
            held = (held[start:] + held[:start])[:take]
            self.held_at = held[-1] + 1
        slots = sorted(set(held).union(window))
        evict: list[tuple[Flow, Installed | None]] = []  # flow, its record when the eviction was decided
        k = 0
        while k < len(slots):
            part = slots[k : k + max(1, min(self.piece, POLL_PIECE))]
            k += len(part)
            t_read = self.clock()
            recs = self.table.flow_entries(part)
            per_slot = (self.clock() - t_read) / len(part)
            self.piece = POLL_PIECE if per_slot <= 0 else max(1, min(POLL_PIECE, int(POLL_PIECE_S / per_slot)))
            gap()
            for rec in recs:
                inst = self.installed.get(rec.flow)
                if inst is None:
                    evict.append((rec.flow, None))
                    continue
                if refresh_due(inst.last_hits, rec.counted, rec.hits):
                    inst.last_hits, inst.idle_polls = rec.hits, 0
                    done = self.ct.refresh(rec.flow, inst.proto, self.timeout_for(inst), inst.tcp_state)
                    if done:
                        self.counters["refreshes"] += 1
                    else:
                        evict.append((rec.flow, inst))
                    gap()
                elif inst.proto == PROTO_TCP and inst.tcp_state == TCP_CONNTRACK_TIME_WAIT:
                    inst.idle_polls += 1
                    if inst.idle_polls >= TIME_WAIT_IDLE_POLLS:
                        evict.append((rec.flow, inst))
        self._apply([("delete", f, "evictions", None) for f, seen in evict if self.installed.get(f) is seen])
        self.poll_blocks.append(max(longest, self.clock() - block))
        self.poll_times.append(self.clock() - t0)

    def stats(self) -> dict:
        lag = list(self.lag)
        p50, mx = percentile(lag, 0.5), max(lag) if lag else None
        return {
            **self.counters,
            "offloaded": len(self.installed),
            "waiting": len(self.waiting),
            "lag_samples": len(lag),
            "lag_p50_ms": None if p50 is None else round(p50 * 1000, 3),
            "lag_max_ms": None if mx is None else round(mx * 1000, 3),
            **{
                f"lag_{k}_{q}_ms": None if not v else round(f(v) * 1000, 3)
                for k, v in self.phases.items()
                for q, f in (("p50", lambda x: percentile(x, 0.5)), ("max", max))
            },
            **{
                f"poll_{k}_{q}_ms": None if not v else round(f(v) * 1000, 3)
                for k, v in (("time", self.poll_times), ("block", self.poll_blocks))
                for q, f in (("p50", lambda x: percentile(x, 0.5)), ("max", max))
            },
            "last_error": self.last_error,
        }
