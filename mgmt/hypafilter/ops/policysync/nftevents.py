"""nf_tables change events (include/uapi/linux/netfilter/nf_tables.h) on the generic `ops.netlink.Netlink`: every
committed transaction is multicast to NFNLGRP_NFTABLES as its objects' messages, closed by NFT_MSG_NEWGEN with the
new generation id and the committing process (pid, name). iptables-nft commits through the same path, so an
`iptables -I`, an `iptables-restore` (ufw, fail2ban, Docker) and an `nft` command all show here; legacy xtables
sends nothing (ops.policysync.live.backend refuses it)."""

from __future__ import annotations

import socket
import struct
from dataclasses import dataclass

from hypafilter.ops.netlink import (
    NETLINK_NETFILTER,
    NLM_F_ACK,
    NLM_F_DUMP,
    Netlink,
    NetlinkError,
    attrs,
    nfnl_request,
)

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


NFT_MSG_GETCHAIN = 4
NFTA_CHAIN_HOOK, NFTA_CHAIN_TYPE = 4, 7
NFTA_HOOK_HOOKNUM, NFTA_HOOK_PRIORITY = 1, 2
# the hook numbers of the ip, ip6, inet and bridge families (NF_INET_* and NF_BR_* share them)
HOOK_NAMES = {0: "prerouting", 1: "input", 2: "forward", 3: "output", 4: "postrouting", 5: "ingress"}


@dataclass(frozen=True)
class BaseChain:
    """A chain attached to a hook (`nft list chains` shows the same)."""

    family: str
    table: str
    name: str
    type: str
    hook: str
    prio: int


def parse_base_chain(data: bytes, off: int) -> BaseChain | None:
    """The chain of an NFT_MSG_NEWCHAIN message of a dump at data[off:], if it is attached to a hook."""
    length, mtype = struct.unpack_from("=IH", data, off)
    if mtype != (NFNL_SUBSYS_NFTABLES << 8 | 3):
        return None
    a = attrs(data, off + 20, off + length)
    if NFTA_CHAIN_HOOK not in a:
        return None
    h = attrs(data, *a[NFTA_CHAIN_HOOK])
    if NFTA_HOOK_HOOKNUM not in h:
        return None
    hooknum = struct.unpack_from(">I", data, h[NFTA_HOOK_HOOKNUM][0])[0]
    prio = struct.unpack_from(">i", data, h[NFTA_HOOK_PRIORITY][0])[0] if NFTA_HOOK_PRIORITY in h else 0
    return BaseChain(
        FAMILY_NAMES.get(data[off + 16], str(data[off + 16])),
        _string(data, a.get(NFTA_TABLE)),
        _string(data, a.get(NFTA_CHAIN_NAME)),
        _string(data, a.get(NFTA_CHAIN_TYPE)),
        HOOK_NAMES.get(hooknum, str(hooknum)),
        prio,
    )


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

    def base_chains(self) -> list[BaseChain]:
        """Every chain of every family attached to a hook (an NFT_MSG_GETCHAIN dump)."""

        def request(seq: int) -> bytes:
            return nfnl_request(NFNL_SUBSYS_NFTABLES, NFT_MSG_GETCHAIN, NLM_F_DUMP, seq, family=socket.AF_UNSPEC)

        return self.consistent_dump("chains", request, parse_base_chain)

    def generation(self) -> int:
        """The ruleset's current generation id (NFT_MSG_GETGEN)."""

        def request(seq: int) -> bytes:
            return nfnl_request(NFNL_SUBSYS_NFTABLES, NFT_MSG_GETGEN, NLM_F_ACK, seq, family=socket.AF_UNSPEC)

        got, _ = self.exchange("generation", request, parse_event)
        gens = [e.gen for e in got if e.kind == "newgen"]
        if not gens:
            raise NftError("generation", 71)  # EPROTO: no NEWGEN in the answer
        return gens[-1]
