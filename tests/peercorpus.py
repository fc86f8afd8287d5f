"""Test helpers for the iptables project's own rule-syntax tests (../shared/peer-tests/iptables-extensions/*.t):
their test lines, and which of them name only matches and targets the parser models fully."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

MODELLED = {"tcp", "udp", "icmp", "multiport", "iprange", "comment"}
VERDICTS = {"ACCEPT", "DROP", "RETURN"}


def cases(path: Path) -> Iterator[tuple[int, str, str, bool]]:
    """(line number, rule, expected, ok) for every test line of a .t file."""
    for no, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip() or line.startswith(("#", ":")):
            continue
        parts = line.rsplit(";", 2)
        if len(parts) != 3:
            continue
        rule, expected, result = parts
        yield no, rule, expected, result.strip() == "OK"


def modelled(tokens: Sequence[str]) -> bool:
    """Whether every match and the target among a rule's tokens (options already split from their values) are
    ones the parser models fully; a goto never is."""
    for opt, arg in zip(tokens, [*tokens[1:], ""], strict=True):
        if opt in ("-m", "--match") and arg not in MODELLED:
            return False
        if opt in ("-j", "--jump") and arg not in VERDICTS:
            return False
        if opt in ("-g", "--goto"):
            return False
    return True
