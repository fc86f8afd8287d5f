"""The one iptables-restore writer: tokens quoted exactly as `iptables-restore` reads them, rule lines, documents.

iptables-restore (1.8.x, `add_param_to_argv`) splits a line at blanks; a double quote opens a quoted part in
which a backslash takes the next character literally; outside quotes every other character, backslash and
single quote included, is literal. So a token is written bare when it has only characters that no reader treats
specially, and otherwise in double quotes with `\\` and `"` escaped — the form `iptables-save` itself writes
(`xtables_save_string`). The empty token is written as `""`; `#` and `'` are quoted too, though iptables-restore
reads them literally anywhere but in the first column. Our own tokenizer (`iptables.tokens.tokenize`, its
RESTORE mode) reads every text written here back to the same tokens; a round-trip test holds both to that.

Every iptables-restore text the tool produces (the hybrid chains, the oracle's original policy, the deploy
switch/delete transactions, the benchmarks' rule sets) is built here.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from functools import lru_cache

from hypafilter.errors import HypafilterError

_SAFE = re.compile(r"^[A-Za-z0-9_@%+=:,./!-]+$")
BUILTIN_FILTER_CHAINS = ("INPUT", "FORWARD", "OUTPUT")


@lru_cache(maxsize=1 << 16)  # the same few thousand tokens recur in every generated chain
def quote(tok: str) -> str:
    """One token as iptables-restore reads it back unchanged."""
    if _SAFE.match(tok):
        return tok
    return '"' + tok.replace("\\", "\\\\").replace('"', '\\"') + '"'


def tokens_text(tokens: Iterable[str]) -> str:
    """A token sequence as one line of iptables-restore text (the inverse of `iptables.tokens.tokenize`)."""
    return " ".join(quote(t) for t in tokens)


def rule_line(chain: str, tokens: Sequence[str], command: str = "-A") -> str:
    """`-A CHAIN tokens...` (or -D/-C with `command`); a leading `-A X`/`--append X` in `tokens` is dropped."""
    toks = tuple(tokens)
    if len(toks) >= 2 and toks[0] in ("-A", "--append"):
        toks = toks[2:]
    return " ".join([command, quote(chain), *(quote(t) for t in toks)])


class Restore:
    """An iptables-restore document for one table, built line by line; `text()` closes it with COMMIT.

    Declaring a chain (`chain`) flushes it when the text is loaded with --noflush; built-in chains are
    declared with their policy.
    """

    def __init__(self, table: str = "filter", comment: str | None = None):
        self.lines: list[str] = [f"# {comment}"] if comment else []
        self.lines.append(f"*{table}")

    def chain(self, name: str, policy: str = "-") -> Restore:
        self.lines.append(f":{name} {policy} [0:0]")
        return self

    def rule(self, chain: str, tokens: Sequence[str]) -> Restore:
        self.lines.append(rule_line(chain, tokens))
        return self

    def insert(self, chain: str, position: int, tokens: Sequence[str]) -> Restore:
        self.lines.append(" ".join(["-I", quote(chain), str(position), *(quote(t) for t in tokens)]))
        return self

    def delete(self, chain: str, tokens: Sequence[str]) -> Restore:
        self.lines.append(rule_line(chain, tokens, command="-D"))
        return self

    def flush(self, chains: Iterable[str]) -> Restore:
        self.lines += [f"-F {quote(c)}" for c in chains]
        return self

    def remove(self, chains: Iterable[str]) -> Restore:
        """Flush every chain first (they may jump to each other), then delete them."""
        chains = list(chains)
        self.flush(chains)
        self.lines += [f"-X {quote(c)}" for c in chains]
        return self

    def extend(self, lines: Iterable[str]) -> Restore:
        """Lines already written by this module (e.g. the body of another Restore)."""
        self.lines += list(lines)
        return self

    def body(self) -> list[str]:
        """The chain and rule lines, without comment, table header and COMMIT."""
        return [ln for ln in self.lines if not ln.startswith(("#", "*"))]

    def text(self) -> str:
        return "\n".join([*self.lines, "COMMIT"]) + "\n"


def body_of(restore_text: str) -> list[str]:
    """The chain and rule lines of an iptables-restore text, without comments, table header and COMMIT."""
    return [ln for ln in restore_text.splitlines() if ln.strip() and not ln.startswith(("*", "COMMIT", "#"))]


def policy_restore(policy, table: str = "filter") -> str:
    """The original policy alone as a complete iptables-restore text (what the kernel oracle and the
    software-only benchmarks load): the built-in chains with the base chain's policy, every user chain verbatim."""
    if policy.base_chain not in BUILTIN_FILTER_CHAINS:
        raise HypafilterError(f"base chain {policy.base_chain} is not a built-in chain of {table}")
    doc = Restore(table)
    for base in BUILTIN_FILTER_CHAINS:
        doc.chain(base, policy.default if base == policy.base_chain else "ACCEPT")
    names = sorted(policy.user_chains)
    for name in names:
        doc.chain(name)
    for toks in policy.original_rules:
        doc.rule(policy.base_chain, toks)
    for name in names:
        for toks in policy.user_chains[name].rules:
            doc.rule(name, toks)
    return doc.text()
