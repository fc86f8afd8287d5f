"""`-m set --match-set NAME DIRS` as a fast-path dimension (issue #24, docs/sets.md).

After flattening, each set match of a rule either becomes the set-slot ternary of the rule's boxes (bit 1 for
`--match-set`, bit 0 for `! --match-set`; ir.sets) or stays a complex check, with the reason said (lint, status):

- `--return-nomatch`, counter tests and updates (`--packets-*`, `--bytes-*`, `--update-counters`,
  `--update-subcounters` in any form), or any other option beside `--match-set`;
- a set the front end does not know (not in the live kernel, not in --ipsets), of another type than hash:ip,
  hash:net, hash:ip,port, hash:net,port, bitmap:port, of the other family than the policy's (an IPv6 policy's
  inet6 sets are slots only on a target with IPv6 set slots: xdp, emu), or with a netmask on a port type;
- a set some `-j SET --add-set/--del-set` of the policy changes (its contents change per packet);
- fewer directions than the set has dimensions (the kernel's ip_set_test answers "no" to every frame then);
- a set whose maxelem exceeds what the target holds per slot, or a ninth slot (MAX_SET_SLOTS), or a target
  without set slots (`Target.set_slots` 0: the NICs until their membership tables land);
- a rule with per-rule state before the set match (the reduction must stay a superset of the frames that reach
  the state).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from hypafilter.ir import Origin, Rule
from hypafilter.ir.sets import MAX_SET_SLOTS, SET_TYPES, SetInfo, SetSlot

SET_TARGET_RE = re.compile(r"--(?:add|del)-set\s+(\S+)")


@dataclass
class SetEnv:
    """What the front end knows of the kernel's sets, and what the target can hold."""

    sets: dict[str, SetInfo] = field(default_factory=dict)
    slots: int = MAX_SET_SLOTS  # set slots of the target (0: every set match stays complex)
    capacity: int = 1 << 20  # the most elements one slot holds (a set's maxelem above it: complex)
    target: str = ""
    source: str = ""  # where the sets were read ("live kernel", a file)
    changed: frozenset[str] = frozenset()  # sets a -j SET of the policy adds to or deletes from
    # the `ipset save` text the sets were read from (labs, the oracle and the kernel check create them from it)
    text: str = field(default="", repr=False)
    # reads (sets, text) when the first set match needs them (the live kernel is asked only for a policy with set
    # matches)
    loader: Callable[[], tuple[dict[str, SetInfo], str]] | None = field(default=None, repr=False, compare=False)
    # whether the target has IPv6 set slots (Target.set_slots6, targets.set_capability6: the xdp program's 128-bit-key
    # maps, the emulated NIC's IPv6 set tables); where not, an IPv6 policy's set matches stay complex
    v6_slots: bool = True

    def load(self) -> None:
        if self.loader is not None:
            loader, self.loader = self.loader, None
            self.sets, self.text = loader()


@dataclass(frozen=True)
class SetNote:
    """One set match of the flattened policy and what became of it (for lint and status)."""

    origin: Origin | None
    test: str  # e.g. "! --match-set svc dst,dst"
    slot: int  # -1: complex
    why: str  # the reason it stayed complex ("" when a slot)


def set_match(group: tuple[str, ...]) -> tuple[bool, str, str, tuple[str, ...]] | None:
    """(negated, name, dirs text, other option tokens) of a `-m set` token group; None for any other group."""
    if group[:2] != ("-m", "set"):
        return None
    toks = list(group[2:])
    neg, name, dirs, rest, i = False, "", "", [], 0
    while i < len(toks):
        t = toks[i]
        if t == "!" and i + 1 < len(toks) and toks[i + 1] in ("--match-set", "--set"):
            neg = True
            i += 1
            continue
        if t in ("--match-set", "--set") and i + 1 < len(toks) and not name:
            name, dirs = toks[i + 1], toks[i + 2] if i + 2 < len(toks) else ""
            i += 3
            continue
        rest.append(t)
        i += 1
    return (neg, name, dirs, tuple(rest)) if name else None


def why_not(env: SetEnv | None, name: str, dirs: tuple[str, ...], rest: tuple[str, ...], family: int = 4) -> str:
    """Why a set match of a policy of `family` cannot be a slot ('' when it can), before slot counting."""
    if env is None or env.slots <= 0:
        who = f"target {env.target}" if env is not None and env.target else "the target"
        return f"{who} has no set slots"
    if rest:
        return f"option {' '.join(rest)} (only a plain --match-set is a fast-path test)"
    env.load()
    info = env.sets.get(name)
    if info is None:
        return f"set {name} is unknown ({env.source or 'no sets read'}): give --ipsets or create it first"
    why = info.supported(family)
    if why:
        return why
    if name in env.changed:
        return f"set {name} is changed per packet by a -j SET of the policy"
    if any(d not in ("src", "dst") for d in dirs) or not dirs:
        return "directions other than src/dst"
    if len(dirs) < SET_TYPES[info.settype]:
        return f"{len(dirs)} direction(s) for a {info.settype} set: the kernel matches no frame"
    full = 128 if info.family == "inet6" else 32  # (bitmap:port, family-less, reads as inet: 32)
    if info.netmask != full and info.settype != "hash:ip":
        return f"netmask {info.netmask} on a {info.settype} set"
    if family == 6 and info.netmask != full:
        return f"netmask {info.netmask} on a family inet6 hash:ip set (IPv6 set slots key whole addresses)"
    if any(o.startswith(("bitmask", "markmask")) for o in info.options):
        return f"set {name}: a bitmask/markmask option"
    if info.maxelem > env.capacity:
        return f"set {name} may hold {info.maxelem} elements (maxelem), the target's slot {env.capacity}"
    return ""


def changed_sets(text: str) -> frozenset[str]:
    """Sets a `-j SET --add-set/--del-set` anywhere in the policy text changes."""
    return frozenset(SET_TARGET_RE.findall(text))


# Set types without a family of their own (NFPROTO_UNSPEC in the kernel): ip6tables may name them.
FAMILY_FREE_TYPES = frozenset({"bitmap:port", "hash:mac", "list:set"})


def why_not6(
    env: SetEnv | None, name: str, origin: Origin | None, dirs: tuple[str, ...] = (), rest: tuple[str, ...] = ()
) -> str:
    """Why a set match of an ip6tables policy stays complex; a PolicyError for a set ip6tables refuses.

    The kernel's ip_set_test answers "not a member" when the frame's family is not the set's (ip_set_core.c: the
    test runs only if `opt->family == set->family || set->family == NFPROTO_UNSPEC`), and ip6tables refuses to add a
    rule naming an inet set at all (libxt_set: "The protocol family of set X is IPv4, which is not applicable"): so
    an inet set in an ip6tables policy is an error here too, never a rule that silently matches nothing. A family
    inet6 set (or a family-less bitmap:port) of the fast path's types is a set slot of the IPv6 plan on a target with
    IPv6 set slots (xdp; emu, a dual-stack core's IPv6 set tables), under the same conditions as IPv4's (why_not); on
    others it stays complex."""
    if env is not None:
        env.load()
        info = env.sets.get(name)
        if info is not None and info.family == "inet" and info.settype not in FAMILY_FREE_TYPES:
            from hypafilter.errors import PolicyError

            col = origin.text.find(name) + 1 if origin and name in origin.text else 0
            raise PolicyError(
                f'set {name} is family inet (IPv4): ip6tables refuses it in an IPv6 rule ("The protocol family of '
                f'set {name} is IPv4, which is not applicable"); use a family inet6 set',
                origin.file if origin else "<policy>",
                origin.line if origin else 0,
                col,
                name,
            )
    if env is not None and env.slots > 0 and not env.v6_slots:
        return f"target {env.target} has no IPv6 set slots"
    return why_not(env, name, dirs, rest, family=6)


def apply_sets(
    rules: list[Rule], env: SetEnv | None, family: int = 4
) -> tuple[list[Rule], tuple[SetSlot, ...], list[SetNote]]:
    """The rules with every eligible set match turned into its slot ternary, the slots in order, and a note per
    set match (see the module docstring). An ip6tables policy (`family` 6): see why_not6."""
    slots: list[SetSlot] = []
    index: dict[tuple[str, tuple[str, ...]], int] = {}
    notes: list[SetNote] = []
    out: list[Rule] = []
    for r in rules:
        keep: list[tuple[str, ...]] = []
        mask = value = 0
        boxes = list(r.boxes)
        for g in r.complex:
            m = set_match(g)
            if m is None:
                keep.append(g)
                continue
            neg, name, dirs_text, rest = m
            dirs = tuple(dirs_text.split(",")) if dirs_text else ()
            test = f"{'! ' if neg else ''}--match-set {name} {dirs_text}".strip()
            why = why_not6(env, name, r.origin, dirs, rest) if family == 6 else why_not(env, name, dirs, rest)
            if not why and r.stateful_pos is not None:
                why = "the rule keeps per-rule state"
            slot = -1
            if not why:
                info = env.sets[name]
                key = (name, dirs[: SET_TYPES[info.settype]])
                slot = index.get(key, -1)
                if slot < 0:
                    if len(slots) >= min(env.slots, MAX_SET_SLOTS):
                        why = f"a set slot beyond the target's {min(env.slots, MAX_SET_SLOTS)}"
                    else:
                        slot = index[key] = len(slots)
                        slots.append(SetSlot(name, info.settype, key[1]))
            if why:
                notes.append(SetNote(r.origin, test, -1, why))
                keep.append(g)
                continue
            bit = 1 << slot
            if mask & bit and (value & bit) != (0 if neg else bit):
                boxes = []  # `-m set A` and `! -m set A` by the same slot: never true
            mask |= bit
            value = (value & ~bit) | (0 if neg else bit)
            notes.append(SetNote(r.origin, test, slot, ""))
        if mask:
            nb = []
            for b in boxes:
                x = b.with_sets(mask, value)
                if x is not None:
                    nb.append(x)
            boxes = nb
        out.append(
            r if not mask and len(keep) == len(r.complex) else replace(r, boxes=tuple(boxes), complex=tuple(keep))
        )
    return out, tuple(slots), notes
