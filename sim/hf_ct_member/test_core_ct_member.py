"""Testbench of hypafilter_core built with the conntrack membership structure (CTM_LOG2 > 0): a wire TCP/UDP frame
that misses the flow cache and is neither a member (CTM_CMD inserts) nor recent egress (a frame the host sent out)
reaches the matcher with ct 3 while CTM_CONTROL's COMPLETE holds and CTM_LEASE runs, and is decided with the
SHUNT_NONE vector (CONTROL bit 4 still sends its ACCEPT to the host); members, egress within the window, ICMP, a
structure not complete, an expired lease give ct 0; deletes make a tuple NEW again; the registers (CTM_*,
CNT_CT_NONE) and the tables. Expected decisions: hwmodel.decide with the ct of hypafilter.hw.ctmember.CtMember."""

from __future__ import annotations

import random

import cocotb
import pytest
from cocotb.triggers import ClockCycles, RisingEdge
from hypafilter.hw import ctmember as cm
from hypafilter.hw import model as hwmodel
from hypafilter.hw import regmap as R
from hypafilter.hw import vhdl
from hypafilter.hw.flowcache import Flow
from hypafilter.ir import Box, Header, Policy, Rule

from sim.hftb import fresh_build, header_frame, load_obj, run_ghdl, save_obj, tuser_for
from sim.hypafilter_core.test_hypafilter_core import TB

CTM_LOG2, EGRESS_LOG2 = 10, 8
MISS_ACCEPT, MISS_DROP = hwmodel.CONTROL_MISS_SHUNT_ACCEPT, hwmodel.CONTROL_MISS_SHUNT_DROP


def ct_policy() -> Policy:
    """Established first (ct 1..2), then rules that read ct 3 and rules that do not."""
    full = Box.full()
    tcp, udp = full.with_field("proto", 6, 6), full.with_field("proto", 17, 17)
    rules = [
        Rule((full.with_field("ct", 1, 2),), "ACCEPT"),
        Rule((tcp.with_field("dport", 80, 80),), "ACCEPT"),
        Rule((tcp.with_field("dport", 22, 22),), "DROP"),
        Rule((udp.with_field("dport", 53, 53).with_field("ct", 3, 3),), "DROP"),
        Rule((udp.with_field("dport", 5000, 5999),), "ACCEPT"),
    ]
    return Policy(rules, "DROP", original_rules=[("ct member test",)])


class CtmTB(TB):
    async def ctm(self, op: int, flow: Flow | None = None) -> None:
        for w, v in enumerate(cm.cmd_words(op, flow)):
            await self.axil.table_access(R, R.TABLE_CTM_CMD, w, v)

    async def ticks(self, n: int) -> None:
        """n ms of the lease time base, with nothing in flight."""
        self.dut.lease_ticks.value = n
        await RisingEdge(self.dut.axis_aclk)
        self.dut.lease_ticks.value = 0
        await ClockCycles(self.dut.axis_aclk, 4)


@cocotb.test()
async def core_ct_member(dut):
    cfg = load_obj("HF_TB_CFG")
    plan, seed = cfg["plan"], cfg["seed"]
    n = len(plan.entries)
    tb = CtmTB(dut, seed, idle=0.2, ready=0.7)
    await tb.reset(n)
    ax, rng = tb.axil, random.Random(seed)
    await ClockCycles(dut.axis_aclk, 1 << max(CTM_LOG2, EGRESS_LOG2))  # the sweeps after reset
    assert await ax.read(R.REG_CTM_CONFIG) == cm.ctm_config(CTM_LOG2, EGRESS_LOG2)
    assert await ax.read(R.REG_CTM_WINDOW) == cm.DEFAULT_WINDOW_MS
    assert await ax.read(R.REG_CTM_CONTROL) == 0
    model = cm.CtMember(CTM_LOG2, EGRESS_LOG2)
    now = 0
    await tb.ticks(cm.DEFAULT_WINDOW_MS + 1)  # stamps read 0 after reset: recent for a window
    now += cm.DEFAULT_WINDOW_MS + 1
    control, gen = hwmodel.CONTROL_ENABLE | MISS_ACCEPT | MISS_DROP, 0x31
    await ax.write(R.REG_CONTROL, control)
    await ax.write(R.REG_GENERATION, gen)
    shunt = [rng.random() < 0.3 for _ in range(n + 1)]
    shunt_none = [s and rng.random() < 0.5 for s in shunt]
    shunt[0] = shunt_none[0] = False
    shunt[2], shunt_none[2] = True, False  # TCP 22 DROP: shunted with ct 0, dropped with ct 3
    shunt[4] = shunt_none[4] = True
    shunt_none[n] = False
    for name, bits in (("SHUNT", shunt), ("SHUNT_NONE", shunt_none)):
        for w in range((n + 1 + 31) // 32):
            word = sum(1 << j for j in range(32) if 32 * w + j <= n and bits[32 * w + j])
            await ax.table_access(R, getattr(R, f"TABLE_{name}"), w, word)
    regs = hwmodel.Regs.from_plan(plan)
    regs.shunt, regs.shunt_none, regs.generation, regs.control = [int(b) for b in shunt], shunt_none, gen, control
    regs.shunt_none = [int(b) for b in shunt_none]
    assert regs.shunt != regs.shunt_none
    counters = hwmodel.Counters(n)
    ct_none = 0

    def rand_flow() -> Flow:
        proto = rng.choice((6, 17))
        dport = rng.choice((80, 22, 443) if proto == 6 else (53, 5353, 5100))
        return Flow(
            0x0A000000 | rng.getrandbits(16), 0xC0A80000 | rng.getrandbits(8), proto, rng.randrange(1024, 65536), dport
        )

    def frame(
        fl: Flow, port: int, flags: int = 0x10, icmp: bool = False, fragment: bool = False
    ) -> tuple[bytes, int, Header]:
        iport = {0x01: 0, 0x04: 1, 0x10: 2, 0x40: 3}.get(port, 0)
        proto = 1 if icmp else fl.proto
        h = Header(
            fl.src,
            fl.dst,
            proto,
            0 if icmp else fl.sport,
            0 if icmp else fl.dport,
            8 if icmp else 0,
            0,
            iport,
            flags if proto == 6 else 0,
        )
        f = header_frame(h, rng)
        if fragment:  # MF set (the checksum no longer fits either): the parser calls it unparsed
            b = bytearray(f)
            b[20] |= 0x20
            f = bytes(b)
        return f, tuser_for(f, port), h

    async def run(items: list[tuple[Flow, int, dict]], complete: bool) -> list[int]:
        """Send the frames (wire or host ports); every output checked; the ct each wire frame had."""
        nonlocal ct_none
        expected, cts, sends = [], [], []
        for fl, port, kw in items:
            f, tu, h = frame(fl, port, **kw)
            key = cm.key_of(fl)
            ct = 0
            if port in hwmodel.HOST_PORTS:
                if h.proto in (6, 17):
                    model.egress(key, now)
            else:
                ct = hwmodel.nic_miss_ct(f, port, model.possible(key, now), complete)
            d = hwmodel.decide(plan, f, port, regs, ct=ct)
            counters.add(d, port)
            ct_none += ct == 3
            cts.append(ct)
            sends.append((f, tu))
            if d.kind != hwmodel.Kind.DROP:
                expected.append((f, hwmodel.out_tuser(tu, d), (fl, port, ct, d)))
        tb.sink.frames.clear()
        await tb.src.send(sends)
        await tb.wait_out(len(expected))
        for k, ((f, tu, what), (got, gtu, _)) in enumerate(zip(expected, tb.sink.frames, strict=True)):
            assert got == f, f"frame {k} {what}: data differs"
            assert gtu == tu, f"frame {k} {what}: tuser {gtu:#x}, expected {tu:#x}"
        return cts

    flows = [rand_flow() for _ in range(60)]
    members, strangers = flows[:30], flows[30:]
    for fl in members:
        await tb.ctm(cm.OP_INSERT, fl if rng.random() < 0.5 else fl.reply())
        model.insert(cm.key_of(fl))
    await ClockCycles(dut.axis_aclk, 20)
    assert await ax.read(R.REG_CTM_MEMBERS) == len(members)

    def mix(count: int) -> list:
        out = []
        for _ in range(count):
            fl = rng.choice(flows)
            fl = fl if rng.random() < 0.5 else fl.reply()
            r = rng.random()
            kw = {"icmp": True} if r < 0.1 else {"flags": rng.choice((0x02, 0x10, 0x11, 0x04))} if r < 0.4 else {}
            out.append((fl, rng.choice((0x01, 0x04, 0x10, 0x40)), kw))
        return out

    # -- not complete: no ct 3
    assert 3 not in await run(mix(60), complete=False)
    # -- complete, lease running: members ct 0, the others ct 3 (ICMP never)
    await ax.write(R.REG_CTM_LEASE, 5000)
    await ax.write(R.REG_CTM_CONTROL, cm.CONTROL_COMPLETE)
    got = await run(mix(200), complete=True)
    assert 3 in got and 0 in got
    # -- egress: the host sends frames of strangers; their replies are members until the window has passed
    out = strangers[:10]
    await run([(fl, rng.choice(sorted(hwmodel.HOST_PORTS)), {}) for fl in out], complete=True)
    got = await run([(fl.reply(), 0x01, {}) for fl in out], complete=True)
    assert got == [0] * len(out), got
    await tb.ticks(cm.DEFAULT_WINDOW_MS)
    now += cm.DEFAULT_WINDOW_MS
    got = await run([(fl.reply(), 0x04, {}) for fl in out], complete=True)
    assert 3 in got
    # -- a host frame the parser refuses (a first fragment) still stamps its key: its reply is a member
    frag = strangers[12:16]
    await run([(fl, 0x02, {"fragment": True}) for fl in frag], complete=True)
    assert await run([(fl.reply(), 0x01, {}) for fl in frag], complete=True) == [0] * len(frag)
    # -- deletes: a deleted tuple is NEW again
    for fl in members[:10]:
        await tb.ctm(cm.OP_DELETE, fl)
        model.delete(cm.key_of(fl))
    got = await run([(fl, 0x10, {}) for fl in members[:10]] + mix(100), complete=True)
    assert 3 in got[:10]
    # -- the lease runs out: COMPLETE clears, no ct 3 until the host sets it again
    await tb.ticks(5000)
    now += 5000
    assert await ax.read(R.REG_CTM_CONTROL) == 0 and await ax.read(R.REG_CTM_LEASE) == 0
    assert 3 not in await run(mix(60), complete=False)
    await ax.write(R.REG_CTM_LEASE, 100)
    assert 3 not in await run(mix(30), complete=False)
    await ax.write(R.REG_CTM_CONTROL, cm.CONTROL_COMPLETE)
    assert 3 in await run(mix(100), complete=True)
    # -- a clear: not complete any more, nothing a member
    await tb.ctm(cm.OP_CLEAR)
    model.clear()
    await ClockCycles(dut.axis_aclk, (1 << CTM_LOG2) + 20)
    assert await ax.read(R.REG_CTM_CONTROL) == 0 and await ax.read(R.REG_CTM_MEMBERS) == 0
    # -- registers and tables
    assert await ax.read(R.REG_CNT_CT_NONE) == ct_none
    for name in [r.name for r in R.MAP.registers if r.name.startswith("CNT_") and r.name != "CNT_CT_NONE"]:
        assert await ax.read(R.MAP.reg(name).offset) == counters.regs.get(name, 0), name
    for w in range((n + 1 + 31) // 32):
        word = sum(1 << j for j in range(32) if 32 * w + j <= n and shunt_none[32 * w + j])
        assert await ax.table_access(R, R.TABLE_SHUNT_NONE, w) == word
    assert await ax.read(R.REG_CTM_STATUS) == 0
    dut._log.info("core_ct_member: %d frames with ct 3, counters %s", ct_none, counters.regs)


# ---------------------------------------------------------------- the pytest side

CTM_GENERICS = {
    "FC_LOG2_SETS": 10,
    "FC_WAYS": 4,
    "FC_TICK_CYCLES": 16,
    "LEASE_TICK_CYCLES": 0,
    "CTM_LOG2": CTM_LOG2,
    "CTM_EGRESS_LOG2": EGRESS_LOG2,
}


@pytest.mark.sim
def test_core_ct_member():
    out = fresh_build("hypafilter_core", "ct_member")
    plan = vhdl.minimal_plan(ct_policy())
    cfg = save_obj({"plan": plan, "seed": 5}, out / "cfg.pkl")
    vhdl.render(plan, out / "gen", tdata_width=256)
    run_ghdl(
        "hypafilter_core",
        vhdl.sources(out / "gen"),
        "ct_member",
        {"C_S_AXIS_DATA_WIDTH": 256, "C_FIFO_DEPTH_BYTES": 4096, **CTM_GENERICS},
        env={"HF_TB_CFG": str(cfg)},
        testcase="core_ct_member",
        test_module="sim.hf_ct_member.test_core_ct_member",
    )
