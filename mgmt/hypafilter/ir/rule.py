"""Rules and policies of the IR: the flattened, ordered rule list of one base chain, each rule a union of boxes
plus the verbatim checks and target the hardware does not implement.

Nothing here knows iptables, nftables or VHDL syntax except the opaque option tokens a rule keeps so that
emitters can write the original checks back. Conversions live at the boundaries (`iptables`, `netfilter`, `hw`).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

from hypafilter.ir.box import Box
from hypafilter.ir.sets import SetInfo, SetSlot

# Action codes as carried in the shunt metadata M[27:24] and the low 4 bits of the netfilter mark.
ACTION_NONE, ACTION_ACCEPT, ACTION_DROP = 0, 1, 2
ACTION_CODES = {"ACCEPT": ACTION_ACCEPT, "DROP": ACTION_DROP}
HW_TARGETS = frozenset(ACTION_CODES)


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
    # Position in the base chain of a rule with per-rule state (limit, quota, recent, ...): such a rule must exist
    # once in the loaded rule set, so every generated chain that needs it jumps to one copy (None: no such state).
    stateful_pos: int | None = None
    # A rule whose only complex checks are connection states is split in two (iptables.ctstate): "hit" = the
    # part for frames the flow cache knows (ct 1/2, no complex checks), "miss" = the rest (ct 0/3, the checks
    # kept); "" = not split. Both parts write the same rule from their levels.
    ct_part: str = ""

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
    origins: tuple[Origin | None, ...] = ()  # where each rule was written (same order), when known


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
    original_origins: list[Origin | None] = field(default_factory=list)  # where each original rule was written
    ignored_tables: tuple[str, ...] = ()  # tables the source file fills besides this policy's (not deployed)
    # every user chain the source declares in the policy's table, reached from the base chain or not (a deploy
    # leaves them in the table, as iptables-restore of the file would have them)
    declared_chains: tuple[str, ...] = ()
    # Some reachable rule reads conntrack state (set by the front end): the fast path then accepts nothing by itself.
    reads_conntrack: bool = False
    # The deployment's interfaces the front end resolved interface checks against: (bridge, ((name, NIC port),
    # ...)); ("", ()) = nothing known, every interface check stayed a check for software. A deployment must match.
    interfaces: tuple[str, tuple[tuple[str, int], ...]] = ("", ())
    # Every interface check so resolved, in the base chain and the user chains it reaches: (where, the check's
    # option tokens, what it became for NIC frames), for reports.
    resolved: list[tuple[Origin | None, tuple[str, ...], str]] = field(default_factory=list)
    # The set slots the simple rules' boxes test (bit i of Box.sets_mask = set_slots[i]; at most MAX_SET_SLOTS),
    # and the sets the front end read (live or --ipsets), by name: what a target fills its tables from.
    set_slots: tuple[SetSlot, ...] = ()
    sets: dict[str, SetInfo] = field(default_factory=dict)
    # Every set match of the flattened rules and what became of it (iptables.sets.SetNote: slot or why complex).
    set_notes: list = field(default_factory=list)
    # The `ipset save` text the sets came from when given as a file (--ipsets): what labs and the oracle create.
    ipsets_text: str = ""
    ipsets_file: str = ""  # the file it came from ("": the live kernel's sets, read where the firewall runs)
    # The address family (ir.family): 4 = an iptables policy, 6 = an ip6tables one, whose boxes hold 128-bit addresses
    # until ir.family.compress ranks them; the ranked policy carries its AddrMap in `addr_map` (None: not ranked).
    family: int = 4
    addr_map: object | None = field(default=None, repr=False, compare=False)
    # What the front end noticed about rules that are not errors (where, what), for lint: for an ip6tables policy the
    # rules that can never match (`-p` of an extension header, as ip6tables warns).
    notes: list[tuple[Origin | None, str]] = field(default_factory=list)

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
        if self.family != 4:  # (only then: the hashes of IPv4 policies stay as they were)
            lines.append(f"family {self.family}")
        lines += [" ".join(r) for r in self.original_rules]
        for name in sorted(self.user_chains):
            lines.append(f"chain {name}")
            lines += [" ".join(r) for r in self.user_chains[name].rules]
        for i, slot in enumerate(self.set_slots):  # the set types shape the fast path (their contents do not)
            lines.append(f"set slot {i} {slot.name} {slot.settype} {','.join(slot.dirs)}")
        return "\n".join(lines) + "\n"

    def policy_hash(self) -> str:
        """Hex SHA-256 of canonical_text(); the deployment's identity (the hardware carries
        hw.vhdl.matcher_hash instead, which ignores everything registers can change)."""
        return hashlib.sha256(self.canonical_text().encode()).hexdigest()
