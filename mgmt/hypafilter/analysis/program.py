"""Software strategies (paper §VI) as netfilter chains: one chain program, emitted as iptables-restore or nft text.

`build_program(plan, strategy)` builds the chains once as data (`Program`); the emitters only render it and
`Program.run` interprets it, so the Python model of the hybrid (model.hybrid_verdict) executes exactly the chain
structure that gets loaded. Strategies:

  full         every shunted packet runs the whole original policy
  cut          complex rules + simple rules from the first shunting rule on (paper §VI-B)
  hsa_cut      complex rules + simple rules whose Alg. 1 bit is set (exact with selective/exact shunting only)
  interval     binary search on the mark → chain C_k of complex rules above the interval → hardware action
  interval_geo interval, keeping in C_k only complex rules whose reduction meets the interval's shunted boxes

Chains, all named prefix+…: MAIN (entry), K0 (mark k = 0: FULL then the chain policy), FULL (original policy
verbatim, user chains renamed prefix+name), CUT, D<n> (dispatch nodes), L<k>A<a> (leaf: the complex rules above
interval k, as jumps to segment and block chains, then the action), C<k> (segment: the complex rules interval k's
chain adds to the previous interval's), B<f>L<l>N<i> (block of B^l consecutive segments of chain family f),
R<i>L<j> (helper chains
that rebuild a multi-level flattened rule exactly), and the renamed user chains. Dispatch compares the whole mark
value under the mask and the mark is never read after complex rules ran.

Nesting depth: nf_tables refuses a ruleset whose chains nest deeper than NFT_JUMP_STACK_SIZE (16) below a base
chain ("Too many links"), and its validator counts a goto like a jump. So the dispatch tree and the block
hierarchy have a fixed number of levels whatever the number of intervals (their fan-out grows instead), chosen
so that base chain -> MAIN -> dispatch -> leaf -> blocks -> helper chains stays within MAX_DEPTH.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

from hypafilter.analysis.plan import PrefixView
from hypafilter.errors import HypafilterError
from hypafilter.ir import Header, Policy
from hypafilter.ir.semantics import ComplexEval, rule_outcome

STRATEGIES = ("full", "cut", "hsa_cut", "interval", "interval_geo")
K_SHIFT = 4
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
    (rendered from its levels; target its own).
    """

    kind: str
    target: str = ""
    value: int = 0
    mask: int = 0
    index: int = -1


@dataclass
class Program:
    policy: Policy
    strategy: str
    prefix: str
    mark_mask: int
    mark_shift: int
    chains: dict[str, list[NfRule]] = field(default_factory=dict)  # in emission order; MAIN first
    verbatim_full: str = ""  # name of the FULL chain (rendered from Policy.original_rules)

    def name(self, suffix: str) -> str:
        return self.prefix + suffix

    @property
    def main(self) -> str:
        return self.name("MAIN")

    def run(self, header: Header, mark: int, complex_eval: ComplexEval) -> tuple[str, int]:
        """Interpret the program from MAIN: (verdict, conditional rules evaluated)."""
        count = [0]
        verdict = self._run(self.main, header, mark, complex_eval, count, 0)
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
                out = None if header is None else rule_outcome(self.policy, r.index, header, ev)
                if out:
                    return out
                continue
            if r.kind == "mark":
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
            out = self._run(r.target, header, mark, ev, count, depth + 1)
            if out is not None:
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
    """The skb mark the shim writes for (k, action), other bits taken from `foreign`."""
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
    plan, strategy: str, prefix: str = "HF1_", mark_mask: int = 0xFFFFFFFF, mark_shift: int = 0
) -> Program:
    if strategy not in STRATEGIES:
        raise HypafilterError(f"unknown strategy {strategy!r} (choose {', '.join(STRATEGIES)})")
    if strategy == "hsa_cut" and plan.mode == "index":
        raise HypafilterError(
            "strategy hsa_cut is not exact with index-based shunting (a shunted packet may first match a simple "
            "rule the HSA cut set leaves out); use --mode selective or exact, or another strategy"
        )
    _check_mark(mark_mask, mark_shift)
    pol = plan.policy
    prog = Program(pol, strategy, prefix, mark_mask, mark_shift)
    for uc in pol.user_chains:
        if len(prefix + uc) > MAX_CHAIN_NAME:
            raise HypafilterError(f"user chain {uc!r}: {prefix + uc!r} is longer than {MAX_CHAIN_NAME} characters")
    default = pol.default
    c = prog.chains
    main, k0, full = prog.name("MAIN"), prog.name("K0"), prog.name("FULL")
    c[main] = []
    kmask = (~0xF << mark_shift) & mark_mask & 0xFFFFFFFF
    if strategy == "full":
        c[main] = [NfRule("always", k0)]
    elif strategy in ("cut", "hsa_cut"):
        cut = prog.name("CUT")
        c[main] = [NfRule("mark", k0, 0, kmask), NfRule("always", cut)]
        c[cut] = [NfRule("policy", index=i) for i in _cut_list(plan, strategy)] + [NfRule("always", default)]
    else:
        chains = plan.geo_chains if strategy == "interval_geo" else plan.chains
        leaves = sorted({(int(plan.interval[j]), int(plan.actions[j])) for j in range(plan.n + 1) if plan.shunt[j]})
        c[main] = [NfRule("mark", k0, 0, kmask)]
        # Depth budget below MAIN: dispatch levels (MAIN's test included) + block levels + the deepest helper chain
        # of a complex rule, so that base -> MAIN -> ... stays within MAX_DEPTH.
        budget = max(2, MAX_DEPTH - 1 - max((_helper_depth(pol.rules[i]) for i in pol.complex_indices), default=0))
        d_levels = (budget + 1) // 2
        families = _families([(k, chains.get(k)) for k, _ in leaves])
        pieces = _Blocks(prog, families, budget - d_levels)
        leaf_rules = []
        for k, a in leaves:
            verdict = {1: "ACCEPT", 2: "DROP"}.get(a, default)
            ch = chains.get(k)
            if ch:
                lname = prog.name(f"L{k}A{a}")
                c[lname] = [NfRule("block", t) for t in pieces.cover(ch)] + [NfRule("always", verdict)]
                tgt = lname
            else:
                tgt = verdict
            leaf_rules.append(((k << K_SHIFT) | a, tgt))
        _dispatch(prog, main, leaf_rules, d_levels, [0])
        c[main].append(NfRule("always", k0))  # a mark no leaf knows: the full policy decides
    c[k0] = [NfRule("always", full), NfRule("always", default)]
    c[full] = [NfRule("policy", index=i) for i in range(len(pol.rules))]
    prog.verbatim_full = full
    return prog


def _cut_list(plan, strategy: str) -> list[int]:
    pol = plan.policy
    if strategy == "hsa_cut":
        return [i for i, r in enumerate(pol.rules) if not r.is_simple or plan.conflict[i]]
    shunted = [plan.entries[j].rule_index for j in range(plan.n) if plan.shunt[j]]
    beta = min(shunted) if shunted else len(pol.rules)
    return [i for i, r in enumerate(pol.rules) if not r.is_simple or i >= beta]


def _helper_depth(rule) -> int:
    """Nested jumps through R<i>L<j> helper chains that rendering flattened rule `rule` adds."""
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
        for f, (base, lengths, keys, names) in enumerate(families):
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
        return [NfRule("policy", index=i) for i in base[(lengths[j0 - 1] if j0 else 0) : lengths[j1 - 1]]]

    def _block(self, f: int, level: int, i: int) -> str:
        name = self.prog.name(f"C{self.fam[f][4][i]}" if level == 0 else f"B{f}L{level}N{i}")
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


def chain_depth(prog_or_text, entry: str | None = None) -> tuple[int, list[str]]:
    """Deepest nesting of jumps/gotos from `entry` (default MAIN) in a Program or iptables-restore text.

    Returns (edges, path); the base chain's jump to MAIN is not included (add 1). Gotos count: the kernel's
    validator counts them like jumps.
    """
    edges: dict[str, set[str]] = {}
    if isinstance(prog_or_text, Program):
        text = render_iptables(prog_or_text)
        entry = entry or prog_or_text.main
    else:
        text = prog_or_text
    for ln in text.splitlines():
        if ln.startswith(":"):
            edges.setdefault(ln[1:].split()[0], set())
    for ln in text.splitlines():
        if not ln.startswith("-A "):
            continue
        toks = ln.split()
        for i in range(2, len(toks) - 1):
            if toks[i] in ("-j", "-g", "--jump", "--goto") and toks[i + 1] in edges:
                edges[toks[1]].add(toks[i + 1])
    if entry is None:
        entry = next(n for n in edges if n.endswith("MAIN"))
    memo: dict[str, tuple[int, list[str]]] = {}

    def walk(name: str, seen: frozenset) -> tuple[int, list[str]]:
        if name in memo:
            return memo[name]
        best = (0, [name])
        for nxt in edges.get(name, ()):
            if nxt in seen:
                raise HypafilterError(f"chain loop through {nxt}")
            d, path = walk(nxt, seen | {nxt})
            if d + 1 > best[0]:
                best = (d + 1, [name, *path])
        memo[name] = best
        return best

    return walk(entry, frozenset({entry}))


# ---------------------------------------------------------------- iptables-restore


@lru_cache(maxsize=1 << 16)  # the same few thousand tokens recur in every leaf and block chain
def _q(tok: str) -> str:
    return tok if tok and not any(ch in tok for ch in " \t\"'\\#") else '"' + tok.replace('"', '\\"') + '"'


def _target_tokens(prog: Program, target: str, args: tuple[str, ...]) -> list[str]:
    pol = prog.policy
    if target == "RETURN":
        return ["-j", pol.default]
    if target in pol.user_chains:
        return ["-j", prog.prefix + target]
    return ["-j", target, *args]


def _rename_jumps(prog: Program, toks: tuple[str, ...]) -> list[str]:
    out = list(toks)
    for i in range(1, len(out)):
        if out[i - 1] in ("-j", "-g", "--jump", "--goto") and out[i] in prog.policy.user_chains:
            out[i] = prog.prefix + out[i]
    return out


def _policy_rule_lines(prog: Program, chain: str, index: int, helpers: dict[str, list[list[str]]]) -> list[str]:
    """The iptables lines (tokens) placing flattened rule `index` in `chain`, plus its helper chains."""
    r = prog.policy.rules[index]
    if not r.levels:
        raise HypafilterError(f"rule {index} has no option levels: cannot write it back to netfilter")
    tgt = _target_tokens(prog, r.target, r.target_args)
    levels = r.levels
    if len(levels) == 1 and not levels[0].unless:
        return [[*levels[0].options, *tgt]]
    names = [prog.name(f"R{index}L{j + 1}") for j in range(len(levels))]
    for j, lv in enumerate(levels):
        if j == 0 and not lv.unless:
            continue
        if names[j] in helpers:
            continue
        body = [[*u, "-j", "RETURN"] for u in lv.unless]
        body.append([*lv.options, *(tgt if j == len(levels) - 1 else ["-j", names[j + 1]])])
        helpers[names[j]] = body
    if levels[0].unless:
        return [["-j", names[0]]]
    return [[*levels[0].options, "-j", names[1]]]


def to_iptables_restore(
    plan, strategy: str, prefix: str = "HF1_", mark_mask: int = 0xFFFFFFFF, mark_shift: int = 0, table: str = "filter"
) -> str:
    """Input for `iptables-restore --noflush`: declares (and so flushes) only the tool's chains."""
    prog = build_program(plan, strategy, prefix, mark_mask, mark_shift)
    return render_iptables(prog, table)


def render_iptables(prog: Program, table: str = "filter") -> str:
    pol = prog.policy
    body: dict[str, list[list[str]]] = {}
    helpers: dict[str, list[list[str]]] = {}
    for name, rules in prog.chains.items():
        lines = []
        if name == prog.verbatim_full:
            lines = [_rename_jumps(prog, toks) for toks in pol.original_rules]
        else:
            for r in rules:
                if r.kind == "policy":
                    lines += _policy_rule_lines(prog, name, r.index, helpers)
                elif r.kind == "mark":
                    lines.append(["-m", "mark", "--mark", f"{r.value:#x}/{r.mask:#x}", "-j", r.target])
                else:
                    lines.append(["-j", r.target])
        body[name] = lines
    for uc in pol.user_chains.values():
        body[prog.prefix + uc.name] = [_rename_jumps(prog, toks) for toks in uc.rules]
    body.update(helpers)
    for name in body:
        if len(name) > MAX_CHAIN_NAME:
            raise HypafilterError(f"chain name {name!r} is longer than {MAX_CHAIN_NAME} characters: shorten the prefix")
    out = [
        f"# hypafilter: strategy {prog.strategy}, policy {pol.source} ({pol.base_chain}, policy {pol.default})",
        f"*{table}",
    ]
    out += [f":{name} - [0:0]" for name in body]
    for name, lines in body.items():
        out += [" ".join(["-A", name, *(_q(t) for t in toks)]) for toks in lines]
    out.append("COMMIT")
    text = "\n".join(out) + "\n"
    depth, path = chain_depth(text, prog.main)
    if depth + 1 > NFT_MAX_DEPTH:
        raise HypafilterError(
            f"chains nest {depth + 1} deep below the base chain ({' -> '.join(path)}); nf_tables allows "
            f"{NFT_MAX_DEPTH}: the policy's own user chains or multi-level rules nest too deeply"
        )
    return text


# ---------------------------------------------------------------- nftables


class _NftUnsupported(HypafilterError):
    pass


def _nft_ports(spec: str) -> str:
    parts = [p.replace(":", "-") for p in spec.split(",")]
    return parts[0] if len(parts) == 1 else "{ " + ", ".join(parts) + " }"


def _nft_match(tokens: tuple[str, ...], where: str) -> list[str]:
    """nft expressions for iptables option tokens; HypafilterError for checks nft text cannot express."""
    out: list[str] = []
    toks = list(tokens)
    i = 0
    proto = None
    neg = False

    def take() -> str:
        nonlocal i
        if i >= len(toks):
            raise HypafilterError(f"{where}: option {toks[i - 1]!r} without a value")
        v = toks[i]
        i += 1
        return v

    while i < len(toks):
        t = take()
        op = "!= " if neg else ""
        if t == "!":
            neg = True
            continue
        neg = False
        if t in ("-s", "--source"):
            out.append(f"ip saddr {op}{take()}")
        elif t in ("-d", "--destination"):
            out.append(f"ip daddr {op}{take()}")
        elif t in ("-p", "--protocol"):
            proto = take()
            out.append(f"meta l4proto {op}{proto}")
        elif t in ("-i", "--in-interface"):
            out.append(f'iifname {op}"{take()}"')
        elif t in ("-o", "--out-interface"):
            out.append(f'oifname {op}"{take()}"')
        elif t == "-m":
            mod = take()
            if mod not in ("tcp", "udp", "icmp", "multiport", "conntrack", "state", "limit", "mark", "comment"):
                raise _NftUnsupported(f"{where}: match -m {mod} has no nftables equivalent in hypafilter's nft output")
        elif t in ("--sport", "--source-port", "--sports", "--source-ports"):
            out.append(f"{proto} sport {op}{_nft_ports(take())}")
        elif t in ("--dport", "--destination-port", "--dports", "--destination-ports"):
            out.append(f"{proto} dport {op}{_nft_ports(take())}")
        elif t == "--icmp-type":
            v = take()
            if "/" in v:
                typ, code = v.split("/", 1)
                out.append(f"icmp type {op}{typ} icmp code {code}")
            else:
                out.append(f"icmp type {op}{v}")
        elif t == "--tcp-flags":
            mask, comp = take().lower(), take().lower()
            m = " | ".join(mask.split(",")) if mask != "all" else "fin | syn | rst | psh | ack | urg | ecn | cwr"
            c = " | ".join(comp.split(",")) if comp not in ("none",) else "0"
            out.append(f"tcp flags & ({m}) {'!=' if op else '=='} {c}")
        elif t == "--syn":
            out.append(f"tcp flags & (fin | syn | rst | ack) {'!=' if op else '=='} syn")
        elif t in ("--ctstate", "--state"):
            out.append(f"ct state {op}{{ {', '.join(s.lower() for s in take().split(','))} }}")
        elif t == "--limit":
            rate = take()
            num, _, unit = rate.partition("/")
            unit = {"s": "second", "sec": "second", "m": "minute", "min": "minute", "h": "hour", "d": "day"}.get(
                unit, unit or "hour"
            )
            out.append(f"limit rate {num}/{unit}")
        elif t == "--limit-burst":
            out[-1] += f" burst {take()} packets"
        elif t == "--mark":
            v = take()
            val, _, mask = v.partition("/")
            out.append(f"meta mark & {mask or '0xffffffff'} {'!=' if op else '=='} {val}")
        elif t == "--comment":
            out.append(f'comment "{take()}"')
        else:
            raise _NftUnsupported(f"{where}: option {t!r} has no nftables equivalent in hypafilter's nft output")
    # nft wants a comment last.
    return [x for x in out if not x.startswith("comment")] + [x for x in out if x.startswith("comment")]


def _nft_target(prog: Program, target: str, args: tuple[str, ...], where: str) -> str:
    pol = prog.policy
    if target == "RETURN":
        return pol.default.lower()
    if target in ("ACCEPT", "DROP"):
        return target.lower()
    if target in pol.user_chains:
        return f"jump {prog.prefix + target}"
    if target == "REJECT":
        return "reject"
    if target == "LOG":
        a = list(args)
        if "--log-prefix" in a:
            return f'log prefix "{a[a.index("--log-prefix") + 1]}"'
        return "log"
    if target == "MARK" and len(args) == 2 and args[0] in ("--set-mark", "--set-xmark"):
        val, _, mask = args[1].partition("/")
        if mask and args[0] == "--set-xmark":
            return f"meta mark set meta mark & {~int(mask, 0) & 0xFFFFFFFF:#x} ^ {val}"
        if mask:
            return f"meta mark set meta mark & {~int(mask, 0) & 0xFFFFFFFF:#x} | {val}"
        return f"meta mark set {val}"
    raise _NftUnsupported(f"{where}: target {target} has no nftables equivalent in hypafilter's nft output")


def _split_rule(toks: tuple[str, ...]) -> tuple[tuple[str, ...], str, tuple[str, ...]]:
    """Option tokens, target, target args of a canonical rule."""
    for i, t in enumerate(toks):
        if t in ("-j", "-g", "--jump", "--goto") and i + 1 < len(toks):
            return tuple(toks[:i]), toks[i + 1], tuple(toks[i + 2 :])
    return tuple(toks), "", ()


def to_nft(
    plan,
    strategy: str,
    prefix: str = "HF1_",
    mark_mask: int = 0xFFFFFFFF,
    mark_shift: int = 0,
    family: str = "ip",
    table: str | None = None,
) -> str:
    """`nft -f` input: one table owned by the tool (deleted and recreated); dispatch as a verdict map on the mark.

    Complex matches without an nft equivalent (string, statistic, recent, ...) raise HypafilterError: nft cannot
    load xtables matches from text, so the nft form is optional and iptables-restore is the reference.
    """
    prog = build_program(plan, strategy, prefix, mark_mask, mark_shift)
    pol = prog.policy
    tname = table or prefix.rstrip("_").lower() or "hypafilter"
    chains: dict[str, list[str]] = {}
    helpers: dict[str, list[str]] = {}

    def rule_text(toks: tuple[str, ...], target: str, args: tuple[str, ...], where: str) -> str:
        parts = _nft_match(toks, where)
        tgt = _nft_target(prog, target, args, where)
        comments = [p for p in parts if p.startswith("comment")]
        parts = [p for p in parts if not p.startswith("comment")]
        return " ".join([*parts, tgt, *comments])

    def policy_rule(index: int) -> str:
        r = pol.rules[index]
        where = f"{pol.source}:{r.origin.line if r.origin else index}"
        lv = r.levels
        if not lv:
            raise HypafilterError(f"rule {index} has no option levels: cannot write it back to nftables")
        if len(lv) == 1 and not lv[0].unless:
            return rule_text(lv[0].options, r.target, r.target_args, where)
        names = [prog.name(f"R{index}L{j + 1}") for j in range(len(lv))]
        for j, level in enumerate(lv):
            if (j == 0 and not level.unless) or names[j] in helpers:
                continue
            body = [" ".join([*_nft_match(u, where), "return"]) for u in level.unless]
            last = j == len(lv) - 1
            body.append(
                rule_text(level.options, r.target, r.target_args, where)
                if last
                else " ".join([*_nft_match(level.options, where), f"jump {names[j + 1]}"])
            )
            helpers[names[j]] = body
        if lv[0].unless:
            return f"jump {names[0]}"
        return " ".join([*_nft_match(lv[0].options, where), f"jump {names[1]}"])

    for name, rules in prog.chains.items():
        lines: list[str] = []
        if name == prog.verbatim_full:
            for toks in pol.original_rules:
                opts, tgt, args = _split_rule(toks)
                lines.append(rule_text(opts, tgt, args, f"{pol.source}: {' '.join(toks)}"))
        else:
            marks = [r for r in rules if r.kind == "mark" and r.mask == (mark_mask & 0xFFFFFFFF)]
            for r in rules:
                if r.kind == "policy":
                    lines.append(policy_rule(r.index))
                elif r.kind == "mark" and r in marks:
                    if r is marks[0]:
                        # The leaves of one dispatch node become a single verdict map on the whole mark.
                        vm = ", ".join(f"{m.value:#x} : {_nft_verdict(m.target)}" for m in marks)
                        lines.append(f"meta mark & {r.mask:#x} vmap {{ {vm} }}")
                elif r.kind == "mark":
                    lines.append(f"meta mark & {r.mask:#x} == {r.value:#x} {_nft_verdict(r.target)}")
                else:
                    lines.append(_nft_verdict(r.target))
        chains[name] = lines
    for uc in pol.user_chains.values():
        lines = []
        for toks in uc.rules:
            opts, tgt, args = _split_rule(toks)
            lines.append(
                rule_text(opts, tgt, args, f"{pol.source}: chain {uc.name}")
                if tgt
                else " ".join(_nft_match(opts, uc.name))
            )
        chains[prog.prefix + uc.name] = lines
    chains.update(helpers)
    out = [
        f"# hypafilter: strategy {strategy}, policy {pol.source} ({pol.base_chain}, policy {pol.default})",
        f"table {family} {tname}",
        f"delete table {family} {tname}",
        f"table {family} {tname} {{",
    ]
    for name, lines in chains.items():
        out.append(f"\tchain {name} {{")
        out += [f"\t\t{ln}" for ln in lines]
        out.append("\t}")
    out.append("}")
    return "\n".join(out) + "\n"


def _nft_verdict(target: str) -> str:
    return target.lower() if target in ("ACCEPT", "DROP") else f"jump {target}"


__all__ = [
    "STRATEGIES",
    "NfRule",
    "Program",
    "build_program",
    "chain_depth",
    "dispatch_cost",
    "mark_for",
    "render_iptables",
    "to_iptables_restore",
    "to_nft",
]
