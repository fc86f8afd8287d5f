"""Test fixtures: IR rules built directly (boxes and canonical iptables options that say the same thing), and the
paper's Listing 1 in IR form."""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence

from hypafilter.ir import PROTO_ICMP, PROTO_TCP, PROTO_UDP, Level, Origin, Policy, Rule
from hypafilter.ir.box import MAXV, complement, product_boxes


def _prefix_range(spec: str) -> tuple[int, int]:
    net = ipaddress.IPv4Network(spec, strict=False)
    return int(net.network_address), int(net.broadcast_address)


def make_rule(
    target: str = "ACCEPT",
    *,
    src: str | None = None,
    dst: str | None = None,
    not_src: bool = False,
    not_dst: bool = False,
    proto: str | None = None,
    sport: tuple[int, int] | None = None,
    dport: tuple[int, int] | None = None,
    dports: Sequence[int] | None = None,
    complex: Sequence[Sequence[str]] = (),
    target_args: Sequence[str] = (),
    line: int = 0,
    chain: str = "FORWARD",
) -> Rule:
    """An IR rule with boxes and canonical iptables options that say the same thing.

    Negated addresses and multiport lists become several boxes (as the parser does).
    """
    opts: list[str] = []
    per_dim: dict[str, list[tuple[int, int]]] = {}
    for flag, spec, neg, dim in (("-s", src, not_src, "src"), ("-d", dst, not_dst, "dst")):
        if spec is None:
            continue
        lo, hi = _prefix_range(spec)
        per_dim[dim] = complement(lo, hi, MAXV[0]) if neg else [(lo, hi)]
        opts += (["!"] if neg else []) + [flag, str(ipaddress.IPv4Network(spec, strict=False))]
    if proto is not None:
        num = {"tcp": PROTO_TCP, "udp": PROTO_UDP, "icmp": PROTO_ICMP}[proto]
        per_dim["proto"] = [(num, num)]
        opts += ["-p", proto]
    if sport is not None or dport is not None:
        if proto not in ("tcp", "udp"):
            raise ValueError("ports need -p tcp or -p udp")
        opts += ["-m", proto]
        for flag, rng, dim in (("--sport", sport, "sport"), ("--dport", dport, "dport")):
            if rng is not None:
                per_dim[dim] = [rng]
                opts += [flag, f"{rng[0]}" if rng[0] == rng[1] else f"{rng[0]}:{rng[1]}"]
    if dports is not None:
        if proto not in ("tcp", "udp") or dport is not None:
            raise ValueError("multiport needs -p tcp/udp and no --dport")
        per_dim["dport"] = [(p, p) for p in dports]
        opts += ["-m", "multiport", "--dports", ",".join(str(p) for p in dports)]
    for group in complex:
        opts += list(group)
    boxes = product_boxes(list(per_dim.items()))
    text = " ".join(["-A", chain, *opts, "-j", target, *target_args])
    return Rule(
        boxes=tuple(boxes),
        target=target,
        complex=tuple(tuple(g) for g in complex),
        target_args=tuple(target_args),
        levels=(Level(options=tuple(opts)),),
        origin=Origin(file="<built>", line=line, chain=chain, text=text),
    )


def make_policy(
    rules: Sequence[Rule], default: str = "ACCEPT", base_chain: str = "FORWARD", source="<built>"
) -> Policy:
    """A Policy from built rules (each one a base-chain rule: original_rules are their options + target)."""
    orig = [(*r.levels[0].options, "-j", r.target, *r.target_args) for r in rules]
    return Policy(rules=list(rules), default=default, base_chain=base_chain, source=source, original_rules=orig)


def listing1() -> Policy:
    """The paper's Listing 1 in IR form (R3 and R5 complex through string matches)."""
    s = [("-m", "string", "--string", "SELECT", "--algo", "bm")]
    h = [("-m", "string", "--hex-string", "|11 02 00|", "--algo", "bm")]
    return make_policy(
        [
            make_rule("ACCEPT", dst="1.2.3.4/32", proto="tcp", dport=(80, 80), line=1),
            make_rule("ACCEPT", src="1.2.3.0/24", proto="tcp", line=2),
            make_rule("DROP", dst="1.2.3.5/32", proto="udp", dport=(3306, 3306), complex=s, line=3),
            make_rule("ACCEPT", dst="1.2.3.4/32", proto="tcp", dport=(443, 443), line=4),
            make_rule("DROP", dst="1.2.3.6/32", proto="udp", dport=(53, 53), complex=h, line=5),
            make_rule("ACCEPT", dst="1.2.3.6/32", proto="udp", dport=(53, 53), line=6),
        ]
    )


# User chain names that stress the tool's naming: ufw's and firewalld's long ones (26 and 28 characters, the
# most iptables allows) and names of the tool's own chains.
CHAIN_NAMES = ("ufw-before-logging-forward", "FWDI_public_allow_twenty_8ch", "MAIN", "K0", "S0", "FULL", "U0_MAIN")


def chain_names_policy_text() -> str:
    """An iptables-save policy jumping to one user chain of each name in CHAIN_NAMES (each complex, so they stay
    user chains in every strategy)."""
    lines = ["*filter", ":FORWARD DROP [0:0]", *(f":{n} - [0:0]" for n in CHAIN_NAMES)]
    lines += [f"-A FORWARD -p udp -m udp --dport {1000 + i} -j {n}" for i, n in enumerate(CHAIN_NAMES)]
    for i, n in enumerate(CHAIN_NAMES):
        lines += [f"-A {n} -m string --string x{i} --algo bm -j DROP", f"-A {n} -j RETURN"]
    return "\n".join([*lines, "COMMIT"]) + "\n"
