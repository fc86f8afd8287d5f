"""The flow sync service's pure part: which conntrack events install or remove a flow, the timeout refresh
decision, eviction and resync (ops/flowsync/: events, syncer, marks, policy), and the ctnetlink codec on the
generic netlink framing. The table here is a small in-memory one with NicClient's flow API (unit tier only;
tests/system/test_flowsync.py runs the service against real conntrack and the emulated NIC)."""

from __future__ import annotations

import socket
import struct
from dataclasses import dataclass

from hypafilter.hw import flowcache as fc
from hypafilter.ops.flowsync import syncer as sync
from hypafilter.ops.flowsync.ctnetlink import (
    CTA_PROTOINFO,
    CTA_PROTOINFO_TCP,
    CTA_PROTOINFO_TCP_STATE,
    CTA_STATUS,
    CTA_TUPLE_REPLY,
    IPCTNL_MSG_CT_NEW,
    ct_request,
    ct_tuple_attr,
    parse_event,
)
from hypafilter.ops.flowsync.events import (
    IPS_ASSURED,
    IPS_CONFIRMED,
    IPS_HELPER,
    IPS_SEEN_REPLY,
    IPS_SRC_NAT,
    CtEvent,
    offload_reason,
)
from hypafilter.ops.flowsync.marks import LiberalMarks
from hypafilter.ops.flowsync.policy import decides_established
from hypafilter.ops.flowsync.syncer import TIME_WAIT_IDLE_POLLS, Syncer, refresh_due
from hypafilter.ops.netlink import NLM_F_CREATE, nl_messages, nla

TCP, UDP = 6, 17
SYN_SENT, ESTABLISHED, FIN_WAIT, CLOSE_WAIT, LAST_ACK, TIME_WAIT = 1, 3, 4, 5, 6, 7
UP = IPS_CONFIRMED | IPS_SEEN_REPLY


@dataclass(frozen=True)
class Rec:
    slot: int
    flow: fc.Flow
    counted: bool
    seen: int
    hits: int


class MemTable:
    """Set-associative like the hardware (canonical key, CRC-32 set), so a full set refuses an insert."""

    protocols = (TCP, UDP)
    hit_counters = True
    set_limited = True
    wide = False  # a dual-stack core's cache: IPv6 tuples too (hw.flowcache's wide keys)

    def __init__(self, log2_sets: int = 4, ways: int = 2):
        self.log2_sets, self.ways = log2_sets, ways
        self.slots: dict[int, list] = {}  # slot -> [flow, hits]
        self.ops: list[tuple[str, fc.Flow]] = []
        self.batches: list[list] = []
        self.reads: list = []

    def flow_config(self):
        from hypafilter.targets.nic import FlowCacheConfig

        return FlowCacheConfig(self.log2_sets, self.ways, 16)

    def flow_set(self, flow):
        return fc.set_index(fc.canonical(flow, self.wide)[0], self.log2_sets, self.wide)

    def _find(self, flow):
        key, _ = fc.canonical(flow, self.wide)
        s = fc.set_index(key, self.log2_sets, self.wide)
        for w in range(self.ways):
            e = self.slots.get(fc.slot(w, s, self.log2_sets))
            if e and fc.canonical(e[0], self.wide)[0] == key:
                return fc.slot(w, s, self.log2_sets)
        return None

    def flow_insert(self, flow):
        self.ops.append(("insert", flow))
        if (sl := self._find(flow)) is not None:
            return fc.ST_EXISTS, sl
        s = fc.set_index(fc.canonical(flow, self.wide)[0], self.log2_sets, self.wide)
        for w in range(self.ways):
            sl = fc.slot(w, s, self.log2_sets)
            if sl not in self.slots:
                self.slots[sl] = [flow, 0]
                return fc.ST_OK, sl
        return fc.ST_FULL, 0

    def flow_delete(self, flow):
        self.ops.append(("delete", flow))
        sl = self._find(flow)
        if sl is None:
            return fc.ST_NOT_FOUND, 0
        del self.slots[sl]
        return fc.ST_OK, sl

    def flow_commands(self, cmds):
        """Inserts and deletes in order (NicClient.flow_commands); the batches are recorded."""
        self.batches.append([(op, flow) for op, flow in cmds])
        return [self.flow_insert(flow) if op == fc.OP_INSERT else self.flow_delete(flow) for op, flow in cmds]

    def flow_clear(self):
        self.slots.clear()

    def flow_entries(self, slots=None):
        self.reads.append(None if slots is None else sorted(slots))
        want = set(range(self.flow_config().entries) if slots is None else slots)
        return [Rec(sl, f, h > 0, 0, h) for sl, (f, h) in sorted(self.slots.items()) if sl in want]

    def flow_counters(self):
        return {"occupancy": len(self.slots)}

    def hit(self, flow, n=1):
        self.slots[self._find(flow)][1] += n


class MemCt:
    """Conntrack as the syncer sees it: entries by flow; liberal and timeout writes recorded."""

    def __init__(self):
        self.entries: set[fc.Flow] = set()
        self.calls: list[tuple] = []
        self.liberal_batches: list[list] = []

    def set_liberal_many(self, evs):
        self.calls += [("liberal", ev.flow) for ev in evs]
        self.liberal_batches.append([ev.flow for ev in evs])
        return [ev.flow in self.entries for ev in evs]

    def refresh(self, flow, proto, seconds, tcp_state=None):
        self.calls.append(("timeout", flow, seconds))
        return flow in self.entries


def ev(kind="update", proto=TCP, state=ESTABLISHED, status=UP, sport=40000, dport=80, **kw):
    src, dst = kw.pop("src", "10.0.0.1"), kw.pop("dst", "10.0.0.2")
    return CtEvent(
        kind=kind,
        family=kw.pop("family", socket.AF_INET),
        proto=proto,
        src=src,
        dst=dst,
        sport=sport,
        dport=dport,
        reply=kw.pop("reply", (dst, src, dport, sport)),
        status=status,
        tcp_state=state if proto == TCP else None,
        **kw,
    )


TIMEOUTS = {
    "tcp": 432000,
    "tcp_fin_wait": 120,
    "tcp_close_wait": 60,
    "tcp_time_wait": 119,
    "udp": 30,
    "udp_stream": 120,
}


def syncer():
    table, ct = MemTable(), MemCt()
    return Syncer(table, ct, dict(TIMEOUTS)), table, ct


def test_install_rule():
    assert offload_reason(ev()) is None
    assert offload_reason(ev(proto=UDP)) is None
    assert offload_reason(ev(state=SYN_SENT, status=IPS_CONFIRMED)) is not None
    assert offload_reason(ev(state=ESTABLISHED, status=IPS_CONFIRMED)) == "no reply seen"
    # half-closed flows stay (one FIN seen); once both ends closed, conntrack must see the last ACK
    assert offload_reason(ev(state=FIN_WAIT)) is None and offload_reason(ev(state=CLOSE_WAIT)) is None
    # LAST_ACK's next ACK moves conntrack to TIME_WAIT: conntrack must see it; in TIME_WAIT ACKs change nothing
    assert offload_reason(ev(state=LAST_ACK)) is not None and offload_reason(ev(state=TIME_WAIT)) is None
    assert offload_reason(ev(state=8)) is not None  # CLOSE
    assert offload_reason(ev(proto=UDP, status=IPS_CONFIRMED)) == "no reply seen"
    assert offload_reason(ev(status=IPS_SEEN_REPLY)) == "not confirmed"
    assert offload_reason(ev(kind="destroy")) == "destroyed"
    assert offload_reason(ev(proto=1)) == "not TCP/UDP over IPv4 or IPv6"
    # IPv6 TCP/UDP is offloadable; whether a table holds it is the table's (test_flowsync_ipv6.py)
    assert offload_reason(ev(family=socket.AF_INET6, src="::1", dst="::2")) is None
    assert offload_reason(ev(family=socket.AF_BRIDGE, src="::1", dst="::2")) == "not TCP/UDP over IPv4 or IPv6"
    assert offload_reason(ev(status=UP | IPS_SRC_NAT)) == "NAT"
    assert offload_reason(ev(reply=("10.9.9.9", "10.0.0.1", 80, 40000))) == "NAT"
    assert offload_reason(ev(status=UP | IPS_HELPER)) == "has a helper"
    assert offload_reason(ev(helper=True)) == "has a helper"
    assert offload_reason(ev(zone=3)) == "zone 3"
    assert offload_reason(ev(zone=0)) is None


def test_tcp_lifecycle_installs_on_established_removes_on_close():
    """Installed at ESTABLISHED, kept while half-closed (the other end may still send), removed once both FINs
    were seen; a refresh while half-closed sets that state's timeout, not the established one."""
    s, table, ct = syncer()
    e = ev()
    ct.entries.add(e.flow)
    assert s.event(ev(kind="new", state=SYN_SENT, status=IPS_CONFIRMED)) is None
    assert s.event(ev(state=2, status=UP)) is None  # SYN_RECV
    assert s.event(e) == "install"
    assert ct.calls == [("liberal", e.flow)]  # liberal before the insert
    assert table.ops == [("insert", e.flow)]
    assert s.event(e) is None  # our own liberal write comes back as an update
    assert s.event(ev(state=FIN_WAIT)) is None  # half-closed: stays
    table.hit(e.flow, 5)
    s.poll()
    assert ct.calls[-1] == ("timeout", e.flow, TIMEOUTS["tcp_fin_wait"])
    assert s.event(ev(state=LAST_ACK)) == "remove"
    assert s.event(ev(kind="destroy", status=0, state=None)) is None
    assert table.slots == {}
    st = s.stats()
    assert (st["inserts"], st["deletes"], st["offloaded"], st["lag_samples"]) == (1, 1, 0, 2)


def test_udp_installs_on_reply_and_leaves_on_destroy():
    s, table, ct = syncer()
    assert s.event(ev(kind="new", proto=UDP, status=IPS_CONFIRMED)) is None
    assert s.event(ev(proto=UDP)) == "install"
    assert ct.calls == []  # no liberal mode for UDP
    assert s.event(ev(kind="destroy", proto=UDP, status=0)) == "remove"
    assert table.slots == {} and s.counters["deletes"] == 1


def test_liberal_refused_means_no_insert():
    s, table, ct = syncer()  # conntrack does not have the entry (destroyed meanwhile)
    assert s.event(ev()) == "install"
    assert table.ops == [] and s.installed == {}


def test_full_set_is_an_insert_failure_and_stays_a_miss():
    s, table, ct = syncer()
    table.ways, table.log2_sets = 1, 0  # one slot in all
    a, b = ev(sport=1), ev(sport=2)
    ct.entries |= {a.flow, b.flow}
    s.event(a)
    s.event(b)
    assert s.counters["inserts"] == 1 and s.counters["insert_failures"] == 1
    assert set(s.installed) == {a.flow}


def test_a_flow_whose_set_is_full_waits_unmarked_and_takes_the_next_free_way():
    """More flows than the table holds: a flow whose set has no free way is neither marked liberal nor sent to the
    table (it waits, its frames go to software); the way a delete frees goes to the set's most recently active
    waiting flow, marked then; a waiting flow that conntrack destroys leaves the queue without a write."""
    s, table, ct = syncer()
    table.ways, table.log2_sets = 1, 0  # one slot in all
    a, b, c = ev(sport=1), ev(sport=2), ev(sport=3)
    ct.entries |= {a.flow, b.flow, c.flow}
    s.event(a, 1.0)
    table.batches.clear()
    ct.liberal_batches.clear()
    assert s.event(b, 2.0) == "install" and s.event(c, 3.0) == "install"  # wanted; both wait
    assert ct.liberal_batches == [] and table.batches == []  # nothing marked, nothing written
    assert s.counters["insert_failures"] == 2 and s.stats()["waiting"] == 2
    s.event(ev(sport=1, kind="destroy", status=0, state=None))  # a's way frees: c, the more recent, takes it
    assert ct.liberal_batches == [[c.flow]]
    assert table.batches == [[(fc.OP_DELETE, a.flow)], [(fc.OP_INSERT, c.flow)]]
    assert set(s.installed) == {c.flow} and s.stats()["waiting"] == 1
    assert s.event(b, 4.0) is None and s.waiting[b.flow].stamp == 4.0  # a newer event of a waiting flow
    assert s.event(ev(sport=2, kind="destroy", status=0, state=None)) == "remove"
    assert s.waiting == {} and s.queues == {} and ct.liberal_batches == [[c.flow]]
    s.event(ev(sport=3, kind="destroy", status=0, state=None))
    assert s.installed == {} and s.fill == {0: 0}


def test_resync_over_more_flows_than_the_table_holds_puts_the_most_recently_active_first():
    """A dump with more offloadable entries than the sets hold: in every set the entries already marked liberal
    (an earlier worker held them) and then those that saw a frame most recently (the least of their state's
    timeout used) get the ways, and only they are marked liberal; the rest wait. An entry already liberal in both
    directions is not marked again."""
    s, table, ct = syncer()
    table.ways, table.log2_sets = 2, 2  # 4 sets of 2
    dump = []
    for i in range(40):
        proto = TCP if i % 2 else UDP
        used = (i * 7919) % 97  # seconds of the state's timeout used: the entry's age
        full = TIMEOUTS["tcp"] if proto == TCP else TIMEOUTS["udp_stream"]
        st = UP | IPS_ASSURED
        dump.append(ev("dump", proto=proto, sport=1000 + i, status=st, timeout=full - used, liberal=i % 10 == 1))
    ct.entries |= {e.flow for e in dump}
    s.resync(dump)
    age = {e.flow: (TIMEOUTS["tcp"] if e.proto == TCP else TIMEOUTS["udp_stream"]) - e.timeout for e in dump}
    by_set: dict[int, list] = {}
    for e in dump:
        by_set.setdefault(table.flow_set(e.flow), []).append(e.flow)
    assert len(s.installed) == 8 and len(s.waiting) == 32 and s.counters["insert_failures"] == 32
    marked_before = {e.flow for e in dump if e.liberal}
    for flows in by_set.values():
        first = sorted(flows, key=lambda f: (f not in marked_before, age[f]))[:2]
        assert set(first) == {f for f in flows if f in s.installed}
    held = {e.flow for e in dump if e.flow in s.installed}
    marked = {f for b in ct.liberal_batches for f in b}
    assert marked == {e.flow for e in dump if e.flow in held and e.proto == TCP and not e.liberal}
    assert {f for _, f in table.batches[0]} == held and len(table.batches) == 1  # only what fits is written


def test_refresh_due():
    assert not refresh_due(None, False, 0)  # never hit
    assert refresh_due(None, True, 5)  # first hit since the insert
    assert not refresh_due(5, True, 5)
    assert refresh_due(5, True, 6)
    assert refresh_due(0xFFFFFFFF, True, 2)  # wrapped


def test_poll_refreshes_only_hit_flows_with_the_protocol_timeout():
    s, table, ct = syncer()
    t, u = ev(sport=1), ev(proto=UDP, sport=2, status=UP | IPS_ASSURED)
    u2 = ev(proto=UDP, sport=3)
    ct.entries |= {t.flow, u.flow, u2.flow}
    for e in (t, u, u2):
        s.event(e)
    ct.calls.clear()
    s.poll()
    assert ct.calls == []  # nothing hit yet
    table.hit(t.flow)
    table.hit(u.flow)
    table.hit(u2.flow)
    s.poll()
    assert set(ct.calls) == {("timeout", t.flow, 432000), ("timeout", u.flow, 120), ("timeout", u2.flow, 30)}
    ct.calls.clear()
    s.poll()
    assert ct.calls == []  # no new hits
    table.hit(t.flow)
    s.poll()
    assert ct.calls == [("timeout", t.flow, 432000)]
    assert s.counters["refreshes"] == 4


def test_poll_evicts_what_conntrack_lost_and_strangers():
    s, table, ct = syncer()
    a, b = ev(sport=1), ev(sport=2)
    ct.entries |= {a.flow, b.flow}
    s.event(a)
    s.event(b)
    stranger = ev(sport=3).flow
    table.flow_insert(stranger)
    ct.entries.discard(a.flow)  # its destroy event was lost
    table.hit(a.flow)
    s.poll()
    assert s.counters["evictions"] == 2
    assert {r.flow for r in table.flow_entries()} == {b.flow}
    assert set(s.installed) == {b.flow}


def test_resync_inserts_and_deletes_against_a_dump():
    s, table, ct = syncer()
    keep, new, gone = ev(sport=1), ev(sport=2), ev(sport=3)
    closing = ev(sport=4, state=LAST_ACK)
    table.flow_insert(keep.flow)
    table.flow_insert(gone.flow)
    table.flow_insert(closing.flow)
    table.hit(keep.flow, 7)
    ct.entries |= {keep.flow, new.flow, closing.flow}
    s.resync([keep, new, closing, ev(proto=UDP, status=IPS_CONFIRMED)])
    assert {r.flow for r in table.flow_entries()} == {keep.flow, new.flow}
    assert s.installed[keep.flow].last_hits == 7  # no refresh for hits from before the restart
    assert s.counters["evictions"] == 2 and s.counters["inserts"] == 1
    # an empty table (FC_OCCUPANCY 0) is not read slot by slot (issue #24: 12-53 s on an 11,100-entry emulated core)
    table.flow_clear()
    table.reads.clear()
    s.resync([keep, new])
    assert table.reads == [] and {r.flow for r in table.flow_entries()} == {keep.flow, new.flow}


def test_decides_established():
    """The plan's answer when it has one; from the entries' ct ranges once the IR has the field; else the policy."""
    from hypafilter.ir import box

    class P:
        reads_conntrack = True

    class PlanC1:
        decides_established = False

    class Entry:
        def __init__(self, boxes):
            self.boxes = boxes

    class Plan:
        def __init__(self, entries):
            self.entries = entries

    assert not decides_established(P(), PlanC1())
    if "ct" not in box.FIELD_INDEX:
        assert decides_established(P(), Plan([]))
        return
    full = box.Box.full()
    hit = full.with_field("ct", 1, 2)
    assert not decides_established(P(), Plan([Entry([full])]))  # every entry spans ct 0..3
    assert decides_established(P(), Plan([Entry([full]), Entry([hit])]))


def test_tcp_update_without_protoinfo_keeps_the_flow():
    """The kernel sends protoinfo only when it changed: an update of the status alone (ASSURED, our own liberal
    or timeout write) carries no TCP state and must not take an established flow out (it did, found on real
    conntrack: every connection was inserted twice)."""
    s, table, ct = syncer()
    e = ev()
    ct.entries.add(e.flow)
    assert s.event(e) == "install"
    assert s.event(ev(state=None, status=UP | IPS_ASSURED)) is None
    assert e.flow in s.installed and s.counters["deletes"] == 0
    s2, _, ct2 = syncer()
    ct2.entries.add(e.flow)
    assert s2.event(ev(state=None)) is None and not s2.installed  # no state known: nothing installed


def test_a_leftover_entry_is_replaced_with_this_orientation():
    """A flow already in the table (a leftover stored from the other end) is deleted and inserted again: its stored
    orientation decides which direction is ORIGINAL (ct 1) and which REPLY (ct 2)."""
    s, table, ct = syncer()
    e = ev()
    ct.entries.add(e.flow)
    table.flow_insert(e.flow.reply())
    table.ops.clear()
    assert s.event(e) == "install"
    assert table.ops == [("insert", e.flow), ("delete", e.flow), ("insert", e.flow)]
    assert [r.flow for r in table.flow_entries()] == [e.flow] and s.counters["inserts"] == 1


def test_status_line():
    from hypafilter.cli.deploy import _fmt_flowsync

    assert _fmt_flowsync({"wanted": False, "reason": "the NIC has no flow cache"}) == (
        "flowsync not running: the NIC has no flow cache"
    )
    assert _fmt_flowsync({"wanted": True, "running": False}).startswith("flowsync DOWN")
    line = _fmt_flowsync(
        {
            "wanted": True,
            "running": True,
            "pid": 7,
            "offloaded": 3,
            "occupancy": 4,
            "waiting": 6,
            "inserts": 5,
            "deletes": 2,
            "evictions": 1,
            "insert_failures": 0,
            "refreshes": 9,
            "lag_p50_ms": 0.4,
            "lag_max_ms": 2.5,
        }
    )
    assert line.startswith(
        "flowsync pid 7: 3 flows offloaded, occupancy 4, 6 waiting for a way (set full); inserts 5, deletes 2, "
        "evictions 1"
    )
    assert line.endswith("sync lag p50 0.4 ms, max 2.5 ms")
    # [ctm] the membership structure's phase: ready while its clear sweeps, COMPLETE only after (issue #24)
    running = {"wanted": True, "running": True, "pid": 7}
    assert _fmt_flowsync({**running, "members": {"phase": "clearing", "pending": 4}}).endswith(
        "; new flows NOT decided yet: clearing the membership structure; misses go to conntrack"
    )
    assert "loading the membership structure (4 entries pending)" in _fmt_flowsync(
        {**running, "members": {"phase": "loading", "pending": 4}}
    )
    assert _fmt_flowsync({**running, "members": {"phase": "complete", "entries": 9}}).endswith(
        "; new flows decided: membership COMPLETE (9 entries)"
    )
    six = {"phase": "complete", "entries": 9, "families": ["ipv4", "ipv6"]}
    assert _fmt_flowsync({**running, "members": six}).endswith(
        "; new flows decided: membership COMPLETE (9 entries, IPv4 and IPv6)"
    )
    liberal = {"wanted": True, "mode": "liberal", "pid": 8, "offloaded": 2, "liberal": 3, "lag_p50_ms": 0.3}
    assert _fmt_flowsync({**liberal, "running": True}).startswith(
        "flowsync pid 8 (liberal marks): 2 TCP flows held, 3 entries marked liberal; sync lag p50 0.3 ms"
    )
    restarting = "is restarting its worker (the last one exited -9)"
    assert _fmt_flowsync({**liberal, "running": False, "down": restarting}) == (
        f"flowsync DOWN: new TCP entries are not marked liberal; the service {restarting}"
    )
    assert _fmt_flowsync({**liberal, "running": False}) == (
        "flowsync DOWN: new TCP entries are not marked liberal (deploy again, or undeploy)"
    )


def test_flows_established_together_are_installed_in_one_batch_after_their_liberal_flags():
    """Events read together: every TCP flow's liberal flag in one conntrack batch, then the flows whose flag was
    set in one flow-cache batch (none inserted before its flag is confirmed; one conntrack no longer has is
    left out); a flow that a later event of the same read removes is not inserted; UDP needs no flag."""
    s, table, ct = syncer()
    table.log2_sets = 6  # room for every flow here (a full set: test_a_flow_whose_set_is_full_waits_unmarked)
    tcp = [ev(sport=41000 + i) for i in range(20)]
    gone = ev(sport=42000)  # destroyed before its flag could be set: conntrack answers ENOENT
    short = ev(sport=43000)  # established and reset in the same read
    udp = ev(proto=UDP, sport=5000, dport=53)
    ct.entries |= {e.flow for e in (*tcp, short)}
    got = s.events([*tcp, gone, short, ev(sport=43000, state=None, kind="destroy", status=0), udp])
    assert got == ["install"] * 22 + ["remove", "install"]
    assert ct.liberal_batches == [[e.flow for e in (*tcp, gone)]]
    assert table.batches == [[(fc.OP_INSERT, e.flow) for e in (*tcp, udp)]]
    assert set(s.installed) == {e.flow for e in (*tcp, udp)} and s.counters["inserts"] == 21
    assert s.counters["liberal"] == 20 and s.stats()["lag_samples"] == 21
    # a flow removed and set up again (same tuple) within one read: the delete first, then the insert, together
    table.batches.clear()
    again = tcp[0]
    assert s.events([ev(sport=again.sport, kind="destroy", status=0, state=None), again]) == ["remove", "install"]
    assert table.batches == [[(fc.OP_DELETE, again.flow), (fc.OP_INSERT, again.flow)]]  # one batch, in order
    assert again.flow in s.installed and s.counters["deletes"] == 1


def test_poll_reads_the_installed_slots_and_the_table_in_turn(monkeypatch):
    """A poll reads the slots of the flows the service installed (refreshed or evicted every poll, while they are
    at most POLL_CHUNK) and the next POLL_CHUNK slots of the table, so a flow it did not install is evicted within
    entries / POLL_CHUNK polls."""
    monkeypatch.setattr(sync, "POLL_CHUNK", 8)
    s, table, ct = syncer()  # 16 sets x 2 ways: 32 slots, 4 parts
    flows = [ev(sport=44000 + i) for i in range(8)]  # at most POLL_CHUNK: all of them every poll
    ct.entries |= {e.flow for e in flows}
    s.events(flows)
    mine = {table._find(e.flow) for e in flows}
    assert {i.slot for i in s.installed.values()} == mine
    assert len({sl // 8 for sl in mine}) > 1  # spread over several parts
    stranger = fc.Flow(9, 9, 17, 9, 9)
    table.flow_insert(stranger)
    where = table._find(stranger)
    for e in flows:
        table.hit(e.flow)
    polls = 0
    while stranger in {f for f, _ in table.slots.values()}:
        s.poll()
        polls += 1
        assert set(table.reads[-1]) == mine | set(range(8 * ((polls - 1) % 4), 8 * ((polls - 1) % 4) + 8))
        assert s.counters["refreshes"] == 8  # all of them at the first poll, whatever part it read
        assert polls <= 4
    assert polls == where // 8 + 1 and s.counters["evictions"] == 1
    # a flow of ours whose conntrack entry is gone is evicted at the next poll, wherever it is
    gone = flows[5]
    ct.entries.discard(gone.flow)
    table.hit(gone.flow)
    s.poll()
    assert gone.flow not in s.installed and s.counters["evictions"] == 2


def test_the_lag_of_an_install_is_split_into_its_parts():
    """stats() says where the lag of an event batch with inserts went: reading the events (event time until the
    batch is applied), the liberal-flag batch, the flow-cache batch; a batch without inserts adds no sample."""
    s, table, ct = syncer()
    times = iter([0.003, 0.004, 0.009])  # apply starts, liberal acked, NIC done (seconds)
    s.clock = lambda: next(times)
    flows = [ev(sport=45000 + i) for i in range(3)]
    ct.entries |= {e.flow for e in flows}
    assert s.events(flows, t_event=0.001) == ["install"] * 3
    st = s.stats()
    assert (st["lag_read_p50_ms"], st["lag_liberal_p50_ms"], st["lag_nic_p50_ms"]) == (2.0, 1.0, 5.0)
    assert st["lag_p50_ms"] == 8.0 and st["lag_nic_max_ms"] == 5.0
    times = iter([0.02, 0.02, 0.03])
    s.events([ev(sport=45000, kind="destroy", status=0, state=None)], t_event=0.01)
    assert len(s.phases["nic"]) == 1 and s.stats()["lag_samples"] == 4


def test_events_that_come_during_a_poll_are_applied_between_its_pieces(monkeypatch):
    """A poll reads the table POLL_PIECE slots at a time and lets the events that came meanwhile through between
    the pieces and refreshes; its evictions skip a flow such an event installed anew (here: a stranger in the table
    that became an established flow of conntrack's, installed over it) and a flow it already removed."""
    monkeypatch.setattr(sync, "POLL_CHUNK", 32)
    monkeypatch.setattr(sync, "POLL_PIECE", 4)
    s, table, ct = syncer()
    flows = [ev(sport=46000 + i) for i in range(6)]
    ct.entries |= {e.flow for e in flows}
    s.events(flows)
    stranger, gone = ev(sport=47000), flows[0]
    table.flow_insert(stranger.flow)
    for e in flows:
        table.hit(e.flow)
    ct.entries.discard(gone.flow)  # its refresh fails: evicted, unless an event removed it first
    calls = []

    def between():  # the events come once every piece was read, after the stranger's eviction was decided
        calls.append(len(table.reads))
        if calls.count(8) == 1 and calls[-1] == 8:
            ct.entries.add(stranger.flow)
            s.events([stranger, ev(sport=gone.sport, kind="destroy", status=0, state=None)])

    s.poll(between)
    assert len(table.reads) == 8 and all(len(r) <= 4 for r in table.reads)  # 32 slots in pieces of 4
    assert sorted(set(calls)) == list(range(1, 9)) and len(calls) == 8 + 6  # after every piece and refresh
    assert stranger.flow in s.installed and table._find(stranger.flow) is not None
    assert gone.flow not in s.installed and table._find(gone.flow) is None
    assert s.counters["evictions"] == 0 and s.counters["deletes"] == 1 and s.counters["refreshes"] == 5
    assert s.stats()["poll_block_max_ms"] is not None


def test_a_poll_on_a_slow_nic_reads_pieces_it_can_read_in_poll_piece_s():
    """On a NIC whose slot reads are slow (an 11,100-entry emulated core under load: ~180 ms a slot) a poll's pieces
    shrink to what the last piece's pace reads in POLL_PIECE_S, at least one slot, so `between` (COMPLETE's renewal
    among its work, a 500 ms lease) comes at least that often; on a fast NIC they are POLL_PIECE again."""
    table, ct = MemTable(log2_sets=8), MemCt()  # 512 slots: a poll reads POLL_CHUNK of them
    s = Syncer(table, ct, dict(TIMEOUTS))
    now = [0.0]
    s.clock = lambda: now[0]
    pace = [0.0125]  # seconds per slot read
    read = table.flow_entries

    def slow(slots):
        now[0] += pace[0] * len(slots)
        return read(slots)

    table.flow_entries = slow
    gaps = []
    last = [0.0]

    def between():
        gaps.append(now[0] - last[0])
        last[0] = now[0]

    s.poll(between)  # 512 slots of the table in turn
    sizes = [len(r) for r in table.reads]
    assert sum(sizes) == 512 and sizes[0] == sync.POLL_PIECE, sizes
    assert {round(n * pace[0] / sync.POLL_PIECE_S) for n in sizes[1:-1]} == {1}, sizes  # 4 slots, 50 ms a piece
    assert max(gaps[1:]) <= sync.POLL_PIECE_S + 1e-6, gaps
    pace[0] = 1.0  # slower than POLL_PIECE_S a slot: one slot at a time
    table.reads.clear()
    s.poll(between)
    assert {len(r) for r in table.reads[1:]} == {1}
    pace[0] = 0.0  # fast again
    table.reads.clear()
    s.poll(between)
    assert {len(r) for r in table.reads[1:-1]} == {sync.POLL_PIECE}


def test_time_wait_comes_back_and_leaves_when_idle():
    """A client that sends its FIN twice before the server acknowledged it takes conntrack to LAST_ACK while the
    server still sends its reply: the flow leaves at LAST_ACK (conntrack must see the next ACK), comes back at
    TIME_WAIT (the server's next segment), is refreshed with TIME_WAIT's timeout while hit, and leaves after
    TIME_WAIT_IDLE_POLLS polls without a hit; conntrack keeps its entry."""
    s, table, ct = syncer()
    e = ev()
    ct.entries.add(e.flow)
    assert s.event(e) == "install"
    assert s.event(ev(state=FIN_WAIT)) is None
    assert s.events([ev(state=LAST_ACK), ev(state=TIME_WAIT)]) == ["remove", "install"]
    assert table.ops[-2:] == [("delete", e.flow), ("insert", e.flow)]
    assert ct.calls[-1] == ("liberal", e.flow)
    table.hit(e.flow, 3)
    s.poll()
    assert ct.calls[-1] == ("timeout", e.flow, TIMEOUTS["tcp_time_wait"])
    for _ in range(TIME_WAIT_IDLE_POLLS - 1):
        s.poll()
        assert e.flow in s.installed
    s.poll()
    assert e.flow not in s.installed and table.slots == {}
    assert s.counters["evictions"] == 1


def test_an_idle_established_flow_stays():
    s, table, ct = syncer()
    e = ev()
    ct.entries.add(e.flow)
    s.event(e)
    for _ in range(TIME_WAIT_IDLE_POLLS + 2):
        s.poll()
    assert e.flow in s.installed


def test_liberal_marks_hold_tcp_only_and_are_never_polled():
    """The xdp target's table (LiberalMarks): the TCP flows Syncer would offload are marked liberal before they
    count as held, UDP flows are not held (they need no mark), and the poll neither refreshes timeouts nor evicts
    (the XDP program refreshes the timeouts itself): a TIME_WAIT flow without hits stays until its event."""
    table, ct = LiberalMarks(), MemCt()
    s = Syncer(table, ct, dict(TIMEOUTS))
    t, u = ev(), ev(proto=UDP, sport=5000, dport=53)
    ct.entries |= {t.flow, u.flow}
    assert s.events([t, u]) == ["install", None]
    assert ct.liberal_batches == [[t.flow]] and set(table.flows) == {t.flow}
    for _ in range(TIME_WAIT_IDLE_POLLS + 2):
        s.poll()
    assert s.event(ev(state=TIME_WAIT)) is None
    for _ in range(TIME_WAIT_IDLE_POLLS + 2):
        s.poll()
    assert set(table.flows) == {t.flow} and [c for c in ct.calls if c[0] == "timeout"] == []
    assert s.event(ev(state=LAST_ACK)) == "remove" and table.flows == {}
    assert ct.calls == [("liberal", t.flow)]  # a mark is never taken back
    assert s.event(t) == "install" and s.event(ev(kind="destroy", status=0, state=None)) == "remove"
    st = s.stats()
    assert (st["inserts"], st["deletes"], st["refreshes"], st["evictions"], st["offloaded"]) == (2, 2, 0, 0, 0)
    assert table.flow_counters()["occupancy"] == 0


def test_liberal_marks_resync_and_capacity():
    """A resync marks every TCP flow the dump says is offloadable; beyond the capacity an insert is refused as by a
    full set (the entry is marked all the same); a stop's clear forgets the set only."""
    table, ct = LiberalMarks(capacity=2), MemCt()
    s = Syncer(table, ct, dict(TIMEOUTS))
    flows = [ev(sport=40000 + k) for k in range(3)]
    ct.entries |= {e.flow for e in flows}
    s.resync([*flows[:2], ev(proto=UDP), ev(sport=41000, state=SYN_SENT, status=IPS_CONFIRMED)])
    assert set(table.flows) == {flows[0].flow, flows[1].flow} and s.counters["liberal"] == 2
    assert s.event(flows[2]) == "install"
    assert s.counters["insert_failures"] == 1 and ("liberal", flows[2].flow) in ct.calls
    assert flows[2].flow not in table.flows and table.flow_counters()["full"] == 1
    s.resync([flows[0]])  # flows[1] is no longer in conntrack's dump
    assert set(table.flows) == {flows[0].flow} and s.counters["evictions"] == 1
    table.flow_clear()
    assert table.flows == {} and table.flow_entries() == []


def test_a_conntrack_message_built_and_framed_reads_back():
    """A conntrack entry message built with the codec's request helpers (ct_request on the generic nfnetlink
    header, ct_tuple_attr, nla) is framed by nl_messages and read back whole by parse_event."""
    flow = fc.Flow(0x0A000001, 0x0A000002, 6, 40000, 80)
    back = fc.Flow(flow.dst, flow.src, 6, flow.dport, flow.sport)
    reply = ct_tuple_attr(back)
    reply = struct.pack("=HH", len(reply), CTA_TUPLE_REPLY | 0x8000) + reply[4:]  # the same tuple, as the reply
    tcp = nla(CTA_PROTOINFO_TCP, nla(CTA_PROTOINFO_TCP_STATE, bytes([3])), True)
    attrs = ct_tuple_attr(flow) + reply + nla(CTA_STATUS, struct.pack(">I", IPS_CONFIRMED | IPS_SEEN_REPLY))
    msg = ct_request(IPCTNL_MSG_CT_NEW, NLM_F_CREATE, 7, attrs + nla(CTA_PROTOINFO, tcp, True))
    assert [(off, seq) for off, _, _, _, seq, _ in nl_messages(msg + msg)] == [(0, 7), (len(msg), 7)]
    ev = parse_event(msg)
    assert (ev.kind, ev.family, ev.flow, ev.tcp_state) == ("new", socket.AF_INET, flow, 3)
    assert ev.reply == ("10.0.0.2", "10.0.0.1", 80, 40000) and offload_reason(ev) is None
    assert parse_event(msg[:-4]) is None  # a truncated message is none


def test_a_full_cache_is_polled_in_turn_each_flow_every_poll_cycle(monkeypatch):
    """More installed flows than POLL_CHUNK: a poll reads max(POLL_CHUNK, flows / POLL_CYCLE) of their slots in turn
    (plus its part of the table), not all of them, and every installed flow is read within POLL_CYCLE polls; a hit
    flow is refreshed at the poll that reads it."""
    monkeypatch.setattr(sync, "POLL_CHUNK", 4)
    monkeypatch.setattr(sync, "POLL_CYCLE", 3)
    s, table, ct = syncer()
    table.log2_sets = 6  # 128 slots
    flows = [ev(sport=45000 + i) for i in range(30)]
    ct.entries |= {e.flow for e in flows}
    s.events(flows)
    held = {i.slot for i in s.installed.values()}
    assert len(held) == 30
    seen: set[int] = set()
    for _ in range(3):
        table.reads.clear()
        s.poll()
        read = {sl for r in table.reads for sl in r}
        assert 10 <= len(read & held) <= 10 + 4  # max(4, 30 / 3), and those the table's part (4 slots) holds
        seen |= read & held
    assert seen == held
    table.hit(flows[0].flow)
    ct.calls.clear()
    for _ in range(3):
        s.poll()
    assert [c[1] for c in ct.calls] == [flows[0].flow]


def test_a_resync_calls_between_in_pieces(monkeypatch):
    """A resync runs `between` every RESYNC_PIECE entries and before its writes (the service takes the events that
    come meanwhile off their socket there), and once more per RESYNC_PIECE ops it fits into the sets."""
    monkeypatch.setattr(sync, "RESYNC_PIECE", 10)
    s, table, ct = syncer()
    dump = [ev("dump", sport=2000 + i) for i in range(45)]
    ct.entries |= {e.flow for e in dump}
    calls = []
    s.resync(dump, lambda: calls.append(len(s.installed)))
    assert len(calls) == 4 + 1 + 4  # 45 entries, before the writes, 45 inserts fitted
    assert calls == [0] * len(calls)  # all before any write
