"""IPv6 frames for `verify -6` and the dual-stack verify (docs/ipv6.md, "Deploy and verify").

The same machinery as IPv4 (ops.verify): every frame carries its id in the source MAC, goes through the hybrid path
and through the plain namespace, where the IPv6 policy is loaded alone into ip6tables, and the verdicts (and the bytes
delivered) are compared. The frames are built with scapy and aimed at what the policy's rules name (netfilter.ip6
`aims`: its networks, their edges and just outside, its ports and ICMPv6 types) and at the lab's own addresses;
nothing here decides a verdict — the kernel does, on both paths.

Kinds (each `v6_<kind>` in the report's by_kind): normal TCP/UDP/ICMPv6; extension-header chains (hop-by-hop,
routing types 0 and 2, destination options, several in a row, AH); first and later fragments; truncated headers
(inside an extension header, inside the upper-layer header, the payload length claiming more than the frame holds);
neighbour discovery (NS, NA, RS, RA); ICMPv6 errors quoting a flow sent before in this run or an invented one; the
jumbo payload option.
"""

from __future__ import annotations

import contextlib
import ipaddress
import random

from hypafilter import netns
from hypafilter.netfilter import ip6, ipset

KINDS6 = (
    "normal",
    "hbh",
    "rt0",
    "rt2",
    "dstopt",
    "chain",
    "ah",
    "frag_first",
    "frag_later",
    "trunc_ext",
    "trunc_l4",
    "trunc_len",
    "nd_ns",
    "nd_na",
    "nd_rs",
    "nd_ra",
    "icmp_error_real",
    "icmp_error_invented",
    "jumbo",
)
# share of well-formed TCP/UDP/ICMPv6 frames; the rest spread over the other kinds
NORMAL_SHARE = 0.4
LAB_NETS = ("fd48:4600::/64", "fd48:4601::/64")
PREFIX = "v6_"


def _scapy():
    import logging

    logging.getLogger("scapy.runtime").setLevel(logging.ERROR)
    from scapy import all as sc

    return sc


class Gen6:
    """Headers aimed at the policy's networks, ports, protocols and ICMPv6 types."""

    def __init__(self, policy: ip6.V6Policy | None, rng: random.Random):
        self.rng = rng
        a = ip6.aims(policy) if policy is not None else ip6.Aims()
        self.nets = a.nets + [ipaddress.IPv6Network(n) for n in LAB_NETS]
        self.ports = a.ports or [22, 53, 80, 443]
        self.protos = a.protos
        self.icmp = a.icmp
        ir = getattr(policy, "ir", None) if policy is not None else None
        self.boxes = [b for r in ir.rules for b in r.boxes] if ir is not None else []

    def addr(self) -> str:
        rng = self.rng
        if rng.random() < 0.1:
            return str(ipaddress.IPv6Address(rng.getrandbits(128) | (0x2 << 124)))  # some global unicast
        net = rng.choice(self.nets)
        lo, hi = int(net.network_address), int(net.broadcast_address)
        r = rng.random()
        v = lo if r < 0.2 else hi if r < 0.35 else lo - 1 if r < 0.45 else hi + 1 if r < 0.55 else rng.randint(lo, hi)
        v &= (1 << 128) - 1
        if ipaddress.IPv6Address(v).is_multicast:  # a source address must not be multicast; keep to unicast
            v = lo
        return str(ipaddress.IPv6Address(v))

    def port(self) -> int:
        rng = self.rng
        p = rng.choice(self.ports)
        return max(0, min(0xFFFF, p + rng.choice((0, 0, 0, -1, 1)))) if rng.random() < 0.8 else rng.randint(1, 65535)

    def _edge(self, lo: int, hi: int, top: int) -> int:
        r = self.rng.random()
        v = lo if r < 0.25 else hi if r < 0.45 else lo - 1 if r < 0.55 else hi + 1 if r < 0.65 else None
        return self.rng.randint(lo, hi) if v is None or not 0 <= v <= top else v

    def box_header(self, b) -> dict:
        """A header at the edges of (or inside, or just outside) box `b` of the policy, as the IPv6 front end read
        it (128-bit src and dst)."""
        from hypafilter.ir import FIELD_INDEX

        f = {n: (b.lo[i], b.hi[i]) for n, i in FIELD_INDEX.items() if i < len(b.lo)}
        top = (1 << 128) - 1
        h = self.plain_header()
        for dim in ("src", "dst"):
            v = self._edge(f[dim][0], min(f[dim][1], top), top)
            if not ipaddress.IPv6Address(v).is_multicast or dim == "dst":
                h[dim] = str(ipaddress.IPv6Address(v))
        plo, phi = f["proto"]
        if phi - plo <= 16:
            h["proto"] = self.rng.randint(plo, phi)
            if h["proto"] not in (6, 17, 58):
                h["proto"] = self.rng.choice((6, 17, 58))
        if h["proto"] in (6, 17):
            h["dport"] = self._edge(*f["dport"], 0xFFFF)
            h["sport"] = self._edge(*f["sport"], 0xFFFF)
        elif h["proto"] == 58 and "icmp_type" in f:
            h["type"] = self._edge(*f["icmp_type"], 255)
            h["code"] = self._edge(*f["icmp_code"], 255)
        return h

    def header(self) -> dict:
        if self.boxes and self.rng.random() < 0.5:
            return self.box_header(self.rng.choice(self.boxes))
        return self.plain_header()

    def plain_header(self) -> dict:
        rng = self.rng
        proto = rng.choice(self.protos) if self.protos and rng.random() < 0.6 else rng.choice((6, 6, 17, 17, 58))
        if proto not in (6, 17, 58):
            proto = rng.choice((6, 17, 58, proto))
        h = {"src": self.addr(), "dst": self.addr(), "proto": proto, "sport": rng.randint(1024, 65535)}
        h["dport"] = self.port()
        if proto == 58:
            if self.icmp and rng.random() < 0.7:
                t, c = rng.choice(self.icmp)
                h["type"], h["code"] = t, c if c >= 0 else rng.choice((0, 0, 1))
            else:
                h["type"], h["code"] = rng.choice(((128, 0), (129, 0), (1, 4), (2, 0), (3, 0), (4, 1), (200, 0)))
        h["flags"] = rng.choice(("S", "S", "A", "SA", "R", "F", "PA", ""))
        return h


def _l4(sc, h: dict, uid: int, payload: bytes):
    if h["proto"] == 6:
        return sc.TCP(sport=h["sport"], dport=h["dport"], seq=uid, flags=h["flags"]) / payload
    if h["proto"] == 17:
        return sc.UDP(sport=h["sport"], dport=h["dport"]) / payload
    if h["proto"] == 58:
        if h["type"] in (128, 129):
            cls = sc.ICMPv6EchoRequest if h["type"] == 128 else sc.ICMPv6EchoReply
            return cls(id=uid & 0xFFFF, seq=1) / payload
        return sc.ICMPv6Unknown(type=h["type"], code=h["code"]) / payload
    return sc.Raw(payload or b"\0" * 8)


def build6(
    uid: int,
    kind: str,
    h: dict,
    rng: random.Random,
    sent: list[dict],
    dst_mac: bytes,
    id_prefix: bytes,
    payload: bytes | None = None,
) -> bytes:
    """The frame of `kind` (KINDS6) for header `h`, its id `uid` in the source MAC after `id_prefix`; `sent`:
    well-formed TCP/UDP headers sent before (quoted by icmp_error_real); `payload`: the upper-layer payload (default
    0-32 random bytes)."""
    sc = _scapy()
    src_mac = (id_prefix + uid.to_bytes(4, "big")).hex(":")
    eth = sc.Ether(dst=dst_mac.hex(":"), src=src_mac, type=0x86DD)
    if payload is None:
        payload = bytes(rng.getrandbits(8) for _ in range(rng.randint(0, 32)))
    ip = sc.IPv6(src=h["src"], dst=h["dst"], hlim=rng.choice((64, 1, 255)))
    l4 = _l4(sc, h, uid, payload)
    cut = None
    if kind == "normal":
        pkt = ip / l4
    elif kind == "hbh":
        pkt = ip / sc.IPv6ExtHdrHopByHop(options=[sc.PadN(optdata=b"\0" * rng.choice((0, 2, 4)))]) / l4
    elif kind == "rt0":
        pkt = ip / sc.IPv6ExtHdrRouting(type=0, addresses=[h["dst"]], segleft=rng.choice((0, 1))) / l4
    elif kind == "rt2":
        pkt = ip / sc.IPv6ExtHdrRouting(type=2, addresses=[h["src"]], segleft=rng.choice((0, 1))) / l4
    elif kind == "dstopt":
        pkt = ip / sc.IPv6ExtHdrDestOpt(options=[sc.PadN(optdata=b"\0\0\0\0")]) / l4
    elif kind == "chain":
        hdrs = [
            sc.IPv6ExtHdrHopByHop(),
            sc.IPv6ExtHdrDestOpt(),
            sc.IPv6ExtHdrRouting(type=rng.choice((0, 2, 4)), addresses=[h["dst"]], segleft=0),
            sc.IPv6ExtHdrDestOpt(),
        ]
        if rng.random() < 0.3:
            hdrs.append(sc.IPv6ExtHdrHopByHop())  # hop-by-hop not first: the kernel's parse refuses it
        pkt = ip
        for x in hdrs:
            pkt = pkt / x
        pkt = pkt / l4
    elif kind == "ah":
        nh = h["proto"]
        icv = bytes(rng.getrandbits(8) for _ in range(12))
        ah = sc.AH(nh=nh, payloadlen=4, spi=rng.randint(1, 0xFFFF), seq=uid, icv=icv)
        pkt = ip / ah / l4
    elif kind in ("frag_first", "frag_later"):
        body = bytes(l4)
        if kind == "frag_first":
            frag = sc.IPv6ExtHdrFragment(nh=h["proto"], offset=0, m=1, id=uid)
            pkt = ip / frag / sc.Raw(body[: max(8, len(body) // 8 * 8)] or body)
        else:
            frag = sc.IPv6ExtHdrFragment(nh=h["proto"], offset=rng.randint(1, 400), m=rng.choice((0, 1)), id=uid)
            pkt = ip / frag / sc.Raw(payload.ljust(8, b"\0")[: 8 * rng.randint(1, 3)])
    elif kind == "trunc_ext":
        pkt = ip / sc.IPv6ExtHdrDestOpt(options=[sc.PadN(optdata=b"\0" * 10)]) / l4
        cut = 14 + 40 + rng.randint(1, 7)
    elif kind == "trunc_l4":
        pkt = ip / l4
        keep = {6: rng.randint(1, 19), 17: rng.randint(1, 7), 58: rng.randint(1, 3)}.get(h["proto"], 1)
        raw = bytearray(bytes(eth / pkt))[: 14 + 40 + keep]
        raw[18:20] = keep.to_bytes(2, "big")  # a consistent payload length: the upper-layer header itself is short
        return bytes(raw)
    elif kind == "trunc_len":
        pkt = ip / l4
        raw = bytes(eth / pkt)
        return raw[: rng.randint(14 + 40, len(raw) - 1)] if len(raw) > 55 else raw[:54]
    elif kind.startswith("nd_"):
        return _nd(sc, kind, uid, h, rng, src_mac, dst_mac)
    elif kind in ("icmp_error_real", "icmp_error_invented"):
        q = dict(rng.choice(sent)) if kind == "icmp_error_real" and sent else dict(h, proto=rng.choice((6, 17)))
        inner = sc.IPv6(src=q["src"], dst=q["dst"]) / _l4(sc, dict(q, flags="S"), 0, b"")
        t, c = rng.choice(((1, 4), (1, 1), (2, 0), (3, 0), (4, 0)))
        err = sc.ICMPv6Unknown(type=t, code=c) if t != 1 else sc.ICMPv6DestUnreach(code=c)
        if t == 2:
            err = sc.ICMPv6PacketTooBig(mtu=1280)
        elif t == 3:
            err = sc.ICMPv6TimeExceeded(code=0)
        elif t == 4:
            err = sc.ICMPv6ParamProblem(code=0, ptr=6)
        pkt = sc.IPv6(src=q["dst"], dst=q["src"], hlim=64) / err / inner
    elif kind == "jumbo":
        body = bytes(l4)
        hbh = sc.IPv6ExtHdrHopByHop(options=[sc.Jumbo(jumboplen=rng.choice((len(body) + 8, 70000)))])
        ip.plen = 0
        pkt = ip / hbh / sc.Raw(body)
    else:
        raise ValueError(kind)
    raw = bytes(eth / pkt)
    return raw[:cut] if cut else raw


def _nd(sc, kind: str, uid: int, h: dict, rng: random.Random, src_mac: str, dst_mac: bytes) -> bytes:
    """Neighbour discovery: to the solicited-node group or the lab's unicast MAC, hop limit 255 (or not)."""
    target = h["dst"]
    hlim = 255 if rng.random() < 0.85 else 64
    src = h["src"] if rng.random() < 0.7 else "fe80::248:46ff:fe00:101"
    if kind == "nd_ns":
        mc = ipaddress.IPv6Address(target).packed[-3:]
        dst = str(ipaddress.IPv6Address(b"\xff\x02" + b"\0" * 9 + b"\x01\xff" + mc))
        mac = "33:33:ff:" + mc.hex(":")
        body = sc.ICMPv6ND_NS(tgt=target) / sc.ICMPv6NDOptSrcLLAddr(lladdr=src_mac)
    elif kind == "nd_na":
        dst, mac = h["src"], dst_mac.hex(":")
        body = sc.ICMPv6ND_NA(tgt=target, R=0, S=1, O=1) / sc.ICMPv6NDOptDstLLAddr(lladdr=src_mac)
    elif kind == "nd_rs":
        dst, mac = "ff02::2", "33:33:00:00:00:02"
        body = sc.ICMPv6ND_RS()
    else:
        dst, mac = "ff02::1", "33:33:00:00:00:01"
        body = sc.ICMPv6ND_RA(routerlifetime=rng.choice((0, 1800))) / sc.ICMPv6NDOptPrefixInfo(
            prefix="2001:db8:99::", prefixlen=64
        )
    if rng.random() < 0.3:
        mac = dst_mac.hex(":")  # unicast to the frame's usual destination
    return bytes(sc.Ether(dst=mac, src=src_mac) / sc.IPv6(src=src, dst=dst, hlim=hlim) / body)


def probes6(
    policy: ip6.V6Policy | None,
    first_uid: int,
    packets: int,
    seed: int,
    dst_mac: bytes,
    id_prefix: bytes,
    normal: float = NORMAL_SHARE,
    headers=None,
) -> list[tuple[int, str, bytes]]:
    """`packets` IPv6 frames as (id, kind, bytes), ids first_uid, first_uid+1, ..., kinds `v6_<kind>`; `normal`: the
    share of well-formed TCP/UDP/ICMPv6 frames (bench rate: 1 - --malformed); `headers` (a list of header dicts, a
    trace mapped into IPv6: tools.classbench6.v6_trace) drawn in turn instead of the policy's aims."""
    rng = random.Random(seed * 1000003 + 6)
    gen = Gen6(policy, rng)
    out = []
    sent: list[dict] = []
    others = KINDS6[1:]
    for i in range(packets):
        uid = first_uid + i
        h = dict(headers[i % len(headers)]) if headers else gen.header()
        kind = "normal" if rng.random() < normal else others[i % len(others)]
        if kind == "normal" and h["proto"] in (6, 17):
            sent.append(h)
        out.append((uid, PREFIX + kind, build6(uid, kind, h, rng, sent, dst_mac, id_prefix)))
    return out


def load_oracle6(ns: str, policy: ip6.V6Policy | None, fw: str) -> None:
    """The IPv6 side alone into ip6tables of the oracle's namespace `ns`: every ip6 table there removed first, then
    the IPv6 policy (or --ipv6-default drop's), or, in mode kernel, the firewall's ip6tables as they are now."""
    for t in ip6.BUILTIN:
        if ip6.table_exists(ns, t):
            netns.run(["nft", "delete", "table", "ip6", t], ns)
    if policy is not None and ip6.uses_sets(policy.text):  # the firewall's sets, as they are now (docs/sets.md)
        sets = ipset.save_text(fw)
        if sets:
            ipset.restore(ns, sets)
    if policy is not None:
        ip6.load(ns, policy)
        return
    text = "".join(netns.run(["ip6tables-save", "-t", t], fw) for t in ip6.BUILTIN if ip6.table_exists(fw, t))
    if text:
        netns.run(["ip6tables-restore", "-w"], ns, input=text)


def flush6(*namespaces: str) -> None:
    """Forget every IPv6 connection the namespaces track."""
    for ns in namespaces:
        with contextlib.suppress(netns.CommandError):
            netns.run(["conntrack", "-F", "-f", "ipv6"], ns)


def conns6(policy: ip6.V6Policy | None, spec, host: bool = False) -> list:
    """`spec.connections` IPv6 connections (ops.connections.Conn, family 6) of the spec's kinds in turn, to the ports
    the IPv6 policy names and one it does not, from source ports of their own; `host` (host mode): the directions in
    turn too, every kind into the host, then every kind out of it (as ConnectionSpec.conns for IPv4)."""
    from hypafilter.ops.connections import DIRECTIONS, SPORT_BASE, UNNAMED_PORT, Conn

    ports = sorted({p for p in (ip6.aims(policy).ports if policy is not None else []) if p} | {UNNAMED_PORT})
    n = len(spec.kinds)
    return [
        Conn(
            spec.kinds[i % n],
            ports[(i // n) % len(ports)],
            SPORT_BASE + 10000 + i,
            DIRECTIONS[(i // n) % 2] if host else "",
            family=6,
        )
        for i in range(spec.connections)
    ]
