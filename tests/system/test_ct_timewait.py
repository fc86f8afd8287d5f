"""Segments of a TCP connection in TIME_WAIT: the kernel is the oracle. The sync service puts a flow back into the
NIC's flow cache when conntrack takes it to TIME_WAIT (docs/flowsync.md, "What goes in, what comes out"): from
then on the hardware decides the flow's ACK segments, with or without data, in either direction, and conntrack
only hears of them through the service's timeout refresh; a SYN, FIN or RST still goes to conntrack. Whether that
changes anything the kernel alone would do is what this module asks the kernel.

With a conntrack-first policy, each path (the hybrid's and the plain one: the policy alone in netfilter) gets its
own real TCP connection from the same client port, closed by the client so that conntrack takes both entries to
TIME_WAIT; on the emulated NIC the test then waits until the service has put the TIME_WAIT flow into the flow
cache. Then crafted segments of that flow (their sequence and acknowledgement numbers from the connection's own
FINs, captured at the client) go through both paths one case at a time, hybrid first: each must arrive on the
hybrid path exactly when it arrives on the plain one, and after each case conntrack's entry must be in the same
state on both, with a timeout within a few seconds (the hybrid's is set by the service's refresh, once a poll).
On the emulated NIC the cases the flow cache looks up must be hits (the flow's hit counter moves): the test is
about the fast path, and does not pass by sending everything to software. test_xdp_ct_timewait.py runs the same on
the xdp lab, whose program leaves TIME_WAIT to conntrack (docs/xdp.md)."""

from __future__ import annotations

import contextlib
import socket
import struct
import time
from dataclasses import dataclass

import pytest
from hypafilter.config import Config
from hypafilter.iptables.document import parse_policy
from hypafilter.netns import inside
from hypafilter.ops import deploy, verify
from test_ct_invalid import craft, through_both
from test_flowsync import Echo, entry_of, hw_flows, talk, wait_for

from conftest import need, need_tool

pytestmark = pytest.mark.system

LAB = "tcw"
TCP_PORT = 7031
POLICY = (
    "*filter\n:FORWARD DROP [0:0]\n"
    "-A FORWARD -m conntrack --ctstate INVALID -j DROP\n"
    "-A FORWARD -m conntrack --ctstate ESTABLISHED,RELATED -j ACCEPT\n"
    f"-A FORWARD -p tcp -m tcp --dport {TCP_PORT} -j ACCEPT\n"
    "COMMIT\n"
)
FIN, SYN, RST, PSH, ACK = 0x01, 0x02, 0x04, 0x08, 0x10
DATA = bytes(range(16))
FAR = 1 << 30  # beyond any window of these connections
PATHS = (("hybrid", "hyb"), ("plain", "plain"))  # (name in through_both's answer, the lab's path key)
TIMEOUT_SLACK = 3  # seconds: the hybrid's TIME_WAIT timeout is refreshed once a poll (1 s), the plain one per packet


@dataclass(frozen=True)
class Case:
    """One crafted segment: its direction ("orig": client -> server, "reply"), flags, sequence and acknowledgement
    numbers as functions of the connection's numbers (Seqs), payload; `looked_up`: the flow cache looks it up
    (an ACK without SYN/FIN/RST, docs/hardware.md), so on the emulated NIC it must be a hit while the flow is
    offloaded; `settle`: wait first until the flow has left the flow cache (after a case that takes conntrack out of
    TIME_WAIT: the sync lag, a divergence of its own, docs/flowsync.md "The sync lag and exactness")."""

    name: str
    way: str
    flags: int
    seq: str
    ack: str
    payload: bytes = b""
    looked_up: bool = False
    settle: bool = False


@dataclass(frozen=True)
class Seqs:
    """The connection's numbers from its FINs as the client saw them: each FIN's sequence number and the
    acknowledgement it carried."""

    cfin: int
    cfin_ack: int
    sfin: int

    def value(self, what: str) -> int:
        n = {"c": self.cfin + 1, "s": self.sfin + 1, "cfin": self.cfin, "cfin_ack": self.cfin_ack}
        base, _, far = what.partition("+")
        return (n[base] + (FAR if far else 0)) & 0xFFFFFFFF


# The segments a client or server (or someone with the tuple) may send while the connection is in TIME_WAIT. Each
# list runs on a fresh connection; the ones that take conntrack out of TIME_WAIT come last.
LATE_SEGMENTS = [
    Case("ACK", "orig", ACK, "c", "s", looked_up=True),
    Case("ACK reply", "reply", ACK, "s", "c", looked_up=True),
    Case("ACK with data", "orig", ACK, "c", "s", DATA, looked_up=True),
    Case("ACK|PSH with data reply", "reply", ACK | PSH, "s", "c", DATA, looked_up=True),
    Case("FIN|ACK retransmitted", "orig", FIN | ACK, "cfin", "cfin_ack"),
    Case("ACK after the FIN", "orig", ACK, "c", "s", looked_up=True),
    Case("RST", "orig", RST, "c", "s"),
    Case("ACK after the RST", "orig", ACK, "c", "s", looked_up=True, settle=True),
]
OUT_OF_WINDOW = [
    Case("ACK", "orig", ACK, "c", "s", looked_up=True),
    Case("ACK seq out of window", "orig", ACK, "c+far", "s", looked_up=True),
    Case("ACK acking unsent data", "orig", ACK, "c", "s+far", looked_up=True),
    Case("ACK reply seq out of window", "reply", ACK, "s+far", "c", looked_up=True),
    Case("FIN|ACK seq out of window", "orig", FIN | ACK, "c+far", "s"),
    Case("RST seq out of window", "orig", RST, "c+far", "0"),
]
# Conntrack (without liberal tracking: the kernel's default) drops these as INVALID; the hybrid path delivers them:
# the flow cache looks at no sequence number, and the service sets liberal window tracking on every TCP flow it
# offloads, so the hybrid's conntrack accepts the ones it sees too (the FIN). An open divergence on the emulated NIC
# (docs/flowsync.md, "The sync lag and exactness"); the xdp lab tracks both paths liberally.
OUT_OF_WINDOW_DIVERGING = frozenset(
    {"ACK seq out of window", "ACK acking unsent data", "ACK reply seq out of window", "FIN|ACK seq out of window"}
)
REOPEN = [
    Case("ACK", "orig", ACK, "c", "s", looked_up=True),
    Case("SYN reusing the tuple", "orig", SYN, "c+far", "0"),
    Case("old ACK after the SYN", "orig", ACK, "c", "s", looked_up=True, settle=True),
]
REOPEN_REPLY = [
    Case("ACK reply", "reply", ACK, "s", "c", looked_up=True),
    Case("SYN reply direction", "reply", SYN, "s+far", "0"),
    Case("ACK after the reply SYN", "orig", ACK, "c", "s", looked_up=True, settle=True),
]


class Env:
    """The policy deployed on `target`, the same policy alone in the plain namespace, an echo server."""

    def __init__(self, lab, target: str):
        need_tool("conntrack", "iptables")
        self.lab, self.target = lab, target
        config = deploy.site_config(Config(target=target))
        if target == "xdp":  # the program decides TCP hits only under liberal tracking (docs/xdp.md); both alike
            for ns in (lab.ns_fw, lab.ns_plain):
                lab.exec_in(ns, ["sysctl", "-qw", "net.netfilter.nf_conntrack_tcp_be_liberal=1"])
        policy = parse_policy(POLICY, filename="cttimewait.rules", base_chain="FORWARD", config=config)
        self.state = deploy.deploy(policy, config, target=target)
        verify.load_oracle(lab.ns_plain, policy, config.table, config.unfilterable)
        for role in ("fw", "plain"):
            lab.flush_conntrack(role)
        self.tgt = deploy.target_of(self.state, config)
        self.echo = Echo(lab.ns_recv, TCP_PORT, TCP_PORT + 1)
        self.uid = 1

    def stop(self) -> None:
        self.echo.close()

    @contextlib.contextmanager
    def nic(self):
        if self.target != "emu":
            yield None
            return
        with self.tgt.client(self.state["nic"]) as nic:
            need(nic.flow_config() is not None, "the emulated NIC has no flow cache")
            yield nic

    def entries(self, cport: int) -> dict[str, dict | None]:
        return {
            p: entry_of(ns, "tcp", TCP_PORT, cport)
            for p, ns in (("hybrid", self.lab.ns_fw), ("plain", self.lab.ns_plain))
        }

    def close(self, cport: int, hold: bool = True) -> dict[str, Seqs]:
        """A real connection from `cport` on each path, some data, closed by the client; returns each path's FIN
        numbers once conntrack holds the plain path's entry in TIME_WAIT and the hybrid's is past the FINs.

        With `hold` the client's ACK of the server's FIN is held back in the sender's OUTPUT once (the server sends
        its FIN again a retransmission timeout later, and the client acks that): the first ACK follows the FIN by one
        trip through the client, less than the service takes to remove the flow conntrack just took to LAST_ACK, so
        it hits and the hybrid's conntrack stays in LAST_ACK (test_a_normal_close); held, both paths see the same
        close and reach TIME_WAIT."""
        lab = self.lab
        rule = ["-p", "tcp", "--sport", str(cport), "--tcp-flags", "ALL", "ACK", "-j", "DROP"]
        caps = {p: verify.raw_socket(lab.ns_send, f"{k}0") for p, k in PATHS}
        socks = []
        try:
            for path in ("hyb", "plain"):
                with inside(lab.ns_send):
                    c = socket.socket()
                socks.append(c)
                c.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                c.settimeout(5)
                c.bind((lab.ip("send", path), cport))
                c.connect((lab.ip("recv", path), TCP_PORT))
                talk(c)
            time.sleep(0.3)  # the delayed ACKs of the last echo go out before the hold
            for cap in caps.values():
                verify.drain(cap)
            if hold:
                lab.exec_in(lab.ns_send, ["iptables", "-w", "-I", "OUTPUT", *rule])
            try:
                for c in socks:
                    c.close()
                time.sleep(0.1)
            finally:
                if hold:
                    lab.exec_in(lab.ns_send, ["iptables", "-w", "-D", "OUTPUT", *rule])

            def closed():
                e = self.entries(cport)
                return (
                    e["plain"]
                    and e["plain"]["state"] == "TIME_WAIT"
                    and e["hybrid"]
                    and e["hybrid"]["state"]
                    in (
                        "TIME_WAIT",
                        "LAST_ACK",
                    )
                )

            assert wait_for(closed, timeout=10), f"conntrack did not see the close: {self.entries(cport)}"
            return {p: fins(caps[p], lab.ip("send", k), cport) for p, k in PATHS}
        finally:
            for cap in caps.values():
                cap.close()
            for c in socks:
                c.close()

    def run(self, cport: int, cases: list[Case]) -> list[dict]:
        """`cases` on a connection from `cport` in TIME_WAIT, through both paths: one record per case."""
        lab, seqs = self.lab, self.close(cport)
        assert wait_for(lambda: all(e and e["state"] == "TIME_WAIT" for e in self.entries(cport).values())), (
            f"conntrack did not reach TIME_WAIT on both paths: {self.entries(cport)}"
        )
        out, near = [], []
        with self.nic() as nic:
            if nic is not None:
                assert wait_for(lambda: flow_of(nic, cport, near) is not None, timeout=5), (
                    "the TIME_WAIT flow did not reach the flow cache"
                )
            for case in cases:
                if case.settle and nic is not None:
                    assert wait_for(lambda: flow_of(nic, cport) is None, timeout=5), (
                        f"{case.name}: flow still offloaded"
                    )
                frames: dict[str, list] = {}
                ids = {}
                for path, key in PATHS:
                    cl, sv = lab.ip("send", key), lab.ip("recv", key)
                    a, b, pa, pb = (cl, sv, cport, TCP_PORT) if case.way == "orig" else (sv, cl, TCP_PORT, cport)
                    how = {"flags": case.flags, "payload": case.payload, "seq": seqs[path].value(case.seq)}
                    how["ack"] = 0 if case.ack == "0" else seqs[path].value(case.ack)
                    frames[path] = [(self.uid, craft(self.uid, a, b, pa, pb, 6, how), case.way)]
                    ids[path] = self.uid
                    self.uid += 1
                t0 = time.monotonic()
                before = flow_of(nic, cport, near) if nic is not None else None
                got = through_both(lab, frames, quiet=0.15)
                after = flow_of(nic, cport, near) if nic is not None else None
                hit = None
                if nic is not None:
                    hit = bool(after and before and after.slot == before.slot and after.hits > before.hits)
                out.append(
                    {
                        "case": case,
                        "hybrid": ids["hybrid"] in got["hybrid"],
                        "plain": ids["plain"] in got["plain"],
                        "hit": hit,
                        "ct": self.entries(cport),
                        "offloaded": before is not None,
                        "s": round(time.monotonic() - t0, 2),
                    }
                )
        return out


def fins(cap: socket.socket, client: str, cport: int) -> Seqs:
    """The sequence numbers of the client's and the server's FIN among the frames `cap` saw (both directions)."""
    cfin = sfin = None
    deadline = time.monotonic() + 2
    while (cfin is None or sfin is None) and time.monotonic() < deadline:
        try:
            f = cap.recv(65536)
        except BlockingIOError:
            time.sleep(0.01)
            continue
        if len(f) < 54 or f[12:14] != b"\x08\x00" or f[23] != 6:
            continue
        l4 = 14 + (f[14] & 0xF) * 4
        sport, dport, seq, ack, _, flags = struct.unpack("!HHIIBB", f[l4 : l4 + 14])
        if not flags & FIN:
            continue
        if socket.inet_ntoa(f[26:30]) == client and sport == cport:
            cfin = (seq, ack)
        elif dport == cport and sport == TCP_PORT:
            sfin = seq
    assert cfin is not None and sfin is not None, "the connection's FINs were not captured"
    return Seqs(cfin[0], cfin[1], sfin)


def flow_of(nic, cport: int, near: list | None = None):
    """The flow-cache record of the hybrid path's connection from `cport` (its original direction), or None. With
    `near` (a list the caller keeps): its slot is read first (one slot, not the whole table, so the cases follow each
    other as fast as a flow's idle polls require) and remembered there."""
    if near:
        for rec in nic.flow_entries(near[-1:]):
            if rec.flow.proto == 6 and rec.flow.sport == cport and rec.flow.dport == TCP_PORT:
                return rec
    for flow, rec in hw_flows(nic).items():
        if flow.proto == 6 and flow.sport == cport and flow.dport == TCP_PORT:
            if near is not None:
                near.append(rec.slot)
            return rec
    return None


def table(records: list[dict]) -> str:
    rows = []
    for r in records:
        ct = {p: (e["state"], e["timeout"]) if e else None for p, e in r["ct"].items()}
        rows.append(f"  {r['case'].name}: hybrid {r['hybrid']} plain {r['plain']} hit {r['hit']} ct {ct} ({r['s']} s)")
    return "\n".join(rows)


def check(records: list[dict], target: str, diverging: frozenset[str] = frozenset()) -> None:
    """Each case's fate and conntrack's entry after it the same on both paths (but the `diverging` cases' fates,
    which must differ: an open divergence, shown); on the emulated NIC, every looked-up case of an offloaded flow a
    hit."""
    print(f"\n{target}:\n{table(records)}")
    for r in records:
        c, what = r["case"], f"{r['case'].name}\n{table(records)}"
        if c.name in diverging:  # the kernel drops it (checked, not assumed), the hybrid path does not
            assert not r["plain"], f"the policy alone accepted it: {what}"
            assert r["hybrid"], f"no longer diverges (make it a plain case): {what}"
        else:
            assert r["hybrid"] == r["plain"], f"fates differ: {what}"
        h, p = r["ct"]["hybrid"], r["ct"]["plain"]
        assert (h is None) == (p is None), f"conntrack entry on one path only: {what}"
        if h is not None:
            assert h["state"] == p["state"], f"conntrack states differ: {what}"
            if not diverging:  # an INVALID segment does not touch the plain entry's timeout, a hit refreshes it
                assert abs(h["timeout"] - p["timeout"]) <= TIMEOUT_SLACK, f"conntrack timeouts differ: {what}"
        if target == "emu" and c.looked_up and not c.settle:
            assert r["offloaded"] and r["hit"], f"not decided by the flow cache: {what}"


@pytest.fixture(scope="module")
def env(lab):
    e = Env(lab, getattr(lab, "target", "emu"))
    yield e
    e.stop()


def test_late_segments_of_a_closed_connection(env):
    """ACKs with and without data in both directions, the FIN again, an RST: what the kernel alone does."""
    check(env.run(41031, LATE_SEGMENTS), env.target)


def test_syn_reusing_the_tuple(env):
    """A SYN from the client reopens the tuple (conntrack destroys the TIME_WAIT entry and tracks a new
    connection), and the old connection's ACK then meets the new entry."""
    check(env.run(41032, REOPEN), env.target)


def test_syn_from_the_server(env):
    """A SYN from the server side of the tuple: conntrack destroys the TIME_WAIT entry, the new connection it would
    open is not allowed; the client's next ACK then starts an entry of its own (loose pickup)."""
    check(env.run(41033, REOPEN_REPLY), env.target)


def test_out_of_window_segments(env):
    """Segments whose sequence or acknowledgement number is far outside the window: INVALID to conntrack without
    liberal tracking. On the emulated NIC an open divergence (OUT_OF_WINDOW_DIVERGING), kept honest: once a change
    closes it this fails, and the cases become plain ones."""
    diverging = OUT_OF_WINDOW_DIVERGING if env.target == "emu" else frozenset()
    check(env.run(41034, OUT_OF_WINDOW), env.target, diverging)


NORMAL_CLOSES = range(41040, 41056)  # the race it checks was lost in 40-90 % of closes before the closing count
LAST_ACK_TIMEOUT = 3  # seconds, on both paths for test_a_normal_close (the kernel's default: 30)


def test_a_normal_close(env):
    """Connections closed as TCP closes them (the client's FIN, the server's FIN, the client's ACK at once): the
    kernel alone takes every entry to TIME_WAIT, and so must the hybrid. On the emulated NIC the last ACK follows the
    server's FIN by one trip through the client, less than the service takes to remove the flow conntrack just took
    to LAST_ACK: it used to hit, conntrack never saw it and the entry stayed in LAST_ACK (30 s, not 120 s). The flow
    cache now stops hitting an entry at its second FIN itself (hf_flow_cache's closing count, docs/flowsync.md "The
    sync lag and exactness"). The xdp program leaves LAST_ACK to conntrack.

    What a LAST_ACK left behind cost: once LAST_ACK's timeout has passed (shortened to LAST_ACK_TIMEOUT on both
    paths), a late segment from the server (an ACK) found no entry on the hybrid path and was a new connection the
    policy does not allow, where the kernel alone still has the entry in TIME_WAIT and lets it through: checked."""
    lab = env.lab
    key = "net.netfilter.nf_conntrack_tcp_timeout_last_ack"
    was = {ns: lab.exec_in(ns, ["sysctl", "-n", key]).strip() for ns in (lab.ns_fw, lab.ns_plain)}
    try:
        for ns in was:
            lab.exec_in(ns, ["sysctl", "-qw", f"{key}={LAST_ACK_TIMEOUT}"])
        seqs, states = {}, {}
        for c in NORMAL_CLOSES:  # each state read well within LAST_ACK_TIMEOUT of its close
            seqs[c] = env.close(c, hold=False)
            time.sleep(0.3)  # any ACK still on its way
            states[c] = {p: (e or {}).get("state") for p, e in env.entries(c).items()}
        last_ack = {c for c, s in states.items() if s["hybrid"] == "LAST_ACK"}
        print(f"\n{env.target}: hybrid entries left in LAST_ACK {len(last_ack)} of {len(states)}: {states}")
        assert all(s["plain"] == "TIME_WAIT" for s in states.values()), f"the kernel alone: {states}"
        assert all(s["hybrid"] in ("LAST_ACK", "TIME_WAIT") for s in states.values()), states
        assert not last_ack, f"conntrack states differ: {states}"
        time.sleep(LAST_ACK_TIMEOUT + 1)
        frames: dict[str, list] = {"hybrid": [], "plain": []}
        late: dict[int, int] = {}  # frame id -> client port
        for c in NORMAL_CLOSES:
            for path, k in PATHS:
                how = {"flags": ACK, "payload": b"", "seq": seqs[c][path].value("s"), "ack": seqs[c][path].value("c")}
                frame = craft(env.uid, lab.ip("recv", k), lab.ip("send", k), TCP_PORT, c, 6, how)
                frames[path].append((env.uid, frame, "reply"))
                late[env.uid] = c
                env.uid += 1
        got = through_both(lab, frames, quiet=0.3)
        delivered = {p: {late[i] for i in got[p]} for p, _ in PATHS}
        print(f"late server ACK delivered: hybrid {sorted(delivered['hybrid'])} plain {sorted(delivered['plain'])}")
        assert delivered["plain"] == set(NORMAL_CLOSES), "the kernel alone did not keep every TIME_WAIT entry"
        # the hybrid path drops exactly the late segments of the entries that stayed in LAST_ACK and expired
        assert delivered["hybrid"] == set(NORMAL_CLOSES) - last_ack
    finally:
        for ns, v in was.items():
            lab.exec_in(ns, ["sysctl", "-qw", f"{key}={v}"])


SYN_AFTER_CLOSES = range(41060, 41068)


def test_syn_after_a_normal_close(env):
    """A SYN reusing the tuple right after a normal close: the kernel alone meets it in TIME_WAIT and tracks a new
    connection (SYN_SENT), and so must the hybrid's: had its entry stayed in LAST_ACK (test_a_normal_close), conntrack
    would ignore the SYN there and the entry would stay in LAST_ACK."""
    lab = env.lab
    rows = {}
    for c in SYN_AFTER_CLOSES:
        seqs = env.close(c, hold=False)
        time.sleep(0.3)  # any ACK still on its way
        closed = {p: (e or {}).get("state") for p, e in env.entries(c).items()}
        frames: dict[str, list] = {}
        for path, k in PATHS:
            how = {"flags": SYN, "payload": b"", "seq": seqs[path].value("c+far"), "ack": 0}
            frames[path] = [
                (env.uid, craft(env.uid, lab.ip("send", k), lab.ip("recv", k), c, TCP_PORT, 6, how), "orig")
            ]
            env.uid += 1
        got = through_both(lab, frames, quiet=0.15)
        after = {p: (e or {}).get("state") for p, e in env.entries(c).items()}
        rows[c] = {"closed": closed, "delivered": {p: bool(got[p]) for p, _ in PATHS}, "after": after}
    print(f"\n{env.target}: {rows}")
    for c, r in rows.items():
        assert r["closed"]["plain"] == "TIME_WAIT" and r["after"]["plain"] == "SYN_SENT", f"the kernel alone: {r}"
        assert r["delivered"]["hybrid"] == r["delivered"]["plain"], f"fates differ: {c} {r}"
    diverged = {c for c, r in rows.items() if r["after"]["hybrid"] != r["after"]["plain"]}
    last_ack = {c for c, r in rows.items() if r["closed"]["hybrid"] == "LAST_ACK"}
    assert not last_ack and not diverged, rows
