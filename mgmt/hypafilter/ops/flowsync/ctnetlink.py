"""Conntrack through ctnetlink: the codec of its messages (`parse_event`, the one decoder of conntrack entries;
`ct_request`, `ct_tuple_attr`) and `Conntrack`, the service's sockets (on the generic `ops.netlink.Netlink`)."""

from __future__ import annotations

import errno
import socket
import struct
from collections.abc import Sequence

from hypafilter.hw.flowcache import PROTO_TCP, Flow
from hypafilter.ops.flowsync.events import CtEvent, Flow6, offload_reason
from hypafilter.ops.netlink import (
    NETLINK_NETFILTER,
    NLM_F_ACK,
    NLM_F_CREATE,
    NLM_F_DUMP,
    NLM_F_EXCL,
    Netlink,
    NetlinkError,
    attrs,
    nfnl_request,
    nla,
)

# ctnetlink (include/uapi/linux/netfilter/nfnetlink_conntrack.h, nf_conntrack_tcp.h)
NFNLGRP_CONNTRACK_NEW, NFNLGRP_CONNTRACK_UPDATE, NFNLGRP_CONNTRACK_DESTROY = 1, 2, 3
GROUPS = (1 << NFNLGRP_CONNTRACK_NEW - 1) | (1 << NFNLGRP_CONNTRACK_UPDATE - 1) | (1 << NFNLGRP_CONNTRACK_DESTROY - 1)
IPCTNL_MSG_CT_NEW, IPCTNL_MSG_CT_GET, IPCTNL_MSG_CT_DELETE = 0, 1, 2
NFNL_SUBSYS_CTNETLINK = 1
IP_CT_TCP_FLAG_BE_LIBERAL = 0x08
# ctnetlink attribute types that parse_event reads and the requests carry
CTA_TUPLE_ORIG, CTA_TUPLE_REPLY, CTA_STATUS, CTA_PROTOINFO, CTA_HELP, CTA_TIMEOUT, CTA_ZONE = 1, 2, 3, 4, 5, 7, 18
CTA_TUPLE_IP, CTA_TUPLE_PROTO = 1, 2
CTA_IP_V4_SRC, CTA_IP_V4_DST, CTA_IP_V6_SRC, CTA_IP_V6_DST = 1, 2, 3, 4
CTA_PROTO_NUM, CTA_PROTO_SRC_PORT, CTA_PROTO_DST_PORT = 1, 2, 3
CTA_PROTOINFO_TCP, CTA_PROTOINFO_TCP_STATE = 1, 1
CTA_PROTOINFO_TCP_FLAGS_ORIGINAL, CTA_PROTOINFO_TCP_FLAGS_REPLY = 4, 5


def _raw_tuple(data: bytes, where: tuple[int, int] | None) -> tuple[str, str, int, int, int] | None:
    if where is None:
        return None
    t = attrs(data, *where)
    if CTA_TUPLE_IP not in t or CTA_TUPLE_PROTO not in t:
        return None
    ip, proto = attrs(data, *t[CTA_TUPLE_IP]), attrs(data, *t[CTA_TUPLE_PROTO])
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
    a = attrs(data, off + 20, end)  # after the netlink header (16 bytes) and nfgenmsg (4)
    orig = _raw_tuple(data, a.get(CTA_TUPLE_ORIG))
    if orig is None:
        return None
    rep = _raw_tuple(data, a.get(CTA_TUPLE_REPLY))
    tcp_state = None
    liberal = False
    if CTA_PROTOINFO in a:
        pi = attrs(data, *a[CTA_PROTOINFO])
        if CTA_PROTOINFO_TCP in pi:
            tcp = attrs(data, *pi[CTA_PROTOINFO_TCP])
            if CTA_PROTOINFO_TCP_STATE in tcp:
                tcp_state = data[tcp[CTA_PROTOINFO_TCP_STATE][0]]
            # struct nf_ct_tcp_flags {flags, mask}: the flags byte of each direction
            dirs = (CTA_PROTOINFO_TCP_FLAGS_ORIGINAL, CTA_PROTOINFO_TCP_FLAGS_REPLY)
            liberal = all(k in tcp and data[tcp[k][0]] & IP_CT_TCP_FLAG_BE_LIBERAL for k in dirs)

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
        liberal=liberal,
    )


def _dumped(data: bytes, off: int) -> CtEvent | None:
    """An entry a dump or a get replies with."""
    return parse_event(data, off, "dump")


def ct_tuple_attr(flow: Flow | Flow6) -> bytes:
    """CTA_TUPLE_ORIG of a TCP/UDP flow: what names a conntrack entry in a get or an update. IPv4 (`Flow`):
    CTA_IP_V4_SRC/DST, 4 bytes each; IPv6 (`Flow6`): CTA_IP_V6_SRC/DST, 16 bytes each (ctnetlink_parse_tuple_ip
    reads the pair of the request's nfgenmsg family: send it with `ct_family(flow)`)."""
    if ct_family(flow) == socket.AF_INET6:
        ip = nla(CTA_IP_V6_SRC, flow.src.to_bytes(16, "big")) + nla(CTA_IP_V6_DST, flow.dst.to_bytes(16, "big"))
    else:
        ip = nla(CTA_IP_V4_SRC, struct.pack(">I", flow.src)) + nla(CTA_IP_V4_DST, struct.pack(">I", flow.dst))
    sport, dport = struct.pack(">H", flow.sport), struct.pack(">H", flow.dport)
    proto = nla(CTA_PROTO_NUM, bytes([flow.proto]))
    proto += nla(CTA_PROTO_SRC_PORT, sport) + nla(CTA_PROTO_DST_PORT, dport)
    return nla(CTA_TUPLE_ORIG, nla(CTA_TUPLE_IP, ip, True) + nla(CTA_TUPLE_PROTO, proto, True), True)


def ct_family(flow: Flow | Flow6) -> int:
    """The nfgenmsg family of a request naming `flow`'s entry: AF_INET6 for a `Flow6`, else AF_INET."""
    return getattr(flow, "family", socket.AF_INET)


def ct_request(mtype: int, flags: int, seq: int, attrs: bytes = b"", family: int = socket.AF_INET) -> bytes:
    """One ctnetlink request message: netlink header (NLM_F_REQUEST | flags), nfgenmsg (family, version 0), attrs."""
    return nfnl_request(NFNL_SUBSYS_CTNETLINK, mtype, flags, seq, attrs, family)


class ConntrackError(NetlinkError):
    """Conntrack refused a ctnetlink request: `code` is its errno."""

    peer = "conntrack"


class Conntrack(Netlink):
    """Conntrack of namespace `ns` through ctnetlink: an event socket (NEW, UPDATE, DESTROY groups), a request
    socket (dump, get, entry updates) and a batch socket (liberal-flag updates of several entries). All three are
    opened inside `ns` and stay there. Requests are built here (`ct_request`) and sent and answered by
    `ops.netlink.Netlink`; every conntrack entry, in an event or a reply, is read by `parse_event`."""

    error = ConntrackError
    STASH = True  # the service reads its events through read_events and looks at `backlog` before it waits

    def __init__(self, ns: str | None):
        super().__init__(ns, NETLINK_NETFILTER, GROUPS)

    def read_events(self) -> list[CtEvent]:
        """Every event queued now (non-blocking), without the echoes of this service's own entry updates.

        They say nothing new: those updates change no state a decision reads (flags, timeout), and every change a
        packet makes comes as an event of its own with port id 0. OSError ENOBUFS: events were lost (the caller
        resyncs)."""
        return self.read(parse_event)

    def request(
        self, what: str, mtype: int, flags: int, attrs: bytes = b"", family: int = socket.AF_INET
    ) -> tuple[list[CtEvent], bool]:
        """One ctnetlink request and its replies (`Netlink.exchange`): the conntrack entries replied (kind "dump")
        and whether the kernel marked the dump inconsistent. ConntrackError: the kernel refused it (its errno)."""
        return self.exchange(what, lambda seq: ct_request(mtype, flags, seq, attrs, family), _dumped)

    def dump(self) -> list[CtEvent]:
        """Every conntrack entry, IPv4 and IPv6 (kind "dump": nfgenmsg family AF_UNSPEC, which ctnetlink_dump_table
        does not filter by; AF_INET would dump IPv4 entries only). A dump the kernel marked inconsistent (the table
        changed under it) is taken again, DUMP_TRIES times at most; then HypafilterError."""
        return self.consistent_dump(
            "dump", lambda seq: ct_request(IPCTNL_MSG_CT_GET, NLM_F_DUMP, seq, family=socket.AF_UNSPEC), _dumped
        )

    def get(self, flow: Flow | Flow6) -> CtEvent | None:
        """The entry of `flow` (original direction; kind "dump"), None when conntrack has none."""
        try:
            entries, _ = self.request("get", IPCTNL_MSG_CT_GET, NLM_F_ACK, ct_tuple_attr(flow), ct_family(flow))
        except ConntrackError as e:
            if e.code == errno.ENOENT:
                return None
            raise
        return entries[0] if entries else None

    def _set(self, flow: Flow | Flow6, what: str, attrs: bytes) -> bool:
        """An update of `flow`'s entry (IPCTNL_MSG_CT_NEW without NLM_F_CREATE); False when conntrack has none."""
        try:
            self.request(what, IPCTNL_MSG_CT_NEW, NLM_F_ACK, ct_tuple_attr(flow) + attrs, ct_family(flow))
        except ConntrackError as e:
            if e.code == errno.ENOENT:
                return False
            raise
        return True

    def set_liberal(self, ev: CtEvent) -> bool:
        """IP_CT_TCP_FLAG_BE_LIBERAL in both directions' TCP flags (flags, mask): conntrack's window checks off."""
        return self.set_liberal_many([ev])[0]

    def set_liberal_many(self, evs: Sequence[CtEvent]) -> list[bool]:
        """set_liberal for several entries, as many in one sendmsg as the socket's buffers take (`Netlink.acked`):
        one IPCTNL_MSG_CT_NEW update (no NLM_F_CREATE) per entry, each with NLM_F_ACK and its own sequence
        number, in the entry's family (nfgenmsg AF_INET or AF_INET6, `ct_tuple_attr`'s address pair: an IPv6 update
        is 24 bytes longer, and the batch is bounded by its bytes as much as by its count, `Netlink.acked`). Per
        entry True once its ack says done, False when conntrack has no such entry (ENOENT); any other error raises
        ConntrackError (the worker ends and the supervisor starts another, which resyncs)."""
        flags = struct.pack("=BB", IP_CT_TCP_FLAG_BE_LIBERAL, IP_CT_TCP_FLAG_BE_LIBERAL)  # nf_ct_tcp_flags
        tcp = nla(CTA_PROTOINFO_TCP_FLAGS_ORIGINAL, flags) + nla(CTA_PROTOINFO_TCP_FLAGS_REPLY, flags)
        protoinfo = nla(CTA_PROTOINFO, nla(CTA_PROTOINFO_TCP, tcp, True), True)

        def update(seq: int, ev: CtEvent) -> bytes:
            attrs = ct_tuple_attr(ev.flow) + protoinfo
            return ct_request(IPCTNL_MSG_CT_NEW, NLM_F_ACK, seq, attrs, ct_family(ev.flow))

        return self.acked("liberal-flag update", update, evs)

    def set_timeout(self, flow: Flow | Flow6, proto: int, seconds: int) -> bool:
        return self._set(flow, "timeout update", nla(CTA_TIMEOUT, struct.pack(">I", int(seconds))))

    def refresh(self, flow: Flow | Flow6, proto: int, seconds: int, tcp_state: int | None = None) -> bool:
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
