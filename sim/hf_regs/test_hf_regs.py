"""Testbench of hf_regs: the registers of hw/regmap.txt over AXI4-Lite with back-pressure (reset values, RW round
trips, RO ignored writes, event counters and their clear), and the indirect-access sequencing towards a model of
the tables: one request per trigger, busy while it runs, stream writes held on the bus until the previous is done;
and the policy sync lease (LEASE, LEASE_STATUS, lease_expired) cycle by cycle against hw.model.Lease."""

from __future__ import annotations

import random
import re

import cocotb
import pytest
from cocotb.clock import Clock
from cocotb.triggers import ClockCycles, ReadOnly, RisingEdge
from cocotb.utils import get_sim_time
from hypafilter.hw import model as hwmodel
from hypafilter.hw import regmap, updatebuffer, vhdl

from sim.hftb import SIM_BUILD, AxiLite, hw, load_obj, run_ghdl, save_obj

PERIOD_NS = 4
# the event bits as hf_pkg.vhd numbers them, and the counter register each one increments
EV = {m[1]: int(m[2]) for m in re.finditer(r"constant EV_(\w+)\s*: natural := (\d+);", hw("hf_pkg.vhd")[0].read_text())}
EV_COUNTER = {
    "WIRE": "PKTIN",
    "FORWARDED": "CNT_FORWARDED",
    "DROPPED": "CNT_DROPPED",
    "OVERRULE": "CNT_SHUNT_OVERRULE",
    "POLICY": "CNT_SHUNT_POLICY",
    "UNPARSED": "CNT_SHUNT_UNPARSED",
    "FROM_HOST": "CNT_FROM_HOST",
    "FORCED": "CNT_SHUNT_FORCED",
    "UNFILTERABLE": "CNT_DROP_UNFILTERABLE",
    "STATE": "CNT_SHUNT_STATE",
    "MIRROR": "CNT_MIRROR",
    "SET_UNC": "CNT_SET_UNCERTAIN",
}
COUNTERS = [*EV_COUNTER.values(), "PKTOUT", "CNT_FIFO_DROP"]
CMD_TRIGGER, CMD_READ, CMD_STREAM = 0x01, 0x10, 0x100


class TB:
    """Clock, reset, AXI-Lite master, event generator and a table responder of one hf_regs, with their models."""

    def __init__(self, dut, seed: int):
        self.dut, self.rng = dut, random.Random(seed)
        cocotb.start_soon(Clock(dut.clk, PERIOD_NS, units="ns").start())
        self.axil = AxiLite(dut, dut.clk, self.rng, stall=0.3)
        self.counts = dict.fromkeys(COUNTERS, 0)
        self.events = 0.0  # chance of a frame event per cycle
        self.latency = (1, 4)  # cycles the tables take for one access
        self.requests: list[tuple[int, int, int]] = []  # (write, IND_ADDRESS, IND_WR_DATA) as the tables saw them
        self.done_at: list[float] = []  # sim time (ns) of each ind_done
        self.table: dict[int, int] = {}
        for s in ("rst", "ev_valid", "ev_bits", "ev_sent", "ev_fifo_drop", "ind_done", "ind_rdata", "lease_ticks"):
            getattr(dut, s).value = 0

    async def reset(self) -> None:
        self.dut.rst.value = 1
        await ClockCycles(self.dut.clk, 3)
        self.dut.rst.value = 0
        cocotb.start_soon(self._tables())
        cocotb.start_soon(self._events())

    async def _tables(self) -> None:
        """Answers each ind_req after `latency` cycles: writes stored, reads from the store (absent: the address)."""
        d = self.dut
        while True:
            await RisingEdge(d.clk)
            await ReadOnly()
            if not int(d.ind_req.value):
                continue
            write, addr, data = int(d.ind_write.value), int(d.ind_addr.value), int(d.ind_wdata.value)
            self.requests.append((write, addr, data))
            await ClockCycles(d.clk, self.rng.randint(*self.latency))
            if write:
                self.table[addr] = data
            d.ind_rdata.value = self.table.get(addr, addr ^ 0x5A5A5A5A)
            d.ind_done.value = 1
            self.done_at.append(get_sim_time("ns"))
            await RisingEdge(d.clk)
            d.ind_done.value = 0

    async def _events(self) -> None:
        d = self.dut
        while True:
            v = self.rng.random() < self.events
            bits, sent, lost = self.rng.getrandbits(EV["W"]), self.rng.randrange(2), self.rng.random() < self.events / 8
            d.ev_valid.value, d.ev_bits.value, d.ev_sent.value, d.ev_fifo_drop.value = int(v), bits, sent, int(lost)
            await RisingEdge(d.clk)
            if v:
                for name, reg in EV_COUNTER.items():
                    self.counts[reg] += (bits >> EV[name]) & 1
                self.counts["PKTOUT"] += sent
            self.counts["CNT_FIFO_DROP"] += lost

    async def quiet(self) -> None:
        self.events = 0.0
        await ClockCycles(self.dut.clk, 3)

    async def check_counters(self) -> None:
        for name in COUNTERS:
            assert await self.axil.read(getattr(regmap, f"REG_{name}")) == self.counts[name], name

    async def idle(self) -> None:
        """Wait for IND_COMMAND bit 0 (busy) to read 0."""
        for _ in range(2000):
            if not (await self.axil.read(regmap.REG_IND_COMMAND)) & CMD_TRIGGER:
                return
        raise AssertionError("IND_COMMAND stays busy")


@cocotb.test()
async def registers_and_indirect_access(dut):
    cfg = load_obj("HF_TB_CFG")
    tb = TB(dut, cfg["n"])
    ax, m = tb.axil, regmap.MAP
    await tb.reset()
    # reset values; '-' in regmap.txt: the generated policy package's
    depth = cfg["depth"]  # update buffer slots: δ more table rows, and BUF_CONFIG says how many
    policy = {
        "IND_CONFIG": cfg["n"] + 1 + depth,
        "NUM_ENTRIES": cfg["n"],
        "MATCHER_HASH": cfg["hash32"],
        "BUF_CONFIG": depth | 16 << 16 | updatebuffer.USED << 24,
        "SET_CONFIG": 0,  # a plan without set slots of either family: no tables, no latency, no IPv6 slots (23:16)
        "BUF6_CONFIG": 0,  # an IPv4-only core: no IPv6 update buffer
    }
    # [ctm] 0xC0-0xDC live in the core (hypafilter_core's ctm block): hf_regs reads them from x_rdata
    base = m.reg("CTM_CONTROL").offset
    dut.x_rdata.value = sum((0xC7C70000 | i) << (32 * i) for i in range(8))
    for r in m.registers:
        want = 0 if r.access == "WO" else policy[r.name] if r.reset is None else r.reset
        if base <= r.offset <= base + 28:
            want = 0xC7C70000 | (r.offset - base) // 4
        if r.name == "FLIP":
            want ^= 0xFFFFFFFF
        assert await ax.read(r.offset) == want, f"{r.name} after reset"
    assert await ax.read(max(r.offset for r in m.registers) + 4) == 0, "an address past the map reads 0"
    tb.events = 0.3
    # RW registers keep what is written (FLIP its inverse); GENERATION and CONTROL drive the datapath
    for r in m.registers:
        if r.access != "RW" or r.name == "IND_COMMAND":
            continue
        value = tb.rng.getrandbits(32)
        if base <= r.offset <= base + 28:  # [ctm] the core's: the write reaches x_wr, x_waddr, x_wdata
            await ax.write(r.offset, value)
            assert (int(dut.x_waddr.value), int(dut.x_wdata.value)) == ((r.offset - base) // 4, value), r.name
            continue
        await ax.write(r.offset, value)
        assert await ax.read(r.offset) == (value ^ 0xFFFFFFFF if r.name == "FLIP" else value), r.name
        if r.name == "GENERATION":
            assert int(dut.generation.value) == value & 0xFFFF
        if r.name == "CONTROL":
            assert int(dut.control.value) == value
    # every event counter counts at least once before the checks (FIFO drops come at events / 8 per cycle, so how
    # many the phase above gives depends on how long it ran, i.e. on the number of registers in the map)
    for _ in range(100):
        if all(tb.counts[c] for c in COUNTERS):
            break
        await ClockCycles(dut.clk, 10)
    # RO registers ignore writes (the counters keep counting)
    await tb.quiet()
    for r in m.registers:
        if r.access == "RO":
            before = await ax.read(r.offset)
            await ax.write(r.offset, ~before & 0xFFFFFFFF)
            assert await ax.read(r.offset) == before, f"{r.name} was written"
    await tb.check_counters()
    assert all(tb.counts[c] for c in COUNTERS), f"every counter should have counted: {tb.counts}"
    # RESET bit 0 clears every counter
    await ax.write(regmap.REG_RESET, 1)
    tb.counts = dict.fromkeys(COUNTERS, 0)
    await tb.check_counters()
    tb.events = 0.5

    # indirect access: one request per trigger, IND_COMMAND busy until the tables answer
    for _ in range(20):
        table, index = tb.rng.choice(m.tables).id, tb.rng.randrange(1 << 24)
        addr = regmap.ind_address(table, index)
        if tb.rng.random() < 0.5:
            value = tb.rng.getrandbits(32)
            assert await ax.table_access(regmap, table, index, value) == 0
            assert tb.requests[-1] == (1, addr, value)
        else:
            assert await ax.table_access(regmap, table, index) == tb.table.get(addr, addr ^ 0x5A5A5A5A)
            assert tb.requests[-1][:2] == (0, addr)
    assert len(tb.requests) == 20
    # a trigger while busy is ignored; the bus does not wait for the tables
    tb.latency = (60, 60)
    await ax.write(regmap.REG_IND_ADDRESS, regmap.ind_address(regmap.TABLE_ACTION, 7))
    await ax.write(regmap.REG_IND_COMMAND, CMD_TRIGGER | CMD_READ)
    await ax.write(regmap.REG_IND_COMMAND, CMD_TRIGGER | CMD_READ)
    assert (await ax.read(regmap.REG_IND_COMMAND)) == CMD_TRIGGER | CMD_READ
    await tb.idle()
    assert len(tb.requests) == 21

    # stream writes: each IND_WR_DATA is a table write at the next index, held on the bus while the last one runs
    base = tb.rng.randrange(1000)
    words = [tb.rng.getrandbits(32) for _ in range(6)]
    tb.latency = (20, 20)
    await ax.write(regmap.REG_IND_ADDRESS, regmap.ind_address(regmap.TABLE_SHUNT, base))
    await ax.write(regmap.REG_IND_COMMAND, CMD_STREAM)
    assert await ax.read(regmap.REG_IND_COMMAND) == CMD_STREAM
    ends = []
    for w in words:
        await ax.write(regmap.REG_IND_WR_DATA, w)
        ends.append(get_sim_time("ns"))
    await tb.idle()
    # the index advances with each word's completion while the mode is on (ending it earlier keeps the last index)
    assert await ax.read(regmap.REG_IND_ADDRESS) == regmap.ind_address(regmap.TABLE_SHUNT, base + len(words))
    await ax.write(regmap.REG_IND_COMMAND, 0)
    assert tb.requests[-len(words) :] == [
        (1, regmap.ind_address(regmap.TABLE_SHUNT, base + i), w) for i, w in enumerate(words)
    ]
    for k in range(1, len(words)):  # word k's bus write completes only after word k-1's table write is done
        assert ends[k] > tb.done_at[-len(words) + k - 1], f"stream word {k} was not held"
    # flow cache: FC_CMD pulses fc_cmd once with the op, the keys and the slot (ignored while FC_STATUS bit 31 is
    # set); the read-back registers show what the core supplies
    pulses: list[tuple[int, ...]] = []

    async def watch_fc():
        while True:
            await RisingEdge(dut.clk)
            await ReadOnly()
            if int(dut.fc_cmd.value):
                pulses.append(
                    tuple(
                        int(getattr(dut, p).value)
                        for p in ("fc_op", "fc_key0", "fc_key1", "fc_key2", "fc_key3", "fc_slot")
                    )
                )

    watcher = cocotb.start_soon(watch_fc())
    keys = [tb.rng.getrandbits(32) for _ in range(4)]
    for name, v in zip(("FC_KEY0", "FC_KEY1", "FC_KEY2", "FC_KEY3"), keys, strict=True):
        await ax.write(m.reg(name).offset, v)
    await ax.write(regmap.REG_FC_SLOT, 0xABCDEF12)
    await ax.write(regmap.REG_FC_CMD, 0x5)
    dut.fc_status.value = 1 << 31
    await ax.write(regmap.REG_FC_CMD, 0x2)  # busy: ignored
    assert await ax.read(regmap.REG_FC_STATUS) == 1 << 31
    for i, name in enumerate(
        ("FC_STATUS", "FC_CONFIG", "FC_NOW", "FC_OCCUPANCY", "FC_INSERTS", "FC_DELETES", "FC_FULL")
    ):
        getattr(dut, name.lower()).value = 0x1000 + i
        assert await ax.read(m.reg(name).offset) == 0x1000 + i, name
    await ClockCycles(dut.clk, 3)
    watcher.kill()
    assert pulses == [(5, *keys, 0xCDEF12)], pulses
    # nothing left in flight: counters agree, no request pending, no response outstanding
    await tb.quiet()
    await tb.check_counters()
    await ClockCycles(dut.clk, 5)
    await ReadOnly()
    assert not int(dut.s_axi_bvalid.value) and not int(dut.s_axi_rvalid.value) and not int(dut.ind_req.value)


class LeaseWatch:
    """Drives lease_ticks every cycle (`mode`: "off" none, "slow" mostly 0 and 1, "wild" also bursts of many ticks
    in one cycle; `fixed`: that many in every cycle) and follows every edge with hw.model.Lease: the ticks of the
    cycle, then a LEASE write the bus takes at that edge. lease_expired must always be the model's `expired` of the
    edge before (a registered output); `check` reads LEASE and LEASE_STATUS while the ticks are off."""

    def __init__(self, dut, rng: random.Random):
        self.dut, self.rng = dut, rng
        self.model = hwmodel.Lease()
        self.hist = [False, False]  # model.expired after the last two edges
        self.mode = "off"
        self.fixed: int | None = None
        self.cycles = 0
        self.seen: set[int] = set()  # lease_expired values met

    def ticks(self) -> int:
        if self.mode == "off":
            return 0
        if self.fixed is not None:
            return self.fixed
        r = self.rng.random()
        if self.mode == "wild" and r < 0.05:
            return self.rng.randrange(2, 200)
        return 1 if r < 0.4 else 0

    async def run(self) -> None:
        d = self.dut
        await RisingEdge(d.clk)
        while True:
            t = self.ticks()
            d.lease_ticks.value = t
            await ReadOnly()
            got = int(d.lease_expired.value)
            assert got == self.hist[-2], f"cycle {self.cycles}: lease_expired {got}, the model says {self.hist[-2]}"
            self.seen.add(got)
            fire = int(d.s_axi_awvalid.value) and int(d.s_axi_awready.value)
            addr = int(d.s_axi_awaddr.value) & ~3
            data = int(d.s_axi_wdata.value)
            await RisingEdge(d.clk)
            self.model.tick(t)
            if fire and addr == regmap.REG_LEASE:
                self.model.write(data)
            self.hist = [self.hist[-1], self.model.expired]
            self.cycles += 1

    async def check(self, ax) -> None:
        mode, self.mode = self.mode, "off"
        await ClockCycles(self.dut.clk, 2)
        assert await ax.read(regmap.REG_LEASE) == self.model.left, "LEASE (ticks left)"
        assert await ax.read(regmap.REG_LEASE_STATUS) == self.model.status(), "LEASE_STATUS"
        self.mode = mode

    async def until(self, cond, limit: int = 5000) -> None:
        for _ in range(limit):
            if cond(self.model):
                return
            await RisingEdge(self.dut.clk)
        raise AssertionError("the lease never got there")


@cocotb.test()
async def lease_countdown(dut):
    """The lease counts down by the ticks of each cycle, expires at 0 when armed (lease_expired one cycle later),
    re-arms on a write (also while expired, also in the cycle of an expiry), never expires disarmed (0), and counts
    its expiries; ticks may come one at a time or many in one cycle (the emulator's harness)."""
    cfg = load_obj("HF_TB_CFG")
    tb = TB(dut, cfg["n"] + 77)
    ax = tb.axil
    await tb.reset()
    w = LeaseWatch(dut, tb.rng)
    cocotb.start_soon(w.run())
    await w.check(ax)  # disarmed after reset: 0 left, status 0
    assert w.model.status() == 0
    w.mode = "slow"
    await ClockCycles(dut.clk, 200)  # disarmed: ticks change nothing
    assert not w.model.expired
    await ax.write(regmap.REG_LEASE, 60)
    await w.check(ax)
    await w.until(lambda m: m.expired)
    await ClockCycles(dut.clk, 3)
    await w.check(ax)
    assert w.model.status() == 0x10003, "armed, expired, one expiry"
    await ax.write(regmap.REG_LEASE, 1000)  # re-armed while expired
    await ClockCycles(dut.clk, 50)
    await w.check(ax)
    assert not w.model.expired and 0 < w.model.left < 1000
    w.mode = "wild"
    await w.until(lambda m: m.expired)  # bursts of ticks in one cycle
    await ax.write(regmap.REG_LEASE, 0)  # disarmed: not expired, stays so
    await ClockCycles(dut.clk, 100)
    await w.check(ax)
    assert w.model.status() == 2 << 16
    # the widest lease, run down by one cycle's ticks
    w.mode = "off"
    await ax.write(regmap.REG_LEASE, 0xFFFFFFFF)
    await ClockCycles(dut.clk, 3)
    assert w.model.left == 0xFFFFFFFF
    await w.check(ax)
    w.fixed, w.mode = 0xFFFFFFFF, "slow"
    await w.until(lambda m: m.expired)
    w.fixed = None
    # short leases written at random while the ticks run: writes meet expiries in the same cycles
    w.mode = "wild"
    for _ in range(40):
        await ax.write(regmap.REG_LEASE, tb.rng.choice((0, 1, 2, 3, tb.rng.randrange(1, 40))))
        await ClockCycles(dut.clk, tb.rng.randrange(0, 30))
    await w.check(ax)
    assert w.seen == {0, 1}
    assert w.cycles > 1000


@pytest.mark.sim
@pytest.mark.parametrize("addr_width", [8, 12])
def test_regs(addr_width):
    tag = f"a{addr_width}"
    out = SIM_BUILD / "hf_regs" / tag
    plan = vhdl.HwPlan([vhdl.HwEntry(()) for _ in range(9)], [0] * 10, [1] * 10, "ab" * 32)
    gen = out / "gen"
    vhdl.render(plan, gen)
    cfg = save_obj(
        {"n": 9, "depth": plan.buffer_depth, "hash32": int(vhdl.matcher_hash(plan)[-8:], 16)}, out / "cfg.pkl"
    )
    sources = [gen / "hf_regs_pkg.vhd", gen / "hf_policy_pkg.vhd", *hw("hf_pkg.vhd", "hf_regs.vhd")]
    run_ghdl("hf_regs", sources, tag, {"ADDR_WIDTH": addr_width}, env={"HF_TB_CFG": str(cfg)})
