"""Renders the rule-set-specific VHDL (matcher and policy package) from a Plan, and lists the core's sources."""

from __future__ import annotations

import functools
import hashlib
import math
from dataclasses import dataclass
from pathlib import Path

import jinja2

from hypafilter.analysis.plan import action_words
from hypafilter.config import UPDATE_BUFFER_DEFAULT, UPDATE_BUFFER_MAX
from hypafilter.hw import regmap, settable
from hypafilter.hw.updatebuffer import buffer_depth
from hypafilter.ir import ACTION_DROP, FIELD_INDEX, MAXV, WIDTHS, Box, Policy
from hypafilter.ir.family import ADDR_BITS, ADDR_MAX
from hypafilter.ir.sets import MAX_SET_SLOTS
from hypafilter.paths import HW_DIR

TEMPLATES = HW_DIR / "templates"
CHUNK = 8  # equality tests are split into 8-bit chunks so that prefixes share comparators across rules
CT = FIELD_INDEX["ct"]
BOX_STAGE_ABOVE = 4  # entries with more boxes than this get a registered box stage (keeps LUT depth low)
# Fan-in of the update buffer's slot encoder: up to 16 slots in one stage (3 LUT levels in yosys' mapping), 256 in two
BUF_FANIN = 16

# Static sources of the core in compile order (after the generated packages, before the generated matcher
# only where nothing static instantiates it; hypafilter_core does, so it comes last).
STATIC_SOURCES = (
    "hf_pkg.vhd",
    "hf_ram.vhd",
    "hf_fifo.vhd",
    "hf_header_parser.vhd",
    "hf_prio_enc.vhd",
    "hf_update_buffer_shell.vhd",
    "hf_update_buffer.vhd",
    "hf_update_buffer6.vhd",
    "hf_set_pkg.vhd",
    "hf_set_table.vhd",
    "hf_tables.vhd",
    "hf_regs.vhd",
    "hf_output.vhd",
    "hf_flow_cache.vhd",
    "hf_ct_member.vhd",
)
TOP_SOURCE = "hypafilter_core.vhd"

# VHDL signal of each header field in the matcher (the order of ir.FIELDS, then the flags).
_SIG = {
    "src": "h_src",
    "dst": "h_dst",
    "proto": "h_proto",
    "sport": "h_sport",
    "dport": "h_dport",
    "icmp_type": "h_icmp_type",
    "icmp_code": "h_icmp_code",
    "iport": "h_iport",
    "ct": "h_ct",  # comparators only for boxes whose ct range is not full (_field_tests)
}


@dataclass(frozen=True)
class HwEntry:
    boxes: tuple[Box, ...]


@dataclass
class HwPlan:
    """The part of plan.Plan the hardware needs (index mode): what minimal_plan builds and the tests construct."""

    entries: list[HwEntry]
    shunt: list[int]
    actions: list[int]
    policy_hash: str
    mode: str = "index"
    buffer_depth: int = UPDATE_BUFFER_DEFAULT  # update buffer slots of the core (Config.update_buffer)
    set_slots: tuple = ()  # ir.sets.SetSlot per set slot the entries' sets ternaries test
    set_geometry: settable.Geometry | None = None  # the slots' tables (None: settable.DEFAULT_GEOMETRY)


def minimal_plan(policy: Policy) -> HwPlan:
    """Index-based shunting over the simple rules: exact, if not minimal (paper §IV-A)."""
    entries, shunt, actions = [], [], []
    complex_seen = False
    for r in policy.rules:
        if r.is_simple:
            entries.append(HwEntry(tuple(r.boxes)))
            shunt.append(int(complex_seen))
            actions.append(r.action_code)
        else:
            complex_seen = True
    shunt.append(int(complex_seen))
    actions.append(policy.default_action_code)
    return HwPlan(entries, shunt, actions, policy.policy_hash())


def _bits(value: int, width: int) -> str:
    return '"' + format(value, f"0{width}b") + '"'


# The IPv6 side of a dual-stack matcher: the signals of a parsed IPv6 frame (the parser's h6_* outputs) and the
# widths of its addresses; iport and ct are the frame's whatever its family, and an IPv6 box tests no set slot.
_SIG6 = {
    **_SIG,
    "src": "h6_src",
    "dst": "h6_dst",
    "proto": "h6_proto",
    "sport": "h6_sport",
    "dport": "h6_dport",
    "icmp_type": "h6_icmp_type",
    "icmp_code": "h6_icmp_code",
}
_WIDTHS6 = {**WIDTHS, "src": ADDR_BITS[6], "dst": ADDR_BITS[6]}


def _field_tests(name: str, lo: int, hi: int, sig: str | None = None, w: int | None = None) -> list[str]:
    """VHDL boolean expressions testing lo <= field <= hi (nothing for the full range); `sig`/`w`: the signal and
    width when not the IPv4 field's (the 128-bit address of an IPv6 entry)."""
    w = WIDTHS[name] if w is None else w
    maxv = (1 << w) - 1
    if lo <= 0 and hi >= maxv:
        return []
    sig = _SIG[name] if sig is None else sig
    size = hi - lo + 1
    if size & (size - 1) == 0 and lo % size == 0:
        # prefix: compare the fixed high bits, chunk by chunk
        free = size.bit_length() - 1
        tests = []
        for c0 in range(0, w, CHUNK):
            c1 = min(w, c0 + CHUNK) - 1
            cw = c1 - c0 + 1
            mask = ((1 << cw) - 1) & ~((1 << max(0, free - c0)) - 1) if free > c0 else (1 << cw) - 1
            if free > c1:
                continue
            val = (lo >> c0) & mask
            part = f"{sig}({c1} downto {c0})"
            if mask == (1 << cw) - 1:
                tests.append(f"{part} = {_bits(val, cw)}")
            else:
                tests.append(f"({part} and {_bits(mask, cw)}) = {_bits(val, cw)}")
        return tests
    tests = []
    if lo > 0:
        tests.append(_order(sig, w, lo, ">"))
    if hi < maxv:
        tests.append(_order(sig, w, hi, "<"))
    return tests


WIDE = 32  # constants wider than this: GHDL 2.0's Verilog writes them as quoted strings (docs/hardware.md's traps)


class Lex(tuple):
    """A wide bound as the comparators it needs, (last, ((strict, equal), ...)) from the lowest chunk up: the chunks'
    tests are registered comparators like any other (the equalities shared by a range's two bounds), and the entry
    stage combines them lexicographically (`strict_k or (equal_k and ...)`), so that neither stage holds a 128-bit
    compare's whole depth (in one stage: 6 LUT levels, docs/ipv6.md "The NIC's core")."""


def _order(sig: str, w: int, c: int, strict: str):
    """sig >= c (strict ">") or sig <= c ("<") on a w-bit field: one VHDL boolean up to WIDE bits, else a Lex of
    WIDE-bit chunk tests (a 128-bit address bound), so that no constant is wider than WIDE bits."""
    if w <= WIDE:
        return f"unsigned({sig}) {strict}= unsigned'({_bits(c, w)})"
    last, upper = "", []
    for c0 in range(0, w, WIDE):
        c1 = min(w, c0 + WIDE) - 1
        part, val = f"{sig}({c1} downto {c0})", _bits((c >> c0) & ((1 << (c1 - c0 + 1)) - 1), c1 - c0 + 1)
        if not last:
            last = f"unsigned({part}) {strict}= unsigned'({val})"
        else:
            upper.append((f"unsigned({part}) {strict} unsigned'({val})", f"{part} = {val}"))
    return Lex((last, tuple(upper)))


def _box_tests(b: Box, sets_w: int = 1, amap=None) -> list[str]:
    """The comparators of one box; `amap` (ir.family.AddrMap): the box is an IPv6 entry's, its src/dst are address
    ranks, and the tests compare the 128-bit addresses the ranks stand for (the hardware sees real addresses), its
    set bits the IPv6 slots' (h6_sets; sets_w is then the IPv6 plan's slot count)."""
    tests = []
    if amap is None:
        for name, lo, hi in zip(_SIG, b.lo, b.hi, strict=True):
            tests += _field_tests(name, lo, hi)
    else:
        for name, lo, hi in zip(_SIG6, b.lo, b.hi, strict=True):
            if name in ("src", "dst"):
                lo, hi = unrank(amap, name, lo, hi)
            tests += _field_tests(name, lo, hi, _SIG6[name], _WIDTHS6[name])
    flags = "h_flags" if amap is None else "h6_flags"
    if b.flags_mask:
        tests.append(f"({flags} and {_bits(b.flags_mask, 8)}) = {_bits(b.flags_value, 8)}")
    if b.sets_mask:
        if b.sets_mask >> sets_w:
            raise ValueError(f"a box tests set slot bits {b.sets_mask:#x} beyond the plan's {sets_w} slots")
        sig = "h_sets" if amap is None else "h6_sets"
        tests.append(f"({sig} and {_bits(b.sets_mask, sets_w)}) = {_bits(b.sets_value, sets_w)}")
    return tests


def unrank(amap, dim: str, lo: int, hi: int) -> tuple[int, int]:
    """The 128-bit address interval a ranked box's [lo, hi] stands for in dimension `dim` (ir.family: a box reaching
    the top address ends at MAXV instead of the top rank)."""
    top = ADDR_MAX[amap.family]
    if hi >= MAXV[FIELD_INDEX[dim]]:
        return amap.interval(dim, lo)[0], top
    return amap.interval(dim, lo)[0], amap.interval(dim, hi)[1]


def v6_base(plan) -> int:
    """The hardware index of a dual-stack core's first IPv6 entry: after the IPv4 entries, the IPv4 policy entry and
    the update buffer's slots (V6_BASE of the policy package; the IPv6 policy entry is V6_BASE + n6)."""
    return len(plan.entries) + 1 + buffer_depth(plan)


def set_slots(plan) -> tuple:
    """The plan's set slots (ir.sets.SetSlot), in slot order; () for plans without any."""
    return tuple(getattr(plan, "set_slots", ()) or ())


def set_geometry(plan) -> settable.Geometry:
    """The geometry of every set slot's table: the plan's `set_geometry` if it has one, else the NIC's default."""
    return getattr(plan, "set_geometry", None) or settable.DEFAULT_GEOMETRY


def set_generics(plan) -> list[dict[str, int]]:
    """hf_set_table's generics per slot (the policy package's SET_* arrays; of an IPv6 plan, the SET6_* arrays of
    the dual-stack core's IPv6 slots, whose tables have V6 set)."""
    geom = set_geometry(plan)
    return [settable.slot_generics(s.settype, tuple(s.dirs), geom) for s in set_slots(plan)]


def _and(terms: list[str]) -> str:
    return " and ".join(terms) if terms else "'1'"


def _or(terms: list[str]) -> str:
    return " or ".join(terms) if terms else "'0'"


def matcher_source(plan, plan6=None) -> dict:
    """Template variables of the matcher: deduplicated comparators and per-entry expressions (`entries`, the IPv4
    ones), and `rows`: (result bit, expression, valid-mask bit, mask: "valid" or the IPv6 entries' "valid6") for
    every entry. `plan6`: the IPv6 side of a
    dual stack (a family-6 Plan); its entries follow at result bits v6_base(plan) + j, every box of theirs tests the
    128-bit addresses its ranks stand for and the frame's family (h_f6), and every IPv4 box tests h_f6 = '0'."""
    comps: dict[str, int] = {}

    def ref(test: str) -> str:
        if test not in comps:
            comps[test] = len(comps)
        return f"cmp({comps[test]})"

    e6 = list(plan6.entries) if plan6 is not None else []
    box_stage = any(len(e.boxes) > BOX_STAGE_ABOVE for e in [*plan.entries, *e6])
    sets_w = max(len(set_slots(plan)), 1)
    boxes, entries, rows = [], [], []

    def term(t) -> str:
        if not isinstance(t, Lex):
            return ref(t)
        expr = ref(t[0])
        for gt, eq in t[1]:
            expr = f"({ref(gt)} or ({ref(eq)} and {expr}))"
        return expr

    sets6_w = max(len(set_slots(plan6)), 1) if plan6 is not None else 1

    def entry(e, extra: list[str], amap) -> str:
        live = [b for b in e.boxes if not b.is_empty()]
        w = sets_w if amap is None else sets6_w
        exprs = [_and([term(t) for t in [*extra, *_box_tests(b, w, amap)]]) for b in live]
        if box_stage:
            refs = []
            for x in exprs:
                refs.append(f"box({len(boxes)})")
                boxes.append(x)
            return _or(refs)
        return _or([f"({x})" if " and " in x else x for x in exprs])

    fam4 = ["h_f6 = '0'"] if plan6 is not None else []
    for i, e in enumerate(plan.entries):
        entries.append(entry(e, fam4, None))
        rows.append((i, entries[-1], i, "valid"))
    if plan6 is not None:
        base = v6_base(plan)
        for j, e in enumerate(e6):
            rows.append((base + j, entry(e, ["h_f6 = '1'"], plan6.addr_map), j, "valid6"))
    return {
        "comparators": list(comps),
        "entries": entries,
        "rows": rows,
        "boxes": boxes,
        "nboxes": len(boxes),
        "box_stage": box_stage,
        "match_latency": 3 if box_stage else 2,
    }


def matcher_hash(plan, plan6=None) -> str:
    """Hex SHA-256 of what the matcher is built from: the entries' boxes in order and the update buffer's depth δ
    (not shunt bits, not actions, not the buffer's contents, which are run-time registers). Its low 32 bits are the
    MATCHER_HASH register: a plan with the same value programs a running core by register writes alone; any other
    plan needs a core generated for it. A View (analysis.overlay) hashes as its static entries: the core it runs on."""
    h = hashlib.sha256(f"hypafilter matcher v1\n{len(plan.entries)}\n".encode())
    for e in plan.entries:
        for b in e.boxes:
            if not b.is_empty():
                lo, hi = b.lo, b.hi
                if lo[CT] == 0 and hi[CT] == MAXV[CT]:  # a box that leaves ct free hashes as before ct existed
                    lo, hi = lo[:CT], hi[:CT]
                sets = f"s{b.sets_mask},{b.sets_value}" if b.sets_mask else ""
                h.update(f"{lo}{hi}{b.flags_mask},{b.flags_value}{sets};".encode())
        h.update(b"\n")
    h.update(f"update buffer {buffer_depth(plan)}\n".encode())
    if set_slots(plan):  # the tables' types, directions and geometry are the core's (their contents are not)
        h.update(f"sets {set_generics(plan)}\n".encode())
    if plan6 is not None:  # a dual-stack core: the IPv6 entries as the addresses their ranks stand for
        h.update(f"ipv6 {len(plan6.entries)}\n".encode())
        m = matcher_source(_Empty(), plan6)
        for _i, expr, _v, _m in m["rows"]:
            h.update(f"{expr}\n".encode())
        h.update("\n".join(m["comparators"]).encode())
        h.update("\n".join(m["boxes"]).encode())
        if set_slots(plan6):  # the IPv6 slots' tables (docs/sets.md "IPv6 sets")
            h.update(f"\nsets6 {set_generics(plan6)}\n".encode())
        if buffer6_depth(plan, plan6):  # the IPv6 update buffer's slots (docs/ipv6.md "## emu")
            h.update(f"\nupdate buffer6 {buffer6_depth(plan, plan6)}\n".encode())
    return h.hexdigest()


def buffer6_depth(plan, plan6) -> int:
    """The IPv6 update buffer's slots (δ6, hf_update_buffer6's DEPTH) of the dual-stack core for (plan, plan6): the
    IPv6 plan's `buffer6_depth` when it has one (0: none), else the IPv4 side's δ, as on xdp; 0 without an IPv6 side.
    Slot b is hardware index v6_base(plan) + n6 + 1 + b. Its latency must be the IPv4 buffer's (the same slot encoder
    stages), or 0 slots."""
    if plan6 is None:
        return 0
    d6 = getattr(plan6, "buffer6_depth", None)
    return buffer_depth(plan) if d6 is None else int(d6)


class _Empty:
    """An IPv4 side without entries or slots (matcher_hash renders the IPv6 side alone)."""

    entries: tuple = ()
    buffer_depth = 0


def enc_stages(n_in: int, fanin: int) -> int:
    """Pipeline stages of the priority encoder: the least s with fanin**s >= n_in. The one computation of it: the
    policy package carries it as ENC_STAGES, hf_prio_enc takes it as its STAGES generic and checks it."""
    s, width = 1, fanin
    while width < n_in:
        width *= fanin
        s += 1
    return s


def res_width(n_entries: int) -> int:
    """Width of the matcher's result vector, the encoder's N_IN: at least 1, so that no array is null."""
    return max(n_entries, 1)


def idx_width(n_entries: int, depth: int = 0) -> int:
    """Bits of a hardware index, 0 .. n_entries + depth (the policy entry and `depth` buffer slots included): IDX_W
    of the policy package."""
    return max(1, (n_entries + depth).bit_length())


def buffer_stages(depth: int, fanin: int = BUF_FANIN) -> int:
    """Stages of the update buffer's slot encoder (hf_update_buffer's STAGES; 1 when there is no slot)."""
    return enc_stages(max(depth, 1), fanin)


def buffer_latency(depth: int, fanin: int = BUF_FANIN) -> int:
    """Cycles the update buffer adds between the static encoder and the tables: the register of the slots that may
    win, then the slot encoder; none without slots (BUF_LATENCY of the policy package)."""
    return 1 + buffer_stages(depth, fanin) if depth else 0


def encoder_generics(n_in: int, fanin: int, idx_w: int) -> dict[str, int]:
    """The generics of one hf_prio_enc, for builds of the encoder alone (synthesis estimates, its testbench)."""
    return {"N_IN": n_in, "FANIN": fanin, "STAGES": enc_stages(n_in, fanin), "IDX_W": idx_w}


POWER_ON = ("plan", "shunt_all")


@functools.lru_cache(maxsize=1)
def template_env() -> jinja2.Environment:
    """The Jinja2 environment of hw/templates (strict: a missing variable is an error)."""
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(TEMPLATES)), undefined=jinja2.StrictUndefined, keep_trailing_newline=True
    )


def render(
    plan, out_dir: Path, tdata_width: int = 256, encoder_fanin: int = 8, power_on: str = "plan", plan6=None
) -> list[Path]:
    """Write the generated VHDL (policy package, matcher) and the register package into out_dir.

    power_on: the table contents after power-on/reset. "plan" = this plan's shunt vector and actions (a bitstream
    that filters on its own); "shunt_all" = every entry shunts (safe for any plan with the same matcher; the
    sources then depend on the matcher alone, so one build serves every plan that shares it).
    plan6: the IPv6 side of a dual stack (a family-6 Plan, docs/ipv6.md "The NIC's core"): a core that walks the
    IPv6 chain and matches a parsed IPv6 frame against these entries only (hardware indices from v6_base(plan), the
    IPv6 policy entry after them), an IPv4 frame against the IPv4 entries only. None: an IPv4-only core, whose
    parser generates the walk out (IPv6 frames unparsed).
    """
    if plan6 is not None and getattr(plan6, "family", 4) != 6:
        raise ValueError("plan6 must be the plan of an IPv6 (family 6) policy")
    if plan6 is not None and len(plan6.shunt) != len(plan6.entries) + 1:
        raise ValueError("plan6.shunt and plan6.actions need n6 + 1 values")
    if power_on not in POWER_ON:
        raise ValueError(f"power_on must be one of {', '.join(POWER_ON)}")
    if tdata_width not in (256, 512):
        raise ValueError("tdata_width must be 256 or 512")
    if encoder_fanin < 2 or encoder_fanin & (encoder_fanin - 1):
        raise ValueError("encoder_fanin must be a power of two >= 2")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    n = len(plan.entries)
    depth = buffer_depth(plan)
    rows = n + 1 + depth
    if not 0 <= depth <= UPDATE_BUFFER_MAX:
        raise ValueError(f"update buffer depth {depth} outside 0..{UPDATE_BUFFER_MAX}")
    if len(plan.shunt) not in (n + 1, rows) or len(plan.actions) != len(plan.shunt):
        raise ValueError(f"plan.shunt and plan.actions need n + 1 values (or n + 1 + {depth}: one per table row)")
    if len(set_slots(plan)) > MAX_SET_SLOTS:
        raise ValueError(f"{len(set_slots(plan))} set slots; the core has tables for at most {MAX_SET_SLOTS}")
    sets6 = set_generics(plan6) if plan6 is not None else []
    if len(sets6) > MAX_SET_SLOTS:
        raise ValueError(f"{len(sets6)} IPv6 set slots; the core has tables for at most {MAX_SET_SLOTS}")
    if any(e.boxes and len(b.lo) != len(MAXV) for e in plan.entries for b in e.boxes):
        raise ValueError("box dimensions do not match ir.FIELDS")
    # the ACTION table words: action code | HF_ACTION_MIRROR_BIT for a mirrored entry (log mirroring); the rows of
    # the buffer's slots power on shunted with no action (a slot is disabled until the host writes it and its row)
    shunt = [int(b) for b in plan.shunt] if power_on == "plan" else [1] * (n + 1)
    actions = action_words(plan) if power_on == "plan" else [ACTION_DROP] * (n + 1)
    shunt += [1] * (rows - len(shunt))
    actions += [0] * (rows - len(actions))
    n6 = len(plan6.entries) if plan6 is not None else 0
    depth6 = buffer6_depth(plan, plan6)
    if depth6 and not (0 < depth6 <= UPDATE_BUFFER_MAX and buffer_latency(depth6) == buffer_latency(depth)):
        raise ValueError(f"IPv6 update buffer depth {depth6}: 0, or one whose latency is the IPv4 buffer's ({depth})")
    if plan6 is not None:  # the IPv6 entries' rows and the IPv6 policy entry's after the buffer's slots, then the
        # IPv6 buffer's slots' rows (shunted, no action: a slot is disabled until the host writes it and its row)
        rows += n6 + 1
        shunt += [int(b) for b in plan6.shunt] if power_on == "plan" else [1] * (n6 + 1)
        actions += action_words(plan6) if power_on == "plan" else [ACTION_DROP] * (n6 + 1)
        rows += depth6
        shunt += [1] * depth6
        actions += [0] * depth6
    words = [0] * ((rows + 31) // 32)
    for i, bit in enumerate(shunt):
        if bit:
            words[i // 32] |= 1 << (i % 32)
    idx_w = idx_width(n + (n6 + 1 if plan6 is not None else 0), depth + depth6)
    # the result vector: the IPv4 entries, then (dual stack) zeros for the IPv4 policy entry and the buffer's slots,
    # then the IPv6 entries, so that the encoder's index is the hardware index of either family
    res_w = res_width(n) if plan6 is None or n6 == 0 else v6_base(plan) + n6
    sw_w = max(1, math.ceil(math.log2(len(words))))
    padded_words = words + [0] * ((1 << sw_w) - len(words))
    padded_actions = [int(a) & 0xF for a in actions] + [0] * ((1 << idx_w) - rows)
    env = template_env()
    mhash = matcher_hash(plan, plan6)
    common = {
        "origin": f"policy {plan.policy_hash}" if power_on == "plan" else f"matcher {mhash} (power-on: shunt all)",
        "n": n,
        "res_width": res_w,
        "valid_width": res_width(n),
        "valid6_width": res_width(n6),
        "buf6_depth": depth6,
        "v6_on": plan6 is not None,
        "n6": n6,
        "rows": rows,
        "idx_w": idx_w,
        "hash32": mhash[-8:].upper(),
        "fanin": encoder_fanin,
        "enc_stages": enc_stages(res_w, encoder_fanin),
        "tdata_width": tdata_width,
        "shunt_words": len(words),
        "shunt_depth": len(padded_words),
        "action_depth": len(padded_actions),
        "shunt_rom": rom_chain(padded_words, len(words)),
        "action_rom": rom_chain(padded_actions, rows),
        "buf_depth": depth,
        "buf_fanin": BUF_FANIN,
        "buf_stages": buffer_stages(depth),
        "buf_latency": buffer_latency(depth),
        "sets": set_generics(plan),
        "sets_or_none": set_generics(plan) or [settable.slot_generics("hash:ip", ("src",), settable.Geometry(1, 1, 1))],
        "sets6": sets6,
        "sets6_or_none": sets6 or [settable.slot_generics("hash:ip", ("src",), settable.Geometry(1, 1, 1))],
        "set_latency": settable.LATENCY if set_slots(plan) or sets6 else 0,
    }
    m = matcher_source(plan, plan6)
    common["match_latency"] = m["match_latency"]
    paths = []
    for tmpl, name, extra in (
        ("hf_policy_pkg.vhd.j2", "hf_policy_pkg.vhd", {}),
        ("hf_matcher.vhd.j2", "hf_matcher.vhd", m),
    ):
        p = out_dir / name
        p.write_text(env.get_template(tmpl).render({**common, **extra}))
        paths.append(p)
    paths[:0] = regmap.write_all(out_dir)
    return paths


def rom_chain(values: list[int], live: int) -> dict:
    """A table's power-on contents as the template writes them: `default` for every index below `live` (the most
    common value there), then one `if i = k` per entry that differs; every other index reads 0. The emulator's core
    powers on with one value everywhere, so its sweep function is one comparison instead of one per entry (GHDL
    turned ~1,100 of them into logic the emulator evaluated every cycle and compiled for minutes)."""
    counts: dict[int, int] = {}
    for v in values[:live]:
        counts[v] = counts.get(v, 0) + 1
    default = max(counts, key=lambda v: (counts[v], v == 0)) if counts else 0
    exceptions = [(i, v) for i, v in enumerate(values) if v != (default if i < live else 0)]
    return {"live": live, "default": default, "exceptions": exceptions}


def sources(out_dir: Path) -> list[Path]:
    """Every VHDL file of the core in compile order, for a build rendered into out_dir."""
    out_dir = Path(out_dir).resolve()
    gen = [out_dir / "hf_regs_pkg.vhd", out_dir / "hf_policy_pkg.vhd"]
    return gen + [HW_DIR / s for s in STATIC_SOURCES] + [out_dir / "hf_matcher.vhd", HW_DIR / TOP_SOURCE]
