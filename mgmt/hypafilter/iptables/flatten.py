"""User-chain flattening: the base chain with its jumps, gotos and RETURNs as one first-match rule list.

Semantics (docs/policy-language.md, "Flattening"):
- `-j C`: every rule of C in order, each conjoined with the jump's checks; C's end falls through to the
  rule after the jump.
- `-j RETURN` in a user chain: later rules of that chain are reached only when the RETURN rule did not
  match. A simple RETURN is subtracted from their boxes (exact); a complex one cannot be, so they are marked
  approximate (boxes over-approximate, the rule stays complex, Level.unless names the guard).
- `-g C`: like `-j C` followed by a RETURN with the same checks (the caller's remaining rules are skipped
  for packets that took the goto); in the base chain, that RETURN is the chain policy.
- `-j RETURN` in the base chain: the chain policy.
- A jump that would expand to more than config.flatten_bound rules, or whose flattening cannot be exact, stays
  one complex rule whose target is the user chain; that chain is loaded verbatim in software. Flattening is not
  exact for a chain that (itself or through chains it reaches) changes state or keeps per-rule state: a MARK,
  CONNMARK, SET, ... would change what the re-evaluated caller checks and RETURN guards of its later rules test,
  and a limit, quota, recent, ... rule copied into every expansion would count packets in several buckets.
- A base-chain rule with per-rule state keeps its base position (`Rule.stateful_pos`), so the generated chains
  load it once (see analysis.program.place_policy_rule).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

from hypafilter.config import Config
from hypafilter.errors import PolicyError
from hypafilter.iptables import canonical
from hypafilter.iptables.rule import target_column
from hypafilter.ir import Box, Level, Rule
from hypafilter.ir.box import boxes_intersect, boxes_minus
from hypafilter.ir.semantics import STATE_CHANGING_TARGETS


class _NotFlat(Exception):
    """This chain cannot be flattened exactly at this jump; keep the jump verbatim."""


@dataclass(frozen=True)
class _Frame:
    boxes: tuple[Box, ...]
    complex: tuple[tuple[str, ...], ...]
    levels: tuple[Level, ...]
    approx: bool


class _Flattener:
    def __init__(self, chains, base: str, default: str, config: Config):
        self.chains, self.base, self.default, self.bound = chains, base, default, config.flatten_bound
        self._keeps_state: dict[str, bool] = {}

    def user(self, name: str) -> bool:
        return name in self.chains and not self.chains[name].builtin

    def keeps_state(self, name: str, visiting: frozenset[str] = frozenset()) -> bool:
        """Does user chain `name`, or a chain it reaches, change state or keep per-rule state?"""
        if name not in self._keeps_state:
            self._keeps_state[name] = any(
                r.stateful
                or r.target in STATE_CHANGING_TARGETS
                or (self.user(r.target) and r.target not in visiting and self.keeps_state(r.target, visiting | {name}))
                for r in self.chains[name].rules
            )
        return self._keeps_state[name]

    def walk(self, name: str, fr: _Frame, stack: tuple[str, ...]) -> list[Rule]:
        if name != self.base and self.keeps_state(name):
            raise _NotFlat(name)
        out: list[Rule] = []
        guard_boxes: list[Box] = []  # union of the simple RETURN guards met so far in this chain
        guard_opts: list[tuple[str, ...]] = []
        approx_here = False
        in_base = name == self.base
        root = (Box.full(),)  # (ir.family: the family's full box)
        depth = len(fr.levels)
        for pos, r in enumerate(self.chains[name].rules):
            opts = canonical.rule_options(r)
            own = r.boxes
            approx = fr.approx or approx_here
            if guard_boxes:
                cut = boxes_minus(own, guard_boxes)
                if cut is None:
                    approx = True
                else:
                    own = cut
            if fr.boxes == root:  # the base chain: meeting the full box changes nothing (drops empty boxes)
                eff = tuple(b for b in own if all(map(operator.le, b.lo, b.hi)))
            else:
                eff = tuple(boxes_intersect(list(fr.boxes), own))
            cx = fr.complex + tuple(r.complex)
            levels = fr.levels + (Level(opts, tuple(guard_opts)),)

            def rule(
                target: str, args: tuple[str, ...] = (), r=r, eff=eff, cx=cx, levels=levels, approx=approx, pos=pos
            ) -> Rule:
                spos = pos if in_base and r.stateful else None
                return Rule(eff, target, cx, args, levels, r.origin, approx, spos)

            def guard(r=r, opts=opts) -> None:
                nonlocal approx_here
                if r.stateful:
                    raise _NotFlat(name)
                guard_opts.append(opts)
                if r.complex:
                    approx_here = True
                else:
                    guard_boxes.extend(r.boxes)

            if r.never:
                # An interface check no NIC frame passes: the rule never matches, and never returns, a NIC frame.
                # Software still holds it for other frames (FULL, verbatim from Policy.original_rules).
                continue
            if depth and not eff:
                # Never reached from this jump; keeping it would only cost hardware entries. It still
                # guards later rules when it is a RETURN or goto (its own boxes, not the empty conjunction).
                if r.target == "RETURN" or r.goto:
                    guard()
                continue
            if r.target == "RETURN":
                if in_base:
                    out.append(rule(self.default))
                else:
                    guard()
            elif self.user(r.target):
                if r.target in stack:
                    o = r.origin
                    raise PolicyError(
                        f"chain loop: {r.target} is reached from itself",
                        o.file,
                        o.line,
                        target_column(o, r.target),
                        r.target,
                    )
                sub = None
                if not r.stateful:
                    try:
                        sub = self.walk(r.target, _Frame(eff, cx, levels, approx), stack + (r.target,))
                    except _NotFlat:
                        sub = None
                    if sub is not None and len(sub) > self.bound:
                        sub = None
                out.extend(sub if sub is not None else [rule(r.target)])
                if r.goto:
                    if in_base:
                        if r.stateful:
                            o = r.origin
                            raise PolicyError(
                                "-g with a stateful match in the base chain cannot be represented; use -j and a "
                                "RETURN-free chain, or move the stateful match into the chain",
                                o.file,
                                o.line,
                                target_column(o, r.target),
                                r.target,
                            )
                        out.append(rule(self.default))
                    else:
                        guard()
            elif not r.target:
                # A rule without a target decides nothing, but it counts the packets it matches (and updates its
                # stateful matches): it stays, as an observing rule, so that netfilter sees what the kernel's sees
                out.append(rule(""))
            else:
                out.append(rule(r.target, tuple(r.target_args)))
        return out


def flatten(chains, base: str, default: str, config: Config | None = None) -> list[Rule]:
    """The flattened rule list of `base` (chains: name -> parse.ChainDef)."""
    f = _Flattener(chains, base, default, config or Config())
    return f.walk(base, _Frame((Box.full(),), (), (), False), (base,))
