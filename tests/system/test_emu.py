"""System test of the emulated NIC: real Verilator core between veth pairs, checked frame by frame against hwmodel."""

from __future__ import annotations

import contextlib
import os
import socket
import struct
import time
from pathlib import Path

import pytest

from conftest import ROOT, need_root, need_tool

pytestmark = pytest.mark.system

NS_NIC, NS_OUT = "hfte-nic", "hfte-out"


def port_table(prefix: str = "") -> dict[str, tuple[str, str, int]]:
    """NIC role -> (interface in the NIC's namespace, its peer outside: prefix + w0p/h0p/w1p/h1p, one-hot TUSER
    port)."""
    roles = (("wire0", 0x01), ("host0", 0x02), ("wire1", 0x04), ("host1", 0x08))
    return {role: (role, f"{prefix}{role[0]}{role[-1]}p", bit) for role, bit in roles}


PORTS = port_table()
ETH_P_ALL = 0x0003
SOL_PACKET, PACKET_AUXDATA = 263, 8
TP_STATUS_VLAN_VALID, TP_STATUS_VLAN_TPID_VALID = 0x10, 0x40
TAG = 0x88B5


def make_plan():
    """A small policy built straight from the IR: simple DROP/ACCEPT entries, one complex rule, policy ACCEPT."""
    from hypafilter.analysis.plan import build_plan
    from hypafilter.config import Config

    from tests.irbuild import make_policy, make_rule

    rules = [
        make_rule("DROP", proto="tcp", dport=(22, 22)),
        make_rule("ACCEPT", src="10.0.1.0/24", proto="udp", dport=(53, 53)),
        make_rule("REJECT", proto="tcp", dport=(80, 80), complex=[("-m", "conntrack", "--ctstate", "NEW")]),
        make_rule("DROP", proto="udp", dport=(9, 9)),
        make_rule("ACCEPT", proto="icmp"),
    ]
    cfg = Config()
    return build_plan(make_policy(rules, "ACCEPT", source="test_emu"), cfg), cfg


@pytest.fixture(scope="session")
def emu_binary():
    need_root()
    need_tool("ghdl", "verilator", "make", "g++", "ip", "ethtool")
    from hypafilter.targets.emu import build

    plan, cfg = make_plan()
    return build(plan, cfg, build_root=ROOT / "build"), plan


def port_sockets(ns_nic: str, ns_out: str, ports: dict, mtu: int) -> dict[str, socket.socket]:
    """veth pairs between the NIC's namespace and `ns_out` for `ports` (role -> (NIC interface, peer, ...)),
    offloads off on the peers, and per role a non-blocking raw socket on its peer with PACKET_AUXDATA (VLAN tags)."""
    from hypafilter import netns
    from hypafilter.targets.emu.ports import veth_ports

    veth_ports(ns_nic, ns_out, [(nic_if, peer) for nic_if, peer, *_ in ports.values()], mtu=mtu)
    for _, peer, *_ in ports.values():
        netns.offloads_off(peer, ns_out)
    socks = {}
    with netns.inside(ns_out):
        for role, (_, peer, *_) in ports.items():
            s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
            s.bind((peer, ETH_P_ALL))
            s.setsockopt(SOL_PACKET, PACKET_AUXDATA, 1)
            s.setblocking(False)
            socks[role] = s
    return socks


@pytest.fixture(scope="module")
def topo():
    need_root()
    from hypafilter.targets.emu.ports import remove

    # MTU 2000 on the wire side lets the test send an oversize frame; the host side must carry the tag.
    socks = port_sockets(NS_NIC, NS_OUT, PORTS, mtu=2000)
    yield socks
    for s in socks.values():
        s.close()
    remove(NS_NIC, NS_OUT)


@pytest.fixture(scope="module")
def nic(emu_binary, topo, tmp_path_factory):
    from hypafilter.hw import updatebuffer
    from hypafilter.targets.emu import EmuNic
    from hypafilter.targets.nic import pack_shunt

    binary, plan = emu_binary
    run = tmp_path_factory.mktemp("emu")
    n = EmuNic(binary, {r: v[0] for r, v in PORTS.items()}, name="t1", netns=NS_NIC, run_dir=run).start()
    rows = updatebuffer.rows(plan)  # the entries, the policy entry, the update buffer's slots
    with n.client() as c:
        power_on = {
            "SHUNT": [c.read_table("SHUNT", w) for w in range(len(pack_shunt([0] * rows)))],
            "ACTION": [c.read_table("ACTION", i) for i in range(rows)],
            "BUF_CONFIG": c.read("BUF_CONFIG"),
            "IND_CONFIG": c.read("IND_CONFIG"),
            "image": c.read_image(),
            "overlay": c.read_overlay(),
        }
        c.program(plan, 0)  # what deploy does before traffic; power-on contents are checked separately
    n.power_on = power_on
    yield n
    assert n.stop() == 0
    assert not n.ctl_path.exists()


def test_power_on_tables_shunt_everything(nic, emu_binary):
    """The emulator's core comes out of reset shunting every entry (before any program()): the build serves every
    plan with the same matcher, so its power-on tables belong to none of them and must be safe for all. Its update
    buffer is empty (every entry valid, every slot disabled, their rows without action)."""
    from hypafilter.hw import updatebuffer
    from hypafilter.ir import ACTION_DROP
    from hypafilter.targets.nic import pack_shunt

    _, plan = emu_binary
    n, depth = len(plan.entries), updatebuffer.buffer_depth(plan)
    assert nic.power_on["SHUNT"] == pack_shunt([1] * (n + 1 + depth))
    # the update buffer's rows have no action; its slots are disabled and every static entry is valid
    assert nic.power_on["ACTION"] == [ACTION_DROP] * (n + 1) + [0] * depth
    assert nic.power_on["BUF_CONFIG"] == depth | 16 << 16 | 11 << 24 and nic.power_on["IND_CONFIG"] == n + 1 + depth
    assert nic.power_on["image"] == updatebuffer.pristine(n, depth)
    assert nic.power_on["overlay"] == ([True] * n, [])


def test_same_matcher_same_binary_other_matcher_refused(nic, emu_binary):
    """A plan that differs only in shunt bits and actions reuses the build and is programmed by registers, with
    only the changed words written; a plan with other hardware entries is refused by the running core."""
    import dataclasses

    import numpy as np
    from hypafilter.config import Config
    from hypafilter.targets.emu import build
    from hypafilter.targets.nic import NicError

    binary, plan = emu_binary
    shunt = np.array(plan.shunt, dtype=bool)
    shunt[0] = not shunt[0]
    actions = np.array(plan.actions, dtype=np.uint8)
    actions[1] = 3 - actions[1]  # ACCEPT <-> DROP
    other = dataclasses.replace(plan, shunt=shunt, actions=actions, policy_hash="0" * 64)
    assert build(other, Config(), build_root=ROOT / "build") == binary
    with nic.client() as c:
        try:
            before = c.program(plan, 5)
            after = c.program(other, 6, known=before)
            assert after["writes"] == 3  # one SHUNT word, one ACTION entry, GENERATION
            assert c.read_table("SHUNT", 0) == after["shunt"][0] and c.read_table("ACTION", 1) == actions[1]
            moved = dataclasses.replace(plan, entries=plan.entries[1:] + plan.entries[:1])
            with pytest.raises(NicError, match="MATCHER_HASH"):
                c.program(moved, 7)
        finally:
            c.program(plan, 0)


def drain(socks) -> None:
    for s in socks.values():
        while True:
            try:
                s.recv(65535)
            except BlockingIOError:
                break


def collect(socks, quiet: float = 0.4, limit: float = 5.0, expect: int | None = None) -> dict[str, list[bytes]]:
    """Frames arriving (PACKET_HOST / OTHERHOST) on each peer until `quiet` seconds pass without one."""
    got: dict[str, list[bytes]] = {r: [] for r in socks}
    start = last = time.monotonic()
    while time.monotonic() - last < quiet and time.monotonic() - start < limit:
        busy = False
        for role, s in socks.items():
            while True:
                try:
                    data, anc, _, addr = s.recvmsg(65535, socket.CMSG_SPACE(32))
                except BlockingIOError:
                    break
                if addr[2] == socket.PACKET_OUTGOING:
                    continue
                got[role].append(with_vlan(data, anc))
                busy = True
        if busy:
            last = time.monotonic()
        if expect is not None and sum(len(v) for v in got.values()) >= expect:
            break
        time.sleep(0.005)
    return got


def with_vlan(data: bytes, anc) -> bytes:
    """The frame as it was on the wire: the kernel moves an 802.1Q tag into PACKET_AUXDATA."""
    for level, kind, raw in anc:
        if level == SOL_PACKET and kind == PACKET_AUXDATA:
            status, _, _, _, _, tci, tpid = struct.unpack("IIIHHHH", raw[:20])
            if status & TP_STATUS_VLAN_VALID:
                tpid = tpid if status & TP_STATUS_VLAN_TPID_VALID else 0x8100
                return data[:12] + struct.pack("!HH", tpid, tci) + data[12:]
    return data


def frames():
    """Frames covering forward, drop, shunt (overrule / policy), unparsed (fragments, bad checksum, link-local
    groups) and unfilterable (two tags); each carries a unique id in its payload."""
    from scapy.layers.inet import ICMP, IP, TCP, UDP
    from scapy.layers.l2 import ARP, Dot1AD, Dot1Q, Ether

    eth = Ether(src="02:00:00:00:00:01", dst="02:00:00:00:00:02")
    out = []
    specs = [
        eth / IP(src="10.9.0.1", dst="10.9.0.2") / TCP(sport=1000, dport=22, flags="S"),
        eth / IP(src="10.0.1.5", dst="10.9.0.2") / UDP(sport=1000, dport=53),
        eth / IP(src="10.0.2.5", dst="10.9.0.2") / UDP(sport=1000, dport=53),
        eth / IP(src="10.9.0.1", dst="10.9.0.2") / TCP(sport=1000, dport=80, flags="S"),
        eth / IP(src="10.9.0.1", dst="10.9.0.2") / UDP(sport=1000, dport=9),
        eth / IP(src="10.9.0.1", dst="10.9.0.2") / ICMP(type=8),
        eth / Dot1Q(vlan=7) / IP(src="10.9.0.1", dst="10.9.0.2") / UDP(sport=5, dport=9),
        eth / IP(src="10.9.0.1", dst="10.9.0.2", frag=10) / UDP(sport=1000, dport=9),
        eth / ARP(psrc="10.9.0.1", pdst="10.9.0.2"),
        eth / Dot1AD(vlan=5) / IP(src="10.0.1.5", dst="10.9.0.2") / UDP(sport=1000, dport=53),
        eth / Dot1AD(vlan=5) / Dot1Q(vlan=6) / IP(src="10.0.1.5", dst="10.9.0.2") / UDP(sport=1000, dport=53),
        eth / Dot1Q(vlan=5) / Dot1Q(vlan=6) / IP(src="10.0.1.5", dst="10.9.0.2") / UDP(sport=1000, dport=53),
        Ether(src="02:00:00:00:00:01", dst="01:80:c2:00:00:0e") / IP(src="10.0.1.5") / UDP(sport=1000, dport=53),
        eth / IP(src="10.0.1.5", dst="10.9.0.2", chksum=0x1234) / UDP(sport=1000, dport=53),
        eth / IP(src="10.0.1.5", dst="10.9.0.2", flags="MF") / UDP(sport=1000, dport=53),
        eth / Dot1Q(vlan=7) / IP(src="10.0.1.5", dst="10.9.0.2", options=b"\x01" * 40) / UDP(sport=1000, dport=53),
    ]
    for i, p in enumerate(specs):
        out.append(bytes(p / f"hf-test-{i:04d}".encode()) + bytes(range(40)))
    out.append(bytes(eth / IP(src="10.9.0.1", dst="10.9.0.2") / UDP(sport=7, dport=7) / (b"L" * 1400)))
    return out


def untag(frame: bytes) -> tuple[int, bytes]:
    assert int.from_bytes(frame[12:14], "big") == TAG, f"host frame without the in-band tag: {frame[:24].hex()}"
    return int.from_bytes(frame[14:22], "big"), frame[:12] + frame[22:]


def check_against_model(socks, plan, regs, sent: list[tuple[str, bytes]]) -> None:
    """Send frames and compare every output with hwmodel.decide for the same frame and register state."""
    from hypafilter.hw import model as hwmodel

    drain(socks)
    for role, f in sent:
        socks[role].send(f)
    expect_n = 0
    expected = []
    for role, f in sent:
        d = hwmodel.decide(plan, f, PORTS[role][2], regs)
        expected.append((role, f, d))
        expect_n += d.kind != hwmodel.Kind.DROP
    got = collect(socks, expect=None)
    for role, f, d in expected:
        if d.kind == hwmodel.Kind.DROP:
            for frames_ in got.values():
                assert f not in frames_, f"dropped frame came out: {f[:40].hex()}"
            continue
        out_role = {v[2]: r for r, v in PORTS.items()}[d.dst_port]
        if PORTS[out_role][2] & 0xAA:  # host port: tagged with the model's metadata
            tagged = [untag(x) for x in got[out_role]]
            assert (d.meta, f) in tagged, (
                f"{role} frame {f[:40].hex()}: expected tagged on {out_role} with M=0x{d.meta:016x}; got {[hex(m) for m, _ in tagged]}"
            )
        else:
            assert f in got[out_role], f"{role} frame {f[:40].hex()}: expected on {out_role}"
    total = sum(len(v) for v in got.values())
    assert total == expect_n, f"{total} frames came out, the model predicts {expect_n}"


def test_wire_frames_follow_the_model(nic, topo, emu_binary):
    from hypafilter.hw import model as hwmodel

    _, plan = emu_binary
    regs = hwmodel.Regs.from_plan(plan)
    check_against_model(topo, plan, regs, [("wire0", f) for f in frames()] + [("wire1", f) for f in frames()[:3]])


def test_update_buffer_in_the_emulated_core(nic, topo, emu_binary):
    """The running core takes a changed policy as an update buffer (analysis.overlay.align: a rule inserted in front,
    one deleted, one inserted before the last), programmed by NicClient.program(View) through the GHDL Verilog netlist
    the emulator runs: read back as written, every frame as hw.model says under those registers (the inserted DROP
    wins over the static ACCEPT, the deleted DROP's frames fall through), then emptied again by program(plan)."""
    from hypafilter.analysis.overlay import align, box_key
    from hypafilter.analysis.plan import build_plan
    from hypafilter.hw import model as hwmodel
    from hypafilter.hw import updatebuffer

    from tests.irbuild import make_policy, make_rule

    _, plan = emu_binary
    n = len(plan.entries)
    rules = list(plan.policy.rules)
    changed = [make_rule("DROP", src="10.0.1.0/24", proto="udp", dport=(53, 53))] + rules[1:]
    changed.insert(len(changed) - 1, make_rule("DROP", proto="icmp"))
    master = build_plan(make_policy(changed, "ACCEPT", source="test_emu changed"), make_plan()[1])
    view = align(plan.entries, master, updatebuffer.buffer_depth(plan))
    assert view.slots and not view.valid.all()
    from scapy.layers.inet import ICMP, IP, TCP, UDP
    from scapy.layers.l2 import Ether

    eth = Ether(src="02:00:00:00:00:01", dst="02:00:00:00:00:02")
    specs = [  # parsed frames (the datagram ends the frame), one per kind of change
        IP(src="10.0.1.5", dst="10.9.0.2") / UDP(sport=1000, dport=53),  # the inserted DROP (a slot)
        IP(src="10.0.2.5", dst="10.9.0.2") / UDP(sport=1000, dport=53),  # the policy entry, as before
        IP(src="10.9.0.1", dst="10.9.0.2") / TCP(sport=1000, dport=22, flags="A"),  # the deleted DROP: masked
        IP(src="10.9.0.1", dst="10.9.0.2") / UDP(sport=1000, dport=9),  # a static DROP, kept
        IP(src="10.9.0.1", dst="10.9.0.2") / ICMP(type=8),  # the static ICMP entry's row: the new DROP
        IP(src="10.9.0.1", dst="10.9.0.2") / TCP(sport=1000, dport=80, flags="S"),  # the complex rule: shunted
    ]
    sent = [
        (r, bytes(eth / (p / f"hf-buf-{r}-{i:02d}".encode()))) for r in ("wire0", "wire1") for i, p in enumerate(specs)
    ]
    regs = hwmodel.Regs.from_plan(view)
    hits = [hwmodel.decide(plan, f, PORTS[r][2], regs) for r, f in sent]
    before = [hwmodel.decide(plan, f, PORTS[r][2], hwmodel.Regs.from_plan(plan)) for r, f in sent]
    assert [d.kind for d in hits[:5]] == [hwmodel.Kind.DROP, hwmodel.Kind.SHUNT, hwmodel.Kind.SHUNT] + [
        hwmodel.Kind.DROP
    ] * 2
    assert [d.kind for d in before[:5]] == [hwmodel.Kind.FORWARD, hwmodel.Kind.SHUNT] + [hwmodel.Kind.DROP] * 2 + [
        hwmodel.Kind.FORWARD
    ]
    assert hits[0].match_index > n and (before[2].match_index, hits[2].match_index) == (0, n)  # a slot; masked
    with nic.client() as c:
        try:
            written = c.program(view, 9)
            assert c.read_overlay() == (view.valid.tolist(), box_key(view.overlay))
            assert c.read("CONTROL") & hwmodel.CONTROL_SHUNT_ALL == 0  # its own bracket is closed again
            regs.generation = 9
            check_against_model(topo, plan, regs, sent)
            c.program(plan, 0, known=written)
            assert c.read_overlay() == ([True] * n, [])
            check_against_model(topo, plan, hwmodel.Regs.from_plan(plan), sent)
        finally:
            c.program(plan, 0)


def test_host_frames_pass_unclassified(nic, topo, emu_binary):
    from hypafilter.hw import model as hwmodel

    _, plan = emu_binary
    regs = hwmodel.Regs.from_plan(plan)
    fs = frames()
    drain(topo)
    check_against_model(topo, plan, regs, [("host1", f) for f in fs] + [("host0", fs[0])])


def test_registers_and_counters(nic, topo, emu_binary):
    from hypafilter.hw.vhdl import matcher_hash
    from hypafilter.targets.nic import CORE_ID

    _, plan = emu_binary
    with nic.client() as c:
        info = c.info()
        assert info["ID"] == CORE_ID
        assert info["NUM_ENTRIES"] == len(plan.entries)
        assert info["MATCHER_HASH"] == int(matcher_hash(plan)[-8:], 16)
        c.write("FLIP", 0x12345678)
        assert c.read("FLIP") == 0xEDCBA987
        c.write("GENERATION", 0x1234)
        assert c.read("GENERATION") == 0x1234
        try:
            _count_frames(c, topo, plan)
        finally:
            c.write("GENERATION", 0)


def _count_frames(c, topo, plan) -> None:
    from hypafilter.hw import model as hwmodel

    regs = hwmodel.Regs.from_plan(plan)
    regs.generation = 0x1234
    c.clear_counters()
    assert all(v == 0 for v in c.counters().values())
    fs = [("wire0", f) for f in frames()] * 3
    expect = hwmodel.Counters(len(plan.entries))
    for role, f in fs:
        src = PORTS[role][2]
        expect.add(hwmodel.decide(plan, f, src, regs), src)
    check_against_model(topo, plan, regs, fs)
    got = c.counters(hits=True)
    for name, value in expect.regs.items():
        assert got[name] == value, f"{name}: core {got[name]}, model {value}"
    for name in got:
        if name != "HITS" and name not in expect.regs:
            assert got[name] == 0, f"{name} counted {got[name]}, the model nothing"
    assert [got["HITS"][i] for i in range(len(plan.entries) + 1)] == expect.hits


def test_shunt_rewrite_and_shunt_all(nic, topo, emu_binary):
    from hypafilter.hw import model as hwmodel
    from hypafilter.targets.nic import pack_shunt

    _, plan = emu_binary
    regs = hwmodel.Regs.from_plan(plan)
    fs = [("wire0", f) for f in frames()[:6]]
    with nic.client() as c:
        try:
            # Shunt entry 0 (tcp/22 DROP) and 3 (udp/9 DROP): those frames now reach the host with reason 0.
            regs.shunt[0] = regs.shunt[3] = 1
            c.write_table_many("SHUNT", 0, pack_shunt(regs.shunt))
            assert c.read_table("SHUNT", 0) == pack_shunt(regs.shunt)[0]
            check_against_model(topo, plan, regs, fs)
            c.set_shunt_all(True)
            regs.control |= hwmodel.CONTROL_SHUNT_ALL
            check_against_model(topo, plan, regs, fs)
        finally:
            c.set_shunt_all(False)
            c.program(plan, 0)
        check_against_model(topo, plan, hwmodel.Regs.from_plan(plan), fs)


def test_shunt_all_now_sets_the_bit_in_one_request(nic, topo, emu_binary):
    """The policy sync service's fail safe on the emulated NIC (EmuTarget.shunt_all_now: one `S` request, the
    connection kept): CONTROL bit 1 set and every other bit left, frames shunted as the model says; again on a
    connection the NIC closed meanwhile (it reconnects)."""
    from hypafilter.config import Config
    from hypafilter.hw import model as hwmodel
    from hypafilter.targets.emu.target import EmuTarget

    _, plan = emu_binary
    fs = [("wire0", f) for f in frames()[:6]]
    info = {"socket": str(nic.ctl_path)}
    tgt = EmuTarget(Config())
    with nic.client() as c:
        before = c.read("CONTROL")
        try:
            assert not before & hwmodel.CONTROL_SHUNT_ALL
            tgt.shunt_all_now(info)
            assert c.read("CONTROL") == before | hwmodel.CONTROL_SHUNT_ALL
            regs = hwmodel.Regs.from_plan(plan)
            regs.control = before | hwmodel.CONTROL_SHUNT_ALL
            check_against_model(topo, plan, regs, fs)
            c.set_shunt_all(False)
            EmuTarget._fast[info["socket"]].sock.close()  # as if the NIC had closed it
            tgt.shunt_all_now(info)
            assert c.read("CONTROL") == before | hwmodel.CONTROL_SHUNT_ALL
        finally:
            c.write("CONTROL", before)
            EmuTarget._fast.pop(info["socket"]).close()


def test_unfilterable_dropped_or_passed(nic, topo, emu_binary):
    """Frames with two VLAN tags: dropped and counted by default, shunted as unparsed with PASS_UNFILTERABLE."""
    from hypafilter.hw import model as hwmodel

    _, plan = emu_binary
    fs = [("wire0", f) for f in frames()]
    unfilterable = [f for _, f in fs if hwmodel.unfilterable(f)]
    assert len(unfilterable) == 2
    with nic.client() as c:
        try:
            c.clear_counters()
            check_against_model(topo, plan, hwmodel.Regs.from_plan(plan), fs)
            assert c.read("CNT_DROP_UNFILTERABLE") == len(unfilterable)
            c.program(plan, 0, unfilterable="pass")
            assert c.read("CONTROL") & hwmodel.CONTROL_PASS_UNFILTERABLE
            check_against_model(topo, plan, hwmodel.Regs.from_plan(plan, "pass"), fs)
            assert c.read("CNT_DROP_UNFILTERABLE") == len(unfilterable)
        finally:
            c.program(plan, 0)
        assert c.read("CONTROL") == hwmodel.CONTROL_ENABLE


def test_oversize_dropped_and_counted(nic, topo):
    from scapy.layers.inet import IP, UDP
    from scapy.layers.l2 import Ether

    before = nic.stats()["ports"]["wire0"]["rx_oversize"]
    big = bytes(Ether() / IP(src="10.9.0.1", dst="10.9.0.2") / UDP(sport=1, dport=2) / (b"x" * 1700))
    drain(topo)
    topo["wire0"].send(big)
    got = collect(topo, quiet=0.3)
    assert all(big not in v for v in got.values())
    assert nic.stats()["ports"]["wire0"]["rx_oversize"] == before + 1


def test_socket_buffer_overflow_counted(nic, topo):
    """Frames that reach wire0 while its socket's buffer is full are dropped by the kernel before the NIC sees them:
    counted (`rx_dropped`), every frame sent either taken or counted so. Before, nothing showed them."""
    import signal

    frame = bytes.fromhex("02000000009902484600010188b6") + b"x" * 1500  # unparsed by the core
    before = nic.stats()["ports"]["wire0"]
    drain(topo)
    sent = 0
    os.kill(nic.pid, signal.SIGSTOP)  # a NIC that falls behind, as under load
    try:
        # ~9 MB: more than the socket's buffer holds (SO_RCVBUFFORCE 4 MB, doubled by the kernel)
        for _ in range(6000):
            with contextlib.suppress(BlockingIOError):
                sent += topo["wire0"].send(frame) > 0
    finally:
        os.kill(nic.pid, signal.SIGCONT)
    collect(topo, quiet=0.5, limit=10.0)
    after = nic.stats()["ports"]["wire0"]
    rx, dropped = after["rx"] - before["rx"], after["rx_dropped"] - before["rx_dropped"]
    assert dropped > 0 and rx + dropped == sent, (rx, dropped)


def test_idle_nic_uses_no_cpu(nic):
    time.sleep(0.3)
    pid = nic.pid

    def cpu() -> float:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    a = cpu()
    time.sleep(1.0)
    assert cpu() - a < 0.05


def test_standby_then_activate_replaces_without_duplicates(nic, topo, emu_binary, tmp_path):
    """Make-before-break: a second NIC on the same interfaces sits in standby, then takes over."""
    from hypafilter.hw import model as hwmodel
    from hypafilter.targets.emu import EmuNic

    binary, plan = emu_binary
    regs = hwmodel.Regs.from_plan(plan)
    fs = [("wire0", f) for f in frames()[:6]]
    new = EmuNic(
        binary, {r: v[0] for r, v in PORTS.items()}, name="t2", netns=NS_NIC, standby=True, run_dir=tmp_path
    ).start()
    try:
        with new.client() as c:
            c.program(plan, 9)  # deploy programs the replacement while it stands by
        check_against_model(topo, plan, regs, fs)  # the old NIC alone answers: generation 0, each frame once
        assert new.stats()["ports"]["wire0"]["rx"] == 0
        nic.deactivate()
        new.activate()
        regs.generation = 9
        check_against_model(topo, plan, regs, fs)
        assert new.stats()["ports"]["wire0"]["rx"] == len(fs)
        new.deactivate()
        nic.activate()
        check_against_model(topo, plan, hwmodel.Regs.from_plan(plan), fs)
    finally:
        assert new.stop() == 0


def test_control_socket_errors(nic):
    from hypafilter.targets.nic import EmuTransport, NicError

    t = EmuTransport(nic.ctl_path)
    try:
        for bad in (
            "R 5",
            "R 0x1000",
            "W 0x10",
            "T R NOPE 0",
            "T W 0 0",
            "FROB",
            "W 0x10 0x1ffffffff",
            "S 0x35 1",
            "S 0x34",
            "S 0x34 0x1ffffffff",
        ):
            with pytest.raises(NicError):
                t.request(bad)
        assert int(t.request("R 0"), 0) == 0x48594641  # still serving after the errors
    finally:
        t.close()


def test_bad_interface_is_a_clear_error(emu_binary, tmp_path):
    from hypafilter.targets.emu import EmuError, EmuNic

    binary, _ = emu_binary
    ifs = {"wire0": "nope0", "wire1": "nope1", "host0": "nope2", "host1": "nope3"}
    with pytest.raises(EmuError, match="nope0"):
        EmuNic(binary, ifs, name="bad", run_dir=tmp_path, disable_offloads=False).start()
