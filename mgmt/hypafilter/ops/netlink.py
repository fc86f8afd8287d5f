"""Netlink, whatever the family: message framing and attributes (include/uapi/linux/netlink.h), the nfnetlink
header of the netfilter families, and `Netlink`, the sockets of one protocol inside a network namespace with their
receive loop: events, one request and its replies, acknowledged batches.

What the messages mean is the caller's: a family's codec (ops.flowsync.ctnetlink for conntrack) builds the
requests and parses the messages; nothing here knows a family's message types or attributes.
"""

from __future__ import annotations

import errno
import os
import socket
import struct
from collections.abc import Callable, Iterator, Sequence
from typing import TypeVar

from hypafilter import netns
from hypafilter.errors import HypafilterError

T = TypeVar("T")

NETLINK_NETFILTER = 12  # the nfnetlink protocol (conntrack, nf_tables, ...)
NLMSG_ERROR, NLMSG_DONE, NLMSG_MIN_TYPE = 2, 3, 0x10
NLM_F_REQUEST, NLM_F_ACK, NLM_F_DUMP_INTR = 0x1, 0x4, 0x10
NLM_F_DUMP, NLM_F_CREATE, NLM_F_EXCL = 0x300, 0x400, 0x200
NLA_F_NESTED = 0x8000
NLA_TYPE_MASK = 0x3FFF  # without NLA_F_NESTED and NLA_F_NET_BYTEORDER
SO_RCVBUFFORCE = getattr(socket, "SO_RCVBUFFORCE", 33)  # asm-generic/socket.h


def attrs(data: bytes, off: int, end: int) -> dict[int, tuple[int, int]]:
    """The netlink attributes in data[off:end]: type -> (payload start, payload end); the first of a type counts."""
    out: dict[int, tuple[int, int]] = {}
    while off + 4 <= end:
        length, kind = struct.unpack_from("=HH", data, off)
        if length < 4 or off + length > end:
            break
        out.setdefault(kind & NLA_TYPE_MASK, (off + 4, off + length))
        off += (length + 3) & ~3
    return out


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


def nla(kind: int, payload: bytes, nested: bool = False) -> bytes:
    """One netlink attribute, padded to 4 bytes."""
    head = struct.pack("=HH", 4 + len(payload), kind | (NLA_F_NESTED if nested else 0))
    return head + payload + bytes(-len(payload) % 4)


def nfnl_request(
    subsys: int, mtype: int, flags: int, seq: int, attrs: bytes = b"", family: int = socket.AF_INET
) -> bytes:
    """One nfnetlink request message of subsystem `subsys`: netlink header (NLM_F_REQUEST | flags), nfgenmsg
    (family, version 0), attrs."""
    body = struct.pack("=BBH", family, 0, 0) + attrs
    head = struct.pack("=IHHII", 16 + len(body), subsys << 8 | mtype, NLM_F_REQUEST | flags, seq, 0)
    return head + body


class NetlinkError(HypafilterError):
    """The kernel refused a request: `code` is its errno. `peer` names the other end in the message."""

    peer = "netlink"

    def __init__(self, what: str, code: int):
        self.code = code
        super().__init__(f"{self.peer} {what}: {os.strerror(code)} (errno {code})")


class Netlink:
    """Netlink sockets of protocol `protocol`, all opened inside namespace `ns` and staying there: an event socket
    subscribed to the multicast `groups` (non-blocking), a request socket (one request and its replies at a time)
    and a batch socket (several acknowledged requests in one datagram). Requests of both are numbered from one
    counter. A family subclasses it with its codec; its errors are `error` (a NetlinkError naming the peer)."""

    error: type[NetlinkError] = NetlinkError
    DUMP_TRIES = 3  # dumps the kernel marked inconsistent (NLM_F_DUMP_INTR) before `consistent_dump` gives up
    RCVBUF = 4 << 20
    # The event socket's receive buffer (the kernel doubles it): the events that come while the owner does other
    # work (the flow sync service's resync over 250,000 entries: 10-17 s) wait there, and one that finds it full is
    # lost (ENOBUFS, and the flow sync service resyncs again). 8 MiB held 6,600 conntrack NEW events here (1.27 KB
    # of buffer each); 64 MiB holds about 50,000. Set with SO_RCVBUFFORCE (CAP_NET_ADMIN), past net.core.rmem_max
    # (212,992 bytes by default, which would make RCVBUF a few hundred events); without the capability, RCVBUF.
    EVENTS_RCVBUF = 32 << 20
    # Whether every wait for a reply first moves the queued event datagrams into `backlog` (`stash`): a family
    # whose owner reads its events through `read` and looks at `backlog` before it waits on the socket sets it
    # (Conntrack: a dump of 250,000 entries takes seconds, in which events would fill the socket).
    STASH = False
    ACK_COST = 1024  # bytes of a receive buffer one ack takes at most (an skb's truesize, not its data)
    TIMEOUT = 10.0  # seconds a request waits for its reply

    def __init__(self, ns: str | None, protocol: int, groups: int):
        with netns.inside(ns):
            # Subscribed before any dump, so that nothing that happens between the two is lost.
            self.events = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, protocol)
            self.req = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, protocol)
            # Batched requests (`acked`): several in one datagram, acks matched by sequence number.
            self.batch = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, protocol)
        for s in (self.req, self.batch):
            s.bind((0, 0))
            s.settimeout(self.TIMEOUT)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, self.RCVBUF)
        self._seq = 0
        self.echoes = 0  # events skipped as echoes of this object's own requests
        self.backlog: list[bytes] = []  # event datagrams taken off the socket by `stash`, not read yet
        self.lost = False  # `stash` met ENOBUFS: the next `read` raises it
        try:
            self.events.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, self.EVENTS_RCVBUF)
        except PermissionError:
            self.events.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, self.RCVBUF)
        self.events.bind((0, groups))
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

    def next_seq(self) -> int:
        self._seq = (self._seq + 1) & 0x7FFFFFFF or 1
        return self._seq

    def foreign(self, data: bytes, parse: Callable[[bytes, int], T | None]) -> list[T]:
        """The events of a datagram (`parse(data, offset)` of each message; None: not one), except the echoes of
        this object's own requests.

        An event that a request causes carries the requesting socket's port id in its header (nlmsg_pid; the
        kernel's own events carry 0), so the echoes are known from the header alone and skipped unparsed."""
        own = self.own_ports()
        out = []
        for off, _, _, _, _, pid in nl_messages(data):
            if pid in own:
                self.echoes += 1
            elif (ev := parse(data, off)) is not None:
                out.append(ev)
        return out

    def stash(self) -> None:
        """Take the event datagrams queued now off the socket into `backlog`, unparsed (a recv each), so that a
        long piece of work that calls it between its parts (a dump, a resync) does not let the socket's buffer
        overflow; `read` gives them back first. An overflow met here is raised by the next `read`."""
        while True:
            try:
                self.backlog.append(self.events.recv(1 << 20))
            except BlockingIOError:
                return
            except OSError as e:
                if e.errno != errno.ENOBUFS:
                    raise
                self.lost = True

    def read(self, parse: Callable[[bytes, int], T | None]) -> list[T]:
        """Every event queued now (non-blocking; those `stash` took off first), without the echoes of this
        object's own requests (`foreign`). OSError ENOBUFS: events were lost (the caller resyncs)."""
        backlog, self.backlog = self.backlog, []
        if self.lost:
            self.lost = False
            raise OSError(errno.ENOBUFS, os.strerror(errno.ENOBUFS))
        out: list[T] = []
        for data in backlog:
            out += self.foreign(data, parse)
        while True:
            try:
                data = self.events.recv(1 << 20)
            except BlockingIOError:
                return out
            out += self.foreign(data, parse)

    def receive(
        self, sock: socket.socket, size: int, what: Callable[[], str]
    ) -> Iterator[tuple[bytes, int, int, int, int, int]]:
        """(datagram, offset, length, type, flags, sequence number) of each netlink message `sock` receives
        (datagrams of at most `size` bytes), for as long as the caller takes them: the one receive loop of the
        request and batch sockets. HypafilterError "<peer> did not answer <what()>" when the socket's timeout
        passes first (`what` is called then, so it can say what was still missing)."""
        while True:
            if self.STASH:
                self.stash()
            try:
                data = sock.recv(size)
            except TimeoutError as e:
                raise HypafilterError(f"{self.error.peer} did not answer {what()}") from e
            for off, length, rtype, rflags, rseq, _ in nl_messages(data):
                yield data, off, length, rtype, rflags, rseq

    def exchange(
        self, what: str, request: Callable[[int], bytes], parse: Callable[[bytes, int], T | None]
    ) -> tuple[list[T], bool]:
        """One request (`request(seq)`) on the request socket and its replies up to the last: NLMSG_DONE ending a
        dump (multipart replies), or NLMSG_ERROR (the ack of a request with NLM_F_ACK, or an error). What `parse`
        makes of the replies (None: skipped) and whether the kernel marked the dump inconsistent
        (NLM_F_DUMP_INTR). `error`: the kernel refused the request or the dump (its errno); HypafilterError: no
        answer. Replies of another sequence number (to an earlier request that raised) are skipped."""
        seq = self.next_seq()
        self.req.send(request(seq))
        entries: list[T] = []
        interrupted = False
        for data, off, length, rtype, rflags, rseq in self.receive(self.req, 1 << 20, lambda: f"the {what}"):
            if rseq != seq:
                continue
            interrupted |= bool(rflags & NLM_F_DUMP_INTR)
            if rtype in (NLMSG_ERROR, NLMSG_DONE):
                if code := nl_errno(data, off, length):
                    raise self.error(what, code)
                return entries, interrupted
            if rtype >= NLMSG_MIN_TYPE and (ev := parse(data, off)) is not None:
                entries.append(ev)

    def consistent_dump(
        self, what: str, request: Callable[[int], bytes], parse: Callable[[bytes, int], T | None]
    ) -> list[T]:
        """A dump (`exchange`); one the kernel marked inconsistent (the table changed under it) is taken again,
        DUMP_TRIES times at most; then HypafilterError."""
        for _ in range(self.DUMP_TRIES):
            entries, interrupted = self.exchange(what, request, parse)
            if not interrupted:
                return entries
        raise HypafilterError(
            f"{self.error.peer} {what}: inconsistent {self.DUMP_TRIES} times in a row (NLM_F_DUMP_INTR)"
        )

    def acked(
        self, what: str, request: Callable[[int, T], bytes], items: Sequence[T], absent: int = errno.ENOENT
    ) -> list[bool]:
        """One request per item (`request(seq, item)`, with NLM_F_ACK and its own sequence number) on the batch
        socket, as many in a datagram as the socket's buffers take (`batch_room`), the next datagram once the acks
        of the one before are read; the kernel runs every message of a datagram and acks each. Per item True once
        its ack says done, False when it answers `absent` (no such object); any other error raises `error`."""
        room, most = self.batch_room()
        out: list[bool] = []
        msgs: list[tuple[int, bytes]] = []
        size = 0
        for item in items:
            seq = self.next_seq()
            msg = request(seq, item)
            if msgs and (size + len(msg) > room or len(msgs) >= most):
                out += self._acked_datagram(what, msgs, absent)
                msgs, size = [], 0
            msgs.append((seq, msg))
            size += len(msg)
        if msgs:
            out += self._acked_datagram(what, msgs, absent)
        return out

    def batch_room(self) -> tuple[int, int]:
        """Bytes of requests one datagram of the batch socket may carry and how many requests: half its send buffer
        (netlink_sendmsg refuses a datagram longer than sk_sndbuf - 32 with EMSGSIZE), and as many acks as half its
        receive buffer holds at ACK_COST each (the kernel charges an ack's whole skb, its truesize, to the buffer;
        an ack that finds it full is dropped and the socket gets ENOBUFS). Both as the kernel reports them, so a
        machine with other net.core.wmem/rmem limits gets batches that fit its buffers."""
        snd = self.batch.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
        rcv = self.batch.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)
        return max(snd // 2, 1), max(rcv // 2 // self.ACK_COST, 1)

    def _acked_datagram(self, what: str, msgs: list[tuple[int, bytes]], absent: int) -> list[bool]:
        data = b"".join(m for _, m in msgs)
        seqs = {seq: k for k, (seq, _) in enumerate(msgs)}
        self.batch.send(data)
        out: list[bool | None] = [None] * len(msgs)
        left = len(msgs)

        def unanswered() -> str:  # called if the socket times out: the acks missing then
            return f"{left} of {len(msgs)} updates"

        for chunk, off, length, rtype, _, rseq in self.receive(self.batch, 1 << 16, unanswered):
            k = seqs.get(rseq)
            if k is None or out[k] is not None or rtype != NLMSG_ERROR:
                continue  # not an ack of this batch (a late one of an earlier batch that raised)
            code = nl_errno(chunk, off, length)
            if code == 0:
                out[k] = True
            elif code == absent:
                out[k] = False
            else:
                raise self.error(what, code)
            left -= 1
            if not left:
                break
        return [bool(x) for x in out]
