"""Test traffic for the core testbenches: frames aimed at plan entries, random frames, malformed frames."""

from __future__ import annotations

import random

from hypafilter.ir import FIELDS, Header
from scapy.layers.inet import IP, UDP
from scapy.layers.inet6 import IPv6
from scapy.layers.l2 import ARP, Dot1Q, Ether

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
    f = bytearray(header_frame(h, rng, vlans=rng.randrange(3), options=rng.randrange(11), pad=rng.randrange(40)))
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
    elif kind == 8:  # first fragment, MF set: parsed
        _set16(f, l3 + 6, 0x2000)
    elif kind == 9:  # total length shorter than the header, or than the L4 bytes needed
        ihl = f[l3] & 0xF
        _set16(f, l3 + 2, ihl * 4 + rng.randrange(0, 3) - 1 if rng.random() < 0.7 else rng.randrange(ihl * 4))
    elif kind == 10:  # long header across beats: 2 tags, IHL 15, TCP
        h2 = Header(h.src, h.dst, 6, h.sport, h.dport, 0, 0, 0, rng.randrange(256))
        return header_frame(h2, rng, vlans=2, options=10, pad=rng.randrange(200)), port
    else:  # random bytes after the Ethernet header
        f[14:] = bytes(rng.randrange(256) for _ in range(len(f) - 14))
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
    vlans, options = rng.choice((0, 0, 1, 2)), rng.choice((0, 0, 1, 10))
    f = bytearray(header_frame(h, rng, vlans=vlans, options=options, pad=rng.randrange(30)))
    l3 = 14 + 4 * vlans
    ihl = f[l3] & 0xF
    edges = {6: (14, 20), 17: (4, 8), 1: (2, 8), 47: (0, 8)}[proto]
    room = max(0, rng.choice(edges) + rng.randrange(-2, 3))
    _set16(f, l3 + 2, ihl * 4 + min(room, len(f) - l3 - ihl * 4))
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
                    vlans=rng.choice((0, 0, 0, 1, 2)),
                    options=rng.choice((0, 0, 0, 1, 10)),
                    pad=rng.randrange(64),
                ),
                PORT_OF_IPORT[h.iport],
            )
        elif r < 0.7:
            h = random_header(rng)
            f, port = header_frame(h, rng, vlans=rng.randrange(3), pad=rng.randrange(100)), PORT_OF_IPORT[h.iport]
        elif r < 0.9:
            f, port = malformed(rng) if rng.random() < 0.75 else truncated_l4(rng)
        else:
            f, port = header_frame(random_header(rng), rng, pad=rng.randrange(100)), rng.choice(HOST)
        out.append((f, tuser_for(f, port)))
    return out
