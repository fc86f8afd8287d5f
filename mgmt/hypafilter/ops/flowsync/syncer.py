"""The synchroniser (pure: the table and conntrack are parameters): `Syncer` keeps a table with NicClient's flow
API equal to the offloadable entries of conntrack, from its events, a dump at start and polls of the table."""

from __future__ import annotations

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
POLL_PIECE = 32  # slots a poll reads before it looks at the conntrack events again (Syncer.poll's `between`)
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


@dataclass
class Syncer:
    """Keeps `table` (NicClient's flow API: flow_config, flow_commands, flow_entries, flow_counters, flow_clear)
    equal to the offloadable entries of conntrack `ct` (set_liberal_many(evs): per entry True, or False when
    conntrack no longer has it; refresh(flow, proto, seconds): True when the entry is there and still
    offloadable and its timeout is set, else False).

    Two properties of the table, which every table declares (NicClient, `LiberalMarks`), say what it is:
    `protocols`, the protocols of the flows it holds, and `hit_counters`, whether it counts hits that the poll
    reads. A table without hit counters (`LiberalMarks`, the xdp target's) gets no poll: nothing to refresh from,
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
    last_error: str = ""

    def _apply(self, ops: list[tuple]) -> None:
        """Flow-cache changes, in order: ("insert", CtEvent, t_event) and ("delete", Flow, counter, t_event), as
        one flow-cache batch (NicClient.flow_commands: one round trip on the emulated NIC). The liberal flags of
        the TCP flows to insert are set first, in one conntrack batch: from the insert on conntrack misses the
        flow's established frames, and without it its window tracking would call the frames it sees later (FIN,
        RST, a shunted one) INVALID. A flow whose flag could not be set (conntrack no longer has it: its destroy
        event follows) is not inserted. t_event None: no event to measure a lag from."""
        t_apply = self.clock()
        t_first = min((op[-1] for op in ops if op[0] == "insert" and op[-1] is not None), default=None)
        tcp = [op[1] for op in ops if op[0] == "insert" and op[1].proto == PROTO_TCP]
        ok = dict(zip(tcp, self.ct.set_liberal_many(tcp), strict=True)) if tcp else {}
        t_liberal = self.clock()
        self.counters["liberal"] += sum(ok.values())
        ops = [op for op in ops if op[0] != "insert" or ok.get(op[1], True)]
        if not ops:
            return
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
            t_event = op[-1]
            if op[0] == "delete":
                self.installed.pop(flow, None)
                if status == ST_OK:
                    self.counters[op[2]] += 1
                    if t_event is not None:
                        self.lag.append(now - t_event)
                elif status != ST_NOT_FOUND:
                    self._error(f"flow_delete {flow}: status {status}")
            elif status == ST_OK:
                ev = op[1]
                self.installed[flow] = Installed(
                    ev.proto, bool(ev.status & IPS_ASSURED), tcp_state=ev.tcp_state, slot=slot
                )
                self.counters["inserts"] += 1
                if t_event is not None:
                    self.lag.append(now - t_event)
            elif status == ST_FULL:
                self.counters["insert_failures"] += 1  # the flow stays a miss: its frames go to software
            else:
                self._error(f"flow_insert {flow}: status {status}")

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
            if flow in pending:
                k = pending[flow]
                if want:
                    ops[k] = ("insert", ev, t_event)  # installed with what conntrack said last
                    out.append(None)
                else:
                    ops[k] = None
                    del pending[flow]
                    out.append("remove")
                continue
            have = flow in self.installed and flow not in removing
            if want and not have:
                pending[flow] = len(ops)
                ops.append(("insert", ev, t_event))
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
        """Whether the entry's flow belongs in the table: offloadable (`offload_reason`) and of a protocol the
        table holds."""
        return offload_reason(ev) is None and ev.proto in self.table.protocols

    def resync(self, entries: Iterable[CtEvent]) -> None:
        """Reconcile the table with a full conntrack dump: insert what should be there, delete the rest."""
        self.counters["resyncs"] += 1
        want: dict[Flow, CtEvent] = {}
        for ev in entries:
            if ev.flow is not None and self.wants(ev):
                want[ev.flow] = ev
        present = {r.flow: r for r in self.table.flow_entries()}
        self.installed = {f: i for f, i in self.installed.items() if f in present}
        ops: list[tuple] = [("delete", flow, "evictions", None) for flow in present if flow not in want]
        for flow, ev in want.items():
            if flow in present:
                rec = present[flow]
                self.installed[flow] = Installed(
                    ev.proto, bool(ev.status & IPS_ASSURED), rec.hits if rec.counted else None, ev.tcp_state, rec.slot
                )
            else:
                ops.append(("insert", ev, None))  # no event to measure a lag from
        self._apply(ops)

    def timeout_for(self, inst: Installed) -> int:
        if inst.proto == PROTO_TCP:
            name = TCP_OFFLOAD_STATES.get(inst.tcp_state, "established")
            return self.timeouts["tcp" if name == "established" else f"tcp_{name}"]
        return self.timeouts["udp_stream"] if inst.assured else self.timeouts["udp"]

    def poll(self, between: Callable[[], None] = lambda: None) -> None:
        """Refresh the conntrack timeout of every flow the hardware saw since the last poll; evict hardware flows
        whose conntrack entry is gone and flows this service did not install. A poll reads the slots of the flows
        it installed and the next POLL_CHUNK slots of the table in turn (all of it every entries / POLL_CHUNK
        polls: 8 with 4,096 entries), not the whole table: reading 4,096 slots took 70-130 ms of the emulated
        NIC's time every poll, which new flows waited for; only another writer can leave a flow it did not
        install once the resync at start has read everything.

        `between()` runs after every POLL_PIECE slots read and every refresh: the service applies the conntrack
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
        slots = sorted({i.slot for i in self.installed.values() if i.slot is not None}.union(window))
        evict: list[tuple[Flow, Installed | None]] = []  # flow, its record when the eviction was decided
        for k in range(0, len(slots), POLL_PIECE):
            recs = self.table.flow_entries(slots[k : k + POLL_PIECE])
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
