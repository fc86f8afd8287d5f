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
verbatim, user chains renamed prefix+name), CUT, D<n> (dispatch nodes), L<k>A<a> (leaf: C<k> then the action),
C<k>, R<i>L<j> (helper chains that rebuild a multi-level flattened rule exactly), and the renamed user chains.
Dispatch compares the whole mark value under the mask and the mark is never read after complex rules ran.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .errors import HypafilterError
from .ir import Header, Policy
from .model import TERMINAL, ComplexEval, rule_outcome
from .plan import PrefixView

STRATEGIES = ("full", "cut", "hsa_cut", "interval", "interval_geo")
K_SHIFT = 4
LEAF_FANOUT = 4  # leaves tested linearly once a dispatch node holds this few
MAX_CHAIN_NAME = 28  # iptables' limit (XT_EXTENSION_MAXNAMELEN - 1)


@dataclass(frozen=True)
class NfRule:
    """One rule of a generated chain.

    kind "mark": `-m mark --mark value/mask -j target`; "always": `-j target`; "policy": flattened rule `index`
    of the policy (rendered from its levels; target its own).
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

    def _run(self, chain: str, header: Header, mark: int, ev: ComplexEval, count: list[int], depth: int) -> str | None:
        if depth > 64:
            raise HypafilterError("chain recursion too deep (generator bug)")
        for r in self.chains[chain]:
            if r.kind == "policy":
                count[0] += 1
                out = rule_outcome(self.policy, r.index, header, ev)
                if out:
                    return out
                continue
            if r.kind == "mark":
                count[0] += 1
                if (mark & r.mask) != r.value:
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
        leaf_rules = []
        built: dict[tuple[int, ...], str] = {}
        last: tuple = ()
        for k, a in leaves:
            verdict = {1: "ACCEPT", 2: "DROP"}.get(a, default)
            ch = chains.get(k)
            if ch:
                # A prefix view of the complex list is identified by its length, without copying it.
                key = ("P", len(ch)) if isinstance(ch, PrefixView) else tuple(ch)
                if key not in built:
                    cname = prog.name(f"C{k}")
                    # Chains above consecutive intervals grow by a suffix: reuse the previous one by a jump, so
                    # the rule count stays linear in the policy instead of intervals x complex rules.
                    if key[0] == "P" and last and last[0] == "P" and last[1] < key[1]:
                        rest = ch.base[last[1] : key[1]]
                        c[cname] = [NfRule("always", built[last])] + [NfRule("policy", index=i) for i in rest]
                    elif (
                        key[0] != "P" and last and last[0] != "P" and len(last) < len(key) and key[: len(last)] == last
                    ):
                        c[cname] = [NfRule("always", built[last])] + [
                            NfRule("policy", index=i) for i in key[len(last) :]
                        ]
                    else:
                        c[cname] = [NfRule("policy", index=i) for i in ch]
                    built[key] = cname
                    last = key
                cname, lname = built[key], prog.name(f"L{k}A{a}")
                c[lname] = [NfRule("always", cname), NfRule("always", verdict)]
                tgt = lname
            else:
                tgt = verdict
            leaf_rules.append(((k << K_SHIFT) | a, tgt))
        _dispatch(prog, main, leaf_rules, [0])
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


def _dispatch(prog: Program, chain: str, leaves: list[tuple[int, str]], counter: list[int]) -> None:
    """Append to `chain` a binary search over the leaf values (sorted): split on the highest differing bit."""
    full_mask = prog.mark_mask & 0xFFFFFFFF
    if len(leaves) <= LEAF_FANOUT:
        for v, tgt in leaves:
            prog.chains[chain].append(NfRule("mark", tgt, _field(prog, v), full_mask))
        return
    bit = (leaves[0][0] ^ leaves[-1][0]).bit_length() - 1
    lo = [x for x in leaves if not (x[0] >> bit) & 1]
    hi = [x for x in leaves if (x[0] >> bit) & 1]
    counter[0] += 1
    sub = prog.name(f"D{counter[0]}")
    prog.chains[sub] = []
    b = _field(prog, 1 << bit)
    prog.chains[chain].append(NfRule("mark", sub, b, b))
    _dispatch(prog, sub, hi, counter)
    _dispatch(prog, chain, lo, counter)


# ---------------------------------------------------------------- iptables-restore


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
    return "\n".join(out) + "\n"


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
    "TERMINAL",
    "NfRule",
    "Program",
    "build_program",
    "dispatch_cost",
    "mark_for",
    "render_iptables",
    "to_iptables_restore",
    "to_nft",
]
