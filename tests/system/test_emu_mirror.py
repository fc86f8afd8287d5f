"""System test of log mirroring on the emulated NIC (ACTION bit 3): the real Verilator core between veth pairs.

A mirrored ACCEPT leaves the core as one frame with two dst_port bits; the emulator (as SUME's output queues)
delivers it once on the paired wire port, untagged, and once on the ingress port's host port with the in-band tag
(metadata reason 4, action 1). A mirrored DROP reaches only the host port (reason 4, action 2); in host mode a
mirrored ACCEPT reaches only the host port (reason 4, action 1); a shunt bit takes precedence over the mirror bit.
The expectations are the contract's (notes s5-mirror.md, docs/hardware.md), written out, not taken from hw.model.
"""

from __future__ import annotations

import pytest

from conftest import ROOT, need_root, need_tool
from tests.system.test_emu import collect, drain, make_plan, port_sockets, port_table, untag

pytestmark = pytest.mark.system

NS_NIC, NS_OUT = "vmir-nic", "vmir-out"
PORTS = port_table("v")
MIRROR = 0x8  # HF_ACTION_MIRROR_BIT
GEN = 0x0321
MAGIC = 0x4846


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    need_root()
    need_tool("ghdl", "verilator", "make", "g++", "ip", "ethtool")
    from hypafilter.targets.emu import EmuNic, build
    from hypafilter.targets.emu.ports import remove

    plan, cfg = make_plan()
    # make_plan's entries: 0 tcp/22 DROP, 1 udp/53 from 10.0.1.0/24 ACCEPT, 2 udp/9 DROP, 3 icmp ACCEPT; the policy
    # entry 4 (ACCEPT) is shunted (a complex rule comes before it)
    assert [int(a) for a in plan.actions] == [2, 1, 2, 1, 1] and [int(b) for b in plan.shunt] == [0, 0, 0, 0, 1]
    binary = build(plan, cfg, build_root=ROOT / "build")
    socks = port_sockets(NS_NIC, NS_OUT, PORTS, mtu=1600)
    nic = EmuNic(
        binary, {r: v[0] for r, v in PORTS.items()}, name="vm", netns=NS_NIC, run_dir=tmp_path_factory.mktemp("vm")
    )
    nic.start()
    try:
        with nic.client() as c:
            c.program(plan, GEN)
            for i in (1, 2, 4):  # mirror the udp/53 ACCEPT, the udp/9 DROP and the (shunted) policy entry
                c.write_table("ACTION", i, int(plan.actions[i]) | MIRROR)
                assert c.read_table("ACTION", i) == int(plan.actions[i]) | MIRROR
        yield nic, socks
    finally:
        assert nic.stop() == 0
        for s in socks.values():
            s.close()
        remove(NS_NIC, NS_OUT)


def frame(udp_dport: int | None, src: str, tag: int) -> bytes:
    from scapy.layers.inet import IP, TCP, UDP
    from scapy.layers.l2 import Ether

    l4 = UDP(sport=1000, dport=udp_dport) if udp_dport else TCP(sport=1000, dport=80, flags="S")
    p = Ether(src="02:00:00:00:00:01", dst="02:00:00:00:00:02") / IP(src=src, dst="10.9.0.2") / l4
    return bytes(p / (f"hf-mirror-{tag:04d}".encode() + bytes(range(40))))  # nothing after the datagram: parsed


def meta(reason: int, action: int, index: int) -> int:
    return MAGIC << 48 | GEN << 32 | reason << 28 | action << 24 | index


def exchange(socks, sends: list[tuple[str, bytes]]) -> dict[str, list[bytes]]:
    drain(socks)
    for role, f in sends:
        socks[role].send(f)
    return collect(socks)


def where(got: dict[str, list[bytes]], f: bytes) -> dict[str, list]:
    """Per port, the copies of f that came out: the frame itself on a wire port, M of each tagged copy on a host."""
    out: dict[str, list] = {}
    for role, frames in got.items():
        for x in frames:
            if PORTS[role][2] & 0xAA:
                m, inner = untag(x)
                if inner == f:
                    out.setdefault(role, []).append(m)
            elif x == f:
                out.setdefault(role, []).append(None)
    return out


def test_mirrored_frames_once_on_the_wire_once_tagged_at_the_host(lab):
    nic, socks = lab
    accept0 = frame(53, "10.0.1.5", 1)  # entry 1, mirrored ACCEPT, from wire0
    accept1 = frame(53, "10.0.1.6", 2)  # the same entry from wire1
    drop0 = frame(9, "10.9.0.1", 3)  # entry 2, mirrored DROP
    policy0 = frame(None, "10.9.0.1", 4)  # tcp/80: the policy entry, shunted although its mirror bit is set
    plain0 = frame(53, "10.0.2.5", 5)  # udp/53 from outside 10.0.1.0/24: policy entry as well
    with nic.client() as c:
        c.clear_counters()
        got = exchange(socks, [("wire0", accept0), ("wire1", accept1), ("wire0", drop0), ("wire0", policy0)])
        counters = c.counters()
    assert where(got, accept0) == {"wire1": [None], "host0": [meta(4, 1, 1)]}
    assert where(got, accept1) == {"wire0": [None], "host1": [meta(4, 1, 1)]}
    assert where(got, drop0) == {"host0": [meta(4, 2, 2)]}
    assert where(got, policy0) == {"host0": [meta(1, 1, 4)]}  # reason 1, action 1: no mirror bit in M
    assert sum(len(v) for v in got.values()) == 6, got
    nonzero = {k: v for k, v in counters.items() if v}
    assert nonzero == {
        "PKTIN": 4,
        "PKTOUT": 4,  # frames out of the core: a mirrored ACCEPT is one frame with two dst_port bits
        "CNT_FORWARDED": 2,
        "CNT_DROPPED": 1,
        "CNT_MIRROR": 3,
        "CNT_SHUNT_POLICY": 1,
    }, nonzero
    # host mode: the mirrored ACCEPT is delivered once, with reason 4 (not 5), nothing on the wire
    with nic.client() as c:
        control = c.read("CONTROL")
        c.write("CONTROL", control | 0x8)
        try:
            got = exchange(socks, [("wire0", accept0), ("wire0", drop0), ("wire0", plain0)])
        finally:
            c.write("CONTROL", control)
    assert where(got, accept0) == {"host0": [meta(4, 1, 1)]}
    assert where(got, drop0) == {"host0": [meta(4, 2, 2)]}
    assert where(got, plain0) == {"host0": [meta(1, 1, 4)]}
    assert sum(len(v) for v in got.values()) == 3, got
