"""Error types shared by every part of the tool; each carries where the problem is."""

from __future__ import annotations

import re

TOKEN_SHOWN = 80  # a token longer than this is cut in messages and listings (a 1 MB token is not echoed whole)
_LONG_WORD = re.compile(rf"[^ \t\n]{{{TOKEN_SHOWN + 1},}}")


def shown(token: str) -> str:
    """A token of user text as every message and listing prints it: cut after TOKEN_SHOWN characters."""
    return token if len(token) <= TOKEN_SHOWN else f"{token[:TOKEN_SHOWN]}... ({len(token)} characters)"


def shown_text(text: str) -> str:
    """Text that quotes user tokens (a rule line, another tool's message) with each overlong word `shown`."""
    return _LONG_WORD.sub(lambda m: shown(m.group()), text) if len(text) > TOKEN_SHOWN else text


class HypafilterError(Exception):
    """Base class: a clear, user-facing error (the CLI prints it and exits non-zero)."""


class PolicyError(HypafilterError):
    """An error in a policy file, naming file, line, column and the offending token."""

    def __init__(self, message: str, file: str = "<policy>", line: int = 0, column: int = 0, token: str = ""):
        self.message = message
        self.file = file
        self.line = line
        self.column = column
        self.token = token
        where = f"{file}:{line}:{column}" if line else file
        tok = f" (at {shown(token)!r})" if token else ""
        super().__init__(f"{where}: {message}{tok}")


class DeployError(HypafilterError):
    """A deploy/update step failed; `step` names it. The previous deployment stays active."""

    def __init__(self, step: str, message: str):
        self.step = step
        super().__init__(f"deploy step '{step}' failed: {message}")
