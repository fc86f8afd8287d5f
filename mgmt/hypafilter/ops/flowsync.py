"""The flow sync service: the NIC's flow cache follows the firewall's conntrack (docs/flowsync.md).

A flow goes into the hardware flow cache when conntrack confirms it established (TCP: protoinfo state ESTABLISHED,
confirmed, seen a reply; UDP: confirmed and seen a reply; IPv4 without NAT, helper or zone only), and leaves it
when conntrack destroys it or it stops being established. Before an insert the conntrack entry is put in TCP
window liberal mode, since conntrack stops seeing the flow's established frames. Every `interval` seconds the
hardware's per-flow hit counters are read: a flow that was hit since the last poll gets its conntrack timeout set
back to the protocol's established timeout (conntrack did not see those frames, so it would let the flow expire),
and a hardware flow conntrack no longer has is evicted. At start the table is reconciled with a full conntrack
dump. Conntrack is read through ctnetlink sockets of the service's own inside the firewall's namespace (events, dump,
get, entry updates); every conntrack message, event or reply, is decoded by `parse_event`.

The pure part (`CtEvent`, `offload_reason`, `Syncer`) takes the table and conntrack as parameters; `serve` runs it
against the deployed NIC (NicClient's flow API) and the firewall namespace; `start`, `stop` and `status` are what
`deploy`, `undeploy` and `status` call. On the xdp target, which has no flow cache but looks frames up in
conntrack's own table, the table is `LiberalMarks` (mode "liberal"): the service only sets the TCP entries it would
offload liberal, and polls nothing.
"""

from __future__ import annotations

import contextlib
import errno
import gc
import ipaddress
import json
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from hypafilter import netns
from hypafilter.errors import HypafilterError
from hypafilter.hw.flowcache import (
    OP_DELETE,
    OP_INSERT,
    PROTO_TCP,
    PROTO_UDP,
    ST_EXISTS,
    ST_FULL,
    ST_NOT_FOUND,
    ST_OK,
    Flow,
)

# ctnetlink (include/uapi/linux/netfilter/nfnetlink_conntrack.h, nf_conntrack_common.h, nf_conntrack_tcp.h)
NFNLGRP_CONNTRACK_NEW, NFNLGRP_CONNTRACK_UPDATE, NFNLGRP_CONNTRACK_DESTROY = 1, 2, 3
GROUPS = (1 << NFNLGRP_CONNTRACK_NEW - 1) | (1 << NFNLGRP_CONNTRACK_UPDATE - 1) | (1 << NFNLGRP_CONNTRACK_DESTROY - 1)
IPCTNL_MSG_CT_NEW, IPCTNL_MSG_CT_GET, IPCTNL_MSG_CT_DELETE = 0, 1, 2
NFNL_SUBSYS_CTNETLINK = 1
NETLINK_NETFILTER = 12
# netlink (include/uapi/linux/netlink.h)
NLMSG_ERROR, NLMSG_DONE, NLMSG_MIN_TYPE = 2, 3, 0x10
NLM_F_REQUEST, NLM_F_ACK, NLM_F_DUMP_INTR = 0x1, 0x4, 0x10
NLM_F_DUMP, NLM_F_CREATE, NLM_F_EXCL = 0x300, 0x400, 0x200
NLA_F_NESTED = 0x8000
IPS_EXPECTED, IPS_SEEN_REPLY, IPS_ASSURED, IPS_CONFIRMED = 1 << 0, 1 << 1, 1 << 2, 1 << 3
IPS_SRC_NAT, IPS_DST_NAT = 1 << 4, 1 << 5
IPS_NAT_MASK = IPS_SRC_NAT | IPS_DST_NAT
IPS_DYING, IPS_TEMPLATE, IPS_UNTRACKED, IPS_HELPER, IPS_OFFLOAD = 1 << 9, 1 << 11, 1 << 12, 1 << 13, 1 << 14
TCP_CONNTRACK_ESTABLISHED, TCP_CONNTRACK_FIN_WAIT, TCP_CONNTRACK_CLOSE_WAIT = 3, 4, 5
TCP_CONNTRACK_LAST_ACK, TCP_CONNTRACK_TIME_WAIT = 6, 7
# TCP states a flow is in the hardware in: established, half-closed (one FIN seen, its ACK maybe not: an ACK the
# hardware forwards leaves conntrack in FIN_WAIT instead of CLOSE_WAIT, which only changes that state's timeout),
# and TIME_WAIT, where every segment the flow cache looks up (no SYN, FIN or RST) leaves conntrack in TIME_WAIT with
# TIME_WAIT's timeout, which the refresh sets. LAST_ACK (and CLOSE) is not: its next ACK takes conntrack to
# TIME_WAIT, so the flow leaves the hardware at LAST_ACK and that ACK reaches conntrack. A flow comes back at
# TIME_WAIT because conntrack also reaches LAST_ACK when one end sends its FIN twice before the other acknowledged
# it, while the other end still sends its data (docs/flowsync.md); an idle TIME_WAIT flow leaves again
# (TIME_WAIT_IDLE_POLLS).
TCP_OFFLOAD_STATES = {
    TCP_CONNTRACK_ESTABLISHED: "established",
    TCP_CONNTRACK_FIN_WAIT: "fin_wait",
    TCP_CONNTRACK_CLOSE_WAIT: "close_wait",
    TCP_CONNTRACK_TIME_WAIT: "time_wait",
}
# Polls without a hit after which a TIME_WAIT flow leaves the hardware (conntrack keeps its entry; its frames miss
# and go to software, which is always right): a closed connection's TIME_WAIT entry does not hold a flow-cache way
# for the state's two minutes.
TIME_WAIT_IDLE_POLLS = 2
IP_CT_TCP_FLAG_BE_LIBERAL = 0x08

# The conntrack timeouts a refresh sets, read from these sysctls of the firewall namespace (seconds).
TIMEOUT_SYSCTLS = {
    "tcp": "net.netfilter.nf_conntrack_tcp_timeout_established",
    "tcp_fin_wait": "net.netfilter.nf_conntrack_tcp_timeout_fin_wait",
    "tcp_close_wait": "net.netfilter.nf_conntrack_tcp_timeout_close_wait",
    "tcp_time_wait": "net.netfilter.nf_conntrack_tcp_timeout_time_wait",
    "udp": "net.netfilter.nf_conntrack_udp_timeout",
    "udp_stream": "net.netfilter.nf_conntrack_udp_timeout_stream",
}
SERVICE_NICE = -10  # the worker's scheduling priority (serve): the sync lag is time a new flow spends in software
INTERVAL = 1.0  # seconds between two polls of the hardware table (timeout refresh, eviction, counters)
POLL_CHUNK = 512  # flow-cache slots a poll reads besides those of the flows it installed (the table in turn)
POLL_PIECE = 32  # slots a poll reads before it looks at the conntrack events again (Syncer.poll's `between`)
LAG_SAMPLES = 4096  # sync lag: the last this many event -> hardware-write times
LAG_PHASES = ("read", "liberal", "nic")  # the parts of the lag (Syncer.phases)
READY_TIMEOUT = 20.0  # seconds `start` waits for the service's first state file


# ---- conntrack entries and the install rule (pure) ---------------------------------------------------------------


@dataclass(frozen=True)
class CtEvent:
    """One conntrack entry as an event (new, update, destroy) or a dump line (dump) carries it."""

    kind: str  # "new" | "update" | "destroy" | "dump"
    family: int
    proto: int
    src: str
    dst: str
    sport: int = 0
    dport: int = 0
    reply: tuple[str, str, int, int] | None = None  # reply tuple (src, dst, sport, dport), None when absent
    status: int = 0
    tcp_state: int | None = None
    timeout: int | None = None
    zone: int | None = None
    helper: bool = False

    @classmethod
    def from_tuples(cls, kind: str, family: int, orig: tuple, rep: tuple | None, **rest) -> CtEvent:
        """The entry of the original and reply tuples (src, dst, proto, sport, dport) as `_raw_tuple` reads them
        (reply None: absent); `rest`: the other fields (status, tcp_state, timeout, zone, helper)."""
        return cls(
            kind=kind,
            family=family,
            proto=orig[2],
            src=orig[0],
            dst=orig[1],
            sport=orig[3],
            dport=orig[4],
            reply=(rep[0], rep[1], rep[3], rep[4]) if rep else None,
            **rest,
        )

    @property
    def flow(self) -> Flow | None:
        """The hardware flow (original direction), None for what the flow cache cannot hold (not IPv4 TCP/UDP)."""
        if self.family != socket.AF_INET or self.proto not in (PROTO_TCP, PROTO_UDP):
            return None
        return Flow(
            int(ipaddress.IPv4Address(self.src)),
            int(ipaddress.IPv4Address(self.dst)),
            self.proto,
            self.sport,
            self.dport,
        )


def offload_reason(ev: CtEvent) -> str | None:
    """None when the entry's established frames may be decided by the hardware; else why not.

    TCP: ESTABLISHED (protoinfo state), confirmed and seen a reply. UDP: confirmed and seen a reply. Never: not IPv4
    TCP/UDP, NAT (the reply is not the original reversed: the one hardware key covers both directions only
    without it), a helper (it must see every packet to create its expectations), a zone other than 0 (the key has
    no zone), an entry dying, a template, untracked, or offloaded to a kernel flowtable."""
    if ev.kind == "destroy":
        return "destroyed"
    if ev.flow is None:
        return "not IPv4 TCP/UDP"
    if ev.status & (IPS_DYING | IPS_TEMPLATE | IPS_UNTRACKED | IPS_OFFLOAD):
        return "dying, template, untracked or in a kernel flowtable"
    if not ev.status & IPS_CONFIRMED:
        return "not confirmed"
    if not ev.status & IPS_SEEN_REPLY:
        return "no reply seen"
    if ev.proto == PROTO_TCP and ev.tcp_state not in TCP_OFFLOAD_STATES:
        return f"TCP state {ev.tcp_state}, not ESTABLISHED, FIN_WAIT, CLOSE_WAIT or TIME_WAIT"
    if ev.status & IPS_NAT_MASK or ev.reply != (ev.dst, ev.src, ev.dport, ev.sport):
        return "NAT"
    if ev.helper or ev.status & IPS_HELPER:
        return "has a helper"
    if ev.zone:
        return f"zone {ev.zone}"
    return None


# ctnetlink attribute types (include/uapi/linux/netfilter/nfnetlink_conntrack.h) that parse_event reads and the
# requests carry
CTA_TUPLE_ORIG, CTA_TUPLE_REPLY, CTA_STATUS, CTA_PROTOINFO, CTA_HELP, CTA_TIMEOUT, CTA_ZONE = 1, 2, 3, 4, 5, 7, 18
CTA_TUPLE_IP, CTA_TUPLE_PROTO = 1, 2
CTA_IP_V4_SRC, CTA_IP_V4_DST, CTA_IP_V6_SRC, CTA_IP_V6_DST = 1, 2, 3, 4
CTA_PROTO_NUM, CTA_PROTO_SRC_PORT, CTA_PROTO_DST_PORT = 1, 2, 3
CTA_PROTOINFO_TCP, CTA_PROTOINFO_TCP_STATE = 1, 1
CTA_PROTOINFO_TCP_FLAGS_ORIGINAL, CTA_PROTOINFO_TCP_FLAGS_REPLY = 4, 5
NLA_TYPE_MASK = 0x3FFF  # without NLA_F_NESTED and NLA_F_NET_BYTEORDER


def _attrs(data: bytes, off: int, end: int) -> dict[int, tuple[int, int]]:
    """The netlink attributes in data[off:end]: type -> (payload start, payload end); the first of a type counts."""
    out: dict[int, tuple[int, int]] = {}
    while off + 4 <= end:
        length, kind = struct.unpack_from("=HH", data, off)
        if length < 4 or off + length > end:
            break
        out.setdefault(kind & NLA_TYPE_MASK, (off + 4, off + length))
        off += (length + 3) & ~3
    return out


def _raw_tuple(data: bytes, where: tuple[int, int] | None) -> tuple[str, str, int, int, int] | None:
    if where is None:
        return None
    t = _attrs(data, *where)
    if CTA_TUPLE_IP not in t or CTA_TUPLE_PROTO not in t:
        return None
    ip, proto = _attrs(data, *t[CTA_TUPLE_IP]), _attrs(data, *t[CTA_TUPLE_PROTO])
    if CTA_IP_V4_SRC in ip and CTA_IP_V4_DST in ip:
        fam, (a, _), (b, _) = socket.AF_INET, ip[CTA_IP_V4_SRC], ip[CTA_IP_V4_DST]
        n = 4
    elif CTA_IP_V6_SRC in ip and CTA_IP_V6_DST in ip:
        fam, (a, _), (b, _) = socket.AF_INET6, ip[CTA_IP_V6_SRC], ip[CTA_IP_V6_DST]
        n = 16
    else:
        return None
    if CTA_PROTO_NUM not in proto:
        return None
    port = {
        k: struct.unpack_from(">H", data, proto[k][0])[0]
        for k in (CTA_PROTO_SRC_PORT, CTA_PROTO_DST_PORT)
        if k in proto
    }
    return (
        socket.inet_ntop(fam, data[a : a + n]),
        socket.inet_ntop(fam, data[b : b + n]),
        data[proto[CTA_PROTO_NUM][0]],
        port.get(CTA_PROTO_SRC_PORT, 0),
        port.get(CTA_PROTO_DST_PORT, 0),
    )


def parse_event(data: bytes, off: int = 0, kind: str | None = None) -> CtEvent | None:
    """The ctnetlink conntrack message at data[off:] (its netlink header first) as a CtEvent, read with struct (in
    about 1/20 of the time pyroute2's nfct_msg takes; the system tests compare it with pyroute2 on real events and
    with `conntrack -L` on real dumps). The one decoder of conntrack messages: events, and with kind="dump" the
    entries a dump or a get replies with (the same IPCTNL_MSG_CT_NEW messages). None for a message that is no
    conntrack entry or has no original tuple."""
    if off + 20 > len(data):
        return None
    length, mtype, flags = struct.unpack_from("=IHH", data, off)
    end = off + length
    if length < 20 or end > len(data) or mtype >> 8 != NFNL_SUBSYS_CTNETLINK:
        return None
    if mtype & 0xFF == IPCTNL_MSG_CT_DELETE:
        kind = kind or "destroy"
    elif mtype & 0xFF == IPCTNL_MSG_CT_NEW:
        kind = kind or ("new" if flags & (NLM_F_CREATE | NLM_F_EXCL) else "update")
    else:
        return None
    a = _attrs(data, off + 20, end)  # after the netlink header (16 bytes) and nfgenmsg (4)
    orig = _raw_tuple(data, a.get(CTA_TUPLE_ORIG))
    if orig is None:
        return None
    rep = _raw_tuple(data, a.get(CTA_TUPLE_REPLY))
    tcp_state = None
    if CTA_PROTOINFO in a:
        pi = _attrs(data, *a[CTA_PROTOINFO])
        if CTA_PROTOINFO_TCP in pi:
            tcp = _attrs(data, *pi[CTA_PROTOINFO_TCP])
            if CTA_PROTOINFO_TCP_STATE in tcp:
                tcp_state = data[tcp[CTA_PROTOINFO_TCP_STATE][0]]

    def be(k: int, fmt: str) -> int | None:
        return struct.unpack_from(fmt, data, a[k][0])[0] if k in a else None

    return CtEvent.from_tuples(
        kind,
        data[off + 16],
        orig,
        rep,
        status=be(CTA_STATUS, ">I") or 0,
        tcp_state=tcp_state,
        timeout=be(CTA_TIMEOUT, ">I"),
        zone=be(CTA_ZONE, ">H"),
        helper=CTA_HELP in a,
    )


def nl_messages(data: bytes) -> Iterator[tuple[int, int, int, int, int, int]]:
    """(offset, length, type, flags, sequence number, port id) of each netlink message of a datagram, in order;
    a truncated message ends the walk."""
    off = 0
    while off + 16 <= len(data):
        length, mtype, flags, seq, pid = struct.unpack_from("=IHHII", data, off)
        if length < 16 or off + length > len(data):
            return
        yield off, length, mtype, flags, seq, pid
        off += (length + 3) & ~3


def nl_errno(data: bytes, off: int, length: int) -> int:
    """The error an NLMSG_ERROR (0: an ack) or NLMSG_DONE (0: the dump's end) message at data[off:] carries, as a
    positive errno."""
    return -struct.unpack_from("=i", data, off + 16)[0] if length >= 20 else 0


def _nla(kind: int, payload: bytes, nested: bool = False) -> bytes:
    """One netlink attribute, padded to 4 bytes."""
    head = struct.pack("=HH", 4 + len(payload), kind | (NLA_F_NESTED if nested else 0))
    return head + payload + bytes(-len(payload) % 4)


def ct_tuple_attr(flow: Flow) -> bytes:
    """CTA_TUPLE_ORIG of an IPv4 TCP/UDP flow: what names a conntrack entry in a get or an update."""
    ip = _nla(CTA_IP_V4_SRC, struct.pack(">I", flow.src)) + _nla(CTA_IP_V4_DST, struct.pack(">I", flow.dst))
    sport, dport = struct.pack(">H", flow.sport), struct.pack(">H", flow.dport)
    proto = _nla(CTA_PROTO_NUM, bytes([flow.proto]))
    proto += _nla(CTA_PROTO_SRC_PORT, sport) + _nla(CTA_PROTO_DST_PORT, dport)
    return _nla(CTA_TUPLE_ORIG, _nla(CTA_TUPLE_IP, ip, True) + _nla(CTA_TUPLE_PROTO, proto, True), True)


def ct_request(mtype: int, flags: int, seq: int, attrs: bytes = b"", family: int = socket.AF_INET) -> bytes:
    """One ctnetlink request message: netlink header (NLM_F_REQUEST | flags), nfgenmsg (family, version 0), attrs."""
    body = struct.pack("=BBH", family, 0, 0) + attrs
    head = struct.pack("=IHHII", 16 + len(body), NFNL_SUBSYS_CTNETLINK << 8 | mtype, NLM_F_REQUEST | flags, seq, 0)
    return head + body


class ConntrackError(HypafilterError):
    """Conntrack refused a ctnetlink request: `code` is its errno."""

    def __init__(self, what: str, code: int):
        self.code = code
        super().__init__(f"conntrack {what}: {os.strerror(code)} (errno {code})")


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


# ---- the synchroniser (pure: the table and conntrack are parameters) ---------------------------------------------


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


# ---- the xdp target's table: liberal marks --------------------------------------------------------------------

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
    hit_counters = False

    def __init__(self, capacity: int = MARKS_CAPACITY):
        self.capacity = capacity
        self.flows: dict[Flow, int] = {}  # flow (original direction) -> its slot number, an insert count
        self.inserts = self.deletes = self.full = 0

    def flow_config(self):
        from hypafilter.targets.nic import FlowCacheConfig

        return FlowCacheConfig(self.capacity.bit_length() - 1, 1, 0)

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


# ---- conntrack through ctnetlink ---------------------------------------------------------------------------------


class Conntrack:
    """Conntrack of namespace `ns` through ctnetlink: an event socket (NEW, UPDATE, DESTROY groups), a request
    socket (dump, get, entry updates) and a batch socket (liberal-flag updates of several entries). All three are
    opened inside `ns` and stay there. Requests are built and replies read here (`ct_request`, `nl_messages`); every
    conntrack entry, in an event or a reply, is read by `parse_event`."""

    DUMP_TRIES = 3  # dumps the kernel marked inconsistent (NLM_F_DUMP_INTR) before `dump` gives up

    def __init__(self, ns: str | None):
        with netns.inside(ns):
            # Subscribed before the dump, so that nothing that happens between the two is lost.
            self.events = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)
            self.req = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)
            # Batched entry updates (set_liberal_many): several requests in one datagram, acks matched by sequence.
            self.batch = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)
        for s in (self.req, self.batch):
            s.bind((0, 0))
            s.settimeout(10.0)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
        self._seq = 0
        self.echoes = 0  # events skipped as echoes of this service's own updates
        self.events.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
        self.events.bind((0, GROUPS))
        self.events.setblocking(False)

    def close(self) -> None:
        self.events.close()
        self.batch.close()
        self.req.close()

    def own_ports(self) -> set[int]:
        """The netlink port ids of this object's request sockets (0, the kernel's, never: a socket not bound yet
        has none)."""
        ports = {self.batch.getsockname()[0], self.req.getsockname()[0]}
        return {p for p in ports if p}

    def _next_seq(self) -> int:
        self._seq = (self._seq + 1) & 0x7FFFFFFF or 1
        return self._seq

    def _foreign(self, data: bytes) -> list[CtEvent]:
        """The events of a datagram (`parse_event`), except the echoes of this service's own entry updates.

        An event that an update through ctnetlink causes carries the requesting socket's port id in its header
        (nlmsg_pid; the kernel's own events carry 0), so the echoes of the liberal-flag and timeout updates are
        known from the header alone and skipped unparsed. They say nothing new: those updates change no state a
        decision reads (flags, timeout), and every change a packet makes comes as an event of its own with port
        id 0."""
        own = self.own_ports()
        out = []
        for off, _, _, _, _, pid in nl_messages(data):
            if pid in own:
                self.echoes += 1
            elif (ev := parse_event(data, off)) is not None:
                out.append(ev)
        return out

    def read_events(self) -> list[CtEvent]:
        """Every event queued now (non-blocking), without the echoes of this service's own updates (`_foreign`).
        OSError ENOBUFS: events were lost (the caller resyncs)."""
        out = []
        while True:
            try:
                data = self.events.recv(1 << 20)
            except BlockingIOError:
                return out
            out += self._foreign(data)

    @staticmethod
    def _replies(
        sock: socket.socket, size: int, what: Callable[[], str]
    ) -> Iterator[tuple[bytes, int, int, int, int, int]]:
        """(datagram, offset, length, type, flags, sequence number) of each netlink message `sock` receives
        (datagrams of at most `size` bytes), for as long as the caller takes them: the one receive loop of the
        request and batch sockets. HypafilterError "conntrack did not answer <what()>" when the socket's timeout
        passes first (`what` is called then, so it can say what was still missing)."""
        while True:
            try:
                data = sock.recv(size)
            except TimeoutError as e:
                raise HypafilterError(f"conntrack did not answer {what()}") from e
            for off, length, rtype, rflags, rseq, _ in nl_messages(data):
                yield data, off, length, rtype, rflags, rseq

    def _exchange(self, what: str, mtype: int, flags: int, attrs: bytes = b"") -> tuple[list[CtEvent], bool]:
        """One request on the request socket and its replies up to the last: NLMSG_DONE ending a dump (multipart
        replies), or NLMSG_ERROR (the ack of a request with NLM_F_ACK, or an error). The conntrack entries replied
        (`parse_event`, kind "dump") and whether the kernel marked the dump inconsistent (NLM_F_DUMP_INTR).
        ConntrackError: the kernel refused the request or the dump (its errno); HypafilterError: no answer.
        Replies of another sequence number (to an earlier request that raised) are skipped."""
        seq = self._next_seq()
        self.req.send(ct_request(mtype, flags, seq, attrs))
        entries: list[CtEvent] = []
        interrupted = False
        for data, off, length, rtype, rflags, rseq in self._replies(self.req, 1 << 20, lambda: f"the {what}"):
            if rseq != seq:
                continue
            interrupted |= bool(rflags & NLM_F_DUMP_INTR)
            if rtype in (NLMSG_ERROR, NLMSG_DONE):
                if code := nl_errno(data, off, length):
                    raise ConntrackError(what, code)
                return entries, interrupted
            if rtype >= NLMSG_MIN_TYPE and (ev := parse_event(data, off, "dump")) is not None:
                entries.append(ev)

    def dump(self) -> list[CtEvent]:
        """Every IPv4 conntrack entry (kind "dump"). A dump the kernel marked inconsistent (the table changed under
        it) is taken again, DUMP_TRIES times at most; then HypafilterError."""
        for _ in range(self.DUMP_TRIES):
            entries, interrupted = self._exchange("dump", IPCTNL_MSG_CT_GET, NLM_F_DUMP)
            if not interrupted:
                return entries
        raise HypafilterError(f"conntrack dump: inconsistent {self.DUMP_TRIES} times in a row (NLM_F_DUMP_INTR)")

    def get(self, flow: Flow) -> CtEvent | None:
        """The entry of `flow` (original direction; kind "dump"), None when conntrack has none."""
        try:
            entries, _ = self._exchange("get", IPCTNL_MSG_CT_GET, NLM_F_ACK, ct_tuple_attr(flow))
        except ConntrackError as e:
            if e.code == errno.ENOENT:
                return None
            raise
        return entries[0] if entries else None

    def _set(self, flow: Flow, what: str, attrs: bytes) -> bool:
        """An update of `flow`'s entry (IPCTNL_MSG_CT_NEW without NLM_F_CREATE); False when conntrack has none."""
        try:
            self._exchange(what, IPCTNL_MSG_CT_NEW, NLM_F_ACK, ct_tuple_attr(flow) + attrs)
        except ConntrackError as e:
            if e.code == errno.ENOENT:
                return False
            raise
        return True

    def set_liberal(self, ev: CtEvent) -> bool:
        """IP_CT_TCP_FLAG_BE_LIBERAL in both directions' TCP flags (flags, mask): conntrack's window checks off."""
        return self.set_liberal_many([ev])[0]

    def set_liberal_many(self, evs: Sequence[CtEvent]) -> list[bool]:
        """set_liberal for several entries in one sendmsg: one IPCTNL_MSG_CT_NEW update (no NLM_F_CREATE) per entry,
        each with NLM_F_ACK and its own sequence number; the kernel runs every message of the datagram and acks
        each. Per entry True once its ack says done, False when conntrack has no such entry (ENOENT); any other
        error raises ConntrackError (the worker ends and the supervisor starts another, which resyncs)."""
        if not evs:
            return []
        flags = struct.pack("=BB", IP_CT_TCP_FLAG_BE_LIBERAL, IP_CT_TCP_FLAG_BE_LIBERAL)  # nf_ct_tcp_flags
        tcp = _nla(CTA_PROTOINFO_TCP_FLAGS_ORIGINAL, flags) + _nla(CTA_PROTOINFO_TCP_FLAGS_REPLY, flags)
        protoinfo = _nla(CTA_PROTOINFO, _nla(CTA_PROTOINFO_TCP, tcp, True), True)
        data, seqs = b"", {}
        for k, ev in enumerate(evs):
            seq = self._next_seq()
            data += ct_request(IPCTNL_MSG_CT_NEW, NLM_F_ACK, seq, ct_tuple_attr(ev.flow) + protoinfo)
            seqs[seq] = k
        self.batch.send(data)
        out: list[bool | None] = [None] * len(evs)
        left = len(evs)

        def unanswered() -> str:  # called if the socket times out: the acks missing then
            return f"{left} of {len(evs)} updates"

        for chunk, off, length, rtype, _, rseq in self._replies(self.batch, 1 << 16, unanswered):
            k = seqs.get(rseq)
            if k is None or out[k] is not None or rtype != NLMSG_ERROR:
                continue  # not an ack of this batch (a late one of an earlier batch that raised)
            code = nl_errno(chunk, off, length)
            if code == 0:
                out[k] = True
            elif code == errno.ENOENT:
                out[k] = False
            else:
                raise ConntrackError("liberal-flag update", code)
            left -= 1
            if not left:
                break
        return [bool(x) for x in out]

    def set_timeout(self, flow: Flow, proto: int, seconds: int) -> bool:
        return self._set(flow, "timeout update", _nla(CTA_TIMEOUT, struct.pack(">I", int(seconds))))

    def refresh(self, flow: Flow, proto: int, seconds: int, tcp_state: int | None = None) -> bool:
        """The timeout of a flow the hardware saw, if conntrack still holds it as offloadable (an entry of the
        same tuple that is new again, after a destroy whose event came late, is not refreshed: False) and, for
        TCP with `tcp_state` given, in the state whose timeout `seconds` is (an entry whose state changed before
        its event was read is not refreshed with the old state's timeout: False, and the poll evicts it; the
        event then installs it again where the new state is one to offload)."""
        ev = self.get(flow)
        if ev is None or offload_reason(ev) is not None:
            return False
        if proto == PROTO_TCP and tcp_state is not None and ev.tcp_state != tcp_state:
            return False
        return self.set_timeout(flow, proto, seconds)


def read_timeouts(ns: str | None) -> dict[str, int]:
    return {k: int(netns.run(["sysctl", "-n", key], ns).strip()) for k, key in TIMEOUT_SYSCTLS.items()}


# ---- the service -------------------------------------------------------------------------------------------------


def state_path(state_dir: Path) -> Path:
    return Path(state_dir) / "flowsync.json"


def pid_path(state_dir: Path) -> Path:
    return Path(state_dir) / "flowsync.pid"


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    tmp.replace(path)


def serve(
    ns: str,
    table,
    state_dir: Path,
    interval: float = INTERVAL,
    stop: Callable[[], bool] = lambda: False,
    nic: str = "",
    service_pid: int | None = None,
    restarts: int = 0,
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
    try:
        syncer = Syncer(table, ct, read_timeouts(ns))
        syncer.resync(ct.dump())
        # Python's full (generation 2) collection walked every object of the worker (then pyroute2's modules too):
        # 70-110 ms under load, once in a run of the established measure, and no flow was installed meanwhile.
        # What is left after this collection (modules, sockets, the syncer) lives as long as the worker: frozen,
        # collections no longer walk it.
        gc.collect()
        gc.freeze()
        next_poll = time.monotonic()

        def drain() -> None:
            """Apply the conntrack events queued now, together."""
            t = time.monotonic()
            try:
                events = ct.read_events()
            except OSError as e:
                if e.errno != errno.ENOBUFS:
                    raise
                syncer.last_error = "conntrack events lost (ENOBUFS): resynchronised from a dump"
                syncer.resync(ct.dump())
                return
            syncer.events(events, t)

        def between() -> None:
            """Within a poll: the events queued now, if any."""
            if select.select([ct.events], [], [], 0)[0]:
                drain()

        while not stopping and not stop():
            now = time.monotonic()
            if now >= next_poll:
                syncer.poll(between)
                doc = _status_doc(syncer, table, ns, nic, started, interval)
                _write_json(
                    state_path(state_dir), {**doc, "pid": service_pid, "worker": os.getpid(), "restarts": restarts}
                )
                next_poll = now + interval
            r, _, _ = select.select([ct.events], [], [], max(0.0, min(next_poll - time.monotonic(), 0.2)))
            if r:
                drain()
    finally:
        gc.unfreeze()
        try:
            table.flow_clear()
        finally:
            ct.close()
            doc = {"running": False, "pid": service_pid, "stopped_at": time.time(), "ns": ns, "nic": nic}
            _write_json(state_path(state_dir), doc)


PR_SET_PDEATHSIG = 1
EXIT_NOT_READY = 3  # a worker that failed before its first state file (no flow cache, no conntrack access)


def supervise(
    ns: str, open_table: Callable[[], object], state_dir: Path, interval: float = INTERVAL, nic: str = ""
) -> int:
    """The service process: runs `serve` in a forked worker and, when the worker ends other than by a stop (an
    exception, a kill), clears the flow table (the worker may have left flows conntrack has destroyed since) and
    starts another, which resyncs from a dump. The worker gets SIGTERM if the supervisor dies (PR_SET_PDEATHSIG),
    so it never runs unsupervised. Returns the exit status: 0 after a stop, 1 when the first worker failed before
    it was ready (nothing to supervise)."""
    import ctypes

    state_dir = Path(state_dir)
    me = os.getpid()
    stopping: list[int] = []
    child: list[int] = []

    def on_stop(*_):
        stopping.append(1)
        for pid in child:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_stop)
    restarts, delay, ever_ready = 0, 0.5, False
    while not stopping:
        t0 = time.monotonic()
        pid = os.fork()
        if pid == 0:  # the worker
            code = EXIT_NOT_READY
            try:
                for sig in (signal.SIGTERM, signal.SIGINT):
                    signal.signal(sig, signal.SIG_DFL)
                ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
                if os.getppid() != me:  # the supervisor died before the prctl
                    os._exit(0)
                table = open_table()
                code = 1
                serve(ns, table, state_dir, interval, nic=nic, service_pid=me, restarts=restarts)
                code = 0
            except BaseException:
                import traceback

                traceback.print_exc()
                sys.stderr.flush()
            os._exit(code)
        child[:] = [pid]
        _, status = os.waitpid(pid, 0)
        child.clear()
        code = os.waitstatus_to_exitcode(status)
        doc = read_status_file(state_dir) or {}
        ever_ready |= doc.get("worker") == pid
        if stopping:
            break
        print(f"flowsync: worker {pid} ended ({code}); clearing the flow table", file=sys.stderr, flush=True)
        if not ever_ready and code == EXIT_NOT_READY:
            return 1
        _write_json(
            state_path(state_dir),
            {"running": False, "restarting": True, "pid": me, "last_exit": code, "ns": ns, "nic": nic},
        )
        try:
            t = open_table()
            try:
                t.flow_clear()
            finally:
                t.close()
        except Exception as e:  # the NIC gone: nothing to clear; the next worker fails and says so
            print(f"flowsync: clearing the flow table: {e}", file=sys.stderr, flush=True)
        restarts += 1
        delay = 1.0 if time.monotonic() - t0 > 30 else min(delay * 2, 30.0)
        deadline = time.monotonic() + delay
        while not stopping and time.monotonic() < deadline:
            time.sleep(0.05)
    return 0


def _status_doc(syncer: Syncer, table, ns: str, nic: str, started: float, interval: float) -> dict:
    try:
        hw = dict(table.flow_counters())
    except Exception as e:  # the counters are for display; the sync goes on
        hw = {"error": str(e)}
    return {
        "running": True,
        "pid": os.getpid(),
        "mode": table.mode,
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


# ---- start, stop, status (deploy, undeploy, status) ---------------------------------------------------------------


def _alive(pid: int) -> bool:
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return b"flowsync" in cmdline and stat.rsplit(")", 1)[1].split()[0] != "Z"


def running_pid(state_dir: Path) -> int | None:
    try:
        pid = int(pid_path(state_dir).read_text().strip())
    except (OSError, ValueError):
        return None
    return pid if _alive(pid) else None


MODES = ("flowcache", "liberal")  # the NIC's flow cache (NicClient), or LiberalMarks (the xdp target)


def start(
    ns: str, state_dir: Path, interval: float = INTERVAL, timeout: float = READY_TIMEOUT, mode: str = "flowcache"
) -> int:
    """Start the service for the deployment in `state_dir` (it reads the NIC from state.json) in `mode` (MODES);
    returns its pid once it has resynchronised (its first state file), raises HypafilterError if it exits
    before."""
    if mode not in MODES:
        raise HypafilterError(f"flow sync mode {mode!r}: not one of {', '.join(MODES)}")
    state_dir = Path(state_dir)
    stop(state_dir)
    state_path(state_dir).unlink(missing_ok=True)
    log = open(state_dir / "flowsync.log", "ab")  # the child keeps it
    argv = [
        sys.executable,
        "-m",
        "hypafilter",
        "flowsync",
        "run",
        "--ns",
        ns,
        "--state-dir",
        str(state_dir),
        "--interval",
        str(interval),
        "--mode",
        mode,
    ]
    p = subprocess.Popen(argv, stdout=log, stderr=log, stdin=subprocess.DEVNULL, start_new_session=True)
    log.close()
    pid_path(state_dir).write_text(f"{p.pid}\n")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if p.poll() is not None:
            tail = (state_dir / "flowsync.log").read_text(errors="replace")[-800:]
            pid_path(state_dir).unlink(missing_ok=True)
            raise HypafilterError(f"the flow sync service exited ({p.returncode}): {tail.strip()}")
        doc = read_status_file(state_dir)
        if doc and doc.get("running") and doc.get("pid") == p.pid:
            return p.pid
        time.sleep(0.05)
    stop(state_dir)
    raise HypafilterError(f"the flow sync service did not get ready within {timeout:g} s")


def stop(state_dir: Path, timeout: float = 10.0) -> bool:
    """Stop the service if it runs (SIGTERM: it clears the flow table and exits); True if one was running."""
    state_dir = Path(state_dir)
    pid = running_pid(state_dir)
    pid_path(state_dir).unlink(missing_ok=True)
    if pid is None:
        return False
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not _alive(pid):
            break
        time.sleep(0.02)
    else:
        os.kill(pid, signal.SIGKILL)
    with_reaped(pid)
    return True


def with_reaped(pid: int) -> None:
    """Reap `pid` if it is our child (started by `start` in this process)."""
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass


def read_status_file(state_dir: Path) -> dict | None:
    try:
        return json.loads(state_path(Path(state_dir)).read_text())
    except (OSError, ValueError):
        return None


def status(state_dir: Path, wanted: dict | None = None) -> dict:
    """The service as `status` shows it: wanted (from the deployment), running, and its counters."""
    doc = read_status_file(state_dir) or {}
    pid = running_pid(state_dir)
    out = {**doc, "running": pid is not None and bool(doc.get("running")) and doc.get("pid") == pid}
    if wanted is not None:
        out["wanted"] = bool(wanted.get("wanted"))
        out["reason"] = wanted.get("reason", "")
    return out


def decides_established(policy, plan) -> bool:
    """Whether the policy's hardware entries can decide a frame by its flow-cache state, so that the flow cache
    matters: the plan's own answer if it has one (`decides_established`); else, once the IR has the `ct` field,
    whether some hardware entry's box does not span every ct value (it reads the flow cache); else (an IR without
    it) whether the policy reads conntrack."""
    own = getattr(plan, "decides_established", None)
    if own is not None:
        return bool(own)
    from hypafilter.ir import box

    ct = box.FIELD_INDEX.get("ct")
    if ct is not None:
        top = box.MAXV[ct]
        return any(b.lo[ct] != 0 or b.hi[ct] != top for e in plan.entries for b in e.boxes)
    return bool(getattr(policy, "reads_conntrack", False))
