"""System test of NicClient's flow-cache API on the running emulated NIC (Verilator core with its flow cache, veth
ports): inserts, finds, deletes, collisions in one set, entries and counters read back, frames through the wire
counted per flow, and CONTROL bits 4/5 (a miss shunted with reason 3, a hit decided in hardware)."""

from __future__ import annotations

import socket

import pytest

from conftest import ROOT, need_root, need_tool
from tests.system.test_emu import check_against_model, collect, drain, port_sockets, untag

pytestmark = pytest.mark.system

LAB = "ffc"
NS_NIC, NS_OUT = f"{LAB}-nic", f"{LAB}-out"
PORTS = {
    "wire0": ("wire0", "w0p", 0x01),
    "host0": ("host0", "h0p", 0x02),
    "wire1": ("wire1", "w1p", 0x04),
    "host1": ("host1", "h1p", 0x08),
}
MISS_ACCEPT, MISS_DROP = 1 << 4, 1 << 5


def make_plan():
    """UDP to port 53 in on MAC1 dropped (iport 1, a `--physdev-in` rule's field), UDP to port 53 from 10.0.1.0/24
    accepted, TCP to 22 dropped, everything else accepted (policy)."""
    import dataclasses

    from hypafilter.analysis.plan import build_plan
    from hypafilter.config import Config

    from tests.irbuild import make_policy, make_rule

    mac1 = make_rule("DROP", proto="udp", dport=(53, 53))
    rules = [
        dataclasses.replace(mac1, boxes=tuple(b.with_field("iport", 1, 1) for b in mac1.boxes)),
        make_rule("DROP", proto="tcp", dport=(22, 22)),
        make_rule("ACCEPT", src="10.0.1.0/24", proto="udp", dport=(53, 53)),
    ]
    cfg = Config()  # the emulator's default flow cache: 10:4
    return build_plan(make_policy(rules, "ACCEPT", source="test_flow_api"), cfg), cfg


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    need_root()
    need_tool("ghdl", "verilator", "make", "g++", "ip", "ethtool")
    from hypafilter.targets.emu import EmuNic, build
    from hypafilter.targets.emu.ports import remove

    plan, cfg = make_plan()
    binary = build(plan, cfg, build_root=ROOT / "build")
    socks = port_sockets(NS_NIC, NS_OUT, PORTS, mtu=1600)
    nic = EmuNic(
        binary, {r: v[0] for r, v in PORTS.items()}, name=LAB, netns=NS_NIC, run_dir=tmp_path_factory.mktemp("emu")
    ).start()
    client = nic.client()
    client.program(plan, 1)
    yield client, socks, plan
    client.close()
    for s in socks.values():
        s.close()
    try:
        assert nic.stop() == 0
    finally:
        remove(NS_NIC, NS_OUT)


def frame(flow, payload: bytes = b"hf-flow") -> bytes:
    from scapy.layers.inet import IP, TCP, UDP
    from scapy.layers.l2 import Ether

    def a(v: int) -> str:
        return socket.inet_ntoa(v.to_bytes(4, "big"))

    l4 = (
        UDP(sport=flow.sport, dport=flow.dport)
        if flow.proto == 17
        else TCP(sport=flow.sport, dport=flow.dport, flags="A")
    )
    return bytes(
        Ether(src="02:00:00:00:00:01", dst="02:00:00:00:00:02") / IP(src=a(flow.src), dst=a(flow.dst)) / l4 / payload
    )


def ip(text: str) -> int:
    return int.from_bytes(socket.inet_aton(text), "big")


def test_flow_api_on_the_emulated_nic(setup):
    from hypafilter.hw import flowcache as fc
    from hypafilter.hw.flowcache import Flow
    from hypafilter.shared import unpack_meta

    c, socks, plan = setup
    cfg = c.flow_config()
    assert (cfg.log2_sets, cfg.ways, cfg.ts_w) == (10, 4, 32)
    c.flow_clear()
    start = c.flow_counters()
    assert start["occupancy"] == 0

    dns = Flow(ip("10.0.1.5"), ip("10.9.0.2"), 17, 4000, 53)
    web = Flow(ip("10.9.0.7"), ip("10.0.1.9"), 6, 40000, 443)
    ssh = Flow(ip("10.9.0.1"), ip("10.9.0.2"), 6, 1000, 22)
    flows = [dns, web, ssh]
    slots = {}
    for fl in flows:
        key = fc.canonical(fl)[0]
        status, slot = c.flow_insert(fl)
        assert (status, slot) == (fc.ST_OK, fc.slot(0, fc.set_index(key, cfg.log2_sets), cfg.log2_sets))
        slots[fl] = slot
    assert c.flow_insert(dns.reply()) == (fc.ST_EXISTS, slots[dns])
    assert c.flow_find(web.reply()) == (fc.ST_OK, slots[web])
    assert c.flow_find(Flow(1, 2, 17, 3, 4))[0] == fc.ST_NOT_FOUND
    entries = {r.slot: r for r in c.flow_entries()}
    assert {r.flow for r in entries.values()} == set(flows)
    assert all(not r.counted and r.seen == 0 and r.hits == 0 for r in entries.values())

    # frames through the wire: each frame of a cached flow is a hit of its entry, in either direction
    drain(socks)
    now0 = c.flow_counters()["now"]
    sent = [("wire0", dns)] * 3 + [("wire1", dns.reply())] * 2 + [("wire0", web)] * 4
    for role, fl in sent:
        socks[role].send(frame(fl))
    collect(socks, expect=len(sent))
    entries = {r.slot: r for r in c.flow_entries()}
    now1 = c.flow_counters()["now"]
    assert entries[slots[dns]].hits == 5 and entries[slots[web]].hits == 4 and entries[slots[ssh]].hits == 0
    assert entries[slots[dns]].counted and not entries[slots[ssh]].counted
    # The stamp is FC_NOW at the hit, which may not have ticked since now0 was read (it was 0 before the frames).
    assert 0 < now0 <= entries[slots[dns]].seen <= now1, (now0, entries[slots[dns]].seen, now1)

    # CONTROL bits 4 and 5: a miss whose verdict is ACCEPT or DROP goes to the host with reason 3; a hit does not
    control = c.read("CONTROL")
    c.write("CONTROL", control | MISS_ACCEPT | MISS_DROP)
    try:
        stranger = Flow(ip("10.0.1.6"), ip("10.9.0.2"), 17, 4001, 53)  # ACCEPT, not cached
        blocked = Flow(ip("10.9.0.1"), ip("10.9.0.2"), 6, 1001, 22)  # DROP, not cached
        drain(socks)
        for fl, payload in ((dns, b"hit"), (stranger, b"miss"), (blocked, b"miss-drop"), (ssh, b"hit-drop")):
            socks["wire0"].send(frame(fl, payload))
        got = collect(socks, expect=3)
        assert frame(dns, b"hit") in got["wire1"]
        tagged = [untag(x) for x in got["host0"]]
        assert sorted(f for _, f in tagged) == sorted([frame(stranger, b"miss"), frame(blocked, b"miss-drop")])
        assert all(unpack_meta(m)["reason"] == 3 for m, _ in tagged)
        assert sum(len(v) for v in got.values()) == 3, "the hit of the DROP flow must be dropped"
        assert c.read("CNT_SHUNT_STATE") >= 2
    finally:
        c.write("CONTROL", control)

    # collisions: a set holds `ways` flows; the next is refused and counted in FC_FULL
    target = fc.set_index(fc.canonical(dns)[0], cfg.log2_sets)
    crowd, port = [], 1
    while len(crowd) < cfg.ways:
        fl = Flow(ip("10.7.0.1"), ip("10.7.0.2"), 17, port, 9)
        port += 1
        if fc.set_index(fc.canonical(fl)[0], cfg.log2_sets) == target:
            crowd.append(fl)
    results = [c.flow_insert(fl) for fl in crowd]
    assert [s for s, _ in results] == [fc.ST_OK] * (cfg.ways - 1) + [fc.ST_FULL]
    counters = c.flow_counters()
    assert counters["full"] == start["full"] + 1
    assert counters["inserts"] == start["inserts"] + 3 + cfg.ways - 1
    assert counters["occupancy"] == 3 + cfg.ways - 1

    # deletes: by either direction; then not found, and gone from the entries
    assert c.flow_delete(web.reply()) == (fc.ST_OK, slots[web])
    assert c.flow_delete(web) == (fc.ST_NOT_FOUND, 0)
    assert c.flow_find(web)[0] == fc.ST_NOT_FOUND
    assert web not in {r.flow for r in c.flow_entries()}
    assert c.flow_counters()["deletes"] == start["deletes"] + 1
    c.flow_clear()
    assert c.flow_entries() == [] and c.flow_counters()["occupancy"] == 0


def test_a_write_changes_no_other_register(setup):
    """A register write changes that register alone (issue #24: CONTROL read 0 on the emulated NIC under the attack
    bench). The register case's `when others => null` became a latch in GHDL 2.0's Verilog: a write of an address
    outside the case (the conntrack membership registers, which the flow sync service writes every renewal, or a
    read-only one) loaded CONTROL, GENERATION, ... with a stale multiplexer value, such as the data of the bus's last
    write. Here each register is read (as `status` reads CONTROL) after a write of data 0 (the flow sync service's
    FC_SLOT), then another address is written: every register must keep its value."""
    c, _, _ = setup
    control, generation = c.read("CONTROL"), c.read("GENERATION")
    want = {"CONTROL": control | MISS_ACCEPT | MISS_DROP, "GENERATION": 0x2345, "DEBUG": 0x5A5A5A5A}
    window = c.read("CTM_WINDOW")
    try:
        c.write_many(list(want.items()))
        for other, value in (("CTM_WINDOW", window), ("CTM_LEASE", 0), ("CTM_CONTROL", 0), ("PKTIN", 0)):
            for reg in want:
                c.write("FC_SLOT", 0)
                c.read(reg)
                c.write(other, value)
                have = {r: c.read(r) for r in want}
                assert have == want, f"after {reg} read and a write of {other}: {have}, want {want}"
    finally:
        c.write_many([("CONTROL", control), ("GENERATION", generation), ("DEBUG", 0)])


def test_iport_of_each_frame_is_its_own(setup):
    """The ingress port of each frame (`iport`): GHDL 2.0's Verilog of the header parser's `case` over the source port
    dropped its `when others` branch (MAC0: iport 0), a latch in the emulator's model that gave a MAC0 frame the iport
    of the MAC1 frame before it (docs/hardware.md, "Known GHDL 2.0 synthesis traps"). The same frame from each wire
    port, one after the other, decided as hw.model says: dropped from MAC1, forwarded from MAC0."""
    from hypafilter.hw import model as hwmodel
    from hypafilter.hw.flowcache import Flow

    c, socks, plan = setup
    c.flow_clear()
    regs = hwmodel.Regs.from_plan(plan)
    dns = frame(Flow(ip("10.0.1.5"), ip("10.9.0.2"), 17, 4000, 53))
    before = c.counters()
    for role in ("wire1", "wire0", "wire1", "wire0"):
        check_against_model(socks, plan, regs, [(role, dns)])
    after = c.counters()
    assert after["CNT_DROPPED"] - before["CNT_DROPPED"] == 2
    assert after["CNT_FORWARDED"] - before["CNT_FORWARDED"] == 2


def test_a_clients_batch_does_not_hold_another_clients_request(setup):
    """Each control-socket client gets a slice of the model's time in turn (issue #24: on the attack bench's
    11,100-entry core the policy sync service's lease renewal, one write, waited behind the flow sync service's
    pipelined batches and its 1,000 ms lease ran out about ten times a minute). One client sends a long batch of
    table reads at once; a second client meanwhile reads a register again and again and must get many answers before
    the batch's end. The emulator that served all a client had sent (up to one 64 KiB read of its socket) before the
    next client answered the second client about once per 64 KiB of the batch."""
    import threading
    import time

    c, _, _ = setup
    path = c.t.path
    lines = "".join(f"T R FLOW_KEY {i % 4096}\n" for i in range(12000)).encode()
    chunks = -(-len(lines) // 65536)
    a = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    b = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    a.settimeout(60)
    b.settimeout(60)
    got = bytearray()
    done = threading.Event()

    def read_batch():
        try:
            while got.count(b"\n") < 12000:
                chunk = a.recv(1 << 16)
                if not chunk:
                    break
                got.extend(chunk)
        finally:
            done.set()

    try:
        a.connect(path)
        b.connect(path)
        reader = threading.Thread(target=read_batch)
        reader.start()
        t0 = time.monotonic()
        a.sendall(lines)
        answered = 0
        while not done.is_set():
            b.sendall(b"R 0x0\n")
            assert b.recv(64).startswith(b"OK")
            answered += 1
        total = time.monotonic() - t0
        reader.join()
    finally:
        a.close()
        b.close()
    assert got.count(b"OK") == 12000, "every request of the batch answered"
    print(
        f"12,000 table reads ({len(lines)} bytes, {chunks} x 64 KiB) in {total:.3f} s; the other client: {answered} reads"
    )
    assert answered > 3 * chunks, f"the other client got {answered} answers during a {total:.3f} s batch"
