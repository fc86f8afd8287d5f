"""Unit tests of hypafilter.hwmodel, the reference model of the hardware parser and decision."""

from __future__ import annotations

from hypafilter.hw import model as hwmodel
from hypafilter.hw import vhdl as hwgen
from hypafilter.ir import Box, Header, Policy, Rule
from hypafilter.shared import unpack_meta
from scapy.layers.inet import ICMP, IP, TCP, UDP
from scapy.layers.inet6 import IPv6
from scapy.layers.l2 import ARP, Dot1AD, Dot1Q, Ether


def frame(pkt) -> bytes:
    return bytes(pkt).ljust(60, b"\0")


def test_parse_tcp_udp_icmp_and_iport():
    f = frame(Ether() / IP(src="10.1.2.3", dst="192.168.0.1") / TCP(sport=1234, dport=80, flags="SA"))
    assert hwmodel.parse_frame(f, 0x10) == Header(0x0A010203, 0xC0A80001, 6, 1234, 80, 0, 0, 2, 0x12)
    u = hwmodel.parse_frame(frame(Ether() / IP() / UDP(sport=53, dport=99)), 0x40)
    assert (u.proto, u.sport, u.dport, u.iport, u.tcp_flags) == (17, 53, 99, 3, 0)
    i = hwmodel.parse_frame(frame(Ether() / IP() / ICMP(type=8, code=3)), 0x01)
    assert (i.proto, i.sport, i.icmp_type, i.icmp_code) == (1, 0, 8, 3)
    gre = hwmodel.parse_frame(frame(Ether() / IP(proto=47)), 0x01)
    assert (gre.proto, gre.sport, gre.dport) == (47, 0, 0)


def test_vlan_tags_and_options_cross_beats():
    pkt = Ether() / Dot1AD(vlan=5) / Dot1Q(vlan=7) / IP(options=b"\x01" * 40) / TCP(dport=443, flags="S")
    f = frame(pkt)
    assert len(f) > 64 + 14  # L4 header beyond the first 512-bit beat
    h = hwmodel.parse_frame(f, 0x04)
    assert (h.dport, h.tcp_flags, h.iport) == (443, 0x02, 1)
    assert hwmodel.parse_frame(frame(Ether() / Dot1Q() / Dot1Q() / Dot1Q() / IP() / UDP()), 0x01) is None


def test_unparsed_cases():
    good = bytearray(frame(Ether() / IP() / TCP()))
    assert hwmodel.parse_frame(bytes(good), 1) is not None
    for mutate in (
        lambda b: b.__setitem__(14, 0x65),  # version 6
        lambda b: b.__setitem__(14, 0x44),  # IHL 4
        lambda b: b.__setitem__(slice(16, 18), b"\x01\x00"),  # total length beyond the frame
        lambda b: b.__setitem__(slice(20, 22), b"\x00\x05"),  # fragment offset
        lambda b: b.__setitem__(slice(16, 18), b"\x00\x1f"),  # total length cuts the TCP flags
    ):
        b = bytearray(good)
        mutate(b)
        assert hwmodel.parse_frame(bytes(b), 1) is None
    mf = bytearray(good)
    mf[20:22] = b"\x20\x00"  # first fragment, MF set: parsed
    assert hwmodel.parse_frame(bytes(mf), 1) is not None
    assert hwmodel.parse_frame(bytes(good[:40]), 1) is None  # truncated
    assert hwmodel.parse_frame(frame(Ether() / IPv6() / UDP()), 1) is None
    assert hwmodel.parse_frame(frame(Ether() / ARP()), 1) is None


def _plan():
    full = Box.full()
    rules = [
        Rule((full.with_field("proto", 6, 6).with_field("dport", 80, 80),), "ACCEPT"),
        Rule((full.with_field("proto", 17, 17),), "DROP"),
        Rule((full.with_field("proto", 1, 1),), "LOG"),
        Rule((full.with_field("proto", 47, 47),), "DROP"),
    ]
    return hwgen.minimal_plan(Policy(rules, "ACCEPT", original_rules=[("t",)]))


def test_decisions_ports_and_metadata():
    plan = _plan()
    regs = hwmodel.Regs.from_plan(plan)
    assert regs.shunt == [0, 0, 1, 1] and regs.actions == [1, 2, 2, 1]
    web = frame(Ether() / IP() / TCP(dport=80))
    d = hwmodel.decide(plan, web, 0x01, regs)
    assert (d.kind, d.dst_port, d.match_index, d.meta) == (hwmodel.Kind.FORWARD, 0x04, 0, None)
    d = hwmodel.decide(plan, frame(Ether() / IP() / UDP()), 0x40, regs)
    assert (d.kind, d.match_index) == (hwmodel.Kind.DROP, 1)
    d = hwmodel.decide(plan, frame(Ether() / IP(proto=47)), 0x10, regs)  # after the complex rule: shunted
    assert (d.kind, d.dst_port, d.match_index, d.reason) == (hwmodel.Kind.SHUNT, 0x20, 2, 0)
    assert unpack_meta(d.meta) == {"index": 2, "action": 2, "reason": 0, "generation": 0, "magic": 0x4846}
    d = hwmodel.decide(plan, frame(Ether() / ARP()), 0x04, regs)
    assert (d.kind, d.dst_port, d.reason, d.match_index) == (hwmodel.Kind.SHUNT, 0x08, 2, 3)
    d = hwmodel.decide(plan, web, 0x08, regs)  # from the host: to the paired MAC of that DMA queue
    assert (d.kind, d.dst_port, d.match_index) == (hwmodel.Kind.FORWARD, 0x04, None)
    t = hwmodel.out_tuser(0xAB_0000_0000 | 60 | 0x01 << 16, hwmodel.decide(plan, web, 0x01, regs))
    assert t == 0xAB_0000_0000 | 60 | 0x01 << 16 | 0x04 << 24


def test_control_bits_and_generation():
    plan = _plan()
    regs = hwmodel.Regs.from_plan(plan)
    web = frame(Ether() / IP() / TCP(dport=80))
    regs.control, regs.generation = 3, 0x12345
    d = hwmodel.decide(plan, web, 0x01, regs)
    assert d.kind == hwmodel.Kind.SHUNT and d.forced and d.counters == ("CNT_SHUNT_OVERRULE", "CNT_SHUNT_FORCED")
    assert unpack_meta(d.meta)["generation"] == 0x2345
    regs.control = 0
    d = hwmodel.decide(plan, web, 0x01, regs)
    assert (d.kind, d.reason) == (hwmodel.Kind.SHUNT, 2)
    c = hwmodel.Counters(len(plan.entries))
    c.add(d, 0x01)
    assert c.regs == {"CNT_SHUNT_UNPARSED": 1, "PKTIN": 1, "PKTOUT": 1} and sum(c.hits) == 0
