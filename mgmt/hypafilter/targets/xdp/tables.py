"""The XDP fast path's tables for a Plan: per-field elementary intervals, box bit vectors, entries (docs/xdp.md).

Every entry's boxes get one bit each, in entry order (so the lowest set bit of a box set is the first entry in
priority order). For each field some box restricts, the field's value range splits into elementary intervals (the
ranges between consecutive box boundaries); every value of one interval lies in exactly the same boxes, so one bit
vector per interval says which. The program looks the header's interval up in every used field, ANDs the vectors
and takes the lowest set bit: the first matching box; `box_entry` turns it into match_index. TCP flags are a
ternary test, not an interval: their table has one vector per flags byte (256). Identical vectors are stored once.

The shape (used fields, vector words, table capacities, update-buffer slots) fixes the compiled program; everything
else is map content, so a rule change that keeps the shape is a map update.

The SFL update buffer (analysis.overlay): a plan given as an `analysis.overlay.View` has rows for every hardware
index (n static entries, the policy entry, the slots), a valid mask over its static entries and the slots' boxes;
`hfx_valid`, `hfx_buf` and the rows of `hfx_ent` hold them. A plain Plan is a pristine matcher: every entry valid,
no slot enabled, the slots' rows shunting.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass, field

import numpy as np

from hypafilter.analysis.overlay import Overlay, Slot
from hypafilter.analysis.plan import action_words
from hypafilter.ir import FIELDS, MAXV, Box
from hypafilter.ir.sets import MAX_SET_SLOTS

# Field order of the program's lookups; src/dst by binary search over sorted interval starts, the rest direct.
FAST_FIELDS = ("src", "dst", "proto", "sport", "dport", "icmp_type", "icmp_code", "iport", "ct", "flags", "sets")
SEARCH_FIELDS = ("src", "dst")
DIRECT_SIZE = {"proto": 256, "sport": 65536, "dport": 65536, "icmp_type": 256, "icmp_code": 256, "iport": 4, "ct": 4}
DIRECT_SIZE["flags"] = 256
DIRECT_SIZE["sets"] = 1 << MAX_SET_SLOTS  # the frame's set-slot bits (docs/sets.md), a ternary like the flags
CHUNK = 1024  # boxes per sweep step (memory: intervals x CHUNK bytes)

# hfx_config (driver/xdp/hf_fastpath.h): control, generation, num_entries, num_words, nb_src, nb_dst, armed,
# ct_tcp_ms, ct_udp_ms, ct_flags, ct_udp_unreplied_ms, ct_hit[2], num_boxes, buf_depth, buf_scan, ct_tcp_cw_ms
CONFIG = struct.Struct("<17I")
CT_HIT_SET = 0x80000000  # hfx_config.ct_hit[] bit HFX_CT_HIT_SET
CT_LOOKUP, CT_NONE_FLAG = 1, 2  # hfx_config.ct_flags (HFX_CT_LOOKUP, HFX_CT_NONE)
SHUNT, SHUNT_NONE = 1, 2  # hfx_entry.shunt bits (HFX_SHUNT, HFX_SHUNT_NONE): ct 0..2, ct 3
BOX_WILD = 0x80000000  # hfx_box value bit HFX_BOX_WILD: no address restricts the box
ENTRY = struct.Struct("<BBHI")  # struct hfx_entry: action (| HF_ACTION_MIRROR_BIT), shunt bits, pad, k
UNUSED_ROW = ENTRY.pack(0, SHUNT | SHUNT_NONE, 0, 0)  # the row of a slot no overlay uses: shunt, k 0 (never decides)
# struct hfx_slot: lo[9], hi[9] (ir FIELDS order), flags mask, flags value, sets mask, sets value, pos, enable
SLOT = struct.Struct(f"<{len(FIELDS)}I{len(FIELDS)}IBBBBII")
SPAN = np.dtype([("start", "<u4"), ("vec", "<u4")])


def pow2(x: int, least: int) -> int:
    v = least
    while v < x:
        v *= 2
    return v


@dataclass
class Tables:
    """The map contents for one plan (see the module docstring)."""

    n: int  # entries; match_index n = the policy entry
    boxes: int
    fields: tuple[str, ...]  # fields some box restricts, in FAST_FIELDS order
    words: int  # 64-bit words in use per vector
    vectors: np.ndarray  # uint64 [nvec, words]
    direct: dict[str, np.ndarray] = field(default_factory=dict)  # field -> uint32 vector id per value
    spans: dict[str, np.ndarray] = field(default_factory=dict)  # field -> SPAN records (start, vector id)
    box_entry: np.ndarray = field(default_factory=lambda: np.zeros(0, np.uint32))
    box_wild: np.ndarray = field(default_factory=lambda: np.zeros(0, bool))  # per box: src and dst unrestricted
    ct_hit: tuple[int, int] = (0, 0)  # hfx_config.ct_hit: CT_HIT_SET | entry per direction (ct 1, 2), or 0
    entries: bytes = b""  # one packed struct hfx_entry per hardware index the plan has rows for
    overlay: Overlay | None = None  # the update buffer's contents (a View's); None: pristine, no slot
    # the set slots' maps (docs/sets.md), in slot order: {"type", "dirs", "mask" (hash:ip's netmask), "cap"}
    sets: list = field(default_factory=list)
    family: int = 4  # 6: an IPv6 table set (build_tables6): spans of SPAN6 (128-bit starts)
    index_base: int = 0  # IPv6: M's match_index of local entry 0
    soft: int = 0  # IPv6: hfx6_config.soft (SOFT_VERBATIM)

    @property
    def depth(self) -> int:
        """The update-buffer slots the plan has rows for (a View's depth; 0 for a plain Plan)."""
        return self.overlay.depth if self.overlay is not None else 0

    def shape(self, depth: int | None = None) -> dict:
        """What the compiled program depends on (capacities with headroom, so that growth stays a map update);
        `depth`: its update-buffer slots (default: the plan's)."""
        nb = max((len(s) for s in self.spans.values()), default=1)
        buf = self.depth if depth is None else depth
        return {
            "fields": list(self.fields),
            "words": pow2(self.words, 1),
            "vec_cap": pow2(len(self.vectors) + len(self.vectors) // 4, 64),
            "nb_cap": pow2(nb + nb // 4, 64),
            "ent_cap": pow2(self.n + 1 + buf + (self.n + 1) // 4, 64),
            "buf": buf,
            **({"sets": self.sets} if self.sets else {}),
        }

    def fits(self, shape: dict) -> bool:
        """Whether these tables load into a program of `shape` (a running one: update instead of rebuild)."""
        nb = max((len(s) for s in self.spans.values()), default=1)
        buf = shape.get("buf", 0)
        return (
            set(self.fields) <= set(shape["fields"])
            and self.words <= shape["words"]
            and len(self.vectors) + (1 if set(self.fields) != set(shape["fields"]) else 0) <= shape["vec_cap"]
            and nb <= shape["nb_cap"]
            and self.depth <= buf
            and self.n + 1 + buf <= shape["ent_cap"]
            and self.sets == shape.get("sets", [])
        )


def shape_id(shape: dict) -> str:
    text = repr(sorted(shape.items()))
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def _pack_rows(bits: np.ndarray) -> np.ndarray:
    """bool [rows, CHUNK-or-less] -> uint64 [rows, ceil(cols/64)] (bit b of word w = column 64w + b)."""
    rows, cols = bits.shape
    pad = (-cols) % 64
    if pad:
        bits = np.concatenate([bits, np.zeros((rows, pad), dtype=bool)], axis=1)
    packed = np.packbits(bits, axis=1, bitorder="little")  # [rows, cols/8] uint8
    return np.ascontiguousarray(packed).view("<u8")


def _interval_vectors(lo: np.ndarray, hi: np.ndarray, top: int) -> tuple[np.ndarray, np.ndarray]:
    """(starts, vectors[nint, words]) of the elementary intervals of [0, top] cut by the closed ranges lo..hi."""
    bounds = np.unique(np.concatenate([[0], lo, hi[hi < top] + 1]).astype(np.int64))
    nint = len(bounds)
    s = np.searchsorted(bounds, lo)
    e = np.searchsorted(bounds, hi + 1)  # exclusive; nint when hi == top
    nbox = len(lo)
    words = max(1, (nbox + 63) // 64)
    out = np.zeros((nint, words), dtype=np.uint64)
    for c0 in range(0, nbox, CHUNK):
        c1 = min(nbox, c0 + CHUNK)
        diff = np.zeros((nint + 1, c1 - c0), dtype=np.int8)
        cols = np.arange(c1 - c0)
        diff[s[c0:c1], cols] = 1  # one start and one end per column, s < e: plain assignment suffices
        diff[e[c0:c1], cols] = -1
        inside = np.cumsum(diff, axis=0, dtype=np.int8)[:nint] > 0
        out[:, c0 // 64 : c0 // 64 + (c1 - c0 + 63) // 64] = _pack_rows(inside)
    return bounds, out


def build_tables(plan) -> Tables:
    """The map contents for `plan` (anything with entries, shunt, actions, interval of length n + 1; or an
    analysis.overlay.View: its static entries, and rows and overlay for every hardware index)."""
    n = len(plan.entries)
    owner, los, his, fm, fv, sm, sv = [], [], [], [], [], [], []
    for j, e in enumerate(plan.entries):
        for b in e.boxes:
            if b.is_empty():
                continue
            owner.append(j)
            los.append(b.lo)
            his.append(b.hi)
            fm.append(b.flags_mask)
            fv.append(b.flags_value)
            sm.append(b.sets_mask)
            sv.append(b.sets_value)
    nbox = len(owner)
    smask = np.array(sm, dtype=np.int64)
    sval = np.array(sv, dtype=np.int64)
    lo = np.array(los, dtype=np.int64).reshape(nbox, len(FIELDS))
    hi = np.array(his, dtype=np.int64).reshape(nbox, len(FIELDS))
    fmask = np.array(fm, dtype=np.int64)
    fval = np.array(fv, dtype=np.int64)
    words = (nbox + 63) // 64
    per_field: dict[str, tuple[np.ndarray, np.ndarray]] = {}  # field -> (starts, vectors)
    for i, name in enumerate(FIELDS):
        if nbox and ((lo[:, i] > 0) | (hi[:, i] < MAXV[i])).any():
            per_field[name] = _interval_vectors(lo[:, i], hi[:, i], MAXV[i])
    if nbox and fmask.any():
        f = np.arange(256, dtype=np.int64)[:, None]
        per_field["flags"] = (np.arange(256), _pack_rows((f & fmask[None, :]) == fval[None, :]))
    if nbox and smask.any():
        v = np.arange(DIRECT_SIZE["sets"], dtype=np.int64)[:, None]
        per_field["sets"] = (np.arange(DIRECT_SIZE["sets"]), _pack_rows((v & smask[None, :]) == sval[None, :]))
    used = tuple(f for f in FAST_FIELDS if f in per_field)
    allvec = np.concatenate([per_field[f][1] for f in used]) if used else np.zeros((0, max(words, 1)), np.uint64)
    uniq, inverse = np.unique(allvec, axis=0, return_inverse=True) if len(allvec) else (allvec, np.zeros(0, int))
    inverse = np.asarray(inverse).reshape(-1)
    t = Tables(n=n, boxes=nbox, fields=used, words=words, vectors=np.ascontiguousarray(uniq, dtype=np.uint64))
    at = 0
    for f in used:
        starts, vecs = per_field[f]
        ids = inverse[at : at + len(vecs)].astype(np.uint32)
        at += len(vecs)
        if f in SEARCH_FIELDS:
            keep = np.ones(len(ids), dtype=bool)  # merge neighbours with the same vector
            keep[1:] = ids[1:] != ids[:-1]
            sp = np.zeros(int(keep.sum()), dtype=SPAN)
            sp["start"] = starts[keep]
            sp["vec"] = ids[keep]
            t.spans[f] = sp
        elif f in ("flags", "sets"):
            t.direct[f] = ids
        else:
            values = np.arange(DIRECT_SIZE[f], dtype=np.int64)
            t.direct[f] = ids[np.searchsorted(starts, values, side="right") - 1]
    t.box_entry = np.array(owner, dtype=np.uint32)
    wild = np.ones(nbox, dtype=bool)
    for f in SEARCH_FIELDS:
        i = FIELDS.index(f)
        wild &= (lo[:, i] == 0) & (hi[:, i] == MAXV[i])
    t.box_wild = wild
    t.ct_hit = tuple(_ct_hit(lo, hi, fmask | smask, t.box_entry, c) for c in (1, 2))
    t.sets = set_maps(plan)
    t.overlay = getattr(plan, "overlay", None)
    t.entries = entry_rows(plan)
    return t


def entry_rows(plan) -> bytes:
    """hfx_ent's rows of `plan`, one per hardware index: n + 1 for a Plan, n + 1 + depth for a View."""
    n = len(plan.entries)
    ov = getattr(plan, "overlay", None)
    rows = n + 1 + (ov.depth if ov is not None else 0)
    words = action_words(plan)  # the action code | MIRROR_BIT where Plan.mirror is set (the NIC's ACTION word)
    if len(words) != rows or len(plan.shunt) != rows or len(plan.interval) != rows:
        raise ValueError(f"a plan of {n} entries needs {rows} rows (buffer slots included), not {len(words)}")
    none = getattr(plan, "shunt_none", None)  # a Plan's or a View's (the master's per row); None: `shunt`
    if none is None or len(none) != rows:
        none = plan.shunt
    bits = [(SHUNT if plan.shunt[j] else 0) | (SHUNT_NONE if none[j] else 0) for j in range(rows)]
    return b"".join(ENTRY.pack(words[j], bits[j], 0, int(plan.interval[j])) for j in range(rows))


def set_maps(plan) -> list[dict]:
    """The set slots' maps of `plan` (its policy's Policy.set_slots and sets): type, directions, hash:ip's netmask
    as a mask, and capacity (the set's maxelem, so the kernel's set always fits)."""
    policy = getattr(plan, "policy", None)
    slots = getattr(policy, "set_slots", ()) if policy is not None else ()
    out = []
    for s in slots:
        info = policy.sets.get(s.name)
        maxelem = info.maxelem if info is not None else 65536
        netmask = min(info.netmask, 32) if info is not None else 32  # (an inet6 set's 128: set_maps6 drops it)
        out.append(
            {
                "name": s.name,
                "type": s.settype,
                "dirs": list(s.dirs),
                "mask": (0xFFFFFFFF << (32 - netmask)) & 0xFFFFFFFF,
                "cap": pow2(maxelem, 64),
            }
        )
    return out


def set_maps6(plan) -> list[dict]:
    """The IPv6 plan's set slots' maps (docs/sets.md "IPv6 sets"): as set_maps, named hfx6_set<i> (the IPv6 program's
    own maps, 128-bit keys), family 6. An inet6 hash:ip keys the whole address (a netmask keeps its rule complex)."""
    out = []
    for i, m in enumerate(set_maps(plan)):
        m = {**m, "map": f"hfx6_set{i}", "family": 6}
        m.pop("mask")
        out.append(m)
    return out


def _ct_hit(lo: np.ndarray, hi: np.ndarray, fmask: np.ndarray, owner: np.ndarray, c: int) -> int:
    """CT_HIT_SET | entry when the first box (priority order) whose ct range holds `c` restricts no other field, so
    every frame with ct `c` matches it and no earlier box: a conntrack hit's answer without a lookup. Else 0."""
    k = FIELDS.index("ct")
    holds = np.flatnonzero((lo[:, k] <= c) & (hi[:, k] >= c))
    if not len(holds):
        return 0
    b = int(holds[0])
    others = [i for i in range(len(FIELDS)) if i != k]
    if fmask[b] or (lo[b, others] != 0).any() or (hi[b, others] != np.array(MAXV)[others]).any():
        return 0
    return CT_HIT_SET | int(owner[b])


def valid_words(valid, words: int) -> np.ndarray:
    """hfx_valid's contents: bit j of word j // 64 = static entry j valid."""
    bits = np.zeros(words * 64, dtype=bool)
    bits[: len(valid)] = np.asarray(valid, dtype=bool)
    return _pack_rows(bits[None, :])[0] if words else np.zeros(0, np.uint64)


def slot_rows(ov: Overlay | None, depth: int) -> bytes:
    """hfx_buf's contents: the overlay's slots, enabled, then disabled empty rows up to `depth`."""
    slots = ov.slots if ov is not None else ()
    if len(slots) > depth:
        raise ValueError(f"{len(slots)} buffer slots for a program of {depth}")
    out = [
        SLOT.pack(
            *s.box.lo, *s.box.hi, s.box.flags_mask, s.box.flags_value, s.box.sets_mask, s.box.sets_value, s.pos, 1
        )
        for s in slots
    ]
    out += [SLOT.pack(*([0] * (2 * len(FIELDS))), 0, 0, 0, 0, 0, 0)] * (depth - len(slots))
    return b"".join(out)


def read_slot(data: bytes) -> tuple[Slot, bool]:
    """One hfx_buf row back: (Slot (master unknown: -1), enabled)."""
    v = SLOT.unpack(data)
    k = len(FIELDS)
    box = Box(tuple(v[:k]), tuple(v[k : 2 * k]), v[2 * k], v[2 * k + 1], v[2 * k + 2], v[2 * k + 3])
    return Slot(box, v[2 * k + 4], -1), bool(v[2 * k + 5])


def overlay_records(ov: Overlay, shape: dict, entries: bytes | None = None) -> bytes:
    """What `hf_xdp overlay` writes into a running program of `shape`: the static entries it is for (`n_static`, which
    the loader checks against the program's), hfx_valid, hfx_buf and, given, the rows of every hardware index
    (`entries`, a View's: Tables.entries)."""
    buf = shape.get("buf", 0)
    words = shape["ent_cap"] // 64
    if len(ov.slots) > buf:
        raise ValueError(f"{len(ov.slots)} buffer slots for a program of {buf}")
    if ov.n_static + 1 + buf > shape["ent_cap"]:
        raise ValueError(f"{ov.n_static} static entries and {buf} slots do not fit {shape['ent_cap']} rows")
    out = [_record("n_static", 4, 1, struct.pack("<I", ov.n_static))]  # checked against hfx_config.num_entries
    out.append(_record("hfx_valid", 8, words, valid_words(ov.valid, words).astype("<u8").tobytes()))
    if buf:
        out.append(_record("hfx_buf", SLOT.size, buf, slot_rows(ov, buf)))
    if entries is not None:
        out.append(_entry_record(entries, ov.n_static, buf))
    return b"".join(out)


def _entry_record(entries: bytes, n: int, buf: int) -> bytes:
    """hfx_ent: the rows given, then unused slots' rows up to n + 1 + buf."""
    have = len(entries) // ENTRY.size
    if have > n + 1 + buf:
        raise ValueError(f"{have} rows for {n} entries and {buf} buffer slots")
    return _record("hfx_ent", ENTRY.size, n + 1 + buf, entries + UNUSED_ROW * (n + 1 + buf - have))


def _record(name: str, value_size: int, count: int, data: bytes) -> bytes:
    assert len(data) == value_size * count, name
    nm = name.encode()
    return struct.pack("<I", len(nm)) + nm + struct.pack("<II", value_size, count) + data


@dataclass(frozen=True)
class CtConfig:
    """Conntrack state from the kernel's table (docs/xdp.md): the established timeouts conntrack itself would set
    (the namespace's sysctls, ms). The default: no lookup (ct always 0). Whether conntrack tracks TCP windows is not
    part of it: the program decides established TCP only on entries marked liberal (docs/xdp.md)."""

    lookup: bool = False
    tcp_ms: int = 0
    udp_ms: int = 0  # stream (replied) timeout
    udp_unreplied_ms: int = 0
    # a lookup without an entry is ct 3, NEW or INVALID (docs/xdp.md "New flows"; targets.xdp.newflows says when)
    none: bool = False
    # TCP CLOSE_WAIT timeout: what a frame decided on a half-closed entry (FIN_WAIT, CLOSE_WAIT) refreshes it to;
    # 0: such entries are not decided (their frames go to conntrack)
    tcp_cw_ms: int = 0

    def flags(self) -> int:
        return (CT_LOOKUP if self.lookup else 0) | (CT_NONE_FLAG if self.lookup and self.none else 0)


def _lookup_records(t, shape: dict, prefix: str, span_dtype) -> list[bytes]:
    """The records of one family's lookup maps: the vectors (PREFIX_vec), each field's spans or direct table
    (PREFIX_f_F) and the boxes' owners (PREFIX_box); span_dtype: SPAN (IPv4) or SPAN6 (128-bit starts)."""
    W = shape["words"]
    vec = np.zeros((len(t.vectors), W), dtype=np.uint64)
    vec[:, : t.words] = t.vectors[:, : t.words] if t.words else vec[:, :0]
    ones = None
    if set(t.fields) != set(shape["fields"]):
        ones = len(vec)  # fields the program looks up but no box restricts any more: an all-ones vector
        row = np.zeros((1, W), dtype=np.uint64)
        full, rest = divmod(t.boxes, 64)
        row[0, :full] = np.uint64(0xFFFFFFFFFFFFFFFF)
        if rest:
            row[0, full] = np.uint64((1 << rest) - 1)
        vec = np.concatenate([vec, row])
    out = [_record(f"{prefix}_vec", 8 * W, len(vec), vec.astype("<u8").tobytes())]
    for f in shape["fields"]:
        if f in SEARCH_FIELDS:
            sp = t.spans.get(f)
            if sp is None:
                sp = np.zeros(1, dtype=span_dtype)
                sp["vec"] = ones
            out.append(_record(f"{prefix}_f_{f}", span_dtype.itemsize, len(sp), sp.tobytes()))
        else:
            ids = t.direct.get(f)
            if ids is None:
                ids = np.full(DIRECT_SIZE[f], ones, dtype=np.uint32)
            out.append(_record(f"{prefix}_f_{f}", 4, len(ids), ids.astype("<u4").tobytes()))
    if t.boxes:
        box = t.box_entry.astype(np.uint32) | np.where(t.box_wild, np.uint32(BOX_WILD), np.uint32(0))
        out.append(_record(f"{prefix}_box", 4, t.boxes, box.astype("<u4").tobytes()))
    return out


def tables_file(
    t: Tables,
    shape: dict,
    control: int,
    generation: int,
    ct: CtConfig | None = None,
    hold: bool = False,
    t6: Tables | None = None,
    control6: int | None = None,
    ct6: CtConfig | None = None,
    view6=None,
) -> bytes:
    """The loader's tables file (driver/xdp/hf_xdp.c) for a program of `shape`; hfx_cfg is written last by it.
    `t6`: the IPv6 table set (build_tables6) for a program whose shape has "v6", with its plan's miss forcing
    (`control6`'s bits 4/5; default `control`'s) and conntrack lookup (`ct6`; default `ct`)."""
    ct = ct or CtConfig()
    if (t6 is not None) != bool(shape.get("v6")):
        raise ValueError("IPv6 tables need a program with an IPv6 table set, and such a program needs them")
    if not t.fits(shape):
        raise ValueError("tables do not fit the program's shape")
    out = _lookup_records(t, shape, "hfx", SPAN)
    buf = shape.get("buf", 0)
    out.append(_entry_record(t.entries, t.n, buf))
    words = shape["ent_cap"] // 64
    valid = t.overlay.valid if t.overlay is not None else np.ones(t.n, dtype=bool)
    out.append(_record("hfx_valid", 8, words, valid_words(valid, words).astype("<u8").tobytes()))
    if buf:
        out.append(_record("hfx_buf", SLOT.size, buf, slot_rows(t.overlay, buf)))
    if t6 is not None:
        out.append(tables6_records(t6, shape["v6"], control if control6 is None else control6, ct6 or ct, view=view6))
    nb = {f: len(t.spans[f]) if f in t.spans else 1 for f in SEARCH_FIELDS}
    cfg = CONFIG.pack(
        0 if hold else control,  # hold: still shunting everything after the write; `armed` below is what ends it
        generation & 0xFFFF,
        t.n,
        t.words,
        nb["src"],
        nb["dst"],
        control,
        ct.tcp_ms,
        ct.udp_ms,
        ct.flags(),
        ct.udp_unreplied_ms,
        *t.ct_hit,
        t.boxes,
        buf,
        len(t.overlay.slots) if t.overlay is not None else 0,
        ct.tcp_cw_ms,
    )
    out.append(_record("hfx_cfg", CONFIG.size, 1, cfg))
    return b"".join(out)


# ---- IPv6: a family-6 plan's table set (docs/ipv6.md "## xdp") ---------------------------------------------------

# struct hfx6_config: num_entries, index_base, num_words, nb_src, nb_dst, ct_hit[2], num_boxes, miss, ct_flags,
# ct_tcp_ms, ct_udp_ms, ct_udp_unreplied_ms, soft, ct_tcp_cw_ms, buf_scan
CONFIG6 = struct.Struct("<16I")
# struct hfx6_slot: src lo/hi, dst lo/hi (four words each, most significant first), lo[9], hi[9] (src, dst unused),
# flags mask, flags value, sets mask, sets value, pos, enable
SLOT6 = struct.Struct(f"<16I{len(FIELDS)}I{len(FIELDS)}IBBBBII")
SOFT_VERBATIM = 1  # hfx6_config.soft HFX6_SOFT_VERBATIM
MISS_BITS = 16 | 32  # HFX_CONTROL_MISS_SHUNT_ACCEPT | _DROP
# struct hfx_span6: the interval's first address as four 32-bit words, most significant first; its vector id
SPAN6 = np.dtype([("start", "<u4", (4,)), ("vec", "<u4")])
ADDR6_TOP = (1 << 128) - 1


def words128(values) -> np.ndarray:
    """uint32 [len, 4]: each 128-bit int as four words, most significant first (struct hfx_span6.start)."""
    out = np.zeros((len(values), 4), dtype=np.uint32)
    for i, v in enumerate(values):
        v = int(v)
        if not 0 <= v <= ADDR6_TOP:
            raise ValueError(f"address {v:#x} is not a 128-bit value")
        out[i] = [(v >> s) & 0xFFFFFFFF for s in (96, 64, 32, 0)]
    return out


def build_tables6(
    plan, index_base: int | None = None, k_base: int | None = None, verbatim: bool | None = None
) -> Tables:
    """The IPv6 table set for a family-6 plan (`plan.family == 6`, `plan.addr_map`: the 128-bit starts of every
    elementary interval per address dimension, `starts[dim][0] == 0`; the plan's boxes hold ranks into them, as
    `ir.family.compress` gives them). The plan's tables are built as any plan's, over the ranks; each address span's
    rank then becomes its interval's 128-bit start. A rank range that reaches the last rank reaches the top address.
    `index_base`: M's match_index of local entry 0 (after the IPv4 side's rows; default the plan's `index_base`, else 0);
    `k_base`: added to every non-zero interval k (default the plan's `k_base`, else 0: the plan's k as they are).
    `verbatim` (default the plan's `verbatim`, else False): ip6tables holds the policy verbatim, without interval
    chains: every k is 0 and software gets every passed IPv6 frame with value 0 (hfx6_config.soft)."""
    if getattr(plan, "family", 4) != 6:
        raise ValueError("build_tables6 takes a family-6 plan (plan.family == 6)")
    amap = getattr(plan, "addr_map", None)
    if amap is None:
        raise ValueError("a family-6 plan without addr_map (the 128-bit interval starts of its ranks)")
    if getattr(plan, "overlay", None) is not None:
        raise ValueError(
            "build_tables6 takes the static family-6 plan: the IPv6 update buffer is written from it and the View by "
            "tables6_records(view=...)"
        )
    starts = {}
    for dim in SEARCH_FIELDS:
        s = [int(x) for x in amap.starts[dim]]
        if not s or s[0] != 0 or any(b <= a for a, b in zip(s, s[1:], strict=False)) or s[-1] > ADDR6_TOP:
            raise ValueError(f"addr_map.starts[{dim!r}] must rise strictly from 0 within 128 bits")
        starts[dim] = s
    idx = {d: FIELDS.index(d) for d in SEARCH_FIELDS}
    top = {d: len(starts[d]) - 1 for d in SEARCH_FIELDS}
    entries = []
    for e in plan.entries:
        boxes = []
        for b in e.boxes:
            lo, hi = list(b.lo), list(b.hi)
            for d, i in idx.items():
                if hi[i] >= top[d] and lo[i] <= top[d]:
                    hi[i] = MAXV[i]  # up to the top address: the rank space's last interval and beyond
                elif lo[i] > top[d]:
                    lo[i] = hi[i] = MAXV[i]  # no address has this rank (an empty box in address space)
            boxes.append(Box(tuple(lo), tuple(hi), b.flags_mask, b.flags_value, b.sets_mask, b.sets_value))
        entries.append(type(e)(e.rule_index, tuple(boxes), e.action, e.is_complex))
    kb = int(getattr(plan, "k_base", 0) if k_base is None else k_base)
    verbatim = bool(getattr(plan, "verbatim", False) if verbatim is None else verbatim)
    interval = np.array([int(k) + kb if int(k) and not verbatim else 0 for k in plan.interval], dtype=np.int64)
    view = _Plan6(entries, plan.shunt, getattr(plan, "shunt_none", None), plan.actions, interval, plan.mirror)
    t = build_tables(view)
    t.sets = set_maps6(plan)
    for d in SEARCH_FIELDS:
        sp = t.spans.get(d)
        if sp is None:
            continue
        sp = sp[sp["start"] <= top[d]]  # spans of ranks no address has (only the widened boxes' beyond the top)
        out = np.zeros(len(sp), dtype=SPAN6)
        out["start"] = words128([starts[d][int(r)] for r in sp["start"]])
        out["vec"] = sp["vec"]
        t.spans[d] = out
    t.family = 6
    t.index_base = int(getattr(plan, "index_base", 0) if index_base is None else index_base)
    t.soft = SOFT_VERBATIM if verbatim else 0
    return t


class _Plan6:
    """What build_tables reads of a plan, for the rank-space view of a family-6 plan."""

    overlay = None
    policy = None

    def __init__(self, entries, shunt, shunt_none, actions, interval, mirror):
        self.entries, self.shunt, self.shunt_none = entries, shunt, shunt_none
        self.actions, self.interval, self.mirror = actions, interval, mirror


def shape6(t6: Tables, depth: int = 0) -> dict:
    """The IPv6 part of a program's shape (`shape["v6"]`): fields, vector words, capacities, and `depth` update-buffer
    slots ("buf": hfx6_buf, hfx6_vbox; local indices n6 + 1 .. n6 + depth; absent when 0, the shape and program
    of before the IPv6 buffer)."""
    s = t6.shape(depth)
    out = {k: s[k] for k in ("fields", "words", "vec_cap", "nb_cap", "ent_cap", "sets") if k in s}
    if depth:
        out["buf"] = depth
    return out


def fits6(t6: Tables, v6shape: dict | None) -> bool:
    if v6shape is None:
        return False
    nb = max((len(s) for s in t6.spans.values()), default=1)
    return (
        set(t6.fields) <= set(v6shape["fields"])
        and t6.words <= v6shape["words"]
        and len(t6.vectors) + (1 if set(t6.fields) != set(v6shape["fields"]) else 0) <= v6shape["vec_cap"]
        and nb <= v6shape["nb_cap"]
        and t6.n + 1 + v6shape.get("buf", 0) <= v6shape["ent_cap"]
        and t6.sets == v6shape.get("sets", [])
    )


def tables6_records(
    t6: Tables, v6shape: dict, miss: int = 0, ct: CtConfig | None = None, view=None, lookup: bool = True
) -> bytes:
    """The IPv6 table set's records of the loader's tables file (written before hfx_cfg, which enables them). `miss`:
    the IPv6 plan's miss forcing bits (CONTROL bits 4/5, as `control_of` gives them for its Plan.miss_shunt); `ct`:
    its conntrack lookup. A program with an IPv6 update buffer (`v6shape["buf"]`) gets its slots, valid mask and
    rows too: those of `view` (an analysis.overlay.View over `t6`'s static entries, `align6`: the update buffer's
    contents), else an empty buffer (every static entry valid, no slot). `lookup` False: the lookup maps are left
    out (a write of the buffer alone into a running program whose lookup maps are `t6`'s)."""
    ct = ct or CtConfig()
    if not fits6(t6, v6shape):
        raise ValueError("IPv6 tables do not fit the program's shape")
    buf = v6shape.get("buf", 0)
    ov = view.overlay if view is not None else None
    if ov is not None and (ov.n_static != t6.n or ov.depth != buf):
        raise ValueError(f"an IPv6 overlay of {ov.n_static} entries and {ov.depth} slots for {t6.n} and {buf}")
    out = _lookup_records(t6, v6shape, "hfx6", SPAN6) if lookup else []
    rows = entry_rows6(view, t6.n) if view is not None else t6.entries
    out.append(_entry_record6(rows, t6.n, buf))
    ct_hit = list(t6.ct_hit)
    if buf:
        valid = ov.valid if ov is not None else np.ones(t6.n, dtype=bool)
        out.append(_record("hfx6_buf", SLOT6.size, buf, slot_rows6(ov, buf)))
        words = v6shape["words"]
        bits = np.zeros(words * 64, dtype=bool)
        if t6.boxes:
            bits[: t6.boxes] = valid[t6.box_entry]
        out.append(_record("hfx6_vbox", 8 * words, 1, _pack_rows(bits[None, :])[0].astype("<u8").tobytes()))
        # a conntrack hit's shortcut to an entry the valid mask took out: classify instead
        ct_hit = [h if not h & CT_HIT_SET or valid[h & ~CT_HIT_SET] else 0 for h in ct_hit]
    nb = {f: len(t6.spans[f]) if f in t6.spans else 1 for f in SEARCH_FIELDS}
    cfg = CONFIG6.pack(
        t6.n,
        t6.index_base,
        t6.words,
        nb["src"],
        nb["dst"],
        *ct_hit,
        t6.boxes,
        miss & MISS_BITS,
        ct.flags(),
        ct.tcp_ms,
        ct.udp_ms,
        ct.udp_unreplied_ms,
        t6.soft,
        ct.tcp_cw_ms,
        len(ov.slots) if ov is not None else 0,
    )
    out.append(_record("hfx6_cfg", CONFIG6.size, 1, cfg))
    return b"".join(out)


def _entry_record6(rows: bytes, n: int, buf: int) -> bytes:
    """hfx6_ent: the rows given (n + 1, or n + 1 + buf with a view's slots), then unused slots' rows up to n + 1 + buf."""
    have = len(rows) // ENTRY.size
    if have > n + 1 + buf:
        raise ValueError(f"{have} IPv6 rows for {n} entries and {buf} buffer slots")
    return _record("hfx6_ent", ENTRY.size, n + 1 + buf, rows + UNUSED_ROW * (n + 1 + buf - have))


def entry_rows6(view, n: int) -> bytes:
    """hfx6_ent's rows of an IPv6 View (`align6`: the master plan's rows, its k already offset by k_base)."""
    rows = entry_rows(view)
    if len(rows) // ENTRY.size != n + 1 + view.overlay.depth:
        raise ValueError("an IPv6 view's rows do not cover its entries and slots")
    return rows


def slot_rows6(ov: Overlay | None, depth: int) -> bytes:
    """hfx6_buf's contents: the overlay's slots (their boxes in address space: 128-bit src/dst), enabled, then
    disabled empty rows up to `depth`."""
    slots = ov.slots if ov is not None else ()
    if len(slots) > depth:
        raise ValueError(f"{len(slots)} IPv6 buffer slots for a program of {depth}")
    out = []
    for s in slots:
        b = s.box
        lo, hi = list(b.lo), list(b.hi)
        addr = []
        for d in SEARCH_FIELDS:
            i = FIELDS.index(d)
            addr += [*words128([lo[i]])[0], *words128([hi[i]])[0]]
            lo[i] = hi[i] = 0
        out.append(SLOT6.pack(*addr, *lo, *hi, b.flags_mask, b.flags_value, b.sets_mask, b.sets_value, s.pos, 1))
    empty = SLOT6.pack(*([0] * (16 + 2 * len(FIELDS))), 0, 0, 0, 0, 0, 0)
    return b"".join(out) + empty * (depth - len(slots))


def split_records(data: bytes) -> list[tuple[str, int, int, bytes]]:
    """The records of a tables file: (map name, value size, count, values)."""
    out, off = [], 0
    while off < len(data):
        (n,) = struct.unpack_from("<I", data, off)
        name = data[off + 4 : off + 4 + n].decode()
        vsize, count = struct.unpack_from("<II", data, off + 4 + n)
        start = off + 12 + n
        out.append((name, vsize, count, data[start : start + vsize * count]))
        off = start + vsize * count
    return out


def with_v6_records(data: bytes, v6: bytes) -> bytes:
    """Tables file `data` with its IPv6 records (hfx6_*) replaced by those of `v6` (tables6_records), placed where
    tables_file puts them: before hfx_cfg, the loader's last."""
    keep = [r for r in split_records(data) if not r[0].startswith("hfx6_")]
    body = [_record(*r) for r in keep if r[0] != "hfx_cfg"]
    cfg = [_record(*r) for r in keep if r[0] == "hfx_cfg"]
    return b"".join(body) + v6 + b"".join(cfg)


BUFFER6_MAPS = ("hfx6_ent", "hfx6_buf", "hfx6_vbox")  # what a write of the IPv6 update buffer rewrites whole


def buffer6_words(data: bytes) -> dict[str, list]:
    """What the state keeps of the IPv6 update buffer's maps as a tables file or tables6_records `data` writes them
    (hfx6_ent's rows: the static entries' and the slots', hfx6_buf's slots, hfx6_vbox's valid mask): per map, its
    element count and a digest of their words, which drift compares with the maps read back (`words6_digest`)."""
    return {name: [count, words6_digest(vals)] for name, _, count, vals in split_records(data) if name in BUFFER6_MAPS}


def words6_digest(vals: bytes) -> str:
    import hashlib

    return hashlib.sha256(vals).hexdigest()[:24]


def lookup6_digest(t6: Tables, v6shape: dict) -> str:
    """A digest of the IPv6 lookup maps `t6` writes into a program of `v6shape` (vectors, spans, direct tables,
    boxes): what the IPv6 update buffer's static entries are, so that an overlay is only ever computed against the
    table set the running program holds."""
    import hashlib

    return hashlib.sha256(b"".join(_lookup_records(t6, v6shape, "hfx6", SPAN6))).hexdigest()[:24]
