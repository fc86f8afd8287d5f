"""Testbench of a dual-stack hypafilter_core's IPv6 update buffer (hf_update_buffer6 in the core, docs/ipv6.md "## emu"):
a core generated from an IPv4 plan and a static IPv6 plan; the IPv6 buffer then written (tables VALID6 and BUF6, as
hw.updatebuffer.writes6 orders them) from analysis.overlay.align6's View of a new IPv6 policy that bans a /128 first,
inside the /48 of a static TCP entry, deletes a static UDP ACCEPT (VALID6 masks it) and adds a /64 UDP DROP in its
place. IPv6 frames at and around every bound of both policies (and each 32-bit chunk of the ban's address one step
off) go through the core three times: shunt everything with the pristine buffer (every match_index the static plan's),
shunt everything with the buffer written (match_index = V6_BASE + the SFL decision over VALID6 and the slots), then
the View's rows in SHUNT/ACTION and classification on (every frame's fate the new plan's own row's)."""

from __future__ import annotations

import random
import shutil

import cocotb
import pytest
from hypafilter.analysis.decision import match_index
from hypafilter.analysis.overlay import align6
from hypafilter.analysis.plan import action_words, build_plan
from hypafilter.config import Config
from hypafilter.hw import model as hwmodel
from hypafilter.hw import regmap, updatebuffer, vhdl
from hypafilter.iptables.document import parse_policy
from hypafilter.ir import Header
from hypafilter.shared import pack_meta

from sim.hftb import SIM_BUILD, load_obj, run_ghdl, save_obj, tuser_for
from sim.hftraffic import PORT_OF_IPORT
from sim.hypafilter_core.test_core_ipv6 import bound_headers, frame6, random_header6
from sim.hypafilter_core.test_hypafilter_core import FIFO_BYTES, TB

V4_RULES = """*filter
:FORWARD DROP [0:0]
-A FORWARD -p tcp -s 10.0.0.0/8 --dport 22 -j ACCEPT
COMMIT
"""
V6_STATIC = """*filter
:FORWARD DROP [0:0]
-A FORWARD -p tcp -s 2001:db8:1::/48 --dport 80:88 -j ACCEPT
-A FORWARD -p udp -d 2001:db8:2::/48 --dport 53 -j ACCEPT
-A FORWARD -p ipv6-icmp --icmpv6-type echo-request -j ACCEPT
-A FORWARD -d 2001:db8:5::/48 -j DROP
COMMIT
"""
BAN = 0x20010DB8000100050000000000000066  # 2001:db8:1:5::66, inside the first rule's /48
V6_NEW = """*filter
:FORWARD DROP [0:0]
-A FORWARD -s 2001:db8:1:5::66/128 -j DROP
-A FORWARD -p tcp -s 2001:db8:1::/48 --dport 80:88 -j ACCEPT
-A FORWARD -p udp -d 2001:db8:2:7::/64 -j DROP
-A FORWARD -p ipv6-icmp --icmpv6-type echo-request -j ACCEPT
-A FORWARD -d 2001:db8:5::/48 -j ACCEPT
COMMIT
"""
DEPTH = 4  # the IPv4 buffer's slots, and so the IPv6 buffer's (vhdl.buffer6_depth)
TAG = "buffer6_w256"


def plans():
    """(IPv4 plan, static IPv6 plan, new IPv6 plan), as the compiler builds them."""
    cfg = Config(update_buffer=DEPTH)
    p4 = build_plan(parse_policy(V4_RULES, "v4.rules"), cfg)
    s6 = build_plan(parse_policy(V6_STATIC, "s6.rules", family=6), cfg)
    n6 = build_plan(parse_policy(V6_NEW, "n6.rules", family=6), cfg)
    return p4, s6, n6


def headers(s6, n6, rng: random.Random) -> list[Header]:
    """Both policies' bounds, random headers, and the ban's address with each 32-bit chunk one step off."""
    hs = bound_headers(s6, rng) + bound_headers(n6, rng) + [random_header6(rng) for _ in range(40)]
    for d in (0, 1, -1, 1 << 32, -(1 << 32), 1 << 64, -(1 << 64), 1 << 96, -(1 << 96)):
        for proto, dport, it in ((6, 80, 0), (17, 53, 0), (58, 0, 128)):
            hs.append(
                Header(src=BAN + d, dst=0x20010DB8000200070000000000000001, proto=proto, sport=1234 if dport else 0,
                       dport=dport, icmp_type=it, icmp_code=0, iport=rng.randrange(4), ct=0,
                       tcp_flags=0x10 if proto == 6 else 0)
            )  # fmt: skip
    return hs


def expect(idx: int, h_src_port: int, tu: int, regs: hwmodel.Regs, policy: int) -> hwmodel.Decision:
    """The core's decision for a parsed IPv6 frame of hardware index idx (the tables' row, CONTROL)."""
    gen = regs.generation & 0xFFFF
    action = regs.actions[idx] & 7
    reason = hwmodel.REASON_POLICY if idx == policy else hwmodel.REASON_OVERRULE
    meta = pack_meta(idx, action, reason, gen)
    if regs.shunt[idx] or action not in (1, 2) or regs.control & hwmodel.CONTROL_SHUNT_ALL:
        return hwmodel.Decision(hwmodel.Kind.SHUNT, h_src_port << 1, meta, idx, action, reason)
    if action == 1:
        return hwmodel.Decision(hwmodel.Kind.FORWARD, hwmodel.PAIRED[h_src_port], None, idx, action, None)
    return hwmodel.Decision(hwmodel.Kind.DROP, 0, None, idx, action, None)


@cocotb.test()
async def core_buffer6(dut):
    cfg = load_obj("HF_TB_CFG")
    p4, s6, view, frames = cfg["plan4"], cfg["static6"], cfg["view"], cfg["frames"]
    n6 = len(s6.entries)
    base = vhdl.v6_base(p4)
    d6 = vhdl.buffer6_depth(p4, s6)
    rows = base + n6 + 1 + d6
    tb = TB(dut, 6, idle=0.2, ready=0.7)
    await tb.reset(rows)
    ax, R = tb.axil, regmap
    assert await ax.read(R.REG_IND_CONFIG) == rows
    assert await ax.read(R.REG_BUF6_CONFIG) == d6 | updatebuffer.WORDS6 << 16 | updatebuffer.USED6 << 24
    regs = hwmodel.Regs.from_plan(p4)
    regs.shunt = list(regs.shunt) + [int(b) for b in s6.shunt] + [1] * d6
    regs.actions = list(regs.actions) + list(action_words(s6)) + [0] * d6
    regs.control = hwmodel.CONTROL_ENABLE | hwmodel.CONTROL_SHUNT_ALL
    await ax.write(R.REG_CONTROL, regs.control)
    img = updatebuffer.image6(view.overlay)
    seen = []
    for phase in range(3):
        if phase == 1:  # the buffer written as the host writes it (inside shunt-everything already)
            for table, start, words in updatebuffer.writes6(updatebuffer.pristine6(n6, d6), img):
                for k, w in enumerate(words):
                    await ax.table_access(R, getattr(R, f"TABLE_{table}"), start + k, w)
        if phase == 2:  # the View's rows (the new plan's), then classification on
            for j in range(view.overlay.rows):
                regs.shunt[base + j] = int(view.shunt[j])
                regs.actions[base + j] = int(action_words(view)[j])
                await ax.table_access(R, R.TABLE_ACTION, base + j, regs.actions[base + j])
            for w in range(base // 32, (rows + 31) // 32):
                word = sum(b << k for k, b in enumerate(regs.shunt[32 * w : 32 * w + 32]))
                await ax.table_access(R, R.TABLE_SHUNT, w, word)
            regs.control = hwmodel.CONTROL_ENABLE
            await ax.write(R.REG_CONTROL, regs.control)
        expected, idxs = [], []
        for f, tu, (i_static, i_view) in frames:
            sp = (tu >> 16) & 0xFF
            idx = base + (i_static if phase == 0 else i_view)
            idxs.append(idx)
            d = expect(idx, sp, tu, regs, base + n6)
            if d.kind != hwmodel.Kind.DROP:
                expected.append((f, hwmodel.out_tuser(tu, d), d))
        seen.append(idxs)
        n_out = len(tb.sink.frames)
        await tb.src.send([(f, tu) for f, tu, _ in frames])
        await tb.wait_out(n_out + len(expected))
        for k, ((f, tu, d), (got, gtu, _)) in enumerate(zip(expected, tb.sink.frames[n_out:], strict=True)):
            what = f"phase {phase}, frame {k}: {d.kind.name}, index {d.match_index}"
            assert got == f, f"{what}: another frame came out"
            assert gtu == tu, f"{what}: tuser {gtu:#x} != {tu:#x}"
    # the buffer's words read back; the slots decided frames ahead of the static entries they precede, and the
    # deleted entry (VALID6 bit 1) matched frames before the write and none after
    for b in range(d6):
        for w in range(updatebuffer.USED6):
            got = await ax.table_access(R, R.TABLE_BUF6, b * updatebuffer.WORDS6 + w)
            assert got == img.slot(b)[w], f"BUF6 slot {b} word {w}"
    assert await ax.table_access(R, R.TABLE_VALID6, 0) == img.valid[0]
    slot_rows = set(range(base + n6 + 1, rows))
    assert any(i in slot_rows for i in seen[1]) and not any(i in slot_rows for i in seen[0])
    assert base + 1 in seen[0] and base + 1 not in seen[1]
    dut._log.info("core_buffer6: %d frames a phase, %d decided by slots", len(frames),
                  sum(i in slot_rows for i in seen[1]))  # fmt: skip


@pytest.mark.sim
def test_core_buffer6():
    """core_buffer6 on a dual-stack core with δ = δ6 = 4 (256 bits)."""
    p4, s6, n6 = plans()
    view = align6(s6, n6, vhdl.buffer6_depth(p4, s6))
    assert view.slots and not view.valid.all(), "the change must use slots and mask an entry"
    rng = random.Random(6)
    frames = []
    won = 0
    for h in headers(s6, n6, rng):
        f = frame6(h, "", rng)
        i_static = match_index(s6, s6.addr_map.header(h))
        i_view = hwmodel.hw_index6(view.entries, view.overlay, h)
        # the oracle of the View itself: its row of the SFL decision is the new plan's own row for the header
        j = match_index(n6, n6.addr_map.header(h))
        assert (bool(view.shunt[i_view]), int(view.actions[i_view])) == (bool(n6.shunt[j]), int(n6.actions[j])), h
        won += i_view > view.n
        frames.append((f, tuser_for(f, PORT_OF_IPORT[h.iport]), (i_static, i_view)))
    assert won > 0
    out = SIM_BUILD / "hypafilter_core" / TAG
    if out.exists():
        shutil.rmtree(out)
    gen = out / "gen"
    vhdl.render(p4, gen, tdata_width=256, plan6=s6)
    cfg = save_obj({"plan4": p4, "static6": s6, "view": view, "frames": frames}, out / "cfg.pkl")
    run_ghdl(
        "hypafilter_core",
        vhdl.sources(gen),
        TAG,
        {"C_S_AXIS_DATA_WIDTH": 256, "C_FIFO_DEPTH_BYTES": FIFO_BYTES},
        env={"HF_TB_CFG": str(cfg)},
        testcase="core_buffer6",
        test_module="test_core_update_buffer6",
        build_args=["-O0"],
    )
