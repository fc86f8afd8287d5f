"""Unit tests of hypafilter.hw.model, the reference model of the hardware parser and decision."""

from __future__ import annotations

import pytest
from hypafilter.hw import model as hwmodel
from hypafilter.hw import vhdl
from hypafilter.ir import Box, Header, Policy, Rule
from hypafilter.shared import unpack_meta
from scapy.layers.inet import ICMP, IP, TCP, UDP
from scapy.layers.inet6 import IPv6
from scapy.layers.l2 import ARP, Dot1AD, Dot1Q, Ether
from scapy.packet import Raw


def frame(pkt) -> bytes:
    """The minimum Ethernet frame: an IPv4 datagram filled up inside (bytes after it make the frame unparsed)."""
    short = 60 - len(bytes(pkt))
    if short > 0 and IP in pkt:
        pkt = pkt / Raw(bytes(short))
    return bytes(pkt).ljust(60, b"\0")


def test_bytes_after_the_datagram_are_unparsed():
    """br_netfilter trims them before the filter runs, so the kernel forwards a shorter frame: only netfilter
    can do the same. Ethernet padding of a short frame is such bytes too."""
    for pkt in (Ether() / IP() / UDP(dport=53), Ether() / Dot1Q() / IP() / TCP(dport=80) / Raw(b"x" * 40)):
        exact = frame(pkt)
        assert hwmodel.parse_frame(exact, 0x01) is not None
        assert hwmodel.parse_frame(exact + b"\0", 0x01) is None
        assert hwmodel.parse_frame(exact + b"tail" * 10, 0x01) is None
    assert hwmodel.parse_frame(bytes(Ether() / IP() / UDP()).ljust(60, b"\0"), 0x01) is None


def test_parse_tcp_udp_icmp_and_iport():
    f = frame(Ether() / IP(src="10.1.2.3", dst="192.168.0.1") / TCP(sport=1234, dport=80, flags="SA"))
    assert hwmodel.parse_frame(f, 0x10) == Header(0x0A010203, 0xC0A80001, 6, 1234, 80, 0, 0, 2, 0x12)
    u = hwmodel.parse_frame(frame(Ether() / IP() / UDP(sport=53, dport=99)), 0x40)
    assert (u.proto, u.sport, u.dport, u.iport, u.tcp_flags) == (17, 53, 99, 3, 0)
    i = hwmodel.parse_frame(frame(Ether() / IP() / ICMP(type=8, code=3)), 0x01)
    assert (i.proto, i.sport, i.icmp_type, i.icmp_code) == (1, 0, 8, 3)
    gre = hwmodel.parse_frame(frame(Ether() / IP(proto=47)), 0x01)
    assert (gre.proto, gre.sport, gre.dport) == (47, 0, 0)


def _fix_checksum(b: bytearray, l3: int = 14) -> bytes:
    """The frame with its IPv4 header checksum made right after a field changed."""
    ihl = b[l3] & 0xF
    b[l3 + 10 : l3 + 12] = b"\0\0"
    b[l3 + 10 : l3 + 12] = (~hwmodel.ipv4_header_sum(bytes(b[l3 : l3 + ihl * 4])) & 0xFFFF).to_bytes(2, "big")
    return bytes(b)


def test_vlan_tags_and_options_cross_beats():
    for tag in (Dot1Q(vlan=7), Dot1AD(vlan=7)):  # the kernel pops one tag of either kind and filters the IPv4
        f = frame(Ether() / tag / IP(options=b"\x01" * 40) / TCP(dport=443, flags="S"))
        assert len(f) > 64 + 14  # L4 header beyond the first 512-bit beat
        h = hwmodel.parse_frame(f, 0x04)
        assert (h.dport, h.tcp_flags, h.iport) == (443, 0x02, 1)
        assert not hwmodel.unfilterable(f)


def test_unfilterable_vlan_stacks():
    """Two tags of either kind, in any order: netfilter on the bridge never filters them."""
    for pkt in (
        Ether() / Dot1AD(vlan=5) / Dot1AD(vlan=7) / IP() / UDP(),
        Ether() / Dot1AD(vlan=5) / Dot1Q(vlan=7) / IP() / UDP(),
        Ether() / Dot1Q(vlan=5) / Dot1Q(vlan=7) / IP() / UDP(),
        Ether() / Dot1Q(vlan=5) / Dot1AD(vlan=7) / IP() / UDP(),
        Ether() / Dot1Q() / Dot1Q() / Dot1Q() / IP() / UDP(),
        Ether() / Dot1AD() / Dot1Q() / ARP(),
    ):
        f = frame(pkt)
        assert hwmodel.unfilterable(f) and hwmodel.parse_frame(f, 0x01) is None, pkt.summary()
    qinq = frame(Ether() / Dot1Q() / Dot1Q() / IP() / UDP())
    assert hwmodel.unfilterable(qinq[:17]) is False  # no second tag to read: merely unparsed
    assert hwmodel.unfilterable(qinq[:18])
    assert not hwmodel.unfilterable(frame(Ether() / Dot1Q() / ARP()))
    assert not hwmodel.unfilterable(frame(Ether() / Dot1AD() / ARP()))
    assert not hwmodel.unfilterable(frame(Ether() / IP() / UDP()))


def test_link_local_groups_are_unparsed():
    for last in range(16):
        f = frame(Ether(dst=f"01:80:c2:00:00:{last:02x}") / IP() / UDP())
        assert hwmodel.parse_frame(f, 0x01) is None
    for dst in ("01:80:c2:00:00:10", "01:80:c2:00:01:00", "01:00:5e:00:00:01", "ff:ff:ff:ff:ff:ff"):
        assert hwmodel.parse_frame(frame(Ether(dst=dst) / IP() / UDP()), 0x01) is not None, dst


def test_ipv4_checksum_every_ihl():
    """A wrong header checksum (br_netfilter drops such packets) is unparsed, whatever the IHL; bytes after the
    header are not covered."""
    for ihl in range(5, 16):
        for tag in (False, True):
            l3 = 18 if tag else 14
            pkt = Ether() / Dot1Q() if tag else Ether()
            pkt = pkt / IP(options=b"\x01" * (4 * (ihl - 5)), id=ihl * 977) / TCP(dport=ihl)
            good = bytearray(frame(pkt))
            assert good[l3] & 0xF == ihl
            assert hwmodel.parse_frame(bytes(good), 0x01).dport == ihl
            for k in range(ihl * 4):
                b = bytearray(good)
                b[l3 + k] ^= 0x10
                assert hwmodel.parse_frame(bytes(b), 0x01) is None, (ihl, k)
            b = bytearray(good)
            b[l3 + ihl * 4 + 4] ^= 0x10  # TCP sequence number: not the IPv4 header's
            assert hwmodel.parse_frame(bytes(b), 0x01) is not None


def test_checksum_ones_complement_zero():
    """0x0000 and 0xFFFF are the same ones' complement number: ip_fast_csum accepts either where one is right."""
    b = bytearray(frame(Ether() / IP(id=0) / UDP()))
    b[24:26] = b"\0\0"
    s = hwmodel.ipv4_header_sum(bytes(b[14:34]))
    # choose the id so that the right checksum is 0x0000 (the rest of the header summing to 0xFFFF)
    b[18:20] = ((0xFFFF - s) % 0xFFFF).to_bytes(2, "big")
    assert hwmodel.ipv4_header_sum(bytes(b[14:34])) == 0xFFFF
    assert hwmodel.parse_frame(bytes(b), 1) is not None
    b[24:26] = b"\xff\xff"
    assert hwmodel.parse_frame(bytes(b), 1) is not None
    b[24:26] = b"\x00\x01"
    assert hwmodel.parse_frame(bytes(b), 1) is None


def test_unparsed_cases():
    good = bytearray(frame(Ether() / IP() / TCP()))
    assert hwmodel.parse_frame(bytes(good), 1) is not None
    for mutate in (
        lambda b: b.__setitem__(14, 0x65),  # version 6
        lambda b: b.__setitem__(14, 0x44),  # IHL 4
        lambda b: b.__setitem__(slice(16, 18), b"\x01\x00"),  # total length beyond the frame
        lambda b: b.__setitem__(slice(20, 22), b"\x00\x05"),  # fragment offset
        lambda b: b.__setitem__(slice(20, 22), b"\x20\x00"),  # first fragment (MF): a fragment all the same
        lambda b: b.__setitem__(slice(20, 22), b"\x3f\xff"),  # MF and the last offset
        lambda b: b.__setitem__(slice(16, 18), b"\x00\x1f"),  # total length cuts the TCP flags
    ):
        b = bytearray(good)
        mutate(b)
        assert hwmodel.parse_frame(_fix_checksum(b), 1) is None
    for flags in (b"\x40\x00", b"\x80\x00"):  # DF, reserved bit: not fragments
        b = bytearray(good)
        b[20:22] = flags
        assert hwmodel.parse_frame(_fix_checksum(b), 1) is not None
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
    return vhdl.minimal_plan(Policy(rules, "ACCEPT", original_rules=[("t",)]))


def test_decisions_ports_and_metadata():
    plan = _plan()
    regs = hwmodel.Regs.from_plan(plan)
    # the update buffer's rows after the policy entry: shunted with no action, as the core powers on
    assert regs.shunt == [0, 0, 1, 1] + [1] * 16 and regs.actions == [1, 2, 2, 1] + [0] * 16
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


def test_lease_counts_down_expires_rearms_and_disarms():
    """hw.model.Lease, the register hf_regs keeps (sim/hf_regs checks the RTL against it cycle by cycle)."""
    lease = hwmodel.Lease()
    lease.tick(5)
    assert (lease.left, lease.armed, lease.expired, lease.status()) == (0, False, False, 0)  # disarmed after reset
    lease.write(3)
    lease.tick()
    lease.tick()
    assert (lease.left, lease.expired, lease.status()) == (1, False, 0x1)
    lease.tick()
    assert (lease.left, lease.expired, lease.status()) == (0, True, 0x10003)
    lease.tick(1000)  # expired once: more ticks count no second expiry
    assert lease.status() == 0x10003
    lease.write(1000)  # a write re-arms it, also while expired
    assert not lease.expired and lease.left == 1000
    lease.tick(0xFFFFFFFF)  # the emulator's owed milliseconds in one cycle
    assert lease.expired and lease.expiries == 2
    lease.write(0)  # 0 disarms: never expired, whatever the ticks
    lease.tick(7)
    assert (lease.armed, lease.expired, lease.status()) == (False, False, 2 << 16)
    # a write in the cycle of an expiry: the expiry counts, the write wins (hf_regs: ticks first, then the write)
    lease.write(2)
    lease.tick(2)
    lease.write(9)
    assert (lease.expiries, lease.left, lease.expired) == (3, 9, False)
    assert hwmodel.lease_status(lease.status()) == {"armed": True, "expired": False, "expiries": 3}
    lease.expiries = hwmodel.LEASE_EXPIRIES_MAX  # saturates
    lease.tick(9)
    assert lease.status() >> 16 == 0xFFFF
    for bad in (-1, 1 << 32):
        with pytest.raises(ValueError, match="LEASE takes"):
            lease.write(bad)


def test_expired_lease_judges_no_wire_frame():
    """An expired lease acts as CONTROL bit 0 clear: every wire frame unparsed (k = 0 at the shim: the live rules
    decide it whole), two-tag frames included; frames from the host pass as always."""
    plan = _plan()
    regs = hwmodel.Regs.from_plan(plan)
    web = frame(Ether() / IP() / TCP(dport=80))
    qinq = frame(Ether() / Dot1Q() / Dot1Q() / IP() / TCP(dport=80))
    assert hwmodel.decide(plan, web, 0x01, regs).kind == hwmodel.Kind.FORWARD
    assert hwmodel.decide(plan, qinq, 0x01, regs).kind == hwmodel.Kind.DROP
    regs.lease_expired = True
    for f in (web, qinq, frame(Ether() / IP() / UDP())):
        d = hwmodel.decide(plan, f, 0x01, regs)
        assert (d.kind, d.dst_port, d.reason, d.match_index, d.counters) == (
            hwmodel.Kind.SHUNT,
            0x02,
            2,
            None,
            ("CNT_SHUNT_UNPARSED",),
        )
        assert (unpack_meta(d.meta)["reason"], unpack_meta(d.meta)["index"]) == (2, hwmodel.NO_INDEX)  # not judged
    assert hwmodel.decide(plan, web, 0x08, regs).kind == hwmodel.Kind.FORWARD  # from the host: unclassified
    off = hwmodel.Regs.from_plan(plan)
    off.control = 0
    assert hwmodel.decide(plan, web, 0x01, off) == hwmodel.decide(plan, web, 0x01, regs)


def test_unfilterable_dropped_counted_or_passed():
    plan = _plan()
    qinq = frame(Ether() / Dot1Q() / Dot1Q() / IP() / TCP(dport=80))
    regs = hwmodel.Regs.from_plan(plan)
    assert regs.control == hwmodel.CONTROL_ENABLE
    d = hwmodel.decide(plan, qinq, 0x01, regs)
    assert (d.kind, d.match_index, d.counters) == (hwmodel.Kind.DROP, None, ("CNT_DROP_UNFILTERABLE",))
    regs.control |= hwmodel.CONTROL_SHUNT_ALL  # not a policy decision: shunt-all leaves it dropped
    assert hwmodel.decide(plan, qinq, 0x01, regs).kind == hwmodel.Kind.DROP
    assert hwmodel.decide(plan, qinq, 0x02, regs).kind == hwmodel.Kind.FORWARD  # from the host: unclassified
    passing = hwmodel.Regs.from_plan(plan, "pass")
    assert passing.control == hwmodel.CONTROL_ENABLE | hwmodel.CONTROL_PASS_UNFILTERABLE
    d = hwmodel.decide(plan, qinq, 0x01, passing)
    assert (d.kind, d.dst_port, d.reason, d.counters) == (hwmodel.Kind.SHUNT, 0x02, 2, ("CNT_SHUNT_UNPARSED",))
    regs.control = 0  # classification off: every wire frame goes to the host
    assert hwmodel.decide(plan, qinq, 0x01, regs).reason == 2
    c = hwmodel.Counters(len(plan.entries))
    c.add(hwmodel.decide(plan, qinq, 0x01, hwmodel.Regs.from_plan(plan)), 0x01)
    assert c.regs == {"CNT_DROP_UNFILTERABLE": 1, "PKTIN": 1} and sum(c.hits) == 0
    with pytest.raises(ValueError, match="drop or pass"):
        hwmodel.unfilterable_control("forward")


def test_host_mode_delivers_hardware_accepts_with_reason_decided():
    """CONTROL bit 3: ACCEPT goes to the ingress port's DMA queue with reason 5 and is counted as forwarded; DROP,
    SHUNT and frames from the host are as in bridge mode."""
    plan = _plan()
    regs = hwmodel.Regs.from_plan(plan, nic_mode="host")
    assert regs.control == hwmodel.CONTROL_ENABLE | hwmodel.CONTROL_HOST_MODE == 0x9
    regs.generation = 7
    web = frame(Ether() / IP() / TCP(dport=80))
    d = hwmodel.decide(plan, web, 0x10, regs)
    assert (d.kind, d.dst_port, d.match_index, d.reason, d.counters) == (
        hwmodel.Kind.FORWARD,
        0x20,
        0,
        hwmodel.REASON_DECIDED,
        ("CNT_FORWARDED",),
    )
    assert hwmodel.REASON_DECIDED == 5
    assert unpack_meta(d.meta) == {"index": 0, "action": 1, "reason": 5, "generation": 7, "magic": 0x4846}
    assert hwmodel.out_tuser(60 | 0x10 << 16, d) == 60 | 0x10 << 16 | 0x20 << 24 | d.meta << 64
    assert hwmodel.decide(plan, frame(Ether() / IP() / UDP()), 0x40, regs).kind == hwmodel.Kind.DROP
    d = hwmodel.decide(plan, frame(Ether() / IP(proto=47)), 0x10, regs)
    assert (d.kind, d.reason) == (hwmodel.Kind.SHUNT, 0)
    assert hwmodel.decide(plan, web, 0x08, regs).dst_port == 0x04  # from the host: unchanged
    regs.control |= hwmodel.CONTROL_SHUNT_ALL
    assert hwmodel.decide(plan, web, 0x01, regs).reason == 0  # shunt-all still wins
    c = hwmodel.Counters(len(plan.entries))
    c.add(hwmodel.decide(plan, web, 0x01, hwmodel.Regs.from_plan(plan, nic_mode="host")), 0x01)
    assert c.regs == {"CNT_FORWARDED": 1, "PKTIN": 1, "PKTOUT": 1} and c.hits[0] == 1
    with pytest.raises(ValueError, match="bridge or host"):
        hwmodel.nic_mode_control("auto")


def test_miss_forcing_precedence():
    """CONTROL bits 4/5 (Plan.miss_shunt): a frame with ct = 0 whose verdict would be ACCEPT (DROP) is shunted with
    reason 3, match_index and action kept; after unparsed (2), the entry's shunt bit, a non-decisive action and
    shunt-everything (0/1), before host-mode ACCEPT (5); a flow-cache hit (ct 1/2) is decided as before."""
    plan = _plan()
    web = frame(Ether() / IP() / TCP(dport=80))
    udp = frame(Ether() / IP() / UDP())
    gre = frame(Ether() / IP(proto=47))  # entry 3: shunt bit set
    plan.miss_shunt = (True, True)
    regs = hwmodel.Regs.from_plan(plan)
    assert regs.control == hwmodel.CONTROL_ENABLE | hwmodel.CONTROL_MISS_SHUNT == 0x31
    for f, idx, action in ((web, 0, 1), (udp, 1, 2)):
        d = hwmodel.decide(plan, f, 0x04, regs)
        assert (d.kind, d.dst_port, d.match_index, d.action, d.reason) == (hwmodel.Kind.SHUNT, 0x08, idx, action, 3)
        assert d.counters == ("CNT_SHUNT_STATE",) and not d.forced
        assert unpack_meta(d.meta) == {"index": idx, "action": action, "reason": 3, "generation": 0, "magic": 0x4846}
        for ct in (1, 2):
            hit = hwmodel.decide(plan, f, 0x04, regs, ct=ct)
            assert hit.kind == (hwmodel.Kind.FORWARD if action == 1 else hwmodel.Kind.DROP) and hit.reason is None
    assert hwmodel.decide(plan, gre, 0x01, regs).reason == hwmodel.REASON_OVERRULE  # the shunt bit first
    assert hwmodel.decide(plan, frame(Ether() / ARP()), 0x01, regs).reason == hwmodel.REASON_UNPARSED
    regs.control |= hwmodel.CONTROL_SHUNT_ALL
    d = hwmodel.decide(plan, web, 0x01, regs)
    assert (d.reason, d.forced) == (hwmodel.REASON_OVERRULE, True)  # shunt-everything before miss forcing
    # host mode: only DROP is forced; an ACCEPT is delivered as decided (the host's conntrack sees it)
    plan.miss_shunt = (False, True)
    host = hwmodel.Regs.from_plan(plan, nic_mode="host")
    assert host.control == hwmodel.CONTROL_ENABLE | hwmodel.CONTROL_HOST_MODE | hwmodel.CONTROL_MISS_SHUNT_DROP
    assert hwmodel.decide(plan, web, 0x01, host).reason == hwmodel.REASON_DECIDED
    assert hwmodel.decide(plan, udp, 0x01, host).reason == hwmodel.REASON_STATE == 3
    host.control |= hwmodel.CONTROL_MISS_SHUNT_ACCEPT  # both bits: forcing comes before the host-mode ACCEPT
    assert hwmodel.decide(plan, web, 0x01, host).reason == hwmodel.REASON_STATE
    c = hwmodel.Counters(len(plan.entries))
    c.add(hwmodel.decide(plan, udp, 0x01, host), 0x01)
    assert c.regs == {"CNT_SHUNT_STATE": 1, "PKTIN": 1, "PKTOUT": 1} and c.hits[1] == 1
