"""The document reader: an iptables-save file or a plain rule file → chains of parsed rules → a flattened `Policy`
(tables, chain declarations and policies, -A/-I/-N/-P commands, the fast path for plain ACCEPT/DROP rules)."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from functools import lru_cache

from hypafilter.config import Config, Interfaces
from hypafilter.errors import HypafilterError, PolicyError
from hypafilter.iptables import canonical
from hypafilter.iptables.ctstate import split_states
from hypafilter.iptables.flatten import flatten
from hypafilter.iptables.parser import (
    IMPLICIT_MATCH,
    MAX_CHAIN_NAME,
    V6_HINT,
    Ctx,
    RuleParser,
    addresses,
    analyse_all,
    interfaces_for,
    port_range,
)
from hypafilter.iptables.rule import IPV6_EXT_PROTOS, Addr, ParsedRule, PortCheck, TcpUdp, Verbatim, target_column
from hypafilter.iptables.sets import SetEnv, apply_sets, changed_sets
from hypafilter.iptables.tables import BUILTIN_CHAINS, CONNTRACK_MATCHES, CONNTRACK_TARGETS
from hypafilter.iptables.tokens import RESTORE, SHELL, SPECIAL, Tok, tokenize
from hypafilter.ir import PROTO_TCP, PROTO_UDP, Box, Origin, Policy, UserChain
from hypafilter.ir.family import address_space
from hypafilter.ir.semantics import KNOWN_TARGETS


@dataclass
class ChainDef:
    name: str
    builtin: bool
    policy: str | None = None  # ACCEPT/DROP for built-in chains
    rules: list[ParsedRule] = field(default_factory=list)
    line: int = 0


_CMD_LONG = {"--append": "-A", "--insert": "-I", "--new-chain": "-N", "--policy": "-P", "--table": "-t"}
_OTHER_COMMANDS = frozenset(
    {"--delete", "--replace", "--flush", "--delete-chain", "--zero", "--rename-chain", "--list", "--check"}
)
_PLAIN_PREFIXES = {
    4: frozenset({"iptables", "iptables-legacy", "iptables-nft"}),
    6: frozenset({"ip6tables", "ip6tables-legacy", "ip6tables-nft"}),
}


class _Document:
    def __init__(self, filename: str, base_chain: str, config: Config, family: int = 4):
        self.filename, self.base_chain, self.config, self.family = filename, base_chain, config, family
        self.ifaces = interfaces_for(config, base_chain)
        self.table = config.table
        builtins = set(BUILTIN_CHAINS.get(self.table, ()))
        self.chains: dict[str, ChainDef] = {c: ChainDef(c, True, "ACCEPT") for c in builtins}
        self.declared: set[str] = set()
        self.tables: dict[str, int] = {}  # every table the file fills -> its first line
        self.mentioned: set[str] = set()  # chains of our table the file declares or gives a rule or policy

    def read(self, text: str) -> None:
        # The format is fixed by the first line that is neither empty nor a comment: `*TABLE` makes an
        # iptables-save file, read as iptables-restore reads it; anything else a plain rule file of shell
        # command lines, read as a shell reads them (iptables.tokens explains both).
        first_line = next((ln for ln in text.split("\n") if ln.strip() and not ln.lstrip().startswith("#")), "")
        if first_line.startswith("*"):
            self._read_save(text)
            return
        for no, raw in enumerate(text.split("\n"), 1):
            toks = tokenize(raw, no, self.filename, SHELL)
            if not toks:
                continue
            ctx, first = Ctx(self.filename, no, self.family), toks[0]
            if first.text.startswith("*") or first.text.startswith(":") or first.text == "COMMIT":
                raise ctx.err("iptables-save syntax in a plain rule file (start the file with *filter)", first)
            self._plain_line(ctx, raw, toks)

    def _read_save(self, text: str) -> None:
        # iptables-restore reads lines up to "\n" only (a "\r" is part of the last token), skips an empty line
        # and a line whose first character is `#`, and recognises `*`, `:` and COMMIT only in the first column.
        lines = text.split("\n")
        if lines and lines[-1] == "":
            lines.pop()
        in_table: str | None = None
        table_line = 0
        for no, raw in enumerate(lines, 1):
            if (
                FAST_PATH
                and self.family == 4
                and in_table == self.table
                and raw.startswith("-A ")
                and not SPECIAL.search(raw)
                and self._fast(no, raw)
            ):
                continue
            if not raw or raw[0] == "#":
                continue
            ctx = Ctx(self.filename, no, self.family)
            toks = tokenize(raw, no, self.filename, RESTORE)
            if not toks:
                raise ctx.err("a line of blanks (iptables-restore refuses it: no command specified)", Tok(raw, 1))
            first = toks[0]
            if raw[0] == "*":
                if in_table is not None:
                    raise ctx.err(f"table {first.text} starts before COMMIT of *{in_table}", first)
                # iptables-restore takes the name up to the first blank and ignores the rest of the line.
                in_table, table_line = raw[1:].replace("\t", " ").split(" ", 1)[0], no
                if in_table not in BUILTIN_CHAINS:
                    raise ctx.err("unknown table", first)
                self.tables.setdefault(in_table, no)
                continue
            if in_table is None:
                raise ctx.err("line outside a table (missing *filter?)", first)
            if raw == "COMMIT":
                in_table = None
                continue
            ours = in_table == self.table
            if raw[0] == ":":
                self._chain_decl(ctx, toks, ours, in_table)
                continue
            if first.text in ("COMMIT",) or first.text[:1] in ("*", ":"):
                # Not in the first column, or with more on the line: iptables-restore reads it as a rule line.
                raise ctx.err("expected a command (-A, -I, -N or -P)", first)
            if re.match(r"^\[\d+:\d+\]$", first.text):
                toks = toks[1:]
                if not toks:
                    raise ctx.err("counters without a rule", first)
            self._command(ctx, raw, toks, ours)
        if in_table is not None:
            raise PolicyError(f"table *{in_table} has no COMMIT", self.filename, table_line, 1, f"*{in_table}")

    def _fast(self, no: int, raw: str) -> bool:
        """Appends the rule of a plain `-A CHAIN [-s A] [-d A] [-p tcp|udp [-m P] [--sport X] [--dport Y]] -j
        ACCEPT|DROP` line (the ClassBench shape) without the general parser; False leaves the line to it.

        Builds exactly the ParsedRule, boxes and canonical options the general path builds (checked by
        tests/unit/test_parse_fast.py); values come from memoised calls of the same value parsers.
        """
        w = raw.split()
        n = len(w)
        if n < 4 or w[-2] != "-j" or w[-1] not in _FAST_TARGETS:
            return False
        ch = self.chains.get(w[1])
        if ch is None:
            return False
        i, end = 2, n - 2
        sport = dport = None
        explicit = False
        src, i = _fast_opt(w, i, end, "-s", _fast_addr)
        dst, i = _fast_opt(w, i, end, "-d", _fast_addr)
        proto, i = _fast_opt(w, i, end, "-p", _FAST_PROTOS.get)
        if proto is not None and proto is not _NOT_FAST:
            if i < end and w[i] == "-m":
                if i + 1 >= end or w[i + 1] != IMPLICIT_MATCH[proto]:
                    return False
                explicit, i = True, i + 2
            sport, i = _fast_opt(w, i, end, "--sport", _fast_port)
            dport, i = _fast_opt(w, i, end, "--dport", _fast_port)
        if i != end or _NOT_FAST in (src, dst, proto, sport, dport):
            return False
        r = ParsedRule(chain=ch.name, origin=Origin(self.filename, no, ch.name, raw.strip()), target=w[-1])
        full = _FULL_BOX
        lo, hi = list(full.lo), list(full.hi)
        opts: list[str] = []
        if src is not None:
            r.src = Addr(src[0], src[1])
            lo[0], hi[0] = src[2], src[3]
            if src[1]:
                opts += ("-s", src[4])
        if dst is not None:
            r.dst = Addr(dst[0], dst[1])
            lo[1], hi[1] = dst[2], dst[3]
            if dst[1]:
                opts += ("-d", dst[4])
        if proto is not None:
            r.proto = proto
            lo[2] = hi[2] = proto
            opts += ("-p", IMPLICIT_MATCH[proto])
            if explicit or sport is not None or dport is not None:
                m = TcpUdp(IMPLICIT_MATCH[proto])
                r.matches.append(m)
                opts += ("-m", m.name)
                for pc, col, opt in ((sport, 3, "--sport"), (dport, 4, "--dport")):
                    if pc is not None:
                        setattr(m, opt[2:], PortCheck(pc[0], pc[1]))
                        lo[col], hi[col] = pc[0], pc[1]
                        if pc[2] is not None:
                            opts += (opt, pc[2])
        r.boxes = [full if lo == list(full.lo) and hi == list(full.hi) else type(full)(tuple(lo), tuple(hi))]
        r.options_cache = tuple(opts)
        ch.rules.append(r)
        return True

    def _chain_decl(self, ctx: Ctx, toks: list[Tok], ours: bool, table: str) -> None:
        first = toks[0]
        name = first.text[1:]
        if len(toks) < 2:
            raise ctx.err("chain declaration needs a policy (ACCEPT, DROP or -)", first)
        if len(toks) > 3 or (len(toks) == 3 and not re.match(r"^\[\d+:\d+\]$", toks[2].text)):
            raise ctx.err("bad chain declaration (:NAME POLICY [packets:bytes])", toks[-1])
        self._check_chain_name(ctx, Tok(name, first.col + 1))
        pol = toks[1]
        builtin = name in self.chains and self.chains[name].builtin if ours else name in BUILTIN_CHAINS[table]
        if builtin and pol.text not in ("ACCEPT", "DROP"):
            raise ctx.err("policy of a built-in chain must be ACCEPT or DROP", pol)
        if not builtin and pol.text != "-":
            raise ctx.err("a user-defined chain cannot have a policy (write -)", pol)
        if not ours:
            return
        self.mentioned.add(name)
        if name in self.declared:
            raise ctx.err(f"chain {name} declared twice", first)
        self.declared.add(name)
        if builtin:
            self.chains[name].policy = pol.text
            self.chains[name].line = ctx.line
        else:
            if name in KNOWN_TARGETS:
                raise ctx.err("a chain cannot have the name of a target", first)
            self.chains[name] = ChainDef(name, False, line=ctx.line)

    def _check_chain_name(self, ctx: Ctx, tok: Tok) -> None:
        n = tok.text
        if not n or len(n) > MAX_CHAIN_NAME or n.startswith(("-", "!")) or any(c.isspace() for c in n):
            raise ctx.err(f"bad chain name (1..{MAX_CHAIN_NAME} characters, not starting with - or !)", tok)

    def _plain_line(self, ctx: Ctx, raw: str, toks: list[Tok]) -> None:
        cmd = os.path.basename(toks[0].text)
        if cmd in _PLAIN_PREFIXES[self.family]:
            toks = toks[1:]
            if not toks:
                raise ctx.err(f"{cmd} without a command", None)
        elif cmd in _PLAIN_PREFIXES[10 - self.family]:
            raise ctx.err(
                f"an {cmd} command in an IPv{self.family} policy ("
                + (V6_HINT if self.family == 4 else "give the IPv4 rules as the policy and these with --ipv6")
                + ")",
                toks[0],
            )
        ours = True
        table = self.table
        if toks[0].text in ("-t", "--table"):
            if len(toks) < 2:
                raise ctx.err("-t needs a table name", toks[0])
            if toks[1].text not in BUILTIN_CHAINS:
                raise ctx.err("unknown table", toks[1])
            table = toks[1].text
            ours = table == self.table
            toks = toks[2:]
            if not toks:
                raise ctx.err("no command after -t", None)
        self.tables.setdefault(table, ctx.line)
        cmd = _CMD_LONG.get(toks[0].text, toks[0].text)
        if cmd not in ("-A", "-I", "-N", "-P"):
            if re.match(r"^-[A-Z]$", cmd) or cmd in _OTHER_COMMANDS:
                raise ctx.err("command not supported in a policy file (use -A, -I, -N, -P)", toks[0])
            toks = [Tok("-A", 0), Tok(self.base_chain, 0), *toks]
        self._command(ctx, raw, toks, ours)

    def _command(self, ctx: Ctx, raw: str, toks: list[Tok], ours: bool) -> None:
        cmd_tok = toks[0]
        cmd = _CMD_LONG.get(cmd_tok.text, cmd_tok.text)
        if cmd not in ("-A", "-I", "-N", "-P"):
            raise ctx.err("expected a command (-A, -I, -N or -P)", cmd_tok)
        if len(toks) < 2:
            raise ctx.err(f"{cmd} needs a chain name", cmd_tok)
        chain_tok = toks[1]
        name = chain_tok.text
        if ours:
            self.mentioned.add(name)
        if cmd == "-N":
            self._check_chain_name(ctx, chain_tok)
            if len(toks) > 2:
                raise ctx.err("unexpected text after -N CHAIN", toks[2])
            if not ours:
                return
            if name in self.chains or name in KNOWN_TARGETS:
                raise ctx.err(f"chain {name} already exists", chain_tok)
            self.chains[name] = ChainDef(name, False, line=ctx.line)
            return
        if cmd == "-P":
            if len(toks) != 3:
                raise ctx.err("-P needs CHAIN and ACCEPT or DROP", toks[-1])
            if not ours:
                return
            ch = self.chains.get(name)
            if ch is None:
                raise ctx.err("no such chain", chain_tok)
            if not ch.builtin:
                raise ctx.err("a user-defined chain cannot have a policy", chain_tok)
            if toks[2].text not in ("ACCEPT", "DROP"):
                raise ctx.err("policy must be ACCEPT or DROP", toks[2])
            ch.policy = toks[2].text
            return
        rest = toks[2:]
        pos = None
        if cmd == "-I" and rest and rest[0].text.isdigit():
            pos = int(rest[0].text)
            if pos < 1:
                raise ctx.err("rule position must be 1 or more", rest[0])
            rest = rest[1:]
        if not ours:
            return
        ch = self.chains.get(name)
        if ch is None:
            raise ctx.err("no such chain (define it first with -N or :NAME -)", chain_tok)
        origin = Origin(self.filename, ctx.line, name, raw.strip())
        rules = RuleParser(ctx, rest, name, {c for c, d in self.chains.items() if not d.builtin}, origin).parse()
        analyse_all(rules, self.ifaces)
        if cmd == "-A":
            ch.rules.extend(rules)
            return
        pos = pos or 1
        if pos > len(ch.rules) + 1:
            raise ctx.err(f"chain {name} has only {len(ch.rules)} rules", toks[2])
        ch.rules[pos - 1 : pos - 1] = rules


# Whether _Document takes the whole-line fast path; the equivalence test turns it off to get the general path.
FAST_PATH = True
_FAST_TARGETS = frozenset({"ACCEPT", "DROP"})
_FAST_PROTOS = {"tcp": PROTO_TCP, "udp": PROTO_UDP}
_NOT_FAST = object()  # an option of the fast shape whose value the fast path does not take


def _fast_opt(w: list[str], i: int, end: int, opt: str, value) -> tuple:
    """`opt VALUE` at w[i] (before w[end]): (value(VALUE), i + 2); (None, i) when w[i] is not opt, and
    (_NOT_FAST, i) when VALUE is missing or value() gives None for it (the general path reports it)."""
    if i >= end or w[i] != opt:
        return None, i
    v = value(w[i + 1]) if i + 1 < end else None
    return (_NOT_FAST, i) if v is None else (v, i + 2)


_FULL_BOX = Box.full()
_NO_CTX = Ctx("<fast>", 0)


@lru_cache(maxsize=1 << 16)
def _fast_addr(text: str) -> tuple[int, int, int, int, str] | None:
    """(net, mask, lo, hi, canonical text) of one contiguous `-s`/`-d` address; None for anything else."""
    try:
        addrs = addresses(_NO_CTX, Tok(text, 0))
    except PolicyError:
        return None
    if len(addrs) != 1:
        return None
    a = Addr(*addrs[0])
    iv = a.intervals()
    if iv is None:
        return None
    return a.net, a.mask, iv[0][0], iv[0][1], canonical.addr_text(a)


@lru_cache(maxsize=1 << 16)
def _fast_port(text: str) -> tuple[int, int, str | None] | None:
    """(lo, hi, canonical text or None when the range is full) of one --sport/--dport; None when invalid."""
    try:
        lo, hi, _ = port_range(_NO_CTX, Tok(text, 0), text)
    except PolicyError:
        return None
    pc = PortCheck(lo, hi)
    return lo, hi, None if pc.is_full else canonical._port(pc)


# Jumps nf_tables follows below a base chain: NFT_JUMP_STACK_SIZE (16) - 1; one more and the kernel answers "Too
# many links", so such a policy cannot be loaded at all (and deep recursion here is bounded by it).
MAX_NESTING = 15


def reachable_chains(chains: dict[str, ChainDef], base: str) -> list[str]:
    """User chains reachable from `base`, in first-reach order; a loop, or chains nested deeper than the kernel
    can load, is a PolicyError naming the jump."""
    order: list[str] = []
    state: dict[str, int] = {}
    height: dict[str, int] = {}  # the deepest nesting of jumps below each visited chain

    def fail(msg: str, via: ParsedRule | None, name: str) -> PolicyError:
        o = via.origin if via else None
        return PolicyError(msg, o.file if o else "<policy>", o.line if o else 0, target_column(o, name), name)

    def visit(name: str, via: ParsedRule | None, level: int) -> int:
        st = state.get(name)
        if st == 1:
            raise fail(f"chain loop: {name} is reached from itself", via, name)
        if st != 2:
            if level > MAX_NESTING:
                raise fail(
                    f"chains nest more than {MAX_NESTING} jumps below {base}: the kernel cannot load it", via, name
                )
            state[name] = 1
            if name != base:
                order.append(name)
            h = 0
            for r in chains[name].rules:
                if r.target in chains and not chains[r.target].builtin:
                    h = max(h, 1 + visit(r.target, r, level + 1))
            height[name] = h
            state[name] = 2
        if level + height[name] > MAX_NESTING:
            raise fail(f"chains nest more than {MAX_NESTING} jumps below {base}: the kernel cannot load it", via, name)
        return height[name]

    visit(base, None, 0)
    return order


@dataclass
class TableChains:
    """Every chain of one table of a policy file, in the order the file declares them (built-in chains first)."""

    table: str
    chains: dict[str, ChainDef]
    tables: dict[str, int]  # every table the file fills -> its first line


def read_table(text: str, filename: str, config: Config | None = None, family: int = 4) -> TableChains:
    """All chains of `config.table` (default filter) as parsed rules, for tools that rewrite a whole table.

    Interface checks stay checks (no bridge is assumed), so a rule's boxes are its header checks alone. `family` 6:
    an ip6tables table (its boxes hold 128-bit addresses, ir.family)."""
    config = config or Config()
    doc = _Document(filename, "INPUT", config, family)
    doc.ifaces = Interfaces()
    with address_space(family):
        doc.read(text)
    return TableChains(config.table, doc.chains, doc.tables)


def read_policy_text(path: str) -> str:
    """A policy file's text, with the file's own errors (missing, not UTF-8) said as such, naming file, line and
    column."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise HypafilterError(f"{path}: {e.strerror}") from e
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        column = e.start - (data.rfind(b"\n", 0, e.start) + 1) + 1
        raise PolicyError(
            f"not UTF-8 text: byte 0x{data[e.start]:02x} (is this an iptables-save file?)", path, line, column
        ) from e


def parse_policy(
    text: str,
    filename: str = "<policy>",
    base_chain: str = "FORWARD",
    config: Config | None = None,
    allow_empty: bool = False,
    sets: SetEnv | None = None,
    family: int = 4,
) -> Policy:
    """Parse and flatten a policy for `base_chain`; bad input raises PolicyError (file:line:column, token).

    `family` 6 reads an ip6tables policy (ip6tables-save file or ip6tables command lines): 128-bit addresses in the
    boxes (ir.family; compress() ranks them for analysis), the matches as ip6tables reads them (docs/ipv6.md).
    """
    with address_space(family):
        return _parse_policy(text, filename, base_chain, config, allow_empty, sets, family)


def _parse_policy(
    text: str,
    filename: str,
    base_chain: str,
    config: Config | None,
    allow_empty: bool,
    sets: SetEnv | None,
    family: int,
) -> Policy:
    """parse_policy inside the family's address space.

    A policy that says nothing about its base chain is refused unless `allow_empty`: no table of ours in the
    file, a base chain the file never names, or one without rules would otherwise become an accept-all (or
    drop-all) firewall without a word."""

    config = config or Config()
    doc = _Document(filename, base_chain, config, family)
    doc.read(text)
    base = doc.chains.get(base_chain)
    if base is None:
        builtins = ", ".join(BUILTIN_CHAINS.get(config.table, ()))
        raise PolicyError(
            f"{base_chain} is not a built-in chain of table {config.table} ({builtins}); chain names are "
            "case-sensitive",
            filename,
        )
    if not base.builtin:
        raise PolicyError(f"base chain {base_chain} is a user-defined chain", filename, base.line, 1, base_chain)
    ignored = tuple(sorted(t for t in doc.tables if t != config.table))
    if not allow_empty:
        hint = " (give --allow-empty to accept that)"
        if config.table not in doc.tables:
            only = f": only {', '.join(ignored)}, which the tool ignores" if ignored else ""
            raise PolicyError(f"no rules of table {config.table} in the file{only}{hint}", filename)
        if base_chain not in doc.mentioned:
            raise PolicyError(f"the file never names chain {base_chain}{hint}", filename)
        if not base.rules:
            raise PolicyError(
                f"chain {base_chain} has no rules: the policy would be its chain policy "
                f"({base.policy or 'ACCEPT'}) for every packet{hint}",
                filename,
                base.line,
                1 if base.line else 0,
                base_chain if base.line else "",
            )
    reach = reachable_chains(doc.chains, base_chain)
    if sets is not None:
        sets.changed = sets.changed | changed_sets(text)
    rules, set_slots, set_notes = apply_sets(
        flatten(doc.chains, base_chain, base.policy or "ACCEPT", config), sets, family
    )
    rules = split_states(rules)
    reads_ct = any(
        r.target in CONNTRACK_TARGETS or any(isinstance(m, Verbatim) and m.name in CONNTRACK_MATCHES for m in r.matches)
        for name in (base_chain, *reach)
        for r in doc.chains[name].rules
    )
    return Policy(
        rules=rules,
        default=base.policy or "ACCEPT",
        base_chain=base_chain,
        source=filename,
        original_rules=[canonical.rule_tokens(r) for r in base.rules],
        original_origins=[r.origin for r in base.rules],
        user_chains={
            n: UserChain(
                n,
                tuple(canonical.rule_tokens(r) for r in doc.chains[n].rules),
                tuple(r.origin for r in doc.chains[n].rules),
            )
            for n in reach
        },
        reads_conntrack=reads_ct,
        ignored_tables=ignored,
        declared_chains=tuple(sorted(n for n, c in doc.chains.items() if not c.builtin)),
        interfaces=(doc.ifaces.bridge, doc.ifaces.ports),
        set_slots=set_slots,
        sets=dict(sets.sets) if sets is not None else {},
        ipsets_text=sets.text if sets is not None else "",
        set_notes=set_notes,
        resolved=[
            (r.origin, toks, outcome)
            for name in (base_chain, *reach)
            for r in doc.chains[name].rules
            for toks, outcome in r.resolved
        ],
        family=family,
        notes=[
            (r.origin, (_AH_NOTE if r.proto == 51 else _EXT_PROTO_NOTE).format(p=canonical.proto_text(r.proto)))
            for name in (base_chain, *reach)
            for r in doc.chains[name].rules
            if family == 6 and (r.proto in IPV6_EXT_PROTOS or r.proto == 51) and not r.proto_invert
        ],
    )


_EXT_PROTO_NOTE = (
    "-p {p} never matches: ip6tables compares -p with the upper-layer protocol ipv6_find_hdr finds after the "
    'extension headers (ip6tables warns "never matched protocol"; use -m ipv6header or the header\'s own match)'
)
_AH_NOTE = (
    "-p {p} matches frames whose extension-header chain reaches AH (nf_tables stops ipv6_find_hdr there); with "
    'ip6tables-legacy it would never match (ip6tables warns "never matched protocol")'
)
