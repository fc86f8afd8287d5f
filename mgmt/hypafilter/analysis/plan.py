"""The Plan: hardware entries, shunt vector, actions and intervals of a policy (paper §V–VI; docs/internals.md).

Modes:
  index     -- entry per simple rule; shunt iff the rule comes after the first complex rule (paper §V-A).
  selective -- entry per simple rule; shunt iff some earlier complex reduction intersects it (Alg. 1).
  exact     -- entry per rule (complex rules contribute their reduction R⁻); shunt exactly the complex entries.

Intervals (paper §VI-C): consecutive simple entries form a group with one k; the policy entry has its own k.
`chains[k]` is the list of policy rule positions software tests for a packet with interval k before applying the
hardware action (index/selective: every complex rule above the group; exact: for a complex entry, the rule itself
and every later rule whose geometry meets its reduction). `geo_chains[k]` keeps only the complex rules whose
reduction meets the shunted boxes of the group (strategy `interval_geo`).
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from hypafilter.analysis import geometry
from hypafilter.analysis.geometry import BoxSet
from hypafilter.config import MODES, STRATEGIES, UPDATE_BUFFER_DEFAULT, Config, mirrors
from hypafilter.errors import HypafilterError
from hypafilter.ir import ACTION_ACCEPT, ACTION_DROP, ACTION_NONE, FIELD_INDEX, Box, Policy
from hypafilter.ir.box import CT_NONE, CT_UNKNOWN
from hypafilter.ir.semantics import observes
from hypafilter.shared import C

CT = FIELD_INDEX["ct"]


class PrefixView(Sequence):
    """The first `count` items of a shared list (interval chains above a group are prefixes of the complex list;
    storing them as views keeps 10k intervals x 10k complex rules from becoming 1e8 list slots)."""

    def __init__(self, base: list[int], count: int):
        self.base = base
        self.count = count

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i):
        if isinstance(i, slice):
            return self.base[: self.count][i]
        if not -self.count <= i < self.count:
            raise IndexError(i)
        return self.base[i % self.count]

    def __iter__(self):
        return iter(self.base[: self.count])

    def __eq__(self, other) -> bool:
        return list(self) == list(other)

    def __repr__(self) -> str:
        return repr(list(self))


@dataclass(frozen=True)
class Entry:
    """One hardware entry: the rule it comes from, its box union, its action code, whether it is a reduction."""

    rule_index: int
    boxes: tuple[Box, ...]
    action: int
    is_complex: bool


@dataclass
class Plan:
    policy: Policy
    mode: str
    entries: list[Entry]
    shunt: np.ndarray  # bool [n + 1]
    actions: np.ndarray  # uint8 [n + 1]
    interval: np.ndarray  # uint32 [n + 1], k >= 1
    policy_hash: str
    conflict: np.ndarray  # bool [len(rules)]: simple rule meets an earlier complex reduction (Alg. 1 bit)
    chains: dict[int, Sequence[int]]  # k -> policy rule positions tested in software before the hardware action
    entry_set: BoxSet = field(repr=False)  # every entry's boxes, owner = entry index
    analysis_seconds: float = 0.0
    groups: dict[int, list[int]] = field(default_factory=dict, repr=False)  # k -> entry indices
    # Miss forcing (CONTROL bits 4/5): a frame the flow cache does not know (ct = 0) whose hardware verdict would be
    # (ACCEPT, DROP) is shunted with reason 3. Set for a policy that reads conntrack (see build_plan).
    miss_shunt: tuple[bool, bool] = (False, False)
    # The shunt bits for a frame no conntrack entry holds (ct 3, ir.box CT_NONE: only the xdp target's lookup proves
    # one), bool [n + 1], a subset of `shunt`: the earlier complex rules that can claim such a frame are only those
    # whose reductions reach ct 3 (iptables.ctstate keeps a state rule's miss part off ct 3 where NEW and INVALID
    # read it alike). None: the same as `shunt`.
    shunt_none: np.ndarray | None = field(default=None, repr=False)
    # Log mirroring: bool [n + 1], entry j's frames get a copy to the host (reason 4) when they are neither shunted
    # nor forced; `observing` bool [len(rules)]: the rules treated as observing (never deciding) in this plan
    mirror: np.ndarray | None = field(default=None, repr=False)
    observing: np.ndarray | None = field(default=None, repr=False)
    strategy: str = "interval"  # the strategy the plan was built for (mirroring depends on it)
    # Built for the live ruleset (a deployment): the operator's chains stay in the kernel under their names and the
    # tool's chains return to them for every frame they do not decide (analysis.program, "live").
    live: bool = False
    # Slots of the update buffer of the core built for it (Config.update_buffer): part of the hardware's identity
    # (hw.vhdl.matcher_hash); the tables of such a core have n + 1 + buffer_depth rows (analysis.overlay)
    buffer_depth: int = UPDATE_BUFFER_DEFAULT
    # The address family (ir.family): 6 for a plan of an ip6tables policy, whose entries hold address ranks; a frame's
    # addresses map to them by `addr_map.rank(dim, addr)` (ir.family.AddrMap; None for IPv4).
    family: int = 4
    addr_map: object | None = field(default=None, repr=False)
    tree_min_segment: int = 16  # strategy tree's runs (Config.tree_min_segment; analysis.trees)
    _geo: dict[int, list[int]] | None = field(default=None, repr=False)

    # Derived arrays, computed once (refresh): bool [n + 1] each.
    forced: np.ndarray = field(init=False, repr=False)  # the entries miss forcing can shunt
    may_shunt: np.ndarray = field(init=False, repr=False)  # deliver the frame itself: shunt | forced
    delivers: np.ndarray = field(init=False, repr=False)  # send software anything: may_shunt | mirror (a copy)

    @property
    def set_slots(self) -> tuple:
        """The set slots the entries' sets ternaries test, in slot order (ir.sets.SetSlot; Policy.set_slots)."""
        return self.policy.set_slots

    def __post_init__(self):
        if self.mirror is None:
            self.mirror = np.zeros(len(self.entries) + 1, dtype=bool)
        if self.observing is None:
            self.observing = np.zeros(len(self.policy.rules), dtype=bool)
        self.refresh()

    def refresh(self) -> None:
        """Recompute the derived arrays (forced, may_shunt, delivers) and drop the cached geo chains and programs:
        call it after changing shunt, actions, miss_shunt or mirror in place."""
        if self.shunt_none is None or len(self.shunt_none) != len(self.shunt):
            self.shunt_none = np.array(self.shunt, dtype=bool, copy=True)
        self.shunt_none = self.shunt_none & self.shunt  # a subset, also after shunt bits changed in place
        self.forced = forced_entries(self.entries, self.actions, self.miss_shunt)
        self.may_shunt = self.shunt | self.forced
        self.delivers = self.may_shunt | self.mirror
        self._geo = None
        self.__dict__.pop("_programs", None)

    @property
    def geo_chains(self) -> dict[int, list[int]]:
        """k -> chains[k] filtered by geometry (interval_geo); computed on first use (costly on huge policies)."""
        if self._geo is None:
            if self.mode == "exact":
                self._geo = {k: list(v) for k, v in self.chains.items()}
            else:
                self._geo = _geo_chains(
                    self.policy, self.entries, self.delivers, self.interval, self.chains, self.groups
                )
        return self._geo

    @property
    def n(self) -> int:
        return len(self.entries)

    @property
    def num_intervals(self) -> int:
        return int(self.interval.max()) if len(self.interval) else 0

    def shunt_string(self) -> str:
        return "".join("1" if b else "0" for b in self.shunt)

    def hsa_members(self) -> np.ndarray:
        """bool[len(rules)]: the rules strategy hsa_cut keeps in software: every complex rule, every simple rule
        whose Alg. 1 bit is set, and every simple rule whose entry may shunt for another reason (miss forcing in a
        policy that reads conntrack), since a shunted packet may first match any of them."""
        keep = self.conflict | np.array([not r.is_simple for r in self.policy.rules], dtype=bool)
        may = self.may_shunt
        for j, e in enumerate(self.entries):
            if may[j]:
                keep[e.rule_index] = True
        return keep

    def entry_of_rule(self) -> dict[int, int]:
        return {e.rule_index: i for i, e in enumerate(self.entries)}

    def report(self) -> dict:
        """The partition report (JSON-ready)."""
        pol = self.policy
        e_of = self.entry_of_rule()
        rules = []
        for i, r in enumerate(pol.rules):
            ent = e_of.get(i)
            rules.append(
                {
                    "index": i,
                    "line": r.origin.line if r.origin else None,
                    "text": r.origin.text if r.origin else None,
                    "kind": "simple" if r.is_simple else "complex",
                    "target": r.target,
                    "boxes": len(r.boxes),
                    "entry": ent,
                    "shunt": None if ent is None else bool(self.shunt[ent]),
                    "interval": None if ent is None else int(self.interval[ent]),
                }
            )
            if r.ct_part:  # one part of a rule split on conntrack state (iptables.ctstate)
                rules[-1]["ct_part"] = r.ct_part
            if self.observing[i]:  # an observing rule the fast path leaves to mirror copies
                rules[-1]["observing"] = True
            if ent is not None and self.mirror[ent]:
                rules[-1]["mirror"] = True
        out = {
            "source": pol.source,
            "base_chain": pol.base_chain,
            "default": pol.default,
            "mode": self.mode,
            "policy_hash": self.policy_hash,
            "rules": len(pol.rules),
            "simple": len(pol.simple_indices),
            "complex": len(pol.complex_indices),
            "entries": self.n,
            "shunt_vector": self.shunt_string(),
            "shunting_entries": int(self.shunt[:-1].sum()),
            "policy_entry_shunted": bool(self.shunt[-1]),
            "intervals": self.num_intervals,
            "chains": {str(k): list(v) for k, v in sorted(self.chains.items())},
            "geo_chains": {str(k): list(v) for k, v in sorted(self.geo_chains.items())},
            "partition": rules,
        }
        if self.family != 4:  # an IPv6 plan: its entries hold address ranks (addr_map; IPv4 reports as they were)
            out["family"] = self.family
            out["address_ranks"] = {d: len(v) for d, v in self.addr_map.starts.items()}
        if any(self.miss_shunt):  # (only then, so that reports of policies without conntrack stay as they were)
            out["miss_shunt"] = {"accept": bool(self.miss_shunt[0]), "drop": bool(self.miss_shunt[1])}
            # the shunt bits for frames no conntrack entry holds (ct 3, the xdp target's lookup)
            out["shunt_vector_no_entry"] = "".join("1" if b else "0" for b in self.shunt_none)
        if self.observing.any():  # log mirroring (only then, as above)
            out["observing_rules"] = [int(i) for i in np.flatnonzero(self.observing)]
            out["mirror_vector"] = "".join("1" if b else "0" for b in self.mirror)
            out["mirroring_entries"] = int(self.mirror[:-1].sum())
            out["policy_entry_mirrored"] = bool(self.mirror[-1])
        return out


MIRROR_BIT = C["HF_ACTION_MIRROR_BIT"]  # 0x8 in the ACTION table word: the entry's decided frames are mirrored


def action_words(plan) -> list[int]:
    """ACTION table words of any plan (Plan, hw.vhdl.HwPlan): the action code, | 0x8 (HF_ACTION_MIRROR_BIT) where
    `plan.mirror` is set; a plan without `mirror` mirrors nothing."""
    mirror = getattr(plan, "mirror", None)
    words = [int(a) & 0x7 for a in plan.actions]
    if mirror is not None:
        words = [w | (MIRROR_BIT if m else 0) for w, m in zip(words, mirror, strict=True)]
    return words


def forced_entries(entries, actions: np.ndarray, miss_shunt: tuple[bool, bool]) -> np.ndarray:
    """bool [n + 1]: the entries whose frames miss forcing shunts: with ct 0 (the flow cache does not know them) an
    entry whose verdict `miss_shunt` names, with ct 3 (no conntrack entry: NEW or INVALID) an ACCEPT entry when
    ACCEPT is forced, since conntrack must create the entry of a NEW frame the policy accepts. An entry whose boxes
    reach neither never gets such a frame (the policy entry may)."""
    accept, drop = miss_shunt
    at0 = ((actions == ACTION_ACCEPT) & accept) | ((actions == ACTION_DROP) & drop)
    at3 = (actions == ACTION_ACCEPT) & accept
    out = at0 | at3
    if out.any():
        for j, e in enumerate(entries):
            if out[j]:
                out[j] = (at0[j] and any(b.lo[CT] == CT_UNKNOWN for b in e.boxes)) or (
                    at3[j] and any(b.lo[CT] <= CT_NONE <= b.hi[CT] for b in e.boxes)
                )
    return out


def ranked(policy: Policy) -> Policy:
    """The policy itself, or for an IPv6 policy not yet ranked its ranked form (ir.family.compress): what the numpy
    analysis takes (same rules, same positions)."""
    if policy.family == 4 or policy.addr_map is not None:
        return policy
    from hypafilter.ir.family import compress

    return compress(policy)[0]


def rule_boxset(policy: Policy, positions) -> BoxSet:
    """The boxes of the given rules, owner = rule position."""
    pos = list(positions)
    return BoxSet.from_unions([policy.rules[i].boxes for i in pos], owners=pos)


def at_ct(bs: BoxSet, value: int | None) -> BoxSet:
    """The boxes of `bs` cut to the plane ct = value (boxes that do not reach it left out); None: `bs` itself."""
    if value is None:
        return bs
    keep = (bs.lo[:, CT] <= value) & (bs.hi[:, CT] >= value)
    lo, hi = bs.lo[keep].copy(), bs.hi[keep].copy()
    lo[:, CT] = value
    hi[:, CT] = value
    return BoxSet(lo, hi, bs.fmask[keep], bs.fval[keep], bs.owner[keep])


def selective_bits(policy: Policy, sources: list[int] | None = None, ct: int | None = None) -> np.ndarray:
    """Alg. 1 for every rule at once: bool[len(rules)], True for a simple rule met by an earlier complex reduction
    (`sources`: the complex rules to test, all of them by default; `ct`: only frames with that ct value)."""
    policy = ranked(policy)
    simple = policy.simple_indices
    cplx = policy.complex_indices if sources is None else sources
    out = np.zeros(len(policy.rules), dtype=bool)
    if not simple or not cplx:
        return out
    tg = at_ct(rule_boxset(policy, simple), ct)
    src = at_ct(rule_boxset(policy, cplx), ct)
    hits = geometry.any_intersection(tg, src, before=tg.owner)
    out[tg.owner[hits]] = True
    return out


def policy_entry_reachable(policy: Policy, sources: list[int] | None = None, ct: int | None = None) -> bool:
    """Can a complex rule's reduction reach the region no simple rule covers?

    A cheap, sound test: False only if every box of every complex rule lies inside one simple rule's box (then a
    packet in the reduction always matches a simple entry, so it never gets the policy entry). Empty reductions
    never match. `sources`: the complex rules to test, all of them by default; `ct`: only frames with that ct value.
    """
    policy = ranked(policy)
    cplx = policy.complex_indices if sources is None else sources
    if not cplx:
        return False
    src = at_ct(rule_boxset(policy, cplx), ct)
    if len(src) == 0:
        return False
    simple = at_ct(rule_boxset(policy, policy.simple_indices), ct)
    return not bool(geometry.contained_in_any(src, simple).all())


def miss_shunt_for(policy: Policy, config: Config) -> tuple[bool, bool]:
    """Plan.miss_shunt: which hardware verdicts a frame the flow cache does not know (ct = 0) must not get.

    Conntrack updates a connection in PREROUTING for every packet it sees, before any filter rule runs: an accepted
    packet it missed leaves the connection unknown, and a dropped one it missed leaves it behind (a dropped UDP
    reply still sets SEEN_REPLY, a dropped RST still closes a TCP connection). So in a policy that reads conntrack,
    no frame the fast path does not know is kept from conntrack. In host mode the hardware's ACCEPT is delivered to
    the host, whose conntrack sees it before INPUT: only the hardware's DROP would hide a frame. In bridge mode both
    would. A flow-cache hit (ct 1 or 2) belongs to a connection conntrack holds as established, which a frame the
    hardware decides leaves as it is (the sync service keeps the flow cache to conntrack's confirmed, established
    flows and removes a flow when conntrack destroys it)."""
    if not policy.reads_conntrack:
        return (False, False)
    if config.mode_for(policy.base_chain) == "host":
        return (False, True)
    return (True, True)


def build_plan(
    policy: Policy,
    config: Config | None = None,
    mode: str | None = None,
    strategy: str | None = None,
    live: bool = False,
) -> Plan:
    """The Plan of `policy` for shunting `mode` and software `strategy` (default: the config's). With mode index or
    selective and strategy interval, interval_geo or tree, observing rules (ir.semantics.observes) do not make entries
    shunt: an entry whose frames would reach one is mirrored instead (Plan.mirror). `live`: for a deployment that
    keeps the operator's chains (Plan.live); a base-chain rule with per-rule state then has one instance, the
    operator's, so an observing one is not mirrored (its copy would need it) but shunts like a deciding rule."""
    config = config or Config()
    mode = mode or config.shunt_mode
    strategy = strategy or config.strategy
    if mode not in MODES:
        raise HypafilterError(f"unknown shunting mode {mode!r} (choose index, selective or exact)")
    if strategy not in STRATEGIES:
        raise HypafilterError(f"unknown strategy {strategy!r} (choose {', '.join(STRATEGIES)})")
    t0 = time.perf_counter()
    policy = ranked(policy)  # an IPv6 policy: analysed on its address ranks (ir.family)
    rules = policy.rules
    cplx = policy.complex_indices
    mirroring = mirrors(mode, strategy)
    observing = np.zeros(len(rules), dtype=bool)
    if mirroring:
        for i in cplx:
            observing[i] = observes(rules[i]) and not (live and rules[i].stateful_pos is not None)
    deciding = [i for i in cplx if not observing[i]]  # the complex rules that can decide (all without mirroring)
    watching = [i for i in cplx if observing[i]]
    conflict = selective_bits(policy, deciding)
    first_deciding = deciding[0] if deciding else len(rules)
    first_watching = watching[0] if watching else len(rules)

    if mode == "exact":
        entries = [
            Entry(i, r.boxes, r.action_code if r.is_simple else ACTION_NONE, not r.is_simple)
            for i, r in enumerate(rules)
        ]
    else:
        entries = [Entry(i, r.boxes, r.action_code, False) for i, r in enumerate(rules) if r.is_simple]
    n = len(entries)
    shunt = np.zeros(n + 1, dtype=bool)
    mirror = np.zeros(n + 1, dtype=bool)  # before `& ~shunt`: some observing rule above may see the frame
    actions = np.zeros(n + 1, dtype=np.uint8)
    seen = selective_bits(policy, watching) if mode == "selective" and watching else None
    for j, e in enumerate(entries):
        actions[j] = e.action
        if mode == "index":
            shunt[j] = e.rule_index > first_deciding
            mirror[j] = e.rule_index > first_watching
        elif mode == "selective":
            shunt[j] = conflict[e.rule_index]
            mirror[j] = seen is not None and seen[e.rule_index]
        else:
            shunt[j] = e.is_complex
    actions[n] = policy.default_action_code
    if mode == "index":
        shunt[n] = bool(deciding)
        mirror[n] = bool(watching)
    elif mode == "selective":
        shunt[n] = policy_entry_reachable(policy, deciding)
        mirror[n] = bool(watching) and policy_entry_reachable(policy, watching)
    shunt_none = _shunt_none(policy, mode, entries, shunt, mirror, deciding) if policy.reads_conntrack else None
    mirror &= ~shunt
    miss_shunt = miss_shunt_for(policy, config)

    interval = np.zeros(n + 1, dtype=np.uint32)
    chains: dict[int, list[int]] = {}
    groups: dict[int, list[int]] = {}  # k -> entry indices
    k = 0
    prev_simple_pos = None
    for j, e in enumerate(entries):
        new_group = (
            e.is_complex
            or prev_simple_pos is None
            or any(not rules[p].is_simple for p in range(prev_simple_pos + 1, e.rule_index))
        )
        if new_group:
            k += 1
            groups[k] = []
            if mode == "exact":
                chains[k] = [] if not e.is_complex else [e.rule_index]
            else:
                chains[k] = PrefixView(cplx, bisect.bisect_left(cplx, e.rule_index))
        groups[k].append(j)
        interval[j] = k
        prev_simple_pos = None if e.is_complex else e.rule_index
    k += 1
    interval[n] = k
    groups[k] = [n]
    chains[k] = [] if mode == "exact" else PrefixView(cplx, len(cplx))

    if mode == "exact":
        _exact_chains(policy, entries, interval, chains)
    plan = Plan(
        policy=policy,
        mode=mode,
        entries=entries,
        shunt=shunt,
        actions=actions,
        interval=interval,
        policy_hash=policy.policy_hash(),
        conflict=conflict,
        chains=chains,
        groups=groups,
        entry_set=BoxSet.from_unions([e.boxes for e in entries]),
        miss_shunt=miss_shunt,
        shunt_none=shunt_none,
        mirror=mirror,
        observing=observing,
        strategy=strategy,
        live=live,
        buffer_depth=config.update_buffer,
        family=policy.family,
        addr_map=policy.addr_map,
        tree_min_segment=config.tree_min_segment,
    )
    plan.analysis_seconds = time.perf_counter() - t0
    return plan


def _shunt_none(policy: Policy, mode: str, entries: list[Entry], shunt, mirror, deciding: list[int]) -> np.ndarray:
    """Plan.shunt_none: the shunt bits for frames with ct 3 (no conntrack entry), by the same rule as `shunt` with
    every box cut to the plane ct = 3. One more exemption: the miss part of a DROP state rule (`-m conntrack
    --ctstate INVALID -j DROP`: pure state checks, no per-rule state) cannot change the verdict of a DROP entry or
    policy below it (it drops or lets the frame reach that DROP), so it does not make such an entry shunt. An entry
    that some observing rule above may see (`mirror` before it is masked by `shunt`) keeps its shunt bit: its frame
    must reach those rules, and without the bit it would be decided without a copy."""
    n = len(entries)
    if mode == "exact":
        return shunt.copy()
    reach = [i for i in deciding if any(b.lo[CT] <= CT_NONE <= b.hi[CT] for b in policy.rules[i].boxes)]
    drops = [i for i in reach if policy.rules[i].target == "DROP" and policy.rules[i].ct_part == "miss"]
    others = [i for i in reach if i not in set(drops)]
    is_drop = np.array([e.action == ACTION_DROP for e in entries] + [policy.default_action_code == ACTION_DROP])
    out = np.zeros(n + 1, dtype=bool)
    if mode == "index":
        first_all = reach[0] if reach else len(policy.rules)
        first_others = others[0] if others else len(policy.rules)
        for j, e in enumerate(entries):
            out[j] = e.rule_index > (first_others if is_drop[j] else first_all)
        out[n] = bool(others) if is_drop[n] else bool(reach)
    else:
        c_all = selective_bits(policy, reach, ct=CT_NONE)
        c_others = selective_bits(policy, others, ct=CT_NONE) if drops else c_all
        for j, e in enumerate(entries):
            out[j] = (c_others if is_drop[j] else c_all)[e.rule_index]
        out[n] = policy_entry_reachable(policy, others if is_drop[n] else reach, ct=CT_NONE)
    return shunt & (out | mirror)


def _exact_chains(policy: Policy, entries: list[Entry], interval: np.ndarray, chains: dict[int, list[int]]) -> None:
    """For each complex entry c: c itself, then every later rule whose boxes meet c's reduction."""
    cx = [j for j, e in enumerate(entries) if e.is_complex]
    if not cx:
        return
    n_rules = len(policy.rules)
    tg = BoxSet.from_unions([entries[j].boxes for j in cx], owners=[entries[j].rule_index for j in cx])
    # Owners negated so that "owner < before" selects the rules *after* the complex rule.
    src = rule_boxset(policy, range(n_rules))
    src.owner = -src.owner
    later = geometry.intersecting_owners(tg, src, before=-tg.owner)
    per_rule: dict[int, set[int]] = {}
    for owner, hit in zip(tg.owner, later, strict=True):
        per_rule.setdefault(int(owner), set()).update((-hit).tolist())
    for j in cx:
        c = entries[j].rule_index
        chains[int(interval[j])] = [c] + sorted(per_rule.get(c, ()))


def _geo_chains(policy, entries, shunt, interval, chains, groups) -> dict[int, list[int]]:
    """chains[k] restricted to complex rules whose reduction meets a box of group k that delivers anything to
    software (`shunt`: Plan.delivers: a shunted or forced frame, or a mirror copy, all of which run chain k)."""
    n = len(entries)
    geo: dict[int, list[int]] = {}
    cplx = policy.complex_indices
    tg_unions, tg_owner = [], []
    for k, members in groups.items():
        geo[k] = []
        if members == [n]:
            geo[k] = list(chains[k])  # the policy entry's region is a complement: keep every complex rule
            continue
        for j in members:
            if shunt[j]:
                tg_unions.append(entries[j].boxes)
                tg_owner.append(k)
    if not tg_unions or not cplx:
        return geo
    tg = BoxSet.from_unions(tg_unions, owners=tg_owner)
    first_pos = {k: entries[m[0]].rule_index for k, m in groups.items() if m != [n]}
    before = np.array([first_pos[int(k)] for k in tg.owner], dtype=np.int64)
    hits = geometry.intersecting_owners(tg, rule_boxset(policy, cplx), before=before)
    acc: dict[int, set[int]] = {}
    for k, h in zip(tg.owner, hits, strict=True):
        acc.setdefault(int(k), set()).update(h.tolist())
    for k, s in acc.items():
        geo[k] = sorted(s)
    return geo
