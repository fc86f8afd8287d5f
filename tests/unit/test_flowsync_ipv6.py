"""The flow sync service with IPv6 conntrack entries (docs/flowsync.md, "IPv6 entries"): the ctnetlink codec's IPv6
tuples (CTA_IP_V6_SRC/DST, nfgenmsg family AF_INET6) built and read back, the liberal-flag updates of IPv6 entries
and their batches bounded by the socket's bytes, the dump in AF_UNSPEC, and which tables hold IPv6 flows: the xdp
target's liberal marks do, the NIC's flow cache (IPv4 keys) and its membership structure do not. Unit tier (no root:
the messages are checked as bytes and through `parse_event`; tests/system/test_xdp_v6_lab.py runs the service on real
IPv6 connections)."""

from __future__ import annotations

import socket
import struct
from dataclasses import replace

import pytest
from hypafilter.hw import flowcache as fc
from hypafilter.ops.flowsync.ctnetlink import (
    CTA_IP_V4_SRC,
    CTA_IP_V6_DST,
    CTA_IP_V6_SRC,
    CTA_PROTOINFO,
    CTA_PROTOINFO_TCP,
    CTA_PROTOINFO_TCP_STATE,
    CTA_STATUS,
    CTA_TUPLE_IP,
    CTA_TUPLE_ORIG,
    CTA_TUPLE_REPLY,
    IPCTNL_MSG_CT_GET,
    IPCTNL_MSG_CT_NEW,
    NFNL_SUBSYS_CTNETLINK,
    Conntrack,
    ct_family,
    ct_request,
    ct_tuple_attr,
    parse_event,
)
from hypafilter.ops.flowsync.events import IPS_CONFIRMED, IPS_SEEN_REPLY, Flow6, offload_reason
from hypafilter.ops.flowsync.marks import LiberalMarks
from hypafilter.ops.flowsync.members import entry_keys
from hypafilter.ops.flowsync.syncer import Syncer
from hypafilter.ops.netlink import NLM_F_CREATE, NLM_F_DUMP, Netlink, attrs, nl_messages, nla
from hypafilter.targets.nic import NicClient

from tests.unit.test_flowsync import ESTABLISHED, TCP, TIMEOUTS, UDP, MemCt, MemTable, ev

A, B = "fd48:4600::1:1", "fd48:4600::2:1"
A_INT, B_INT = 0xFD48_4600_0000_0000_0000_0000_0001_0001, 0xFD48_4600_0000_0000_0000_0000_0002_0001


def ev6(**kw):
    return ev(family=socket.AF_INET6, src=kw.pop("src", A), dst=kw.pop("dst", B), **kw)


def _nfgen_family(msg: bytes) -> int:
    return msg[16]


def _tuple_addrs(msg: bytes, which: int) -> dict[int, bytes]:
    """The address attributes of the message's tuple `which` (CTA_TUPLE_ORIG/REPLY), as bytes by type."""
    top = attrs(msg, 20, len(msg))
    t = attrs(msg, *top[which])
    return {k: msg[o:e] for k, (o, e) in attrs(msg, *t[CTA_TUPLE_IP]).items()}


def test_an_ipv6_entry_is_a_flow6_and_offloadable():
    e = ev6()
    assert e.flow == Flow6(A_INT, B_INT, TCP, 40000, 80) and e.flow.family == socket.AF_INET6
    assert e.flow.reply() == Flow6(B_INT, A_INT, TCP, 80, 40000)
    assert offload_reason(e) is None and offload_reason(ev6(proto=UDP)) is None
    assert offload_reason(ev6(proto=58)) == "not TCP/UDP over IPv4 or IPv6"  # ICMPv6
    assert offload_reason(ev6(reply=("fd48:4600::9", A, 80, 40000))) == "NAT"
    # the same numbers in an IPv4 flow are another flow: neither equal nor taken for one another
    assert Flow6(1, 2, TCP, 3, 4) != fc.Flow(1, 2, TCP, 3, 4) and ct_family(fc.Flow(1, 2, TCP)) == socket.AF_INET


def test_an_ipv6_tuple_built_and_framed_reads_back():
    """ct_tuple_attr of a Flow6: CTA_IP_V6_SRC/DST of 16 bytes each, in a request of nfgenmsg family AF_INET6; an
    entry message made of it (both tuples, status, TCP state) reads back through parse_event as the same entry."""
    flow = Flow6(A_INT, B_INT, TCP, 40000, 80)
    orig = ct_tuple_attr(flow)
    reply = ct_tuple_attr(flow.reply())
    reply = struct.pack("=HH", len(reply), CTA_TUPLE_REPLY | 0x8000) + reply[4:]
    tcp = nla(CTA_PROTOINFO_TCP, nla(CTA_PROTOINFO_TCP_STATE, bytes([ESTABLISHED])), True)
    body = orig + reply + nla(CTA_STATUS, struct.pack(">I", IPS_CONFIRMED | IPS_SEEN_REPLY))
    msg = ct_request(IPCTNL_MSG_CT_NEW, NLM_F_CREATE, 9, body + nla(CTA_PROTOINFO, tcp, True), ct_family(flow))
    assert _nfgen_family(msg) == socket.AF_INET6 and struct.unpack_from("=H", msg, 4)[0] >> 8 == NFNL_SUBSYS_CTNETLINK
    ips = _tuple_addrs(msg, CTA_TUPLE_ORIG)
    assert ips == {
        CTA_IP_V6_SRC: socket.inet_pton(socket.AF_INET6, A),
        CTA_IP_V6_DST: socket.inet_pton(socket.AF_INET6, B),
    }
    assert [(off, seq) for off, _, _, _, seq, _ in nl_messages(msg + msg)] == [(0, 9), (len(msg), 9)]
    e = parse_event(msg)
    assert (e.kind, e.family, e.src, e.dst, e.flow, e.tcp_state) == ("new", socket.AF_INET6, A, B, flow, ESTABLISHED)
    assert e.reply == (B, A, 80, 40000) and offload_reason(e) is None
    # the IPv4 form is unchanged: 4-byte addresses, family AF_INET
    v4 = ct_tuple_attr(fc.Flow(0x0A000001, 0x0A000002, TCP, 1, 2))
    m4 = ct_request(IPCTNL_MSG_CT_NEW, 0, 1, v4, ct_family(fc.Flow(0, 0, TCP)))
    assert _nfgen_family(m4) == socket.AF_INET and _tuple_addrs(m4, CTA_TUPLE_ORIG)[CTA_IP_V4_SRC] == bytes(
        [10, 0, 0, 1]
    )
    assert len(orig) - len(v4) == 24  # two 16-byte addresses for two 4-byte ones


class _Recorded(Conntrack):
    """Conntrack's request building without sockets: the messages acked/consistent_dump would send."""

    def __init__(self):
        self.sent: list[bytes] = []
        self.seq = 100

    def acked(self, what, request, items, absent=0):
        out = []
        for item in items:
            self.seq += 1
            self.sent.append(request(self.seq, item))
            out.append(True)
        return out

    def consistent_dump(self, what, request, parse):
        self.sent.append(request(1))
        return []


def test_liberal_updates_of_ipv6_entries_name_them_in_their_family():
    """set_liberal_many over IPv4 and IPv6 entries: each update an IPCTNL_MSG_CT_NEW without NLM_F_CREATE in its
    entry's family with its own tuple, both directions' BE_LIBERAL flag; read back, each is that entry, liberal."""
    ct = _Recorded()
    four, six = ev(), ev6()
    assert ct.set_liberal_many([four, six]) == [True, True]
    m4, m6 = ct.sent
    assert (_nfgen_family(m4), _nfgen_family(m6)) == (socket.AF_INET, socket.AF_INET6)
    for m, e in ((m4, four), (m6, six)):
        length, mtype, flags = struct.unpack_from("=IHH", m, 0)
        assert length == len(m) and mtype == NFNL_SUBSYS_CTNETLINK << 8 | IPCTNL_MSG_CT_NEW
        assert not flags & NLM_F_CREATE
        back = parse_event(m)
        assert (back.kind, back.family, back.flow, back.liberal) == ("update", e.family, e.flow, True)
    assert len(m6) - len(m4) == 24


def test_the_dump_asks_for_every_family():
    """The dump's nfgenmsg family is AF_UNSPEC (ctnetlink filters a dump by any other family: AF_INET dumped IPv4
    entries only)."""
    ct = _Recorded()
    assert ct.dump() == []
    (msg,) = ct.sent
    _, mtype, flags = struct.unpack_from("=IHH", msg, 0)
    assert mtype & 0xFF == IPCTNL_MSG_CT_GET and flags & NLM_F_DUMP and _nfgen_family(msg) == socket.AF_UNSPEC


class _Batches(Netlink):
    """Netlink.acked's batching with a given room and no socket: the datagrams it would send."""

    def __init__(self, room: int, most: int):
        self.room, self.most, self.seq, self.datagrams = room, most, 0, []

    def batch_room(self):
        return self.room, self.most

    def next_seq(self):
        self.seq += 1
        return self.seq

    def _acked_datagram(self, what, msgs, absent):
        self.datagrams.append([m for _, m in msgs])
        return [True] * len(msgs)


def test_ipv6_liberal_updates_are_batched_by_the_socket_buffer_bytes():
    """An IPv6 update is longer than an IPv4 one, so the same send-buffer room takes fewer of them: every datagram
    within the room (and the ack count), none split, all sent, in order."""
    rec = _Recorded()
    rec.set_liberal_many([ev6(sport=40000 + k) for k in range(50)])
    updates = rec.sent
    rec4 = _Recorded()
    rec4.set_liberal_many([ev()])
    size4, size6 = len(rec4.sent[0]), len(updates[0])
    assert size6 - size4 == 24
    room = 10 * size4  # ten IPv4 updates' bytes
    nl = _Batches(room, 1000)
    assert nl.acked("liberal-flag update", lambda seq, m: m, updates) == [True] * 50
    assert [m for d in nl.datagrams for m in d] == updates
    assert all(sum(len(m) for m in d) <= room for d in nl.datagrams)
    per = room // size6
    assert per < 10 and [len(d) for d in nl.datagrams[:-1]] == [per] * (len(nl.datagrams) - 1)
    nl = _Batches(1 << 20, 7)  # the ack count bounds it too
    nl.acked("liberal-flag update", lambda seq, m: m, updates)
    assert max(len(d) for d in nl.datagrams) == 7


def test_liberal_marks_hold_ipv6_tcp_as_ipv4():
    """The xdp target's table: IPv6 TCP entries marked liberal before they count as held, alongside IPv4 ones; UDP
    of either family needs no mark; an IPv6 flow leaves at LAST_ACK and on its destroy; a resync marks IPv6 entries
    of the dump."""
    table, ct = LiberalMarks(), MemCt()
    s = Syncer(table, ct, dict(TIMEOUTS))
    t4, t6, u6 = ev(), ev6(), ev6(proto=UDP, sport=5000, dport=53)
    ct.entries |= {t4.flow, t6.flow, u6.flow}
    assert s.events([t4, t6, u6]) == ["install", "install", None]
    assert ct.liberal_batches == [[t4.flow, t6.flow]] and set(table.flows) == {t4.flow, t6.flow}
    assert s.event(ev6(state=6)) == "remove" and set(table.flows) == {t4.flow}  # LAST_ACK
    assert s.event(ev6(state=7)) == "install"  # back at TIME_WAIT
    assert s.event(ev6(kind="destroy", status=0, state=None)) == "remove" and t6.flow not in table.flows
    dumped = [ev6(kind="dump", sport=41000 + k) for k in range(3)] + [ev(kind="dump", sport=42000)]
    ct.entries |= {e.flow for e in dumped}
    s.resync(dumped)
    assert set(table.flows) == {e.flow for e in dumped}
    st = s.stats()
    assert st["offloaded"] == 4 and st["errors"] == 0


def test_an_ipv4_only_flow_cache_gets_no_ipv6_entry():
    """An IPv4-only core's flow cache has IPv4 keys (NicClient.families without AF_INET6: FC_CONFIG bit 24 clear,
    tests/unit/test_nic.py): an IPv6 entry is neither marked liberal nor sent to it, by events or by a resync; its
    IPv4 neighbours are; the membership structure holds no IPv6 key either (on any core)."""
    assert isinstance(NicClient.families, property) and socket.AF_INET6 in LiberalMarks.families
    for families in (None, (socket.AF_INET,)):
        table, ct = MemTable(), MemCt()
        if families is not None:
            table.families = families
        s = Syncer(table, ct, dict(TIMEOUTS))
        t4, t6, u6 = ev(), ev6(), ev6(proto=UDP, sport=5000, dport=53)
        ct.entries |= {t4.flow, t6.flow, u6.flow}
        assert s.events([t6, t4, u6]) == [None, "install", None]
        s.resync([t6, t4, u6])
        assert ct.calls == [("liberal", t4.flow)]
        assert {f for b in table.batches for _, f in b} == {t4.flow}
        assert set(s.installed) == {t4.flow}
    assert entry_keys(ev6()) == () and entry_keys(ev6(proto=UDP)) == () and len(entry_keys(ev())) == 1


def test_a_dual_stack_flow_cache_gets_ipv6_entries():
    """A dual-stack core's flow cache holds IPv6 tuples (families IPv4 and IPv6): an established IPv6 TCP entry is
    marked liberal and inserted as an IPv4 one, by events and by a resync, and removed when conntrack destroys it."""
    table, ct = MemTable(), MemCt()
    table.families, table.wide = (socket.AF_INET, socket.AF_INET6), True
    s = Syncer(table, ct, dict(TIMEOUTS))
    t4, t6 = ev(), ev6()
    ct.entries |= {t4.flow, t6.flow}
    assert s.events([t6, t4]) == ["install", "install"]
    assert set(s.installed) == {t4.flow, t6.flow} and ("liberal", t6.flow) in ct.calls
    assert {f for b in table.batches for _, f in b} == {t4.flow, t6.flow}
    assert s.events([replace(t6, kind="destroy")]) == ["remove"]
    assert set(s.installed) == {t4.flow}
    s.resync([t6, t4])
    assert set(s.installed) == {t4.flow, t6.flow}


@pytest.mark.parametrize(
    ("fs", "part"),
    [
        ({"mode": "liberal", "families": ["ipv4", "ipv6"]}, "2 TCP flows held (IPv4 and IPv6), 3 entries"),
        ({"families": ["ipv4"]}, "2 flows offloaded (IPv4 only), occupancy"),
        ({"mode": "liberal"}, "2 TCP flows held, 3 entries"),  # an older service's status file
    ],
)
def test_status_names_the_families(fs, part):
    from hypafilter.cli.deploy import _fmt_flowsync

    line = _fmt_flowsync({"wanted": True, "running": True, "pid": 1, "offloaded": 2, "liberal": 3, **fs})
    assert part in line, line
