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
    vals = dict(zip(FIELDS, h.values(), strict=True), flags=h.tcp_flags)
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
    assert (size, count) == (CONFIG.size, 1) and CONFIG.unpack_from(data, at + 8)[-2:] == want


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
    # conntrack fields (no lookup; no rule reads conntrack, so no hit entry).
    nb = (len(t.spans["src"]), len(t.spans["dst"]))
    assert data.endswith(struct.pack("<13I", 1, 3, t.n, t.words, *nb, 1, 0, 0, 0, 0, 0, 0))
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
