"""The rule IR: boxes and their algebra (`box`), rules and policies (`rule`), and the meaning of a rule in a
first-match walk (`semantics`). Format-free: nothing here reads or writes iptables, nft or VHDL.

The names below are the IR's vocabulary, imported from here by every other layer.
"""

from hypafilter.ir.box import FIELD_INDEX, FIELDS, MAXV, NDIM, PROTO_ICMP, PROTO_TCP, PROTO_UDP, WIDTHS, Box, Header
from hypafilter.ir.rule import (
    ACTION_ACCEPT,
    ACTION_CODES,
    ACTION_DROP,
    ACTION_NONE,
    HW_TARGETS,
    Level,
    Origin,
    Policy,
    Rule,
    UserChain,
)

__all__ = [
    "ACTION_ACCEPT", "ACTION_CODES", "ACTION_DROP", "ACTION_NONE", "FIELDS", "FIELD_INDEX", "HW_TARGETS", "MAXV",
    "NDIM", "PROTO_ICMP", "PROTO_TCP", "PROTO_UDP", "WIDTHS", "Box", "Header", "Level", "Origin", "Policy", "Rule",
    "UserChain",
]  # fmt: skip
