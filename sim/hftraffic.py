"""Test traffic for the core testbenches: frames aimed at plan entries, random frames, malformed frames, and the
frames the kernel treats apart (unfilterable VLAN stacks, link-local groups, bad checksums, fragments)."""

from __future__ import annotations

import random

from hypafilter.hw.model import ipv4_header_sum
from hypafilter.ir import FIELDS, Header
from scapy.layers.inet import IP, UDP
from scapy.layers.inet6 import IPv6
from scapy.layers.l2 import ARP, Dot1AD, Dot1Q, Ether

from sim.hftb import HOST, WIRE, header_frame, tuser_for

PORT_OF_IPORT = {0: 0x01, 1: 0x04, 2: 0x10, 3: 0x40}


def point_in_box(box, rng: random.Random) -> Header:
    """A header inside the box (ends of intervals favoured, where off-by-one bugs live)."""
    vals = {}
    for name, lo, hi in zip(FIELDS, box.lo, box.hi, strict=True):
        r = rng.random()
        vals[name] = lo if r < 0.2 else hi if r < 0.4 else rng.randint(lo, hi)
    flags = (box.flags_value | (rng.randrange(256) & ~box.flags_mask)) & 0xFF
    proto = vals["proto"]
    if proto not in (6, 17):
        vals["sport"] = vals["dport"] = 0
    if proto != 1:
        vals["icmp_type"] = vals["icmp_code"] = 0
    return Header(**vals, tcp_flags=flags if proto == 6 else 0)


def random_header(rng: random.Random) -> Header:
    proto = rng.choice((6, 6, 17, 17, 1, 47, 0))
    tcp_udp = proto in (6, 17)
    return Header(
        src=rng.getrandbits(32),
        dst=rng.getrandbits(32),
        proto=proto,
        sport=rng.getrandbits(16) if tcp_udp else 0,
        dport=rng.choice((rng.getrandbits(16), 80, 53, 443)) if tcp_udp else 0,
        icmp_type=rng.randrange(256) if proto == 1 else 0,
        icmp_code=rng.randrange(4) if proto == 1 else 0,
        iport=rng.randrange(4),
        tcp_flags=rng.randrange(256) if proto == 6 else 0,
    )


def _set16(b: bytearray, off: int, v: int) -> None:
    b[off], b[off + 1] = (v >> 8) & 0xFF, v & 0xFF


def fix_checksum(f: bytearray, l3: int) -> None:
    """Make the IPv4 header checksum at l3 right again after a field was changed (when the header is there)."""
    ihl = f[l3] & 0xF
    if ihl < 5 or l3 + ihl * 4 > len(f):
        return
    _set16(f, l3 + 10, 0)
    _set16(f, l3 + 10, ~ipv4_header_sum(bytes(f[l3 : l3 + ihl * 4])) & 0xFFFF)


def kernel_apart(rng: random.Random) -> tuple[bytes, int]:
    """A frame netfilter sees differently from a plain one: an unfilterable VLAN stack (two tags, 802.1Q or
    802.1ad in any order), a link-local group destination, a wrong IPv4 header checksum, a fragment; or the legal frame next to
    each edge (one tag of either kind, 01:80:C2:00:00:10, DF without MF, a checksum of 0xFFFF for 0x0000)."""
    port = rng.choice(WIRE)
    h = random_header(rng)
    kind = rng.randrange(8)
    if kind == 0:  # 802.1ad outer tag, then IPv4 (filtered: parsed) or another tag (unfilterable)
        inner = rng.choice((Dot1Q(vlan=rng.randrange(4096)) / IP(), IP(), Dot1AD() / IP()))
        return bytes(Ether() / Dot1AD(vlan=rng.randrange(4096)) / inner / UDP()).ljust(60, b"\0"), port
    if kind == 1:  # 802.1Q then 802.1Q or 802.1ad (unfilterable), or one 802.1Q tag (parsed)
        f = header_frame(h, rng, vlans=rng.choice((1, 2)), options=rng.choice((0, 10)), ad_share=0.0)
        if rng.random() < 0.3 and f[16:18] == b"\x81\x00":
            f = f[:16] + b"\x88\xa8" + f[18:]
        return f, port
    if kind == 2:  # QinQ cut right after the outer tag or inside the inner one
        f = header_frame(h, rng, vlans=2, ad_share=rng.random())
        return f[: rng.randrange(12, 20)], port
    f = bytearray(header_frame(h, rng, vlans=rng.choice((0, 1)), options=rng.randrange(11), ad_share=0.0))
    l3 = 18 if f[12:14] == b"\x81\x00" else 14
    if kind == 3:  # link-local destination group (parsed from ...:10 on)
        f[0:6] = bytes((0x01, 0x80, 0xC2, 0, 0, rng.choice((rng.randrange(16), 0x10, 0x1F, 0xFF))))
    elif kind == 4:  # one bit flipped in the header (options included), in its checksum, or just past the header
        ihl = f[l3] & 0xF
        k = rng.choice((10, 11, rng.randrange(20, ihl * 4 + 1), rng.randrange(ihl * 4)))
        f[l3 + k] ^= 1 << rng.randrange(8)
    elif kind == 5:  # a fragment: MF alone (first), an offset alone (last), both; DF and reserved bits kept apart
        _set16(f, l3 + 6, rng.choice((0x2000, rng.randrange(1, 0x2000), 0x2000 | rng.randrange(1, 0x2000))))
        fix_checksum(f, l3)
    elif kind == 6:  # DF or the reserved bit only: not a fragment
        _set16(f, l3 + 6, rng.choice((0x4000, 0x8000)))
        fix_checksum(f, l3)
    else:  # the checksum's ones'-complement twin (0x0000 and 0xFFFF are one number: still right), else a wrong one
        c = f[l3 + 10] << 8 | f[l3 + 11]
        if c in (0, 0xFFFF):
            _set16(f, l3 + 10, c ^ 0xFFFF)
        else:
            f[l3 + 10] ^= 0x80
    return bytes(f), port


def malformed(rng: random.Random) -> tuple[bytes, int]:
    """A frame the parser must not guess about (or a legal corner case); returns (frame, src_port)."""
    port = rng.choice(WIRE)
    h = random_header(rng)
    kind = rng.randrange(12)
    if kind == 0:  # truncated anywhere
        f = header_frame(h, rng, vlans=rng.randrange(3), options=rng.randrange(11))
        return f[: rng.randrange(1, 60)], port
    if kind == 1:
        return bytes(Ether() / IPv6() / UDP()).ljust(60, b"\0"), port
    if kind == 2:
        return bytes(Ether() / ARP()).ljust(60, b"\0"), port
    if kind == 3:  # three tags
        return bytes(Ether() / Dot1Q() / Dot1Q() / Dot1Q() / IP() / UDP()).ljust(60, b"\0"), port
    # mostly one 802.1Q tag or none, so that the IPv4 checks below are reached (two tags are unfilterable)
    vlans = rng.choice((0, 0, 1, 1, 2))
    f = bytearray(header_frame(h, rng, vlans=vlans, options=rng.randrange(11), pad=rng.randrange(40), ad_share=0.1))
    l3 = 14
    while (f[l3 - 2] << 8 | f[l3 - 1]) in (0x8100, 0x88A8):
        l3 += 4
    if kind == 4:
        f[l3] = 0x60 | (f[l3] & 0xF)  # version 6 in an IPv4 ethertype
    elif kind == 5:
        f[l3] = 0x40 | rng.randrange(5)  # IHL < 5
    elif kind == 6:  # total length beyond the frame
        _set16(f, l3 + 2, len(f) - l3 + rng.randrange(1, 300))
    elif kind == 7:  # non-first fragment
        _set16(f, l3 + 6, rng.randrange(1, 0x2000) | rng.choice((0, 0x2000)))
    elif kind == 8:  # first fragment, MF set: a fragment too, unparsed
        _set16(f, l3 + 6, 0x2000)
    elif kind == 9:  # total length shorter than the header, or than the L4 bytes needed
        ihl = f[l3] & 0xF
        _set16(f, l3 + 2, ihl * 4 + rng.randrange(0, 3) - 1 if rng.random() < 0.7 else rng.randrange(ihl * 4))
    elif kind == 10:  # long header across beats: 1 tag, IHL 15, TCP
        h2 = Header(h.src, h.dst, 6, h.sport, h.dport, 0, 0, 0, rng.randrange(256))
        return header_frame(h2, rng, vlans=1, options=10, pad=rng.randrange(200), ad_share=0.0), port
    else:  # random bytes after the Ethernet header
        f[14:] = bytes(rng.randrange(256) for _ in range(len(f) - 14))
    if kind != 11:  # the field changed, not the checksum, is what the frame tests
        fix_checksum(f, l3)
    return bytes(f), port


def truncated_l4(rng: random.Random) -> tuple[bytes, int]:
    """A TCP/UDP/ICMP (or GRE) frame whose IPv4 total length leaves just around the kernel's L4 minimum.

    The L4 room (total length - IHL*4) is drawn near the edges that matter: the bytes the parser reads (TCP 14,
    UDP 4, ICMP 2) and the kernel's hotdrop minimum (TCP 20, UDP 8, ICMP 8); the frame keeps its full length, so
    only the total length makes the header short, as for a runt the sender padded.
    """
    port = rng.choice(WIRE)
    h = random_header(rng)
    proto = rng.choice((6, 17, 1, 47))
    h = Header(
        h.src,
        h.dst,
        proto,
        h.sport if proto in (6, 17) else 0,
        h.dport if proto in (6, 17) else 0,
        h.icmp_type if proto == 1 else 0,
        h.icmp_code if proto == 1 else 0,
        h.iport,
        h.tcp_flags if proto == 6 else 0,
    )
    vlans, options = rng.choice((0, 0, 1)), rng.choice((0, 0, 1, 10))
    f = bytearray(header_frame(h, rng, vlans=vlans, options=options, pad=rng.randrange(30), ad_share=0.0))
    l3 = 14 + 4 * vlans
    ihl = f[l3] & 0xF
    edges = {6: (14, 20), 17: (4, 8), 1: (2, 8), 47: (0, 8)}[proto]
    room = max(0, rng.choice(edges) + rng.randrange(-2, 3))
    _set16(f, l3 + 2, ihl * 4 + min(room, len(f) - l3 - ihl * 4))
    fix_checksum(f, l3)
    return bytes(f), port


def frames_for(plan, rng: random.Random, count: int, headers: list[Header] | None = None) -> list[tuple[bytes, int]]:
    """A mix of (frame, tuser): aimed at entries, trace headers when given, random, malformed, from the host."""
    boxes = [b for e in plan.entries for b in e.boxes if not b.is_empty()]
    out = []
    for _ in range(count):
        r = rng.random()
        if r < 0.45 and (boxes or headers):
            h = (
                rng.choice(headers)
                if headers and (not boxes or rng.random() < 0.5)
                else point_in_box(rng.choice(boxes), rng)
            )
            f, port = (
                header_frame(
                    h,
                    rng,
                    vlans=rng.choice((0, 0, 0, 1, 1, 2)),
                    options=rng.choice((0, 0, 0, 1, 10)),
                    pad=rng.randrange(64),
                    ad_share=0.2,
                ),
                PORT_OF_IPORT[h.iport],
            )
        elif r < 0.7:
            h = random_header(rng)
            f, port = header_frame(h, rng, vlans=rng.randrange(3), pad=rng.randrange(100)), PORT_OF_IPORT[h.iport]
        elif r < 0.9:
            q = rng.random()
            f, port = malformed(rng) if q < 0.5 else truncated_l4(rng) if q < 0.7 else kernel_apart(rng)
        else:
            f, port = header_frame(random_header(rng), rng, pad=rng.randrange(100)), rng.choice(HOST)
        out.append((f, tuser_for(f, port)))
    return out
