"""Conntrack entries as the flow sync service sees them (`CtEvent`: an event or a dump line) and the install rule
(`offload_reason`): which entries' established frames the hardware may decide. Pure."""

from __future__ import annotations

import functools
import socket
from dataclasses import dataclass

from hypafilter.hw.flowcache import PROTO_TCP, PROTO_UDP, Flow, Flow6

# Conntrack's status bits and TCP states (include/uapi/linux/netfilter/nf_conntrack_common.h, nf_conntrack_tcp.h)
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
# (syncer.TIME_WAIT_IDLE_POLLS).
TCP_OFFLOAD_STATES = {
    TCP_CONNTRACK_ESTABLISHED: "established",
    TCP_CONNTRACK_FIN_WAIT: "fin_wait",
    TCP_CONNTRACK_CLOSE_WAIT: "close_wait",
    TCP_CONNTRACK_TIME_WAIT: "time_wait",
}


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
    # IP_CT_TCP_FLAG_BE_LIBERAL in both directions' TCP flags as the message reports them (False when it carries
    # no TCP protoinfo): the flow sync service's mark, which it does not set twice
    liberal: bool = False

    @classmethod
    def from_tuples(cls, kind: str, family: int, orig: tuple, rep: tuple | None, **rest) -> CtEvent:
        """The entry of the original and reply tuples (src, dst, proto, sport, dport) as the codec reads them
        (reply None: absent); `rest`: the other fields (status, tcp_state, timeout, zone, helper, liberal)."""
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

    @functools.cached_property
    def flow(self) -> Flow | Flow6 | None:
        """The flow (original direction): `Flow` for IPv4, `Flow6` for IPv6; None for what no table holds (not
        TCP/UDP, another family). Whether a table holds the family is the table's (`families`: the NIC's flow cache
        IPv6 too on a dual-stack core). Made once per entry (a resync over 250,000 entries asks for it several times each)."""
        if self.proto not in (PROTO_TCP, PROTO_UDP):
            return None
        if self.family == socket.AF_INET:
            return Flow(_ipv4(self.src), _ipv4(self.dst), self.proto, self.sport, self.dport)
        if self.family == socket.AF_INET6:
            return Flow6(_ipv6(self.src), _ipv6(self.dst), self.proto, self.sport, self.dport)
        return None


def _ipv4(text: str) -> int:
    """A dotted IPv4 address as an integer (inet_aton: a tenth of ipaddress.IPv4Address's time)."""
    return int.from_bytes(socket.inet_aton(text), "big")


def _ipv6(text: str) -> int:
    return int.from_bytes(socket.inet_pton(socket.AF_INET6, text), "big")


def offload_reason(ev: CtEvent) -> str | None:
    """None when the entry's established frames may be decided by the hardware; else why not.

    TCP: ESTABLISHED (protoinfo state), confirmed and seen a reply. UDP: confirmed and seen a reply. Never: not
    TCP/UDP over IPv4 or IPv6 (whether the table holds the family is the table's: `Syncer.wants`), NAT (the
    reply is not the original reversed: the one hardware key covers both directions only without it), a helper (it must see every packet to create its expectations), a zone other than 0 (the key has
    no zone), an entry dying, a template, untracked, or offloaded to a kernel flowtable."""
    if ev.kind == "destroy":
        return "destroyed"
    if ev.flow is None:
        return "not TCP/UDP over IPv4 or IPv6"
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
