"""Reference classifier (first match over the flattened list) and the Python emulation of the hybrid system.

`complex_eval(index, rule, header)` decides the checks the model cannot see (string, statistic, a user chain
kept verbatim, ...) for a rule whose boxes contain the header: False = no match, True = match (the target then
applies), or a verdict string ("ACCEPT", "DROP", ...) = the rule decided that verdict (e.g. a verbatim user chain
that accepted). The same callback drives both sides of every comparison, so random matches stay comparable.
A rule without complex checks matches on geometry alone, whatever its target.

Also here: `make_rule`, a builder of IR rules with consistent boxes and iptables options (tests, ClassBench).
"""

from __future__ import annotations

import ipaddress
import itertools
from collections.abc import Callable, Sequence

import numpy as np

from hypafilter.analysis import geometry
from hypafilter.analysis.geometry import BoxSet
from hypafilter.ir.types import MAXV, PROTO_ICMP, PROTO_TCP, PROTO_UDP, Box, Header, Level, Origin, Policy, Rule

ComplexEval = Callable[[int, Rule, Header], "bool | str"]
TERMINAL = frozenset({"ACCEPT", "DROP", "REJECT", "QUEUE", "NFQUEUE"})
ACTION_NAMES = {1: "ACCEPT", 2: "DROP"}


def never(index: int, rule: Rule, header: Header) -> bool:
    """The default complex_eval: complex checks never match."""
    return False


def rule_outcome(policy: Policy, index: int, header: Header, complex_eval: ComplexEval) -> str | None:
    """What rule `index` does to `header`: a verdict string, "" (matched, non-terminal: continue) or None (no match)."""
    r = policy.rules[index]
    if not any(b.contains(header) for b in r.boxes):
        return None
    if r.complex or r.approximate:
        res = complex_eval(index, r, header)
        if isinstance(res, str):
            return res
        if not res:
            return None
    if r.target == "RETURN":  # a RETURN in the base chain ends it: the chain policy applies
        return policy.default
    if r.target in TERMINAL:
        return r.target
    return ""


def reference_verdict(policy: Policy, header: Header, complex_eval: ComplexEval | None = None) -> str:
    """First match over the flattened rule list; non-terminal targets (LOG, MARK, ...) continue."""
    ev = complex_eval or never
    for i in range(len(policy.rules)):
        out = rule_outcome(policy, i, header, ev)
        if out:
            return out
    return policy.default


def hardware_decision(plan, header: Header) -> tuple[int, bool, int]:
    """The matcher's result for one header: (match_index, shunted, action code)."""
    mi = plan.n
    for j, e in enumerate(plan.entries):
        if any(b.contains(header) for b in e.boxes):
            mi = j
            break
    return mi, bool(plan.shunt[mi]), int(plan.actions[mi])


def hybrid_verdict(
    plan,
    strategy: str,
    header: Header,
    complex_eval: ComplexEval | None = None,
    foreign_mark: int = 0,
    mark_mask: int = 0xFFFFFFFF,
    mark_shift: int = 0,
) -> tuple[str, bool, int]:
    """(verdict, shunted, traversed) of the hybrid system: hardware decision, shim mark, generated netfilter.

    The software side runs the very chain structure the emitters write (netfilter.build_program), with the mark
    the shim would write (other mark bits set to `foreign_mark`, to check that dispatch honours the mask).
    """
    from hypafilter.analysis.program import build_program, mark_for  # noqa: PLC0415 (netfilter imports this module)

    mi, shunted, action = hardware_decision(plan, header)
    if not shunted:
        return (ACTION_NAMES.get(action, plan.policy.default) if mi < plan.n else plan.policy.default), False, 0
    cache = plan.__dict__.setdefault("_programs", {})
    key = (strategy, mark_mask, mark_shift)
    if key not in cache:
        cache[key] = build_program(plan, strategy, mark_mask=mark_mask, mark_shift=mark_shift)
    prog = cache[key]
    mark = mark_for(prog, int(plan.interval[mi]), action, foreign_mark)
    verdict, count = prog.run(header, mark, complex_eval or never)
    return verdict, True, count


# ---------------------------------------------------------------- vectorised variants for traces


def classify_entries(plan, values: np.ndarray, flags: np.ndarray | None = None) -> np.ndarray:
    """match_index for many headers (values[p, NDIM] in FIELDS order); n where no entry matches."""
    return geometry.first_match(BoxSet.points(values, flags), plan.entry_set, default=plan.n)


def first_rule_match(policy: Policy, positions: Sequence[int], values: np.ndarray, flags=None) -> np.ndarray:
    """For many headers: the first of `positions` (rule positions) whose boxes contain it, else len(rules)."""
    src = BoxSet.from_unions([policy.rules[i].boxes for i in positions], owners=list(positions))
    return geometry.first_match(BoxSet.points(values, flags), src, default=len(policy.rules))


# ---------------------------------------------------------------- building IR rules directly


def _prefix_range(spec: str) -> tuple[int, int]:
    net = ipaddress.IPv4Network(spec, strict=False)
    return int(net.network_address), int(net.broadcast_address)


def _complement(lo: int, hi: int, maxv: int) -> list[tuple[int, int]]:
    out = []
    if lo > 0:
        out.append((0, lo - 1))
    if hi < maxv:
        out.append((hi + 1, maxv))
    return out


def make_rule(
    target: str = "ACCEPT",
    *,
    src: str | None = None,
    dst: str | None = None,
    not_src: bool = False,
    not_dst: bool = False,
    proto: str | None = None,
    sport: tuple[int, int] | None = None,
    dport: tuple[int, int] | None = None,
    dports: Sequence[int] | None = None,
    complex: Sequence[Sequence[str]] = (),
    target_args: Sequence[str] = (),
    line: int = 0,
    chain: str = "FORWARD",
) -> Rule:
    """An IR rule with boxes and canonical iptables options that say the same thing.

    Negated addresses and multiport lists become several boxes (as the parser does).
    """
    opts: list[str] = []
    per_dim: dict[str, list[tuple[int, int]]] = {}
    for flag, spec, neg, dim in (("-s", src, not_src, "src"), ("-d", dst, not_dst, "dst")):
        if spec is None:
            continue
        lo, hi = _prefix_range(spec)
        per_dim[dim] = _complement(lo, hi, MAXV[0]) if neg else [(lo, hi)]
        opts += (["!"] if neg else []) + [flag, str(ipaddress.IPv4Network(spec, strict=False))]
    if proto is not None:
        num = {"tcp": PROTO_TCP, "udp": PROTO_UDP, "icmp": PROTO_ICMP}[proto]
        per_dim["proto"] = [(num, num)]
        opts += ["-p", proto]
    if sport is not None or dport is not None:
        if proto not in ("tcp", "udp"):
            raise ValueError("ports need -p tcp or -p udp")
        opts += ["-m", proto]
        for flag, rng, dim in (("--sport", sport, "sport"), ("--dport", dport, "dport")):
            if rng is not None:
                per_dim[dim] = [rng]
                opts += [flag, f"{rng[0]}" if rng[0] == rng[1] else f"{rng[0]}:{rng[1]}"]
    if dports is not None:
        if proto not in ("tcp", "udp") or dport is not None:
            raise ValueError("multiport needs -p tcp/udp and no --dport")
        per_dim["dport"] = [(p, p) for p in dports]
        opts += ["-m", "multiport", "--dports", ",".join(str(p) for p in dports)]
    for group in complex:
        opts += list(group)
    boxes = []
    dims = list(per_dim)
    for combo in itertools.product(*(per_dim[d] for d in dims)):
        b = Box.full()
        for d, (lo, hi) in zip(dims, combo, strict=True):
            b = b.with_field(d, lo, hi)
        boxes.append(b)
    text = " ".join(["-A", chain, *opts, "-j", target, *target_args])
    return Rule(
        boxes=tuple(boxes),
        target=target,
        complex=tuple(tuple(g) for g in complex),
        target_args=tuple(target_args),
        levels=(Level(options=tuple(opts)),),
        origin=Origin(file="<built>", line=line, chain=chain, text=text),
    )


def make_policy(
    rules: Sequence[Rule], default: str = "ACCEPT", base_chain: str = "FORWARD", source="<built>"
) -> Policy:
    """A Policy from built rules (each one a base-chain rule: original_rules are their options + target)."""
    orig = [(*r.levels[0].options, "-j", r.target, *r.target_args) for r in rules]
    return Policy(rules=list(rules), default=default, base_chain=base_chain, source=source, original_rules=orig)


def listing1() -> Policy:
    """The paper's Listing 1 in IR form (R3 and R5 complex through string matches)."""
    s = [("-m", "string", "--string", "SELECT", "--algo", "bm")]
    h = [("-m", "string", "--hex-string", "|11 02 00|", "--algo", "bm")]
    return make_policy(
        [
            make_rule("ACCEPT", dst="1.2.3.4/32", proto="tcp", dport=(80, 80), line=1),
            make_rule("ACCEPT", src="1.2.3.0/24", proto="tcp", line=2),
            make_rule("DROP", dst="1.2.3.5/32", proto="udp", dport=(3306, 3306), complex=s, line=3),
            make_rule("ACCEPT", dst="1.2.3.4/32", proto="tcp", dport=(443, 443), line=4),
            make_rule("DROP", dst="1.2.3.6/32", proto="udp", dport=(53, 53), complex=h, line=5),
            make_rule("ACCEPT", dst="1.2.3.6/32", proto="udp", dport=(53, 53), line=6),
        ]
    )
