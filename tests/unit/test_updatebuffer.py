"""The update buffer's register image (hw.updatebuffer): slot words and back, the Overlay an image describes, the
order of the host's writes, the model deciding from an image as the View does, the configuration key, and the
register client's write_overlay / read_overlay / program(View) against the fake control socket of test_nic."""

from __future__ import annotations

import random

import numpy as np
import pytest
from hypafilter.analysis import decision
from hypafilter.analysis.overlay import Overlay, Slot, align, box_key
from hypafilter.analysis.plan import build_plan
from hypafilter.config import Config
from hypafilter.errors import HypafilterError
from hypafilter.hw import model as hwmodel
from hypafilter.hw import regmap, updatebuffer, vhdl
from hypafilter.hw.updatebuffer import ENABLE, USED, W_CONTROL, WORDS, Image
from hypafilter.ir import MAXV, Box, Header
from hypafilter.targets.nic import EmuTransport, NicClient

from tests.irbuild import make_policy, make_rule
from tests.unit.test_nic import fake  # noqa: F401 (the fake NIC's fixture)


def random_box(rng: random.Random) -> Box:
    lo, hi = [], []
    for m in MAXV:
        a, b = sorted((rng.randint(0, m), rng.randint(0, m)))
        if rng.random() < 0.3:
            a, b = 0, m
        lo.append(a)
        hi.append(b)
    mask = rng.randrange(256) if rng.random() < 0.5 else 0
    return Box(tuple(lo), tuple(hi), mask, rng.randrange(256) & mask)


def test_slot_words_round_trip_within_the_word_masks():
    rng = random.Random(1)
    for _ in range(300):
        s = Slot(random_box(rng), rng.randrange(1 << 20), -1)
        w = updatebuffer.slot_words(s)
        assert len(w) == USED and w[W_CONTROL] == ENABLE | s.pos
        assert all(x & ~m == 0 for x, m in zip(w, updatebuffer.WORD_MASKS, strict=True))
        assert updatebuffer.slot_of(w) == s
    assert updatebuffer.slot_of(updatebuffer.slot_words(None)) is None
    full = updatebuffer.slot_words(Slot(Box.full(), 7, 0))
    assert full[:4] == [0, 0xFFFFFFFF, 0, 0xFFFFFFFF] and full[4] == full[5] == 0xFFFF << 16
    assert full[6] == 0xFF << 8 | 0xFF << 24 and full[7] == 0xFF << 8 | 3 << 18 | 3 << 22
    # a flags value with bits outside the mask never matches: such words read back as the never-matching box
    w = full[:]
    w[updatebuffer.W_FLAGS] = 0x01 | 0x02 << 8
    assert updatebuffer.slot_of(w).box == updatebuffer.NEVER
    with pytest.raises(ValueError, match="empty box"):
        updatebuffer.slot_words(Slot(updatebuffer.NEVER, 0, 0))


def test_regmap_describes_the_tables_the_layout_fills():
    m = regmap.MAP
    assert (m.table("VALID").id, m.table("BUF").id) == (6, 7)
    assert len({t.id for t in m.tables}) == len(m.tables)
    assert m.table("BUF").depth == config_max_slots() * WORDS
    doc = m.table("BUF").doc
    for name, (lw, ls, _hw, hs) in updatebuffer.LAYOUT.items():
        lo = f"{name} lo" + (f" << {ls}" if ls else "")
        hi = f"{name} hi" + (f" << {hs}" if hs else "")
        assert f"w{lw} " in doc and lo in doc and hi in doc, name
    assert f"w{W_CONTROL} control: enable << 31 | pos" in doc
    assert m.reg("BUF_CONFIG").access == "RO" and m.reg("VERSION").reset >= 0x00010007


def config_max_slots() -> int:
    from hypafilter.config import UPDATE_BUFFER_MAX

    return UPDATE_BUFFER_MAX


def _plans(rng: random.Random, depth: int = 16):
    """A static plan and a changed one (inserts and deletes) with its View over the static matcher."""
    base = []
    for _ in range(rng.randint(2, 8)):
        port = rng.choice((22, 53, 80, 443))
        kw = {"proto": rng.choice(("tcp", "udp")), "dport": (port, port)}
        if rng.random() < 0.5:
            kw["src"] = rng.choice(("10.0.0.0/8", "10.1.0.0/16", "192.168.0.0/24"))
        base.append(make_rule(rng.choice(("ACCEPT", "DROP")), **kw))
    changed = list(base)
    for _ in range(rng.randint(1, 3)):
        if changed and rng.random() < 0.5:
            del changed[rng.randrange(len(changed))]
        else:
            changed.insert(
                rng.randint(0, len(changed)), make_rule(rng.choice(("ACCEPT", "DROP")), proto="tcp", dports=[22, 80])
            )
    cfg = Config(update_buffer=depth)
    static = build_plan(make_policy(base, "DROP"), cfg, mode="index")
    master = build_plan(make_policy(changed, "DROP"), cfg, mode="index")
    return static, master, align(static.entries, master, depth)


def _headers(rng: random.Random, count: int) -> list[Header]:
    out = []
    for _ in range(count):
        src = rng.choice((0x0A000001, 0x0A010203, 0xC0A80005, 0x08080808))
        out.append(Header(src, 0x0B000001, rng.choice((6, 17)), rng.randrange(1024, 65536), rng.choice((22, 53, 80))))
    return out


def test_the_model_decides_a_register_image_as_the_view():
    """hw.model with the View's tables as registers (rows, VALID and BUF words) gives the View's hardware index
    (analysis.overlay.hw_indices through analysis.decision) and its shunt bit and action for every header."""
    rng = random.Random(7)
    checked = 0
    for _ in range(40):
        static, master, view = _plans(rng)
        regs = hwmodel.Regs.from_plan(view)
        assert regs.buffer == updatebuffer.image(view.overlay)
        assert len(regs.shunt) == len(regs.actions) == view.overlay.rows
        for h in _headers(rng, 30):
            hw = hwmodel.hw_index(static, h, regs.buffer)  # the static plan under the register image
            assert hw == decision.match_index(view, h) == hwmodel.hw_index(view, h, None)
            assert view.master[hw] == decision.match_index(master, h)
            checked += hw > len(static.entries)
    assert checked > 50, "too few headers reached a buffer slot"


def test_overlay_of_keeps_the_indices_of_disabled_slots():
    a = Box.full().with_field("dport", 80, 80)
    b = Box.full().with_field("dport", 22, 22)
    ov = Overlay(3, 4, np.array([True, False, True]), (Slot(a, 0, 0), Slot(a, 1, 1), Slot(b, 2, 2)))
    img = updatebuffer.image(ov)
    assert updatebuffer.overlay_of(img).slots == tuple(Slot(s.box, s.pos, -1) for s in ov.slots)
    holed = Image(img.n, img.valid, img.buf[:USED] + (0,) * USED + img.buf[2 * USED :])
    back = updatebuffer.overlay_of(holed)
    assert [s.box for s in back.slots] == [a, updatebuffer.NEVER, b] and back.slots[1].pos == 0
    other = Box.full().with_field("dport", 9, 9)
    plan = vhdl.HwPlan([vhdl.HwEntry((other,))] * 3, [0] * 4, [1] * 4, "ab" * 32, buffer_depth=4)
    h = Header(1, 2, 6, 1000, 22)
    assert hwmodel.hw_index(plan, h, holed) == 3 + 1 + 2  # slot 2 keeps its index, slot 1 never matches
    assert hwmodel.hw_index(plan, Header(1, 2, 6, 1000, 9), holed) == 0
    unsorted = Image(img.n, img.valid, img.buf[2 * USED : 3 * USED] + img.buf[USED:])
    with pytest.raises(ValueError, match="sorted"):
        updatebuffer.overlay_of(unsorted)
    assert updatebuffer.pristine(3, 4).pristine and not img.pristine


def test_writes_disable_first_and_enable_last():
    a, b, c = (Box.full().with_field("dport", p, p) for p in (22, 80, 443))
    old = updatebuffer.image(Overlay(40, 4, np.ones(40, bool), (Slot(a, 0, 0), Slot(b, 5, 1), Slot(c, 9, 2))))
    valid = np.ones(40, bool)
    valid[33] = False
    new = updatebuffer.image(Overlay(40, 4, valid, (Slot(a, 0, 0), Slot(c, 9, 2))))
    ops = updatebuffer.writes(old, new)
    assert (
        ops
        == [
            ("BUF", 1 * WORDS + W_CONTROL, [0]),  # slot 1 changes (c replaces b): disabled first
            ("BUF", 2 * WORDS + W_CONTROL, [0]),  # slot 2 is unused now: disabled, its fields stay
            ("VALID", 1, [0xFF & ~(1 << 1)]),
            (
                "BUF",
                1 * WORDS,
                updatebuffer.slot_words(Slot(c, 9, 2))[: W_CONTROL + 1],
            ),  # fields, control word: enabled
        ]
    )
    assert updatebuffer.writes(new, new) == []
    assert updatebuffer.writes(new, old)[0] == ("BUF", 1 * WORDS + W_CONTROL, [0])
    # a slot disabled before and after compares equal whatever stale fields it keeps
    slot2 = list(old.buf[2 * USED : 3 * USED])
    slot2[W_CONTROL] = 0
    stale = Image(new.n, new.valid, new.buf[: 2 * USED] + tuple(slot2) + new.buf[3 * USED :])
    assert stale.same(new) and updatebuffer.writes(stale, new) == []
    # not known: every slot disabled first, every word written
    blind = updatebuffer.writes(None, new)
    assert [op[1] for op in blind[:4]] == [b * WORDS + W_CONTROL for b in range(4)]
    assert blind[4][0] == "VALID" and [op[1] for op in blind[5:]] == [
        0,
        10,
        W_CONTROL,
        WORDS,
        WORDS + 10,
        WORDS + W_CONTROL,
    ]


def test_config_update_buffer(tmp_path):
    assert Config().update_buffer == 16
    f = tmp_path / "c.toml"
    for good in (0, 1, 256):
        f.write_text(f"update_buffer = {good}\n")
        assert Config.load(f).update_buffer == good
        assert build_plan(make_policy([make_rule("DROP", proto="tcp")]), Config.load(f)).buffer_depth == good
    for bad in ("257", "-1", '"16"', "true", "1.5"):
        f.write_text(f"update_buffer = {bad}\n")
        with pytest.raises(HypafilterError, match="update_buffer must be a whole number of slots, 0..256"):
            Config.load(f)


def _program_fake(nic, plan) -> NicClient:
    """A client of the fake NIC made a core built for `plan`, as after reset."""
    nic.regs[regmap.REG_NUM_ENTRIES] = len(plan.entries)
    nic.regs[regmap.REG_MATCHER_HASH] = int(vhdl.matcher_hash(plan)[-8:], 16)
    nic.regs[regmap.REG_BUF_CONFIG] = updatebuffer.buffer_depth(plan) | 16 << 16 | updatebuffer.USED << 24
    nic.regs[regmap.REG_CONTROL] = 1
    for k, w in enumerate(updatebuffer.valid_words([True] * len(plan.entries))):
        nic.tables[(regmap.TABLE_VALID, k)] = w
    return NicClient(EmuTransport(nic.path))


def _control_writes(nic) -> list[int]:
    return [int(ln.split()[2], 0) for ln in nic.log if ln.startswith(f"W 0x{regmap.REG_CONTROL:x} ")]


def test_program_a_view_writes_rows_and_buffer_inside_shunt_everything(fake):  # noqa: F811
    rng = random.Random(3)
    while True:
        static, master, view = _plans(rng, depth=8)
        if view.slots and not view.valid.all():
            break
    assert vhdl.matcher_hash(view) == vhdl.matcher_hash(static)  # the View runs on the static plan's core
    with _program_fake(fake, static) as c:
        first = c.program(static, 1)
        assert _control_writes(fake) == []  # empty buffer before and after: no bracket of its own
        fake.log.clear()
        got = c.program(view, 2, known=first)
        assert _control_writes(fake) == [3, 1]  # shunt everything around the writes, then back
        ctl = [k for k, ln in enumerate(fake.log) if ln.startswith(f"W 0x{regmap.REG_CONTROL:x} ")]
        tw = [k for k, ln in enumerate(fake.log) if ln.startswith("T WS")]
        gen = [k for k, ln in enumerate(fake.log) if ln.startswith(f"W 0x{regmap.REG_GENERATION:x} ")]
        assert ctl[0] < min(tw) and max(tw) < gen[0] < ctl[1]
        assert c.read_overlay() == (view.valid.tolist(), box_key(view.overlay))
        rows = view.overlay.rows
        assert [fake.tables.get((regmap.TABLE_ACTION, i), 0) for i in range(rows)] == [
            int(a) | (8 if m else 0) for a, m in zip(view.actions, view.mirror, strict=True)
        ]
        shunt = [fake.tables[(regmap.TABLE_SHUNT, w)] >> j & 1 for w in range((rows + 31) // 32) for j in range(32)]
        assert shunt[:rows] == [int(b) for b in view.shunt]
        # the same view again: nothing to write, no bracket; back to the static plan: the buffer is emptied
        fake.log.clear()
        again = c.program(view, 3, known=got)
        assert again["writes"] == 1 and _control_writes(fake) == []
        c.program(static, 4, known=again)
        assert _control_writes(fake) == [3, 1]
        assert c.read_overlay() == ([True] * len(static.entries), [])


def test_write_overlay_and_read_overlay(fake):  # noqa: F811
    a = Box.full().with_field("proto", 6, 6).with_field("dport", 22, 22)
    b = Box(Box.full().lo, Box.full().hi, 0x12, 0x02).with_field("src", 0x0A000000, 0x0AFFFFFF)
    plan = vhdl.HwPlan([vhdl.HwEntry((Box.full(),))] * 40, [0] * 41, [1] * 41, "ab" * 32, buffer_depth=4)
    valid = np.ones(40, bool)
    valid[[0, 39]] = False
    ov = Overlay(40, 4, valid, (Slot(a, 0, 5), Slot(b, 40, 9)))
    with _program_fake(fake, plan) as c:
        fake.log.clear()
        out = c.write_overlay(ov)
        assert _control_writes(fake) == [3, 1]
        assert out["writes"] == 2 + 2 + 2 * (W_CONTROL + 1) and Image.from_dict(out["overlay"]) == updatebuffer.image(
            ov
        )
        assert fake.tables[(regmap.TABLE_BUF, 1 * WORDS + W_CONTROL)] == ENABLE | 40
        got_valid, slots = c.read_overlay()
        assert got_valid == valid.tolist() and slots == box_key(ov)
        assert c.read_image() == updatebuffer.image(ov)
        fake.log.clear()
        assert c.write_overlay(ov)["writes"] == 0 and _control_writes(fake) == []
        with pytest.raises(Exception, match="the core has 40 and 4"):
            c.write_overlay(Overlay.empty(40, 5))
        # a hole (slot 0 disabled by someone else) shows in the drift check
        fake.tables[(regmap.TABLE_BUF, W_CONTROL)] = 0
        assert c.read_overlay()[1] == [None, box_key(ov)[1]]
