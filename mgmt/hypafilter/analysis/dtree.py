"""Decision trees over a run of rules, to be encoded as jump chains (HiTables, papers/trees-in-the-list-hitables.txt):
`hypafilter optimize` (optimize.emit, which imports it as optimize.tree) and strategy tree (analysis.trees).

A chain's rules are cut into *segments*: maximal runs of rules that may be moved into a tree. Each segment becomes
a tree whose inner nodes split the header space (source, destination, protocol, ports) and whose leaves hold, in
their original order, every rule of the segment that a packet of the leaf's region could reach. A packet walks one
path: the dispatch tests, then one leaf; it meets the same rules in the same order as in the linear segment except
rules it could not have matched, so its verdict, the observing rules it passes (LOG, counters) and the state it
touches are those of the original (docs/optimize.md gives the argument in full).

What may not move (a segment boundary): `-j RETURN` and `-g` (a tree is entered by a jump, so they would return
elsewhere), and rules with per-rule state (limit, quota, statistic...: copies in several leaves would each keep
their own). Everything else moves, complex matches included: a rule is placed by an over-approximation of the
packets that can reach any of its matches — its header checks when nothing before them in the rule can drop the
packet on its own (hotdrop), its -s/-d/-p alone otherwise.

Ports are split only for TCP/UDP frames that are whole first fragments with a full transport header (at least 20
resp. 8 bytes): a `u32` guard sends every other TCP/UDP frame of the tree to a linear copy of the segment, because
the kernel's tcp/udp matches drop a truncated header outright (hotdrop), and a fragment has no ports.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

import numpy as np

from hypafilter.iptables import canonical
from hypafilter.iptables.rule import Comment, Icmp, Iprange, Multiport, ParsedRule, TcpUdp, Verbatim
from hypafilter.iptables.tables import STATEFUL_MATCHES
from hypafilter.ir.box import FIELD_INDEX, PROTO_TCP, PROTO_UDP

DIMS = ("src", "dst", "proto", "sport", "dport")
SRC, DST, PROTO, SPORT, DPORT = range(5)
_COLS = [FIELD_INDEX[d] for d in DIMS]
TOP = np.array([0xFFFFFFFF, 0xFFFFFFFF, 0xFF, 0xFFFF, 0xFFFF], dtype=np.int64)

# Matches that never drop a packet by themselves (no hotdrop) and keep no per-rule state: a rule whose matches
# are all of these (and the modelled ones) is placed by its header checks, ports included.
QUIET_MATCHES = frozenset(
    {
        "addrtype", "cgroup", "comment", "connbytes", "connlabel", "connmark", "conntrack", "cpu", "devgroup",
        "dscp", "helper", "iprange", "length", "mac", "mark", "owner", "physdev", "pkttype", "policy", "realm",
        "set", "state", "string", "time", "tos", "ttl", "u32",
    }
)  # fmt: skip

# A TCP (UDP) frame whose ports the dispatch may read: first fragment (offset 0) with 20 (8) bytes of transport
# header. u32 reads 4 bytes at each position and fails (no match) past the end of the packet.
WHOLE_L4 = {
    PROTO_TCP: "4&0x1FFF=0 && 0>>22&0x3C@16&0=0",
    PROTO_UDP: "4&0x1FFF=0 && 0>>22&0x3C@4&0=0",
}


# IPv6 (ip6tables): a TCP (UDP) frame whose upper-layer header follows the fixed header directly (next header 6
# or 17: no extension header, so no fragment header either) with 20 (8) bytes of it there. Every other frame of the
# protocol (extension headers first, a fragment, a short header) goes to the linear copy.
WHOLE_L4_6 = {
    PROTO_TCP: "4>>8&0xFF=6 && 56&0=0",
    PROTO_UDP: "4>>8&0xFF=17 && 44&0=0",
}

PROTO_NAMES = {1: "icmp", 6: "tcp", 17: "udp"}
PROTO_NAMES_6 = {6: "tcp", 17: "udp", 58: "ipv6-icmp"}


@dataclass(frozen=True)
class RankSpace:
    """The address dimensions of a tree over an IPv6 run (family 6): the trees cut ranks (`rank_regions`), rank r of
    dimension d standing for the addresses [starts[d][r], starts[d][r + 1] - 1] (the last one up to 2**128 - 1).
    Every box's bounds are rank bounds, so every address of one rank is in the same boxes and a cut between ranks
    is exact; the tests are written as the 128-bit addresses the ranks stand for."""

    starts: tuple[tuple[int, ...], tuple[int, ...]]  # per SRC, DST
    family: int = 6

    @property
    def bits(self) -> int:
        return 128 if self.family == 6 else 32

    def addr(self, d: int, r: int) -> int:
        """The first address of rank r (2**bits past the top rank)."""
        s = self.starts[d]
        return s[r] if r < len(s) else 1 << self.bits

    def span(self, d: int, rlo: int, rhi: int) -> tuple[int, int]:
        """The addresses ranks rlo..rhi stand for."""
        return self.addr(d, rlo), self.addr(d, rhi + 1) - 1

    def is_prefix_cut(self, d: int, rlo: int, rhi: int, c: int) -> bool:
        """prefix_cut on the addresses: one -s/-d prefix tells the two sides of the cut at rank c apart."""
        alo, ahi = self.span(d, rlo, rhi)
        a = self.addr(d, c)
        block = a & -a
        return a - block <= alo or a + block - 1 >= ahi

    def prefix_cuts(self, d: int, rlo: int, rhi: int) -> list[int]:
        """The ranks in (rlo, rhi] where a cut is one prefix test: an aligned block from the region's first address,
        or one ending at its last, whose edge is a rank start."""
        alo, ahi = self.span(d, rlo, rhi)
        index = self._index[d]
        out = []
        for k in range(self.bits):
            for a in (alo + (1 << k), ahi + 1 - (1 << k)):
                r = index.get(a)
                if r is not None and rlo < r <= rhi:
                    out.append(r)
        return out

    @property
    def _index(self) -> tuple[dict[int, int], dict[int, int]]:
        idx = self.__dict__.get("_idx")
        if idx is None:
            idx = tuple({v: i for i, v in enumerate(s)} for s in self.starts)
            object.__setattr__(self, "_idx", idx)
        return idx


def rank_regions(rules: list[tuple[list, list]], family: int = 6) -> tuple[list[tuple[list, list]], RankSpace]:
    """(the rules' regions on ranks, RankSpace) of regions over 128-bit addresses (`regions(r, family=6)`): per
    address dimension the starts of the elementary intervals of every box (lo, hi + 1 below the top, and 0); a box
    reaching the top address ends at TOP (the tree's full interval), as ir.family.compress does."""
    top = (1 << (128 if family == 6 else 32)) - 1
    cuts: tuple[set[int], set[int]] = ({0}, {0})
    for any_, whole in rules:
        for lo, hi in (*any_, *whole):
            for d in (SRC, DST):
                cuts[d].add(lo[d])
                if hi[d] < top:
                    cuts[d].add(hi[d] + 1)
    starts = tuple(tuple(sorted(c)) for c in cuts)
    for s in starts:
        if len(s) > int(TOP[SRC]):
            raise ValueError(f"{len(s)} elementary address intervals do not fit 32-bit ranks")
    index = tuple({v: i for i, v in enumerate(s)} for s in starts)

    def ranked(boxes):
        out = []
        for lo, hi in boxes:
            lo, hi = list(lo), list(hi)
            for d in (SRC, DST):
                lo[d] = index[d][lo[d]]
                hi[d] = int(TOP[d]) if hi[d] >= top else index[d][hi[d] + 1] - 1
            out.append((tuple(lo), tuple(hi)))
        return out

    return [(ranked(a), ranked(w)) for a, w in rules], RankSpace(starts, family)


def range_test(d: int, rlo: int, rhi: int, c: int, proto: int | None, space: RankSpace | None = None
               ) -> tuple[bool, tuple[str, ...]]:  # fmt: skip
    """Tokens testing, for a packet already in [rlo, rhi] on dimension d, which side of the cut c it is on:
    (True, tokens) when the tokens hold exactly for the left part [rlo, c-1], (False, tokens) for the right.
    `space`: the address dimensions are ranks of that RankSpace (IPv6), written as the addresses they stand for."""
    if d in (SRC, DST):
        opt = "-s" if d == SRC else "-d"
        bits, ip = 32, canonical.ip_str
        if space is not None:
            bits, ip = space.bits, (canonical.ip6_str if space.family == 6 else canonical.ip_str)
            (rlo, rhi), c = space.span(d, rlo, rhi), space.addr(d, c)
        k = min((c & -c).bit_length() - 1, bits)
        if c - (1 << k) <= rlo:  # one prefix ending at c-1 holds the left part
            return True, (opt, f"{ip(c - (1 << k))}/{bits - k}")
        if c + (1 << k) - 1 >= rhi:  # one prefix starting at c holds the right part
            return False, (opt, f"{ip(c)}/{bits - k}")
        which = "--src-range" if d == SRC else "--dst-range"
        return True, ("-m", "iprange", which, f"{ip(rlo)}-{ip(c - 1)}")
    name = PROTO_NAMES[proto]
    opt = "--sport" if d == SPORT else "--dport"
    return True, ("-p", name, "-m", name, opt, f"{rlo}:{c - 1}" if rlo != c - 1 else str(rlo))


def movable(r: ParsedRule) -> str | None:
    """Why the rule must stay in place (a segment boundary), or None when it may move into a tree."""
    if r.goto:
        return "-g returns to the caller of its chain"
    if r.target == "RETURN":
        return "RETURN leaves its chain"
    if r.stateful or any(isinstance(m, Verbatim) and m.name in STATEFUL_MATCHES for m in r.matches):
        return "per-rule state"
    return None


def _quiet(r: ParsedRule) -> bool:
    for m in r.matches:
        if isinstance(m, TcpUdp):
            if m.option is not None:
                return False
        elif isinstance(m, Verbatim):
            if m.name not in QUIET_MATCHES:
                return False
        elif not isinstance(m, Multiport | Iprange | Icmp | Comment):
            return False
    return True


def _addr_iv(a, top: int = 0xFFFFFFFF) -> list[tuple[int, int]]:
    if a is None:
        return [(0, top)]
    iv = a.intervals()
    return [(0, top)] if iv is None else iv


def _proto_iv(r: ParsedRule) -> list[tuple[int, int]]:
    if not r.proto:
        return [(0, 0xFF)]
    if r.proto_invert:
        return [(lo, hi) for lo, hi in ((0, r.proto - 1), (r.proto + 1, 0xFF)) if lo <= hi]
    return [(r.proto, r.proto)]


def _meet(a: list[tuple[int, int]], b: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out = [(max(x0, y0), min(x1, y1)) for x0, x1 in a for y0, y1 in b]
    return [(x, y) for x, y in out if x <= y]


def _top(family: int) -> int:
    return (1 << 128) - 1 if family == 6 else 0xFFFFFFFF


def region_any(r: ParsedRule, family: int = 4) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Where the rule can act on any packet, a truncated or fragmented one included: its -s, -d and -p (tested by
    ip_packet_match before any match) and the address ranges of the matches before the first one that may drop a
    packet whose header it cannot read (tcp, udp, multiport, icmp and every match not in QUIET_MATCHES). `family`
    6: an ip6tables rule, 128-bit addresses (rank them with `rank_regions` before `build`)."""
    top = _top(family)
    src, dst = _addr_iv(r.src, top), _addr_iv(r.dst, top)
    for m in r.matches:
        if isinstance(m, Iprange):
            for rng_, which in ((m.src, "src"), (m.dst, "dst")):
                if rng_ is None:
                    continue
                lo, hi, inv = rng_
                iv = [(a, b) for a, b in ((0, lo - 1), (hi + 1, top)) if a <= b] if inv else [(lo, hi)]
                if which == "src":
                    src = _meet(src, iv)
                else:
                    dst = _meet(dst, iv)
        elif isinstance(m, Comment) or (isinstance(m, Verbatim) and m.name in QUIET_MATCHES):
            continue
        else:
            break
    return [
        ((s[0], d[0], p[0], 0, 0), (s[1], d[1], p[1], 0xFFFF, 0xFFFF)) for s in src for d in dst for p in _proto_iv(r)
    ]


def region(r: ParsedRule, family: int = 4) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Where the rule can act on a whole packet (a TCP/UDP first fragment whose transport header is all there, as
    below a WHOLE_L4 guard): its header checks when no match of it can drop such a packet by itself, its -s, -d and
    -p otherwise. The tree uses it only where every TCP/UDP frame is whole; region_any elsewhere."""
    if _quiet(r) and r.boxes:
        seen = {}
        for b in r.boxes:
            key = (tuple(b.lo[c] for c in _COLS), tuple(b.hi[c] for c in _COLS))
            seen[key] = None
        return list(seen)
    top = _top(family)
    return [
        ((s[0], d[0], p[0], 0, 0), (s[1], d[1], p[1], 0xFFFF, 0xFFFF))
        for s in _addr_iv(r.src, top)
        for d in _addr_iv(r.dst, top)
        for p in _proto_iv(r)
    ]


def regions(r: ParsedRule, family: int = 4) -> tuple[list, list]:
    """(region_any, region) of a rule: what `build` takes per rule (family 6: 128-bit, to be ranked)."""
    return region_any(r, family), region(r, family)


@dataclass
class Region:
    """The header space a node covers: intervals per DIMS, protocols excluded from [lo, hi], and whether every
    TCP/UDP frame here has been checked to have readable ports (WHOLE_L4)."""

    lo: tuple[int, ...]
    hi: tuple[int, ...]
    excluded: frozenset[int] = frozenset()
    whole_l4: bool = False

    def proto(self) -> int | None:
        return self.lo[PROTO] if self.lo[PROTO] == self.hi[PROTO] else None

    def with_dim(self, d: int, lo: int, hi: int, **kw) -> Region:
        nlo, nhi = list(self.lo), list(self.hi)
        nlo[d], nhi[d] = lo, hi
        return Region(tuple(nlo), tuple(nhi), kw.get("excluded", self.excluded), kw.get("whole_l4", self.whole_l4))


@dataclass
class Leaf:
    rules: list[int]  # rule indexes in the segment, ascending


@dataclass
class Split:
    """Tests in order, each sending matching packets to a child; packets passing none go to `rest`.

    kind "range": tests are (dim, lo, hi) intervals; kind "proto": tests are protocol numbers."""

    kind: str
    dim: int
    tests: list[tuple]
    children: list[Node]
    rest: Node
    guard: int | None = None  # protocol whose non-whole frames first go to the linear copy (WHOLE_L4)


@dataclass
class Node:
    region: Region
    boxes: np.ndarray  # indexes into the segment's box arrays
    body: Leaf | Split | None = None
    depth: int = 0  # chains entered by goto from the tree's root chain to reach this node's chain (at most)
    rules: int = 0


@dataclass
class Boxes:
    """Boxes over DIMS with the rule each belongs to."""

    lo: np.ndarray
    hi: np.ndarray
    owner: np.ndarray

    @staticmethod
    def of(per_rule: list[list[tuple[tuple[int, ...], tuple[int, ...]]]]) -> Boxes:
        lo_l, hi_l, own_l = [], [], []
        for i, boxes in enumerate(per_rule):
            for lo, hi in boxes:
                lo_l.append(lo)
                hi_l.append(hi)
                own_l.append(i)
        return Boxes(
            np.array(lo_l, dtype=np.int64).reshape(-1, 5),
            np.array(hi_l, dtype=np.int64).reshape(-1, 5),
            np.array(own_l, dtype=np.int64),
        )


@dataclass
class Tree:
    root: Node
    any: Boxes  # region_any per rule: where a node's TCP/UDP frames may lack readable ports
    whole: Boxes  # region per rule: below a WHOLE_L4 guard
    size: int  # rules in the segment
    linear: bool = False  # a linear copy of the segment exists (some split reads ports)
    emitted_rules: int = 0
    stats: dict = field(default_factory=dict)

    def boxes(self, rg: Region) -> Boxes:
        return self.whole if rg.whole_l4 else self.any


@dataclass
class Params:
    binth: int = 8  # a node with at most this many rules is a leaf
    max_expansion: float = 4.0  # rules written (dispatch + leaves + linear copy) per rule of the segment
    cuts: int = 24  # candidate cut points tried per dimension and node
    dup_weight: float = 0.5  # score = largest child + dup_weight * rules duplicated
    # Chains a path may goto through below the tree's root chain (the linear copy counts as one more): nf_tables
    # counts a goto like a jump against its nesting limit (NFT_JUMP_STACK_SIZE, 16 below a base chain).
    max_depth: int = 10
    guard: bool = True  # False only to show what the WHOLE_L4 guard prevents (tests): port cuts without it
    range_cost: float = 10.0  # added to the score of an address cut no prefix test makes (an iprange match)
    space: RankSpace | None = None  # the address dimensions are ranks (IPv6: rank_regions), not addresses


def prefix_cut(c: np.ndarray, rlo: int, rhi: int) -> np.ndarray:
    """Whether one prefix test tells the sides of a cut at c apart in [rlo, rhi]: the largest aligned block
    ending at c-1 reaches down to rlo, or the one starting at c reaches up to rhi."""
    c = np.asarray(c, dtype=np.int64)
    block = c & -c
    return (c - block <= rlo) | (c + block - 1 >= rhi)


def _owners(owner: np.ndarray, idx: np.ndarray) -> np.ndarray:
    return np.unique(owner[idx])


def _inside(bx: Boxes, rg: Region) -> np.ndarray:
    """Which boxes meet the region."""
    m = np.all((bx.lo <= np.array(rg.hi)) & (bx.hi >= np.array(rg.lo)), axis=1)
    return m & _proto_hits(bx.lo, bx.hi, rg)


def _proto_hits(lo: np.ndarray, hi: np.ndarray, rg: Region) -> np.ndarray:
    """Which boxes (rows of lo/hi over DIMS) hold a protocol of the region."""
    a = np.maximum(lo[:, PROTO], rg.lo[PROTO])
    b = np.minimum(hi[:, PROTO], rg.hi[PROTO])
    n = b - a + 1
    for v in rg.excluded:
        n = n - ((a <= v) & (v <= b))
    return n > 0


def build(rules: list[tuple[list, list]], params: Params | None = None) -> Tree:
    """A tree over the rules (in priority order), each given as (region_any, region): see `regions`."""
    params = params or Params()
    any_, whole = Boxes.of([a for a, _ in rules]), Boxes.of([w for _, w in rules])
    root = Node(Region((0, 0, 0, 0, 0), tuple(int(x) for x in TOP)), np.arange(len(any_.owner)))
    root.rules = len(rules)
    tree = Tree(root, any_, whole, len(rules))
    # Written: the leaves' rules, the dispatch tests, the linear copy, and the jump into the tree.
    budget = params.max_expansion * max(len(rules), 1) - 1
    used = float(len(rules))
    heap: list[tuple[int, int, Node]] = [(-root.rules, 0, root)]
    seq = 1
    while heap:
        _, _, node = heapq.heappop(heap)
        if node.rules <= params.binth:
            continue
        best = _best_split(tree, node, params)
        if best is None:
            continue
        split, sizes, cost = best
        if node.depth + 1 + (split.guard is not None) > params.max_depth:
            continue
        extra = cost + sum(sizes) - node.rules
        if split.guard is not None and not tree.linear:
            extra += len(rules)
        if used + extra > budget:
            continue
        used += extra
        if split.guard is not None:
            tree.linear = True
        node.body = split
        for child in (*split.children, split.rest):
            # a child is a chain of its own (goto), except the one written on in the node's chain; which one that is
            # the writer decides (an address cut tests whichever side one prefix holds), so count both
            child.depth = node.depth + (child is not split.rest or split.kind == "range")
            heapq.heappush(heap, (-child.rules, seq, child))
            seq += 1
    _finish(tree, root)
    tree.emitted_rules = int(used) + 1
    return tree


def _finish(tree: Tree, node: Node) -> None:
    if node.body is None:
        node.body = Leaf([int(x) for x in _owners(tree.boxes(node.region).owner, node.boxes)])
        return
    for child in (*node.body.children, node.body.rest):
        _finish(tree, child)


def _child(tree: Tree, idx: np.ndarray, rg: Region) -> Node:
    """A node of region rg holding the boxes idx (indexes into tree.boxes(rg))."""
    n = Node(rg, idx)
    n.rules = len(_owners(tree.boxes(rg).owner, idx))
    return n


def _whole_view(tree: Tree, node: Node) -> np.ndarray:
    """The node's rules seen from below a guard: their whole-packet boxes (tree.whole) that meet its region."""
    if node.region.whole_l4:
        return node.boxes
    owners = _owners(tree.any.owner, node.boxes)
    return np.flatnonzero(np.isin(tree.whole.owner, owners) & _inside(tree.whole, node.region))


def _best_split(tree: Tree, node: Node, params: Params):
    rg, idx = node.region, node.boxes
    bx = tree.boxes(rg)
    lo, hi = bx.lo[idx], bx.hi[idx]
    n = node.rules
    cands = []  # (score, builder)
    # Address and port cuts: children [rlo, c-1] and [c, rhi]. A port cut sees the rules as they read a whole
    # packet (below it, or below the guard it brings, every TCP/UDP frame is whole).
    p = rg.proto()
    widx = _whole_view(tree, node) if p in (PROTO_TCP, PROTO_UDP) else None
    for d in [SRC, DST] + ([SPORT, DPORT] if widx is not None else []):
        if d in (SPORT, DPORT):
            lo, hi = tree.whole.lo[widx], tree.whole.hi[widx]
        rlo, rhi = rg.lo[d], rg.hi[d]
        clo, chi = np.maximum(lo[:, d], rlo), np.minimum(hi[:, d], rhi)
        pts = np.unique(np.concatenate([clo[clo > rlo], chi[chi < rhi] + 1]))
        if len(pts) == 0:
            continue
        if len(pts) > params.cuts:
            pts = pts[np.linspace(0, len(pts) - 1, params.cuts).round().astype(np.int64)]
        if d in (SRC, DST) and params.space is not None:  # ranks: the prefix cuts whose edge is a rank start
            geo = np.array(params.space.prefix_cuts(d, rlo, rhi), dtype=np.int64)
            pts = np.unique(np.concatenate([pts, geo]))
        elif d in (SRC, DST):  # the cuts one prefix test can make (-s/-d), next to those the rules suggest
            pw = np.int64(1) << np.arange(32, dtype=np.int64)
            geo = np.concatenate([rlo + pw, rhi + 1 - pw])
            pts = np.unique(np.concatenate([pts, geo[(geo > rlo) & (geo <= rhi)]]))
        left = (clo[:, None] < pts[None, :]).sum(axis=0)
        right = (chi[:, None] >= pts[None, :]).sum(axis=0)
        nb = len(lo)
        score = np.maximum(left, right) + params.dup_weight * (left + right - nb)
        if d in (SRC, DST) and params.space is not None:
            sp = params.space
            pre = np.array([sp.is_prefix_cut(d, rlo, rhi, int(c)) for c in pts], dtype=bool)
            score = score + params.range_cost * ~pre
        elif d in (SRC, DST):
            score = score + params.range_cost * ~prefix_cut(pts, rlo, rhi)
        k = int(np.argmin(score))
        if max(left[k], right[k]) >= nb:
            continue
        cands.append((float(score[k]), ("range", d, int(pts[k]))))
    lo, hi = bx.lo[idx], bx.hi[idx]
    # Protocol: the most common single protocols, then the rest.
    if p is None:
        single = lo[:, PROTO] == hi[:, PROTO]
        vals, counts = np.unique(lo[single, PROTO], return_counts=True)
        # (protocol 0 cannot be tested: `-p 0` means every protocol)
        keep = [
            int(v)
            for v, _ in sorted(zip(vals, counts, strict=True), key=lambda t: -t[1])
            if int(v) not in rg.excluded and v != 0
        ]
        keep = keep[:4]
        if keep:
            sizes = [int(((lo[:, PROTO] <= v) & (hi[:, PROTO] >= v)).sum()) for v in keep]
            other = rg.with_dim(PROTO, rg.lo[PROTO], rg.hi[PROTO], excluded=rg.excluded | frozenset(keep))
            rest = int(_proto_hits(lo, hi, other).sum())
            sizes.append(rest)
            # A split that only fixes the protocol still pays: ports can be cut below it.
            mine = np.isin(tree.whole.owner, _owners(bx.owner, idx))
            ports = bool(np.any(tree.whole.lo[mine, SPORT:] > 0) or np.any(tree.whole.hi[mine, SPORT:] < 0xFFFF))
            if max(sizes) < len(idx) or (rest < len(idx) and ports):
                score = max(sizes) + params.dup_weight * (sum(sizes) - len(idx)) + 0.5 * (len(keep) - 1)
                cands.append((score, ("proto", PROTO, tuple(keep))))
    if not cands:
        return None
    _, (kind, d, arg) = min(cands, key=lambda c: c[0])
    if kind == "range":
        c = arg
        lrg = rg.with_dim(d, rg.lo[d], c - 1)
        rrg = rg.with_dim(d, c, rg.hi[d])
        guard = None
        use, ubx = idx, bx
        if d in (SPORT, DPORT):
            if not rg.whole_l4 and params.guard:
                guard = p
            lrg.whole_l4 = rrg.whole_l4 = True
            use, ubx = widx, tree.whole
        left = _child(tree, use[ubx.lo[use, d] <= c - 1], lrg)
        right = _child(tree, use[ubx.hi[use, d] >= c], rrg)
        split = Split("range", d, [(d, rg.lo[d], c - 1)], [left], right, guard)
        sizes = [left.rules, right.rules]
        cost = 1 + (1 if guard is not None else 0)
    else:
        children = []
        for v in arg:
            crg = rg.with_dim(PROTO, v, v, excluded=frozenset())
            children.append(_child(tree, idx[(lo[:, PROTO] <= v) & (hi[:, PROTO] >= v)], crg))
        orr = rg.with_dim(PROTO, rg.lo[PROTO], rg.hi[PROTO], excluded=rg.excluded | frozenset(arg))
        rest = _child(tree, idx[_proto_hits(lo, hi, orr)], orr)
        split = Split("proto", PROTO, list(arg), children, rest)
        sizes = [c.rules for c in children] + [rest.rules]
        cost = len(arg)
    if max(sizes) > n or (max(sizes) == n and kind != "proto"):
        return None
    return split, sizes, cost


def path(tree: Tree, point: tuple[int, ...], first_match) -> tuple[int, int | None]:
    """(rules the kernel evaluates, the rule that decides) for a whole packet at `point` (values over DIMS) walking the
    encoded tree: each dispatch test, the guard, then the leaf's rules up to `first_match(rules)`'s answer (the
    position in the list it is given of the first rule that ends the walk, or None)."""
    node, n = tree.root, 0
    while isinstance(node.body, Split):
        b = node.body
        if b.guard is not None:
            n += 1
        if b.kind == "proto":
            nxt = b.rest
            for v, child in zip(b.tests, b.children, strict=True):
                n += 1
                if point[PROTO] == v:
                    nxt = child
                    break
            node = nxt
            continue
        d, lo, hi = b.tests[0]
        n += 1
        node = b.children[0] if lo <= point[d] <= hi else b.rest
    rules = node.body.rules
    k = first_match(rules)
    return n + (len(rules) if k is None else k + 1), (None if k is None else rules[k])
