"""The rule parser: one rule's tokens → a `ParsedRule` (checks, matches, target), with the option tables it reads
and errors that name the user's file, line, column and token (see docs/policy-language.md)."""

from __future__ import annotations

import ipaddress
import re
from functools import lru_cache

from hypafilter.config import Config, Interfaces
from hypafilter.errors import PolicyError
from hypafilter.iptables import canonical
from hypafilter.iptables.rule import (
    Addr,
    Comment,
    Icmp,
    Icmp6,
    Iface,
    Iprange,
    Multiport,
    ParsedRule,
    PortCheck,
    TcpUdp,
    Verbatim,
    analyse,
)
from hypafilter.iptables.tables import (
    ICMP6_TYPES,
    ICMP_TYPES,
    PROTO_ALIASES,
    PROTO_BY_NAME,
    REJECT6_WITH,
    SERVICES,
    TCP_FLAG_WORDS,
)
from hypafilter.iptables.tokens import SHELL, Tok, tokenize
from hypafilter.ir import PROTO_ICMP, PROTO_TCP, PROTO_UDP, Origin
from hypafilter.ir.semantics import KNOWN_TARGETS, STANDARD_TARGETS

IFNAMSIZ = 16
MAX_CHAIN_NAME = 28  # XT_EXTENSION_MAXNAMELEN - 1
MULTIPORT_MAX = 15
COMMENT_MAX = 255
PORT_PROTOS = frozenset({PROTO_TCP, PROTO_UDP, 33, 132, 136})  # multiport: tcp, udp, dccp, sctp, udplite


# --- tokens -------------------------------------------------------------------------------------------------


# --- option tables --------------------------------------------------------------------------------------------

# Standard (non-extension) rule options: canonical name -> takes an argument.
_STD_LONG = {
    "--source": "-s",
    "--src": "-s",
    "--destination": "-d",
    "--dst": "-d",
    "--protocol": "-p",
    "--in-interface": "-i",
    "--out-interface": "-o",
    "--fragment": "-f",
    "--jump": "-j",
    "--goto": "-g",
    "--match": "-m",
    "--set-counters": "-c",
    "--ipv4": "-4",
    "--ipv6": "-6",
}
_STD_ARG = {"-s": True, "-d": True, "-p": True, "-i": True, "-o": True, "-f": False, "-j": True, "-g": True}
_STD_ARG |= {"-m": True, "-c": True, "-4": False, "-6": False}
_INVERTIBLE_STD = frozenset({"-s", "-d", "-p", "-i", "-o", "-f"})

# Options of the matches the compiler models: match -> {spelling: (canonical, number of arguments)}.
# tcp and udp share the port options.
_PORT_OPTS = {
    "--sport": ("--sport", 1),
    "--source-port": ("--sport", 1),
    "--dport": ("--dport", 1),
    "--destination-port": ("--dport", 1),
}
_MATCH_OPTS: dict[str, dict[str, tuple[str, int]]] = {
    "tcp": {
        **_PORT_OPTS,
        "--tcp-flags": ("--tcp-flags", 2),
        "--syn": ("--syn", 0),
        "--tcp-option": ("--tcp-option", 1),
    },
    "udp": _PORT_OPTS,
    "icmp": {"--icmp-type": ("--icmp-type", 1)},
    "icmp6": {"--icmpv6-type": ("--icmpv6-type", 1)},
    "multiport": {
        "--sports": ("--sports", 1),
        "--source-ports": ("--sports", 1),
        "--dports": ("--dports", 1),
        "--destination-ports": ("--dports", 1),
        "--ports": ("--ports", 1),
    },
    "iprange": {"--src-range": ("--src-range", 1), "--dst-range": ("--dst-range", 1)},
    "comment": {"--comment": ("--comment", 1)},
}
IMPLICIT_MATCH = {PROTO_TCP: "tcp", PROTO_UDP: "udp", PROTO_ICMP: "icmp"}
_MATCH_PROTO = {"tcp": PROTO_TCP, "udp": PROTO_UDP, "icmp": PROTO_ICMP}
# ip6tables: `-p ipv6-icmp` (icmpv6, 58) loads icmp6, `-p icmp` loads nothing (libipt_icmp is IPv4's)
PROTO_ICMPV6 = 58
IMPLICIT_MATCH6 = {PROTO_TCP: "tcp", PROTO_UDP: "udp", PROTO_ICMPV6: "icmp6"}
_MATCH_PROTO6 = {"tcp": PROTO_TCP, "udp": PROTO_UDP, "icmp6": PROTO_ICMPV6}
# libxtables loads icmp6 under these names (xtables_find_match)
ICMP6_NAMES = frozenset({"icmp6", "icmpv6", "ipv6-icmp"})
# A hint for an IPv6 input met in an IPv4 policy (and the reverse)
V6_HINT = "give an ip6tables policy with -6 FILE, or beside the IPv4 policy with --ipv6 FILE"


def _is_std(text: str) -> bool:
    if text in _STD_ARG or text in _STD_LONG:
        return True
    if text.startswith("--") and "=" in text:
        return text.split("=", 1)[0] in _STD_LONG
    return len(text) > 2 and text[0] == "-" and text[1] in "sdpiojgmc" and text[1] != "-"


# --- value parsers ---------------------------------------------------------------------------------------------

_IPV4 = re.compile(r"^\d{1,3}(\.\d{1,3}){0,3}$")


class Ctx:
    """Where we are, for errors; and which family the policy is (4: iptables, 6: ip6tables)."""

    def __init__(self, filename: str, line: int, family: int = 4):
        self.filename, self.line, self.family = filename, line, family

    def err(self, msg: str, tok: Tok | None) -> PolicyError:
        return PolicyError(msg, self.filename, self.line, tok.col if tok else 0, tok.text if tok else "")


def _ipv4(ctx: Ctx, tok: Tok, text: str) -> int:
    m = _IPV4.match(text)
    if not m:
        if ":" in text:
            raise ctx.err(f"an IPv6 address in an IPv4 policy (iptables is IPv4: {V6_HINT})", tok)
        if re.search(r"[A-Za-z]", text):
            raise ctx.err("host names are not accepted, write an IPv4 address", tok)
        raise ctx.err("bad IPv4 address", tok)
    octets = [int(g) for g in text.split(".")]
    if any(o > 255 for o in octets):
        raise ctx.err("bad IPv4 address (octet > 255)", tok)
    octets += [0] * (4 - len(octets))  # iptables pads a short address with zero octets
    return (octets[0] << 24) | (octets[1] << 16) | (octets[2] << 8) | octets[3]


_IPV6 = re.compile(r"^[0-9A-Fa-f:.]+$")
V6_ALL = (1 << 128) - 1


def _ipv6(ctx: Ctx, tok: Tok, text: str) -> int:
    """One IPv6 address as inet_pton(AF_INET6) reads it (full, `::`-compressed, or with a dotted IPv4 tail)."""
    if not _IPV6.match(text) or ":" not in text:
        if _IPV4.match(text):
            raise ctx.err("an IPv4 address in an IPv6 policy (ip6tables takes IPv6 addresses only)", tok)
        if "%" in text:
            raise ctx.err("bad IPv6 address (a zone index %... is not accepted by ip6tables)", tok)
        if re.search(r"[G-Zg-z]", text):
            raise ctx.err("host names are not accepted, write an IPv6 address", tok)
        raise ctx.err("bad IPv6 address", tok)
    try:
        return int(ipaddress.IPv6Address(text))
    except ValueError:
        raise ctx.err("bad IPv6 address", tok) from None


def addresses6(ctx: Ctx, tok: Tok) -> list[tuple[int, int]]:
    """`-s`/`-d` of ip6tables: ADDR[/LEN|/MASK][,...]; LEN 0..128 or an IPv6 mask (xtables parse_ip6mask; an
    IPv4-style dotted mask is refused, as ip6tables refuses it)."""
    ok = _addresses6_ok(tok.text)  # (policies repeat their addresses: valid texts are parsed once)
    return list(ok) if ok is not None else _addresses6(ctx, tok)


@lru_cache(maxsize=1 << 16)
def _addresses6_ok(text: str) -> tuple[tuple[int, int], ...] | None:
    try:
        return tuple(_addresses6(Ctx("", 0, 6), Tok(text, 0)))
    except PolicyError:
        return None


def _addresses6(ctx: Ctx, tok: Tok) -> list[tuple[int, int]]:
    out = []
    for part in tok.text.split(","):
        if not part:
            raise ctx.err("empty address in list", tok)
        addr, slash, m = part.partition("/")
        ip = _ipv6(ctx, tok, addr)
        if not slash:
            mask = V6_ALL
        elif m.isdigit():
            if int(m) > 128:
                raise ctx.err("bad prefix length (0..128)", tok)
            mask = (V6_ALL << (128 - int(m))) & V6_ALL
        elif ":" in m:
            mask = _ipv6(ctx, tok, m)
        else:
            raise ctx.err(f"invalid mask {m!r} (ip6tables takes a prefix length 0..128 or an IPv6 mask)", tok)
        out.append((ip & mask, mask))
    return out


def addresses(ctx: Ctx, tok: Tok) -> list[tuple[int, int]]:
    if ctx.family == 6:
        return addresses6(ctx, tok)
    out = []
    for part in tok.text.split(","):
        if not part:
            raise ctx.err("empty address in list", tok)
        addr, slash, m = part.partition("/")
        ip = _ipv4(ctx, tok, addr)
        if not slash:
            mask = 0xFFFFFFFF
        elif m.isdigit():
            if int(m) > 32:
                raise ctx.err("bad prefix length (0..32)", tok)
            mask = (0xFFFFFFFF << (32 - int(m))) & 0xFFFFFFFF
        else:
            mask = _ipv4(ctx, tok, m)
        out.append((ip & mask, mask))
    return out


def _number(ctx: Ctx, tok: Tok, text: str, top: int, what: str) -> int:
    if not text.isdigit():
        raise ctx.err(f"bad {what} {text!r}", tok)
    v = int(text)
    if v > top:
        raise ctx.err(f"{what} {v} out of range (0..{top})", tok)
    return v


def port_number(ctx: Ctx, tok: Tok, text: str) -> int:
    if text in SERVICES:
        return SERVICES[text]
    if text and not text.isdigit() and re.match(r"^[A-Za-z][\w-]*$", text):
        raise ctx.err(f"unknown service name {text!r} (write the port number)", tok)
    return _number(ctx, tok, text, 0xFFFF, "port")


def port_range(ctx: Ctx, tok: Tok, text: str) -> tuple[int, int, bool]:
    if ":" not in text:
        p = port_number(ctx, tok, text)
        return p, p, False
    a, _, b = text.partition(":")
    lo = port_number(ctx, tok, a) if a else 0
    hi = port_number(ctx, tok, b) if b else 0xFFFF
    if lo > hi:
        raise ctx.err("invalid port range (min > max)", tok)
    return lo, hi, True


def _protocol(ctx: Ctx, tok: Tok) -> int:
    t = tok.text.lower()
    if t == "all":
        return 0
    if t in PROTO_BY_NAME:
        return PROTO_BY_NAME[t]
    if t in PROTO_ALIASES:
        return PROTO_ALIASES[t]
    if t.isdigit():
        return _number(ctx, tok, t, 255, "protocol number")
    raise ctx.err("unknown protocol", tok)


def _flags(ctx: Ctx, tok: Tok) -> int:
    v = 0
    for w in tok.text.split(","):
        if w.upper() not in TCP_FLAG_WORDS:
            raise ctx.err(f"unknown TCP flag {w!r}", tok)
        v |= TCP_FLAG_WORDS[w.upper()]
    return v


def _icmp(ctx: Ctx, tok: Tok) -> tuple[int, int, int]:
    t = tok.text
    if t.lower() in ICMP_TYPES:
        return ICMP_TYPES[t.lower()]
    typ, slash, code = t.partition("/")
    return _type_code(ctx, tok, typ, slash, code, "ICMP", "")


def _type_code(ctx: Ctx, tok: Tok, typ: str, slash: str, code: str, what: str, why: str) -> tuple[int, int, int]:
    """TYPE[/CODE] of `--icmp-type` and `--icmpv6-type`: (type, code low, code high). Code ranges other than 0:255
    are refused: iptables and ip6tables accept them but print only their minimum back, which would reload as another
    rule; refuse rather than change the policy's meaning."""
    ty = _number(ctx, tok, typ, 255, f"{what} type")
    if not slash:
        return ty, 0, 0xFF
    if ":" in code:
        a, _, b = code.partition(":")
        c1, c2 = _number(ctx, tok, a, 255, f"{what} code"), _number(ctx, tok, b, 255, f"{what} code")
        if c1 != c2 and (c1, c2) != (0, 255):
            raise ctx.err(f"{what} code ranges other than 0:255 are not supported{why}", tok)
        return ty, c1, c2
    c = _number(ctx, tok, code, 255, f"{what} code")
    return ty, c, c


def _icmp6(ctx: Ctx, tok: Tok) -> tuple[int, int, int]:
    """`--icmpv6-type` as ip6tables 1.8.9 reads it (parse_icmpv6): a unique case-insensitive prefix of a name, or
    TYPE[/CODE]. Code ranges are refused: ip6tables keeps them but saves only their minimum, which reloads as
    another rule (the same reason the IPv4 parser refuses them)."""
    t = tok.text
    hits = [n for n in ICMP6_TYPES if t and n.startswith(t.lower())]
    if len(hits) > 1:
        raise ctx.err(f"ambiguous ICMPv6 type {t!r}: {hits[0]!r} or {hits[1]!r}?", tok)
    if hits:
        return ICMP6_TYPES[hits[0]]
    typ, slash, code = t.partition("/")
    if ":" in typ:
        raise ctx.err("ICMPv6 type ranges are not supported (ip6tables refuses them)", tok)
    if not typ.isdigit():
        raise ctx.err(f"unknown ICMPv6 type {t!r}", tok)
    return _type_code(ctx, tok, typ, slash, code, "ICMPv6", " (ip6tables saves only the first)")


def _iface(ctx: Ctx, tok: Tok) -> str:
    if not tok.text:
        raise ctx.err("empty interface name", tok)
    if len(tok.text) >= IFNAMSIZ:
        raise ctx.err(f"interface name longer than {IFNAMSIZ - 1} characters", tok)
    if any(c.isspace() or c in "/" for c in tok.text):
        raise ctx.err("bad character in interface name", tok)
    return tok.text


# --- one rule ---------------------------------------------------------------------------------------------------


class RuleParser:
    """Parses the option tokens of one rule (after `-A CHAIN`) into ParsedRule objects (several for `-s a,b`)."""

    def __init__(self, ctx: Ctx, toks: list[Tok], chain: str, chains: set[str], origin: Origin):
        self.ctx, self.chain, self.chains, self.origin = ctx, chain, chains, origin
        self.toks = self._split(toks)
        self.i = 0
        self.family = ctx.family
        self.implicit = IMPLICIT_MATCH6 if ctx.family == 6 else IMPLICIT_MATCH
        self.r = ParsedRule(chain=chain, origin=origin, family=ctx.family)
        self.srcs: list[tuple[int, int]] | None = None
        self.dsts: list[tuple[int, int]] | None = None
        self.src_inv = self.dst_inv = False
        self.seen: dict[str, Tok] = {}
        self.current: object | None = None  # the match (or "target") that takes unknown tokens
        self.match_toks: dict[int, Tok] = {}  # id(match) -> its -m token, for late errors
        self.match_seen: dict[int, set[str]] = {}

    def _split(self, toks: list[Tok]) -> list[Tok]:
        """`--opt=value` and `-pVALUE` into two tokens, as getopt_long does."""
        out = []
        for t in toks:
            if not t.quoted and t.text.startswith("--") and "=" in t.text:
                name, _, val = t.text.partition("=")
                out += [Tok(name, t.col), Tok(val, t.col + len(name) + 1)]
            elif (
                not t.quoted and len(t.text) > 2 and t.text[0] == "-" and t.text[1] in "sdpiojgmc" and t.text[1] != "-"
            ):
                out += [Tok(t.text[:2], t.col), Tok(t.text[2:], t.col + 2)]
            else:
                out.append(t)
        return out

    def _next_arg(self, opt: Tok, what: str = "an argument") -> Tok:
        if self.i >= len(self.toks):
            raise self.ctx.err(f"option {opt.text} needs {what}", opt)
        t = self.toks[self.i]
        self.i += 1
        return t

    def _bare(self, t: Tok) -> bool:
        """Whether `t` may be an option or `!`. iptables ignores quoting (argv is argv); only inside a verbatim
        group, whose options' arity we do not know, is a quoted `"-j"` or `"!"` taken as that group's value."""
        return not t.quoted or not isinstance(self.current, (Verbatim, str))

    def parse(self) -> list[ParsedRule]:
        inv_tok: Tok | None = None
        while self.i < len(self.toks):
            t = self.toks[self.i]
            self.i += 1
            if t.text == "!" and self._bare(t):
                nxt = self.toks[self.i] if self.i < len(self.toks) else None
                if isinstance(self.current, (Verbatim, str)) and not (
                    nxt and (_is_std(nxt.text) or self._routable(nxt.text))
                ):
                    self._verbatim(t)
                    continue
                if inv_tok is not None:
                    raise self.ctx.err("multiple ! flags not allowed", t)
                if nxt is None:
                    raise self.ctx.err("! at the end of the rule", t)
                inv_tok = t
                continue
            inv = inv_tok is not None
            if _is_std(t.text) and self._bare(t):
                self._std(t, inv, inv_tok)
            elif isinstance(self.current, (Verbatim, str)) and not self._routable(t.text):
                if inv:
                    self._verbatim(inv_tok)
                self._verbatim(t)
            else:
                self._match_option(t, inv)
            inv_tok = None
        return self._finish()

    def _verbatim(self, t: Tok) -> None:
        if self.current == "target":
            self.r.target_args.append(t.text)
        else:
            self.current.tokens.append(t.text)

    def _std(self, t: Tok, inv: bool, inv_tok: Tok | None) -> None:
        opt = _STD_LONG.get(t.text, t.text)
        if inv and opt not in _INVERTIBLE_STD:
            raise self.ctx.err(f"cannot have ! before {t.text}", inv_tok)
        if opt not in ("-m",) and opt in self.seen:
            raise self.ctx.err(f"multiple {opt} options not allowed", t)
        self.seen.setdefault(opt, t)
        self.current = None
        if opt == "-4":
            if self.family == 6:
                raise self.ctx.err("-4: an IPv4 rule in an IPv6 policy (ip6tables-restore skips such a line)", t)
            return
        if opt == "-6":
            if self.family == 4:
                raise self.ctx.err(
                    f"-6: an IPv6 rule in an IPv4 policy (iptables-restore skips such a line; {V6_HINT})", t
                )
            return
        if opt == "-f" and self.family == 6:
            raise self.ctx.err("-f is not supported in IPv6 (ip6tables: use -m frag)", t)
        if opt == "-f":
            self.r.frag = not inv
            return
        # iptables 1.8.9 has no intrapositioned negation (`-s ! A`, `--dport ! 80`): a `!` after an option is
        # that option's value, and the value parsers refuse it as iptables does.
        arg = self._next_arg(t)
        if opt in ("-s", "-d"):
            addrs = addresses(self.ctx, arg)
            if inv and len(addrs) > 1:
                raise self.ctx.err("! not allowed with multiple addresses", arg)
            if inv and addrs[0][1] == 0:
                raise self.ctx.err("! with a /0 address would never match", arg)
            if opt == "-s":
                self.srcs, self.src_inv = addrs, inv
            else:
                self.dsts, self.dst_inv = addrs, inv
        elif opt == "-p":
            p = _protocol(self.ctx, arg)
            if p == 0 and inv:
                raise self.ctx.err("rule would never match protocol", arg)
            self.r.proto, self.r.proto_invert = p, inv
            self.proto_tok = arg
        elif opt in ("-i", "-o"):
            name = _iface(self.ctx, arg)
            if opt == "-i":
                self.r.iif = Iface(name, inv)
            else:
                self.r.oif = Iface(name, inv)
        elif opt == "-c":
            if not re.match(r"^\d+,\d+$", arg.text):
                raise self.ctx.err("-c needs PACKETS,BYTES", arg)
        elif opt == "-m":
            self._load(arg)
        elif opt in ("-j", "-g"):
            if "-j" in self.seen and "-g" in self.seen:
                raise self.ctx.err("give -j or -g, not both", t)
            self._target(opt, arg)

    def _load(self, name_tok: Tok) -> object:
        name = name_tok.text
        if not name or name.startswith("-"):
            raise self.ctx.err("-m needs a match name", name_tok)
        # Every -m loads a new instance, as iptables does (`-m tcp --dport 80 -m tcp --dport 22` holds two tcp
        # matches, both checked; iptables-nft 1.8.9 lists only the last --dport, iptables-legacy lists both), and
        # an option goes to the latest instance that takes it (`_owner`). The instances' boxes are intersected.
        if name in ("tcp", "udp"):
            m = TcpUdp(name)
        elif self.family == 6 and name in ICMP6_NAMES:
            m = Icmp6()
        elif self.family == 6 and name == "icmp":
            raise self.ctx.err("-m icmp is IPv4's (ip6tables: -p ipv6-icmp -m icmp6 --icmpv6-type T)", name_tok)
        elif name == "icmp":
            m = Icmp()
        elif name == "multiport":
            m = Multiport()
        elif name == "iprange":
            m = Iprange(family=self.family)
        elif name == "comment":
            m = Comment()
        else:
            m = Verbatim(name)
        self.r.matches.append(m)
        self.match_toks[id(m)] = name_tok
        self.match_seen[id(m)] = set()
        self.current = m
        return m

    def _target(self, opt: str, arg: Tok) -> None:
        name = arg.text
        if not name or name.startswith("-"):
            raise self.ctx.err(f"{opt} needs a target", arg)
        if opt == "-g":
            if name not in self.chains:
                raise self.ctx.err("-g needs a user-defined chain", arg)
        elif name not in KNOWN_TARGETS and name not in self.chains:
            raise self.ctx.err("unknown target (neither a netfilter target nor a defined chain)", arg)
        elif self.family == 6 and name in _IPV4_ONLY_TARGETS:
            raise self.ctx.err(f"target {name} is IPv4's (ip6tables has no such target)", arg)
        if name == self.chain:
            raise self.ctx.err(f"chain {name} jumps to itself (loop)", arg)
        self.r.target, self.r.goto = name, opt == "-g"
        self.target_tok = arg
        # Extension targets take their own options; standard verdicts and chains take none.
        self.current = "target" if name in KNOWN_TARGETS and name not in STANDARD_TARGETS else None

    def _owner(self, name: str) -> tuple[object | None, str | None]:
        """Which modelled match takes option `name`: a loaded one, or the one `-p` would load implicitly."""
        # iptables offers an option to every loaded match; failing that, -p tcp/udp/icmp loads its match.
        for m in reversed(self.r.matches):
            if not isinstance(m, Verbatim) and name in _MATCH_OPTS.get(_kind(m), {}):
                return m, None
        if self.r.proto in self.implicit and not self.r.proto_invert:
            mname = self.implicit[self.r.proto]
            if name in _MATCH_OPTS[mname]:
                return None, mname
        return None, None

    def _routable(self, text: str) -> bool:
        """Whether an option met inside a verbatim match/target group really belongs to a modelled match.

        Only sctp and dccp (kept verbatim) share option names with the modelled matches; everything else
        that a modelled match knows is taken by it, as iptables does.
        """
        name = text.split("=", 1)[0] if text.startswith("--") else text
        if isinstance(self.current, Verbatim) and self.current.name in ("sctp", "dccp"):
            return False
        owner, implicit = self._owner(name)
        return owner is not None or implicit is not None

    def _match_option(self, t: Tok, inv: bool) -> None:
        name = t.text
        owner, implicit = self._owner(name)
        if owner is None and implicit is not None:
            owner = self._load(Tok(implicit, t.col))
        if owner is None:
            if self.r.proto in self.implicit and name in (
                "--sport",
                "--dport",
                "--icmp-type",
                "--icmpv6-type",
                "--tcp-flags",
                "--syn",
            ):
                raise self.ctx.err(f"unknown option for -p {canonical.proto_text(self.r.proto)}", t)
            raise self.ctx.err("unknown option", t)
        self.current = owner
        kind = _kind(owner)
        canon, nargs = _MATCH_OPTS[kind][name]
        if canon in self.match_seen[id(owner)] or (
            kind == "tcp"
            and canon in ("--syn", "--tcp-flags")
            and {"--syn", "--tcp-flags"} & self.match_seen[id(owner)]
        ):
            raise self.ctx.err(f"only one {canon} allowed", t)
        if kind == "multiport" and self.match_seen[id(owner)]:
            raise self.ctx.err("multiport takes only one of --sports, --dports, --ports", t)
        self.match_seen[id(owner)].add(canon)
        if canon == "--comment" and inv:
            raise self.ctx.err("cannot have ! before --comment", t)
        args = [self._next_arg(t, f"{nargs} argument(s)") for _ in range(nargs)]
        ctx = self.ctx
        if isinstance(owner, TcpUdp):
            if canon in ("--sport", "--dport"):
                lo, hi, _ = port_range(ctx, args[0], args[0].text)
                setattr(owner, canon[2:], PortCheck(lo, hi, inv))
            elif canon == "--tcp-flags":
                owner.flags = (_flags(ctx, args[0]), _flags(ctx, args[1]), inv)
            elif canon == "--syn":
                owner.flags = (0x17, 0x02, inv)
            elif canon == "--tcp-option":
                owner.option = (_number(ctx, args[0], args[0].text, 255, "TCP option"), inv)
        elif isinstance(owner, Icmp6):
            owner.type, owner.code_min, owner.code_max = _icmp6(ctx, args[0])
            owner.invert = inv
        elif isinstance(owner, Icmp):
            owner.type, owner.code_min, owner.code_max = _icmp(ctx, args[0])
            owner.invert = inv
        elif isinstance(owner, Multiport):
            owner.kind, owner.invert = canon[2:], inv
            count = 0
            for part in args[0].text.split(","):
                if not part:
                    raise ctx.err("empty port in list", args[0])
                lo, hi, rng = port_range(ctx, args[0], part)
                if rng and lo >= hi:
                    raise ctx.err(f"invalid port range {part!r} in multiport list", args[0])
                owner.entries.append((lo, hi, rng))
                count += 2 if rng else 1
            if count > MULTIPORT_MAX:
                raise ctx.err(f"too many ports in multiport list (at most {MULTIPORT_MAX}; a range counts 2)", args[0])
        elif isinstance(owner, Iprange):
            a, dash, b = args[0].text.partition("-")
            ip = _ipv6 if self.family == 6 else _ipv4
            lo = ip(ctx, args[0], a)
            hi = ip(ctx, args[0], b) if dash else lo
            if lo > hi:
                raise ctx.err("address range is reversed and would never match", args[0])
            setattr(owner, "src" if canon == "--src-range" else "dst", (lo, hi, inv))
        elif isinstance(owner, Comment):
            if len(args[0].text) > COMMENT_MAX:
                raise ctx.err(f"comment longer than {COMMENT_MAX} characters", args[0])
            owner.text = args[0].text

    def _finish(self) -> list[ParsedRule]:
        r, ctx = self.r, self.ctx
        for m in r.matches:
            mt = self.match_toks[id(m)]
            kind = _kind(m)
            need = (_MATCH_PROTO6 if self.family == 6 else _MATCH_PROTO).get(kind)
            if need is not None and (r.proto != need or r.proto_invert):
                pname = "ipv6-icmp" if kind == "icmp6" else kind
                raise ctx.err(f"-m {kind} needs -p {pname} (not negated)", mt)
            if kind == "multiport":
                if not m.kind:
                    raise ctx.err("multiport needs --sports, --dports or --ports", mt)
                if r.proto not in PORT_PROTOS or r.proto_invert:
                    raise ctx.err("multiport needs -p tcp, udp, udplite, sctp or dccp", mt)
            if kind == "icmp" and m.type < 0:
                raise ctx.err("icmp needs --icmp-type", mt)
            if kind == "icmp6" and m.type < 0:
                raise ctx.err("icmp6 needs --icmpv6-type", mt)
            if kind == "iprange" and m.src is None and m.dst is None:
                raise ctx.err("iprange needs --src-range or --dst-range", mt)
            if kind == "comment" and m.text is None:
                raise ctx.err("comment needs --comment", mt)
            if isinstance(m, Verbatim) and not m.tokens and m.name in _NEED_OPTIONS:
                raise ctx.err(f"-m {m.name} needs options", mt)
        if self.family == 6 and r.target == "REJECT":
            self._reject6()
        out = []
        fam = self.family
        for s in self.srcs or [None]:
            for d in self.dsts or [None]:
                rr = ParsedRule(**{k: getattr(r, k) for k in r.__dataclass_fields__})
                rr.src = Addr(s[0], s[1], self.src_inv, fam) if s else None
                rr.dst = Addr(d[0], d[1], self.dst_inv, fam) if d else None
                out.append(rr)
        return out

    def _reject6(self) -> None:
        """REJECT's options as ip6tables takes them (libip6t_REJECT: a unique prefix of a reject type; tcp-reset
        only for -p tcp). The tokens stay as written (ip6tables-restore reads them the same way)."""
        args, tok = self.r.target_args, self.target_tok
        if not args:
            return
        if args[0] != "--reject-with" or len(args) != 2:
            raise self.ctx.err(f"REJECT takes only --reject-with TYPE (got {' '.join(args)})", tok)
        want = args[1]
        hits = sorted({v for k, v in REJECT6_WITH.items() if want and k.startswith(want.lower())})
        if len(hits) != 1:
            why = "ambiguous" if hits else "unknown"
            hint = " (icmp-* types are IPv4's; ip6tables: icmp6-*)" if want.startswith("icmp-") else ""
            raise self.ctx.err(f"{why} IPv6 reject type {want!r}{hint}", tok)
        if hits[0] == "tcp-reset" and (self.r.proto != PROTO_TCP or self.r.proto_invert):
            raise self.ctx.err("--reject-with tcp-reset needs -p tcp (the kernel refuses it otherwise)", tok)


# Matches that iptables refuses without any option (so `-m X` alone is an error, not a complex rule).
_NEED_OPTIONS = frozenset({"string", "conntrack", "state", "mark", "connmark", "physdev", "set", "recent", "u32"})


# Targets ip6tables does not have (IPv4-only xtables targets).
_IPV4_ONLY_TARGETS = frozenset({"ULOG", "CLUSTERIP", "ECN", "TTL"})


def _kind(m) -> str:
    if isinstance(m, TcpUdp):
        return m.name
    return {Icmp: "icmp", Icmp6: "icmp6", Multiport: "multiport", Iprange: "iprange", Comment: "comment"}.get(
        type(m), "verbatim"
    )


def parse_rule(
    text: str,
    chain: str = "FORWARD",
    chains: set[str] | None = None,
    filename: str = "<rule>",
    line: int = 1,
    config: Config | None = None,
    mode: str = SHELL,
    family: int = 4,
) -> list[ParsedRule]:
    """Parse one rule's options (no `-A`); the parsed rules carry boxes and complex groups (see analyse).

    The text is read as written after `iptables -A CHAIN` on a shell command line (the form of the iptables
    project's .t tests); `mode=RESTORE` reads it as a line of an iptables-save file (iptables.tokens)."""
    from hypafilter.ir.family import address_space

    config = config or Config()
    ctx = Ctx(filename, line, family)
    toks = tokenize(text, line, filename, mode)
    origin = Origin(filename, line, chain, text.strip())
    rules = RuleParser(ctx, toks, chain, set(chains or ()), origin).parse()
    with address_space(family):
        analyse_all(rules, interfaces_for(config, chain))
    return rules


def interfaces_for(config: Config, base_chain: str) -> Interfaces:
    """What the rules of a policy for `base_chain` may assume about the NIC's frames' interfaces: the deployment's
    Interfaces in FORWARD, where the NIC's frames are bridged; elsewhere only which interface each port is."""
    ifaces = config.interfaces
    return ifaces if base_chain == "FORWARD" else Interfaces("", ifaces.ports)


def analyse_all(rules: list[ParsedRule], ifaces: Interfaces) -> None:
    """Boxes and complex groups of parsed rules, interface checks resolved against `ifaces`."""
    for r in rules:
        analyse(r, ifaces, canonical.options_of)


# --- documents -------------------------------------------------------------------------------------------------
