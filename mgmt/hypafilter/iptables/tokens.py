"""The tokenizer: one line of iptables text split into tokens exactly as iptables-restore reads it."""

from __future__ import annotations

import re
from typing import NamedTuple

from hypafilter.errors import PolicyError


class Tok(NamedTuple):  # a NamedTuple: tens of thousands are made per policy, a frozen dataclass is 3x slower
    text: str
    col: int  # 1-based column of the token's first character
    quoted: bool = False


SPECIAL = re.compile(r"[\"'\\#]")
_WORD = re.compile(r"\S+")


def tokenize(line: str, lineno: int = 0, filename: str = "<policy>") -> list[Tok]:
    """Shell-like split of one line as iptables-restore does it: "..." (\\" and \\\\ escapes), '...', # comments."""
    if not SPECIAL.search(line):
        # Fast path for the common line without quotes, escapes or comments: plain whitespace split.
        return [Tok(m.group(), m.start() + 1) for m in _WORD.finditer(line)]
    toks: list[Tok] = []
    i, n = 0, len(line)
    while i < n:
        if line[i].isspace():
            i += 1
            continue
        if line[i] == "#":
            break
        start, buf, quoted = i, [], False
        while i < n and not line[i].isspace():
            c = line[i]
            if c == '"':
                quoted, j = True, i + 1
                while j < n and line[j] != '"':
                    if line[j] == "\\" and j + 1 < n and line[j + 1] in '"\\':
                        j += 1
                    buf.append(line[j])
                    j += 1
                if j >= n:
                    raise PolicyError("unterminated double quote", filename, lineno, i + 1, line[i:])
                i = j + 1
            elif c == "'":
                quoted, j = True, line.find("'", i + 1)
                if j < 0:
                    raise PolicyError("unterminated single quote", filename, lineno, i + 1, line[i:])
                buf.append(line[i + 1 : j])
                i = j + 1
            elif c == "\\" and i + 1 < n:
                buf.append(line[i + 1])
                i += 2
            else:
                buf.append(c)
                i += 1
        toks.append(Tok("".join(buf), start + 1, quoted))
    return toks
