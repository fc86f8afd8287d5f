"""The kernel's own word on a policy: its rules loaded for real into a scratch network namespace, and every line
the kernel (or iptables' userspace parser) refuses mapped back to the user's file, line and token.

`iptables-restore --test` alone is not enough: it parses in userspace only, so what only the kernel refuses (a
string match with `--from` above `--to`, an algorithm that does not exist) passes it. A real load into a fresh
namespace sees both, and changes nothing on the host. ipsets live per namespace: a set the policy names is
created in the scratch namespace from the host's own definition (`ipset save`), and a set the host does not have
is an error of its own.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Sequence
from dataclasses import dataclass

from hypafilter import netns
from hypafilter.errors import PolicyError, shown_text
from hypafilter.iptables.tokens import tokenize
from hypafilter.iptables.writer import BUILTIN_FILTER_CHAINS, rule_line
from hypafilter.ir import Origin, Policy

MAX_ERRORS = 50  # each refused line is commented out and the load retried; a file this broken is reported in part
_USERSPACE = re.compile(r"^Error occurred at line: (\d+)$", re.M)
_KERNEL = re.compile(r"^line (\d+): (.*)$", re.M)
_PREFIX = re.compile(r"^ip6?tables-restore v[\d.]+ \([^)]*\): ?", re.M)


@dataclass(frozen=True)
class Line:
    """One line of the text to load and where it came from (None: a line the checker wrote)."""

    text: str
    origin: Origin | None = None


def restore_command(family: int = 4) -> str:
    """The restore tool of a policy's family (ir.family): iptables-restore, or ip6tables-restore for IPv6."""
    return "ip6tables-restore" if family == 6 else "iptables-restore"


def available(family: int = 4) -> str | None:
    """Why the kernel check cannot run here (None: it can): it needs root and iptables-restore (ip6tables-restore for
    an IPv6 policy)."""
    tool = restore_command(family)
    if os.geteuid() != 0:
        return "not root (network namespaces need it)"
    if not shutil.which(tool) or not shutil.which("ip"):
        return f"{tool} or ip is not installed"
    return None


def set_names(tokens: Sequence[str]) -> list[str]:
    """The ipsets a rule's tokens name (`-m set --match-set NAME FLAGS`, `-j SET --add-set NAME FLAGS`)."""
    return [tokens[i + 1] for i, t in enumerate(tokens[:-1]) if t in ("--match-set", "--add-set", "--del-set")]


def _host_sets(text: str | None = None) -> dict[str, str]:
    """The host's ipsets (or those of an `ipset save` text): name -> its `create` line from `ipset save` (empty when
    ipset is missing)."""
    if not shutil.which("ipset"):
        return {}
    out = {}
    if text is None:
        text = netns.run(["ipset", "save"], check=False)
    for ln in text.splitlines():
        parts = ln.split()
        if len(parts) >= 3 and parts[0] == "create":
            out[parts[1]] = ln
    return out


def check(
    lines: Sequence[Line],
    sets: dict[str, Origin],
    table: str = "filter",
    sets_text: str | None = None,
    family: int = 4,
) -> list[PolicyError]:
    """Load `lines` (a complete iptables-restore text for `table`) into a scratch namespace; every refusal as a
    PolicyError at the user's line. `sets`: ipset name -> the first rule that names it; `sets_text`: the `ipset save`
    text they come from (--ipsets, or the firewall's; None: this namespace's). `family` 6: ip6tables-restore."""
    errors: list[PolicyError] = []
    host_sets = _host_sets(sets_text or None) if sets else {}
    missing = {name: o for name, o in sets.items() if name not in host_sets}
    why = "does not exist on this host" if shutil.which("ipset") else "cannot be checked: ipset is not installed"
    for name, o in sorted(missing.items()):
        col = o.text.find(name) + 1 if o.text.find(name) >= 0 else 0
        errors.append(PolicyError(f"ipset {name} {why}", o.file, o.line, col, name))
    work = [ln.text for ln in lines]
    for i, ln in enumerate(lines):  # rules on missing sets cannot load anywhere: already reported
        if ln.origin is not None and any(n in missing for n in set_names(ln.text.split())):
            work[i] = "# " + ln.text
    needed = sorted(set(sets) - set(missing))
    # A scratch network namespace: a named one when ipsets must be created in it first, else a private one per
    # attempt (`unshare --net`, one process instead of three; it ends with the command)
    ns = f"hflint-{os.getpid()}" if needed else None
    if ns:
        netns.add(ns)
    tool = restore_command(family)
    restore = [tool, "-w"] if ns else ["unshare", "--net", tool, "-w"]
    try:
        for name in needed:
            netns.run(["ipset", "restore"], ns, input=host_sets[name] + "\n")
        for _ in range(MAX_ERRORS):
            try:
                netns.run(restore, ns, input="\n".join(work) + "\n")
                break
            except netns.CommandError as e:
                refused = _refused(e.stderr)
                refused = [(n, msg) for n, msg in refused if 0 < n <= len(lines) and not work[n - 1].startswith("#")]
                if not refused:  # nothing to point at (or the same line again): report the whole answer once
                    source = next((ln.origin.file for ln in lines if ln.origin), "<policy>")
                    errors.append(PolicyError(f"the kernel refused the policy: {e}", source))
                    break
                for n, msg in refused:
                    ln = lines[n - 1]
                    o = ln.origin
                    if o is None:  # a line the checker wrote: report it against the policy as a whole
                        errors.append(PolicyError(f"the kernel refused a generated line ({msg}): {ln.text}"))
                    else:
                        col, tok = refused_token(msg, o.text)
                        errors.append(
                            PolicyError(f"the kernel refuses this rule: {shown_text(msg)}", o.file, o.line, col, tok)
                        )
                    work[n - 1] = "# " + work[n - 1]
    finally:
        if ns:
            netns.delete(ns)
    return sorted(errors, key=lambda e: (e.file, e.line, e.column))


def _refused(stderr: str) -> list[tuple[int, str]]:
    """(line, message) pairs from iptables-restore's error output: a userspace parse error names one line
    ("Error occurred at line: N", the message before it); the kernel's refusals name theirs ("line N: ...")."""
    text = _PREFIX.sub("", stderr)
    m = _USERSPACE.search(text)
    if m:
        msg = text[: m.start()].strip().splitlines()
        return [(int(m.group(1)), msg[-1] if msg else "parse error")]
    return [(int(n), msg.strip()) for n, msg in _KERNEL.findall(text)]


def refused_token(msg: str, text: str) -> tuple[int, str]:
    """(column, token) of the rule line `text` that a refusal `msg` is about: a token the message quotes (an unknown
    match or target, a bad value), else the value of the option a message naming no token is known to be about;
    (1, text) when neither is there."""
    try:
        toks = tokenize(text)
    except PolicyError:
        return 1, text
    words = [t.text for t in toks]
    for q in _QUOTED.findall(msg):
        name = q[0] or q[1]
        if name in words:
            t = toks[words.index(name)]
            return t.col, t.text
    for pattern, option, applies in _HINTS:
        if pattern.search(msg) and option in words[:-1] and applies(words):
            t = toks[words.index(option) + 1]
            return t.col, t.text
    return 1, text


def _value(words: list[str], option: str) -> int | None:
    i = words.index(option) + 1 if option in words[:-1] else 0
    return int(words[i]) if i and words[i].isdigit() else None


# Tokens a refusal quotes: `name' (iptables' "Couldn't load match `x'") and "value".
_QUOTED = re.compile(r"`([^']*)'|\"([^\"]*)\"")
# Refusals that name no token, and the option whose value they are about when the rule has it.
_HINTS = (
    (re.compile(r"Invalid MAC address"), "--mac-source", lambda w: True),
    # a text-search algorithm the kernel has no module for
    (re.compile(r"\(No such file or directory\)"), "--algo", lambda w: True),
    # the string match's window: --from above --to
    (re.compile(r"\(Invalid argument\)"), "--to", lambda w: (_value(w, "--from") or 0) > (_value(w, "--to") or 0)),
)


def policy_lines(policy: Policy, table: str = "filter") -> tuple[list[Line], dict[str, Origin]]:
    """The policy's table as the kernel would load it alone (its base chain with its policy, every reachable user
    chain), each rule line with the origin it was written at; and the ipsets its rules name."""
    out = [Line(f"*{table}")]
    out += [Line(f":{c} {policy.default if c == policy.base_chain else 'ACCEPT'} [0:0]") for c in BUILTIN_FILTER_CHAINS]
    names = sorted(policy.user_chains)
    out += [Line(f":{n} - [0:0]") for n in names]
    placed = [(policy.base_chain, toks, o) for toks, o in _with_origins(policy.original_rules, policy.original_origins)]
    for n in names:
        uc = policy.user_chains[n]
        placed += [(n, toks, o) for toks, o in _with_origins(uc.rules, uc.origins)]
    sets: dict[str, Origin] = {}
    for chain, toks, o in placed:
        out.append(Line(rule_line(chain, toks), o))
        for s in set_names(toks):
            if o is not None:
                sets.setdefault(s, o)
    out.append(Line("COMMIT"))
    return out, sets


def _with_origins(rules, origins):
    return zip(rules, list(origins) + [None] * (len(rules) - len(origins)), strict=True)
