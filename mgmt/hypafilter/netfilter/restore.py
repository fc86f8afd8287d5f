"""The software strategies' chains as iptables-restore text: a `Program` rendered through the one iptables writer.

The text declares (and so flushes) only the tool's own chains, so it is loaded with `iptables-restore --noflush`
beside whatever else the table holds; the base chain's single jump to MAIN is the deploy transaction's business.
"""

from __future__ import annotations

from hypafilter.analysis.program import (
    MAX_CHAIN_NAME,
    NFT_MAX_DEPTH,
    Placed,
    Program,
    build_program,
    original_placements,
    place_policy_rule,
    rename_jumps,
)
from hypafilter.errors import HypafilterError
from hypafilter.iptables.writer import Restore


def to_iptables_restore(plan, strategy: str, *program, table: str = "filter", **options) -> str:
    """Input for `iptables-restore --noflush`: declares (and so flushes) only the tool's chains. `program` and
    `options` are build_program's (prefix, mark_mask, mark_shift, nic_mode)."""
    return render_iptables(build_program(plan, strategy, *program, **options), table)


def _tokens(p: Placed) -> tuple[str, ...]:
    if not p.target:  # a rule kept only for what its matches do (e.g. `-m recent --set`): no -j at all
        return p.options
    return (*p.options, "-j", p.target, *p.args)


def chain_bodies(prog: Program) -> dict[str, list[tuple[str, ...]]]:
    """Every chain of the program (helpers and renamed user chains included) as rule token lists, in load order."""
    pol = prog.policy
    body: dict[str, list[tuple[str, ...]]] = {}
    helpers: dict[str, list[Placed]] = {}
    for name, rules in prog.chains.items():
        if name == prog.verbatim_full:
            body[name] = [x if isinstance(x, tuple) else _tokens(x) for x in original_placements(prog, helpers)]
            continue
        lines: list[tuple[str, ...]] = []
        for r in rules:
            if r.kind == "policy":
                lines.append(_tokens(place_policy_rule(prog, r.index, helpers)))
            elif r.kind == "mark":
                lines.append(("-m", "mark", "--mark", f"{r.value:#x}/{r.mask:#x}", "-g" if r.goto else "-j", r.target))
            elif r.kind == "unmark":
                lines.append(("-j", "MARK", "--set-xmark", f"0x0/{r.mask:#x}"))
            elif r.kind == "hdr":  # strategy tree's dispatch: a header test, then a goto (or RETURN: an empty leaf)
                lines.append((*r.options, "-j" if r.target == "RETURN" or not r.goto else "-g", r.target))
            else:
                lines.append(("-g" if r.goto else "-j", r.target))
        body[name] = lines
    for uc in pol.user_chains.values() if not prog.live else ():  # live: the operator's own chains are jumped to
        body[prog.user_names[uc.name]] = [rename_jumps(prog, toks) for toks in uc.rules]
    for name, placed in helpers.items():
        body[name] = [_tokens(p) for p in placed]
    for name in body:
        if len(name) > MAX_CHAIN_NAME:
            raise HypafilterError(f"chain name {name!r} is longer than {MAX_CHAIN_NAME} characters: shorten the prefix")
    return body


def render_iptables(prog: Program, table: str = "filter") -> str:
    pol = prog.policy
    body = chain_bodies(prog)
    doc = Restore(
        table, f"hypafilter: strategy {prog.strategy}, policy {pol.source} ({pol.base_chain}, policy {pol.default})"
    )
    for name in body:
        doc.chain(name)
    for name, lines in body.items():
        for toks in lines:
            doc.rule(name, toks)
    depth, path = _depth(body, prog.main)
    if depth + 1 > NFT_MAX_DEPTH:
        raise HypafilterError(
            f"chains nest {depth + 1} deep below the base chain ({' -> '.join(path)}); nf_tables allows "
            f"{NFT_MAX_DEPTH}: the policy's own user chains or multi-level rules nest too deeply"
        )
    return doc.text()


def chain_depth(prog_or_text, entry: str | None = None) -> tuple[int, list[str]]:
    """Deepest nesting of jumps/gotos from `entry` (default MAIN) in a Program or iptables-restore text.

    Returns (edges, path); the base chain's jump to MAIN is not included (add 1). Gotos count: the kernel's
    validator counts them like jumps.
    """
    if isinstance(prog_or_text, Program):
        return _depth(chain_bodies(prog_or_text), entry or prog_or_text.main)
    body: dict[str, list[tuple[str, ...]]] = {}
    lines = prog_or_text.splitlines()
    for ln in lines:
        if ln.startswith(":"):
            body.setdefault(ln[1:].split()[0], [])
    for ln in lines:
        if ln.startswith("-A "):
            toks = ln.split()
            body.setdefault(toks[1], []).append(tuple(toks[2:]))
    if entry is None:
        entry = next(n for n in body if n.endswith("MAIN"))
    return _depth(body, entry)


def _depth(body: dict[str, list[tuple[str, ...]]], entry: str) -> tuple[int, list[str]]:
    edges = {name: set() for name in body}
    for name, lines in body.items():
        for toks in lines:
            for i in range(len(toks) - 1):
                if toks[i] in ("-j", "-g", "--jump", "--goto") and toks[i + 1] in edges:
                    edges[name].add(toks[i + 1])
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
