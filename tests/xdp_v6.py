"""IPv6 on the xdp target before the IR and verify -6 land (docs/ipv6.md "## xdp"): a family-6 plan from hand-made IR
and IPv6 frames of every extension-header shape.

`ranked_plan(rules)` makes, from rules over 128-bit prefixes, both the ip6tables-save text (the kernel's oracle) and
the plan `build_plan` gives for the ranked policy (each address dimension cut at the rules' prefix boundaries, every
prefix a range of ranks, the ranked policy written as an ordinary IPv4 policy whose addresses are the ranks), with
`plan.family = 6` and `plan.addr_map` as the contract's `ir.family.compress` gives them. To be replaced by the IR
engineer's parser and compress once they are merged."""

from __future__ import annotations

import bisect
import ipaddress
import random
import struct
from dataclasses import dataclass

TOP = (1 << 128) - 1


@dataclass(frozen=True)
class Rule6:
    src: str | None = None  # an IPv6 prefix
    dst: str | None = None
    proto: str | None = None  # tcp, udp, icmpv6 (ipv6-icmp), esp, or a number
    dport: tuple[int, int] | None = None
    icmp6: int | None = None  # an ICMPv6 type
    target: str = "ACCEPT"
    complex_: bool = False  # a match the fast path leaves to the kernel (string; the same in both texts)


class AddrMap:
    """The contract's AddrMap: per address dimension the sorted 128-bit starts of the elementary intervals."""

    def __init__(self, starts: dict[str, list[int]]):
        self.starts = starts

    def rank(self, dim: str, addr: int) -> int:
        return bisect.bisect_right(self.starts[dim], addr) - 1


def _prefix(p: str | None) -> tuple[int, int]:
    if p is None:
        return 0, TOP
    n = ipaddress.IPv6Network(p)
    return int(n.network_address), int(n.broadcast_address)


PROTO = {"tcp": 6, "udp": 17, "icmpv6": 58, "esp": 50}


def texts(rules: list[Rule6], policy: str = "DROP") -> tuple[str, str, AddrMap]:
    """(ip6tables-save text, the ranked policy as an iptables-save text, AddrMap)."""
    starts = {}
    for i, dim in enumerate(("src", "dst")):
        cut = {0}
        for r in rules:
            lo, hi = _prefix((r.src, r.dst)[i])
            cut.add(lo)
            if hi < TOP:
                cut.add(hi + 1)
        starts[dim] = sorted(cut)
    amap = AddrMap(starts)
    v6, v4 = ["*filter", f":FORWARD {policy} [0:0]"], ["*filter", f":FORWARD {policy} [0:0]"]
    for r in rules:
        a6, a4 = ["-A FORWARD"], ["-A FORWARD"]
        rng = []
        for dim, p, flag in (("src", r.src, "-s"), ("dst", r.dst, "-d")):
            if p is None:
                continue
            a6.append(f"{flag} {p}")
            lo, hi = _prefix(p)
            rlo, rhi = amap.rank(dim, lo), amap.rank(dim, hi)
            rng.append(f"--{dim}-range {ipaddress.IPv4Address(rlo)}-{ipaddress.IPv4Address(rhi)}")
        if rng:
            a4.append("-m iprange " + " ".join(rng))
        if r.proto:
            num = PROTO.get(r.proto, r.proto)
            a6.append(f"-p {num}")
            a4.append("-p icmp" if num == 58 else f"-p {num}")  # ICMPv6 written as ICMP (relabelled: _icmp6)
        if r.dport:
            name = "tcp" if r.proto == "tcp" else "udp"
            a6.append(f"-m {name} --dport {r.dport[0]}:{r.dport[1]}")
            a4.append(f"-m {name} --dport {r.dport[0]}:{r.dport[1]}")
        if r.icmp6 is not None:
            a6.append(f"-m icmp6 --icmpv6-type {r.icmp6}")
            a4.append(f"-m icmp --icmp-type {r.icmp6}")  # the ranked policy's icmp_type field
        if r.complex_:
            a6.append('-m string --string "hfx6" --algo bm')
            a4.append('-m string --string "hfx6" --algo bm')
        a6.append(f"-j {r.target}")
        a4.append(f"-j {r.target}")
        v6.append(" ".join(a6))
        v4.append(" ".join(a4))
    v6.append("COMMIT")
    v4.append("COMMIT")
    return "\n".join(v6) + "\n", "\n".join(v4) + "\n", amap


def ranked_plan(rules: list[Rule6], policy: str = "DROP", mode: str = "selective", index_base: int = 0):
    """(ip6tables-save text, family-6 Plan)."""
    from hypafilter.analysis.plan import build_plan
    from hypafilter.config import Config
    from hypafilter.iptables.document import parse_policy

    t6, t4, amap = texts(rules, policy)
    plan = build_plan(parse_policy(t4, "v6x-ranked"), Config(shunt_mode=mode))
    plan.entries = [_icmp6(e) for e in plan.entries]
    plan.family = 6
    plan.addr_map = amap
    plan.index_base = index_base
    return t6, plan


def _icmp6(entry):
    """The entry with protocol 1 (the ranked text's stand-in, its icmp_type field the ICMPv6 type) as 58."""
    import dataclasses

    from hypafilter.ir import FIELDS, Box

    k = FIELDS.index("proto")
    out = []
    for b in entry.boxes:
        if (b.lo[k], b.hi[k]) == (1, 1):
            lo, hi = list(b.lo), list(b.hi)
            lo[k] = hi[k] = 58
            b = Box(tuple(lo), tuple(hi), b.flags_mask, b.flags_value, b.sets_mask, b.sets_value)
        elif b.lo[k] <= 58 <= b.hi[k] and (b.lo[k], b.hi[k]) != (0, 255):
            raise ValueError("a protocol range over 58 in the ranked policy")
        out.append(b)
    return dataclasses.replace(entry, boxes=tuple(out))


# ---- frames ------------------------------------------------------------------------------------------------------

MAC = bytes.fromhex("020000000002") + bytes.fromhex("020000000001")


def _csum(data: bytes) -> int:
    if len(data) % 2:
        data += b"\0"
    s = sum(struct.unpack(f"!{len(data) // 2}H", data))
    while s >> 16:
        s = (s & 0xFFFF) + (s >> 16)
    return (~s) & 0xFFFF


def l4(proto: int, src: int, dst: int, sport=1234, dport=80, icmp=(128, 0), payload=b"x" * 8, flags=0x10) -> bytes:
    if proto == 6:
        h = struct.pack("!HHIIBBHHH", sport, dport, 1, 1, 5 << 4, flags, 65535, 0, 0) + payload
    elif proto == 17:
        h = struct.pack("!HHHH", sport, dport, 8 + len(payload), 0) + payload
    elif proto == 58:
        h = struct.pack("!BBHI", icmp[0], icmp[1], 0, 0) + payload
    else:
        return payload
    pseudo = src.to_bytes(16, "big") + dst.to_bytes(16, "big") + struct.pack("!IxxxB", len(h), proto)
    c = _csum(pseudo + h)
    at = {6: 16, 17: 6, 58: 2}[proto]
    if proto == 17 and c == 0:
        c = 0xFFFF
    return h[:at] + struct.pack("!H", c) + h[at + 2 :]


def ext(kind: int, nh: int, size: int | None = None) -> bytes:
    """An extension header of `kind` (0 hop-by-hop, 60 destination options, 43 routing, 51 AH, 44 fragment) that
    says next header `nh`. Options headers carry PadN."""
    if size is None:
        size = 16 if kind == 51 else 0 if kind == 44 else 8
    if kind in (0, 60):
        body = bytes([1, size - 4]) + bytes(size - 4)  # PadN filling the header
        return bytes([nh, size // 8 - 1]) + body
    if kind == 43:
        return bytes([nh, size // 8 - 1, 253, 0]) + bytes(size - 4)  # an experimental type, segments left 0
    if kind == 51:
        return bytes([nh, size // 4 - 2, 0, 0]) + struct.pack("!II", 0x100, 1) + bytes(size - 12)
    if kind == 44:
        return bytes([nh, 0]) + struct.pack("!HI", size, 7)  # `size` here: the fragment offset|M word
    raise ValueError(kind)


def frame(
    uid: int,
    src: int,
    dst: int,
    proto: int,
    chain: tuple[int, ...] = (),
    vlan: int | None = None,
    hlim: int = 64,
    **kw,
) -> bytes:
    """Ethernet + IPv6 (flow label = uid, the tag the oracle's capture reads) + the extension headers `chain` (in
    order) + the upper layer."""
    body = l4(proto, src, dst, **kw)
    nxt = proto
    for kind in reversed(chain):
        body = ext(kind, nxt) + body
        nxt = kind
    ip = struct.pack("!IHBB", (6 << 28) | (uid & 0xFFFFF), len(body), nxt, hlim)
    ip += src.to_bytes(16, "big") + dst.to_bytes(16, "big")
    eth = MAC + (struct.pack("!HH", 0x8100, vlan) if vlan is not None else b"") + b"\x86\xdd"
    return eth + ip + body


def raw_frame(uid: int, src: int, dst: int, nxt: int, body: bytes, plen: int | None = None) -> bytes:
    ip = struct.pack("!IHBB", (6 << 28) | (uid & 0xFFFFF), len(body) if plen is None else plen, nxt, 64)
    return MAC + b"\x86\xdd" + ip + src.to_bytes(16, "big") + dst.to_bytes(16, "big") + body


def addr_in(prefix: str | None, rng: random.Random) -> int:
    lo, hi = _prefix(prefix)
    return rng.randint(lo, hi)


def flow_label(f: bytes) -> int | None:
    """The uid of a frame built here (None: not IPv6)."""
    at = 14
    if f[12:14] == b"\x81\x00":
        at = 18
    if f[at - 2 : at] != b"\x86\xdd" or len(f) < at + 40:
        return None
    return struct.unpack("!I", f[at : at + 4])[0] & 0xFFFFF
