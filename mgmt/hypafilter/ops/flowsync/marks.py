"""The table of the flow sync service's liberal mode (the xdp target): `LiberalMarks`, the TCP flows whose
conntrack entries the service has set liberal, behind NicClient's flow API."""

from __future__ import annotations

import socket
from collections.abc import Iterable, Sequence

from hypafilter.errors import HypafilterError
from hypafilter.hw.flowcache import OP_DELETE, OP_INSERT, PROTO_TCP, ST_EXISTS, ST_FULL, ST_NOT_FOUND, ST_OK, Flow
from hypafilter.ops.flowsync.events import Flow6

MARKS_CAPACITY = 1 << 22  # LiberalMarks: flows held at most (nf_conntrack_max is 262,144 here)


class LiberalMarks:
    """The table of the service's liberal mode (the xdp target; docs/flowsync.md, "The xdp target: liberal marks"):
    the TCP flows whose conntrack entries the service has set liberal, in memory, behind NicClient's flow API.

    The XDP program has no flow cache: it looks every frame up in conntrack's own table and decides an established
    TCP frame only when the entry is liberal in both directions (docs/xdp.md). What it needs from the service is
    the Syncer's install path without a hardware write: IP_CT_TCP_FLAG_BE_LIBERAL set on an entry once it is
    offloadable and before it counts as installed (`Syncer._apply`), the flow forgotten on its destroy or when it
    stops being offloadable, a reconciliation from a dump at start. So the Syncer runs unchanged against this
    table, and what differs is what the table is, said by its properties (a table, not a Syncer option, because
    these are facts about what holds the flows, and every place that asks reads them from it):

    - `protocols` TCP only: a UDP entry needs no mark (the program reads conntrack's UDP state as it is);
    - `families` IPv4 and IPv6: the program looks IPv6 TCP up in conntrack as IPv4's (`bpf_sock_tuple.ipv6`, the
      same liberal condition, docs/ipv6.md "## xdp"), so an IPv6 entry is marked as an IPv4 one (a `Flow6`, its
      ctnetlink update in family AF_INET6);
    - `hit_counters` False: no hits to read, so the Syncer does not poll it. The program refreshes the timeout of
      every entry whose frame it decides (`bpf_ct_change_timeout`, to what conntrack would set): the service must
      neither refresh timeouts from hits nor evict idle flows for it;
    - an ample capacity (`MARKS_CAPACITY`, above any nf_conntrack_max here): beyond it an insert answers ST_FULL
      like a full flow-cache set (counted as an insert failure; the entry's flag is already set, so the program
      decides its frames all the same).

    A mark is never taken back, not when a flow leaves the set nor when the service stops (`flow_clear` empties
    only the set): once the program forwarded a flow's segments conntrack's windows for it are stale, and the next
    segment that reaches conntrack would be INVALID on an entry that is not liberal."""

    mode = "liberal"
    protocols = (PROTO_TCP,)
    families = (socket.AF_INET, socket.AF_INET6)
    hit_counters = False
    set_limited = False  # no sets: an insert fails only beyond `capacity`

    def __init__(self, capacity: int = MARKS_CAPACITY):
        self.capacity = capacity
        self.flows: dict[Flow | Flow6, int] = {}  # flow (original direction) -> its slot number, an insert count
        self.inserts = self.deletes = self.full = 0

    def flow_config(self):
        from hypafilter.targets.nic import FlowCacheConfig

        return FlowCacheConfig(self.capacity.bit_length() - 1, 1, 0)

    def flow_set(self, flow: Flow) -> None:
        return None

    def flow_commands(self, cmds: Sequence[tuple]) -> list[tuple[int, int]]:
        out = []
        for op, flow, *_ in cmds:
            if op == OP_INSERT:
                if flow in self.flows:
                    out.append((ST_EXISTS, self.flows[flow]))
                elif len(self.flows) >= self.capacity:
                    self.full += 1
                    out.append((ST_FULL, 0))
                else:
                    self.flows[flow] = self.inserts
                    self.inserts += 1
                    out.append((ST_OK, self.flows[flow]))
            elif op == OP_DELETE:
                slot = self.flows.pop(flow, None)
                self.deletes += int(slot is not None)
                out.append((ST_NOT_FOUND, 0) if slot is None else (ST_OK, slot))
            else:
                raise HypafilterError(f"liberal marks: flow command {op} is not insert or delete")
        return out

    def flow_entries(self, slots: Iterable[int] | None = None) -> list:
        from hypafilter.targets.nic import FlowRecord

        want = None if slots is None else set(slots)
        return [FlowRecord(s, f, False, 0, 0) for f, s in self.flows.items() if want is None or s in want]

    def flow_counters(self) -> dict:
        return {"occupancy": len(self.flows), "inserts": self.inserts, "deletes": self.deletes, "full": self.full}

    def flow_clear(self) -> None:
        self.flows.clear()

    def close(self) -> None:
        pass
