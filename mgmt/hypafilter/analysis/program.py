"""Software strategies (paper §VI) as netfilter chains: one chain program, emitted as iptables-restore or nft text.

`build_program(plan, strategy)` builds the chains once as data (`Program`); the emitters only render it and
`Program.run` interprets it, so the Python model of the hybrid (model.hybrid_verdict) executes exactly the chain
structure that gets loaded. Strategies:

  full         every shunted packet runs the whole original policy
  cut          complex rules + simple rules from the first shunting rule on (paper §VI-B)
  hsa_cut      complex rules + simple rules whose Alg. 1 bit is set or whose entry shunts anyway (Plan.hsa_members;
               exact with selective/exact shunting only)
  interval     binary search on the mark → chain C_k of complex rules above the interval → hardware action
  interval_geo interval, keeping in C_k only complex rules whose reduction meets the interval's shunted boxes
  tree         interval, with the k = 0 path (K0, not live; K0T, live on xdp and emu: the frames marked HF_MARK_K0_TREE)
               and long interval chains (2 × Config.tree_min_segment rules and more) walked as decision trees
               (analysis.trees over analysis.dtree; docs/optimize.md), live ones rebuilt lazily

Chains, all named prefix+…: MAIN (entry), K0 (mark k = 0: FULL then the chain policy), K0T (strategy tree, live: the
mark value HF_MARK_K0_TREE; the changes since the tree's base returned to the live rules, the tree, the chain
policy), FULL (original policy
verbatim, user chains renamed prefix+name), CUT, D<n> (dispatch nodes), L<k>A<a> (leaf: the complex rules above
interval k, as jumps to segment and block chains, then the action), C<k> (segment: the complex rules interval k's
chain adds to the previous interval's), B<f>L<l>N<i> (block of B^l consecutive segments of chain family f),
R<i>L<j> (helper chains
that rebuild a multi-level flattened rule exactly), T<n> (strategy tree: a tree's nodes, leaves and linear copy),
K0D<n> and TD<n> (strategy tree, live: the rules changed since a tree's base, ahead of K0T's and a chain's tree),
and the renamed user chains. Dispatch compares the whole mark
value under the mask and the mark is never read after complex rules ran.

Nesting depth: nf_tables refuses a ruleset whose chains nest deeper than NFT_JUMP_STACK_SIZE (16) below a base
chain ("Too many links"), and its validator counts a goto like a jump. So the dispatch tree and the block
hierarchy have a fixed number of levels whatever the number of intervals (their fan-out grows instead), chosen
so that base chain -> MAIN -> dispatch -> leaf -> blocks -> helper chains stays within MAX_DEPTH.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from hypafilter.analysis import trees
from hypafilter.analysis.dtree import DIMS as TREE_DIMS
from hypafilter.analysis.plan import PrefixView
from hypafilter.config import MIRROR_STRATEGIES, STRATEGIES
from hypafilter.errors import HypafilterError
from hypafilter.ir import Header, Policy
from hypafilter.ir.semantics import ComplexEval, rule_outcome
from hypafilter.shared import C

K_SHIFT = C["HF_MARK_K_SHIFT"]
DECIDED_ACCEPT = C["HF_MARK_DECIDED_ACCEPT"]  # host mode: the hardware's ACCEPT is final (k = 0, action ACCEPT)
MARK_MIRROR = C["HF_MARK_MIRROR"]  # log mirroring: the mark's action nibble of a copy is action | MARK_MIRROR
K0_TREE = C["HF_MARK_K0_TREE"]  # strategy tree, live: an unparsed frame of a trusted fast path walks the K0 tree
LEAF_FANOUT = 4  # leaves tested linearly once a dispatch node holds this few
BLOCK_FANOUT = 8  # a family of more segments than this gets block chains (then more levels, up to the budget)
MAX_DEPTH = 8  # target nesting below the base chain (its jump to MAIN included); nf_tables allows 15
NFT_MAX_DEPTH = 15  # NFT_JUMP_STACK_SIZE - 1: one more nested jump and the kernel answers "Too many links"
MAX_CHAIN_NAME = 28  # iptables' limit (XT_EXTENSION_MAXNAMELEN - 1)


@dataclass(frozen=True)
class NfRule:
    """One rule of a generated chain.

    kind "mark": `-m mark --mark value/mask -j target`; "always": `-j target`; "block": `-j target` into a
    block/segment chain that returns (counted as one tested rule); "policy": flattened rule `index` of the policy
    (rendered from its levels; target its own; with `span` 2 also rule index + 1, its other conntrack part); "unmark": give back the mark bits the shim used (`mask`), so that
    the policy rules after it see the mark they would see without the hybrid (unconditional, not counted).
    """

    kind: str
    target: str = ""
    value: int = 0
    mask: int = 0
    index: int = -1
    # "policy" only: how many consecutive flattened rules from `index` this one line stands for: 2 for the hit and
    # miss parts of a rule split on conntrack state (iptables.ctstate), which render as the same rule
    span: int = 1
    # "mark"/"always": `-g` instead of `-j`: where the target chain ends, MAIN's caller goes on (a live deployment's
    # K0: the operator's rules after the base chain's jump decide, not the rest of MAIN)
    goto: bool = False
    # "hdr" only (strategy tree's dispatch): the option tokens the rule is written with and what they test, for
    # Program.run: ("proto", p), ("range", dim of analysis.dtree.DIMS, lo, hi, protocol or None), or ("guard", p):
    # a TCP/UDP frame without readable ports (never a Header of the model, whose frames are whole)
    options: tuple[str, ...] = ()
    test: tuple = ()


def hdr_holds(test: tuple, header: Header) -> bool:
    """Does a "hdr" rule's test hold for a (whole) header?"""
    if test[0] == "proto":
        return header.proto == test[1]
    if test[0] == "range":
        _, d, lo, hi, proto = test
        if proto is not None and header.proto != proto:
            return False
        return lo <= getattr(header, TREE_DIMS[d]) <= hi
    if test[0] == "box":  # the live K0 tree's diversion: -s, -d (ranges) and -p
        _, slo, shi, dlo, dhi, plo, phi = test
        return slo <= header.src <= shi and dlo <= header.dst <= dhi and plo <= header.proto <= phi
    return False  # "guard": the model's frames are whole first fragments


@dataclass
class Program:
    policy: Policy
    strategy: str
    prefix: str
    mark_mask: int
    mark_shift: int
    chains: dict[str, list[NfRule]] = field(default_factory=dict)  # in emission order; MAIN first
    verbatim_full: str = ""  # name of the FULL chain (rendered from Policy.original_rules)
    user_names: dict[str, str] = field(default_factory=dict)  # the policy's user chain -> the tool's copy of it
    # Live (a deployment, Plan.live): the policy stays in the kernel under its own chain names after the base chain's
    # jump to MAIN; K0 and every frame no leaf decides return to it, user chains are the operator's own (no copies).
    live: bool = False
    tree_stats: dict = field(default_factory=dict)  # strategy tree: trees built, rules in them, rules written
    k_base: int = 0  # added to the plan's k > 0 in the marks (build_program)

    def name(self, suffix: str) -> str:
        return self.prefix + suffix

    @property
    def main(self) -> str:
        return self.name("MAIN")

    def run(
        self, header: Header, mark: int, complex_eval: ComplexEval, trace: list[int] | None = None
    ) -> tuple[str, int]:
        """Interpret the program from MAIN: (verdict, conditional rules evaluated). `trace`, when given, gets the
        position of every flattened policy rule evaluated, in order."""
        count = [0]
        self._trace = trace
        verdict = self._run(self.main, header, mark, complex_eval, count, 0)
        if verdict is None and self.live:
            # MAIN returned to the base chain: the operator's rules after the jump decide (the live policy)
            for i in range(len(self.policy.rules)):
                count[0] += 1
                if trace is not None:
                    trace.append(i)
                out = rule_outcome(self.policy, i, header, complex_eval)
                if out:
                    return out, count[0]
            return self.policy.default, count[0]
        if verdict is None:
            raise HypafilterError(f"{self.main} fell through without a verdict (generator bug)")
        return verdict, count[0]

    def path_cost(self, mark: int) -> int:
        """Rules tested for `mark` when no policy rule matches (dispatch, block jumps, the leaf's complex rules)."""
        count = [0]
        self._run(self.main, None, mark, None, count, 0)
        return count[0]

    def _block_cost(self, chain: str) -> int:
        memo = self.__dict__.setdefault("_costs", {})
        if chain not in memo:
            memo[chain] = sum(1 + (self._block_cost(r.target) if r.kind == "block" else 0) for r in self.chains[chain])
        return memo[chain]

    def _run(
        self, chain: str, header: Header | None, mark: int, ev: ComplexEval | None, count: list[int], depth: int
    ) -> str | None:
        if depth > 64:
            raise HypafilterError("chain recursion too deep (generator bug)")
        for r in self.chains[chain]:
            if r.kind == "policy":
                count[0] += 1
                for i in range(r.index, r.index + r.span) if header is not None else ():
                    if getattr(self, "_trace", None) is not None:
                        self._trace.append(i)
                    out = rule_outcome(self.policy, i, header, ev)
                    if out:
                        return out
                continue
            if r.kind == "unmark":
                mark &= ~r.mask
                continue
            if r.kind == "hdr":
                count[0] += 1
                if header is None or not hdr_holds(r.test, header):
                    continue
            elif r.kind == "mark":
                count[0] += 1
                if (mark & r.mask) != r.value:
                    continue
            elif r.kind == "block":
                count[0] += 1
                if header is None:  # no policy rule matches: the block's cost is static (memoised)
                    count[0] += self._block_cost(r.target)
                    continue
            if r.target in ("ACCEPT", "DROP"):
                return r.target
            if r.target == "RETURN":
                return None
            out = self._run(r.target, header, mark, ev, count, depth + 1)
            if out is not None or r.goto:  # a goto's chain ending ends this one too
                return out
        return None


def dispatch_cost(prog: Program, mark: int) -> int:
    """Mark tests evaluated in MAIN and the dispatch nodes until a leaf (or the k = 0 / fallback jump) is taken."""
    count = 0
    chain = prog.main
    while True:
        for r in prog.chains[chain]:
            if r.kind == "mark":
                count += 1
                if (mark & r.mask) != r.value:
                    continue
                if r.target.startswith(prog.prefix + "D"):
                    chain = r.target
                    break
                return count
            elif r.kind == "always":
                return count
        else:
            return count


def _check_mark(mark_mask: int, mark_shift: int) -> None:
    if not 0 < mark_mask <= 0xFFFFFFFF or not 0 <= mark_shift < 32:
        raise HypafilterError("mark_mask must be a non-zero 32-bit mask and mark_shift 0..31")


def mark_for(prog: Program, k: int, action: int, foreign: int = 0) -> int:
    """The skb mark the shim writes for (k, action) — k the plan's interval, the program's k_base added to a k > 0 —,
    other bits taken from `foreign`."""
    k = k + prog.k_base if k else 0
    v = ((k << K_SHIFT) | action) << prog.mark_shift
    return ((foreign & ~prog.mark_mask) | (v & prog.mark_mask)) & 0xFFFFFFFF


def _field(prog: Program, v: int) -> int:
    placed = v << prog.mark_shift
    if placed & ~prog.mark_mask & 0xFFFFFFFF or placed > 0xFFFFFFFF:
        raise HypafilterError(
            f"mark value {v:#x} does not fit mark_mask {prog.mark_mask:#x} at shift {prog.mark_shift}: "
            "widen mark_mask or use fewer intervals"
        )
    return placed


def build_program(
    plan,
    strategy: str,
    prefix: str = "HF1_",
    mark_mask: int = 0xFFFFFFFF,
    mark_shift: int = 0,
    nic_mode: str = "bridge",
    k_base: int = 0,
) -> Program:
    """The chains of `strategy` for `plan`. nic_mode "host": MAIN first accepts the mark value "decided ACCEPT"
    (HF_MARK_DECIDED_ACCEPT: the hardware's ACCEPT is final) through chain DA, which gives back the mark bits.

    `k_base`: added to every interval k > 0 of the plan in the marks the dispatch tests and the leaves' names (the
    IPv6 plan of a dual-stack deployment numbers its intervals after the IPv4 plan's largest k, docs/ipv6.md); k = 0
    stays the full policy.

    Log mirroring (Plan.mirror, strategies interval/interval_geo/tree): leaf (k, action | HF_MARK_MIRROR) runs chain k
    on the copy, then DROP (bridge mode, and a copy of a DROP in host mode) or ACCEPT (host mode, copy of an ACCEPT:
    the frame itself); before the K0 fallback MAIN drops any other mark with the mirror bit (bridge mode) or of a
    copy of a DROP (host mode)."""
    if strategy not in STRATEGIES:
        raise HypafilterError(f"unknown strategy {strategy!r} (choose {', '.join(STRATEGIES)})")
    if nic_mode not in ("bridge", "host"):
        raise HypafilterError(f"unknown NIC mode {nic_mode!r} (bridge or host)")
    mirror = getattr(plan, "mirror", None)
    if mirror is not None and mirror.any() and strategy not in MIRROR_STRATEGIES:
        raise HypafilterError(
            f"the plan mirrors observing rules (built for strategy {getattr(plan, 'strategy', '?')}), which strategy "
            f"{strategy} cannot run on a copy: build the plan for strategy {strategy}"
        )
    if strategy == "hsa_cut" and plan.mode == "index":
        raise HypafilterError(
            "strategy hsa_cut is not exact with index-based shunting (a shunted packet may first match a simple "
            "rule the HSA cut set leaves out); use --mode selective or exact, or another strategy"
        )
    _check_mark(mark_mask, mark_shift)
    pol = plan.policy
    live = bool(getattr(plan, "live", False))
    if k_base < 0:
        raise HypafilterError(f"k_base must be >= 0, not {k_base}")
    prog = Program(pol, strategy, prefix, mark_mask, mark_shift, live=live, k_base=k_base)
    if len(prefix) + len("R99999L99") > MAX_CHAIN_NAME:
        raise HypafilterError(f"chain prefix {prefix!r} is too long: the tool's chain names must fit {MAX_CHAIN_NAME}")
    prog.user_names = {n: n for n in pol.user_chains} if live else user_chain_names(prefix, pol.user_chains)
    default = pol.default
    c = prog.chains
    main, k0, full = prog.name("MAIN"), prog.name("K0"), prog.name("FULL")
    c[main] = []
    kmask = (~0xF << mark_shift) & mark_mask & 0xFFFFFFFF
    # Every chain that runs policy rules first clears the bits the shim wrote: a packet from the NIC carries no
    # mark in those bits (the mark is scrubbed between namespaces and a DMA'd packet starts at 0), so the policy
    # sees exactly the mark it would see without the hybrid (ARCHITECTURE §5). Dispatch reads the mark before.
    unmark = NfRule("unmark", mask=mark_mask & 0xFFFFFFFF)
    to_k0 = NfRule("always", k0, goto=live)
    if strategy == "full":
        c[main] = [to_k0]
    elif strategy in ("cut", "hsa_cut") and live and any(_live_only(pol, i) for i in _cut_list(plan, strategy)):
        c[main] = [to_k0]  # the cut would copy a rule only the live chain runs: the live rules decide
    elif strategy in ("cut", "hsa_cut"):
        cut = prog.name("CUT")
        c[main] = [NfRule("mark", k0, 0, kmask, goto=live), NfRule("always", cut)]
        c[cut] = [unmark, *policy_rules(pol, _cut_list(plan, strategy)), NfRule("always", default)]
    else:
        chains = plan.geo_chains if strategy == "interval_geo" else plan.chains  # tree: interval's chains
        may = plan.may_shunt  # an entry forced on a flow-cache miss delivers (k, action) like a shunting one
        leaves = {(int(plan.interval[j]), int(plan.actions[j])) for j in range(plan.n + 1) if may[j]}
        if mirror is not None:  # a mirrored entry's copy carries (k, action | MARK_MIRROR)
            leaves |= {(int(plan.interval[j]), int(plan.actions[j]) | MARK_MIRROR) for j in np.flatnonzero(mirror)}
        leaves = sorted(leaves)
        c[main] = [NfRule("mark", k0, 0, kmask, goto=live)]
        # Depth budget below MAIN: dispatch levels (MAIN's test included) + block levels + the deepest helper chain
        # of a complex rule, so that base -> MAIN -> ... stays within MAX_DEPTH.
        budget = max(2, MAX_DEPTH - 1 - max((_helper_depth(pol.rules[i]) for i in pol.complex_indices), default=0))
        d_levels = (budget + 1) // 2

        if live:
            # A frame whose chain would run a rule only the live chain runs (_live_only: per-rule state, a jump into
            # an operator's chain) goes to the operator's rules: no leaf, so MAIN returns to the live chain.
            leaves = [
                (k, a) for k, a in leaves if a & MARK_MIRROR or not any(_live_only(pol, i) for i in chains.get(k) or ())
            ]

        def chain_of(k: int, a: int):
            ch = chains.get(k)
            if live and ch and a & MARK_MIRROR:
                # a copy comes from an entry no deciding complex rule can see (the plan shunts those entries): a rule
                # only the live chain runs is left out of its chain, since no copy reaches it
                ch = [i for i in ch if not _live_only(pol, i)]
            return ch

        families = _families([(k, chain_of(k, a)) for k, a in leaves])
        pieces = _Blocks(prog, families, budget - d_levels)
        leaf_rules = []
        for k, a in leaves:
            verdict = {1: "ACCEPT", 2: "DROP"}.get(a, default)
            if a & MARK_MIRROR:  # a copy: discarded, except in host mode where a copy of an ACCEPT is the frame
                verdict = "ACCEPT" if nic_mode == "host" and a & ~MARK_MIRROR == 1 else "DROP"
            ch = chain_of(k, a)
            km = k + k_base if k else 0  # the k the mark carries
            if ch:
                lname = prog.name(f"L{km}A{a}")
                c[lname] = [unmark, *(NfRule("block", t) for t in pieces.cover(ch)), NfRule("always", verdict)]
                tgt = lname
            else:
                tgt = verdict
            leaf_rules.append(((km << K_SHIFT) | a, tgt))
        _dispatch(prog, main, leaf_rules, d_levels, [0])
        if mirror is not None and mirror.any():
            # A copy is never forwarded or delivered: a mark with the mirror bit that no leaf took is dropped, not
            # sent through the full policy. In host mode only the copy of a DROP (action nibble 0x6): the "copy" of
            # an ACCEPT is the frame itself, which the full policy then decides. (A plan without mirroring has no
            # copies: the hardware sends none with its generation, and deploy shunts everything while the tables
            # change.)
            if nic_mode == "bridge":
                mm = _field(prog, MARK_MIRROR)
                c[main].append(NfRule("mark", "DROP", mm, mm))
            else:
                c[main].append(NfRule("mark", "DROP", _field(prog, MARK_MIRROR | 2), _field(prog, 0xF)))
        c[main].append(to_k0)  # a mark no leaf knows: the full policy decides
    if nic_mode == "host":
        # Host mode: a frame the hardware accepted reaches INPUT with the "decided" value (k = 0, action ACCEPT),
        # which no leaf uses and which the K0 test would otherwise send through the whole policy. Bridge mode never
        # sees it (no frame carries reason 5), and its chains stay as they were.
        da = prog.name("DA")
        c[main].insert(0, NfRule("mark", da, _field(prog, DECIDED_ACCEPT), mark_mask & 0xFFFFFFFF))
        c[da] = [unmark, NfRule("always", "ACCEPT")]
    if live:
        # falls off: back through MAIN to the base chain, whose rules after the jump are the policy (strategy tree:
        # K0 stays the live list, only long interval chains get trees)
        c[k0] = [unmark]
    else:
        c[k0] = [unmark, NfRule("always", full), NfRule("always", default)]
        c[full] = policy_rules(pol, range(len(pol.rules)))
        prog.verbatim_full = full
    if strategy == "tree":
        kit = trees.Kit(NfRule, policy_rules, _helper_depth)
        min_segment = getattr(plan, "tree_min_segment", 16)
        # A live deployment's trees are rebuilt lazily (docs/optimize.md, "Lazy trees"): `plan.trees_fresh` False (a
        # follow) writes each tree of the last rebuild (`plan.tree_bases`: as the deployment recorded them) with the
        # rules changed since diverted to a linear chain ahead of it.
        # The IPv6 side of a dual-stack deployment (a ranked plan, family 6) too: its trees' cuts are ranks of each
        # run's own boxes (written back as addresses), its bases and cache the deployment's family-6 ones.
        bases = trees.Bases(
            pol,
            min_segment,
            live=live,
            fresh=getattr(plan, "trees_fresh", True),
            recorded=getattr(plan, "tree_bases", None),
            cache=getattr(plan, "tree_cache", None),
        )
        prog.tree_stats = trees.treeify(prog, kit, NFT_MAX_DEPTH, min_segment, bases)
        if live and getattr(plan, "k0_tree", False):
            # The live K0 tree (docs/optimize.md, "The live K0 tree"): only frames with the mark value K0_TREE walk
            # it; every other k = 0 frame keeps the live list.
            why = trees.live_k0_blocked(pol, lambda i: _live_only(pol, i))
            if why:
                prog.tree_stats["k0_tree"] = why
            else:
                k0t = prog.name("K0T")
                prog.tree_stats.update(trees.live_k0(prog, kit, NFT_MAX_DEPTH, min_segment, bases, k0t))
                if k0t in c:
                    at = 1 if nic_mode == "host" else 0  # after host mode's decided-ACCEPT test
                    c[main].insert(at, NfRule("mark", k0t, _field(prog, K0_TREE), mark_mask & 0xFFFFFFFF, goto=True))
        if live:
            prog.tree_stats["trees_built"] = bases.built  # K0T's included
            prog.tree_stats["rebuilt_cheaper"] = bases.rebuilt_cheaper
        recorded = bases.commit()
        if recorded is not None:  # bases built (or dropped) here: the deployment records them (ops.deploy)
            plan.tree_bases_built = recorded
        built = bases.cache_json()
        if built is not None:  # trees built here: the deployment keeps them for a new process (ops.deploy)
            plan.tree_cache_built = built
        if live:
            plan.tree_stats = dict(prog.tree_stats)  # what the deployment's chains hold (its state, `status`)
    return prog


def k0_tree_wanted(plan, strategy: str) -> bool:
    """Does a live deployment of `plan` under `strategy` give its unparsed frames the K0 tree (the fast path then
    marks them HF_MARK_K0_TREE)? `plan.k0_tree`: the deployment's fast path can mark them (ops.deploy: xdp, emu)."""
    pol = plan.policy
    return (
        strategy == "tree"
        and bool(getattr(plan, "live", False))
        and bool(getattr(plan, "k0_tree", False))
        and not trees.live_k0_blocked(pol, lambda i: _live_only(pol, i))
    )


def _live_only(pol, i: int) -> bool:
    """Rules of a live deployment that the tool's chains never copy: a base-chain rule with per-rule state (its
    bucket is the operator's rule's) and a jump into one of the operator's chains (a reference from the tool's
    chains would keep `iptables -X` from deleting it)."""
    r = pol.rules[i]
    return r.stateful_pos is not None or r.target in pol.user_chains


def twins(pol, i: int, j: int) -> bool:
    """Are flattened rules i and j = i + 1 the hit and miss parts of one rule split on conntrack state?"""
    if i < 0 or j != i + 1 or j >= len(pol.rules):
        return False
    a, b = pol.rules[i], pol.rules[j]
    return (a.ct_part, b.ct_part) == ("hit", "miss") and (a.levels, a.origin, a.target, a.target_args) == (
        b.levels,
        b.origin,
        b.target,
        b.target_args,
    )


def policy_rules(pol, indices) -> list[NfRule]:
    """The "policy" lines for these flattened rules, in order: the two parts of a split rule next to each other are
    one line (they render as the same rule, which holds for a frame exactly when one of them does)."""
    out: list[NfRule] = []
    for i in indices:
        i = int(i)
        if out and out[-1].span == 1 and twins(pol, out[-1].index, i):
            out[-1] = NfRule("policy", index=out[-1].index, span=2)
        else:
            out.append(NfRule("policy", index=i))
    return out


def _cut_list(plan, strategy: str) -> list[int]:
    pol = plan.policy
    if strategy == "hsa_cut":
        return [int(i) for i in np.flatnonzero(plan.hsa_members())]
    may = plan.may_shunt
    shunted = [plan.entries[j].rule_index for j in range(plan.n) if may[j]]
    beta = min(shunted) if shunted else len(pol.rules)
    return [i for i, r in enumerate(pol.rules) if not r.is_simple or i >= beta]


def _helper_depth(rule) -> int:
    """Nested jumps through R<i>L<j> (or S<pos>) helper chains that rendering flattened rule `rule` adds."""
    if rule.stateful_pos is not None:
        return 1
    lv = rule.levels
    if not lv or (len(lv) == 1 and not lv[0].unless):
        return 0
    return len(lv) - 1 + (1 if lv[0].unless else 0)


def _chain_key(ch) -> tuple:
    # A prefix view of the complex list is identified by its length, without copying it.
    return ("P", len(ch)) if isinstance(ch, PrefixView) else ("T", tuple(ch))


def _families(chain_list) -> list[tuple[object, list[int], set, list[int]]]:
    """Group the interval chains into families of prefixes of one base list: (base, sorted prefix lengths, keys).

    All prefix views share the complex list. Explicit lists (interval_geo, exact mode) form a family while each
    chain (in interval order) extends the previous one, which is how chains above consecutive intervals grow.
    """
    views: dict[int, tuple[object, set]] = {}
    runs: list[list[tuple]] = []
    first: dict[tuple, int] = {}  # chain key -> the first interval k with that chain (names its segment C<k>)
    for k, ch in chain_list:
        if not ch:
            continue
        first.setdefault(_chain_key(ch), k)
        if isinstance(ch, PrefixView):
            views.setdefault(id(ch.base), (ch.base, set()))[1].add(len(ch))
            continue
        t = tuple(ch)
        last = runs[-1][-1] if runs else None
        if last is not None and t == last:
            continue
        if last is not None and len(last) < len(t) and t[: len(last)] == last:
            runs[-1].append(t)
        else:
            runs.append([t])
    out = [
        (base, sorted(lengths), {("P", n) for n in lengths}, [first[("P", n)] for n in sorted(lengths)])
        for base, lengths in views.values()
    ]
    out += [(run[-1], [len(t) for t in run], {("T", t) for t in run}, [first[("T", t)] for t in run]) for run in runs]
    return out


class _Blocks:
    """Segment and block chains of every family, built on first use, and the cover of each interval chain.

    Segment j of a family holds the rules between its (j-1)-th and j-th prefix lengths. A level-1 block holds the
    rules of B consecutive segments; a level-l block (l >= 2) jumps to B level-(l-1) blocks. A prefix of p segments
    is covered by whole blocks from the top level down and then single segments: at most (B-1) jumps per level,
    nesting at most `levels` deep: a family uses the fewest levels that keep B <= BLOCK_FANOUT (or all of them,
    B growing instead). Every complex rule is written at most twice (its level-1 block and its segment).
    """

    def __init__(self, prog: Program, families, levels: int):
        self.prog = prog
        self.where: dict[tuple, tuple[int, int]] = {}  # chain key -> (family, segments in the prefix)
        self.fam = []
        taken: set[str] = set()
        for f, (base, lengths, keys, firsts) in enumerate(families):
            # segment j is C<k> for the first interval k with its chain; two families can share that k (a live
            # deployment's mirror copies walk an explicit list of the same rules as the shunted frames' prefix
            # view), and a second C<k> would silently reuse the first family's segment: C<k>F<f> then
            names = [f"C{k}" if f"C{k}" not in taken else f"C{k}F{f}" for k in firsts]
            taken.update(names)
            m = len(lengths)
            # As few levels as keep a leaf's jumps below BLOCK_FANOUT per level, at most `levels`.
            lv = 0
            while lv < max(1, levels) and m > BLOCK_FANOUT ** (lv + 1):
                lv += 1
            b = 2
            while b ** (lv + 1) < m:
                b += 1
            self.fam.append((base, lengths, b, lv, names))
            pos = {n: j + 1 for j, n in enumerate(lengths)}
            for key in keys:
                self.where[key] = (f, pos[key[1] if key[0] == "P" else len(key[1])])

    def _rules(self, f: int, j0: int, j1: int) -> list[NfRule]:
        base, lengths = self.fam[f][:2]
        return policy_rules(self.prog.policy, base[(lengths[j0 - 1] if j0 else 0) : lengths[j1 - 1]])

    def _block(self, f: int, level: int, i: int) -> str:
        name = self.prog.name(self.fam[f][4][i] if level == 0 else f"B{f}L{level}N{i}")
        if name not in self.prog.chains:
            b = self.fam[f][2]
            if level <= 1:
                self.prog.chains[name] = self._rules(f, i * b**level, (i + 1) * b**level)
            else:
                self.prog.chains[name] = [NfRule("block", self._block(f, level - 1, i * b + x)) for x in range(b)]
        return name

    def cover(self, ch) -> list[str]:
        """Chains whose concatenation is `ch`: whole blocks from the top level down, then single segments."""
        f, p = self.where[_chain_key(ch)]
        b, lv = self.fam[f][2], self.fam[f][3]
        out, start = [], 0
        for level in range(lv, -1, -1):
            size = b**level
            while start + size <= p:
                out.append(self._block(f, level, start // size))
                start += size
        return out


def _dispatch(prog: Program, chain: str, leaves: list[tuple[int, str]], levels: int, counter: list[int]) -> None:
    """Append to `chain` a search over the (sorted) leaf values that nests at most `levels` chains deep.

    A node splits its leaves into about len ** (1 / levels) groups along the binary trie of the values (largest
    group first), so each group is one value/mask test; a group of one leaf is tested directly.
    """
    full_mask = prog.mark_mask & 0xFFFFFFFF
    if levels <= 1 or len(leaves) <= LEAF_FANOUT:
        for v, tgt in leaves:
            prog.chains[chain].append(NfRule("mark", tgt, _field(prog, v), full_mask))
        return
    want = 2
    while want**levels < len(leaves):
        want += 1
    groups = [leaves]
    while len(groups) < want:
        big = max(range(len(groups)), key=lambda g: len(groups[g]))
        grp = groups[big]
        if len(grp) == 1:
            break
        bit = (grp[0][0] ^ grp[-1][0]).bit_length() - 1
        groups[big : big + 1] = [[x for x in grp if not (x[0] >> bit) & 1], [x for x in grp if (x[0] >> bit) & 1]]
    for grp in groups:
        if len(grp) == 1:
            v, tgt = grp[0]
            prog.chains[chain].append(NfRule("mark", tgt, _field(prog, v), full_mask))
            continue
        low = (grp[0][0] ^ grp[-1][0]).bit_length()  # the bits the group's values differ in
        value = _field(prog, grp[0][0] >> low << low)
        mask = full_mask & ~((1 << (low + prog.mark_shift)) - 1) & 0xFFFFFFFF
        counter[0] += 1
        sub = prog.name(f"D{counter[0]}")
        prog.chains[sub] = []
        prog.chains[chain].append(NfRule("mark", sub, value, mask))
        _dispatch(prog, sub, grp, levels - 1, counter)


# ---------------------------------------------------------------- rule placement (shared by every renderer)


@dataclass(frozen=True)
class Placed:
    """One generated rule in iptables token form: option tokens, then a target. `chain` says the target is a chain
    of the program (a jump), otherwise it is a verdict or extension target with `args`."""

    options: tuple[str, ...]
    target: str
    args: tuple[str, ...] = ()
    chain: bool = False


def user_chain_names(prefix: str, names) -> dict[str, str]:
    """The tool's name for each of the policy's user chains: prefix, `U<i>_` and as much of the original name as
    fits iptables' 28 characters. The index makes every name unique and keeps it apart from the tool's own
    chains (MAIN, K0, FULL, CUT, D<n>, L<k>A<a>, C<k>, B.., R<i>L<j>, S<p>), whatever the user chains are called
    and however long their names are (any legal name, up to 28 characters)."""
    return {n: f"{prefix}U{i}_{n}"[:MAX_CHAIN_NAME] for i, n in enumerate(sorted(names))}


def resolve_target(prog: Program, target: str, args: tuple[str, ...] = ()) -> Placed:
    """A rule's target as loaded: RETURN in the base chain is the chain policy; user chains get the prefix."""
    if target == "RETURN":
        return Placed((), prog.policy.default)
    if target in prog.user_names:
        return Placed((), prog.user_names[target], chain=True)
    return Placed((), target, tuple(args))


def rename_jumps(prog: Program, toks: tuple[str, ...]) -> tuple[str, ...]:
    """Verbatim rule tokens with jumps/gotos to the policy's user chains renamed to the program's copies."""
    out = list(toks)
    for i in range(1, len(out)):
        if out[i - 1] in ("-j", "-g", "--jump", "--goto") and out[i] in prog.user_names:
            out[i] = prog.user_names[out[i]]
    return tuple(out)


def place_policy_rule(prog: Program, index: int, helpers: dict[str, list[Placed]]) -> Placed:
    """How flattened rule `index` is written into a chain: one rule, plus (in `helpers`) the R<i>L<j> helper
    chains that rebuild a multi-level rule exactly — each level's RETURN guards, then its options jumping on."""
    r = prog.policy.rules[index]
    if not r.levels:
        raise HypafilterError(f"rule {index} has no option levels: cannot write it back to netfilter")
    tgt = resolve_target(prog, r.target, r.target_args)
    levels = r.levels
    if r.stateful_pos is not None:
        # Per-rule state (a limit's bucket, a quota, a recent list): one copy, in S<pos>, reached by every chain
        # that tests the rule (interval segments, blocks, CUT and the verbatim FULL chain alike).
        name = prog.name(f"S{r.stateful_pos}")
        helpers[name] = [Placed(levels[0].options, tgt.target, tgt.args, tgt.chain)]
        return Placed((), name, chain=True)
    if len(levels) == 1 and not levels[0].unless:
        return Placed(levels[0].options, tgt.target, tgt.args, tgt.chain)
    names = [prog.name(f"R{index}L{j + 1}") for j in range(len(levels))]
    for j, lv in enumerate(levels):
        if (j == 0 and not lv.unless) or names[j] in helpers:
            continue
        body = [Placed(tuple(u), "RETURN") for u in lv.unless]
        if j == len(levels) - 1:
            body.append(Placed(lv.options, tgt.target, tgt.args, tgt.chain))
        else:
            body.append(Placed(lv.options, names[j + 1], chain=True))
        helpers[names[j]] = body
    if levels[0].unless:
        return Placed((), names[0], chain=True)
    return Placed(levels[0].options, names[1], chain=True)


def original_placements(prog: Program, helpers: dict[str, list[Placed]]) -> list[Placed | tuple[str, ...]]:
    """The FULL chain: the base chain's rules verbatim (user-chain jumps renamed), except that a rule with per-rule
    state is the jump to its one copy (`place_policy_rule`)."""
    by_pos = {r.stateful_pos: i for i, r in enumerate(prog.policy.rules) if r.stateful_pos is not None}
    return [
        place_policy_rule(prog, by_pos[pos], helpers) if pos in by_pos else rename_jumps(prog, toks)
        for pos, toks in enumerate(prog.policy.original_rules)
    ]
