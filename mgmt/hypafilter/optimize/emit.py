"""`hypafilter optimize`: a policy file in, an iptables-restore file out whose filter table walks trees instead of
lists (optimize.tree), every other table copied as written."""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass, field, replace

from hypafilter.analysis.dtree import PROTO_NAMES as _PROTO_NAMES
from hypafilter.analysis.dtree import PROTO_NAMES_6 as _PROTO_NAMES_6
from hypafilter.analysis.dtree import WHOLE_L4_6, rank_regions
from hypafilter.analysis.dtree import range_test as _range_test
from hypafilter.config import Config
from hypafilter.errors import HypafilterError
from hypafilter.iptables import canonical
from hypafilter.iptables.document import read_table
from hypafilter.iptables.parser import MAX_CHAIN_NAME
from hypafilter.iptables.rule import Comment, ParsedRule
from hypafilter.iptables.tables import BUILTIN_CHAINS
from hypafilter.iptables.writer import quote, rule_line
from hypafilter.optimize.tree import (
    WHOLE_L4,
    Leaf,
    Node,
    Params,
    Split,
    Tree,
    build,
    movable,
    regions,
)

NFT_MAX_DEPTH = 15  # NFT_JUMP_STACK_SIZE - 1 (analysis.program explains)


@dataclass
class Segment:
    chain: str
    start: int  # index of its first rule in the chain
    rules: list[ParsedRule]
    tree: Tree | None = None
    root: str = ""
    space: object = None  # the tree's RankSpace (IPv6: its address cuts are ranks)


@dataclass
class Result:
    text: str
    rules_in: int
    rules_out: int
    segments: list[Segment] = field(default_factory=list)
    build_s: float = 0.0
    kept: dict[str, int] = field(default_factory=dict)  # why rules stayed in place -> how many
    notes: list[str] = field(default_factory=list)
    family: int = 4

    @property
    def expansion(self) -> float:
        return self.rules_out / self.rules_in if self.rules_in else 1.0

    def summary(self) -> dict:
        return {
            "rules_in": self.rules_in,
            "rules_out": self.rules_out,
            "expansion": round(self.expansion, 3),
            "trees": sum(1 for s in self.segments if s.tree is not None),
            "rules_in_trees": sum(len(s.rules) for s in self.segments if s.tree is not None),
            "kept_in_place": self.kept,
            "build_s": round(self.build_s, 3),
            "notes": self.notes,
            **({"family": 6} if self.family == 6 else {}),
        }


class _Writer:
    def __init__(self, prefix: str, taken: set[str]):
        self.prefix, self.taken = prefix, taken
        self.chains: list[str] = []
        self.lines: list[str] = []
        self.n = 0

    def new_chain(self, hint: str) -> str:
        while True:
            name = f"{self.prefix}-{hint}-{self.n}"
            self.n += 1
            if len(name) > MAX_CHAIN_NAME:
                raise HypafilterError(f"chain prefix {self.prefix!r} too long for chain names of {MAX_CHAIN_NAME}")
            if name not in self.taken:
                self.taken.add(name)
                self.chains.append(name)
                return name

    def rule(self, chain: str, tokens) -> None:
        self.lines.append(rule_line(chain, tokens))


def _leaf_tokens(r: ParsedRule, label: str) -> tuple[str, ...]:
    opts = canonical.rule_options(r)
    if not any(isinstance(m, Comment) for m in r.matches):
        opts = (*opts, "-m", "comment", "--comment", label)
    return opts + canonical.target_tokens(r)


def _emit_tree(w: _Writer, seg: Segment, labels: list[str], family: int = 4) -> None:
    tree = seg.tree
    names, whole_l4 = (_PROTO_NAMES_6, WHOLE_L4_6) if family == 6 else (_PROTO_NAMES, WHOLE_L4)
    hint = re.sub(r"[^A-Za-z0-9_]", "", seg.chain)[:12] or "c"
    root = w.new_chain(hint)
    seg.root = root
    linear = w.new_chain(hint) if tree.linear else None
    if linear:
        for r, lab in zip(seg.rules, labels, strict=True):
            w.rule(linear, _leaf_tokens(r, lab))

    def leaf_or_chain(node: Node) -> tuple[str, ...]:
        if isinstance(node.body, Leaf) and not node.body.rules:
            return ("-j", "RETURN")  # nothing here can match: back to the chain after the tree
        name = w.new_chain(hint)
        body(node, name)
        return ("-g", name)

    def body(node: Node, chain: str) -> None:
        while True:
            b = node.body
            if isinstance(b, Leaf):
                for i in b.rules:
                    w.rule(chain, _leaf_tokens(seg.rules[i], labels[i]))
                return
            assert isinstance(b, Split)
            rg = node.region
            if b.guard is not None:
                w.rule(chain, ("-m", "u32", "!", "--u32", whole_l4[b.guard], "-g", linear))
            if b.kind == "proto":
                for v, child in zip(b.tests, b.children, strict=True):
                    w.rule(chain, ("-p", names.get(v, str(v)), *leaf_or_chain(child)))
                node = b.rest
                continue
            (d, _, c1) = b.tests[0]
            left_side, toks = _range_test(d, rg.lo[d], rg.hi[d], c1 + 1, rg.proto(), seg.space)
            first, then = (b.children[0], b.rest) if left_side else (b.rest, b.children[0])
            w.rule(chain, (*toks, *leaf_or_chain(first)))
            node = then

    body(tree.root, root)


def optimize(text: str, filename: str, params: Params | None = None, prefix: str = "ht", min_segment: int = 16,
             config: Config | None = None, family: int = 4) -> Result:  # fmt: skip
    """The optimised filter table of a policy file as an iptables-restore text (other tables copied). `family` 6:
    an ip6tables policy in, an ip6tables-restore text out (the trees cut ranks of its 128-bit addresses)."""
    params = params or Params()
    t0 = time.monotonic()
    tc = read_table(text, filename, config, family=family)
    if not tc.chains or "filter" not in tc.tables:
        raise HypafilterError(f"{filename}: no rules of table filter in the file")
    w = _Writer(prefix, set(tc.chains))
    # nf_tables refuses nesting deeper than NFT_MAX_DEPTH below a base chain and counts gotos too. A walk passes
    # at most nest + 1 chains (nest: the deepest chain of jumps the file has), each tree adding its jump and at
    # most max_depth gotos (+1 for the linear copy): give every tree the same share of what is left.
    nest = _nesting(tc.chains)
    share = (NFT_MAX_DEPTH - nest) // (nest + 1) - 2
    notes = []
    if share < 1:
        notes.append(
            f"no trees: the chains already nest {nest} jumps deep, and a tree would pass nf_tables' limit of "
            f"{NFT_MAX_DEPTH} nested chains"
        )
        min_segment = 1 << 62
    params = replace(params, max_depth=min(params.max_depth, max(share, 1)))
    base = os.path.basename(filename)
    segments: list[Segment] = []
    kept: dict[str, int] = {}
    out_rules: dict[str, list[tuple[str, ...]]] = {}
    rules_in = 0
    for name, ch in tc.chains.items():
        rules_in += len(ch.rules)
        out: list[tuple[str, ...]] = []
        start = 0
        for i, r in enumerate([*ch.rules, None]):
            why = None if r is None else movable(r)
            if r is not None and why is None:
                continue
            run = ch.rules[start:i]  # the movable rules before this one
            if len(run) >= min_segment:
                seg = Segment(name, start, run)
                regs = [regions(x, family) for x in run]
                p = params
                if family == 6:  # 128-bit addresses: the tree cuts their ranks (exact: analysis.dtree.RankSpace)
                    regs, seg.space = rank_regions(regs, family)
                    p = replace(params, space=seg.space)
                seg.tree = build(regs, p)
                _emit_tree(w, seg, [_label(name, start + j, x, base) for j, x in enumerate(run)], family)
                segments.append(seg)
                out.append(("-j", seg.root))
            else:
                out.extend(canonical.rule_tokens(x) for x in run)
            if r is not None:
                kept[why] = kept.get(why, 0) + 1
                out.append(canonical.rule_tokens(r))
            start = i + 1
        out_rules[name] = out
    six = " (ip6tables)" if family == 6 else ""
    lines = [
        f"# optimised by hypafilter optimize from {base}{six}: decision trees as chains {prefix}* (docs/optimize.md)"
    ]
    lines.append("*filter")
    order = [c for c in BUILTIN_CHAINS["filter"] if c in tc.chains]
    order += [c for c in tc.chains if c not in order]
    for name in order:
        ch = tc.chains[name]
        policy = (ch.policy or "ACCEPT") if ch.builtin else "-"
        lines.append(f":{quote(name)} {policy} [0:0]")
    for name in w.chains:
        lines.append(f":{quote(name)} - [0:0]")
    for name in order:
        toks = out_rules[name]
        lines.extend(rule_line(name, t) for t in toks)
    lines.extend(w.lines)
    lines.append("COMMIT")
    others = _other_tables(text, filename, tc.tables)
    rules_out = sum(len(v) for v in out_rules.values()) + len(w.lines)
    return Result(
        "\n".join(lines) + "\n" + others, rules_in, rules_out, segments, time.monotonic() - t0, kept, notes, family
    )


def _nesting(chains) -> int:
    """The longest chain of jumps (and gotos) between the file's user chains, from any chain."""
    memo: dict[str, int] = {}

    def height(name: str, seen: frozenset) -> int:
        if name in memo:
            return memo[name]
        h = 0
        for r in chains[name].rules:
            t = r.target
            if t in chains and not chains[t].builtin and t not in seen:
                h = max(h, 1 + height(t, seen | {t}))
        memo[name] = h
        return h

    return max((height(n, frozenset({n})) for n in chains), default=0)


def _label(chain: str, index: int, r: ParsedRule, base: str) -> str:
    where = f" {base}:{r.origin.line}" if r.origin is not None and r.origin.line else ""
    return f"{chain} rule {index + 1}{where}"


def _other_tables(text: str, filename: str, tables: dict[str, int]) -> str:
    """The blocks of tables other than filter, as written (an iptables-save file); a plain rule file that fills
    another table is refused (its commands are not restore syntax)."""
    if not (set(tables) - {"filter"}):
        return ""
    lines = text.split("\n")
    if not next((ln for ln in lines if ln.strip() and not ln.lstrip().startswith("#")), "").startswith("*"):
        raise HypafilterError(
            f"{filename}: a plain rule file with tables other than filter: give an iptables-save file instead"
        )
    out, cur = [], None
    for ln in lines:
        if ln.startswith("*"):
            cur = ln[1:].split()[0]
            if cur != "filter":
                out.append(ln)
            continue
        if cur is not None and cur != "filter":
            out.append(ln)
        if ln == "COMMIT":
            cur = None
    return "\n".join(out) + "\n"
