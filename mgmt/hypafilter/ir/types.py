"""The rule IR: format-independent rules whose header part is a union of boxes (ARCHITECTURE §2).

Nothing here knows iptables, nftables or VHDL syntax except the opaque option tokens a rule keeps so that
emitters can write the original checks back. Conversions live at the boundaries (`parse`, `netfilter`,
`hwgen`).

Header model (the same convention in the hardware parser, the Python reference model and the trace tools):
every IPv4 packet is a point in the space of FIELDS below. Fields that a packet does not carry are 0: ports
are 0 unless the protocol is TCP (6) or UDP (17); icmp_type/icmp_code are 0 unless the protocol is ICMP (1);
tcp_flags (byte 13 of the TCP header) is 0 unless TCP; iport is the ingress MAC index (0..3). A check on a
port, ICMP field or TCP flags always comes with the matching protocol check, so the zero convention never
lets a rule match a packet it should not.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

# Interval dimensions of a box, in this order everywhere (numpy arrays use this column order).
FIELDS: tuple[str, ...] = ("src", "dst", "proto", "sport", "dport", "icmp_type", "icmp_code", "iport")
WIDTHS: dict[str, int] = {
    "src": 32,
    "dst": 32,
    "proto": 8,
    "sport": 16,
    "dport": 16,
    "icmp_type": 8,
    "icmp_code": 8,
    "iport": 2,
}
MAXV: tuple[int, ...] = tuple((1 << WIDTHS[f]) - 1 for f in FIELDS)
NDIM = len(FIELDS)
FIELD_INDEX = {f: i for i, f in enumerate(FIELDS)}

PROTO_ICMP, PROTO_TCP, PROTO_UDP = 1, 6, 17

# Action codes as carried in the shunt metadata M[27:24] and the low 4 bits of the netfilter mark.
ACTION_NONE, ACTION_ACCEPT, ACTION_DROP = 0, 1, 2
ACTION_CODES = {"ACCEPT": ACTION_ACCEPT, "DROP": ACTION_DROP}
HW_TARGETS = frozenset(ACTION_CODES)


@dataclass(frozen=True, order=True)
class Box:
    """A hyper-rectangle: closed intervals per FIELDS dimension, plus a ternary test on TCP flags.

    The flags test is `(tcp_flags & flags_mask) == flags_value` (iptables' --tcp-flags); mask 0 = any.
    """

    lo: tuple[int, ...]
    hi: tuple[int, ...]
    flags_mask: int = 0
    flags_value: int = 0

    def __post_init__(self):
        if len(self.lo) != NDIM or len(self.hi) != NDIM:
            raise ValueError("box needs one interval per field")
        if self.flags_value & ~self.flags_mask:
            raise ValueError("flags_value has bits outside flags_mask")

    @staticmethod
    def full() -> Box:
        return Box(tuple(0 for _ in FIELDS), MAXV)

    def with_field(self, name: str, lo: int, hi: int) -> Box:
        i = FIELD_INDEX[name]
        return Box(
            self.lo[:i] + (lo,) + self.lo[i + 1 :],
            self.hi[:i] + (hi,) + self.hi[i + 1 :],
            self.flags_mask,
            self.flags_value,
        )

    def interval(self, name: str) -> tuple[int, int]:
        i = FIELD_INDEX[name]
        return self.lo[i], self.hi[i]

    def is_empty(self) -> bool:
        return any(lo > hi for lo, hi in zip(self.lo, self.hi, strict=True))

    def intersect(self, other: Box) -> Box | None:
        if (self.flags_value ^ other.flags_value) & self.flags_mask & other.flags_mask:
            return None
        lo = tuple(max(a, b) for a, b in zip(self.lo, other.lo, strict=True))
        hi = tuple(min(a, b) for a, b in zip(self.hi, other.hi, strict=True))
        if any(a > b for a, b in zip(lo, hi, strict=True)):
            return None
        return Box(lo, hi, self.flags_mask | other.flags_mask, self.flags_value | other.flags_value)

    def contains(self, point: Header) -> bool:
        v = point.values()
        if any(not (lo <= x <= hi) for lo, hi, x in zip(self.lo, self.hi, v, strict=True)):
            return False
        return (point.tcp_flags & self.flags_mask) == self.flags_value


def boxes_intersect(a: list[Box], b: list[Box]) -> list[Box]:
    """Intersection of two unions of boxes (pairwise)."""
    out = []
    for x in a:
        for y in b:
            z = x.intersect(y)
            if z is not None:
                out.append(z)
    return out


@dataclass(frozen=True)
class Header:
    """A packet header as a point in the header space (see the module docstring for the zero convention)."""

    src: int = 0
    dst: int = 0
    proto: int = 0
    sport: int = 0
    dport: int = 0
    icmp_type: int = 0
    icmp_code: int = 0
    iport: int = 0
    tcp_flags: int = 0

    def values(self) -> tuple[int, ...]:
        return (self.src, self.dst, self.proto, self.sport, self.dport, self.icmp_type, self.icmp_code, self.iport)


@dataclass(frozen=True)
class Origin:
    """Where a rule came from (for error messages, reports and the dashboard's per-rule view)."""

    file: str
    line: int
    chain: str
    text: str


@dataclass(frozen=True)
class Level:
    """One level of the chain stack a flattened rule came through (outermost first).

    `options` are the canonical iptables option tokens of the rule at that level, without `-A CHAIN` and
    without the target (e.g. ("-s", "10.0.0.0/8", "-p", "tcp", "-m", "tcp", "--dport", "80")).
    `unless` lists the option tokens of RETURN rules that precede it in that chain: the packet reaches this
    rule only if none of them matched. Emitters rebuild exact netfilter rules from these levels.
    """

    options: tuple[str, ...]
    unless: tuple[tuple[str, ...], ...] = ()


@dataclass(frozen=True)
class Rule:
    """One rule of the flattened, ordered rule list of the base chain.

    boxes      -- the geometric reduction R⁻ as a union of boxes ([] = can never match)
    complex    -- verbatim token groups of checks the hardware does not implement (matches, -i/-o, ...);
                  non-empty, or a target other than ACCEPT/DROP, makes the rule complex
    target     -- "ACCEPT", "DROP", or any other target name (REJECT, LOG, MARK, a user chain kept unflattened)
    target_args-- the target's options, verbatim
    levels     -- the chain stack, see Level; a rule written directly in the base chain has one level
    origin     -- source location of the innermost rule
    """

    boxes: tuple[Box, ...]
    target: str
    complex: tuple[tuple[str, ...], ...] = ()
    target_args: tuple[str, ...] = ()
    levels: tuple[Level, ...] = ()
    origin: Origin | None = None
    approximate: bool = False  # boxes over-approximate the rule (e.g. a complex RETURN guard above it)

    @property
    def is_simple(self) -> bool:
        return not self.complex and self.target in HW_TARGETS and not self.approximate

    @property
    def action_code(self) -> int:
        return ACTION_CODES.get(self.target, ACTION_NONE)


@dataclass(frozen=True)
class UserChain:
    """A user-defined chain kept verbatim (needed when a jump to it could not be flattened)."""

    name: str
    rules: tuple[tuple[str, ...], ...]  # each: canonical option tokens including -j/-g target


@dataclass
class Policy:
    """A parsed, flattened policy for one base chain: the input of every analysis and emitter."""

    rules: list[Rule]
    default: str = "ACCEPT"  # the base chain's policy: the implicit final catch-all (ACCEPT or DROP)
    base_chain: str = "FORWARD"
    source: str = "<policy>"
    # Verbatim original, for the "full" strategy and k = 0 traffic: the base chain's rules (canonical tokens,
    # including the target) and every user chain they can reach.
    original_rules: list[tuple[str, ...]] = field(default_factory=list)
    user_chains: dict[str, UserChain] = field(default_factory=dict)

    @property
    def simple_indices(self) -> list[int]:
        return [i for i, r in enumerate(self.rules) if r.is_simple]

    @property
    def complex_indices(self) -> list[int]:
        return [i for i, r in enumerate(self.rules) if not r.is_simple]

    @property
    def default_action_code(self) -> int:
        return ACTION_CODES[self.default]

    def canonical_text(self) -> str:
        """A stable text form of what the policy means (drives the policy hash)."""
        lines = [f"base {self.base_chain} policy {self.default}"]
        lines += [" ".join(r) for r in self.original_rules]
        for name in sorted(self.user_chains):
            lines.append(f"chain {name}")
            lines += [" ".join(r) for r in self.user_chains[name].rules]
        return "\n".join(lines) + "\n"

    def policy_hash(self) -> str:
        """Hex SHA-256 of canonical_text(); the deployment's identity (the hardware carries
        hwgen.matcher_hash instead, which ignores everything registers can change)."""
        return hashlib.sha256(self.canonical_text().encode()).hexdigest()
