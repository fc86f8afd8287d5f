"""Strategy `tree`: the lists software still walks, as decision trees (HiTables, docs/optimize.md) in the Program.

`treeify(prog)` rewrites a built interval program in place: the k = 0 path (K0: untagged, unparsed and stale frames,
every frame while an update shunts everything) walks the whole flattened policy as optimize.tree's trees instead of
the verbatim FULL chain, and every chain of at least 2 × Config.tree_min_segment policy lines (an interval's segment or block of
complex rules) walks its movable runs as trees too. The trees are optimize.tree's, built over the flattened rules:
inner nodes are `hdr` rules (a header test with a goto), leaves are the same `policy` lines every other chain holds,
so `Program.run` executes them and both emitters render them.

What stays linear (a run ends there), as in optimize: rules with per-rule state (they jump to their one copy S<pos>)
and rules whose options the parser cannot read back. A flattened rule never returns or goes to its caller by itself
(RETURN and -g are folded into the flattening), and its region is the one optimize gives the rule as written in the
base chain (level 0): a multi-level rule's helper chains only run after that rule's -s/-d/-p held, so its -s/-d/-p
alone over-approximate where any part of it can act. A policy whose interface checks were resolved against the
deployment's NIC ports (Policy.resolved) keeps K0 on the verbatim FULL chain: its flattened rules are exact for NIC
frames only.

`live_k0` is a live deployment's K0 tree (chain K0T, for the frames xdp marks HF_MARK_K0_TREE). A live deployment's
trees, K0T's and the interval chains', are rebuilt lazily (`Bases`): a follow writes each as the tree of its base
(the rules of the last rebuild) and sends the frames in the -s/-d/-p of the rules changed since to a linear chain of
the live rules that can act there, ahead of it (docs/optimize.md, "The live K0 tree" and "Lazy trees").
"""

from __future__ import annotations

import difflib
import functools
import hashlib
import ipaddress
import json
import re
from collections import Counter
from collections.abc import Callable
from dataclasses import astuple, dataclass, replace
from pathlib import Path

import numpy as np

from hypafilter.analysis import dtree
from hypafilter.analysis.dtree import (
    DIMS,
    PROTO_NAMES,
    PROTO_NAMES_6,
    SPORT,
    WHOLE_L4,
    WHOLE_L4_6,
    Leaf,
    Node,
    Params,
    Region,
    Split,
    Tree,
    build,
    range_test,
    rank_regions,
    region_any,
    regions,
)
from hypafilter.errors import HypafilterError
from hypafilter.iptables.document import read_table
from hypafilter.iptables.parser import parse_rule
from hypafilter.iptables.tokens import RESTORE
from hypafilter.iptables.writer import tokens_text

# Config.tree_min_segment (default 16, optimize's --min-segment) is the shortest run of movable rules made a tree;
# a chain of at least twice as many policy lines (K0 always) is cut into runs, and a tree node of at most half as
# many rules is a leaf (optimize's --binth, 8 by default).
TREE_MAX_EXPANSION = 4.0  # rules written per rule of a run (optimize's --max-expansion)


def _parse_all(options: list[tuple[str, ...]], family: int = 4) -> list[list]:
    """The parsed rules of each option list: one document (the parser's fast path), or one by one when the document
    is refused (a rule that does not parse alone then stays in place). `family` 6: ip6tables rules."""
    lines = ["*filter", ":HFTREE - [0:0]", *(f"-A HFTREE {tokens_text(o)}" for o in options), "COMMIT"]
    try:
        chains = read_table("\n".join(lines) + "\n", "<flattened rules>", family=family).chains
    except HypafilterError:
        chains = None
    if chains is not None:
        by_line: dict[int, list] = {}
        for p in chains["HFTREE"].rules:
            by_line.setdefault(p.origin.line, []).append(p)
        return [by_line.get(j + 3, []) for j in range(len(options))]
    out = []
    for o in options:
        try:
            out.append(parse_rule(tokens_text(o), chain="HFTREE", mode=RESTORE, family=family))
        except HypafilterError:
            out.append([])
    return out


def flat_regions(pol, wanted=None) -> list[tuple[list, list] | None]:
    """(region_any, region) per flattened rule, as optimize.tree.build takes them; None for a rule that stays (and
    for a rule not in `wanted`, when given: only those are parsed). An IPv6 policy's (`pol.family` 6, ranked or not)
    are over 128-bit addresses, read from the rules' own tokens (`_Trees` ranks them per tree)."""
    family = getattr(pol, "family", 4)
    out: list[tuple[list, list] | None] = []
    cache: dict[tuple[str, ...], tuple[list, list] | None] = {}
    keys = [
        (str(len(r.levels) == 1 and not r.levels[0].unless), *r.levels[0].options)
        if r.levels and (wanted is None or i in wanted)
        else None
        for i, r in enumerate(pol.rules)
    ]
    todo = list(dict.fromkeys(k[1:] for k in keys if k is not None))
    parsed_of = dict(zip(todo, _parse_all(todo, family), strict=True))
    for r, key in zip(pol.rules, keys, strict=True):
        if r.stateful_pos is not None or key is None or r.target == "RETURN":
            out.append(None)
            continue
        single = key[0] == "True"
        if key not in cache:
            parsed = parsed_of[key[1:]]
            if not parsed or any(p.stateful for p in parsed):
                cache[key] = None
            elif single:
                any_, whole = [], []
                for p in parsed:
                    a, w = regions(p, family)
                    any_ += a
                    whole += w
                cache[key] = (any_, whole)
            else:  # helper chains follow: only level 0's header checks tell where the rule can act
                any_ = [b for p in parsed for b in region_any(p, family)]
                cache[key] = (any_, any_)
        out.append(cache[key])
    return out


def _ip_range(spec: str) -> tuple[int, int]:
    if "-" in spec:
        a, b = spec.split("-")
        return int(ipaddress.ip_address(a)), int(ipaddress.ip_address(b))
    net = ipaddress.ip_network(spec)
    return int(net.network_address), int(net.broadcast_address)


def tested(options: tuple[str, ...], amap=None) -> tuple:
    """What a dispatch rule's tokens test, for Program.run: ("range", dim, lo, hi, proto | None). `amap` (a ranked
    IPv6 policy's ir.family.AddrMap): an address range as the ranks of its ends, which the model's headers carry
    (exact: a tree's cuts are bounds of the policy's own boxes, so they start ranks of the policy too)."""

    def ranks(dim: str, lo: int, hi: int) -> tuple[int, int]:
        return (amap.rank(dim, lo), amap.rank(dim, hi)) if amap is not None else (lo, hi)

    if options[0] in ("-s", "-d"):
        dim = "src" if options[0] == "-s" else "dst"
        return ("range", DIMS.index(dim), *ranks(dim, *_ip_range(options[1])), None)
    if options[:2] == ("-m", "iprange"):
        dim = "src" if options[2] == "--src-range" else "dst"
        return ("range", DIMS.index(dim), *ranks(dim, *_ip_range(options[3])), None)
    # ("-p", name, "-m", name, "--sport"/"--dport", "A:B" or "A")
    proto = {v: k for k, v in (*PROTO_NAMES.items(), *PROTO_NAMES_6.items())}[options[1]]
    lo, _, hi = options[5].partition(":")
    return ("range", DIMS.index(options[4][2:]), int(lo), int(hi or lo), proto)


class _Trees:
    def __init__(self, prog, min_segment: int, kit):
        self.prog, self.min_segment = prog, min_segment
        self.rule, self.kit_lines = kit.rule, kit.lines
        self.regs: list = []
        self.lines = kit.lines
        self.cache: dict = {}
        self.bases: Bases | None = None  # counts the trees built (`built`)
        self.n = 0
        self.trees = 0
        self.rules_in = 0
        self.rules_out = 0
        # an IPv6 policy's trees cut the ranks of their own run's 128-bit addresses (analysis.dtree.RankSpace) and
        # are written as ip6tables tests; the model's headers carry the policy's ranks (`addr_map`)
        self.family = getattr(prog.policy, "family", 4)
        self.amap = getattr(prog.policy, "addr_map", None)

    def use(self, fit: _Fit) -> None:
        """Write over the rules of `fit`'s base (indices are its positions): its regions and built trees, each rule
        written as the live policy's rule fit.remap[p] (None: deleted since, left out)."""
        remap, lines = fit.remap, self.kit_lines
        self.regs, self.cache = fit.base.regs, fit.base.trees
        self.lines = lambda pol, idx: lines(pol, [remap[i] for i in idx if remap[i] is not None])

    def chain(self, stem: str = "T") -> str:
        while True:
            name = self.prog.name(f"{stem}{self.n}")
            self.n += 1
            if name not in self.prog.chains:
                self.prog.chains[name] = []
                return name

    def rewrite(self, indices: list[int], max_depth: int) -> list:
        """The lines replacing a chain's policy lines over the base's rules `indices` (in order)."""
        policy_rules = self.lines
        pol = self.prog.policy
        out: list = []
        run: list[int] = []

        def flush() -> None:
            if len(run) >= self.min_segment and max_depth >= 2:
                out.append(self._tree(list(run), max_depth))
            else:
                out.extend(policy_rules(pol, run))
            run.clear()

        for i in indices:
            if self.regs[i] is None:
                flush()
                out.extend(policy_rules(pol, [i]))
            else:
                run.append(i)
        flush()
        return out

    def _tree(self, run: list[int], max_depth: int):
        NfRule, policy_rules = self.rule, self.lines
        prog, pol = self.prog, self.prog.policy
        params = Params(binth=max(1, self.min_segment // 2), max_expansion=TREE_MAX_EXPANSION, max_depth=max_depth)
        ckey = (tuple(run), astuple(params))
        regs, space = [self.regs[i] for i in run], None
        six = self.family == 6
        if six:  # the tree's address cuts are ranks of its run's boxes, written back as the addresses they stand for
            regs, space = rank_regions(regs, 6)
            params = replace(params, space=space)
        names, whole_l4 = (PROTO_NAMES_6, WHOLE_L4_6) if six else (PROTO_NAMES, WHOLE_L4)
        tree = self.cache.get(ckey)
        if tree is None:
            tree = self.cache[ckey] = build(regs, params)
            if self.bases is not None:
                self.bases.built += 1
        self.trees += 1
        self.rules_in += len(run)
        self.rules_out += tree.emitted_rules
        root = self.chain()
        linear = self.chain() if tree.linear else None
        if linear:
            prog.chains[linear] = policy_rules(pol, run)

        def target(node) -> str:
            if isinstance(node.body, Leaf) and not node.body.rules:
                return "RETURN"  # nothing here can match: back to the chain after the tree's jump
            name = self.chain()
            body(node, name)
            return name

        def body(node, chain: str) -> None:
            lines = prog.chains[chain]
            while True:
                b = node.body
                if isinstance(b, Leaf):
                    lines.extend(policy_rules(pol, [run[j] for j in b.rules]))
                    return
                assert isinstance(b, Split)
                rg = node.region
                if b.guard is not None:
                    opts = ("-m", "u32", "!", "--u32", whole_l4[b.guard])
                    lines.append(NfRule("hdr", linear, goto=True, options=opts, test=("guard", b.guard)))
                if b.kind == "proto":
                    for v, child in zip(b.tests, b.children, strict=True):
                        opts = ("-p", names.get(v, str(v)))
                        lines.append(NfRule("hdr", target(child), goto=True, options=opts, test=("proto", v)))
                    node = b.rest
                    continue
                d, _, c1 = b.tests[0]
                proto = rg.proto() if d >= SPORT else None
                left, opts = range_test(d, rg.lo[d], rg.hi[d], c1 + 1, proto, space)
                first, then = (b.children[0], b.rest) if left else (b.rest, b.children[0])
                lines.append(NfRule("hdr", target(first), goto=True, options=opts, test=tested(opts, self.amap)))
                node = then

        body(tree.root, root)
        return NfRule("always", root)


def _depths(prog) -> dict[str, int]:
    """Chains nested below the base chain to reach each chain of the program (its longest path; MAIN is 1)."""
    depth = {prog.main: 1}
    order = [prog.main]
    while order:
        name = order.pop()
        for r in prog.chains.get(name, ()):
            if r.target in prog.chains and depth[name] + 1 > depth.get(r.target, 0):
                depth[r.target] = depth[name] + 1
                order.append(r.target)
    return depth


def _user_height(pol) -> dict[str, int]:
    """Nested jumps below each of the policy's user chains (its own chains of jumps)."""
    memo: dict[str, int] = {}

    def h(name: str, seen: frozenset) -> int:
        if name not in memo:
            best = 0
            for toks in pol.user_chains[name].rules:
                for a, b in zip(toks, toks[1:], strict=False):
                    if a in ("-j", "-g", "--jump", "--goto") and b in pol.user_chains and b not in seen:
                        best = max(best, 1 + h(b, seen | {b}))
            memo[name] = best
        return memo[name]

    return {n: h(n, frozenset({n})) for n in pol.user_chains}


@dataclass(frozen=True)
class Kit:
    """What treeify writes with (analysis.program's, passed in: that module imports this one)."""

    rule: Callable  # NfRule
    lines: Callable  # policy_rules(policy, indices) -> the "policy" lines
    helper_depth: Callable  # a flattened rule -> nested helper chains its rendering adds


def treeify(prog, kit: Kit, nft_max_depth: int, min_segment: int = 16, bases: Bases | None = None) -> dict:
    """Rewrite K0 and the long chains of policy lines of a built program as trees (see the module docstring).
    `bases` (a live deployment's follow): each chain's tree is its base's, the rules changed since diverted ahead of
    it (`Bases`, docs/optimize.md "Lazy trees"); default: every tree built. Returns a summary: trees, rules in
    them, rules written, and (lazy) `lazy_trees` and `lazy_changed`: the chains' trees kept and the rules diverted."""
    _helper_depth = kit.helper_depth

    pol = prog.policy
    bases = bases or Bases(pol, min_segment, live=False, fresh=True)
    k0_tree = bool(prog.verbatim_full) and not pol.resolved
    uh = _user_height(pol)

    def below(i: int) -> int:  # nesting a policy line adds: helper chains, then a user chain's own jumps
        r = pol.rules[i]
        return _helper_depth(r) + (1 + uh[r.target] if r.target in uh else 0)

    depth = _depths(prog)
    built = set(prog.chains)  # the interval structure's chains (trees are not made trees again)
    t = _Trees(prog, min_segment, kit)
    t.bases = bases
    divs = iter(range(1 << 30))  # diversion chains TD<n>, numbered apart from the trees' T<n>
    lazy = {"lazy_trees": 0, "lazy_changed": 0}

    def room(name: str, idx: list[int]) -> int:
        # base -> ... -> this chain (depth[name]) -> the tree's root -> gotos -> the linear copy -> helpers/user chains
        deepest = max((below(i) for i in idx), default=0)
        return min(Params().max_depth, nft_max_depth - depth[name] - 2 - deepest)

    def as_tree(name: str, idx: list[int], per_box: int):
        """(lines, fit) writing the policy's rules `idx` as a tree (its base's), or None: no tree was written."""
        fit = bases.fit(idx, per_box=per_box)
        t.use(fit)
        before = t.trees
        lines = t.rewrite(list(range(len(fit.remap))), room(name, idx))
        if t.trees == before:  # no run long enough (or no room below nf_tables' limit)
            return None
        bases.keep(fit)
        if not fit.fresh:
            lazy["lazy_trees"] += 1
            lazy["lazy_changed"] += len(fit.changed)
        return lines, fit

    def diverted(fit: _Fit, idx: list[int], tail: list) -> list:
        return _diversions(prog, kit, fit, idx, lambda: prog.name(f"TD{next(divs)}"), tail) if fit.changed else []

    # 1. Interval chains: a leaf L<k>A<a> whose whole chain (its blocks and segments, concatenated) is long walks it
    # as one tree, longest chains first while the trees written stay within TREE_MAX_EXPANSION rules per policy rule;
    # leaves with the same chain share its tree and its diversion.
    leaf = re.compile(re.escape(prog.prefix) + r"L\d+A\d+")

    def expand(chain: str) -> list[int]:
        out = []
        for r in prog.chains[chain]:
            if r.kind == "policy":
                out += range(r.index, r.index + r.span)
            else:  # "block": a segment or block chain
                out += expand(r.target)
        return out

    cands = []
    for name, rules in prog.chains.items():
        if leaf.fullmatch(name) and all(r.kind == "block" for r in rules[1:-1]):
            idx = [i for r in rules[1:-1] for i in expand(r.target)]
            if len(idx) >= 2 * min_segment:
                cands.append((len(idx), name, idx))
    budget = TREE_MAX_EXPANSION * max(len(pol.rules), 1)
    sharing = Counter(tuple(idx) for _, _, idx in cands)  # leaves of one chain: each tests every box twice
    shared: dict[tuple[int, ...], tuple] = {}
    heads: dict[tuple, list] = {}
    for n, name, idx in sorted(cands, key=lambda c: -c[0]):
        key = tuple(idx)
        if key not in shared:
            if t.rules_out + TREE_MAX_EXPANSION * n > budget:
                continue
            got = as_tree(name, idx, 2 * sharing[key])
            if got is None:
                continue
            shared[key] = got
        lines, fit = shared[key]
        rules = prog.chains[name]
        verdict = rules[-1]
        if key not in heads:
            heads[key] = diverted(fit, idx, [])
        # a diverted frame jumps to the live rules that can act there (shared by the leaves of the chain), then
        # meets its box again and the leaf's verdict: the tree is not walked
        head = [
            r
            for d in heads[key]
            for r in (
                kit.rule("hdr", d.target, options=d.options, test=d.test),
                kit.rule("hdr", verdict.target, options=d.options, test=d.test),
            )
        ]
        prog.chains[name] = [rules[0], *head, *lines, verdict]
    if shared:  # segments and blocks no leaf jumps to any more
        seen, todo = {prog.main}, [prog.main]
        while todo:
            for r in prog.chains[todo.pop()]:
                if r.target in prog.chains and r.target not in seen:
                    seen.add(r.target)
                    todo.append(r.target)
        for name in [n for n in prog.chains if n not in seen]:
            del prog.chains[name]

    # 2. What is left: K0 (the whole policy) and every long chain of policy lines (a segment, a level-1 block)
    work = []
    for name, rules in list(prog.chains.items()):
        if name not in built or name == prog.verbatim_full or not rules or any(r.kind != "policy" for r in rules):
            continue
        idx = [i for r in rules for i in range(r.index, r.index + r.span)]
        if len(rules) >= 2 * min_segment:
            work.append((name, idx))
    k0 = prog.name("K0")
    if k0_tree and pol.rules:
        work.append((k0, list(range(len(pol.rules)))))
    for name, idx in work:
        got = as_tree(name, idx, 1)
        if got is None:  # the chain stays as it was
            continue
        lines, fit = got
        if name == k0:
            unmark, default = prog.chains[k0][0], prog.chains[k0][-1]
            prog.chains[k0] = [unmark, *lines, default]
            del prog.chains[prog.verbatim_full]
            prog.verbatim_full = ""
        else:  # a segment or block, jumped to: a diverted frame's chain ends where it would (back to the caller)
            prog.chains[name] = [*diverted(fit, idx, []), *lines]
    out = {"trees": t.trees, "rules_in_trees": t.rules_in, "rules_written": t.rules_out}
    return {**out, **lazy, "trees_built": bases.built} if bases.live else out


# ---------------------------------------------------------------- live trees, lazily rebuilt (SFL in software)

# Changed rules (deleted from a tree's base and inserted since) a live tree keeps diverting to a linear chain before
# it is built anew from the live rules (SFL's δ: docs/optimize.md, "Lazy trees").
LAZY_DELTA = 8


@dataclass
class _Base:
    """The rules a live tree was last built from (its base), with their regions and built trees (one per process:
    the policy sync worker's follows reuse it until the next rebuild)."""

    keys: list
    regs: list
    trees: dict


@dataclass
class _Fit:
    """A live list of rules written as the tree of `base`: remap[p] is the live policy's rule that base position p
    is written as (None: deleted since), `changed` the region_any of every rule deleted or inserted since, and
    `live_regs` the regions of the live list's rules, in its order."""

    base: _Base
    remap: list
    changed: list
    live_regs: list
    fresh: bool


def rule_key(r) -> tuple:
    """What a flattened rule is written from (its place in the file left out): equal keys, equal rules in netfilter.
    Nested tuples of strings, so that a deployment keeps them in its state (`bases_of_json`)."""
    levels = tuple((tuple(lv.options), tuple(tuple(u) for u in lv.unless)) for lv in r.levels)
    return (levels, r.target, tuple(r.target_args), r.ct_part)


def keys_of_json(doc) -> list[tuple]:
    """rule_key tuples back from their JSON lists."""

    def tup(x):
        return tuple(tup(y) for y in x) if isinstance(x, list) else x

    return [tup(k) for k in doc]


def bases_of_json(doc) -> dict:
    """A deployment's recorded bases ({"k0": keys or None, "chains": [keys, ...]}) back from JSON."""
    return {
        "k0": keys_of_json(doc["k0"]) if doc.get("k0") else None,
        "chains": [keys_of_json(c) for c in doc.get("chains", [])],
    }


def _base_of_keys(keys: list[tuple], cache: dict | None = None, family: int = 4) -> _Base:
    """A base from its rules' keys alone (a new process, as the policy sync worker after a deploy): its regions and
    built trees from the deployment's tree cache (`cache_of_json`) when it has them; else the regions are the
    flattened rules' (flat_regions reads the levels and the target, as rules of `family`: an ip6tables rule without
    an address spans 128 bits) and the trees are built again on first use."""
    from types import SimpleNamespace as NS

    got = cache.get(_keys_digest(keys)) if cache else None
    if got is not None:
        return _Base(list(keys), got[0], got[1])
    rules = [NS(levels=[NS(options=lv[0], unless=lv[1]) for lv in k[0]], target=k[1], stateful_pos=None) for k in keys]
    return _Base(list(keys), flat_regions(NS(rules=rules, family=family)), {})


# ---- the tree cache: a deployment's built trees, so that a new process (the policy sync worker after a deploy or a
# restart) writes them without building them (docs/optimize.md, "Lazy trees"). Deterministic: a base's regions and
# trees follow from its rules' keys and the code that builds them, so entries are looked up by the keys and the cache
# is used only by the code that wrote it (`code`: a digest of the builder's sources).

CACHE_VERSION = 1


@functools.cache
def _code_digest() -> str:
    """The code a cached tree depends on: the tree builders and the front end that reads the rules' regions (a cache
    written by another version of either is not used)."""
    h = hashlib.sha256()
    front = Path(dtree.__file__).parent.parent / "iptables"
    for f in (dtree.__file__, __file__, *sorted(front.glob("*.py"))):
        h.update(Path(f).read_bytes())
    return h.hexdigest()[:16]


def _node_json(n: Node) -> list:
    b = n.body
    rg = [list(n.region.lo), list(n.region.hi)]
    if isinstance(b, Leaf):
        return [rg, list(b.rules)]
    tests = [list(t) if isinstance(t, tuple) else t for t in b.tests]
    return [rg, [b.kind, b.dim, tests, [_node_json(c) for c in b.children], _node_json(b.rest), b.guard]]


_NO_BOXES = np.zeros(0, dtype=np.int64)


def _node_of_json(doc: list) -> Node:
    (lo, hi), body = doc
    node = Node(Region(tuple(lo), tuple(hi)), _NO_BOXES)
    if body and isinstance(body[0], str):
        kind, dim, tests, children, rest, guard = body
        tests = [tuple(t) if isinstance(t, list) else t for t in tests]
        node.body = Split(kind, dim, tests, [_node_of_json(c) for c in children], _node_of_json(rest), guard)
    else:
        node.body = Leaf(list(body))
    return node


def _tree_json(tree: Tree) -> dict:
    return {"root": _node_json(tree.root), "size": tree.size, "linear": tree.linear, "emitted": tree.emitted_rules}


def _tree_of_json(doc: dict) -> Tree:
    return Tree(_node_of_json(doc["root"]), None, None, doc["size"], doc["linear"], doc["emitted"])


def _regs_of_json(regs: list) -> list:
    # (the boxes' corners stay lists: every reader indexes them or makes arrays of them)
    return [None if r is None else (r[0], r[1]) for r in regs]


def _keys_digest(keys) -> str:
    """A base's rules named by a digest of their keys (tuples and their JSON lists give the same)."""
    return hashlib.sha256(json.dumps(keys, separators=(",", ":")).encode()).hexdigest()


def cache_json(pool: dict) -> dict:
    """The built trees (and regions) of a program's bases, for the deployment's state (`cache_of_json`)."""
    bases = ([pool["k0"]] if pool.get("k0") is not None else []) + list(pool["chains"].values())
    return {
        "version": CACHE_VERSION,
        "code": _code_digest(),
        "bases": [
            {
                "keys": _keys_digest(b.keys),
                "regs": b.regs,
                "trees": [[list(run), list(p), _tree_json(t)] for (run, p), t in b.trees.items()],
            }
            for b in bases
        ],
    }


def cache_of_json(doc) -> dict:
    """{digest of the keys: (regs, trees)} of a cache_json document; empty when another version of the code wrote
    it."""
    if not isinstance(doc, dict) or doc.get("version") != CACHE_VERSION or doc.get("code") != _code_digest():
        return {}
    out = {}
    for b in doc.get("bases", []):
        trees = {(tuple(run), tuple(p)): _tree_of_json(t) for run, p, t in b["trees"]}
        out[b["keys"]] = (_regs_of_json(b["regs"]), trees)
    return out


_POOLS: dict[tuple, dict] = {}  # (base chain, family, min_segment) -> {"k0": _Base | None, "chains": {keys: _Base}}


def _pool_keys(pool: dict) -> dict:
    k0 = pool["k0"]
    return {"k0": list(k0.keys) if k0 is not None else None, "chains": sorted(list(k) for k in pool["chains"])}


class Bases:
    """The bases of one program's trees. Not live (`fresh`, no `live`): every tree is built. Live: a list of rules
    (K0T's whole policy, an interval chain) is written as the tree of the base it differs least from, K0's for K0T,
    any recorded interval chain's for a chain, when at most LAZY_DELTA rules changed and each has a region; else its
    tree is built and becomes its base. `recorded`: the bases as the deployment recorded them (this process may not
    have built them). `commit()` keeps this program's bases for the next follow in this process, and returns them
    for the deployment to record when they changed."""

    def __init__(self, pol, min_segment: int, live: bool, fresh: bool, recorded: dict | None = None,
                 cache: Callable[[], dict] | None = None):  # fmt: skip
        """`cache`: reads the deployment's tree cache (`cache_of_json`), called only when this process holds no
        trees of the recorded bases."""
        self.pol, self.live = pol, live
        self.built = 0  # trees built by this program (a follow that reuses every base's trees builds none)
        self.rebuilt_cheaper = 0  # lazy fits built anew because their diversion would write more rules
        self.keys = [rule_key(r) for r in pol.rules] if live else []
        self.pkey = (pol.base_chain, getattr(pol, "family", 4), min_segment)
        pool = None if fresh or not live else _POOLS.get(self.pkey)
        if (
            live
            and not fresh
            and recorded is not None
            and (pool is None or _pool_keys(pool) != _pool_keys_of(recorded))
        ):
            got = cache() if cache is not None else {}
            fam = self.pkey[1]
            pool = {
                "k0": _base_of_keys(recorded["k0"], got, fam) if recorded.get("k0") else None,
                "chains": {tuple(k): _base_of_keys(k, got, fam) for k in recorded.get("chains", [])},
            }
        self.old = pool or {"k0": None, "chains": {}}
        self.new: dict = {"k0": None, "chains": {}}
        self._regs: dict[int, tuple | None] = {}
        self._counts: dict[int, Counter] = {}

    def regs(self, idx) -> list:
        """The policy rules' regions (flat_regions), parsed once per program."""
        missing = [i for i in idx if i not in self._regs]
        if missing:
            got = flat_regions(self.pol, set(missing))
            for i in missing:
                self._regs[i] = got[i]
        return [self._regs[i] for i in idx]

    def fit(self, idx: list[int], k0: bool = False, per_box: int | None = None) -> _Fit:
        """The policy's rules `idx` (in order) as a tree: of a base with at most LAZY_DELTA changes, or built.
        `per_box` (the dispatch rules a diversion box adds where the tree is written): a lazy fit whose diversion
        writes more rules than the tree built anew is built anew, so that a follow loads no more than a rebuild
        (docs/optimize.md, "What a follow loads"); counted in `rebuilt_cheaper`."""
        best = None
        if self.live:
            keys = [self.keys[i] for i in idx]
            if k0:
                cands = [self.old["k0"]] if self.old["k0"] is not None else []
            else:
                same = self.old["chains"].get(tuple(keys))
                cands = [same] if same is not None else self._near(keys)
            for base in cands:
                f = self._fit(base, keys, idx)
                if f is not None and (best is None or len(f.changed) < len(best.changed)):
                    best = f
        if best is not None and best.changed and per_box is not None:
            rebuilt = rebuild_rules(best, len(idx))
            if rebuilt is not None and diversion_rules(best, per_box) > rebuilt:
                self.rebuilt_cheaper += 1
                best = None
        if best is None:
            base = _Base([self.keys[i] for i in idx] if self.live else [], self.regs(idx), {})
            best = _Fit(base, list(idx), [], [], True)
        return best

    def keep(self, fit: _Fit, k0: bool = False) -> None:
        """`fit`'s base is a base of this program (its tree was written)."""
        if k0:
            self.new["k0"] = fit.base
        else:
            self.new["chains"][tuple(fit.base.keys)] = fit.base

    def commit(self) -> dict | None:
        if not self.live:
            return None
        _POOLS[self.pkey] = self.new
        now = _pool_keys(self.new)
        return now if now != _pool_keys(self.old) else None

    def cache_json(self) -> dict | None:
        """The bases' trees for the deployment's tree cache when this program built any (else it holds them)."""
        return cache_json(self.new) if self.live and self.built else None

    def _near(self, keys: list) -> list[_Base]:
        """The recorded chains' bases whose rules differ from `keys` by at most LAZY_DELTA (as multisets)."""
        have = Counter(keys)
        out = []
        for base in self.old["chains"].values():  # a tree built in this program is its own chain's
            if abs(len(base.keys) - len(keys)) > LAZY_DELTA:
                continue
            c = self._counts.get(id(base))
            if c is None:
                c = self._counts[id(base)] = Counter(base.keys)
            if (c - have).total() + (have - c).total() <= LAZY_DELTA:
                out.append(base)
        return out

    def _fit(self, base: _Base, keys: list, idx: list[int]) -> _Fit | None:
        if base.keys == keys:
            return _Fit(base, list(idx), [], None, False)
        sm = difflib.SequenceMatcher(None, base.keys, keys, autojunk=False)
        at: list[int | None] = [None] * len(base.keys)
        kept: set[int] = set()
        for a, b, n in sm.get_matching_blocks():
            for x in range(n):
                at[a + x] = b + x
                kept.add(b + x)
        gone = [p for p, m in enumerate(at) if m is None]
        new = [q for q in range(len(keys)) if q not in kept]
        if len(gone) + len(new) > LAZY_DELTA:
            return None
        regs_new = self.regs([idx[q] for q in new])
        covers = [base.regs[p] for p in gone] + regs_new
        if any(c is None for c in covers):
            return None
        inv = {b: a for a, b in enumerate(at) if b is not None}
        of_new = dict(zip(new, regs_new, strict=True))
        live_regs = [base.regs[inv[q]] if q in inv else of_new[q] for q in range(len(keys))]
        remap = [idx[m] if m is not None else None for m in at]
        return _Fit(base, remap, [c[0] for c in covers], live_regs, False)


def _pool_keys_of(recorded: dict) -> dict:
    k0 = recorded.get("k0")
    return {"k0": list(k0) if k0 else None, "chains": sorted(list(k) for k in recorded.get("chains", []))}


def live_k0_blocked(pol, live_only: Callable[[int], bool]) -> str:
    """Why a live deployment's K0 stays the live list ("" when it may walk a tree). An IPv6 policy (the IPv6 side of a
    dual-stack xdp deployment) may: the xdp program marks the IPv6 frames it passes unparsed too (CONTROL bit 7)."""
    if pol.resolved:
        return "the policy's interface checks were resolved against the NIC's ports (exact for NIC frames only)"
    if not pol.rules:
        return "the policy has no rules"
    for i in range(len(pol.rules)):
        if live_only(i):
            r = pol.rules[i]
            what = "per-rule state" if r.stateful_pos is not None else f"a jump into the operator's chain {r.target}"
            return f"flattened rule {i} has {what}, which only the live chain may run"
    return ""


def _meets(boxes, box) -> bool:
    """Does a rule's region_any meet a diversion box (src, dst, protocol ranges)?"""
    slo, shi, dlo, dhi, plo, phi = box
    return any(
        lo[0] <= shi and slo <= hi[0] and lo[1] <= dhi and dlo <= hi[1] and lo[2] <= phi and plo <= hi[2]
        for lo, hi in boxes
    )


def _boxes(fit: _Fit) -> list[tuple]:
    """The distinct boxes (src, dst, protocol ranges) of the changed rules' region_any, one diversion each."""
    seen: dict[tuple, None] = {}
    for boxes in fit.changed:
        for lo, hi in boxes:
            plo, phi = lo[2], hi[2]
            if plo != phi:
                plo, phi = 0, 255  # iptables' -p names one protocol: a wider box is still a cover
            seen[(lo[0], hi[0], lo[1], hi[1], plo, phi)] = None
    return list(seen)


def diversion_rules(fit: _Fit, per_box: int) -> int:
    """The rules a lazy fit's diversion writes: per box its chain (the live rules that can act there and the tail's
    one rule) and `per_box` dispatch rules in the chains that test it."""
    return sum(1 + per_box + sum(1 for rg in fit.live_regs if rg is None or _meets(rg[0], box)) for box in _boxes(fit))


def rebuild_rules(fit: _Fit, n_live: int) -> int | None:
    """What building the tree of the `n_live` live rules anew would write, estimated by what the base's trees write
    with each rule inserted since written once more and each deleted once less (the same run of rules up to the few
    changed); None when this process holds none of the base's trees (they are built either way)."""
    runs: dict[tuple, int] = {}
    for (run, _), tree in fit.base.trees.items():
        runs[run] = max(runs.get(run, 0), tree.emitted_rules)
    if not runs:
        return None
    deleted = sum(p is None for p in fit.remap)
    inserted = n_live - (len(fit.remap) - deleted)
    return sum(runs.values()) + inserted - deleted


def _diversions(prog, kit, fit: _Fit, idx: list[int], name: Callable[[], str], tail: list) -> list:
    """One `hdr` rule per distinct box of the changed rules' region_any (-s, -d, -p), going to a chain (`name()`)
    that holds, in order, every rule of the live list `idx` that can act on a frame of the box (its region_any meets
    it; a rule without a region too), then `tail`: the live list for the affected part, the rules that cannot act
    there left out. The tree after the diversion holds the base's kept rules only."""
    pol = prog.policy
    six = getattr(pol, "family", 4) == 6
    top = (1 << 128) - 1 if six else 0xFFFFFFFF
    addr = (lambda a: str(ipaddress.IPv6Address(a))) if six else (lambda a: str(ipaddress.IPv4Address(a)))
    amap = getattr(pol, "addr_map", None)
    out = []
    for box in _boxes(fit):
        slo, shi, dlo, dhi, plo, phi = box
        opts: list[str] = []
        if (slo, shi) != (0, top) or (dlo, dhi) != (0, top):
            opts += ["-m", "iprange"]
            if (slo, shi) != (0, top):
                opts += ["--src-range", f"{addr(slo)}-{addr(shi)}"]
            if (dlo, dhi) != (0, top):
                opts += ["--dst-range", f"{addr(dlo)}-{addr(dhi)}"]
        if (plo, phi) != (0, 255):
            opts = ["-p", str(plo), *opts]
        chain = name()
        acting = [j for j, rg in zip(idx, fit.live_regs, strict=True) if rg is None or _meets(rg[0], box)]
        prog.chains[chain] = [*kit.lines(pol, acting), *tail]
        test = ("box", *box)
        if amap is not None:
            # the model's headers carry the policy's ranks: the ranks the box's addresses fall in. A rank holds no
            # bound of a live rule inside it, so a live rule that acts on any address of a rank the box reaches meets
            # the box, and is in the chain: the model diverts as exactly as the kernel (which tests the addresses)
            test = ("box", amap.rank("src", slo), amap.rank("src", shi), amap.rank("dst", dlo),
                    amap.rank("dst", dhi), plo, phi)  # fmt: skip
        out.append(kit.rule("hdr", chain, goto=True, options=tuple(opts), test=test))
    return out


def live_k0(prog, kit: Kit, nft_max_depth: int, min_segment: int, bases: Bases, chain: str) -> dict:
    """A live deployment's K0 tree: chain `chain` (K0T), entered with a goto for the mark value HF_MARK_K0_TREE
    (the fast path's unparsed frames while it trusts its tables), walks the policy as trees and ends with its chain
    policy. The tree is the one built for the policy of the last rebuild (its base, `bases`); the flattened rules
    changed since (deleted from the base, inserted in the live policy) come first as `hdr` rules that send a frame in
    their -s/-d/-p to a linear chain K0D<n> of the live policy's rules that can act there (`_diversions`): outside
    every changed rule's -s/-d/-p the base's walk and the live policy's pass the same rules in the same order (the
    base's deleted rules are left out of the leaves). A rebuild (a fresh `bases`, more than LAZY_DELTA changes, a
    changed rule no region covers) builds the tree of the live policy. Returns the summary (`k0_tree`: "built",
    "lazy" or why not, `k0_changed`, trees, rules)."""
    pol = prog.policy
    everything = list(range(len(pol.rules)))
    fit = bases.fit(everything, k0=True, per_box=1)
    prog.chains[chain] = []  # placed for the depth computation
    t = _Trees(prog, min_segment, kit)
    t.bases = bases
    t.use(fit)
    depth = _depths(prog)
    _helper_depth = kit.helper_depth
    uh = _user_height(pol)
    deepest = max((_helper_depth(r) + (1 + uh[r.target] if r.target in uh else 0) for r in pol.rules), default=0)
    room = min(Params().max_depth, nft_max_depth - depth.get(chain, 2) - 2 - deepest)
    lines = t.rewrite(list(range(len(fit.remap))), room)
    if t.trees == 0:
        del prog.chains[chain]
        return {"k0_tree": "no run long enough for a tree", "k0_changed": len(fit.changed)}
    bases.keep(fit, k0=True)
    n = iter(range(1 << 30))
    prog.chains[chain] = [
        kit.rule("unmark", mask=prog.mark_mask & 0xFFFFFFFF),
        *_diversions(prog, kit, fit, everything, lambda: prog.name(f"K0D{next(n)}"), [kit.rule("always", pol.default)]),
        *lines,
        kit.rule("always", pol.default),
    ]
    return {
        "k0_tree": "built" if fit.fresh else "lazy",
        "k0_changed": len(fit.changed),
        "k0_trees": t.trees,
        "k0_rules_in_trees": t.rules_in,
        "k0_rules_written": t.rules_out,
    }
