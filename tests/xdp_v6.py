"""IPv6 on the xdp target (docs/ipv6.md "## xdp"): family-6 plans of generated rules and IPv6 frames of every
extension-header shape, the kernel (ip6tables alone on a bridge) as oracle, and the IPv6 path's cost.

`ranked_plan(rules)` gives the ip6tables-save text of rules over 128-bit prefixes (the kernel's oracle) and its plan:
the front end's (`parse_policy(..., family=6)`, `ir.family.compress`), or, with `hand`, one made without it (each
address dimension cut at the rules' prefix boundaries, every prefix a range of ranks, the ranked policy written as
an ordinary IPv4 policy whose addresses are the ranks, `plan.addr_map` an `AddrMap` of the contract's shape)."""

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


def texts(
    rules: list[Rule6], policy: str = "DROP", ct_first: bool = False, full_ranks: bool = False
) -> tuple[str, str, AddrMap]:
    """(ip6tables-save text, the ranked policy as an iptables-save text, AddrMap); `ct_first`: an ESTABLISHED,RELATED
    accept before the rules; `full_ranks`: an unrestricted address written as the range of every rank, 0 .. the
    last (the other form a compress may give it)."""
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
    if ct_first:
        for t in (v6, v4):
            t.append("-A FORWARD -m conntrack --ctstate ESTABLISHED,RELATED -j ACCEPT")
    for r in rules:
        a6, a4 = ["-A FORWARD"], ["-A FORWARD"]
        rng = []
        for dim, p, flag in (("src", r.src, "-s"), ("dst", r.dst, "-d")):
            if p is None and full_ranks:
                top = ipaddress.IPv4Address(len(amap.starts[dim]) - 1)
                rng.append(f"--{dim}-range 0.0.0.0-{top}")
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


def ranked_plan(
    rules: list[Rule6],
    policy: str = "DROP",
    mode: str = "selective",
    index_base: int = 0,
    ct_first: bool = False,
    full_ranks: bool = False,
    hand: bool = False,
):
    """(ip6tables-save text, family-6 Plan). The plan is the front end's: `parse_policy(text, family=6)`, ranked by
    `ir.family.compress` inside `build_plan`. `hand`: from the hand-made ranked text instead (the IR as the contract
    describes it, with `full_ranks` the other form a compress may write an unrestricted address in)."""
    from hypafilter.analysis.plan import build_plan
    from hypafilter.config import Config
    from hypafilter.iptables.document import parse_policy

    t6, t4, amap = texts(rules, policy, ct_first, full_ranks)
    cfg = Config(shunt_mode=mode)
    if not hand:
        plan = build_plan(parse_policy(t6, "v6x", config=cfg, family=6), cfg)
        assert plan.family == 6 and plan.addr_map is not None
        plan.index_base = index_base
        return t6, plan
    plan = build_plan(parse_policy(t4, "v6x-ranked", config=cfg), cfg)
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


# ---- the kernel as oracle ------------------------------------------------------------------------------------------

SENDER = r"""
import json, select, socket, struct, sys, time
data = open(sys.argv[1], "rb").read()
frames, at = [], 0
while at < len(data):
    (n,) = struct.unpack_from("<I", data, at)
    frames.append(data[at + 4 : at + 4 + n])
    at += 4 + n
rx = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(3))
rx.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 23)
rx.bind((sys.argv[3], 0))
tx = socket.socket(socket.AF_PACKET, socket.SOCK_RAW)
tx.bind((sys.argv[2], 0))
for f in frames:
    tx.send(f)
seen, quiet = [], time.monotonic() + 0.5
while time.monotonic() < quiet:
    if not select.select([rx], [], [], 0.05)[0]:
        continue
    f, addr = rx.recvfrom(65536)
    if addr[2] == socket.PACKET_OUTGOING:
        continue
    seen.append(f.hex())
    quiet = time.monotonic() + 0.3
print(json.dumps(seen))
"""


class Oracle:
    """ip6tables alone on a bridge (br_netfilter, bridge-nf-call-ip6tables and bridge-nf-filter-vlan-tagged on):
    namespace `<prefix>-k` holds br0 over k0, k1; `<prefix>-w` the other ends w0, w1. Frames go in at w0; the
    flow labels of those that come out at w1 are the ones the kernel passed. IPv6 is off on every interface, so no
    frame of the namespaces' own is captured."""

    def __init__(self, prefix: str):
        self.k, self.w = f"{prefix}-k", f"{prefix}-w"

    def __enter__(self):
        from hypafilter import netns

        for ns in (self.k, self.w):
            netns.delete(ns)
            netns.add(ns)
        try:
            netns.run(["modprobe", "br_netfilter"], check=False)
            for i in (0, 1):
                netns.run(["ip", "-n", self.k, "link", "add", f"k{i}", "type", "veth", "peer", "name", f"w{i}"])
                netns.run(["ip", "-n", self.k, "link", "set", f"w{i}", "netns", self.w])
            netns.run(["ip", "-n", self.k, "link", "add", "br0", "type", "bridge"])
            for ns, names in ((self.k, ("k0", "k1", "br0")), (self.w, ("w0", "w1"))):
                netns.run(["sysctl", "-qw", "net.ipv6.conf.all.disable_ipv6=1"], ns)
                netns.run(["sysctl", "-qw", "net.ipv6.conf.default.disable_ipv6=1"], ns)
                for n in names:
                    netns.run(["ip", "-n", ns, "link", "set", n, "up"])
            for i in (0, 1):
                netns.run(["ip", "-n", self.k, "link", "set", f"k{i}", "master", "br0"])
            for key in ("bridge-nf-call-ip6tables", "bridge-nf-filter-vlan-tagged"):
                netns.run(["sysctl", "-qw", f"net.bridge.{key}=1"], self.k)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc):
        from hypafilter import netns

        for ns in (self.k, self.w):
            netns.delete(ns)

    def passed(self, ruleset: str, frames: list[bytes]) -> set[int]:
        """The flow labels (uids) of `frames` that the kernel forwards under the ip6tables-save text `ruleset`."""
        import json
        import subprocess
        import sys
        import tempfile

        from hypafilter import netns

        netns.run(["ip6tables-restore"], self.k, input=ruleset)
        with tempfile.TemporaryDirectory(prefix="v6x-") as d:
            path = f"{d}/frames"
            with open(path, "wb") as fh:
                for f in frames:
                    fh.write(struct.pack("<I", len(f)) + f)
            out = subprocess.run(
                ["ip", "netns", "exec", self.w, sys.executable, "-c", SENDER, path, "w0", "w1"],
                capture_output=True,
                text=True,
                check=True,
                timeout=60,
            ).stdout
        return {u for u in (flow_label(bytes.fromhex(h)) for h in json.loads(out)) if u is not None}


# Chains of extension headers the frames carry (kinds: 0 hop-by-hop, 60 destination options, 43 routing, 51 AH).
CHAINS = [(), (), (), (0,), (60,), (43,), (0, 60, 43), (60, 0), (60, 60, 60), (43, 60)]
AH_CHAINS = [(51,), (0, 60, 43, 51), (51, 43), (60, 51, 60)]  # AH: unparsed (the backends read it apart)
LONG = (60,) * 9  # more than the program's budget (HFX6_EXT_MAX 8): unparsed
PARSED = ("plain", "chain", "chain8", "vlan", "esp", "none59", "other")


def frames_for(rules: list[Rule6], rng: random.Random, count: int) -> list[tuple[int, str, bytes]]:
    """(uid, kind, frame): frames aimed at the rules' prefixes, ports and types (and around them) with every
    extension-header shape, and the malformed or special shapes the program must leave unparsed."""
    out = []
    uid = 0

    def addrs():
        r = rng.choice(rules)
        s = addr_in(r.src if rng.random() < 0.8 else None, rng)
        d = addr_in(r.dst if rng.random() < 0.8 else None, rng)
        return r, s, d

    def upper(r):
        p = r.proto if r.proto and rng.random() < 0.8 else rng.choice(["tcp", "udp", "icmpv6"])
        p = int(PROTO.get(p, p))
        kw = {}
        if p in (6, 17):
            lo, hi = r.dport if r.dport else (1, 65535)
            kw["dport"] = rng.randint(lo, hi) if rng.random() < 0.8 else rng.randint(1, 65535)
            kw["sport"] = rng.randint(1024, 65535)
            if p == 6:
                kw["flags"] = rng.choice([0x10, 0x02, 0x18, 0x11])
        elif p == 58:
            t = r.icmp6 if r.icmp6 is not None and rng.random() < 0.7 else rng.choice([1, 128, 129, 135, 136, 143])
            kw["icmp"] = (t, rng.choice([0, 0, 1]))
        if rng.random() < 0.1:
            kw["payload"] = b"xxhfx6xx"  # the complex rule's string
        return p, kw

    while len(out) < count:
        uid += 1
        r, s, d = addrs()
        p, kw = upper(r)
        kind = rng.choice(
            ["plain"] * 6
            + ["chain"] * 4
            + [
                "chain8",
                "vlan",
                "esp",
                "none59",
                "other",
                "long",
                "ah",
                "frag0",
                "fragn",
                "trunc_plen",
                "trunc_ext",
                "trunc_l4",
            ]
            + ["jumbo", "hbh_bad", "hbh_pad1", "trailing", "version"]
        )
        if kind == "plain":
            f = frame(uid, s, d, p, **kw)
        elif kind == "chain":
            f = frame(uid, s, d, p, chain=rng.choice(CHAINS[3:]), **kw)
        elif kind == "vlan":
            f = frame(uid, s, d, p, chain=rng.choice(CHAINS), vlan=5, **kw)
        elif kind == "esp":
            f = raw_frame(uid, s, d, 50, struct.pack("!II", 0x200, 1) + bytes(16))
        elif kind == "none59":
            f = raw_frame(uid, s, d, 60, ext(60, 59) + bytes(8))  # payload after no-next-header: ignored
        elif kind == "other":
            f = raw_frame(uid, s, d, 0, ext(0, 132) + bytes(16))  # SCTP-numbered, after a hop-by-hop header
        elif kind == "chain8":
            f = frame(uid, s, d, p, chain=(60,) * 7 + (43,), **kw)  # the budget's eight headers: walked
        elif kind == "ah":
            f = frame(uid, s, d, p, chain=rng.choice(AH_CHAINS), **kw)
        elif kind == "long":
            f = frame(uid, s, d, p, chain=LONG, **kw)
        elif kind in ("frag0", "fragn"):
            off = 0x0001 if kind == "frag0" else (8 << 3)  # offset 0 with M, or offset 8 bytes, last
            body = bytes([p, 0]) + struct.pack("!HI", off, uid) + l4(p, s, d, **kw)
            f = raw_frame(uid, s, d, 44, body)
        elif kind == "trunc_plen":
            b = l4(p, s, d, **kw)
            f = raw_frame(uid, s, d, p, b, plen=len(b) + 8)  # claims more than the frame has: the kernel drops
        elif kind == "trunc_ext":
            f = raw_frame(uid, s, d, 60, bytes([p, 2]) + bytes(14))  # says 24 bytes, 16 there
        elif kind == "trunc_l4":
            b = l4(p, s, d, **kw)
            f = raw_frame(uid, s, d, p if p in (6, 17, 58) else 6, b[:6])
        elif kind == "jumbo":
            hbh = bytes([p, 0, 0xC2, 4]) + struct.pack("!I", 70000)
            f = raw_frame(uid, s, d, 0, hbh + l4(p, s, d, **kw), plen=0)
        elif kind == "hbh_bad":
            hbh = bytes([p, 0, 0x1E, 9, 0, 0, 0, 0])  # an option longer than the header
            f = raw_frame(uid, s, d, 0, hbh + l4(p, s, d, **kw))
        elif kind == "hbh_pad1":
            hbh = bytes([p, 1]) + bytes(14)  # 14 Pad1 options: more than the budget, valid to the kernel
            f = raw_frame(uid, s, d, 0, hbh + l4(p, s, d, **kw))
        elif kind == "trailing":
            f = frame(uid, s, d, p, **kw) + bytes(6)  # bytes beyond the payload: the kernel trims them
        else:  # version
            f = bytearray(frame(uid, s, d, p, **kw))
            f[14] = (5 << 4) | (f[14] & 0xF)
            f = bytes(f)
        out.append((uid, kind, f))
    return out


def ipv4_tcp(src: str, dst: str, sport: int, dport: int) -> bytes:
    """An IPv4 TCP ACK frame (header checksum right; the TCP one is not read)."""
    tcp = struct.pack("!HHIIBBHHH", sport, dport, 1, 1, 5 << 4, 0x10, 65535, 0, 0)
    ip = struct.pack(
        "!BBHHHBBH4s4s", 0x45, 0, 20 + len(tcp), 1, 0, 64, 6, 0, *(ipaddress.IPv4Address(a).packed for a in (src, dst))
    )
    ip = ip[:10] + struct.pack("!H", _csum(ip)) + ip[12:]
    return MAC + b"\x08\x00" + ip + tcp


# ---- cost (docs/ipv6.md "## xdp": `python -m tests.xdp_v6 cost`) ---------------------------------------------------


def cost(rules: int = 1000, frames: int = 400, repeat: int = 2000, seed: int = 1) -> dict:
    """BPF_PROG_TEST_RUN ns per frame of the IPv6 path against the IPv4 one (in the same program, and in a program
    without an IPv6 table set: `ipv4_alone`), on policies of the same structure:
    `rules` rules of a random source and destination prefix each (IPv6 /32../64 under 2001:db8::/16's neighbours,
    IPv4 /8../24), half of them TCP with a destination port range, a chain policy DROP; frames aimed at the rules.
    Needs root (a namespace `v6x-cost` of its own)."""
    from hypafilter import netns
    from hypafilter.analysis.plan import build_plan
    from hypafilter.iptables.document import parse_policy
    from hypafilter.targets.xdp.run import run_frames

    rng = random.Random(seed)
    r6, lines4 = [], ["*filter", ":FORWARD DROP [0:0]"]
    for _ in range(rules):
        tcp = rng.random() < 0.5
        lo = rng.randint(1, 60000)
        dport = (lo, lo + rng.randint(0, 100)) if tcp else None
        s6 = f"{ipaddress.IPv6Address(rng.getrandbits(128) & ~((1 << 96) - 1))}/{rng.choice([32, 48, 64])}"
        d6 = f"{ipaddress.IPv6Address(rng.getrandbits(128) & ~((1 << 96) - 1))}/{rng.choice([32, 48, 64])}"
        r6.append(
            Rule6(
                src=str(ipaddress.IPv6Network(s6, strict=False)),
                dst=str(ipaddress.IPv6Network(d6, strict=False)),
                proto="tcp" if tcp else "udp",
                dport=dport,
                target=rng.choice(["ACCEPT", "DROP"]),
            )
        )
        s4 = ipaddress.IPv4Network(
            f"{ipaddress.IPv4Address(rng.getrandbits(32))}/{rng.choice([8, 16, 24])}", strict=False
        )
        d4 = ipaddress.IPv4Network(
            f"{ipaddress.IPv4Address(rng.getrandbits(32))}/{rng.choice([8, 16, 24])}", strict=False
        )
        port = f" -m tcp --dport {dport[0]}:{dport[1]}" if tcp else ""
        lines4.append(f"-A FORWARD -s {s4} -d {d4} -p {'tcp' if tcp else 'udp'}{port} -j {r6[-1].target}")
    plan4 = build_plan(parse_policy("\n".join([*lines4, "COMMIT", ""]), "cost4"))
    _, plan6 = ranked_plan(r6, "DROP", index_base=len(plan4.entries) + 1)
    f6, f4 = [], []
    for uid in range(frames):
        r = rng.choice(r6)
        p = 6 if r.proto == "tcp" else 17
        dport = rng.randint(*r.dport) if r.dport else rng.randint(1, 65535)
        f6.append((0, frame(uid, addr_in(r.src, rng), addr_in(r.dst, rng), p, dport=dport)))
        ln = rng.choice(lines4[2:]).split()
        s4, d4 = (ipaddress.IPv4Network(ln[ln.index(k) + 1]) for k in ("-s", "-d"))
        a4 = str(s4[rng.randrange(s4.num_addresses)])
        b4 = str(d4[rng.randrange(d4.num_addresses)])
        f4.append((0, ipv4_tcp(a4, b4, 1234, dport)))
    ns = "v6x-cost"
    netns.delete(ns)
    netns.add(ns)
    try:
        netns.run(["ip", "-n", ns, "link", "add", "n0", "type", "veth", "peer", "name", "n1"])
        for p in ("n0", "n1"):
            netns.run(["ip", "-n", ns, "link", "set", p, "up"])
        out = {}
        for name, fr, p6 in (("ipv4_alone", f4, None), ("ipv4", f4, plan6), ("ipv6", f6, plan6)):
            res = run_frames(plan4, fr, ["n0", "n1"], ns=ns, repeat=repeat, plan6=p6)
            ns_per = sorted(v.ns for v in res.verdicts)
            out[name] = {"median_ns": ns_per[len(ns_per) // 2], "mean_ns": round(sum(ns_per) / len(ns_per), 1)}
        out["rules"], out["entries4"], out["entries6"] = rules, len(plan4.entries), len(plan6.entries)
        out["spans6"] = {d: len(plan6.addr_map.starts[d]) for d in ("src", "dst")}
        out["prog"] = res.prog
        return out
    finally:
        netns.delete(ns)


if __name__ == "__main__":
    import json
    import sys

    if sys.argv[1:2] == ["cost"]:
        print(json.dumps(cost(*(int(x) for x in sys.argv[2:])), indent=1))
