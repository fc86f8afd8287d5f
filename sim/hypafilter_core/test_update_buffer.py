"""The core with its update buffer (SFL): a policy changed by inserts and deletes while frames stream. Each change is
what the host writes (analysis.overlay.align's View: the rows that differ, then hw.updatebuffer.writes: disable,
valid mask, fields, enable last) inside CONTROL bit 1. Every frame is checked against hw.model: a frame decided
before the bracket under the old tables, one that entered after it under the new ones, any other under either or
shunted by the bracket; a frame wholly inside the bracket must be shunted. Counters, HITS and the VALID/BUF words
are read back."""

from __future__ import annotations

import dataclasses
import random
from collections import Counter

import cocotb
import pytest
from cocotb.triggers import RisingEdge
from hypafilter.analysis.overlay import align
from hypafilter.analysis.plan import build_plan
from hypafilter.config import Config
from hypafilter.hw import model as hwmodel
from hypafilter.hw import regmap, updatebuffer, vhdl
from hypafilter.ir import Policy, Rule
from hypafilter.shared import unpack_meta

from conftest import TEST_FULL
from sim.hftb import cycle, load_obj
from sim.hftraffic import frames_for
from sim.hypafilter_core.test_hypafilter_core import TB, _run_core, random_policy

DEPTH = 16
GENERATIONS = (0x11, 0x12, 0x13, 0x14)
R = regmap


def _stateless(policy: Policy) -> Policy:
    """The policy with its complex rules made complex by a match that reads no conntrack state (no miss forcing)."""
    rules = [
        Rule(r.boxes, r.target, complex=(("-m", "mark", "--mark", "1"),) if r.complex else ()) for r in policy.rules
    ]
    return Policy(rules, policy.default, original_rules=policy.original_rules)


def plans(seed: int):
    """The static plan and the master plans of three changes, as Views over the static matcher: inserts; instead of
    them deletes and an insert; back to the static rule set (the buffer emptied)."""
    rng = random.Random(seed)
    cfg = Config(update_buffer=DEPTH)
    base = _stateless(random_policy(rng, 30))
    static = build_plan(base, cfg)
    extra = _stateless(random_policy(rng, 6)).rules
    one = list(base.rules)
    for r in extra[:3]:  # early, where they win over most of the static entries
        one.insert(rng.randrange(4), r)
    # the rules of the two entries that see the most traffic deleted, and one more; one rule inserted
    hits = Counter()
    pristine = updatebuffer.pristine(len(static.entries), DEPTH)
    for f, t in frames_for(static, random.Random(seed + 1), 300):
        hdr = hwmodel.parse_frame(f, (t >> 16) & 0xFF)
        if hdr is not None:
            hits[hwmodel.hw_index(static, hdr, pristine)] += 1
    top = [j for j, _ in hits.most_common() if j < len(static.entries)][:2]
    gone = {static.entries[j].rule_index for j in top} | {rng.randrange(len(base.rules))}
    two = [r for i, r in enumerate(base.rules) if i not in gone]
    two.insert(rng.randrange(len(two) + 1), extra[3])
    masters = [
        build_plan(Policy(rs, base.default, original_rules=[(f"change {k}",)]), cfg) for k, rs in enumerate((one, two))
    ]
    masters.append(static)
    views = [align(static.entries, m, DEPTH) for m in masters]
    assert views[0].slots and not views[1].valid.all() and views[2].overlay.pristine
    return static, masters, views


class Aim:
    """Frames aimed at every entry of the static rule set and of the changes."""

    def __init__(self, plans_):
        self.entries = [e for p in plans_ for e in p.entries]


def unique(frames):
    seen, out = set(), []
    for f, t in frames:
        if (f, t) not in seen:
            seen.add((f, t))
            out.append((f, t))
    return out


def outcome(d: hwmodel.Decision, tuser: int):
    """(emitted?, output tuser) of a decision."""
    return (d.kind != hwmodel.Kind.DROP, hwmodel.out_tuser(tuser, d) if d.kind != hwmodel.Kind.DROP else None)


async def drain(tb, quiet: int = 200) -> None:
    """Until no frame has come out for `quiet` cycles; then nothing may be in flight."""
    last, idle = len(tb.sink.frames), 0
    while idle < quiet:
        await RisingEdge(tb.dut.axis_aclk)
        idle = idle + 1 if len(tb.sink.frames) == last else 0
        last = len(tb.sink.frames)
    assert not tb.sink.mid_frame and not int(tb.dut.m_axis_tvalid.value), "a frame is still in flight"


async def stream_write(ax, table: int, start: int, words) -> None:
    """Stream writes (IND_COMMAND bit 8), then wait for the last one (what NicClient's transports do)."""
    await ax.write(R.REG_IND_ADDRESS, R.ind_address(table, start))
    await ax.write(R.REG_IND_COMMAND, 0x100)
    for w in words:
        await ax.write(R.REG_IND_WR_DATA, w)
    await ax.write(R.REG_IND_COMMAND, 0)
    for _ in range(1000):
        if not await ax.read(R.REG_IND_COMMAND) & 1:
            return
    raise AssertionError("stream write never completed")


def row_writes(old: hwmodel.Regs, new: hwmodel.Regs):
    """The SHUNT words and ACTION words that differ, in runs (NicClient.write_tables)."""
    out = []
    pack = updatebuffer.valid_words  # the SHUNT table packs bits as VALID does: 32 rows per word
    for table, a, b in ((R.TABLE_SHUNT, pack(old.shunt), pack(new.shunt)), (R.TABLE_ACTION, old.actions, new.actions)):
        i = 0
        while i < len(b):
            if a[i] == b[i]:
                i += 1
                continue
            j = i
            while j < len(b) and a[j] != b[j]:
                j += 1
            out.append((table, i, list(b[i:j])))
            i = j
    return out


@cocotb.test()
async def core_updates(dut):
    cfg = load_obj("HF_TB_CFG")
    static, views, phases = cfg["plan"], cfg["views"], cfg["phases"]
    n = len(static.entries)
    tb = TB(dut, cfg["seed"], idle=0.2, ready=0.7)
    await tb.reset(n + 1 + DEPTH)
    ax = tb.axil
    regs = hwmodel.Regs.from_plan(static)
    await ax.write(R.REG_GENERATION, GENERATIONS[0])
    regs.generation = GENERATIONS[0]
    counts: dict[str, int] = {}
    forced_max = 0
    hits_lo = [0] * (n + 1 + DEPTH)
    hits_hi = [0] * (n + 1 + DEPTH)
    emitted = 0
    kinds = {"before": 0, "after": 0, "bracket": 0, "inside": 0, "slot": 0, "masked": 0}
    pristine = updatebuffer.pristine(n, DEPTH)

    for k, frames in enumerate(phases):
        new = hwmodel.Regs.from_plan(views[k - 1]) if k else regs
        if k:
            new.generation = GENERATIONS[k]
        first = len(tb.sink.frames)
        start = len(tb.src.accepted_first)
        sender = cocotb.start_soon(tb.src.send(frames))
        ts = te = None
        if k:
            while len(tb.src.accepted_first) - start < len(frames) // 4:
                await RisingEdge(dut.axis_aclk)
            ts = cycle()
            await ax.write(R.REG_CONTROL, regs.control | hwmodel.CONTROL_SHUNT_ALL)
            for table, i, words in row_writes(regs, new):
                await stream_write(ax, table, i, words)
            for name, i, words in updatebuffer.writes(regs.buffer, new.buffer):
                await stream_write(ax, R.MAP.table(name).id, i, words)
            await ax.write(R.REG_GENERATION, new.generation)
            await ax.write(R.REG_CONTROL, new.control)
            te = cycle()
        await sender
        await drain(tb)
        # every frame left the core or was dropped: match outputs to frames in order (frames are unique)
        outs = tb.sink.frames[first:]
        acc = tb.src.accepted_first[start:]
        o = 0
        later_out = [None] * len(frames)  # the first output cycle of this frame or of a later emitted one
        seq = []
        for f, _tu in frames:
            if o < len(outs) and outs[o][0] == f:
                seq.append(outs[o])
                o += 1
            else:
                seq.append(None)
        assert o == len(outs), f"phase {k}: {len(outs) - o} output frames match no input frame in order"
        nxt = None
        for i in range(len(frames) - 1, -1, -1):
            if seq[i] is not None:
                nxt = seq[i][2]
            later_out[i] = nxt
        for i, (f, tu) in enumerate(frames):
            sp = (tu >> 16) & 0xFF
            before = hwmodel.decide(static, f, sp, regs)
            after = hwmodel.decide(static, f, sp, new)
            got = (seq[i] is not None, seq[i][1] if seq[i] is not None else None)
            if ts is None or (later_out[i] is not None and later_out[i] < ts):
                allowed, tag = [before], "before"
            elif acc[i] > te:
                allowed, tag = [after], "after"
            else:
                allowed, tag = [before, after], "bracket"
            match = [d for d in allowed if outcome(d, tu) == got]
            if match:
                d = match[0]
                kinds[tag] += 1
                for name in d.counters:
                    counts[name] = counts.get(name, 0) + 1
                if tag == "bracket" and "CNT_SHUNT_FORCED" not in d.counters and d.kind == hwmodel.Kind.SHUNT:
                    forced_max += 1
                if d.match_index is not None and d.reason != hwmodel.REASON_UNPARSED:
                    idx = {x.match_index for x in match}
                    for x in idx:
                        hits_hi[x] += 1
                    if len(idx) == 1:
                        hits_lo[d.match_index] += 1
                if tag == "after" and d.match_index is not None and d.reason != hwmodel.REASON_UNPARSED:
                    kinds["slot"] += d.match_index > n
                    # the static entry it hit before the change is masked off now
                    hdr = hwmodel.parse_frame(f, sp)
                    was = hwmodel.hw_index(static, hdr, pristine)
                    kinds["masked"] += was < n and not updatebuffer.valid_of(new.buffer.valid, n)[was]
            else:
                # only a frame the bracket may have touched can be shunted with tables from in between
                assert tag == "bracket" and got[0], (
                    f"phase {k} frame {i} ({tag}): {got} not {[outcome(d, tu) for d in allowed]}"
                )
                m = unpack_meta(got[1] >> 64)
                assert (got[1] >> 24) & 0xFF == sp << 1, f"phase {k} frame {i}: bracketed frame not shunted"
                assert m["magic"] == 0x4846 and m["reason"] in (0, 1), f"phase {k} frame {i}: metadata {m}"
                assert m["generation"] in (regs.generation, new.generation)
                kinds["bracket"] += 1
                reason = "CNT_SHUNT_POLICY" if m["reason"] == 1 else "CNT_SHUNT_OVERRULE"
                counts[reason] = counts.get(reason, 0) + 1
                forced_max += 1
                hits_lo[m["index"]] += 1
                hits_hi[m["index"]] += 1
            if ts is not None and seq[i] is not None and acc[i] >= ts and seq[i][2] <= te:
                # wholly inside the bracket: shunted (unparsed frames keep reason 2, host frames pass)
                if sp in hwmodel.WIRE_PORTS:
                    assert (seq[i][1] >> 24) & 0xFF == sp << 1, f"phase {k} frame {i}: decided inside the bracket"
                    kinds["inside"] += 1
            if sp in hwmodel.WIRE_PORTS:
                counts["PKTIN"] = counts.get("PKTIN", 0) + 1
            if seq[i] is not None:
                counts["PKTOUT"] = counts.get("PKTOUT", 0) + 1
                emitted += 1
        regs = new
    # counters: exact but CNT_SHUNT_FORCED, which a bracketed frame may or may not have counted
    for r in R.MAP.registers:
        if not (r.name.startswith("CNT_") or r.name in ("PKTIN", "PKTOUT")):
            continue
        got = await ax.read(r.offset)
        if r.name == "CNT_SHUNT_FORCED":
            assert counts.get(r.name, 0) <= got <= counts.get(r.name, 0) + forced_max, (r.name, got, forced_max)
        else:
            assert got == counts.get(r.name, 0), (r.name, got, counts.get(r.name, 0))
    for i in range(n + 1 + DEPTH):
        h = await ax.table_access(R, R.TABLE_HITS, i)
        assert hits_lo[i] <= h <= hits_hi[i], f"HITS[{i}] = {h}, expected {hits_lo[i]}..{hits_hi[i]}"
    # the VALID and BUF words read back as written, the rows too
    for w, v in enumerate(regs.buffer.valid):
        assert await ax.table_access(R, R.TABLE_VALID, w) == v
    for b in range(DEPTH):
        for w in range(updatebuffer.USED):
            got = await ax.table_access(R, R.TABLE_BUF, b * updatebuffer.WORDS + w)
            want = regs.buffer.buf[b * updatebuffer.USED + w]
            assert got == want or not regs.buffer.enabled(b), f"BUF slot {b} word {w}"
    assert kinds["before"] and kinds["after"] and kinds["bracket"] and kinds["inside"], kinds
    assert kinds["slot"] > 10 and kinds["masked"] > 5, f"too few frames decided by a slot or a masked entry: {kinds}"
    dut._log.info("core_updates: %d frames, %d out, %s, counters %s", sum(map(len, phases)), emitted, kinds, counts)


# ---------------------------------------------------------------- pytest side


@pytest.mark.sim
def test_core_update_buffer():
    """Inserts and deletes taken by the running core (256 bits, δ = 16) while frames stream."""
    seed = 23
    static, masters, views = plans(seed)
    aim = Aim([static, *masters])
    rng = random.Random(seed)
    phases = [unique(frames_for(aim, rng, c)) for c in (150, 350, 350, 350)]
    _run_core(
        "updates_w256",
        static,
        256,
        seed,
        (1,),
        testcase="core_updates",
        extra={"views": views, "phases": phases},
        test_module="test_update_buffer",
    )


@TEST_FULL  # make test-full
@pytest.mark.sim
def test_core_rate_with_update_buffer():
    """The buffer costs vhdl.buffer_latency(δ) cycles of latency and no throughput: core_rate at 512 bits (one 60-byte
    frame per cycle) on one plan built without slots and with 64 (3 cycles: the win register, two encoder stages)."""
    base = vhdl.minimal_plan(random_policy(random.Random(512), 40))
    figures = {}
    for depth in (0, 64):
        plan = dataclasses.replace(base, buffer_depth=depth)
        out = _run_core(f"rate_d{depth}_w512", plan, 512, seed=512, counts=(1,), testcase="core_rate")
        text = (out / "rate.txt").read_text()
        words = dict(w.split("=") for w in text.split() if "=" in w and w[0] != "(")
        figures[depth] = {k: float(words[k]) for k in ("packets/cycle", "latency_cycles")}
    assert (
        figures[64]["latency_cycles"]
        == figures[0]["latency_cycles"] + vhdl.buffer_latency(64)
        == (figures[0]["latency_cycles"] + 3)
    ), figures
    assert figures[64]["packets/cycle"] == figures[0]["packets/cycle"] == 1.0, figures
