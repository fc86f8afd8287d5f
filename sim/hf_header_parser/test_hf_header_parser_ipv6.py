"""Testbench of hf_header_parser's IPv6 walk (issue #25): every frame's h_family / h6_unparsed / h6_* outputs equal
an independent model — scapy's IPv6 layers dissect each header at the offset the kernel's ipv6_find_hdr reaches,
and the kernel's rules decide what the hardware must not guess — and every frame's IPv4 outputs (IPv6 frames
included: unparsed there) still equal hwmodel.parse_frame, every header LATENCY edges after the beat that completes
the capture whatever its family, at 256 and 512.

The kernel's rules the model applies (docs/ipv6.md "The NIC's parser"):
- ipv6_find_hdr (net/ipv6/exthdrs_core.c) steps over hop-by-hop 0, routing 43, fragment 44, destination options 60
  and AH 51 (ipv6_ext_hdr; 59 ends the walk as the upper-layer "protocol"), AH by ipv6_authlen ((len + 2) * 4
  bytes), the others by ipv6_optlen ((len + 1) * 8); ip6_packet_match's -p is the protocol it returns.
- A fragment header: unparsed (with defragmentation active only whole datagrams are filtered; later fragments
  match no port).
- br_validate_ipv6 (net/bridge/br_netfilter_ipv6.c) trims the frame to 40 + payload length and judges a first
  hop-by-hop header's options (nf_ip6_check_hbh_len; a jumbogram has payload length 0): the payload must end where
  the frame ends, its length be non-zero, and a first hop-by-hop header be 8 bytes of PadN(4) or Router Alert +
  PadN(0) (what both it and the host path's ip6_parse_tlv accept).
- tcp_mt, udp_mt, icmp6_match hotdrop an upper-layer header shorter than 20 / 8 / 8 bytes: unparsed.
- The budget: at most V6_MAX_HDRS extension headers, each starting within the capture's first HB - 2 bytes, and the
  upper-layer bytes read (TCP 14, UDP 4, ICMPv6 2) within the capture (HB = 96 bytes at 256, 128 at 512).
"""

from __future__ import annotations

import collections
import ipaddress
import random

import cocotb
import pytest
from cocotb.clock import Clock
from cocotb.triggers import ClockCycles, ReadOnly, RisingEdge
from hypafilter.hw import model as hwmodel
from scapy.layers.inet import TCP, UDP
from scapy.layers.inet6 import (
    ICMPv6DestUnreach,
    ICMPv6EchoRequest,
    ICMPv6MLReport,
    ICMPv6ND_NS,
    ICMPv6Unknown,
    IPv6,
    IPv6ExtHdrDestOpt,
    IPv6ExtHdrFragment,
    IPv6ExtHdrHopByHop,
    IPv6ExtHdrRouting,
    Jumbo,
    PadN,
    RouterAlert,
)
from scapy.layers.ipsec import AH
from scapy.layers.l2 import Dot1AD, Dot1Q, Ether
from scapy.packet import Raw

from sim.hftb import SIM_BUILD, WIRE, AxisSource, Free, Ports, hw, load_obj, run_ghdl, save_obj, tuser_for
from sim.hftraffic import frames_for, kernel_apart, malformed

V6_MAX_HDRS = 3  # the parser's default generic
LATENCY = 3  # clock edges from the one that takes the capture-completing beat to h_valid (c_v, p1, p2, o registers)
HDR_NEED_BYTES = 92  # hw/hf_pkg.vhd
EXT = (0, 43, 44, 51, 60)
EXT_CLS = {0: IPv6ExtHdrHopByHop, 43: IPv6ExtHdrRouting, 60: IPv6ExtHdrDestOpt, 51: AH}
NEED = {6: 20, 17: 8, 58: 8}  # kernel minimum upper-layer header
READ = {6: 14, 17: 4, 58: 2}  # bytes the parser reads


def capture_bytes(width: int) -> int:
    nb = width // 8
    return -(-HDR_NEED_BYTES // nb) * nb


def _u16(b: bytes, off: int) -> int:
    return b[off] << 8 | b[off + 1]


def family(f: bytes) -> int:
    if len(f) < 14:
        return 0
    et = _u16(f, 12)
    if et in (0x8100, 0x88A8):
        if len(f) < 18:
            return 0
        et = _u16(f, 16)
    return int(et == 0x86DD)


def first_hbh_ok(h) -> bool:
    """nf_ip6_check_hbh_len and ip6_parse_tlv both accept these two 8-byte forms (scapy's view of the options)."""
    if h.len != 0:
        return False
    opts = [(type(o).__name__, o.optlen, bytes(getattr(o, "optdata", b""))) for o in h.options]
    if opts == [("PadN", 4, b"\0\0\0\0")]:
        return True
    return len(opts) == 2 and opts[0][:2] == ("RouterAlert", 2) and opts[1] == ("PadN", 0, b"")


def model6(f: bytes, width: int, max_hdrs: int = V6_MAX_HDRS):
    """(src, dst, hlim, proto, sport, dport, icmp type, icmp code, tcp flags, l4_ok) of an IPv6 frame the parser
    must parse, else None."""
    return walk6(f, width, max_hdrs)[0]


def walk6(f: bytes, width: int, max_hdrs: int = V6_MAX_HDRS) -> tuple[tuple | None, str]:
    """model6's answer and why: "parsed/<ext headers>" or the rule that leaves the frame unparsed."""
    hb = capture_bytes(width)
    n = len(f)
    if hwmodel.unfilterable(f) or hwmodel.link_local(f):
        return None, "ethernet"
    l3 = 18 if _u16(f, 12) in (0x8100, 0x88A8) else 14
    if l3 + 40 > n:
        return None, "short"
    ip = IPv6(f[l3 : l3 + 40])
    if ip.version != 6:
        return None, "version"
    if ip.plen == 0:
        return None, "jumbo"
    if l3 + 40 + ip.plen != n:
        return None, "length"
    off, nh, count = l3 + 40, ip.nh, 0
    while nh in EXT:
        if nh == 44:
            return None, "fragment"
        if count == max_hdrs:
            return None, "budget/headers"
        if off + 2 > hb:
            return None, "budget/bytes"
        if off + 2 > n:  # ipv6_find_hdr's skb_header_pointer of the 2-byte header fails: -EBADMSG
            return None, "truncated"
        if nh == 0 and count == 0 and off + 8 > n:  # nf_ip6_check_hbh_len cannot pull 8 bytes
            return None, "truncated"
        # scapy reads the whole header: zeros after the frame's end stand for bytes that are not there (only nh and
        # the length byte, inside the frame, steer the walk; a header that does not end in the frame leaves the
        # upper layer beyond it, below)
        h = EXT_CLS[nh](f[off:].ljust(64, b"\0"))
        if nh == 0 and count == 0 and not first_hbh_ok(h):
            return None, "hop-by-hop"
        off += (h.payloadlen + 2) * 4 if nh == 51 else (h.len + 1) * 8
        nh, count = h.nh, count + 1
    if off + 2 > hb or off + READ.get(nh, 0) > hb:
        return None, "budget/bytes"
    if off + NEED.get(nh, 0) > n:
        return None, "truncated"
    sport = dport = it = ic = flags = 0
    l4ok = 1
    if nh == 6:
        t = TCP(f[off:])
        sport, dport, flags = t.sport, t.dport, int(t.flags)
        l4ok = int(5 <= t.dataofs and t.dataofs * 4 <= n - off)
    elif nh == 17:
        u = UDP(f[off:])
        sport, dport = u.sport, u.dport
        l4ok = int(8 <= u.len <= n - off)
    elif nh == 58:
        c = ICMPv6Unknown(f[off:])
        it, ic = c.type, c.code
    src, dst = int(ipaddress.IPv6Address(ip.src)), int(ipaddress.IPv6Address(ip.dst))
    return (src, dst, ip.hlim, nh, sport, dport, it, ic, flags, l4ok), f"parsed/{count}"


# ---------------------------------------------------------------- frames


def _addr(rng: random.Random) -> str:
    return str(ipaddress.IPv6Address(rng.getrandbits(128)))


def _ext(nh: int, rng: random.Random, first: bool, nxt: int):
    """One extension header of type nh whose next header is nxt (scapy layers, lengths drawn)."""
    if nh == 0:
        if first:
            k = rng.randrange(8)
            if k < 3:
                return IPv6ExtHdrHopByHop(nh=nxt, options=[PadN(optdata=b"\0" * 4)])
            if k < 6:
                return IPv6ExtHdrHopByHop(nh=nxt, options=[RouterAlert(value=rng.randrange(3))])
            if k == 6:  # a PadN with a non-zero byte: ip6_parse_tlv drops it
                return IPv6ExtHdrHopByHop(nh=nxt, autopad=0, options=[PadN(optdata=b"\0\x01\0\0")])
            # longer, or a Router Alert with more padding: legal, but not a form the parser takes
            return IPv6ExtHdrHopByHop(nh=nxt, options=[RouterAlert(), PadN(optdata=b"\0" * rng.randrange(3, 7))])
        return IPv6ExtHdrHopByHop(nh=nxt, options=[PadN(optdata=b"\0" * rng.randrange(0, 14))])
    if nh == 43:
        k = rng.randrange(3)
        return IPv6ExtHdrRouting(nh=nxt, type=rng.choice((0, 2)), segleft=k, addresses=[_addr(rng)] * k)
    if nh == 60:
        return IPv6ExtHdrDestOpt(nh=nxt, options=[PadN(optdata=b"\0" * rng.choice((0, 0, 4, 10, 20)))])
    if nh == 51:
        p = rng.choice((1, 2, 3, 4, 7))  # (p + 2) * 4 bytes: 12, 16, 20, 24, 36
        return AH(
            nh=nxt, payloadlen=p, spi=rng.getrandbits(32), seq=rng.getrandbits(32), icv=b"\x5a" * ((p + 2) * 4 - 12)
        )
    return IPv6ExtHdrFragment(
        nh=nxt, offset=rng.choice((0, 0, rng.randrange(1, 8192))), m=rng.randrange(2), id=rng.getrandbits(32)
    )


def _upper(proto: int, rng: random.Random):
    if proto == 6:
        return TCP(
            sport=rng.getrandbits(16), dport=rng.choice((22, 80, 443, rng.getrandbits(16))), flags=rng.getrandbits(8)
        )
    if proto == 17:
        return UDP(sport=rng.getrandbits(16), dport=rng.choice((53, 123, rng.getrandbits(16))))
    if proto == 58:
        return rng.choice(
            (
                ICMPv6EchoRequest(id=rng.getrandbits(16)),
                ICMPv6ND_NS(tgt=_addr(rng)),
                ICMPv6MLReport(),
                ICMPv6DestUnreach(code=rng.randrange(7)) / IPv6(src=_addr(rng), dst=_addr(rng)) / UDP(),
                ICMPv6Unknown(type=rng.randrange(256), code=rng.randrange(256)),
            )
        )
    return Raw(bytes(rng.randrange(256) for _ in range(rng.choice((0, 4, 16)))))


def ipv6_frame(rng: random.Random, chain: list[int], proto: int, vlan: bool = False, body: int = 0) -> bytes:
    """Ether [/ Dot1Q|Dot1AD] / IPv6 / the chain of extension headers / the upper layer, built by scapy."""
    pkt = Ether(src="02:00:00:00:00:01", dst="02:00:00:00:00:02")
    if vlan:
        pkt = pkt / (Dot1Q(vlan=rng.randrange(4096)) if rng.random() < 0.7 else Dot1AD(vlan=rng.randrange(4096)))
    kinds = [*chain, proto]
    pkt = pkt / IPv6(src=_addr(rng), dst=_addr(rng), hlim=rng.randrange(256), nh=kinds[0])
    for i, nh in enumerate(chain):
        pkt = pkt / _ext(nh, rng, i == 0, kinds[i + 1])
    pkt = pkt / _upper(proto, rng)
    if body:
        pkt = pkt / Raw(bytes(rng.randrange(256) for _ in range(body)))
    return bytes(pkt)


def _set_plen(f: bytearray, l3: int, plen: int) -> None:
    f[l3 + 4], f[l3 + 5] = plen >> 8 & 0xFF, plen & 0xFF


def random_ipv6(rng: random.Random, width: int) -> bytes:
    """A frame around one of the rules: chains of every type and length, the budget's edge, truncations."""
    n_hdrs = rng.choice((0, 1, 1, 2, 2, 3, 3, 4))
    chain = [rng.choice((0, 43, 60, 60, 51, 51, 44)) for _ in range(n_hdrs)]
    if rng.random() < 0.4:  # hop-by-hop first, as senders put it
        chain = [0, *chain[1:]] if chain else [0]
    proto = rng.choice((6, 6, 17, 17, 58, 58, 59, 50, 47, 132))
    vlan = rng.random() < 0.3
    f = bytearray(ipv6_frame(rng, chain, proto, vlan, body=rng.choice((0, 0, 8, 100))))
    l3 = 18 if vlan else 14
    plen = _u16(f, l3 + 4)
    kind = rng.randrange(12)
    if kind == 0:  # the payload length shortened and the frame cut there: headers truncated within the datagram
        plen = max(1, plen - rng.randrange(1, 30))
        _set_plen(f, l3, plen)
        f = f[: l3 + 40 + plen]
    elif kind == 1:  # the frame cut (the payload length says more)
        f = f[: rng.randrange(14, len(f))]
    elif kind == 2:  # bytes after the datagram (Ethernet padding): br_validate_ipv6 trims them
        f += bytes(rng.randrange(1, 20))
    elif kind == 3:  # payload length 0 (a jumbogram without, or with, the jumbo option)
        if rng.random() < 0.5:
            hbh = bytes(IPv6ExtHdrHopByHop(nh=f[l3 + 6], options=[Jumbo(jumboplen=plen + 8)]))
            f = f[: l3 + 40] + hbh + f[l3 + 40 :]
            f[l3 + 6] = 0
        _set_plen(f, l3, 0)
    elif kind == 4:  # another version
        f[l3] = (rng.choice((4, 5, 7, 0)) << 4) | (f[l3] & 0xF)
    elif kind == 5:  # link-local destination group
        f[0:6] = bytes((0x01, 0x80, 0xC2, 0, 0, rng.choice((0, 0x0E, 0x10))))
    elif kind == 6:  # a second tag: unfilterable
        tag = bytes((0x81, 0x00, 0, rng.randrange(256)))
        f = f[:12] + tag + f[12:]
    return bytes(f)


def budget_edge(rng: random.Random, width: int) -> bytes:
    """The upper-layer header placed around the capture's end, or V6_MAX_HDRS and V6_MAX_HDRS + 1 headers."""
    hb = capture_bytes(width)
    proto = rng.choice((6, 17, 58, 59))
    vlan = rng.random() < 0.3
    l3 = 18 if vlan else 14
    if rng.random() < 0.5:
        n = rng.choice((V6_MAX_HDRS - 1, V6_MAX_HDRS, V6_MAX_HDRS, V6_MAX_HDRS + 1))
        chain = [rng.choice((43, 60, 51)) for _ in range(n)]
        return ipv6_frame(rng, chain, proto, vlan, body=rng.choice((0, 40)))
    # one destination options header (and a 12-byte AH when the length is 4 mod 8) sized so that the upper layer
    # starts around hb - READ
    total = max(8, (hb - READ.get(proto, 2) + rng.choice((-8, -4, 0, 0, 4, 8)) - (l3 + 40)) // 4 * 4)
    ah = total % 8 == 4
    if ah and total < 20:
        total += 8
    dest = total - 12 if ah else total
    kinds = [60, 51, proto] if ah else [60, proto]
    pkt = Ether(src="02:00:00:00:00:01", dst="02:00:00:00:00:02")
    if vlan:
        pkt = pkt / Dot1Q(vlan=1)
    pkt = pkt / IPv6(src=_addr(rng), dst=_addr(rng), nh=60)
    pkt = pkt / IPv6ExtHdrDestOpt(nh=kinds[1], autopad=0, options=[PadN(optdata=b"\0" * (dest - 4))])
    if ah:
        pkt = pkt / AH(nh=proto, payloadlen=1, icv=b"")
    return bytes(pkt / _upper(proto, rng) / Raw(bytes(rng.randrange(0, 30))))


# ---------------------------------------------------------------- cocotb side


class TB:
    def __init__(self, dut):
        self.dut = dut
        self.width = len(dut.tdata)
        self.nhb = -(-HDR_NEED_BYTES // (self.width // 8))
        cocotb.start_soon(Clock(dut.clk, 4, units="ns").start())
        self.out: list = []
        self.done: list[int] = []  # cycle of each frame's capture-completing beat

    async def monitor(self):
        d = self.dut
        cyc, beats = 0, 0
        while True:
            await RisingEdge(d.clk)
            await ReadOnly()
            cyc += 1
            if int(d.beat_valid.value):  # the beat is accepted at this edge's end: it counts at the next edge
                beats += 1
                if beats == self.nhb or (beats < self.nhb and int(d.tlast.value)):
                    self.done.append(cyc + 1)
                if int(d.tlast.value):
                    beats = 0
            if int(d.h_valid.value):
                v4 = v6 = None
                if not int(d.h_unparsed.value):
                    names = ("h_src", "h_dst", "h_proto", "h_sport", "h_dport", "h_icmp_type", "h_icmp_code")
                    names += ("h_iport", "h_flags")
                    v4 = (hwmodel.Header(*(int(getattr(d, s).value) for s in names)), int(d.h_l4_ok.value))
                if not int(d.h6_unparsed.value):
                    names = ("h6_src", "h6_dst", "h6_hlim", "h6_proto", "h6_sport", "h6_dport")
                    names += ("h6_icmp_type", "h6_icmp_code", "h6_flags", "h6_l4_ok")
                    v6 = tuple(int(getattr(d, s).value) for s in names)
                self.out.append((int(d.h_family.value), v4, v6, int(d.h_unfilterable.value), cyc))


@cocotb.test()
async def ipv6_walk_matches_model(dut):
    frames, width = load_obj("HF_TB_CFG")
    tb = TB(dut)
    rng = random.Random(5)
    dut.rst.value = 1
    src = AxisSource(
        Ports(
            dut,
            s_axis_tvalid="beat_valid",
            s_axis_tdata="tdata",
            s_axis_tkeep="tkeep",
            s_axis_tlast="tlast",
            s_axis_tuser="tuser",
            s_axis_tready=Free(1),
        ),
        dut.clk,
        tb.width,
        rng,
        idle=0.2,
    )
    cocotb.start_soon(tb.monitor())  # before the first beat: it counts every beat
    await ClockCycles(dut.clk, 3)
    dut.rst.value = 0
    await src.send(frames)
    await ClockCycles(dut.clk, 20)
    assert len(tb.out) == len(frames) == len(tb.done), "one header per frame, none left in flight"
    parsed6 = 0
    for k, ((f, tuser), (fam, v4, v6, unf, cyc), done) in enumerate(zip(frames, tb.out, tb.done, strict=True)):
        assert cyc - done == LATENCY, f"frame {k}: header {cyc - done} cycles after the capture, not {LATENCY}"
        assert unf == int(hwmodel.unfilterable(f)), f"frame {k} ({f.hex()}): unfilterable {unf}"
        assert fam == family(f), f"frame {k} ({f.hex()}): family {fam}"
        # the IPv4 outputs of every frame (IPv6 ones included: unparsed there) as before the walk
        h = hwmodel.parse_frame(f, (tuser >> 16) & 0xFF)
        want4 = h if h is None else (h, int(hwmodel.l4_ok(f)))
        assert v4 == want4, f"frame {k} ({f.hex()}): IPv4 outputs {v4} != {want4}"
        want6 = model6(f, width) if fam else None
        parsed6 += want6 is not None
        assert v6 == want6, f"frame {k} ({f.hex()}): IPv6 outputs {v6} != {want6}"
    # every rule met, every chain length parsed (a generator change that loses a case fails here)
    whys = collections.Counter(walk6(f, width)[1] for f, _ in frames if family(f))
    want = {"ethernet", "short", "version", "jumbo", "length", "fragment", "budget/headers", "budget/bytes"}
    want |= {"truncated", "hop-by-hop", *(f"parsed/{i}" for i in range(V6_MAX_HDRS + 1))}
    assert want <= set(whys), f"cases not met: {want - set(whys)}"
    dut._log.info(f"IPv6 cases: {dict(sorted(whys.items()))}")
    dut._log.info(f"{len(frames)} frames, {sum(family(f) for f, _ in frames)} IPv6, {parsed6} parsed")


def ipv6_frames(width: int, rng: random.Random) -> list[tuple[bytes, int]]:
    """Chains of every header type, several in a row, straddling beats; truncations, fragments (first and later),
    the budget's edge; and IPv4 and other frames between them (their outputs must not change)."""
    out = []
    for chain in ([], [0], [43], [60], [51], [44], [0, 60], [0, 43, 60], [60, 51, 43], [51, 51], [0, 0], [43, 44]):
        for proto in (6, 17, 58, 59, 50):
            out.append(ipv6_frame(rng, chain, proto, vlan=rng.random() < 0.3))
    out += [random_ipv6(rng, width) for _ in range(260)]
    out += [budget_edge(rng, width) for _ in range(100)]
    frames = [(f, tuser_for(f, rng.choice(WIRE))) for f in out]
    # IPv4 and the rest, as the IPv4 testbench sends them: their outputs and timing must not change
    frames += frames_for(hwmodel_plan(), rng, 60)
    frames += [(f, tuser_for(f, p)) for f, p in (malformed(rng) for _ in range(30))]
    frames += [(f, tuser_for(f, p)) for f, p in (kernel_apart(rng) for _ in range(30))]
    rng.shuffle(frames)
    return frames


def hwmodel_plan():
    from hypafilter.hw.vhdl import HwPlan

    return HwPlan([], [0], [1], "0" * 64)


@pytest.mark.sim
@pytest.mark.parametrize("width", [256, 512])
def test_header_parser_ipv6(width):
    rng = random.Random(600 + width)
    frames = ipv6_frames(width, rng)
    tag = f"v6-w{width}"
    cfg = save_obj((frames, width), SIM_BUILD / "hf_header_parser" / tag / "cfg.pkl")
    sources = hw("hf_pkg.vhd", "hf_header_parser.vhd")
    run_ghdl(
        "hf_header_parser",
        sources,
        tag,
        {"DATA_WIDTH": width},
        env={"HF_TB_CFG": str(cfg)},
        test_module="test_hf_header_parser_ipv6",
    )
