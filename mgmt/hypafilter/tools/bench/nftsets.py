"""The set-based software peer of `bench optimize`: a first-match list of header rules written as nft verdict maps.

Each rule's boxes become elements of concatenated-range verdict maps (the pipapo set type, `flags interval`), keyed
on the fields the rule tests (`ip saddr . ip daddr`, then `meta l4proto`, then `th sport` and/or `th dport`: a frame
whose transport header is too short fails the lookup as it fails iptables-nft's payload test). Maps are looked up in
order; a map whose key misses lets the frame go on, as a rule that does not match.

Exact by construction: an element is put in the first map of its key shape that comes after every map holding an
element of the other verdict it overlaps and that holds no element it overlaps. So two overlapping elements of
different verdicts are looked up in their original order (of the same verdict, either order gives the frames they
share that verdict), and the elements of one map are pairwise disjoint (the kernel refuses overlapping ones: what
`nft -o` runs into, "File exists"). An element whose frames all match one earlier element is dead and left out. Rules the writer cannot write this way (complex
matches, negations, other targets, user chains, multiport) make the peer refuse the policy with the rule named.
"""

from __future__ import annotations

import bisect
import ipaddress
import time
from dataclasses import dataclass, field

import numpy as np

from hypafilter.errors import HypafilterError
from hypafilter.ir import FIELD_INDEX, MAXV

# Columns of an element's box: the fields a map key can hold.
DIMS = ("src", "dst", "proto", "sport", "dport")
_COL = [FIELD_INDEX[f] for f in DIMS]
_PROTOS = {"tcp": 6, "udp": 17}
_BLOCK = 256  # rows of the overlap matrix computed at once
_PORT_FLAGS = {"--sport": "s", "--source-port": "s", "--dport": "d", "--destination-port": "d"}


@dataclass(frozen=True)
class Shape:
    """The fields a map's key holds beyond `ip saddr . ip daddr`."""

    proto: bool
    ports: str  # "", "s", "d" or "sd"

    def key(self) -> str:
        parts = ["ip saddr", "ip daddr"]
        if self.proto:
            parts.append("meta l4proto")
        parts += [f"th {p}port" for p in self.ports]
        return " . ".join(parts)

    def types(self) -> str:
        parts = ["ipv4_addr", "ipv4_addr"] + (["inet_proto"] if self.proto else [])
        return " . ".join(parts + ["inet_service"] * len(self.ports))


@dataclass
class Group:
    """One lookup: elements (lo, hi over DIMS, verdict) that are pairwise disjoint, all of one shape."""

    shape: Shape
    elements: list[tuple[tuple[int, ...], tuple[int, ...], str]] = field(default_factory=list)


@dataclass
class SetsRuleset:
    text: str
    rules_in: int
    elements: int
    lookups: int
    maps: int
    dead: int
    build_s: float

    def summary(self) -> dict:
        return {"nft_sets_rules_in": self.rules_in, "nft_sets_elements": self.elements,
                "nft_sets_lookups": self.lookups, "nft_sets_maps": self.maps, "nft_sets_dead": self.dead,
                "nft_sets_build_s": round(self.build_s, 3)}  # fmt: skip


def rule_shape(options: tuple[str, ...], where: str) -> Shape:
    """The key shape of a rule from its canonical option tokens; anything but -s, -d, -p tcp/udp/N and tcp/udp port
    tests (and comments) is refused: the peer writes header lookups only."""
    proto, ports, i = False, set(), 0
    while i < len(options):
        t = options[i]
        nxt = options[i + 1] if i + 1 < len(options) else None
        if t == "!" or nxt == "!":
            raise HypafilterError(f"nft sets peer: {where}: a negation ({' '.join(options)})")
        if t in ("-s", "-d") or (t == "-m" and nxt in ("tcp", "udp", "comment")) or t == "--comment":
            i += 2
        elif t == "-p":
            proto = nxt not in ("all", "0")
            i += 2
        elif t in _PORT_FLAGS:
            ports.add(_PORT_FLAGS[t])
            i += 2
        else:
            raise HypafilterError(f"nft sets peer: {where}: {t} {nxt or ''} is not a header test it writes".rstrip())
    return Shape(proto, "".join(p for p in "sd" if p in ports))


def _entries(text: str, name: str):
    from hypafilter.iptables.document import parse_policy

    policy = parse_policy(text, filename=name, base_chain="FORWARD")
    if policy.user_chains or policy.ignored_tables:
        raise HypafilterError("nft sets peer: the policy has user chains or other tables; it writes one chain")
    lo, hi, shapes, verdicts, rule_of = [], [], [], [], []
    for k, r in enumerate(policy.rules):
        where = f"rule {k + 1}" + (f" ({r.origin.text})" if r.origin else "")
        if r.complex or r.target not in ("ACCEPT", "DROP") or len(r.levels) != 1 or r.levels[0].unless:
            raise HypafilterError(f"nft sets peer: {where}: not a header rule with ACCEPT or DROP")
        shape = rule_shape(r.levels[0].options, where)
        for b in r.boxes:
            if (
                b.flags_mask
                or b.sets_mask
                or any((b.lo[i], b.hi[i]) != (0, MAXV[i]) for i in range(len(MAXV)) if i not in _COL)
            ):
                raise HypafilterError(f"nft sets peer: {where}: tests a field it does not write")
            if shape.ports and not (b.lo[2] == b.hi[2] and b.lo[2] in _PROTOS.values()):
                raise HypafilterError(f"nft sets peer: {where}: ports without -p tcp or -p udp")
            lo.append([b.lo[i] for i in _COL])
            hi.append([b.hi[i] for i in _COL])
            shapes.append(shape)
            verdicts.append(r.target.lower())
            rule_of.append(k)
    return policy, np.array(lo, dtype=np.int64).reshape(-1, 5), np.array(hi, dtype=np.int64).reshape(-1, 5), \
        shapes, verdicts, rule_of  # fmt: skip


def _covers(a: Shape, b: Shape) -> bool:
    """Every frame an element of shape b can match reaches a's key (a reads no field b does not read)."""
    return (not a.proto or b.proto) and set(a.ports) <= set(b.ports)


def group(lo: np.ndarray, hi: np.ndarray, shapes: list[Shape], verdicts: list[str]) -> tuple[list[Group], int]:
    """The elements, in first-match order, placed into lookups (see the module's docstring); (groups, dead)."""
    groups: list[Group] = []
    gidx = np.full(len(lo), -1, dtype=np.int64)  # the group of each placed element (-1: dead)
    by_shape: dict[Shape, list[int]] = {}
    dead = 0
    verd = np.array([v == "accept" for v in verdicts])
    for i in range(len(lo)):
        if i % _BLOCK == 0:  # overlap and containment of the next rows against every earlier element, vectorised
            end = min(i + _BLOCK, len(lo))
            meets = np.ones((end - i, end), dtype=bool)
            holds = np.ones((end - i, end), dtype=bool)
            for d in range(lo.shape[1]):
                a_lo, a_hi, b_lo, b_hi = lo[i:end, d, None], hi[i:end, d, None], lo[None, :end, d], hi[None, :end, d]
                meets &= b_lo <= a_hi
                meets &= a_lo <= b_hi
                holds &= b_lo <= a_lo
                holds &= a_hi <= b_hi
            holds &= meets
        meet = meets[i % _BLOCK, :i] & (gidx[:i] >= 0)
        inside = np.flatnonzero(meet & holds[i % _BLOCK, :i])
        if any(_covers(shapes[j], shapes[i]) for j in inside):
            dead += 1
            continue
        # after every map holding an overlapping element of the other verdict (of the same verdict, either order
        # gives the frames they share the same verdict), in a map holding none that overlaps
        other = meet & (verd[:i] != verd[i])
        last = int(gidx[:i][other].max()) if other.any() else -1
        taken = set(gidx[:i][meet].tolist())
        mine = by_shape.setdefault(shapes[i], [])
        g = next((g for g in mine[bisect.bisect_right(mine, last) :] if g not in taken), None)
        if g is None:
            g = len(groups)
            groups.append(Group(shapes[i]))
            mine.append(g)
        groups[g].elements.append((tuple(int(x) for x in lo[i]), tuple(int(x) for x in hi[i]), verdicts[i]))
        gidx[i] = g
    return groups, dead


def _addr(lo: int, hi: int) -> str:
    size = hi - lo + 1
    if size & (size - 1) == 0 and lo % size == 0:
        return f"{ipaddress.IPv4Address(lo)}/{33 - size.bit_length()}"
    return f"{ipaddress.IPv4Address(lo)}-{ipaddress.IPv4Address(hi)}"


def _span(lo: int, hi: int) -> str:
    return str(lo) if lo == hi else f"{lo}-{hi}"


def _key_values(shape: Shape, lo, hi) -> list[str]:
    vals = [_addr(lo[0], hi[0]), _addr(lo[1], hi[1])]
    if shape.proto:
        vals.append(_span(lo[2], hi[2]))
    vals += [_span(lo[3], hi[3]) if p == "s" else _span(lo[4], hi[4]) for p in shape.ports]
    return vals


def _single(shape: Shape, lo, hi, verdict: str) -> str:
    """One element as a plain rule (a map of one element costs more than its tests)."""
    parts = []
    for k, (name, v) in enumerate(zip(shape.key().split(" . "), _key_values(shape, lo, hi), strict=True)):
        if k < 2 and v == "0.0.0.0/0":  # an address test that holds for every frame
            continue
        parts.append(f"{name} {v}")
    return " ".join(parts + [verdict])


def to_nft(groups: list[Group], default: str, table: str = "hfsets") -> str:
    """The nft ruleset: one named verdict map per lookup of two or more elements, the base chain of the bench's
    bridged FORWARD path (priority filter, the chain policy) looking them up in order."""
    maps, chain = [], []
    for n, g in enumerate(groups):
        if len(g.elements) == 1:
            chain.append(_single(g.shape, *g.elements[0]))
            continue
        elems = ",\n\t\t\t".join(f"{' . '.join(_key_values(g.shape, lo, hi))} : {v}" for lo, hi, v in g.elements)
        maps.append(f"\tmap m{n} {{\n\t\ttype {g.shape.types()} : verdict\n\t\tflags interval\n"
                    f"\t\telements = {{ {elems} }}\n\t}}\n")  # fmt: skip
        chain.append(f"{g.shape.key()} vmap @m{n}")
    body = "".join(f"\t\t{ln}\n" for ln in chain)
    return (f"table ip {table} {{\n{''.join(maps)}\tchain forward {{\n\t\ttype filter hook forward priority filter; "
            f"policy {default.lower()};\n{body}\t}}\n}}\n")  # fmt: skip


def nft_sets(text: str, name: str = "<policy>") -> SetsRuleset:
    """The peer for an iptables policy of header rules in FORWARD (bad input: HypafilterError naming the rule)."""
    t0 = time.monotonic()
    policy, lo, hi, shapes, verdicts, _ = _entries(text, name)
    groups, dead = group(lo, hi, shapes, verdicts)
    out = to_nft(groups, policy.default)
    return SetsRuleset(out, len(policy.rules), sum(len(g.elements) for g in groups), len(groups),
                       sum(1 for g in groups if len(g.elements) > 1), dead, time.monotonic() - t0)  # fmt: skip
