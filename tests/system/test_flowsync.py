"""The flow sync service (ops/flowsync/) against real conntrack: the events of real TCP and UDP connections, the
install decision at each, TCP window liberal mode and the timeout set as conntrack itself reports them
(`conntrack -L`, pyroute2's dump); then the whole service on the emulated NIC's flow cache in a lab:
deploy starts it, flows go in and out of the hardware, hits refresh conntrack's timeout, a restart resyncs, a dead
service is drift, undeploy stops it."""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import os
import re
import signal
import socket
import struct
import tempfile
import threading
import time

import pytest
from hypafilter import netns
from hypafilter.hw.flowcache import Flow
from hypafilter.netns import inside
from hypafilter.ops.flowsync import service as flowsync
from hypafilter.ops.flowsync.ctnetlink import (
    GROUPS,
    IPCTNL_MSG_CT_DELETE,
    IPCTNL_MSG_CT_GET,
    IPCTNL_MSG_CT_NEW,
    Conntrack,
    ConntrackError,
    parse_event,
)
from hypafilter.ops.flowsync.events import IPS_ASSURED, IPS_SEEN_REPLY, CtEvent, offload_reason
from hypafilter.ops.flowsync.service import SERVICE
from hypafilter.ops.flowsync.syncer import TIME_WAIT_IDLE_POLLS
from hypafilter.ops.lab import flush_conntrack
from hypafilter.ops.netlink import NLM_F_ACK, NLM_F_CREATE, NLM_F_EXCL

from conftest import need, need_root, need_tool
from tests.scratchns import scratch_netns

pytestmark = pytest.mark.system

LAB = "dsync"
TCP_PORT, UDP_PORT = 7001, 7002
POLICY = (
    "*filter\n:FORWARD DROP [0:0]\n"
    "-A FORWARD -m conntrack --ctstate ESTABLISHED -j ACCEPT\n"
    f"-A FORWARD -p tcp -m tcp --dport {TCP_PORT} -j ACCEPT\n"
    f"-A FORWARD -p udp -m udp --dport {UDP_PORT} -j ACCEPT\n"
    "COMMIT\n"
)


def stateless_policy():
    """A FORWARD policy that reads no conntrack state: deploy starts no flow sync service for it."""
    from hypafilter.config import Config
    from hypafilter.iptables.document import parse_policy

    return parse_policy(
        f"*filter\n:FORWARD DROP [0:0]\n-A FORWARD -p tcp -m tcp --dport {TCP_PORT} -j ACCEPT\nCOMMIT\n",
        filename="plain.rules",
        base_chain="FORWARD",
        config=Config(),
    )


@contextlib.contextmanager
def tracking_ns(name: str):
    """A scratch namespace whose conntrack tracks connections (a conntrack match makes the kernel register its
    hooks, on demand), loopback up, and a Conntrack on it: (ns, ct); the caller closes ct."""
    with scratch_netns(name, "iptables", "conntrack") as ns:
        netns.run(["ip", "link", "set", "lo", "up"], ns)
        netns.run(["iptables", "-w", "-A", "INPUT", "-m", "conntrack", "--ctstate", "ESTABLISHED", "-j", "ACCEPT"], ns)
        yield ns, Conntrack(ns)


def conntrack_list(ns: str) -> list[dict]:
    """The kernel's own listing (`conntrack -L` in `ns`, conntrack-tools): proto, timeout, state and the original
    tuple of every IPv4 entry."""
    out = []
    for line in netns.run(["conntrack", "-L", "-f", "ipv4"], ns).splitlines():
        f = line.split()
        if len(f) < 4 or not f[2].isdigit():
            continue
        first: dict[str, str] = {}  # the first src=, dst=, sport=, dport= are the original tuple
        for k, v in re.findall(r"(src|dst|sport|dport)=(\S+)", line):
            first.setdefault(k, v)
        out.append(
            {
                "proto": f[0],
                "timeout": int(f[2]),
                "state": None if f[3].startswith("src=") else f[3],
                "src": first.get("src"),
                "dst": first.get("dst"),
                "sport": int(first.get("sport", 0)),
                "dport": int(first.get("dport", 0)),
            }
        )
    return out


def entry_of(ns: str, proto: str, dport: int, sport: int | None = None) -> dict | None:
    for e in conntrack_list(ns):
        if e["proto"] == proto and e["dport"] == dport and (sport is None or e["sport"] == sport):
            return e
    return None


def wait_for(cond, timeout: float = 5.0, step: float = 0.05):
    deadline = time.monotonic() + timeout
    while True:
        v = cond()
        if v or time.monotonic() > deadline:
            return v
        time.sleep(step)


def events_until(ct: Conntrack, pred, timeout: float = 5.0) -> list[CtEvent]:
    """Conntrack events read from `ct` until one satisfies `pred` (all of them, in order)."""
    got: list[CtEvent] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        new = ct.read_events()
        got += new
        if any(pred(e) for e in new):
            return got
        time.sleep(0.02)
    raise AssertionError(f"no such event within {timeout} s; got {got}")


def tcp_flags(ns: str) -> dict[tuple[int, int], tuple[int, int]]:
    """TCP flags (original, reply) of every TCP entry by its (source, destination) port, as pyroute2's dump reports
    them (not the code under test)."""
    from pyroute2.netlink.nfnetlink.nfctsocket import NFCTSocket

    with inside(ns):
        s = NFCTSocket()
        s.asyncore.socket  # noqa: B018  (pyroute2 opens its socket lazily: here, inside `ns`)
    out = {}
    try:
        for m in s.dump():
            t = m.get_attr("CTA_TUPLE_ORIG").get_attr("CTA_TUPLE_PROTO")
            info = m.get_attr("CTA_PROTOINFO")
            tcp = info.get_attr("CTA_PROTOINFO_TCP") if info else None
            if tcp:
                out[(t.get_attr("CTA_PROTO_SRC_PORT"), t.get_attr("CTA_PROTO_DST_PORT"))] = (
                    tcp.get_attr("CTA_PROTOINFO_TCP_FLAGS_ORIGINAL")[0],
                    tcp.get_attr("CTA_PROTOINFO_TCP_FLAGS_REPLY")[0],
                )
    finally:
        s.close()
    return out


def liberal_flags(ns: str, sport: int, dport: int) -> tuple[int, int]:
    """TCP flags (original, reply) of the entry sport -> dport (`tcp_flags`)."""
    flags = tcp_flags(ns).get((sport, dport))
    assert flags is not None, f"no conntrack entry {sport} -> {dport}"
    return flags


# ---- conntrack side, in a namespace of its own ------------------------------------------------------------------


def test_events_decisions_liberal_and_timeout_on_real_conntrack():
    with tracking_ns("dsct") as (ns, ct):  # closed by the test
        try:
            with inside(ns):
                srv = socket.socket()
                cli = socket.socket()
                usrv = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
                ucli = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            srv.bind(("127.0.0.1", TCP_PORT))
            srv.listen()
            cli.connect(("127.0.0.1", TCP_PORT))
            acc, _ = srv.accept()
            cli.sendall(b"x")
            acc.recv(1)
            sport = cli.getsockname()[1]

            def is_tcp(e):
                return e.proto == 6 and e.sport == sport and e.dport == TCP_PORT

            got = [e for e in events_until(ct, lambda e: is_tcp(e) and e.tcp_state == 3) if is_tcp(e)]
            assert got[0].kind == "new" and got[0].tcp_state == 1  # SYN_SENT
            assert offload_reason(got[0]) is not None
            assert [e.kind for e in got[1:]] == ["update"] * (len(got) - 1)
            assert all(offload_reason(e) is not None for e in got[:-1])
            assert offload_reason(got[-1]) is None  # ESTABLISHED, confirmed, seen a reply
            flow = got[-1].flow

            # Liberal mode as the kernel then reports it, in both directions.
            assert not any(f & 0x08 for f in liberal_flags(ns, sport, TCP_PORT))
            assert ct.set_liberal(got[-1])
            assert all(f & 0x08 for f in liberal_flags(ns, sport, TCP_PORT))
            # A timeout write shows in the kernel's own listing (conntrack -L).
            assert entry_of(ns, "tcp", TCP_PORT, sport)["timeout"] > 1000
            assert ct.set_timeout(flow, 6, 77)
            assert 70 <= entry_of(ns, "tcp", TCP_PORT, sport)["timeout"] <= 77
            assert ct.refresh(flow, 6, 432000)  # still established: refreshed
            assert entry_of(ns, "tcp", TCP_PORT, sport)["timeout"] > 431000
            dumped = [e for e in ct.dump() if is_tcp(e)]
            assert len(dumped) == 1 and offload_reason(dumped[0]) is None

            # Close: both FINs take the entry through LAST_ACK (remove: conntrack must see the next ACK) to
            # TIME_WAIT (offloadable again: its ACKs change nothing), then it is destroyed.
            ct.read_events()
            cli.close()
            acc.close()
            got = [e for e in events_until(ct, lambda e: is_tcp(e) and e.tcp_state == 7) if is_tcp(e)]
            states = [e.tcp_state for e in got if e.tcp_state is not None]
            assert 6 in states and states[-1] == 7, states
            assert all(offload_reason(e) is not None for e in got if e.tcp_state == 6)
            assert offload_reason(got[-1]) is None
            before = entry_of(ns, "tcp", TCP_PORT, sport)["timeout"]
            assert before <= 120
            # A refresh for the state the service last knew (ESTABLISHED) is refused: the entry moved on.
            assert not ct.refresh(flow, 6, 432000, 3)
            assert entry_of(ns, "tcp", TCP_PORT, sport)["timeout"] <= before
            assert ct.refresh(flow, 6, 118, 7)  # TIME_WAIT's own: set
            assert 110 <= entry_of(ns, "tcp", TCP_PORT, sport)["timeout"] <= 118
            netns.run(["iptables", "-w", "-F", "INPUT"], ns)  # entries outlive rules: destroy it by hand
            flush_conntrack(ns)
            got = events_until(ct, lambda e: is_tcp(e) and e.kind == "destroy")
            assert any(e.kind == "destroy" and is_tcp(e) for e in got)
            assert entry_of(ns, "tcp", TCP_PORT, sport) is None
            assert ct.get(flow) is None and not ct.refresh(flow, 6, 432000) and not ct.set_timeout(flow, 6, 60)
            netns.run(
                ["iptables", "-w", "-A", "INPUT", "-m", "conntrack", "--ctstate", "ESTABLISHED", "-j", "ACCEPT"], ns
            )

            # UDP: one way is not established; the reply makes it so.
            usrv.bind(("127.0.0.1", UDP_PORT))
            ucli.sendto(b"a", ("127.0.0.1", UDP_PORT))
            data, peer = usrv.recvfrom(16)
            usport = ucli.getsockname()[1]

            def is_udp(e):
                return e.proto == 17 and e.sport == usport and e.dport == UDP_PORT

            got = [e for e in events_until(ct, is_udp) if is_udp(e)]
            assert got[0].kind == "new" and offload_reason(got[0]) == "no reply seen"
            usrv.sendto(b"b", peer)
            ucli.recv(16)
            got = [e for e in events_until(ct, lambda e: is_udp(e) and e.status & 2) if is_udp(e)]
            assert got[-1].kind == "update" and offload_reason(got[-1]) is None
            assert ct.set_timeout(got[-1].flow, 17, 99)
            assert 90 <= entry_of(ns, "udp", UDP_PORT, usport)["timeout"] <= 99
            for s in (srv, usrv, ucli):
                s.close()
        finally:
            ct.close()


# ---- the service on the emulated NIC's flow cache ------------------------------------------------------------------


class Echo:
    """A TCP echo server in `ns` on `port` (one thread per connection) and a UDP echo server on `uport`."""

    def __init__(self, ns: str, port: int, uport: int):
        with inside(ns):
            self.srv = socket.socket()
            self.usrv = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.srv.bind(("0.0.0.0", port))
        self.srv.listen()
        self.usrv.bind(("0.0.0.0", uport))
        self.stop = False
        for fn in (self._tcp, self._udp):
            threading.Thread(target=fn, daemon=True).start()

    def _tcp(self):
        while not self.stop:
            try:
                c, _ = self.srv.accept()
            except OSError:
                return
            threading.Thread(target=self._conn, args=(c,), daemon=True).start()

    @staticmethod
    def _conn(c):
        with c:
            while data := c.recv(65536):
                c.sendall(data)

    def _udp(self):
        while not self.stop:
            try:
                data, peer = self.usrv.recvfrom(65536)
                if peer is None:  # shut down
                    return
                self.usrv.sendto(data, peer)
            except OSError:
                return

    def close(self):
        self.stop = True
        for s in (self.srv, self.usrv):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()


def talk(c: socket.socket, n: int = 5) -> None:
    for i in range(n):
        msg = b"ping %d" % i
        c.sendall(msg)
        got = b""
        while len(got) < len(msg):
            got += c.recv(64)
        assert got == msg


def hw_flows(nic) -> dict:
    return {r.flow: r for r in nic.flow_entries()}


def test_liberal_flags_of_many_entries_in_one_batch_on_real_conntrack():
    """set_liberal_many: one datagram of updates for several established TCP entries and one conntrack does not
    have; the kernel acks each (True, or False for ENOENT) and reports the flag set on exactly the existing ones,
    in both directions; an entry not in the batch keeps its flags."""
    with tracking_ns("dslb") as (ns, ct):  # closed by the test
        socks = []
        try:
            with inside(ns):
                srv = socket.socket()
                clients = [socket.socket() for _ in range(6)]
            srv.bind(("127.0.0.1", TCP_PORT))
            srv.listen()
            for c in clients:
                c.connect(("127.0.0.1", TCP_PORT))
                socks.append(srv.accept()[0])
            sports = [c.getsockname()[1] for c in clients]
            est: dict[int, CtEvent] = {}

            def all_established(e):
                if e.proto == 6 and e.dport == TCP_PORT and e.tcp_state == 3:
                    est[e.sport] = e
                return set(est) >= set(sports)

            events_until(ct, all_established)
            batch = [est[p] for p in sports[:5]]
            missing = CtEvent("update", socket.AF_INET, 6, "127.0.0.1", "127.0.0.1", 1, TCP_PORT)
            assert ct.set_liberal_many([*batch[:3], missing, *batch[3:]]) == [True] * 3 + [False] + [True] * 2
            for p in sports[:5]:
                assert all(f & 0x08 for f in liberal_flags(ns, p, TCP_PORT)), p
            assert not any(f & 0x08 for f in liberal_flags(ns, sports[5], TCP_PORT))
            assert ct.set_liberal_many([]) == [] and ct.set_liberal(est[sports[5]])
            assert all(f & 0x08 for f in liberal_flags(ns, sports[5], TCP_PORT))
        finally:
            for x in (*socks, *clients, srv):
                x.close()
            ct.close()


def _pyroute2_tuple(t) -> tuple[str, str, int, int, int] | None:
    if t is None:
        return None
    ip, proto = t.get_attr("CTA_TUPLE_IP"), t.get_attr("CTA_TUPLE_PROTO")
    if ip is None or proto is None:
        return None
    return (
        ip.get_attr("CTA_IP_V4_SRC") or ip.get_attr("CTA_IP_V6_SRC"),
        ip.get_attr("CTA_IP_V4_DST") or ip.get_attr("CTA_IP_V6_DST"),
        proto.get_attr("CTA_PROTO_NUM"),
        proto.get_attr("CTA_PROTO_SRC_PORT") or 0,
        proto.get_attr("CTA_PROTO_DST_PORT") or 0,
    )


def pyroute2_event(msg) -> CtEvent | None:
    """A ctnetlink event as pyroute2's nfct_msg decodes it (the oracle of parse_event: the decoding is pyroute2's,
    not the service's code; the decoded tuples and fields become a CtEvent as the service's own do, `from_tuples`)."""
    h = msg["header"]
    t = h["type"] & 0xFF
    if t == IPCTNL_MSG_CT_DELETE:
        kind = "destroy"
    elif t == IPCTNL_MSG_CT_NEW:
        kind = "new" if h["flags"] & (NLM_F_CREATE | NLM_F_EXCL) else "update"
    else:
        return None
    orig = _pyroute2_tuple(msg.get_attr("CTA_TUPLE_ORIG"))
    if orig is None:
        return None
    rep = _pyroute2_tuple(msg.get_attr("CTA_TUPLE_REPLY"))
    pi = msg.get_attr("CTA_PROTOINFO")
    tcp = pi.get_attr("CTA_PROTOINFO_TCP") if pi is not None else None
    flags = (
        [tcp.get_attr(k) for k in ("CTA_PROTOINFO_TCP_FLAGS_ORIGINAL", "CTA_PROTOINFO_TCP_FLAGS_REPLY")] if tcp else []
    )
    return CtEvent.from_tuples(
        kind,
        msg["nfgen_family"],
        orig,
        rep,
        status=msg.get_attr("CTA_STATUS") or 0,
        tcp_state=tcp.get_attr("CTA_PROTOINFO_TCP_STATE") if tcp is not None else None,
        timeout=msg.get_attr("CTA_TIMEOUT"),
        zone=msg.get_attr("CTA_ZONE"),
        helper=msg.get_attr("CTA_HELP") is not None,
        liberal=bool(flags) and all(f is not None and f[0] & 0x08 for f in flags),
    )


def clear_liberal(ns: str) -> None:
    """0x08 off in both directions of every TCP entry of `ns` (ctnetlink updates, flags 0 and
    mask 0x08), so that the marks the service sets can be told from what conntrack -R made."""
    from hypafilter.ops.flowsync import ctnetlink as c
    from hypafilter.ops.netlink import nla

    ct = c.Conntrack(ns)
    try:
        tcp = [e for e in ct.dump() if e.proto == 6]
        off = struct.pack("=BB", 0, 0x08)
        pi = nla(
            c.CTA_PROTOINFO,
            nla(
                c.CTA_PROTOINFO_TCP,
                nla(c.CTA_PROTOINFO_TCP_FLAGS_ORIGINAL, off) + nla(c.CTA_PROTOINFO_TCP_FLAGS_REPLY, off),
                True,
            ),
            True,
        )

        def update(seq, e):
            return c.ct_request(c.IPCTNL_MSG_CT_NEW, c.NLM_F_ACK, seq, c.ct_tuple_attr(e.flow) + pi)

        assert all(ct.acked("liberal-flag clear", update, tcp))
    finally:
        ct.close()


def test_liberal_marks_of_5000_entries_in_bounded_datagrams():
    """A resync over 5,000 established TCP entries (the xdp target's liberal marks after a worker restart): all
    5,000 updates acknowledged as done, in datagrams the socket's buffers take, and every entry liberal in both
    directions after it (entries conntrack -I makes carry the flag already: it is cleared first, so that the
    service, which does not mark an entry that is liberal already, updates all 5,000). Before, the 5,000 updates went as one datagram, the kernel refused it (EMSGSIZE, `Message
    too long`) and the supervisor restarted the worker into the same resync (issue #24)."""
    from hypafilter.ops.flowsync.marks import LiberalMarks
    from hypafilter.ops.flowsync.policy import read_timeouts
    from hypafilter.ops.flowsync.syncer import Syncer
    from hypafilter.tools.bench.ctflows import open_flows

    n = 5000
    with tracking_ns("dslm") as (ns, ct):
        try:
            src, dst = 0x0A000001, 0x0A000002
            open_flows(ns, [(6, src, dst, 10000 + k, TCP_PORT) for k in range(n)], liberal=False)
            clear_liberal(ns)
            before = tcp_flags(ns)
            print(f"flags before, cleared: {sorted(set(before.values()))}")
            assert len(before) == n and not any(o & 0x08 or r & 0x08 for o, r in before.values())
            room, most = ct.batch_room()
            print(f"batch room: {room} bytes, {most} updates a datagram")
            syncer = Syncer(table=LiberalMarks(), ct=ct, timeouts=read_timeouts(ns))
            syncer.resync(ct.dump())
            assert syncer.counters["errors"] == 0 and syncer.last_error == "", syncer.last_error
            assert syncer.counters["liberal"] == n and len(syncer.table.flows) == n
            after = tcp_flags(ns)
            assert len(after) == n and all(o & 0x08 and r & 0x08 for o, r in after.values())
        finally:
            ct.close()


def test_events_of_20000_new_entries_wait_in_the_event_socket():
    """20,000 conntrack entries made while nobody reads the event socket (as while the service resyncs over a large
    table: 10-17 s at 250,000 entries): every NEW event is still there to read, none lost. With the socket's
    buffer at 8 MiB about 6,600 fitted, the rest were lost (ENOBUFS) and the service would resync again, during
    which more events come (issue #24)."""
    from hypafilter.tools.bench.ctflows import open_flows

    n = 20000
    with tracking_ns("dsev") as (ns, ct):
        try:
            open_flows(ns, [(17, 0x0A000000 + k, 0x0A800001, 1000 + k % 50000, UDP_PORT) for k in range(n)], False)
            got = ct.read_events()
            assert sum(e.kind == "new" for e in got) == n, len(got)
        finally:
            ct.close()


def test_events_stashed_between_the_parts_of_a_long_piece_of_work_are_all_read():
    """The event socket shrunk to about 200 events' room: 5,000 entries made 50 at a time (the events of a
    flow sync resync's seconds), `Conntrack.stash` between the batches (as the dump's receive loop and the resync
    call it): every NEW event is read, in order, and none lost; without the stash the same overflows (ENOBUFS)."""
    from hypafilter.tools.bench.ctflows import _ip

    def make(ns: str, first: int, n: int) -> None:
        lines = [
            f"-I -s {_ip(0x0A000000 + k)} -d 10.128.0.1 -r 10.128.0.1 -q {_ip(0x0A000000 + k)} -p udp --sport 1000"
            f" --dport {UDP_PORT} --reply-port-src {UDP_PORT} --reply-port-dst 1000 -t 600 -u SEEN_REPLY,ASSURED"
            for k in range(first, first + n)
        ]
        with tempfile.NamedTemporaryFile("w", suffix=".ct") as f:
            f.write("\n".join(lines) + "\n")
            f.flush()
            netns.run(["conntrack", "-R", f.name], ns)

    for stash in (True, False):
        with tracking_ns("dsst") as (ns, ct):
            try:
                ct.events.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 128 << 10)  # a few hundred events
                for k in range(0, 5000, 50):
                    make(ns, k, 50)
                    if stash:
                        ct.stash()
                if stash:
                    got = ct.read_events()
                    assert [e.src for e in got if e.kind == "new"] == [_ip(0x0A000000 + k) for k in range(5000)]
                else:
                    with pytest.raises(OSError) as e:
                        ct.read_events()
                    assert e.value.errno == errno.ENOBUFS
            finally:
                ct.close()


def test_lean_event_parser_reads_real_events_as_pyroute2_does():
    """parse_event (struct, what the service reads events with) against pyroute2's nfct_msg (`pyroute2_event`), on
    the raw events of real TCP and UDP flows over IPv4 and IPv6: new, updates, destroys; every message the same."""
    from pyroute2.netlink import NETLINK_NETFILTER
    from pyroute2.netlink.nfnetlink.nfctsocket import AsyncNFCTSocket
    from pyroute2.netlink.nlsocket import Marshal

    marshal = Marshal()
    marshal.msg_map.update(AsyncNFCTSocket.policy)
    with scratch_netns("dslp", "iptables", "ip6tables") as ns:
        netns.run(["ip", "link", "set", "lo", "up"], ns)
        for tool in ("iptables", "ip6tables"):
            netns.run([tool, "-w", "-A", "INPUT", "-m", "conntrack", "--ctstate", "ESTABLISHED", "-j", "ACCEPT"], ns)
        with inside(ns):
            evs = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)
            evs.bind((0, GROUPS))
            for fam, host in ((socket.AF_INET, "127.0.0.1"), (socket.AF_INET6, "::1")):
                srv = socket.socket(fam)
                srv.bind((host, TCP_PORT))
                srv.listen()
                c = socket.socket(fam)
                c.connect((host, TCP_PORT))
                a = srv.accept()[0]
                c.sendall(b"ping")
                a.recv(10)
                a.sendall(b"pong")
                c.recv(10)
                c.close()
                a.close()
                srv.close()
                u, r = socket.socket(fam, socket.SOCK_DGRAM), socket.socket(fam, socket.SOCK_DGRAM)
                r.bind((host, UDP_PORT))
                u.sendto(b"x", (host, UDP_PORT))
                _, peer = r.recvfrom(10)
                r.sendto(b"y", peer)
                u.recvfrom(10)
                u.close()
                r.close()
        flush_conntrack(ns)  # the destroys
        time.sleep(0.3)
        evs.setblocking(False)
        pairs = []
        with contextlib.suppress(BlockingIOError):
            while True:
                data = evs.recv(1 << 20)
                off = 0
                for msg in marshal.parse(data):
                    pairs.append((pyroute2_event(msg), parse_event(data, off)))
                    off += msg["header"]["length"]
        evs.close()
    got = [a for a, _ in pairs]
    assert [a for a, b in pairs if a != b] == [] and len(pairs) > 10
    assert {(e.family, e.proto, e.kind) for e in got} >= {
        (f, p, k) for f in (socket.AF_INET, socket.AF_INET6) for p in (6, 17) for k in ("new", "update", "destroy")
    }
    assert any(e.tcp_state == 3 for e in got) and any(e.timeout for e in got)


TCP_STATE_NAMES = {  # conntrack -L's names of the TCP states (nf_conntrack_tcp.h's order)
    1: "SYN_SENT",
    2: "SYN_RECV",
    3: "ESTABLISHED",
    4: "FIN_WAIT",
    5: "CLOSE_WAIT",
    6: "LAST_ACK",
    7: "TIME_WAIT",
    8: "CLOSE",
    9: "SYN_SENT2",
}


def conntrack_entries(ns: str) -> dict[tuple, dict]:
    """Every IPv4 entry as `conntrack -L` (conntrack-tools) prints it, by original tuple (proto, src, dst, sport,
    dport): its timeout, TCP state name, reply tuple and the [ASSURED] / [UNREPLIED] marks."""
    out = {}
    for line in netns.run(["conntrack", "-L", "-f", "ipv4"], ns).splitlines():
        f = line.split()
        if len(f) < 4 or not f[2].isdigit():
            continue
        kv = re.findall(r"(src|dst|sport|dport)=(\S+)", line)
        orig, rep = dict(kv[:4]), dict(kv[4:8])
        key = (int(f[1]), orig["src"], orig["dst"], int(orig.get("sport", 0)), int(orig.get("dport", 0)))
        assert key not in out, line
        out[key] = {
            "timeout": int(f[2]),
            "state": None if f[3].startswith("src=") else f[3],
            "reply": (rep["src"], rep["dst"], int(rep.get("sport", 0)), int(rep.get("dport", 0))),
            "assured": "[ASSURED]" in line,
            "unreplied": "[UNREPLIED]" in line,
        }
    return out


def test_dump_and_get_read_real_entries_as_conntrack_lists_them():
    """Conntrack.dump and Conntrack.get (raw ctnetlink replies through parse_event) against `conntrack -L` on real
    entries: TCP established, in TIME_WAIT and SYN_SENT (a SYN dropped), UDP answered and not, and enough UDP
    entries (300) that the dump comes in several multipart datagrams; every entry, its reply tuple, TCP state,
    timeout and status marks the same. A get of an entry conntrack lacks is None; a request conntrack refuses
    raises ConntrackError with its errno."""
    with tracking_ns("mdump") as (ns, ct):  # closed by the test
        socks: list[socket.socket] = []
        try:
            netns.run(["iptables", "-w", "-A", "INPUT", "-p", "tcp", "--dport", "7009", "--syn", "-j", "DROP"], ns)
            with inside(ns):
                srv = socket.socket()
                clients = [socket.socket() for _ in range(4)]
                syn = socket.socket()
                u, r = (
                    socket.socket(socket.AF_INET, socket.SOCK_DGRAM),
                    socket.socket(socket.AF_INET, socket.SOCK_DGRAM),
                )
            socks += [srv, *clients, syn, u, r]
            srv.bind(("127.0.0.1", TCP_PORT))
            srv.listen()
            accepted = []
            for c in clients:
                c.connect(("127.0.0.1", TCP_PORT))
                accepted.append(srv.accept()[0])
                c.sendall(b"x")
                accepted[-1].recv(1)
            socks += accepted
            clients[0].close()  # one goes to TIME_WAIT: both ends close
            accepted[0].close()
            syn.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                syn.connect(("127.0.0.1", 7009))
            r.bind(("127.0.0.1", UDP_PORT))
            u.sendto(b"q", ("127.0.0.1", UDP_PORT))
            _, peer = r.recvfrom(10)
            r.sendto(b"a", peer)
            u.recv(10)
            for port in range(20000, 20300):  # one-way: UNREPLIED
                u.sendto(b"o", ("127.0.0.1", port))
            time.sleep(0.3)

            dumped = ct.dump()
            listed = conntrack_entries(ns)
            by_key = {(e.proto, e.src, e.dst, e.sport, e.dport): e for e in dumped}
            assert len(by_key) == len(dumped) > 300
            assert set(by_key) == set(listed)
            states = set()
            for key, want in listed.items():
                e = by_key[key]
                assert e.kind == "dump" and e.family == socket.AF_INET, e
                assert e.reply == want["reply"], (e, want)
                assert (TCP_STATE_NAMES.get(e.tcp_state) if e.proto == 6 else None) == want["state"], (e, want)
                assert 0 <= e.timeout - want["timeout"] <= 2, (e, want)  # conntrack -L listed it a moment later
                assert bool(e.status & IPS_ASSURED) == want["assured"], (e, want)
                assert (not e.status & IPS_SEEN_REPLY) == want["unreplied"], (e, want)
                states.add(want["state"])
            assert {"ESTABLISHED", "TIME_WAIT", "SYN_SENT", None} <= states, states

            # get: each entry as the dump has it (the timeout may have moved on by a second)
            for key in [k for k in listed if k[0] == 6] + [(17, "127.0.0.1", "127.0.0.1", u.getsockname()[1], 20123)]:
                e = by_key[key]
                got = ct.get(e.flow)
                assert got is not None and got.kind == "dump"
                assert dataclasses.replace(got, timeout=e.timeout) == e and e.timeout - got.timeout <= 1
            absent = Flow(0x7F000001, 0x7F000001, 6, 1, TCP_PORT)
            assert ct.get(absent) is None and not ct.set_timeout(absent, 6, 60)
            # A get without a tuple: conntrack refuses it (EINVAL), and says so.
            with pytest.raises(ConntrackError, match=r"conntrack get: .*errno 22") as err:
                ct.request("get", IPCTNL_MSG_CT_GET, NLM_F_ACK)
            assert err.value.code == 22
            assert len(ct.dump()) == len(dumped)  # the socket still works after the error
        finally:
            for x in socks:
                x.close()
            ct.close()


def test_echoes_of_the_services_own_updates_are_skipped_others_are_read():
    """The events that the service's own entry updates cause (liberal flags, timeout) are skipped before they are
    parsed (their header names the service's request socket); an update through other sockets and the kernel's
    own events still come through."""
    with tracking_ns("dsec") as (ns, ct):  # closed by the test
        try:
            with inside(ns):
                srv, c = socket.socket(), socket.socket()
            srv.bind(("127.0.0.1", TCP_PORT))
            srv.listen()
            c.connect(("127.0.0.1", TCP_PORT))
            a = srv.accept()[0]
            sport = c.getsockname()[1]
            mine = lambda e: e.proto == 6 and e.sport == sport and e.dport == TCP_PORT  # noqa: E731
            est = [e for e in events_until(ct, lambda e: mine(e) and e.tcp_state == 3) if mine(e)][-1]
            time.sleep(0.2)
            assert not [e for e in ct.read_events() if mine(e)]
            assert ct.set_liberal_many([est]) == [True] and ct.set_timeout(est.flow, 6, 1234)
            # the same kind of update from other netlink sockets (another client's): its event is read
            other = Conntrack(ns)
            try:
                assert other.set_timeout(est.flow, 6, 999)
            finally:
                other.close()
            time.sleep(0.3)
            got = [e for e in ct.read_events() if mine(e)]
            assert [e.kind for e in got] == ["update"], got
            assert ct.echoes == 2 and len(ct.own_ports()) == 2
            # the kernel's own events (port id 0) still come through: the close
            c.close()
            a.close()
            assert events_until(ct, lambda e: mine(e) and e.tcp_state not in (None, 3))
        finally:
            for x in (c, a, srv):
                x.close()
            ct.close()


def test_service_on_the_emulated_flow_cache(lab):
    from hypafilter.config import Config
    from hypafilter.iptables.document import parse_policy
    from hypafilter.ops import deploy
    from hypafilter.targets.nic import NicClient

    need_tool("conntrack")
    need(
        hasattr(NicClient, "flow_config"),
        "NicClient has no flow cache API yet (flow_config, flow_insert, ...): it comes with issue #13's hardware part",
    )
    policy = parse_policy(POLICY, filename="established.rules", base_chain="FORWARD", config=Config())
    state = deploy.deploy(policy, deploy.site_config(Config()))
    tgt = deploy.target_of(state, Config())
    with tgt.client(state["nic"]) as nic:
        # FC_CONFIG through NicClient.flow_config() (None: reads 0). A core from before the flow cache has neither
        # the API nor the register (its address reads another register there).
        fc_config = nic.flow_config() if hasattr(nic, "flow_config") else None
    need(
        fc_config is not None,
        "the emulated NIC has no flow cache (NicClient.flow_config() missing or FC_CONFIG reads 0): the flow cache "
        "in the core and NicClient's flow API come with issue #13's hardware part",
    )
    fs = state["flowsync"]
    assert fs["wanted"] and fs["pid"], fs
    assert deploy.status()["flowsync"]["running"]
    sd = deploy.STATE_DIR
    fw, udst = deploy.NS_FW, lab.ip("recv", "hyb")
    echo = Echo(lab.ns_recv, TCP_PORT, UDP_PORT)
    try:
        with inside(lab.ns_send):
            c = socket.socket()
            u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        c.settimeout(5)
        u.settimeout(5)
        c.connect((udst, TCP_PORT))
        talk(c)
        sport = c.getsockname()[1]
        e = entry_of(fw, "tcp", TCP_PORT, sport)
        assert e and e["state"] == "ESTABLISHED"
        tflow = Flow(
            int.from_bytes(socket.inet_aton(e["src"]), "big"),
            int.from_bytes(socket.inet_aton(e["dst"]), "big"),
            6,
            sport,
            TCP_PORT,
        )
        with tgt.client(state["nic"]) as nic:
            assert wait_for(lambda: tflow in hw_flows(nic)), "the established TCP flow did not reach the hardware"
            assert all(f & 0x08 for f in liberal_flags(fw, sport, TCP_PORT))
            # Timeout refresh: conntrack's timeout cut short by hand; frames the hardware now decides (hits) must
            # make the service set it back to the established timeout, which the kernel's listing shows.
            from pyroute2.netlink.nfnetlink.nfctsocket import NFCTAttrTuple, NFCTSocket

            with inside(fw):
                s = NFCTSocket()
                s.asyncore.socket  # noqa: B018
            try:
                s.entry(
                    "set",
                    tuple_orig=NFCTAttrTuple(saddr=e["src"], daddr=e["dst"], proto=6, sport=sport, dport=TCP_PORT),
                    timeout=60,
                )
            finally:
                s.close()
            assert entry_of(fw, "tcp", TCP_PORT, sport)["timeout"] <= 60
            hits0 = hw_flows(nic)[tflow].hits
            talk(c, 20)
            assert wait_for(lambda: hw_flows(nic)[tflow].hits > hits0), "the flow's frames did not hit in hardware"
            assert wait_for(lambda: entry_of(fw, "tcp", TCP_PORT, sport)["timeout"] > 1000, timeout=5), (
                "the hardware's hits did not refresh conntrack's timeout"
            )

            # UDP: installed once the reply is seen.
            u.sendto(b"u1", (udst, UDP_PORT))
            assert u.recv(16) == b"u1"
            usport = u.getsockname()[1]
            ue = entry_of(fw, "udp", UDP_PORT, usport)
            uflow = Flow(
                int.from_bytes(socket.inet_aton(ue["src"]), "big"),
                int.from_bytes(socket.inet_aton(ue["dst"]), "big"),
                17,
                usport,
                UDP_PORT,
            )
            assert wait_for(lambda: uflow in hw_flows(nic)), "the UDP flow with a reply did not reach the hardware"

            # Restart: a new service resyncs from the dump (the stopped one cleared the table).
            SERVICE.stop(sd)
            assert hw_flows(nic) == {}
            flowsync.start(deploy.NS_FW, sd)
            assert {tflow, uflow} <= set(hw_flows(nic)), "the restarted service did not resync from the dump"

            # Close: the FINs take TCP out of ESTABLISHED and the flow leaves the hardware at LAST_ACK (the flow
            # cache itself stops hitting it at the second FIN, so the last ACK reaches conntrack: TIME_WAIT); at
            # TIME_WAIT the flow comes back until TIME_WAIT_IDLE_POLLS polls without a hit, then leaves for good.
            c.close()
            assert wait_for(lambda: (entry_of(fw, "tcp", TCP_PORT, sport) or {}).get("state") == "TIME_WAIT"), [
                (e["proto"], e["state"], e["timeout"]) for e in conntrack_list(fw)
            ]
            time.sleep(0.3)  # the last ACK, and its event read by the service (lag p50 ~1 ms)
            gone = (TIME_WAIT_IDLE_POLLS + 2) * flowsync.INTERVAL + 2
            assert wait_for(lambda: tflow not in hw_flows(nic), timeout=gone), "the closed TCP flow stayed in hardware"

            # The counters as status shows them (the state file is written at each poll: wait for the next one).
            def counted():
                st = deploy.status()["flowsync"]
                return st if st.get("deletes", 0) >= 1 and st.get("occupancy") == len(hw_flows(nic)) else None

            st = wait_for(counted, timeout=5)
            assert st, deploy.status()["flowsync"]
            assert st["running"] and st["inserts"] >= 2 and st["offloaded"] == 1, st  # the resync's two; UDP left
            assert st["lag_samples"] >= 1 and st["lag_max_ms"] is not None

            # A killed worker: the supervisor clears the table and starts another, which resyncs.
            worker = SERVICE.read_status_file(sd)["worker"]
            os.kill(worker, signal.SIGKILL)
            assert wait_for(
                lambda: (SERVICE.read_status_file(sd) or {}).get("worker") not in (None, worker)
                and SERVICE.read_status_file(sd).get("running"),
                timeout=10,
            ), "no new worker after the old one was killed"
            assert uflow in hw_flows(nic), "the new worker did not resync"
            # A killed supervisor: its worker is told (PR_SET_PDEATHSIG), clears the table and ends; the service
            # is down, which status reports as drift.
            os.kill(SERVICE.running_pid(sd), signal.SIGKILL)
            assert wait_for(lambda: SERVICE.running_pid(sd) is None)
            assert wait_for(lambda: hw_flows(nic) == {}), "flows stayed in the hardware without a service"
            assert any(d.startswith("flowsync:") for d in deploy.drift(deploy.read_state()))
        u.close()
    finally:
        echo.close()
    deploy.undeploy()
    assert SERVICE.running_pid(sd) is None and not SERVICE.pid_path(sd).exists()


def test_no_service_without_a_flow_cache_or_a_conntrack_policy(lab):
    """Deploy says why the service does not run, and nothing runs: a policy that does not read conntrack, or a NIC
    without a flow cache."""
    from hypafilter.config import Config
    from hypafilter.iptables.document import parse_policy
    from hypafilter.ops import deploy

    plain = stateless_policy()
    state = deploy.deploy(plain, deploy.site_config(Config()))
    assert state["flowsync"] == {
        "wanted": False,
        "mode": "flowcache",
        "reason": "the policy's hardware entries do not read conntrack state",
    }
    assert SERVICE.running_pid(deploy.STATE_DIR) is None
    st = deploy.status()
    assert not st["flowsync"]["wanted"] and not any(d.startswith("flowsync") for d in st["drift"])
    ctpol = parse_policy(POLICY, filename="established.rules", base_chain="FORWARD", config=Config())
    state = deploy.deploy(ctpol, deploy.site_config(Config()))
    with deploy.target_of(state, Config()).client(state["nic"]) as nic:
        has_fc = hasattr(nic, "flow_config") and nic.flow_config() is not None
    if has_fc:
        assert state["flowsync"]["wanted"] and SERVICE.running_pid(deploy.STATE_DIR) == state["flowsync"]["pid"]
    else:
        assert not state["flowsync"]["wanted"] and "flow cache" in state["flowsync"]["reason"]
        assert SERVICE.running_pid(deploy.STATE_DIR) is None
    deploy.undeploy()
    assert SERVICE.running_pid(deploy.STATE_DIR) is None


def test_lab_flush_conntrack_empties_the_roles_namespace():
    """Lab.flush_conntrack (verify runs it between runs) flushes the role's namespace: pyroute2 opens its socket
    lazily, and it used to be opened (and the flush done) in the caller's namespace instead."""
    from hypafilter.ops.lab import Lab

    need_root()
    need_tool("ip", "iptables", "conntrack")
    lab, role = Lab("dflush"), "fw"
    ns = lab.ns(role)
    netns.delete(ns)
    netns.add(ns)
    try:
        netns.run(["ip", "link", "set", "lo", "up"], ns)
        netns.run(["iptables", "-w", "-A", "INPUT", "-m", "conntrack", "--ctstate", "NEW", "-j", "ACCEPT"], ns)
        with inside(ns):
            u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        with u:
            u.sendto(b"x", ("127.0.0.1", UDP_PORT))
        assert entry_of(ns, "udp", UDP_PORT) is not None
        lab.flush_conntrack(role)
        assert entry_of(ns, "udp", UDP_PORT) is None
    finally:
        netns.delete(ns)


def test_emulated_nic_survives_a_client_closing_as_another_connects(lab):
    """Deploy closes its last NIC connection and opens the flow sync check's at once; the emulator used to accept
    the new client in the poll round where the old one's close was served, erase a poll entry past the end and
    die (munmap_chunk(): invalid pointer). Found by this feature's deploy; the loop accepts after serving now."""
    from hypafilter.config import Config
    from hypafilter.ops import deploy
    from hypafilter.targets.nic import EmuTransport

    policy = stateless_policy()
    state = deploy.deploy(policy, deploy.site_config(Config()))
    tgt, path = deploy.target_of(state, Config()), state["nic"]["socket"]
    for _ in range(20):
        a = socket.socket(socket.AF_UNIX)
        a.connect(path)
        a.close()
        b = EmuTransport(path, timeout=5)
        try:
            assert b.read(0) == 0x48594641  # the ID register
        finally:
            b.close()
    assert tgt.alive(state["nic"])
    deploy.undeploy()


def test_verify_after_a_flush_the_lagging_service_has_not_read(lab, tmp_path):
    """verify flushes conntrack on both paths before its frames; the NIC's flow cache loses the flushed flows only
    once the sync service has read their destroy events. A frame of such a flow still cached is a hit, which the
    policy's ESTABLISHED entry accepts in hardware while the flushed kernel sees NEW and drops it (`make fuzz`,
    policy seed 14, found it with the service merely slow). Here the service is stopped (SIGSTOP) while verify runs,
    so the lag is as long as verify: verify must still compare the frames from an empty fast path."""
    from hypafilter.config import Config
    from hypafilter.iptables.document import parse_policy
    from hypafilter.ops import deploy, verify

    need_tool("conntrack")
    config = deploy.site_config(Config())
    policy = parse_policy(POLICY, filename="established.rules", base_chain="FORWARD", config=config)
    state = deploy.deploy(policy, config)
    tgt = deploy.target_of(state, config)
    with tgt.client(state["nic"]) as nic:
        need(nic.flow_config() is not None, "the emulated NIC has no flow cache")
    src, dst = lab.ip("send", "hyb"), lab.ip("recv", "hyb")
    echo = Echo(lab.ns_recv, TCP_PORT, UDP_PORT)
    worker = None
    try:
        with inside(lab.ns_send):
            u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        with u:
            u.settimeout(5)
            u.sendto(b"u1", (dst, UDP_PORT))
            assert u.recv(16) == b"u1"
            sport = u.getsockname()[1]
        flow = Flow(
            int.from_bytes(socket.inet_aton(src), "big"),
            int.from_bytes(socket.inet_aton(dst), "big"),
            17,
            sport,
            UDP_PORT,
        )
        with tgt.client(state["nic"]) as nic:
            assert wait_for(lambda: flow in hw_flows(nic)), "the UDP flow with a reply did not reach the hardware"
        worker = SERVICE.read_status_file(deploy.STATE_DIR)["worker"]
        os.kill(worker, signal.SIGSTOP)
        # The reply direction: once conntrack is flushed it is a NEW datagram to the sender's port, which the
        # policy drops; the stale cache entry would make it an ESTABLISHED hit accepted in hardware.
        trace = tmp_path / "reply.trace"
        trace.write_text(f"{flow.dst} {flow.src} {UDP_PORT} {sport} 17 0\n")
        report = verify.verify(policy, config, packets=20, trace=str(trace), malformed=0.0)
        assert report["mismatches"] == 0, report.get("examples", [])[:3]
        with tgt.client(state["nic"]) as nic:
            assert flow not in hw_flows(nic)
    finally:
        if worker:
            os.kill(worker, signal.SIGCONT)
        echo.close()
    deploy.undeploy()
