"""Canonical iptables text of parsed rules, in the order and spelling `iptables -S` prints them."""

from __future__ import annotations

from functools import lru_cache

from hypafilter.iptables import rule as pr
from hypafilter.iptables.tables import PROTO_NAME, TCP_FLAGS
from hypafilter.iptables.writer import tokens_text


@lru_cache(maxsize=1 << 16)  # policies repeat the same addresses many times
def ip_str(v: int) -> str:
    return ".".join(str((v >> s) & 0xFF) for s in (24, 16, 8, 0))


@lru_cache(maxsize=1 << 16)
def ip6_str(v: int) -> str:
    """A 128-bit address as glibc's inet_ntop writes it (what ip6tables prints): the longest run of two or more zero
    groups (the first of equal runs) as `::`, lower-case hex without leading zeros, and the last 32 bits dotted for
    an IPv4-mapped (::ffff:a.b.c.d) or IPv4-compatible (::a.b.c.d, not ::, ::1 or ::0.0.x.y) address."""
    groups = [(v >> (112 - 16 * i)) & 0xFFFF for i in range(8)]
    best, cur = (-1, 0), (-1, 0)
    for i, g in enumerate(groups):
        if g == 0:
            cur = (cur[0] if cur[0] >= 0 else i, cur[1] + 1)
            if cur[1] > best[1]:
                best = cur
        else:
            cur = (-1, 0)
    if best[1] < 2:
        best = (-1, 0)
    dotted = best[0] == 0 and (best[1] == 6 or (best[1] == 5 and groups[5] == 0xFFFF))
    if dotted and best[1] == 6 and groups[6] == 0:  # (glibc: ::0.0.x.y is written as hex, ::1 and :: too)
        dotted = False
    out = []
    i = 0
    while i < 8:
        if i == best[0]:
            out.append(":" if i == 0 else "")
            i += best[1]
            if i == 8:
                out.append("")
            continue
        if dotted and i == 6:
            out.append(ip_str(v & 0xFFFFFFFF))
            break
        out.append(f"{groups[i]:x}")
        i += 1
    return ":".join(out)


def family_ip_str(v: int, family: int) -> str:
    return ip6_str(v) if family == 6 else ip_str(v)


def addr_text(a: pr.Addr) -> str:
    p = a.prefix
    ip = ip6_str if a.family == 6 else ip_str
    return f"{ip(a.net)}/{p}" if p is not None else f"{ip(a.net)}/{ip(a.mask)}"


def proto_text(p: int) -> str:
    return PROTO_NAME.get(p, str(p))


def flags_text(v: int) -> str:
    if v == 0:
        return "NONE"
    return ",".join(name for name, bit in TCP_FLAGS if v & bit)


def _neg(inv: bool) -> tuple[str, ...]:
    return ("!",) if inv else ()


def _port(p: pr.PortCheck) -> str:
    return str(p.lo) if p.lo == p.hi else f"{p.lo}:{p.hi}"


def match_tokens(m) -> tuple[str, ...]:
    """`-m NAME` and the match's options in the order its iptables extension saves them."""
    if isinstance(m, pr.TcpUdp):
        out = ["-m", m.name]
        for opt, pc in (("--sport", m.sport), ("--dport", m.dport)):
            if pc is not None and (pc.invert or not pc.is_full):
                out += [*_neg(pc.invert), opt, _port(pc)]
        if m.option is not None:
            out += [*_neg(m.option[1]), "--tcp-option", str(m.option[0])]
        if m.flags is not None and (m.flags[0] or m.flags[2]):
            out += [*_neg(m.flags[2]), "--tcp-flags", flags_text(m.flags[0]), flags_text(m.flags[1])]
        return tuple(out)
    if isinstance(m, pr.Multiport):
        ports = ",".join(f"{lo}:{hi}" if rng else str(lo) for lo, hi, rng in m.entries)
        return ("-m", "multiport", *_neg(m.invert), f"--{m.kind}", ports)
    if isinstance(m, pr.Iprange):
        out = ["-m", "iprange"]
        for opt, r in (("--src-range", m.src), ("--dst-range", m.dst)):
            if r is not None:
                ip = ip6_str if m.family == 6 else ip_str
                out += [*_neg(r[2]), opt, f"{ip(r[0])}-{ip(r[1])}"]
        return tuple(out)
    if isinstance(m, pr.Icmp6):  # libip6t_icmp6's save: the type, and the code unless it is every code
        t = str(m.type) if (m.code_min, m.code_max) == (0, 0xFF) else f"{m.type}/{m.code_min}"
        return ("-m", "icmp6", *_neg(m.invert), "--icmpv6-type", t)
    if isinstance(m, pr.Icmp):
        if m.type == 0xFF and m.code_min == 0 and m.code_max == 0xFF:
            t = "any"
        elif m.code_min == 0 and m.code_max == 0xFF:
            t = str(m.type)
        elif m.code_min == m.code_max:
            t = f"{m.type}/{m.code_min}"
        else:
            t = f"{m.type}/{m.code_min}:{m.code_max}"
        return ("-m", "icmp", *_neg(m.invert), "--icmp-type", t)
    if isinstance(m, pr.Comment):
        return ("-m", "comment", "--comment", m.text or "")
    if isinstance(m, pr.Verbatim):
        return ("-m", m.name, *m.tokens)
    raise TypeError(m)


def options_of(x) -> tuple[str, ...]:
    """Canonical tokens of one check: a match object, or a tagged tuple for the standard options."""
    if isinstance(x, tuple):
        kind = x[0]
        if kind == "addr":
            _, opt, a = x
            return (*_neg(a.invert), opt, addr_text(a))
        if kind == "iface":
            _, opt, i = x
            return (*_neg(i.invert), opt, i.name)
        if kind == "frag":
            return (*_neg(not x[1]), "-f")
        raise ValueError(kind)
    return match_tokens(x)


def _iface_shown(i: pr.Iface | None) -> bool:
    return i is not None and not (i.matches_all and not i.invert)


def rule_options(r: pr.ParsedRule) -> tuple[str, ...]:
    """The rule's checks without `-A CHAIN` and without the target, as `iptables -S` orders them."""
    if r.options_cache is not None:
        return r.options_cache
    out: list[str] = []
    if r.src is not None and (r.src.mask or r.src.invert):
        out += options_of(("addr", "-s", r.src))
    if r.dst is not None and (r.dst.mask or r.dst.invert):
        out += options_of(("addr", "-d", r.dst))
    if _iface_shown(r.iif):
        out += options_of(("iface", "-i", r.iif))
    if _iface_shown(r.oif):
        out += options_of(("iface", "-o", r.oif))
    if r.proto:
        out += [*_neg(r.proto_invert), "-p", proto_text(r.proto)]
    if r.frag is not None:
        out += options_of(("frag", r.frag))
    for m in r.matches:
        out += match_tokens(m)
    return tuple(out)


def target_tokens(r: pr.ParsedRule, target: str | None = None) -> tuple[str, ...]:
    t = r.target if target is None else target
    if not t:
        return ()
    return ("-g" if r.goto else "-j", t, *r.target_args)


def rule_tokens(r: pr.ParsedRule) -> tuple[str, ...]:
    """Options and target: what `iptables -S` prints after `-A CHAIN`."""
    return rule_options(r) + target_tokens(r)


def rule_text(r: pr.ParsedRule) -> str:
    return tokens_text(rule_tokens(r))
