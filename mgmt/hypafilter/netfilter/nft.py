"""The software strategies' chains as `nft -f` text: a `Program` rendered for nftables, dispatch as a verdict map.

Only what nftables text can say is written (addresses, address ranges, protocols, ports, ICMP and ICMPv6, TCP flags,
conntrack state, limit, mark, comments and the common targets); anything else raises HypafilterError, because nft
cannot load xtables matches from text. iptables-restore (`netfilter.restore`) is the reference form. A policy of
family 6 (an ip6tables one) is written for an `ip6` table: `ip6 saddr`, `icmpv6 type`.
"""

from __future__ import annotations

import ipaddress
from dataclasses import replace

from hypafilter.analysis.program import (
    Placed,
    build_program,
    original_placements,
    place_policy_rule,
    resolve_target,
)
from hypafilter.errors import HypafilterError, shown


class _NftUnsupported(HypafilterError):
    pass


def _nft_ports(spec: str) -> str:
    parts = [p.replace(":", "-") for p in spec.split(",")]
    return parts[0] if len(parts) == 1 else "{ " + ", ".join(parts) + " }"


# ip6tables' xtables matches that drop the frame outright ("hotdrop") when the transport header they read is not all
# there (and the frame is no later fragment): tcp_mt, udp_mt, icmp6_match, multiport (net/netfilter,
# net/ipv6/netfilter); nft's expressions just do not match it. The bytes each reads. Which of them a loaded policy
# runs as xtables matches is the iptables back end's choice (legacy: all; ip6tables-nft 1.8.9 writes tcp, udp and
# multiport as native expressions and keeps icmp6 an xtables match): `hotdrop` of to_nft, xt_matches6.
HOTDROP6 = {"tcp": 20, "udp": 8, "icmp6": 8, "multiport": 4}
HOTDROP6_PROTOS = ("tcp", "udp", "udplite", "ipv6-icmp", "sctp", "dccp")  # the protocols those matches take


def _nft_match(
    tokens: tuple[str, ...],
    where: str,
    family: int = 4,
    guards: list[tuple[list[str], int]] | None = None,
    hotdrop=frozenset(HOTDROP6),
) -> list[str]:
    """nft expressions for iptables (family 6: ip6tables) option tokens; HypafilterError for checks nft text cannot
    express. `guards` (family 6) gets, for each HOTDROP6 match in `hotdrop`, (the expressions of the checks before
    it, the bytes it reads): where those hold, a short transport header is a drop in ip6tables (to_nft writes that
    first)."""
    ip = "ip6" if family == 6 else "ip"
    icmp_mod = "icmp6" if family == 6 else "icmp"
    out: list[str] = []
    toks = list(tokens)
    i = 0
    proto = None
    neg = False

    def take() -> str:
        nonlocal i
        if i >= len(toks):
            raise HypafilterError(f"{where}: option {shown(toks[i - 1])!r} without a value")
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
            out.append(f"{ip} saddr {op}{take()}")
        elif t in ("-d", "--destination"):
            out.append(f"{ip} daddr {op}{take()}")
        elif t in ("--src-range", "--dst-range"):
            out.append(f"{ip} {'saddr' if t == '--src-range' else 'daddr'} {op}{take()}")
        elif t in ("-p", "--protocol"):
            proto = take()
            out.append(f"meta l4proto {op}{proto}")
        elif t in ("-i", "--in-interface"):
            out.append(f'iifname {op}"{take()}"')
        elif t in ("-o", "--out-interface"):
            out.append(f'oifname {op}"{take()}"')
        elif t == "-m":
            mod = take()
            if family == 6 and guards is not None and mod in HOTDROP6 and mod in hotdrop:
                guards.append((_proto_first([x for x in out if not x.startswith("comment")]), HOTDROP6[mod]))
            if mod not in (
                "tcp",
                "udp",
                icmp_mod,
                "multiport",
                "iprange",
                "conntrack",
                "state",
                "limit",
                "mark",
                "comment",
            ):
                raise _NftUnsupported(
                    f"{where}: match -m {shown(mod)} has no nftables equivalent in hypafilter's nft output"
                )
        elif t in ("--sport", "--source-port", "--sports", "--source-ports"):
            out.append(f"{proto} sport {op}{_nft_ports(take())}")
        elif t in ("--dport", "--destination-port", "--dports", "--destination-ports"):
            out.append(f"{proto} dport {op}{_nft_ports(take())}")
        elif t == "--icmp-type" and family == 4:
            out += _nft_icmp(take(), bool(op), where)
        elif t == "--icmpv6-type" and family == 6:
            out += _nft_icmp6(take(), bool(op), where)
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
            raise _NftUnsupported(f"{where}: option {shown(t)!r} has no nftables equivalent in hypafilter's nft output")
    if family == 6:
        out = _proto_first(out)
    # nft wants a comment last.
    return [x for x in out if not x.startswith("comment")] + [x for x in out if x.startswith("comment")]


def _proto_first(exprs: list[str]) -> list[str]:
    """A family-6 rule's protocol test first, as ip6tables-nft 1.8.9 writes its rules (`nft --debug=netlink`): a
    1-byte compare that leaves a rule of another protocol before its 16-byte address loads and masks (docs/results.md
    "× nft with IPv6": 51,649 ns a frame address first against 19,457 protocol first on acl1_1100 mapped into IPv6).
    IPv4's keeps the policy's order (its figures were measured so; a 4-byte address test is cheap)."""
    return [x for x in exprs if x.startswith("meta l4proto")] + [x for x in exprs if not x.startswith("meta l4proto")]


def _nft_icmp(spec: str, negated: bool, where: str) -> list[str]:
    """`--icmp-type` as iptables -S prints it (any, T, T/C, T/A:B). Type 255 matches every ICMP packet, as in the
    kernel; a negated type/code pair is one test of the pair, not two negated tests."""
    typ, _, code = spec.partition("/")
    if typ in ("any", "255"):
        return ["icmp type != 0-255"] if negated else []  # never / always true for an ICMP packet
    code = code.replace(":", "-")
    if not code:
        return [f"icmp type {'!= ' if negated else ''}{typ}"]
    if not negated:
        return [f"icmp type {typ} icmp code {code}"]
    if "-" in code:
        raise _NftUnsupported(f"{where}: ! --icmp-type {shown(spec)} (a negated code range) has no nftables form here")
    return [f"icmp type . icmp code != {{ {typ} . {code} }}"]


def xt_matches6(ns: str | None) -> frozenset[str]:
    """The HOTDROP6 matches the ip6tables filter table loaded in `ns` runs as xtables matches (to_nft's `hotdrop`):
    every one with the legacy back end, else those its nf_tables bytecode calls by name (`match name icmp6`)."""
    import re

    from hypafilter import netns
    from hypafilter.netfilter import ip6

    if ip6.backend(ns) == "legacy":
        return frozenset(HOTDROP6)
    code = netns.run(["nft", "--debug=netlink", "list", "table", "ip6", "filter"], ns, check=False)
    return frozenset(re.findall(r"\[ match name (\S+) rev", code)) & frozenset(HOTDROP6)


def _nft_icmp6(spec: str, negated: bool, where: str) -> list[str]:
    """`--icmpv6-type` as ip6tables -S prints it (T or T/C, numbers). Unlike IPv4's icmp match, ip6tables' icmp6
    has no "any" type: 255 is a type like the others."""
    typ, _, code = spec.partition("/")
    if not typ.isdigit() or not (code.isdigit() or not code):
        raise _NftUnsupported(f"{where}: --icmpv6-type {shown(spec)} is not T or T/C in numbers")
    if not code:
        return [f"icmpv6 type {'!= ' if negated else ''}{typ}"]
    if not negated:
        return [f"icmpv6 type {typ} icmpv6 code {code}"]
    return [f"icmpv6 type . icmpv6 code != {{ {typ} . {code} }}"]


def _nft_target(p: Placed, where: str) -> str:
    if p.chain:
        return f"jump {p.target}"
    target, args = p.target, p.args
    if target == "RETURN":
        return "return"
    if target in ("ACCEPT", "DROP"):
        return target.lower()
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
    raise _NftUnsupported(f"{where}: target {shown(target)} has no nftables equivalent in hypafilter's nft output")


def _split_rule(toks: tuple[str, ...]) -> tuple[tuple[str, ...], str, tuple[str, ...]]:
    """Option tokens, target, target args of a canonical rule."""
    for i, t in enumerate(toks):
        if t in ("-j", "-g", "--jump", "--goto") and i + 1 < len(toks):
            return tuple(toks[:i]), toks[i + 1], tuple(toks[i + 2 :])
    return tuple(toks), "", ()


def to_nft(
    plan,
    strategy: str,
    *program,
    family: str | None = None,
    table: str | None = None,
    fast_prefix: str | None = None,
    hotdrop=frozenset(HOTDROP6),
    **options,
) -> str:
    """`nft -f` input: one table owned by the tool (deleted and recreated); dispatch as a verdict map on the mark.
    `family`: the table's (default ip6 for a policy of family 6, else ip).

    Complex matches without an nft equivalent (string, statistic, recent, ...) raise HypafilterError: nft cannot
    load xtables matches from text, so the nft form is optional and iptables-restore is the reference.
    `program` and `options` are build_program's (prefix, mark_mask, mark_shift, nic_mode).

    A policy of family 6 gets hotdrop guards (HOTDROP6) before its rules with the matches named in `hotdrop`
    (default all: x_tables' ip6tables; xt_matches6 says which a loaded policy runs as xtables matches).
    `fast_prefix`: the table also holds the program without them under that prefix, and chain <prefix>ENTRY sends a frame that no ip6tables match
    can hotdrop (a later fragment, a protocol without such a match, a transport header of at least 20 bytes) there,
    any other to <prefix>MAIN: the guards cost only the frames they can concern.
    """
    prog = build_program(plan, strategy, *program, **options)
    pol = prog.policy
    fam = getattr(pol, "family", 4)
    family = family or ("ip6" if fam == 6 else "ip")
    tname = table or prog.prefix.rstrip("_").lower() or "hypafilter"
    chains = _nft_chains(prog, strategy, fam, frozenset(hotdrop))
    if fast_prefix is not None:
        if fam != 6:
            raise HypafilterError("to_nft: fast_prefix is for a policy of family 6 (its hotdrop guards)")
        chains.update(_nft_chains(build_program(plan, strategy, fast_prefix, *program[1:], **options), strategy, 6))
        protos = ", ".join(sorted(HOTDROP6_PROTOS))
        chains[f"{prog.prefix}ENTRY"] = [
            f"frag frag-off != 0 goto {fast_prefix}MAIN",
            f"meta l4proto != {{ {protos} }} goto {fast_prefix}MAIN",
            f"@th,{8 * max(HOTDROP6.values()) - 32},32 & 0x0 == 0x0 goto {fast_prefix}MAIN",  # 20 bytes there
            f"goto {prog.prefix}MAIN",
        ]
    out = [
        f"# hypafilter: strategy {strategy}, policy {pol.source} ({pol.base_chain}, policy {pol.default})",
        f"table {family} {tname}",
        f"delete table {family} {tname}",
        f"table {family} {tname} {{",
    ]
    for name, lines in chains.items():
        out.append(f"\tchain {name} {{")
        out += [f"\t\t{ln}" for line in lines for ln in line.split("\n")]
        out.append("\t}")
    out.append("}")
    return "\n".join(out) + "\n"


def _nft_chains(prog, strategy: str, fam: int, hotdrop=frozenset()) -> dict[str, list[str]]:
    """The program's chains as nft rule lines (a line may hold several rules, one a line); family 6: with the hotdrop
    guards of its rules' matches in `hotdrop` (HOTDROP6) and their chains."""
    pol = prog.policy
    chains: dict[str, list[str]] = {}
    helpers: dict[str, list[Placed]] = {}
    short: dict[str, list[str]] = {}  # the hotdrop guards' chains (guarded)

    def guarded(toks: tuple[str, ...], where: str, tail: list[str]) -> str:
        """The rule's line (its checks, then `tail`), after the hotdrop guards of its matches in `hotdrop` (family
        6): a jump to a chain SHORT<n> that drops a frame whose transport header is shorter than n bytes."""
        guards: list[tuple[list[str], int]] = []
        parts = _nft_match(toks, where, fam, guards, hotdrop)
        comments = [x for x in parts if x.startswith("comment")]
        parts = [x for x in parts if not x.startswith("comment")]
        lines = []
        for before, need in guards:
            name = f"{prog.prefix}SHORT{need}"
            short[name] = [
                "frag frag-off != 0 return",  # a later fragment: the match is false, no drop
                f"@th,{8 * need - 32},32 & 0x0 == 0x0 return",  # the load fails (no match) when the bytes are not there
                "drop",
            ]
            lines.append(" ".join([*before, f"jump {name}"]))
        return "\n".join([*lines, " ".join([*parts, *tail, *comments])])

    def rule_text(p: Placed, where: str) -> str:
        return guarded(p.options, where, [_nft_target(p, where)])

    def verbatim(toks: tuple[str, ...], where: str, in_base: bool) -> str:
        opts, tgt, args = _split_rule(toks)
        if not tgt:
            return guarded(opts, where, [])
        if tgt == "RETURN" and not in_base:  # leaves the user chain; only the base chain's RETURN is its policy
            return rule_text(Placed(opts, "RETURN"), where)
        return rule_text(replace(resolve_target(prog, tgt, args), options=opts), where)

    for name, rules in prog.chains.items():
        lines: list[str] = []
        if name == prog.verbatim_full:
            lines = [
                rule_text(x, f"{pol.source}: {name}")
                if isinstance(x, Placed)
                else verbatim(x, f"{pol.source}: {' '.join(map(shown, x))}", True)
                for x in original_placements(prog, helpers)
            ]
        else:
            marks = [r for r in rules if r.kind == "mark" and r.mask == (prog.mark_mask & 0xFFFFFFFF)]
            for r in rules:
                if r.kind == "policy":
                    rule = pol.rules[r.index]
                    where = f"{pol.source}:{rule.origin.line if rule.origin else r.index}"
                    lines.append(rule_text(place_policy_rule(prog, r.index, helpers), where))
                elif r.kind == "mark" and r in marks:
                    if r is marks[0]:
                        # The leaves of one dispatch node become a single verdict map on the whole mark.
                        vm = ", ".join(f"{m.value:#x} : {_nft_verdict(m.target)}" for m in marks)
                        lines.append(f"meta mark & {r.mask:#x} vmap {{ {vm} }}")
                elif r.kind == "mark":
                    lines.append(f"meta mark & {r.mask:#x} == {r.value:#x} {_nft_verdict(r.target, r.goto)}")
                elif r.kind == "unmark":
                    lines.append(f"meta mark set meta mark & {~r.mask & 0xFFFFFFFF:#x}")
                elif r.kind == "hdr":
                    if fam == 6:
                        raise _NftUnsupported(f"{pol.source}: strategy {strategy}'s header tests have no IPv6 nft form")
                    lines += _nft_hdr(r)
                else:
                    lines.append(_nft_verdict(r.target, r.goto))
        chains[name] = lines
    for uc in pol.user_chains.values():
        chains[prog.user_names[uc.name]] = [
            verbatim(toks, f"{pol.source}: chain {uc.name}", False) for toks in uc.rules
        ]
    for name, placed in helpers.items():
        chains[name] = [rule_text(p, f"{pol.source}: {name}") for p in placed]
    chains.update(short)
    return chains


def _nft_hdr(r) -> list[str]:
    """Strategy tree's dispatch rule (NfRule "hdr") in nft: what its test says, natively."""
    verdict = "return" if r.target == "RETURN" else _nft_verdict(r.target, r.goto)
    if r.test[0] == "proto":
        return [f"meta l4proto {r.test[1]} {verdict}"]
    if r.test[0] == "box":  # the live K0 tree's diversion to the live rules
        _, slo, shi, dlo, dhi, plo, phi = r.test
        ip = lambda v: str(ipaddress.IPv4Address(v))  # noqa: E731
        parts = [] if (plo, phi) == (0, 255) else [f"meta l4proto {plo}"]
        parts += [] if (slo, shi) == (0, 0xFFFFFFFF) else [f"ip saddr {ip(slo)}-{ip(shi)}"]
        parts += [] if (dlo, dhi) == (0, 0xFFFFFFFF) else [f"ip daddr {ip(dlo)}-{ip(dhi)}"]
        return [" ".join([*parts, verdict])]
    if r.test[0] == "range":
        _, d, lo, hi, proto = r.test
        span = lambda a, b: str(a) if a == b else f"{a}-{b}"  # noqa: E731
        if d < 2:
            ip = lambda v: str(ipaddress.IPv4Address(v))  # noqa: E731
            return [f"ip {'saddr' if d == 0 else 'daddr'} {span(ip(lo), ip(hi))} {verdict}"]
        name = {6: "tcp", 17: "udp"}[proto]
        return [f"meta l4proto {proto} {name} {'sport' if d == 3 else 'dport'} {span(lo, hi)} {verdict}"]
    # "guard": a TCP (UDP) frame that is a later fragment or whose 20 (8) byte header is not all there goes to the
    # linear copy (the u32 test of the iptables form); the kernel has trimmed a frame to its IP total length
    need = 20 if r.test[1] == 6 else 8
    out = [f"meta l4proto {r.test[1]} ip frag-off & 0x1fff != 0 {verdict}"]
    out += [f"meta l4proto {r.test[1]} ip hdrlength {h} ip length < {4 * h + need} {verdict}" for h in range(5, 16)]
    return out


def _nft_verdict(target: str, goto: bool = False) -> str:
    return target.lower() if target in ("ACCEPT", "DROP") else f"{'goto' if goto else 'jump'} {target}"
