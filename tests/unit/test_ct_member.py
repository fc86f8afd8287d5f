"""The conntrack membership structure's Python side: the reference (hw/ctmember.py: hashes, counting, sticky
counters, refused deletes, egress stamps) and the service's `Members` (ops/flowsync/members.py): which tuples go in
and out for which conntrack entries, the full load, and when COMPLETE's lease is renewed (the sync-lag argument of
docs/flowsync.md "New flows on the NIC")."""

from __future__ import annotations

import socket
import zlib

from hypafilter.hw import ctmember as cm
from hypafilter.hw.flowcache import KEY_BITS, Flow
from hypafilter.ops.flowsync.events import IPS_CONFIRMED, IPS_DST_NAT, CtEvent
from hypafilter.ops.flowsync.members import LEASE_MS, MARGIN_MS, Members, entry_keys


def test_crc32c_and_bank_indices():
    assert cm.crc32c(b"123456789") == 0xE3069283  # the CRC-32C check value
    f = Flow(0x0A000001, 0xC0A80001, 6, 40000, 80)
    key = cm.key_of(f)
    assert key == cm.key_of(f.reply())
    b = key.to_bytes(KEY_BITS // 8, "big")
    a, c = zlib.crc32(b), cm.crc32c(b)
    assert cm.bank_indices(key, 16) == (a & 0xFFFF, c & 0xFFFF, a >> 16, c >> 16)
    assert cm.egress_index(key, 12) == ((a ^ c) >> 8) & 0xFFF
    assert cm.cmd_words(cm.OP_DELETE, f) == [f.src, f.dst, 40000 << 16 | 80, 2 << 8 | 6]
    assert cm.parse_config(cm.ctm_config(16, 12)) == (16, 12) and cm.parse_config(0) is None


def test_counting_sticky_refused_and_egress():
    m = cm.CtMember(8, 4, window=100)
    k1, k2 = cm.key_of(Flow(1, 2, 6, 3, 4)), cm.key_of(Flow(5, 6, 17, 7, 8))
    assert not m.member(k1)
    m.insert(k1)
    m.insert(k1)
    assert m.delete(k1) and m.member(k1)
    assert m.delete(k1) and not m.member(k1)
    assert not m.delete(k2) and m.refused == 1 and m.members == 0  # never inserted: nothing changes
    for _ in range(cm.COUNTER_MAX + 3):
        m.insert(k2)
    assert m.saturated >= 1
    for _ in range(cm.COUNTER_MAX + 3):
        m.delete(k2)
    assert m.member(k2)  # sticky: a permanent possible member, never a lost one
    m.egress(k1, 1000)
    assert m.possible(k1, 1099) and not m.possible(k1, 1100)
    assert not m.recent(k1, 999 + 2**32)  # a stamp from the future after a wrap reads old, not recent


def test_shunt_stamps_and_the_decision():
    """A key handed to the host is shunted for a window (not a member: its frames still get ct 3), and the decision
    sends a frame with ct 3 whose key is shunted to the host with reason 3 and no index (the whole policy in
    software); ct 0 frames and frames of other keys are decided as before."""
    from hypafilter.hw import model as hwmodel
    from hypafilter.hw import vhdl
    from hypafilter.ir import Box, Policy, Rule
    from hypafilter.ops.verify import PROTO_TCP, build_frame

    m = cm.CtMember(8, 4, window=100)
    fl = Flow(0x0A000001, 0xC0A80001, 6, 40000, 80)
    k = cm.key_of(fl)
    m.shunt(k, 1000)
    assert m.shunted(cm.key_of(fl.reply()), 1099) and not m.shunted(k, 1100)
    assert not m.possible(k, 1050)
    tcp = Box.full().with_field("proto", 6, 6)
    rules = [Rule((Box.full().with_field("ct", 1, 2),), "ACCEPT"), Rule((tcp.with_field("dport", 80, 80),), "ACCEPT")]
    plan = vhdl.minimal_plan(Policy(rules, "DROP", original_rules=[("shunt stamps",)]))
    regs = hwmodel.Regs.from_plan(plan)
    regs.control = hwmodel.CONTROL_ENABLE | hwmodel.CONTROL_MISS_SHUNT_ACCEPT
    regs.shunt_none = [0] * len(regs.shunt)
    h = {"proto": PROTO_TCP, "src": fl.dst, "dst": fl.src, "sport": 80, "dport": 40000, "flags": 0x14}
    reply = build_frame(7, h, b"")
    assert hwmodel.decide(plan, reply, 0x01, regs, ct=3).kind == hwmodel.Kind.DROP  # NEW: the policy drops it
    d = hwmodel.decide(plan, reply, 0x01, regs, ct=3, shunted=True)
    assert (d.kind, d.dst_port, d.reason, d.match_index) == (hwmodel.Kind.SHUNT, 0x02, hwmodel.REASON_STATE, None)
    assert d.meta & 0xFFFFFF == hwmodel.NO_INDEX and d.counters == ("CNT_SHUNT_STATE",)
    assert hwmodel.decide(plan, reply, 0x01, regs, ct=0, shunted=True) == hwmodel.decide(plan, reply, 0x01, regs)


def ev(kind: str, src="10.0.0.1", dst="10.0.1.1", sport=40000, dport=80, reply=None, status=IPS_CONFIRMED, proto=6):
    return CtEvent(
        kind=kind,
        family=socket.AF_INET,
        proto=proto,
        src=src,
        dst=dst,
        sport=sport,
        dport=dport,
        reply=reply or (dst, src, dport, sport),
        status=status,
    )


def test_entry_keys_nat_and_protocols():
    plain = ev("new")
    assert len(entry_keys(plain)) == 1
    nat = ev("new", reply=("10.0.9.9", "100.64.0.1", 80, 61000), status=IPS_CONFIRMED | IPS_DST_NAT)
    keys = entry_keys(nat)
    assert len(keys) == 2 and keys[1] == cm.key_of(Flow(0x0A000909, 0x64400001, 6, 80, 61000))
    assert entry_keys(ev("new", proto=1, sport=0, dport=0)) == ()


class Recorder:
    """What the service writes to the NIC: the commands and COMPLETE's writes, applied to a reference structure."""

    def __init__(self):
        self.m = cm.CtMember(12)
        self.complete: list[int] = []

    def ctm_commands(self, cmds):
        for op, f in cmds:
            if op == cm.OP_CLEAR:
                self.m.clear()
            elif op == cm.OP_INSERT:
                self.m.insert(cm.key_of(f))
            else:
                assert self.m.delete(cm.key_of(f)), "a delete of a key the service never inserted"

    def ctm_wait_idle(self):
        pass

    def ctm_idle(self):
        return True

    def ctm_complete(self, lease_ms: int):
        self.complete.append(lease_ms)


class SlowSweep(Recorder):
    """A core whose clear's sweep lasts `sweep` status reads (the emulated core clocks only while it is read; an
    11,100-entry core's sweep took 9.4 s): a CTM_CMD write meanwhile would wait on the bus for the rest of it, and
    waiting for it holds up the service's start past the readiness limit (issue #24)."""

    def __init__(self, sweep: int, left: int = 0):
        super().__init__()
        self.sweep, self.left, self.reads = sweep, left, 0  # left: a sweep running already (the core's reset)

    def ctm_commands(self, cmds):
        assert not self.left, "a CTM_CMD write while the clear's sweep runs (it waits on the bus until the end)"
        super().ctm_commands(cmds)
        if any(op == cm.OP_CLEAR for op, _ in cmds):
            self.left = self.sweep

    def ctm_wait_idle(self):
        raise AssertionError("the service waited for the clear's sweep (its readiness waits with it)")

    def ctm_idle(self):
        self.reads += 1
        self.left = max(0, self.left - 1)
        return not self.left


def test_members_follow_events_and_loads():
    nic = Recorder()
    mem = Members(nic)
    a, b = ev("dump"), ev("dump", sport=40001)
    mem.load([a, b, ev("dump", sport=40003)])
    assert nic.complete == [0] and nic.m.members == 0 and len(mem.pending) == 3
    assert mem.load_step() and mem.clearing  # the clear made (its sweep: the next step finds it over)
    # events during the load: a pending entry destroyed is never inserted (nor deleted: the hardware never had it)
    mem.events([ev("destroy", sport=40003), ev("new", sport=40001)])
    assert nic.m.members == 0 and len(mem.pending) == 2
    mem.caught_up()
    mem.renew()
    assert nic.complete == [0], "COMPLETE while a load is pending"
    assert mem.load_step(1) and len(mem.pending) == 1  # a chunk of one: one left
    assert not mem.load_step() and nic.m.members == 2
    mem.events([ev("new"), ev("update"), ev("new", sport=40002), ev("destroy", sport=40001), ev("destroy", sport=9)])
    assert nic.m.members == 2 and len(mem.held) == 2  # duplicates not inserted twice, unknown destroys ignored
    nat = ev("new", sport=5, reply=("10.0.9.9", "100.64.0.1", 80, 61000), status=IPS_CONFIRMED | IPS_DST_NAT)
    mem.events([nat])
    assert nic.m.members == 4
    mem.events([ev("destroy", sport=5, reply=("10.0.9.9", "100.64.0.1", 80, 61000))])
    assert nic.m.members == 2
    mem.load([a])
    while mem.load_step():
        pass
    assert nic.m.members == 1 and nic.complete[-1] == 0


def test_load_returns_before_the_sweep_and_complete_only_after_it():
    """The service is ready before the clear's sweep is over, and COMPLETE (a miss is NEW) comes only after it and
    the resync's inserts (issue #24: an 11,100-entry emulated core's sweep took 9.4 s, the service never got ready).
    The load returns at once; events meanwhile wait with the dump's entries (no CTM_CMD write while a sweep runs,
    the one after the core's reset included); `load_step` makes the clear once the structure is idle and asks
    whether its sweep is over between the events, then inserts."""
    t = [100.0]
    nic = SlowSweep(sweep=3, left=2)
    mem = Members(nic, clock=lambda: t[0], window_ms=2000)
    mem.load([ev("dump"), ev("dump", sport=40001)])
    assert mem.clearing and nic.complete == [0] and nic.reads == 0
    assert mem.stats()["phase"] == "clearing" and not mem.stats()["complete"]
    mem.events([ev("new", sport=40002), ev("destroy", sport=40001), ev("new", sport=40003)])
    assert nic.m.members == 0 and len(mem.pending) == 3
    steps = 0
    while mem.load_step():
        steps += 1
        mem.caught_up()
        mem.renew()
        assert nic.complete == [0] and not mem.complete, "COMPLETE before the sweep and the resync's inserts"
    assert nic.reads == 2 + 3 and steps == 4 and not mem.clearing  # the reset's sweep, then the clear's
    assert nic.m.members == 3 and not mem.pending and mem.stats()["phase"] == "loaded"
    mem.caught_up()
    mem.renew()
    assert nic.complete[-1] == LEASE_MS and mem.complete and mem.stats()["phase"] == "complete"
    st = mem.stats()
    assert st["load_at"] <= st["cleared_at"] <= st["complete_at"]
    # lost events: a new load withdraws COMPLETE at once and clears again, without waiting
    mem.events([ev("new", sport=40004)])
    mem.load([ev("dump")])
    assert nic.complete[-1] == 0 and not mem.complete and mem.clearing and mem.stats()["complete_at"] is None
    mem.caught_up()
    mem.renew()
    assert nic.complete[-1] == 0
    while mem.load_step():
        pass
    mem.caught_up()
    mem.renew()
    assert nic.m.members == 1 and nic.complete[-1] == LEASE_MS


def test_complete_only_renewed_when_caught_up_within_the_window():
    t = [100.0]
    nic = Recorder()
    mem = Members(nic, clock=lambda: t[0], window_ms=2000)
    mem.load([])
    while mem.load_step():  # the clear, its sweep seen over, nothing pending
        pass
    mem.renew()
    assert nic.complete == [0], "renewed before the service caught up"
    mem.caught_up()
    mem.renew()
    assert nic.complete[-1] == LEASE_MS and mem.complete
    # caught up long ago (a poll or a stop since): the lease plus the time behind must stay within the window
    t[0] += (2000 - MARGIN_MS - LEASE_MS) / 1000 + 0.01
    mem.renew()
    assert nic.complete[-1] == LEASE_MS and mem.counters["withheld"] == 1 and mem.counters["renewals"] == 1
    mem.caught_up()
    mem.renew()
    assert mem.counters["renewals"] == 2


def test_no_renewal_while_the_policy_sync_service_holds_new_flows(tmp_path):
    """The hold file of ops.policysync.newflows (a helper, expectation, notrack or zone appeared): COMPLETE is not
    renewed, and the next renewal after the hold is gone sets it again."""
    from hypafilter.ops.flowsync.hold import HOLD_FILE, held

    t = [100.0]
    nic = Recorder()
    mem = Members(nic, clock=lambda: t[0], window_ms=2000, state_dir=tmp_path)
    mem.load([])
    while mem.load_step():
        pass
    mem.caught_up()
    (tmp_path / HOLD_FILE).write_text("held\n")
    assert held(tmp_path)
    mem.renew()
    assert nic.complete == [0] and not mem.complete and mem.counters["held"] == 1
    (tmp_path / HOLD_FILE).unlink()
    t[0] += 0.2
    mem.caught_up()
    mem.renew()
    assert nic.complete[-1] == LEASE_MS and mem.complete


def test_ipv6_keys_folded_with_their_family():
    """An IPv6 tuple: folded addresses in the 104-bit key, FAMILY6 above it, hashes over the family byte and the key
    (the VHDL's constants), either direction one key; a tuple folding to an IPv4 tuple's is another key; CTM_CMD
    carries the folded addresses with w3 bit 10; CTM_CONFIG bit 24 says the structure takes them."""
    from hypafilter.hw.flowcache import Flow6

    f6 = Flow6(0xFD484600 << 96 | 0x1234 << 64 | 7, 0x20010DB8 << 96 | 0x10, 6, 41000, 80)
    k = cm.key_of(f6)
    assert k == cm.key_of(f6.reply()) and cm.is_v6_key(k)
    assert cm.fold(f6.src) == 0xFD484600 ^ 0x1234 ^ 7
    low = cm.key_of(Flow(cm.fold(f6.src), cm.fold(f6.dst), 6, 41000, 80))
    assert k == cm.FAMILY6 | low and not cm.is_v6_key(low)
    b = (1 << 104 | low).to_bytes(14, "big")
    a, c = zlib.crc32(b), cm.crc32c(b)
    assert b[0] == 1 and cm.bank_indices(k, 16) == (a & 0xFFFF, c & 0xFFFF, a >> 16, c >> 16)
    assert cm.bank_indices(k, 16) != cm.bank_indices(low, 16)
    w = cm.cmd_words(cm.OP_INSERT, f6)
    assert w == [cm.fold(f6.src), cm.fold(f6.dst), 41000 << 16 | 80, cm.CMD_V6 | 1 << 8 | 6]
    assert cm.cmd_words(cm.OP_INSERT, cm.key_flow(k)) in (w, [w[1], w[0], 80 << 16 | 41000, w[3]])
    assert cm.config_v6(cm.ctm_config(16, 12, v6=True)) and not cm.config_v6(cm.ctm_config(16, 12))
    # an IPv6 host frame with unknown ports: every IPv6 key of its two addresses (either direction, any ports) recent
    # for a window; no other address pair's (unless its index collides), no IPv4 key
    m = cm.CtMember(8, 4, window=100)
    m.egress_unknown6(f6.dst, f6.src, 5000)
    other = cm.key_of(Flow6(f6.src, f6.dst, 17, 1, 2))
    far = cm.key_of(Flow6(f6.src ^ 1, f6.dst, 6, 41000, 80))
    assert cm.unknown6_index(cm.fold(f6.src), cm.fold(f6.dst)) == cm.unknown6_index(cm.fold(f6.dst), cm.fold(f6.src))
    assert m.possible(k, 5099) and m.possible(other, 5099) and not m.possible(k, 5100)
    assert not m.possible(far, 5050) and not m.possible(low, 5050)
    # a refused IPv6 wire frame handed to the host: the same stamp of its pair (its reverse tuple a possible member)
    m.refused6(f6.src, f6.dst, 6000)
    assert m.possible(cm.key_of(Flow6(f6.dst, f6.src, 6, 80, 41000)), 6099) and not m.possible(k, 6100)


def test_entry_keys_of_ipv6_entries():
    """IPv6 TCP/UDP entries go in only when the structure takes IPv6 keys (a dual-stack core's); their NAT reply
    tuple as a second key."""
    from hypafilter.hw.flowcache import Flow6

    e = CtEvent(kind="new", family=socket.AF_INET6, proto=6, src="fd48:4600::1", dst="2001:db8:2::10", sport=41000,
                dport=80, reply=("2001:db8:2::10", "fd48:4600::1", 80, 41000), status=IPS_CONFIRMED)  # fmt: skip
    assert entry_keys(e) == ()
    want = cm.key_of(Flow6(0xFD484600 << 96 | 1, 0x20010DB8_0002 << 80 | 0x10, 6, 41000, 80))
    assert entry_keys(e, v6=True) == (want,)
    nat = CtEvent(kind="new", family=socket.AF_INET6, proto=17, src="fd48:4600::1", dst="2001:db8:2::10",
                  sport=5000, dport=53, reply=("2001:db8:9::9", "fd48:4600::1", 53, 5000), status=IPS_CONFIRMED)  # fmt: skip
    assert len(entry_keys(nat, v6=True)) == 2
    icmp = CtEvent(kind="new", family=socket.AF_INET6, proto=58, src="fd48:4600::1", dst="2001:db8:2::10")
    assert entry_keys(icmp, v6=True) == ()
    rec = Recorder()
    mem = Members(rec, v6=True)
    mem.events([e])
    assert rec.m.member(want) and mem.stats()["entries"] == 1 and mem.stats()["families"] == ["ipv4", "ipv6"]
    assert Members(Recorder()).stats()["families"] == ["ipv4"]
