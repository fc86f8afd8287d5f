"""nf_tables change events (include/uapi/linux/netfilter/nf_tables.h) on the generic `ops.netlink.Netlink`: every
committed transaction is multicast to NFNLGRP_NFTABLES as its objects' messages, closed by NFT_MSG_NEWGEN with the
new generation id and the committing process (pid, name). iptables-nft commits through the same path, so an
`iptables -I`, an `iptables-restore` (ufw, fail2ban, Docker) and an `nft` command all show here; legacy xtables
sends nothing (ops.policysync.live.backend refuses it)."""

from __future__ import annotations

import socket
import struct
from dataclasses import dataclass

from hypafilter.ops.netlink import NETLINK_NETFILTER, NLM_F_ACK, Netlink, NetlinkError, attrs, nfnl_request

NFNL_SUBSYS_NFTABLES = 10
NFNLGRP_NFTABLES = 7
GROUPS = 1 << (NFNLGRP_NFTABLES - 1)
# enum nf_tables_msg_types
MSG_NAMES = {
    0: "newtable",
    2: "deltable",
    3: "newchain",
    5: "delchain",
    6: "newrule",
    8: "delrule",
    9: "newset",
    11: "delset",
    12: "newsetelem",
    14: "delsetelem",
    15: "newgen",
    18: "newobj",
    20: "delobj",
    22: "newflowtable",
    24: "delflowtable",
}
NFT_MSG_NEWGEN, NFT_MSG_GETGEN = 15, 16
NFTA_GEN_ID, NFTA_GEN_PROC_PID, NFTA_GEN_PROC_NAME = 1, 2, 3
NFTA_TABLE = 1  # the first attribute of a table, chain, rule, set, element list, object and flowtable: its table
NFTA_CHAIN_NAME, NFTA_RULE_CHAIN = 3, 2
FAMILY_NAMES = {1: "inet", 2: "ip", 3: "arp", 5: "netdev", 7: "bridge", 10: "ip6"}


class NftError(NetlinkError):
    peer = "nf_tables"


@dataclass(frozen=True)
class NftEvent:
    """One message of a committed transaction: its kind (MSG_NAMES), family name, table and chain (when it names
    them); a "newgen" closes the transaction with its generation id and the committing process."""

    kind: str
    family: str = ""
    table: str = ""
    chain: str = ""
    gen: int = 0
    pid: int = 0
    proc: str = ""


def _string(data: bytes, where: tuple[int, int] | None) -> str:
    if where is None:
        return ""
    return data[where[0] : where[1]].split(b"\0", 1)[0].decode(errors="replace")


def parse_event(data: bytes, off: int) -> NftEvent | None:
    """The event of the message at data[off:] (None: not an nf_tables change)."""
    length, mtype = struct.unpack_from("=IH", data, off)
    if mtype >> 8 != NFNL_SUBSYS_NFTABLES or (mtype & 0xFF) not in MSG_NAMES:
        return None
    kind = MSG_NAMES[mtype & 0xFF]
    family = FAMILY_NAMES.get(data[off + 16], str(data[off + 16]))
    a = attrs(data, off + 20, off + length)
    if kind == "newgen":
        gen = struct.unpack_from(">I", data, a[NFTA_GEN_ID][0])[0] if NFTA_GEN_ID in a else 0
        pid = struct.unpack_from(">I", data, a[NFTA_GEN_PROC_PID][0])[0] if NFTA_GEN_PROC_PID in a else 0
        return NftEvent(kind, gen=gen, pid=pid, proc=_string(data, a.get(NFTA_GEN_PROC_NAME)))
    chain = ""
    if kind in ("newchain", "delchain"):
        chain = _string(data, a.get(NFTA_CHAIN_NAME))
    elif kind in ("newrule", "delrule"):
        chain = _string(data, a.get(NFTA_RULE_CHAIN))
    return NftEvent(kind, family, _string(data, a.get(NFTA_TABLE)), chain)


class NfTables(Netlink):
    """nf_tables' sockets in a namespace: the change events (`read_events`; OSError ENOBUFS when some were lost)
    and the ruleset's generation (`generation`)."""

    error = NftError

    def __init__(self, ns: str | None):
        super().__init__(ns, NETLINK_NETFILTER, GROUPS)

    def read_events(self) -> list[NftEvent]:
        return self.read(parse_event)

    def generation(self) -> int:
        """The ruleset's current generation id (NFT_MSG_GETGEN)."""

        def request(seq: int) -> bytes:
            return nfnl_request(NFNL_SUBSYS_NFTABLES, NFT_MSG_GETGEN, NLM_F_ACK, seq, family=socket.AF_UNSPEC)

        got, _ = self.exchange("generation", request, parse_event)
        gens = [e.gen for e in got if e.kind == "newgen"]
        if not gens:
            raise NftError("generation", 71)  # EPROTO: no NEWGEN in the answer
        return gens[-1]
