"""The XDP fast path's tables (hypafilter.targets.xdp.tables) without a kernel: the program's lookup done in numpy over
the tables — per-field interval, AND of the vectors, lowest set bit, box -> entry — must give hw's match_index
(analysis.decision, the one first-match definition) for every header; shapes and the tables file refuse misfits."""

from __future__ import annotations

import random
import struct

import numpy as np
import pytest
from hypafilter.analysis import decision
from hypafilter.analysis.plan import build_plan
from hypafilter.config import Config
from hypafilter.iptables.document import parse_policy
from hypafilter.ir import FIELDS, MAXV, Header
from hypafilter.targets.xdp.tables import CONFIG, CT_HIT_SET, SEARCH_FIELDS, build_tables, shape_id, tables_file
from hypafilter.tools.fuzz import random_policy

from conftest import ROOT

POLICY = """*filter
:FORWARD DROP [0:0]
-A FORWARD -s 10.0.0.0/8 ! -d 10.1.0.0/16 -p tcp -m tcp --dport 1000:2000 --tcp-flags SYN,ACK SYN -j ACCEPT
-A FORWARD -p udp -m multiport --dports 53,123,5000:5010 -j ACCEPT
-A FORWARD -p icmp -m icmp --icmp-type 8/0 -j ACCEPT
-A FORWARD ! -s 192.168.0.0/16 -p tcp ! --sport 1:1023 -j DROP
-A FORWARD -m string --string BAD --algo bm -j DROP
-A FORWARD -d 172.16.0.0/12 -j ACCEPT
COMMIT
"""


def lookup(t, h: Header) -> int:
    """What the program computes (driver/xdp/fastpath.bpf.c.j2, classify), in Python."""
    if not t.boxes:
        return t.n
    acc = np.full(max(t.words, 1), np.uint64(0xFFFFFFFFFFFFFFFF))
    vals = dict(zip(FIELDS, h.values(), strict=True), flags=h.tcp_flags, sets=h.sets)
    if vals["ct"] in (1, 2) and t.ct_hit[vals["ct"] - 1] & CT_HIT_SET:
        return t.ct_hit[vals["ct"] - 1] & ~CT_HIT_SET  # hfx_config.ct_hit: the hit's entry without a lookup
    if vals["ct"] and "ct" in t.fields and set(SEARCH_FIELDS) & set(t.fields):
        # A conntrack hit: the first box of the direct fields' AND decides when no address restricts it.
        for f in t.fields:
            if f not in SEARCH_FIELDS:
                acc &= t.vectors[t.direct[f][vals[f]]]
        for w, word in enumerate(acc[: t.words]):
            if word:
                box = w * 64 + (int(word) & -int(word)).bit_length() - 1
                if t.box_wild[box]:
                    return int(t.box_entry[box])
                break
        acc = np.full(max(t.words, 1), np.uint64(0xFFFFFFFFFFFFFFFF))
    for f in t.fields:
        if f in SEARCH_FIELDS:
            sp = t.spans[f]
            i = int(np.searchsorted(sp["start"], vals[f], side="right")) - 1
            vec = sp["vec"][i]
        else:
            vec = t.direct[f][vals[f]]
        acc &= t.vectors[vec]
    for w, word in enumerate(acc[: t.words]):
        if word:
            bit = (int(word) & -int(word)).bit_length() - 1
            return int(t.box_entry[w * 64 + bit])
    return t.n


def headers(plan, rng: random.Random, count: int) -> list[Header]:
    boxes = [b for e in plan.entries for b in e.boxes]
    out = []
    for _ in range(count):
        b = rng.choice(boxes) if boxes and rng.random() < 0.8 else None
        v = []
        for i, top in enumerate(MAXV):
            if b is None:
                v.append(rng.randint(0, top))
            else:
                lo, hi = b.lo[i], b.hi[i]
                v.append(rng.choice((lo, hi, max(0, lo - 1), min(top, hi + 1), rng.randint(lo, hi))))
        *fields, ct = v  # FIELDS ends with ct; Header's tcp_flags comes before it
        out.append(Header(*fields, tcp_flags=rng.randint(0, 255), ct=ct))
    return out


@pytest.mark.parametrize("seed", range(1, 9))
def test_lookup_is_first_match(seed):
    text = POLICY if seed == 1 else random_policy(seed)
    _check_lookup(text, seed)


@pytest.mark.parametrize("seed", range(1, 5))
def test_lookup_with_conntrack(seed):
    """Policies that read conntrack: their split rules restrict ct, which the tables treat as any other field."""
    text = (ROOT / "rulesets" / "conntrack.rules").read_text() if seed == 1 else random_policy(seed, conntrack=True)
    plan = build_plan(parse_policy(text, f"c{seed}"))
    assert "ct" in build_tables(plan).fields
    _check_lookup(text, seed)


def test_wild_boxes_and_their_bit():
    """The conntrack hit's shortcut: a box is wild exactly when no address restricts it, and hfx_box carries
    HFX_BOX_WILD for those (the file's record); a ct-first policy's conntrack box is one, and the lookup (with the
    shortcut, above) still gives the first match."""
    text = POLICY.replace(
        ":FORWARD DROP [0:0]\n", ":FORWARD DROP [0:0]\n-A FORWARD -m conntrack --ctstate ESTABLISHED -j ACCEPT\n"
    )
    _check_lookup(text, 11)
    t = build_tables(build_plan(parse_policy(text, "ct-first")))
    assert t.box_wild[0] and not t.box_wild.all() and t.box_entry[0] == 0
    data = tables_file(t, t.shape(), 1, 0)
    at = data.index(b"hfx_box") + len(b"hfx_box")
    size, count = struct.unpack_from("<II", data, at)
    box = np.frombuffer(data, "<u4", count, at + 8)
    assert size == 4 and count == t.boxes
    assert ((box & 0x7FFFFFFF) == t.box_entry).all() and ((box >> 31).astype(bool) == t.box_wild).all()


CT_RULES = {
    # first rule a hit can match -> the entry hfx_config.ct_hit names per direction (None: classify)
    "-m conntrack --ctstate ESTABLISHED,RELATED -j ACCEPT": (0, 0),
    "-m state --state ESTABLISHED -j ACCEPT": (0, 0),
    "-m conntrack --ctstate ESTABLISHED --ctdir ORIGINAL -j ACCEPT": (0, None),
    "-p tcp -m conntrack --ctstate ESTABLISHED -j ACCEPT": (None, None),
    "-s 10.0.0.0/8 -m conntrack --ctstate ESTABLISHED -j ACCEPT": (None, None),
    "-i eth0 -m conntrack --ctstate ESTABLISHED -j ACCEPT": (None, None),
}


@pytest.mark.parametrize("rule", sorted(CT_RULES))
def test_conntrack_hit_entry(rule):
    """hfx_config.ct_hit: set exactly when the first box a hit can lie in restricts nothing else; then it names that
    box's entry, in the tables file's hfx_cfg row too, and the lookup (which takes it, above) still gives the first
    match for every header, hits in both directions among them."""
    text = POLICY.replace(":FORWARD DROP [0:0]\n", f":FORWARD DROP [0:0]\n-A FORWARD {rule}\n")
    _check_lookup(text, 12)
    t = build_tables(build_plan(parse_policy(text, "ct-hit")))
    want = tuple(0 if e is None else CT_HIT_SET | e for e in CT_RULES[rule])
    assert t.ct_hit == want
    data = tables_file(t, t.shape(), 1, 0)
    at = data.index(b"hfx_cfg") + len(b"hfx_cfg")
    size, count = struct.unpack_from("<II", data, at)
    assert (size, count) == (CONFIG.size, 1) and CONFIG.unpack_from(data, at + 8)[11:13] == want


def _check_lookup(text: str, seed: int) -> None:
    policy = parse_policy(text, f"p{seed}")
    for mode in ("index", "exact"):
        plan = build_plan(policy, Config(shunt_mode=mode))
        t = build_tables(plan)
        rng = random.Random(seed)
        for h in headers(plan, rng, 400):
            assert lookup(t, h) == decision.match_index(plan, h), h


def test_shape_and_file():
    plan = build_plan(parse_policy(POLICY, "p"))
    t = build_tables(plan)
    shape = t.shape()
    assert set(t.fields) == {"src", "dst", "proto", "sport", "dport", "icmp_type", "icmp_code", "flags"}
    assert shape["words"] >= t.words and shape["ent_cap"] > t.n
    assert t.fits(shape) and len(shape_id(shape)) == 12
    data = tables_file(t, shape, control=1, generation=3)
    # The config record is the last one; its fields: control, generation, num_entries, num_words, nb, armed, the
    # conntrack fields (no lookup; no rule reads conntrack, so no hit entry), boxes, the update buffer (none here).
    nb = (len(t.spans["src"]), len(t.spans["dst"]))
    assert data.endswith(struct.pack("<17I", 1, 3, t.n, t.words, *nb, 1, 0, 0, 0, 0, 0, 0, t.boxes, 0, 0, 0))
    small = dict(shape, words=0)
    assert not t.fits(small)
    with pytest.raises(ValueError):
        tables_file(t, small, 1, 0)
    # Fewer fields than the program looks up: the missing ones get an all-ones vector, and the lookup still fits.
    fewer = build_tables(
        build_plan(parse_policy("*filter\n:FORWARD ACCEPT [0:0]\n-A FORWARD -s 10.0.0.0/8 -j DROP\nCOMMIT\n", "q"))
    )
    assert fewer.fields == ("src",) and fewer.fits(shape)
    assert tables_file(fewer, shape, 1, 0)


def test_control_has_the_nic_bits():
    """The fast path's CONTROL bits are the NIC register's (hw.model), miss forcing (Plan.miss_shunt) included."""
    from hypafilter.hw import model
    from hypafilter.targets.xdp.target import control_of

    for unf in ("drop", "pass"):
        for mode in ("bridge", "host"):
            for miss in ((False, False), (False, True), (True, True)):
                want = model.CONTROL_ENABLE | model.unfilterable_control(unf) | model.nic_mode_control(mode)
                assert control_of(unf, mode, miss) == want | model.miss_shunt_control(miss)
    plan = build_plan(parse_policy((ROOT / "rulesets" / "conntrack.rules").read_text(), "c"))
    assert model.Regs.from_plan(plan).control == control_of("drop", "bridge", plan.miss_shunt)


def test_mirror_bit_in_the_entries():
    """Plan.mirror (the analysis's; set by hand here) becomes HF_ACTION_MIRROR_BIT in each entry's action byte,
    the hardware's ACTION word encoding; the action code and shunt bit stay. A plan without it mirrors nothing; a
    mirror array of the wrong length is refused."""
    from hypafilter import shared
    from hypafilter.targets.xdp.tables import ENTRY

    plan = build_plan(parse_policy(POLICY, "p"))
    n = len(plan.entries)
    plain = build_tables(plan).entries
    assert not plan.mirror.any()  # no observing rule
    assert all(ENTRY.unpack_from(plain, j * ENTRY.size)[0] & shared.HF_ACTION_MIRROR_BIT == 0 for j in range(n + 1))
    mirror = np.zeros(n + 1, dtype=bool)
    mirror[::2] = True
    plan.mirror = mirror
    got = build_tables(plan).entries
    for j in range(n + 1):
        action, shunt, _, k = ENTRY.unpack_from(got, j * ENTRY.size)
        assert action == int(plan.actions[j]) | (shared.HF_ACTION_MIRROR_BIT if mirror[j] else 0)
        assert (shunt, k) == ENTRY.unpack_from(plain, j * ENTRY.size)[1:2] + (int(plan.interval[j]),)
    plan.mirror = mirror[:-1]
    with pytest.raises(ValueError):
        build_tables(plan)


def records(data: bytes) -> dict[str, np.ndarray | bytes]:
    """The tables file's records by name: {name: (value size, count, bytes)}."""
    out, at = {}, 0
    while at < len(data):
        (k,) = struct.unpack_from("<I", data, at)
        name = data[at + 4 : at + 4 + k].decode()
        size, count = struct.unpack_from("<II", data, at + 4 + k)
        at += 12 + k
        out[name] = (size, count, data[at : at + size * count])
        at += size * count
    return out


def lookup_buffered(t, data: bytes, h: Header) -> int:
    """The program's decision with the update buffer (driver/xdp/fastpath.bpf.c.j2, classify and buffer) over the
    tables file's records: the lookup over the boxes of valid entries (hfx_valid, projected onto hfx_box as the
    loader does), then the enabled slots in order up to the first placed after the static match."""
    from hypafilter.targets.xdp.tables import SLOT

    rec = records(data)
    cfg = CONFIG.unpack(rec["hfx_cfg"][2])
    n, depth, scan = cfg[2], cfg[14], cfg[15]
    words = np.frombuffer(rec["hfx_valid"][2], "<u8")
    valid = np.unpackbits(words.view(np.uint8), bitorder="little").astype(bool)
    keep = valid[t.box_entry] if t.boxes else np.zeros(0, bool)
    vals = dict(zip(FIELDS, h.values(), strict=True), flags=h.tcp_flags, sets=h.sets)
    i = n
    if t.boxes:
        acc = np.zeros(t.boxes, dtype=bool)
        acc[:] = keep
        for f in t.fields:
            if f in SEARCH_FIELDS:
                sp = t.spans[f]
                vec = sp["vec"][int(np.searchsorted(sp["start"], vals[f], side="right")) - 1]
            else:
                vec = t.direct[f][vals[f]]
            bits = np.unpackbits(t.vectors[vec].astype("<u8").view(np.uint8), bitorder="little")[: t.boxes]
            acc &= bits.astype(bool)
        hit = np.flatnonzero(acc)
        i = int(t.box_entry[hit[0]]) if len(hit) else n
    size, count, raw = rec.get("hfx_buf", (SLOT.size, 0, b""))
    assert (size, count) == (SLOT.size, depth)
    v = list(h.values())
    k = len(FIELDS)
    for b in range(min(scan, depth)):
        row = SLOT.unpack_from(raw, b * SLOT.size)
        lo, hi, (fm, fv, sm, sv, pos, on) = row[:k], row[k : 2 * k], row[2 * k :]
        if not on:
            continue
        if pos > i:
            break
        if all(a <= x <= z for a, x, z in zip(lo, v, hi, strict=True)) and h.tcp_flags & fm == fv and h.sets & sm == sv:
            return n + 1 + b
    return i


@pytest.mark.parametrize("seed", range(1, 7))
def test_update_buffer_in_the_tables_file(seed):
    """A static plan's tables with the overlay of a changed policy (analysis.overlay.align: rules deleted, inserted,
    a multiport rule of one slot per port): hfx_valid, hfx_buf (slots in order, enabled, their positions), the rows
    of every hardware index in hfx_ent (unused slots shunting) and hfx_cfg's buffer fields, decoded and run as the
    program runs them, give analysis.decision's hardware index for every header."""
    from hypafilter.analysis.overlay import align
    from hypafilter.targets.xdp.tables import ENTRY

    rng = random.Random(seed)
    text = POLICY if seed == 1 else random_policy(seed)
    lines = text.splitlines()
    body = [i for i, ln in enumerate(lines) if ln.startswith("-A FORWARD ")]
    changed = list(lines)
    del changed[body[len(body) // 2]]
    changed.insert(body[0], "-A FORWARD -p tcp -m multiport --dports 22,80,443 -j DROP")
    changed.insert(body[-1], lines[body[0]].replace("-j ACCEPT", "-j DROP"))
    for mode in ("index", "exact"):
        cfg = Config(shunt_mode=mode)
        static = build_plan(parse_policy(text, "s"), cfg)
        master = build_plan(parse_policy("\n".join(changed) + "\n", "m"), cfg)
        view = align(static.entries, master, 32)
        t = build_tables(view)
        assert t.depth == 32 and len(t.entries) == ENTRY.size * (t.n + 33)
        shape = t.shape(48)  # a program with more slots than the view: the rest unused
        data = tables_file(t, shape, 1, 0)
        rec = records(data)
        assert rec["hfx_ent"][1] == t.n + 1 + 48 and rec["hfx_buf"][1] == 48
        for j in range(t.n + 1 + view.overlay.depth, t.n + 49):
            assert ENTRY.unpack_from(rec["hfx_ent"][2], j * ENTRY.size)[:2] == (
                0,
                3,
            )  # shunt for every ct, never decides
        assert CONFIG.unpack(rec["hfx_cfg"][2])[13:16] == (t.boxes, 48, view.overlay.used)
        for h in headers(master, rng, 300) + headers(static, rng, 100):
            assert lookup_buffered(t, data, h) == decision.match_index(view, h), (mode, h)
        # the same static tables without the overlay: the static plan's first match
        plain = tables_file(build_tables(static), shape, 1, 0)
        for h in headers(static, rng, 100):
            assert lookup_buffered(build_tables(static), plain, h) == decision.match_index(static, h)


def test_overlay_records_refuse_misfits():
    """overlay_records (what write_overlay hands the loader): more slots than the program has, or more static
    entries than its rows, are refused; a fitting one carries every valid word and slot row."""
    from hypafilter.analysis.overlay import Overlay, Slot
    from hypafilter.ir import Box
    from hypafilter.targets.xdp.tables import SLOT, overlay_records, read_slot

    plan = build_plan(parse_policy(POLICY, "p"))
    shape = build_tables(plan).shape(4)
    box = Box.full().with_field("dport", 22, 22)
    ov = Overlay(plan.n, 4, [True, False] + [True] * (plan.n - 2), (Slot(box, 1, 0), Slot(box, 3, 2)))
    rec = records(overlay_records(ov, shape))
    assert set(rec) == {"n_static", "hfx_valid", "hfx_buf"} and rec["hfx_valid"][1] == shape["ent_cap"] // 64
    assert struct.unpack("<I", rec["n_static"][2]) == (plan.n,)
    assert np.frombuffer(rec["hfx_valid"][2], "<u8")[0] == (1 << plan.n) - 1 - 2
    rows = [read_slot(rec["hfx_buf"][2][b * SLOT.size : (b + 1) * SLOT.size]) for b in range(4)]
    assert [(s.box, s.pos, on) for s, on in rows[:2]] == [(box, 1, True), (box, 3, True)]
    assert [on for _, on in rows[2:]] == [False, False]
    with pytest.raises(ValueError):
        overlay_records(Overlay(plan.n, 8, np.ones(plan.n, bool), (Slot(box, 0, 0),) * 5), shape)
    with pytest.raises(ValueError):
        overlay_records(Overlay(shape["ent_cap"], 4, np.ones(shape["ent_cap"], bool)), shape)


@pytest.mark.parametrize("at", ["spread", "top"])
def test_bench_buffer_view_decides_as_the_plan(at):
    """`bench xdp-cost --buffer-slots K`: K of the plan's entries left out of the static matcher and put into the
    buffer (spread over the list, or the first K: every slot at position 0, scanned by every frame) decide every
    header as the plan does (the View's hardware index stands for the plan's entry)."""
    from hypafilter.tools.bench.xdpcost import buffer_view

    plan = build_plan(parse_policy(random_policy(5), "p5"))
    view = buffer_view(plan, 4, 16, at)
    assert view.n == plan.n - 4 and view.overlay.used >= 4 and view.overlay.valid.all()
    if at == "top":
        assert {s.pos for s in view.overlay.slots} == {0}
    for h in headers(plan, random.Random(at), 300):
        assert view.master[decision.match_index(view, h)] == decision.match_index(plan, h), h
