"""The tokenizer: one line of iptables text split into tokens the way its real reader splits it.

Two readers, two modes (each checked against iptables-nft 1.8.9 and the POSIX shell, tests/unit/test_parse.py and
tests/system/test_parse_roundtrip.py):

RESTORE — an iptables-save / iptables-restore line, read as `add_param_to_argv` (iptables/xshared.c) reads it.
  Tokens are separated by blanks (space, tab; no other white space). A double quote opens a quoted part; inside
  it a backslash takes the next character literally (`\\'` is `'`, `\\\\` is `\\`, `\\"` is `"`, `\\x` is `x`),
  and the closing quote ends the token at once (`"ab"cd` is the two tokens `ab` and `cd`). Outside double quotes
  every character is literal: backslash, single quote and `#` included (`'q'` is the three characters `'q'`).
  `""` is an empty token. A line is a comment only when its first character is `#` (the document reader
  decides that); a `#` anywhere else is an ordinary character. An unterminated double quote is refused:
  iptables-restore would carry the line break and the rest of the line into the token.

SHELL — a line of a plain rule file, i.e. a shell command line (`iptables -A FORWARD ...`), read as a POSIX shell
  reads it: blanks separate words; `'...'` is literal; in `"..."` a backslash escapes only `$`, backquote, `"`
  and `\\` (elsewhere it stays); outside quotes a backslash takes the next character literally; a word that
  starts with `#` begins a comment to the end of the line (`a#b` is one word). What a shell would expand or
  interpret — `$`, backquote, `;`, `&`, `|`, `<`, `>`, `(`, `)`, and the unquoted glob characters `*`, `?`,
  `[` — is refused rather than guessed, as is a trailing backslash (a continuation line).
"""

from __future__ import annotations

import re
from typing import NamedTuple

from hypafilter.errors import PolicyError

RESTORE = "restore"
SHELL = "shell"


class Tok(NamedTuple):  # a NamedTuple: tens of thousands are made per policy, a frozen dataclass is 3x slower
    text: str
    col: int  # 1-based column of the token's first character
    quoted: bool = False  # written with quoting (so not the bare spelling of an option or `!`)


# Characters that make a line leave the fast path (a plain split at blanks) in each mode. SPECIAL also holds the
# white space other than blanks, which is part of a token for both readers but not for `str.split()` (the
# document reader's whole-line fast path splits that way).
SPECIAL = re.compile(r'["\r\v\f\x1c-\x1f\x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000]')
SHELL_SPECIAL = re.compile(r"[\"'\\#$`;&|<>()*?\[]")
_WORD = re.compile(r"[^ \t\n]+")
_BLANK = " \t\n"
_SHELL_REFUSED = "$`;&|<>()"
_SHELL_GLOB = "*?["
_SHELL_DQ_ESCAPES = '$`"\\'


def tokenize(line: str, lineno: int = 0, filename: str = "<policy>", mode: str = RESTORE) -> list[Tok]:
    """The tokens of one line as iptables-restore (`mode=RESTORE`) or a shell (`mode=SHELL`) splits it."""
    if not (SPECIAL if mode == RESTORE else SHELL_SPECIAL).search(line):
        # Fast path for the common line without quotes (and, for the shell, escapes and comments).
        return [Tok(m.group(), m.start() + 1) for m in _WORD.finditer(line)]
    if mode == RESTORE:
        return _restore(line, lineno, filename)
    if mode == SHELL:
        return _shell(line, lineno, filename)
    raise ValueError(f"unknown tokenizer mode {mode!r}")


def _restore(line: str, lineno: int, filename: str) -> list[Tok]:
    toks: list[Tok] = []
    i, n = 0, len(line)
    while i < n:
        if line[i] in _BLANK:
            i += 1
            continue
        start, buf, quoted = i, [], False
        while i < n and line[i] not in _BLANK:
            c = line[i]
            if c != '"':
                buf.append(c)
                i += 1
                continue
            quoted, j = True, i + 1
            while j < n and line[j] != '"':
                if line[j] == "\\":
                    j += 1
                    if j >= n:
                        break
                buf.append(line[j])
                j += 1
            if j >= n:
                raise PolicyError("unterminated double quote", filename, lineno, i + 1, line[i:])
            i = j + 1
            break  # the closing quote ends the token, whatever follows
        toks.append(Tok("".join(buf), start + 1, quoted))
    return toks


def _shell(line: str, lineno: int, filename: str) -> list[Tok]:
    toks: list[Tok] = []
    i, n = 0, len(line)

    def refuse(msg: str, at: int) -> PolicyError:
        return PolicyError(msg, filename, lineno, at + 1, line[at:])

    while i < n:
        if line[i] in _BLANK:
            i += 1
            continue
        if line[i] == "#":
            break
        start, buf, quoted = i, [], False
        while i < n and line[i] not in _BLANK:
            c = line[i]
            if c == "'":
                j = line.find("'", i + 1)
                if j < 0:
                    raise refuse("unterminated single quote", i)
                quoted = True
                buf.append(line[i + 1 : j])
                i = j + 1
            elif c == '"':
                quoted, j = True, i + 1
                while j < n and line[j] != '"':
                    d = line[j]
                    if d in "$`":
                        raise refuse(f"shell expansion {d!r} is not supported in a rule file (use single quotes)", j)
                    if d == "\\" and j + 1 < n and line[j + 1] in _SHELL_DQ_ESCAPES:
                        j += 1
                    buf.append(line[j])
                    j += 1
                if j >= n:
                    raise refuse("unterminated double quote", i)
                i = j + 1
            elif c == "\\":
                if i + 1 >= n:
                    raise refuse("a trailing backslash (continuation line) is not supported in a rule file", i)
                quoted = True
                buf.append(line[i + 1])
                i += 2
            elif c in _SHELL_REFUSED:
                raise refuse(f"shell syntax {c!r} is not supported in a rule file (quote it)", i)
            elif c in _SHELL_GLOB:
                raise refuse(f"unquoted shell glob character {c!r} (quote it)", i)
            else:
                buf.append(c)
                i += 1
        toks.append(Tok("".join(buf), start + 1, quoted))
    return toks
