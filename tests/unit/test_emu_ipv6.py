"""The emulated NIC's IPv6 side (docs/ipv6.md "## emu"): the family-6 plan deploy hangs on the IPv4 plan goes into the
dual-stack core's rows at V6_BASE = n4 + 1 + δ through the same registers as IPv4 (NicClient.program), the shim's
interval table gets the IPv6 indices' k, and the update buffer's path keeps a core only while its IPv6 matcher is
the plan's. Behaviour on the real emulator: tests/system/test_fuzz.py::test_fuzz_ipv6_emu, test_ipv6_deploy.py."""

from __future__ import annotations

import pytest
from hypafilter.analysis.plan import build_plan
from hypafilter.config import Config
from hypafilter.hw import regmap, updatebuffer, vhdl
from hypafilter.hw.model import ACTION_ACCEPT, ACTION_DROP
from hypafilter.iptables.document import parse_policy
from hypafilter.netfilter import ip6
from hypafilter.targets.emu import v6 as emu_v6
from hypafilter.targets.nic import CORE_ID, EmuTransport, NicClient, NicError
from hypafilter.targets.xdp.v6 import plan6_for

from tests.unit.test_nic import BUF_CONFIG, FakeNic

V4 = """*filter
:INPUT ACCEPT [0:0]
:FORWARD ACCEPT [0:0]
:OUTPUT ACCEPT [0:0]
-A FORWARD -s 10.0.0.0/8 -p tcp --dport 80 -j ACCEPT
-A FORWARD -p udp --dport 53 -j DROP
-A FORWARD -p tcp -m limit --limit 5/s -j ACCEPT
COMMIT
"""
V6 = """*filter
:INPUT ACCEPT [0:0]
:FORWARD DROP [0:0]
:OUTPUT ACCEPT [0:0]
-A FORWARD -p ipv6-icmp --icmpv6-type echo-request -j ACCEPT
-A FORWARD -s 2001:db8:1::/48 -p tcp --dport 80 -j ACCEPT
-A FORWARD -p udp --dport 5000:5100 -j DROP
-A FORWARD -p tcp --dport 8080 -j REJECT --reject-with icmp6-port-unreachable
-A FORWARD -p tcp -j ACCEPT
COMMIT
"""
CT6 = V6.replace(
    ":OUTPUT ACCEPT [0:0]\n", ":OUTPUT ACCEPT [0:0]\n-A FORWARD -m conntrack --ctstate ESTABLISHED -j ACCEPT\n"
)


def _plans(v6_text: str = V6, config: Config | None = None):
    config = config or Config()
    plan = build_plan(parse_policy(V4, filename="v4.rules", base_chain="FORWARD", config=config), config, live=True)
    plan6, why = plan6_for(ip6.V6Policy("v6.rules", v6_text, tables=("filter",)), config, plan, target="emu")
    assert why == "" and plan6 is not None
    return plan, plan6


@pytest.fixture
def fake(tmp_path):
    f = FakeNic(tmp_path / "nic.sock", {regmap.REG_ID: CORE_ID})
    f.regs[regmap.REG_BUF_CONFIG] = BUF_CONFIG
    yield f
    f.srv.close()


def test_plan6_for_the_emulated_nic():
    plan, plan6 = _plans()
    # the core's V6_BASE: after the IPv4 entries, their policy entry and the 16 buffer slots
    assert plan6.index_base == vhdl.v6_base(plan) == len(plan.entries) + 1 + 16
    assert plan6.k_base == plan.num_intervals and plan6.family == 6
    assert plan6_for(None, Config(), plan, target="emu")[0] is None
    off = plan6_for(ip6.V6Policy("v6.rules", V6, tables=("filter",)), Config(emu_ipv6=False), plan, target="emu")
    assert off == (None, "emu_ipv6 is off in the configuration")
    # the switches are the targets' own
    assert plan6_for(ip6.V6Policy("v6.rules", V6, tables=("filter",)), Config(xdp_ipv6=False), plan, target="emu")[0]


def test_program_writes_the_ipv6_rows(fake):
    plan, plan6 = _plans()
    n4, n6, base = len(plan.entries), len(plan6.entries), vhdl.v6_base(plan)
    fake.regs[regmap.REG_NUM_ENTRIES] = n4
    # a core generated without the IPv6 side is refused: its MATCHER_HASH is the IPv4 matcher's
    fake.regs[regmap.REG_MATCHER_HASH] = int(vhdl.matcher_hash(plan)[-8:], 16)
    plan.plan6 = plan6
    with NicClient(EmuTransport(fake.path)) as c, pytest.raises(NicError, match="MATCHER_HASH"):
        c.program(plan, 1)
    fake.regs[regmap.REG_MATCHER_HASH] = int(vhdl.matcher_hash(plan, plan6)[-8:], 16)
    with NicClient(EmuTransport(fake.path)) as c:
        written = c.program(plan, 2)
    shunt = [(fake.tables.get((regmap.TABLE_SHUNT, i // 32), 0) >> (i % 32)) & 1 for i in range(base + n6 + 1)]
    action = [fake.tables.get((regmap.TABLE_ACTION, i), 0) for i in range(base + n6 + 1)]
    assert shunt[: n4 + 1] == [int(b) for b in plan.shunt] and action[: n4 + 1] == [int(a) for a in plan.actions]
    assert shunt[n4 + 1 : base] == [1] * 16 and action[n4 + 1 : base] == [0] * 16  # the buffer's slots
    assert shunt[base:] == [int(b) for b in plan6.shunt] and action[base:] == [int(a) for a in plan6.actions]
    assert ACTION_ACCEPT in action[base:] and ACTION_DROP in action[base:] and 0 in shunt[base:]
    ct0 = [True] * (n6 + 1)  # a stateless IPv6 side: every row meets frames the flow cache does not know
    v6 = {k: written["v6"][k] for k in ("entries", "index_base", "matcher", "ct0", "depth", "static")}
    assert v6 == {"entries": n6, "index_base": base, "matcher": emu_v6.v6_matcher(plan6), "ct0": ct0, "depth": 16,
                  "static": plan6.source6}  # fmt: skip
    # the IPv6 update buffer empty (a Plan): VALID6 all ones, no slot enabled
    assert updatebuffer.Image6.from_dict(written["v6"]["overlay"]).pristine
    assert fake.tables.get((regmap.TABLE_VALID6, 0)) == (1 << n6) - 1
    assert written["miss_shunt"] == [False, False]
    # only the IPv6 rows that changed are written again
    plan6.shunt[:] = True
    fake.log.clear()
    with NicClient(EmuTransport(fake.path)) as c:
        c.program(plan, 3, known=written)
    rows = [int(w) for ln in fake.log if ln.startswith(f"T WS {regmap.TABLE_SHUNT} ") for w in ln.split()[3:4]]
    assert rows and all(w * 32 + 31 >= base for w in rows), fake.log


def test_miss_forcing_of_each_family(fake):
    """An IPv6 frame has ct 0 on the core (its flow cache holds IPv4 tuples): a conntrack-reading IPv6 side sets
    CONTROL's IPv6 miss forcing bits (6/7), the IPv4 side's its own (4/5), so one family's conntrack does not send
    the other's frames to the host."""
    plan, plan6 = _plans(CT6)
    assert tuple(plan.miss_shunt) == (False, False) and tuple(plan6.miss_shunt) == (True, True)
    plan.plan6 = plan6
    fake.regs[regmap.REG_NUM_ENTRIES] = len(plan.entries)
    fake.regs[regmap.REG_MATCHER_HASH] = int(vhdl.matcher_hash(plan, plan6)[-8:], 16)
    fake.regs[regmap.REG_CONTROL] = 0x1
    with NicClient(EmuTransport(fake.path)) as c:
        written = c.program(plan, 1)
    assert written["miss_shunt"] == [False, False] and written["miss_shunt6"] == [True, True]
    assert fake.regs[regmap.REG_CONTROL] == 0xC1
    plan.plan6 = None  # a core programmed without an IPv6 side: bits 6/7 cleared
    fake.regs[regmap.REG_MATCHER_HASH] = int(vhdl.matcher_hash(plan)[-8:], 16)
    with NicClient(EmuTransport(fake.path)) as c:
        assert "miss_shunt6" not in c.program(plan, 2)
    assert fake.regs[regmap.REG_CONTROL] == 0x1


def test_shim_intervals_of_the_ipv6_indices():
    plan, plan6 = _plans()
    four = [int(k) for k in plan.interval]
    rows = emu_v6.intervals(four, plan6)
    base, kb = plan6.index_base, plan6.k_base
    assert rows[: len(four)] == four and rows[len(four) : base] == [0] * (base - len(four))
    assert rows[base:] == [int(k) + kb if k else 0 for k in plan6.interval]
    assert min(rows[base:]) > kb  # every IPv6 entry's k follows the IPv4 plan's (the chains' numbers)
    plan6.verbatim = True  # ip6tables holds the policy alone: every IPv6 frame passed with k = 0
    assert emu_v6.intervals(four, plan6)[base:] == [0] * (len(plan6.entries) + 1)
    with pytest.raises(ValueError, match="start at"):
        emu_v6.intervals([1] * (base + 1), plan6)


def test_a_core_keeps_its_ipv6_matcher_only():
    plan, plan6 = _plans()
    tables = {"v6": {"entries": len(plan6.entries), "matcher": emu_v6.v6_matcher(plan6)}}
    assert emu_v6.core_keeps_v6(tables, plan6)
    _, complex_only = _plans(V6.replace("--dport 8080", "--dport 8081"))  # a complex rule: the same hardware
    assert emu_v6.core_keeps_v6(tables, complex_only)
    _, other = _plans(V6.replace("5000:5100", "5000:5200"))
    assert not emu_v6.core_keeps_v6(tables, other)
    assert not emu_v6.core_keeps_v6({}, plan6) and not emu_v6.core_keeps_v6(tables, None)
    assert emu_v6.core_keeps_v6({}, None)


def test_deciding_rows_of_the_written_tables(fake):
    plan, plan6 = _plans()
    plan.plan6 = plan6
    fake.regs[regmap.REG_NUM_ENTRIES] = len(plan.entries)
    fake.regs[regmap.REG_MATCHER_HASH] = int(vhdl.matcher_hash(plan, plan6)[-8:], 16)
    with NicClient(EmuTransport(fake.path)) as c:
        written = c.program(plan, 1)
        rows = emu_v6.deciding_rows(written)
        want = [
            not s and int(a) in (ACTION_ACCEPT, ACTION_DROP) for s, a in zip(plan6.shunt, plan6.actions, strict=True)
        ]
        assert rows == want and any(rows) and not all(rows)
        base = plan6.index_base
        fake.tables[(regmap.TABLE_HITS, base + 1)] = 7
        assert emu_v6.hits6(c, written) == [0, 7] + [0] * (len(plan6.entries) - 1)
    # miss forcing (either family's) sends an ACCEPT or DROP row's ct-0 frames to the host
    assert not any(emu_v6.deciding_rows({**written, "miss_shunt6": [True, True]}))
    assert emu_v6.deciding_rows({**written, "miss_shunt": [True, True]}) == rows  # the IPv4 side's bits
    assert emu_v6.deciding_rows({k: v for k, v in written.items() if k != "v6"}) == []


def test_an_established_row_is_never_forced(fake):
    """A conntrack-first IPv6 side: its ESTABLISHED row matches only frames of flows the cache knows (ct 1/2), which
    bits 6/7 never force, so it counts as deciding; the rows that meet ct 0 do not (docs/ipv6.md "## emu")."""
    plan, plan6 = _plans(CT6)
    plan.plan6 = plan6
    assert plan6.miss_shunt[0]  # the IPv6 plan forces its accepted misses
    fake.regs[regmap.REG_NUM_ENTRIES] = len(plan.entries)
    fake.regs[regmap.REG_MATCHER_HASH] = int(vhdl.matcher_hash(plan, plan6)[-8:], 16)
    with NicClient(EmuTransport(fake.path)) as c:
        written = c.program(plan, 1)
    ct0 = written["v6"]["ct0"]
    assert ct0[0] is False and all(ct0[1:]), ct0  # the ESTABLISHED entry comes first
    rows = emu_v6.deciding_rows(written)
    assert rows[0] and int(plan6.actions[0]) == ACTION_ACCEPT and not plan6.shunt[0]
    assert not any(r for r, a in zip(rows[1:], plan6.actions[1:], strict=False) if int(a) == ACTION_ACCEPT)
    # a state written before `ct0` existed: every row may meet ct 0
    old = {**written, "v6": {k: v for k, v in written["v6"].items() if k != "ct0"}}
    assert not emu_v6.deciding_rows(old)[0]


BAN6 = V6.replace(":OUTPUT ACCEPT [0:0]\n", ":OUTPUT ACCEPT [0:0]\n-A FORWARD -s 2001:db8:1:5::66/128 -j DROP\n")


def test_program_writes_the_ipv6_update_buffer(fake):
    """A ban inserted first in the IPv6 policy, as align6's View over the core's static IPv6 plan (emu_v6.view6): the
    core's MATCHER_HASH stays the static plan's, the rows at V6_BASE are the View's n6 + 1 + δ6, one slot (BUF6 words,
    enable last) at position 0, VALID6 all ones, the shim's IPv6 k the View's (k_base applied once)."""
    plan, static6 = _plans()
    _, new6 = _plans(BAN6)
    n4, n6, base = len(plan.entries), len(static6.entries), vhdl.v6_base(plan)
    d6 = vhdl.buffer6_depth(plan, static6)
    view = emu_v6.view6(static6, new6, d6)
    assert view.overlay.used == 1 and view.slots[0].pos == 0 and view.valid.all()
    fake.regs[regmap.REG_NUM_ENTRIES] = n4
    fake.regs[regmap.REG_MATCHER_HASH] = int(vhdl.matcher_hash(plan, static6)[-8:], 16)
    plan.plan6 = view
    with NicClient(EmuTransport(fake.path)) as c:
        written = c.program(plan, 2)
    rows6 = n6 + 1 + d6
    action = [fake.tables.get((regmap.TABLE_ACTION, i), 0) for i in range(base, base + rows6)]
    assert action == [int(a) for a in view.actions] and action[n6 + 1] == ACTION_DROP
    words = [fake.tables.get((regmap.TABLE_BUF6, i), 0) for i in range(updatebuffer.USED6)]
    assert words == updatebuffer.slot_words6(view.slots[0])
    assert words[:4] == [0x20010DB8, 0x00010005, 0, 0x66] and words[4:8] == words[:4]  # src lo = hi = the /128
    ctl = [ln.split() for ln in fake.log if ln.startswith("T W") and ln.split()[2] == str(regmap.TABLE_BUF6)]
    assert ctl and int(ctl[-1][3]) == updatebuffer.W6_CONTROL, ctl  # the enable word last
    assert written["v6"]["static"] == static6.source6 and written["v6"]["matcher"] == emu_v6.v6_matcher(static6)
    ks = emu_v6.intervals([0] * (n4 + 1), view)
    assert ks[base:] == [int(k) for k in view.interval] and len(ks) == base + rows6


def test_drift_of_the_ipv6_update_buffer(fake):
    """status' NIC drift reads VALID6 and the IPv6 slots back: a slot's enable word cleared by hand is drift."""
    from hypafilter.ops.deploy import nic_drift

    plan, static6 = _plans()
    _, new6 = _plans(BAN6)
    fake.regs[regmap.REG_NUM_ENTRIES] = len(plan.entries)
    fake.regs[regmap.REG_MATCHER_HASH] = int(vhdl.matcher_hash(plan, static6)[-8:], 16)
    plan.plan6 = emu_v6.view6(static6, new6, vhdl.buffer6_depth(plan, static6))
    with NicClient(EmuTransport(fake.path)) as c:
        written = c.program(plan, 2)
        st = {"generation": 2, "tables": written}
        before = nic_drift(c, st)  # (the fake's CONTROL has classification off: said alike before and after)
        assert not any("IPv6 update buffer" in d for d in before)
        c.write_table("BUF6", updatebuffer.W6_CONTROL, 0)
        assert nic_drift(c, st) == [*before, "nic: the IPv6 update buffer differs from the deployed one (slots [0])"]


@pytest.mark.parametrize("ctm_v6", [True, False])
def test_shunt_none_of_the_ipv6_rows(fake, ctm_v6):
    """SHUNT_NONE (the shunt bits of frames with ct 3) at V6_BASE: the IPv6 plan's shunt_none when the core's
    conntrack membership structure takes IPv6 keys (CTM_CONFIG bit 24), else every IPv6 row shunted (an IPv6 frame
    never has ct 3 there); the IPv4 rows as before."""
    from hypafilter.hw import ctmember

    plan, plan6 = _plans(CT6)
    assert plan6.shunt_none is not None and not all(plan6.shunt_none)
    plan.plan6 = plan6
    n4, n6, base = len(plan.entries), len(plan6.entries), vhdl.v6_base(plan)
    fake.regs[regmap.REG_NUM_ENTRIES] = n4
    fake.regs[regmap.REG_MATCHER_HASH] = int(vhdl.matcher_hash(plan, plan6)[-8:], 16)
    fake.regs[regmap.REG_CTM_CONFIG] = ctmember.ctm_config(12, 12, v6=ctm_v6)
    with NicClient(EmuTransport(fake.path)) as c:
        c.program(plan, 1)
    none = [(fake.tables.get((regmap.TABLE_SHUNT_NONE, i // 32), 0) >> (i % 32)) & 1 for i in range(base + n6 + 1)]
    assert none[: n4 + 1] == [int(b) for b in plan.shunt[: n4 + 1]] and none[n4 + 1 : base] == [1] * 16
    assert none[base:] == ([int(b) for b in plan6.shunt_none] if ctm_v6 else [1] * (n6 + 1))


def test_the_lazy_rebuild_of_the_ipv6_update_buffer(tmp_path):
    """The policy sync service's lazy rebuild over a dual-stack core (ops.policysync.worker): the IPv6 buffer's use
    read from the state (a slot in use; a masked static entry alone is in use but never half full), due when half
    full or in use and idle, and the core built beforehand in its thread is the one the rebuild's follow looks for
    (deploy.rebuild_plan: the deployed IPv6 side's entries in the matcher hash; without them the follow would build
    the dual-stack core again while everything shunts)."""
    from hypafilter.analysis.overlay import Overlay
    from hypafilter.ops import deploy
    from hypafilter.ops.policysync.worker import Follower, rebuild_due

    plan, static6 = _plans()
    _, new6 = _plans(BAN6)
    d6 = vhdl.buffer6_depth(plan, static6)
    f = Follower("w3u-fw", tmp_path, None, lambda s: None)
    v6 = {"depth": d6, "overlay": updatebuffer.image6(emu_v6.view6(static6, new6, d6).overlay).as_dict()}
    f._st = {"target": "emu", "tables": {"v6": v6}}
    assert f.buffer6_use() == (1, d6, True)
    masked = Overlay.empty(len(static6.entries), d6)
    masked.valid[1] = False
    f._st["tables"]["v6"]["overlay"] = updatebuffer.image6(masked).as_dict()
    assert f.buffer6_use() == (0, d6, True)
    f._st["tables"]["v6"]["overlay"] = updatebuffer.pristine6(len(static6.entries), d6).as_dict()
    assert f.buffer6_use() == (0, d6, False)
    f._st["target"] = "xdp"  # xdp's IPv6 buffer is Follower6's (its tables, not a core)
    assert f.buffer6_use() == (0, 0, False)
    assert not rebuild_due(1, 16, 59.0, 60.0) and rebuild_due(1, 16, 60.0, 60.0) and rebuild_due(8, 16, 0.0, 60.0)
    assert not rebuild_due(0, 16, 0.0, 60.0, masked=True) and rebuild_due(0, 16, 60.0, 60.0, masked=True)
    assert not rebuild_due(0, 16, 1e9, 60.0)

    six = {"mode": "policy", "source": "v6.rules", "text": V6, "tables": ["filter"], "base_chain": "FORWARD",
           "chains": {"k_base": plan.num_intervals}}  # fmt: skip
    policy = parse_policy(V4, filename="v4.rules", base_chain="FORWARD", config=Config())
    built = deploy.rebuild_plan(policy, {"target": "emu", "ipv6": six}, Config())
    assert built.plan6 is not None and vhdl.matcher_hash(built, built.plan6) == vhdl.matcher_hash(plan, static6)
    assert vhdl.matcher_hash(built, None) != vhdl.matcher_hash(plan, static6)
    for st, cfg in (
        ({"target": "emu", "ipv6": {"mode": "kernel"}}, Config()),
        ({"target": "emu", "ipv6": six}, Config(emu_ipv6=False)),
        ({"target": "xdp", "ipv6": six}, Config()),
    ):
        assert getattr(deploy.rebuild_plan(policy, st, cfg), "plan6", None) is None, (st, cfg)
