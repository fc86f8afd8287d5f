"""Counter collection for the dashboard: a Snapshot of every counter at one time, rates as snapshot differences.

A `Collector` reads the deployed system (deploy state, the NIC's counters and per-entry hits through its
target's counter source: the emulated NIC's registers and HITS table, the XDP program's per-CPU maps; the tool's
netfilter chains through `iptables-save -c`, and `ops.deploy.drift`) into an immutable `Snapshot`; a `Sampler` thread takes one
every interval and keeps the last N in a ring buffer. The collector also keeps `Totals`: counters accumulated from
the differences of the sources, so they only go up for the life of the process (a NIC restart, a new generation's
chains or an undeploy does not take them back). Everything the web app shows is computed from those snapshots, so
the app can be tested on recorded snapshots and the collector's arithmetic on its own.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import re
import shlex
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hypafilter import netns, targets
from hypafilter.analysis.plan import build_plan
from hypafilter.analysis.program import build_program, twins
from hypafilter.config import Config
from hypafilter.errors import HypafilterError
from hypafilter.iptables.document import parse_policy
from hypafilter.ops import deploy
from hypafilter.ops.flowsync.service import SERVICE as FLOWSYNC
from hypafilter.ops.policysync.service import SERVICE as POLICYSYNC

# Hardware counters (hw/regmap.txt) and the (path, reason) labels they carry in /api and /metrics. Every target's
# counter source (targets.base.CounterSource) reports these names with these meanings: the emulated NIC's registers,
# the XDP program's per-CPU counters (a name a target lacks reads 0: the fast path has no FIFO to overflow).
HW_COUNTERS: dict[str, tuple[str, str]] = {
    "CNT_FORWARDED": ("forwarded", ""),
    "CNT_DROPPED": ("dropped", ""),
    "CNT_DROP_UNFILTERABLE": ("dropped", "unfilterable"),  # netfilter cannot filter it (Config.unfilterable)
    "CNT_SHUNT_OVERRULE": ("shunted", "overrule"),
    "CNT_SHUNT_POLICY": ("shunted", "policy"),
    "CNT_SHUNT_UNPARSED": ("shunted", "unparsed"),
    "CNT_SHUNT_STATE": ("shunted", "state"),  # reason 3: a flow-cache miss forced to conntrack (CONTROL bits 4/5)
    "CNT_SHUNT_FORCED": ("shunted", "forced"),
    "CNT_FROM_HOST": ("from_host", ""),
    "CNT_FIFO_DROP": ("fifo_drop", ""),
    # log mirroring: frames the hardware decided (also counted as forwarded or dropped) whose entry has the mirror
    # bit, so the host got the frame or a copy with metadata reason 4 "mirror"
    "CNT_MIRROR": ("mirrored", "mirror"),
}
SHUNT_REASONS: tuple[str, ...] = ("overrule", "policy", "unparsed", "state", "forced")
# A forced shunt (CONTROL "shunt everything") is also counted under its reason (overrule or policy) by the core,
# so the total of shunted frames is the sum of the four reasons; "forced" is a subset shown on its own.
SHUNT_TOTAL_COUNTERS: tuple[str, ...] = (
    "CNT_SHUNT_OVERRULE",
    "CNT_SHUNT_POLICY",
    "CNT_SHUNT_UNPARSED",
    "CNT_SHUNT_STATE",
)
# Every frame from the wire is counted in exactly one of these (docs/hardware.md): (decision, reason) per counter.
# Forced shunts are a subset of overrule/policy, mirrored frames of forwarded/dropped, from-host frames and FIFO
# drops are not decisions on wire frames.
WIRE_DECISIONS: dict[str, tuple[str, str]] = {
    c: (d, r or "rule")
    for c, (d, r) in HW_COUNTERS.items()
    if d in ("forwarded", "dropped", "shunted") and r != "forced"
}
# Deploys and updates take from well under a second (cached build, table rewrite) to minutes (cold emulator build).
UPDATE_BUCKETS: tuple[float, ...] = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)

HF_RULE_COMMENT = re.compile(r"\bhf:rule=(\d+)\b")


@dataclass(frozen=True)
class RuleInfo:
    """One rule of the deployed (flattened) policy, as the per-rule view needs it."""

    index: int
    text: str
    where: str
    target: str
    simple: bool
    entry: int | None  # hardware entry whose HITS counter counts this rule's first matches (None: no entry)
    shunt: bool | None  # that entry may shunt: its shunt bit, or miss forcing (Plan.may_shunt; None without an entry)
    counts_hw: bool = True  # its hardware first-matches are its hits (False: software re-counts shunted ones)
    id: str = ""  # stable identity (rule_ids): the same rule keeps it when rules are inserted above it
    chain: str = ""  # the chain it is written in


@dataclass(frozen=True)
class Update:
    """One deploy/update/undeploy from the deploy journal."""

    generation: int
    kind: str
    started: float  # Unix time
    duration: float  # seconds
    ok: bool = True
    policy_hash: str = ""
    policy: str = ""
    error: str = ""
    steps: tuple[tuple[str, float], ...] = ()  # (step, seconds) in order


@dataclass(frozen=True)
class Deployment:
    """What is deployed: generation, policy, partition and the update history."""

    generation: int
    policy_hash: str = ""
    policy: str = ""
    target: str = ""
    mode: str = ""
    strategy: str = ""
    default: str = ""
    prefix: str = "HF1_"  # every netfilter chain of this generation starts with it (docs/internals.md)
    netns: str = "hf-fw"
    table: str = "filter"
    n_entries: int = 0  # hardware entries without the policy entry
    policy_shunt: bool | None = None  # the policy entry's shunt bit
    rules: tuple[RuleInfo, ...] = ()
    history: tuple[Update, ...] = ()
    nic: str = ""  # where the NIC's counters are (emulator control socket, XDP program's pins)
    nic_id: str = ""  # which NIC process or program: a new one counts from 0
    nic_info: dict = field(default_factory=dict, compare=False)  # the target's info on the NIC (deploy state "nic")
    positions: dict[tuple[str, int], int] = field(default_factory=dict, compare=False)  # see rule_positions
    # chains of this generation the kernel holds under an earlier generation's name (a follow loads only the chains
    # that changed: docs/optimize.md, "What a follow loads"): {name in the kernel: name in this generation}
    aliases: dict[str, str] = field(default_factory=dict, compare=False)

    @property
    def partition(self) -> dict[str, int]:
        simple = sum(1 for r in self.rules if r.simple)
        return {
            "rules": len(self.rules),
            "simple": simple,
            "complex": len(self.rules) - simple,
            "hardware_entries": self.n_entries,
            "shunting_entries": sum(1 for r in self.rules if r.shunt) + (1 if self.policy_shunt else 0),
        }


@dataclass(frozen=True)
class Snapshot:
    """All counters of the deployed system at one time. Counters are cumulative; rates come from differences."""

    seq: int
    time: float  # Unix time
    mono: float  # monotonic clock, for rates
    deployment: Deployment | None
    hw: dict[str, int] = field(default_factory=dict)  # CNT_* register -> value
    hits: tuple[int, ...] = ()  # HITS table, entry 0..n (n = policy entry)
    nf: dict[int, tuple[int, int]] = field(default_factory=dict)  # policy rule index -> (packets, bytes)
    nf_main: tuple[int, int] = (0, 0)  # packets/bytes that entered the tool's MAIN chain (shunted + k = 0)
    errors: tuple[str, ...] = ()
    drift: tuple[str, ...] | None = None  # ops.deploy.drift of this deployment (None: not checked yet)
    totals: Totals | None = None  # counters accumulated by the collector up to this snapshot
    flowsync: dict = field(default_factory=dict)  # the flow sync service (ops.daemon.Service.status); {}: not deployed
    # the policy sync service (its status: following, counters, lags) and the update buffer's use {used, depth}
    policysync: dict = field(default_factory=dict)

    @property
    def generation(self) -> int | None:
        return self.deployment.generation if self.deployment else None

    def shunted(self) -> int:
        return sum(self.hw.get(c, 0) for c in SHUNT_TOTAL_COUNTERS)

    def classified(self) -> int:
        return self.hw.get("CNT_FORWARDED", 0) + self.hw.get("CNT_DROPPED", 0) + self.shunted()


@dataclass(frozen=True)
class Totals:
    """Counters for the life of the collector: accumulated differences of the sources, never going down.

    hw: CNT_* name -> frames. rule_hw / rule_nf: rule id -> hardware first matches / netfilter packets.
    updates: (kind, result) -> journal entries seen. update_buckets: successful updates per UPDATE_BUCKETS bound.
    """

    hw: dict[str, int] = field(default_factory=dict)
    rule_hw: dict[str, int] = field(default_factory=dict)
    rule_nf: dict[str, int] = field(default_factory=dict)
    policy_entry: int = 0
    nf_main: int = 0
    updates: dict[tuple[str, str], int] = field(default_factory=dict)
    update_buckets: tuple[int, ...] = (0,) * len(UPDATE_BUCKETS)
    update_count: int = 0
    update_sum: float = 0.0
    flowsync: dict[str, int] = field(default_factory=dict)  # FLOWSYNC_COUNTERS name -> events of the service


# The flow sync service's counters (docs/flowsync.md): accumulated per service process like the NIC's.
FLOWSYNC_COUNTERS = ("inserts", "deletes", "evictions", "insert_failures", "refreshes", "events", "errors")


class Accumulator:
    """Totals of counters read from sources that restart: each reading adds its increase since the source's last
    reading, or its whole value when it went down (the source restarted from 0) or is new, as Prometheus' rate()
    reads a reset. A source belongs to a group (one NIC process, one generation's chains): when the group changes
    the previous group's readings are forgotten, so the new group's counters count from 0."""

    def __init__(self):
        self.totals: dict[Hashable, int] = {}
        self._group: Hashable = None
        self._last: dict[Hashable, int] = {}

    def observe(self, group: Hashable, readings: Iterable[tuple[Hashable, Hashable, int]]) -> None:
        """readings: (key of the total, source, cumulative value of the source)."""
        if group != self._group:
            self._group, self._last = group, {}
        last, totals = self._last, self.totals
        for key, source, value in readings:
            old = last.get(source)
            last[source] = value
            inc = value - old if old is not None and value >= old else value
            if inc:
                totals[key] = totals.get(key, 0) + inc
            elif key not in totals:
                totals[key] = 0


def counter_delta(old: int, new: int) -> int:
    """Increase of a cumulative counter; a smaller new value means it restarted (new NIC, cleared) from 0."""
    return new - old if new >= old else new


@dataclass(frozen=True)
class Rates:
    """Per-second rates between two snapshots."""

    time: float  # Unix time of the later snapshot
    seconds: float
    hw: dict[str, float]  # CNT_* -> frames/s
    shunted: float
    classified: float
    nf_main: float
    valid: bool = True  # False when either snapshot lacks hardware counters

    @property
    def shunt_ratio(self) -> float | None:
        return self.shunted / self.classified if self.classified > 0 else None


def rates(prev: Snapshot, cur: Snapshot) -> Rates:
    dt = cur.mono - prev.mono
    if dt <= 0:
        raise ValueError("snapshots must be in time order")
    # A snapshot whose NIC read failed has no counters: no rate rather than a spike when the NIC comes back.
    valid = bool(prev.hw) and bool(cur.hw)
    hw = {c: counter_delta(prev.hw.get(c, 0), cur.hw.get(c, 0)) / dt if valid else 0.0 for c in HW_COUNTERS}
    shunted = sum(hw[c] for c in SHUNT_TOTAL_COUNTERS)
    classified = hw["CNT_FORWARDED"] + hw["CNT_DROPPED"] + shunted
    nf_main = counter_delta(prev.nf_main[0], cur.nf_main[0]) / dt
    return Rates(cur.time, dt, hw, shunted, classified, nf_main, valid)


# --- netfilter -----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class NfRule:
    """One rule line of `iptables-save -c`."""

    chain: str
    position: int  # 1-based within its chain, as `iptables -L --line-numbers`
    packets: int
    bytes: int
    tokens: tuple[str, ...]  # after `-A CHAIN`

    @property
    def target(self) -> str:
        for flag in ("-j", "-g"):
            if flag in self.tokens:
                i = self.tokens.index(flag)
                if i + 1 < len(self.tokens):
                    return self.tokens[i + 1]
        return ""

    @property
    def rule_tag(self) -> int | None:
        """The policy rule index from an `hf:rule=<i>` comment the compiler puts on emitted rules, if any."""
        for i, tok in enumerate(self.tokens[:-1]):
            if tok == "--comment":
                m = HF_RULE_COMMENT.search(self.tokens[i + 1])
                if m:
                    return int(m.group(1))
        return None


_COUNTED = re.compile(r"^\[(\d+):(\d+)\]\s+-A\s+(\S+)\s*(.*)$")


def parse_iptables_save(text: str, table: str = "filter") -> list[NfRule]:
    """Rules with counters of one table from `iptables-save -c` output."""
    out: list[NfRule] = []
    current = None
    positions: dict[str, int] = {}
    for lineno, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if line.startswith("*"):
            current = line[1:]
            positions = {}
            continue
        if current != table or not line.startswith("["):
            continue
        m = _COUNTED.match(line)
        if not m:
            raise HypafilterError(f"iptables-save -c:{lineno}: cannot read counters of {line!r}")
        chain = m.group(3)
        positions[chain] = positions.get(chain, 0) + 1
        rest = m.group(4)
        try:
            # shlex only where quoting can change the split: it is most of the cost at 50,000 rules.
            tokens = tuple(shlex.split(rest) if '"' in rest or "'" in rest or "\\" in rest else rest.split())
        except ValueError as e:
            raise HypafilterError(f"iptables-save -c:{lineno}: {e}") from e
        out.append(NfRule(chain, positions[chain], int(m.group(1)), int(m.group(2)), tokens))
    return out


def attribute_netfilter(
    rules: Iterable[NfRule],
    prefix: str,
    n_policy_rules: int,
    positions: dict[tuple[str, int], int] | None = None,
    aliases: dict[str, str] | None = None,
) -> tuple[dict[int, tuple[int, int]], tuple[int, int]]:
    """Netfilter counters of one generation's chains (names starting with `prefix`, and those it keeps under an
    earlier name: `aliases`, {name in the kernel: name in the generation}) per policy rule, and what entered its MAIN
    chain.

    `positions` maps (chain, position) to the policy rule whose matches that rule line counts (rule_positions).
    Rules carrying an `hf:rule=<i>` comment count for rule i instead, when the emitter writes such comments; a
    jump into a chain that holds rules tagged i is then not counted again.
    """
    if aliases:
        rules = [dataclasses.replace(r, chain=aliases[r.chain]) if r.chain in aliases else r for r in rules]
    mine = [r for r in rules if r.chain.startswith(prefix)]
    tags_in: dict[str, set[int]] = {}
    for r in mine:
        if r.rule_tag is not None:
            tags_in.setdefault(r.chain, set()).add(r.rule_tag)
    per_rule: dict[int, tuple[int, int]] = {}

    def add(i: int, r: NfRule) -> None:
        if 0 <= i < n_policy_rules:
            p, b = per_rule.get(i, (0, 0))
            per_rule[i] = (p + r.packets, b + r.bytes)

    for r in mine:
        if tags_in:
            tag = r.rule_tag
            if tag is not None and tag not in tags_in.get(r.target, ()):
                add(tag, r)
        elif positions and (r.chain, r.position) in positions:
            add(positions[(r.chain, r.position)], r)
    main = f"{prefix}MAIN"
    entered = [r for r in rules if r.target == main and not r.chain.startswith(prefix)]
    return per_rule, (sum(r.packets for r in entered), sum(r.bytes for r in entered))


def iptables_save(ns: str | None, table: str = "filter") -> str:
    """The table with counters. The timeout bounds a stuck xtables lock; it is generous because the dump of a
    50,000-rule table takes seconds on the nftables backend (and runs on the per-rule thread, not in a snapshot)."""
    return netns.run(["iptables-save", "-c", "-t", table], ns, timeout=60)


# --- deploy state --------------------------------------------------------------------------------------------


def history_from_state(state: dict) -> tuple[Update, ...]:
    """The deploy journal; its `time` is when a step ended, so the start is time - duration."""
    out = []
    for h in state.get("history") or []:
        result = h.get("result", "ok")
        duration = float(h.get("duration_s") or 0.0)
        kind = h.get("kind") or ("undeploy" if result == "undeployed" else "update")
        out.append(
            Update(
                generation=int(h.get("generation") or 0),
                kind=str(kind),
                started=float(h.get("time") or 0.0) - duration,
                duration=duration,
                ok=result in ("ok", "undeployed"),
                policy_hash=str(h.get("policy_hash") or ""),
                policy=str(h.get("policy_source") or ""),
                error=str(h.get("error") or "; ".join(h.get("errors") or [])),
                steps=tuple((str(k), float(v)) for k, v in (h.get("steps") or {}).items()),
            )
        )
    return tuple(out)


def deployed_policy(state: dict):
    """The deployed Policy, re-read from its file when that still holds the deployed policy (so the per-rule
    view shows file:line), else from the original rules the state keeps (`plain_rules`); checked by hash."""
    want = state.get("policy_hash", "")
    base = state.get("base_chain", "FORWARD")
    source = state.get("policy_source", "")
    config = deploy.state_config(state, plan=True)
    if source and Path(source).is_file():
        try:
            policy = parse_policy(
                Path(source).read_text(), filename=source, base_chain=base, config=config, allow_empty=True
            )
            if policy.policy_hash() == want:
                return policy
        except HypafilterError:
            pass  # the file changed since the deploy: fall back to the deployed text
    # Whether an empty policy was allowed was decided by the deploy (--allow-empty); what is deployed is shown.
    text = state.get("plain_rules")
    if text is None:
        raise HypafilterError(f"deploy state has no rules of the deployed policy and {source or 'its file'} differs")
    policy = parse_policy(
        text, filename=f"{source or 'deployed'} (as deployed)", base_chain=base, config=config, allow_empty=True
    )
    if want and policy.policy_hash() != want:
        raise HypafilterError("the deployed rules in the state file do not hash to the deployed policy hash")
    return policy


def rule_positions(program) -> dict[tuple[str, int], int]:
    """(chain, 1-based position) of the netfilter rule whose counter counts the matches of each policy rule.

    Follows netfilter.render_iptables: a policy rule is one line in its chain, except multi-level or guarded
    rules, whose matches are counted by the last line of their helper chain R<i>L<last>. The verbatim FULL chain
    maps line by line only when no user chain was flattened into the base chain.
    """
    pol = program.policy
    pos: dict[tuple[str, int], int] = {}
    for name, rules in program.chains.items():
        if name == program.verbatim_full:
            # The two parts of a rule split on conntrack state (consecutive) are one line there: its first part.
            firsts = [i for i in range(len(pol.rules)) if not twins(pol, i - 1, i)]
            if not pol.user_chains and len(pol.original_rules) == len(firsts):
                pos.update({(name, j + 1): i for j, i in enumerate(firsts)})
            continue
        for p, r in enumerate(rules, 1):
            if r.kind != "policy":
                continue
            levels = pol.rules[r.index].levels
            if len(levels) == 1 and not levels[0].unless:
                pos[(name, p)] = r.index
            else:
                pos[(program.name(f"R{r.index}L{len(levels)}"), len(levels[-1].unless) + 1)] = r.index
    return pos


def rule_ids(policy) -> list[str]:
    """A stable identity per flattened rule: a short hash of its chain, the canonical options of every level it
    came through and its target, so inserting or removing other rules does not rename it. A rule written twice
    the same way in one chain gets .2, .3, ... in order. The two parts of a rule split on conntrack state
    (Rule.ct_part) are told apart by their part."""
    out = []
    seen: dict[str, int] = {}
    for r in policy.rules:
        chain = r.origin.chain if r.origin else policy.base_chain
        if r.levels:
            levels = [" ".join(lv.options) + "".join(" !(" + " ".join(u) + ")" for u in lv.unless) for lv in r.levels]
            text = " > ".join(levels) + " -j " + " ".join((r.target, *r.target_args))
        else:
            text = r.origin.text if r.origin else r.target
        if r.ct_part:
            text += f" [ct {r.ct_part}]"
        h = hashlib.sha256(f"{policy.base_chain}|{chain}|{text}".encode()).hexdigest()[:12]
        n = seen[h] = seen.get(h, 0) + 1
        out.append(h if n == 1 else f"{h}.{n}")
    return out


def deployment_from_state(state: dict) -> Deployment:
    """Everything the views need about the deployment: rules with their entries and shunt bits, positions."""
    policy = deployed_policy(state)
    config = deploy.state_config(state, plan=True)
    plan = build_plan(policy, config)
    prefix = state.get("prefix") or f"{config.chain_prefix}{state['generation']}_"
    program = build_program(plan, config.strategy, prefix, config.mark_mask, config.mark_shift, config.nic_mode)
    # Rules that shunted traffic meets again in software: there netfilter counts their matches, so the hardware
    # first-match count must not be added on top. Under "full" every shunted packet runs the verbatim FULL chain.
    recounted = set(range(len(policy.rules))) if config.strategy == "full" else set()
    recounted |= {
        i
        for name, rules in program.chains.items()
        if name != program.verbatim_full
        for r in rules
        if r.kind == "policy"
        for i in range(r.index, r.index + r.span)
    }
    entry_of: dict[int, int] = {}
    for e, entry in enumerate(plan.entries):
        entry_of.setdefault(int(entry.rule_index), e)
    rules = []
    ids = rule_ids(policy)
    may = plan.may_shunt  # frames forced to software on a flow-cache miss meet the rule there again too
    for i, r in enumerate(policy.rules):
        e = entry_of.get(i)
        shunt = bool(may[e]) if e is not None else None
        where = f"{r.origin.file}:{r.origin.line}" if r.origin else ""
        text = (
            r.origin.text if r.origin else " ".join((*r.levels[-1].options, "-j", r.target)) if r.levels else r.target
        )
        counts_hw = e is not None and not (shunt and i in recounted)
        chain = r.origin.chain if r.origin else policy.base_chain
        rules.append(RuleInfo(i, text.strip(), where, r.target, r.is_simple, e, shunt, counts_hw, ids[i], chain))
    n = len(plan.entries)
    expected = (state.get("partition") or {}).get("entries")
    if expected is not None and expected != n:
        raise HypafilterError(
            f"re-planned policy has {n} hardware entries, the deployed one {expected} "
            "(deployed with a site configuration the state file does not record?)"
        )
    return Deployment(
        generation=int(state["generation"]),
        policy_hash=str(state.get("policy_hash", "")),
        policy=str(state.get("policy_source", "")),
        target=str(state.get("target", "")),
        mode=config.shunt_mode,
        strategy=config.strategy,
        default=policy.default,
        prefix=prefix,
        aliases={v: k for k, v in (state.get("chains_kept") or {}).items()},
        netns=str((state.get("shim") or {}).get("netns", "hf-fw")),
        table=config.table,
        n_entries=n,
        policy_shunt=bool(may[n]),
        rules=tuple(rules),
        history=history_from_state(state),
        nic=nic_location(state),
        nic_id=nic_identity(state),
        nic_info=dict(state.get("nic") or {}),
        positions=rule_positions(program),
    )


def nic_location(state: dict) -> str:
    """Where the deployed NIC's counters are: the emulator's control socket, the XDP program's pin directory."""
    nic = state.get("nic") or {}
    return str(nic.get("socket") or nic.get("pin") or "")


def nic_identity(state: dict) -> str:
    nic = state.get("nic") or {}
    return f"{nic_location(state)}#{nic.get('pid', '')}"


def partial_deployment(state: dict) -> Deployment:
    """Generation and history when the deployed policy cannot be re-read (the error is shown beside it)."""
    gen = int(state.get("generation") or 0)
    return Deployment(
        generation=gen,
        policy_hash=str(state.get("policy_hash", "")),
        policy=str(state.get("policy_source", "")),
        target=str(state.get("target", "")),
        mode=str(state.get("mode", "")),
        strategy=str(state.get("strategy", "")),
        prefix=state.get("prefix") or f"{state.get('chain_prefix', 'HF')}{gen}_",
        netns=str((state.get("shim") or {}).get("netns", "hf-fw")),
        table=str(state.get("table", "filter")),
        history=history_from_state(state),
        nic=nic_location(state),
        nic_id=nic_identity(state),
        nic_info=dict(state.get("nic") or {}),
    )


# --- the collector -------------------------------------------------------------------------------------------


def open_nic(deployment: Deployment) -> Any:
    """The deployed NIC's counter source (targets.base.CounterSource: counters(), hits(count), close()), from the
    target the deployment runs on (deploy state "target"; older states: the emulated NIC)."""
    if not deployment.nic:
        raise HypafilterError("the deploy state names no NIC")
    target = targets.get(deployment.target or "emu", Config())
    return target.counter_source(deployment.nic_info, timeout=5.0)


def read_flowsync(state: dict) -> dict:
    """The flow sync service of the deployment in `state` as `hypafilter status` shows it ({} for a deployment
    that never recorded one)."""
    if "flowsync" not in state:
        return {}
    return FLOWSYNC.status(deploy.STATE_DIR, state.get("flowsync"))


def read_policysync(state: dict) -> dict:
    """The policy sync service of the deployment in `state` as `hypafilter status` shows it, with the update
    buffer's use (`buffer`: slots used and the matcher's depth; None without a buffer) and the fast path's lease
    (`lease`: armed, expired, left_ms, and the deployment's length `want_ms`; None when it cannot be read)."""
    if "policysync" not in state:
        return {}
    out = POLICYSYNC.status(deploy.STATE_DIR, state.get("policysync"))
    ov = state.get("overlay")
    out["buffer"] = {"used": len(ov["slots"]), "depth": ov["depth"]} if ov else None
    try:
        lease = deploy.target_of(state, deploy.state_config(state)).lease(state["nic"])
        out["lease"] = {**lease, "want_ms": int(state.get("lease_ms") or 0)}
    except Exception:  # a NIC gone or unreachable: drift says so
        out["lease"] = None
    return out


def check_drift(state: dict) -> list[str]:
    """What `hypafilter status` reports as drift (one implementation: ops.deploy.drift)."""
    return deploy.drift(state)


class Collector:
    """Takes Snapshots of the deployed system. The readers are parameters so each can be replaced in tests.

    Drift is checked every `drift_every` seconds (and at once when the deployment changes) on a thread of its
    own (`drift_async`), so a slow check (iptables-save of a large rule set, the shim's maps) delays no snapshot.
    """

    def __init__(
        self,
        state_reader: Callable[[], dict | None] = deploy.read_state,
        nic_opener: Callable[[Deployment], Any] = open_nic,
        nf_reader: Callable[[str, str], str] = iptables_save,
        deployment_builder: Callable[[dict], Deployment] = deployment_from_state,
        drift_checker: Callable[[dict], list[str]] | None = check_drift,
        drift_every: float = 2.0,
        drift_async: bool = True,
        rules_async: bool = False,
        flowsync_reader: Callable[[dict], dict] = read_flowsync,
        policysync_reader: Callable[[dict], dict] = read_policysync,
    ):
        self._flowsync_reader = flowsync_reader
        self._policysync_reader = policysync_reader
        self._fs = Accumulator()
        self._state_reader = state_reader
        self._nic_opener = nic_opener
        self._nf_reader = nf_reader
        self._builder = deployment_builder
        self._drift_checker = drift_checker
        self._drift_every = drift_every
        self._drift_async = drift_async
        # Per-rule sources (HITS table, iptables-save of every chain) on a thread of their own: at 50,000 rules
        # they take seconds, the traffic counters microseconds. A snapshot carries their newest reading.
        self._rules_async = rules_async
        self._rules_thread: threading.Thread | None = None
        self._rules_reading: tuple | None = None  # (deployment key, seq, hits, nf, nf_main, nf_ok, errors)
        self._rules_seq = 0
        self._rules_used = -1
        self._rules_nic: Any = None
        self._drift: tuple[tuple | None, tuple[str, ...]] | None = None  # (state key it was checked for, result)
        self._drift_at = -1e18
        self._drift_for: tuple | None = None
        self._drift_thread: threading.Thread | None = None
        self._dep_key: tuple | None = None
        self._dep: Deployment | None = None
        self._dep_error: str | None = None
        self._nic: Any = None
        self._nic_for: tuple | None = None
        self._seq = 0
        self._lock = threading.Lock()
        self._hw = Accumulator()
        self._rule_hw = Accumulator()
        self._rule_nf = Accumulator()
        self._main = Accumulator()
        self._journal_seen = float("-inf")
        self._updates: dict[tuple[str, str], int] = {}
        self._buckets = [0] * len(UPDATE_BUCKETS)
        self._update_count = 0
        self._update_sum = 0.0

    def _deployment(self, errors: list[str]) -> tuple[Deployment | None, dict | None]:
        try:
            state = self._state_reader()
        except Exception as e:  # a broken reader must not stop the dashboard
            errors.append(f"deploy state: {e}")
            return self._dep, None
        if not state or not state.get("generation"):
            self._dep_key, self._dep, self._dep_error = None, None, None
            return None, state
        self._journal(state)
        # Re-planning is the expensive part: only when the deployment (or its journal) changed.
        history = state.get("history") or ()
        key = (
            state.get("generation"),
            state.get("policy_hash"),
            len(history),
            history[-1].get("time") if history else None,
        )
        if key != self._dep_key:
            try:
                self._dep, self._dep_error = self._builder(state), None
            except Exception as e:
                self._dep, self._dep_error = partial_deployment(state), f"deployed policy: {e}"
            self._dep_key = key
        if self._dep_error:
            errors.append(self._dep_error)
        return self._dep, state

    def _journal(self, state: dict) -> None:
        """Count the journal entries not seen before (the journal keeps 50; the counts keep going)."""
        newest = self._journal_seen
        for u, h in zip(history_from_state(state), state.get("history") or (), strict=True):
            t = float(h.get("time") or 0.0)
            if t <= self._journal_seen:
                continue
            newest = max(newest, t)
            key = (u.kind, "ok" if u.ok else "failed")
            self._updates[key] = self._updates.get(key, 0) + 1
            if u.ok and u.kind != "undeploy":
                self._update_count += 1
                self._update_sum += u.duration
                for i, bound in enumerate(UPDATE_BUCKETS):
                    if u.duration <= bound:
                        self._buckets[i] += 1
        self._journal_seen = newest

    def _check_drift(self, state: dict | None, dep: Deployment | None) -> tuple[str, ...] | None:
        if self._drift_checker is None or state is None or dep is None:
            return None
        key = self._dep_key
        due = time.monotonic() - self._drift_at >= self._drift_every or self._drift_for != key
        running = self._drift_thread is not None and self._drift_thread.is_alive()
        if due and not running:
            self._drift_at, self._drift_for = time.monotonic(), key

            def run() -> None:
                try:
                    found = tuple(self._drift_checker(state))
                except Exception as e:  # a check that cannot run says so as drift
                    found = (f"drift check: {e}",)
                self._drift = (key, found)

            if self._drift_async:
                self._drift_thread = threading.Thread(target=run, name="hypafilter-drift", daemon=True)
                self._drift_thread.start()
            else:
                run()
        if self._drift is None or self._drift[0] != key:
            return None  # not checked yet for this deployment
        return self._drift[1]

    def _accumulate(self, dep: Deployment | None, hw: dict, hits: tuple, nf: dict, nf_main: tuple[int, int]) -> Totals:
        if dep is not None and hw:
            self._hw.observe(dep.nic_id, ((c, c, v) for c, v in hw.items()))
        if dep is not None and hits:
            readings = [
                (r.id, r.entry, hits[r.entry]) for r in dep.rules if r.entry is not None and r.entry < len(hits)
            ]
            if dep.n_entries < len(hits):
                readings.append((None, dep.n_entries, hits[dep.n_entries]))  # None: the policy entry
            self._rule_hw.observe(dep.nic_id, readings)
        if dep is not None and nf is not None:
            self._rule_nf.observe(dep.prefix, ((r.id, r.index, nf.get(r.index, (0, 0))[0]) for r in dep.rules))
            self._main.observe(dep.prefix, [("", "", nf_main[0])])
        rule_hw = dict(self._rule_hw.totals)
        policy_entry = rule_hw.pop(None, 0)
        return Totals(
            hw=dict(self._hw.totals),
            rule_hw=rule_hw,
            rule_nf=dict(self._rule_nf.totals),
            policy_entry=policy_entry,
            nf_main=self._main.totals.get("", 0),
            updates=dict(self._updates),
            update_buckets=tuple(self._buckets),
            update_count=self._update_count,
            update_sum=self._update_sum,
        )

    def _read_rules(self, dep: Deployment, nic: Any) -> tuple:
        """Per-entry hits and netfilter counters: (hits, nf, nf_main, nf_ok, errors)."""
        errors: list[str] = []
        hits: tuple[int, ...] = ()
        if nic is not None:
            try:
                hits = tuple(int(v) for v in nic.hits(dep.n_entries + 1))
            except Exception as e:
                errors.append(f"NIC HITS table: {e}")
        nf: dict[int, tuple[int, int]] = {}
        nf_main, nf_ok = (0, 0), False
        try:
            text = self._nf_reader(dep.netns, dep.table)
            saved = parse_iptables_save(text, dep.table)
            nf, nf_main = attribute_netfilter(saved, dep.prefix, len(dep.rules), dep.positions, dep.aliases)
            nf_ok = True
        except Exception as e:
            errors.append(f"netfilter: {e}")
        return hits, nf, nf_main, nf_ok, errors

    def _rules_async_reading(self, dep: Deployment) -> tuple:
        """The newest per-rule reading of this deployment, starting the next one when none is running."""
        key = self._dep_key
        running = self._rules_thread is not None and self._rules_thread.is_alive()
        if not running:

            def run() -> None:
                try:
                    if self._rules_nic is None or self._rules_nic[0] != dep.nic_id:
                        self._rules_nic = (dep.nic_id, self._nic_opener(dep))
                    nic = self._rules_nic[1]
                except Exception as e:
                    self._rules_nic, nic = None, None
                    hits_err = [f"NIC: {e}"]
                else:
                    hits_err = []
                hits, nf, nf_main, nf_ok, errors = self._read_rules(dep, nic)
                if any(e.startswith("NIC HITS") for e in errors):
                    self._rules_nic = None
                self._rules_seq += 1
                self._rules_reading = (key, self._rules_seq, hits, nf, nf_main, nf_ok, hits_err + errors)

            self._rules_thread = threading.Thread(target=run, name="hypafilter-rules", daemon=True)
            self._rules_thread.start()
        r = self._rules_reading
        if r is None or r[0] != key:
            return 0, (), {}, (0, 0), False, []
        return r[1:]

    def snapshot(self) -> Snapshot:
        with self._lock:
            errors: list[str] = []
            dep, state = self._deployment(errors)
            hw: dict[str, int] = {}
            hits: tuple[int, ...] = ()
            nf: dict[int, tuple[int, int]] = {}
            nf_ok = False
            nf_main = (0, 0)
            if dep is not None:
                key = (dep.nic, dep.nic_id)
                try:
                    if self._nic is None or self._nic_for != key:
                        self._close_nic()
                        self._nic = self._nic_opener(dep)
                        self._nic_for = key
                    counters = self._nic.counters()
                    hw = {c: int(counters.get(c, 0)) for c in HW_COUNTERS}
                except Exception as e:
                    errors.append(f"NIC: {e}")
                    self._close_nic()
                if self._rules_async:
                    seq, hits, nf, nf_main, nf_ok, more = self._rules_async_reading(dep)
                    if seq == self._rules_used:  # accumulated already: the totals take each reading once
                        nf_ok, fresh_hits = False, ()
                    else:
                        fresh_hits = hits
                        self._rules_used = seq
                    errors += more
                else:
                    hits, nf, nf_main, nf_ok, more = self._read_rules(dep, self._nic if hw else None)
                    fresh_hits = hits
                    errors += more
            else:
                fresh_hits = ()
            drift = self._check_drift(state, dep)
            fs: dict = {}
            if dep is not None and state is not None:
                try:
                    fs = self._flowsync_reader(state)
                except Exception as e:
                    errors.append(f"flowsync: {e}")
            ps: dict = {}
            if dep is not None and state is not None:
                try:
                    ps = self._policysync_reader(state)
                except Exception as e:
                    errors.append(f"policysync: {e}")
            if fs.get("running"):
                self._fs.observe(fs.get("pid"), ((c, c, int(fs.get(c) or 0)) for c in FLOWSYNC_COUNTERS))
            totals = dataclasses.replace(
                self._accumulate(dep, hw, fresh_hits, nf if nf_ok else None, nf_main), flowsync=dict(self._fs.totals)
            )
            self._seq += 1
            return Snapshot(
                self._seq,
                time.time(),
                time.monotonic(),
                dep,
                hw,
                hits,
                nf,
                nf_main,
                tuple(errors),
                drift,
                totals,
                fs,
                ps,
            )

    def _close_nic(self) -> None:
        close = getattr(self._nic, "close", None)
        if close is not None:
            try:
                close()
            except Exception:  # closing a broken connection
                pass
        self._nic = None
        self._nic_for = None


class Sampler:
    """Keeps the last `keep` snapshots in a ring buffer, taken every `interval` seconds by a background thread."""

    def __init__(self, collector: Collector | None = None, interval: float = 1.0, keep: int = 600):
        if interval <= 0 or keep < 2:
            raise HypafilterError("sampler needs interval > 0 and at least 2 snapshots kept")
        self.collector = collector
        self.interval = interval
        self._ring: deque[Snapshot] = deque(maxlen=keep)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.last_error: str | None = None

    def add(self, snap: Snapshot) -> None:
        """Append a snapshot (the sampler thread does this; tests feed recorded snapshots the same way)."""
        with self._lock:
            if self._ring and snap.mono <= self._ring[-1].mono:
                raise ValueError("snapshots must be added in time order")
            self._ring.append(snap)

    def sample(self) -> Snapshot:
        if self.collector is None:
            raise HypafilterError("sampler has no collector")
        snap = self.collector.snapshot()
        self.add(snap)
        return snap

    def snapshots(self) -> list[Snapshot]:
        with self._lock:
            return list(self._ring)

    def latest(self) -> Snapshot | None:
        with self._lock:
            return self._ring[-1] if self._ring else None

    def get(self, seq: int) -> Snapshot | None:
        with self._lock:
            for s in reversed(self._ring):
                if s.seq == seq:
                    return s
        return None

    def start(self) -> None:
        if self._thread is not None:
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="hypafilter-sampler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None

    def _run(self) -> None:
        next_at = time.monotonic()
        while not self._stop.is_set():
            try:
                self.sample()
                self.last_error = None
            except Exception as e:  # keep sampling; a snapshot catches source errors itself
                self.last_error = str(e)
            next_at += self.interval
            delay = next_at - time.monotonic()
            if delay < 0:  # fell behind (a slow read): do not try to catch up with a burst
                next_at = time.monotonic()
                delay = 0
            self._stop.wait(delay)


def env_token() -> str | None:
    return os.environ.get("HYPAFILTER_DASHBOARD_TOKEN") or None
