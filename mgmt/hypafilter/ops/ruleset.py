"""The firewall's filter table as a deployment writes it: the tool's chains (`<prefix><gen>_*`) and the single jump to
MAIN, the policy loaded live under its own names (`live_text`), the texts of the switch and of the removal, and what
the kernel says back (the jump, the base chain's policy, a fingerprint of the tool's chains, their counters). Every
function names the namespace it works in; nothing here keeps state."""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass

from hypafilter import netns
from hypafilter.config import Config
from hypafilter.errors import HypafilterError
from hypafilter.iptables.writer import Restore
from hypafilter.ir import Policy


def chain_prefix(config: Config, generation: int) -> str:
    return f"{config.chain_prefix}{generation}_"


def owned_chains(ns: str | None, config: Config) -> dict[int, list[str]]:
    """Chains in the table that belong to the tool, by generation (also leftovers of an interrupted run)."""
    pat = re.compile(rf"^:({re.escape(config.chain_prefix)}(\d+)_\S*)")
    out: dict[int, list[str]] = {}
    for line in netns.run(["iptables-save", "-t", config.table], ns).splitlines():
        m = pat.match(line)
        if m:
            out.setdefault(int(m.group(2)), []).append(m.group(1))
    return out


def switch_text(
    config: Config,
    base: str,
    new_body: list[str],
    new_main: str | None,
    old_main: str | None,
    base_policy: str | None = None,
) -> str:
    """One restore that loads new chains and moves the single base-chain jump from old_main to new_main; with
    `base_policy`, the base chain takes that policy (the policy's own: without the jump it fails closed)."""
    doc = Restore(config.table)
    if base_policy:
        doc.chain(base, base_policy)  # with --noflush a built-in chain's declaration sets its policy, flushes nothing
    doc.extend(new_body)
    if old_main:
        doc.delete(base, ["-j", old_main])
    if new_main:
        doc.insert(base, 1, ["-j", new_main])
    return doc.text()


def delete_text(
    config: Config,
    chains: list[str],
    base: str | None = None,
    main: str | None = None,
    base_policy: str | None = None,
) -> str:
    """One restore that removes the jump base -> main (if given) and the chains, and gives the base chain back the
    policy it had before the first deploy (`base_policy`)."""
    doc = Restore(config.table)
    if base and base_policy:
        doc.chain(base, base_policy)
    if base and main:
        doc.delete(base, ["-j", main])
    return doc.remove(chains).text()


def orphans(snapshot: str, policy: Policy, prefix: str) -> list[str]:
    """User chains of the table listing `snapshot` that a deploy of `policy` leaves without a reason to exist: not
    the policy's, not the tool's, and not reached from another built-in chain (INPUT, OUTPUT: not the policy's).
    A file deployed is the table, as `iptables-restore` of it would make it: a chain of an earlier policy that stayed
    would keep, for instance, conntrack and its defragmentation registered in the namespace."""
    chains: dict[str, list[str]] = {}
    builtin: set[str] = set()
    for ln in snapshot.splitlines():
        if ln.startswith(":"):
            name, pol = ln[1:].split()[:2]
            chains[name] = []
            if pol != "-":
                builtin.add(name)
        elif ln.startswith("-A "):
            toks = ln.split()
            for i in range(2, len(toks) - 1):
                if toks[i] in ("-j", "-g", "--jump", "--goto"):
                    chains.setdefault(toks[1], []).append(toks[i + 1])
    own = re.compile(rf"^{re.escape(prefix)}\d+_")
    keep = set(policy.user_chains) | set(policy.declared_chains) | {c for c in chains if own.match(c)}
    reached: set[str] = set()
    todo = [c for c in builtin if c != policy.base_chain]
    while todo:
        for t in chains.get(todo.pop(), []):
            if t in chains and t not in reached and t not in builtin:
                reached.add(t)
                todo.append(t)
    return sorted(c for c in chains if c not in builtin and c not in keep and c not in reached)


def live_text(
    config: Config,
    policy: Policy,
    new_body: list[str],
    new_main: str,
    old_main: str | None,
    remove: list[str] = (),
) -> str:
    """One restore that makes the policy the live ruleset under its own names — the base chain's rules, its policy
    and its user chains (declared, so created or flushed) — with the single jump to new_main first, and loads the
    tool's new chains (their rules jump to the operator's chains by name). `remove`: user chains to delete
    (`orphans`); other chains of the table are left as they are; the old MAIN goes with the base chain's flush."""
    base = policy.base_chain
    doc = Restore(config.table)
    doc.chain(base, policy.default)
    names = sorted(policy.user_chains)
    for name in names:
        doc.chain(name)
    doc.extend(new_body)
    doc.flush([base])
    doc.rule(base, ["-j", new_main])
    for toks in policy.original_rules:
        doc.rule(base, toks)
    for name in names:
        for toks in policy.user_chains[name].rules:
            doc.rule(name, toks)
    if remove:
        doc.remove(remove)
    return doc.text()


@dataclass
class Reused:
    """A generation's chains with those already in the kernel under an earlier generation's name taken from there
    (`reuse_chains`): `body` the lines to load (the chains to create, their jumps to kept chains renamed), `created`
    their names, `in_use` every chain the generation walks in the kernel ({name: [digest, the tool's chains it jumps
    to]}: created and kept), `kept` {the generation's name: the earlier name it is loaded as}."""

    body: list[str]
    created: list[str]
    in_use: dict[str, list]
    kept: dict[str, str]

    @property
    def rules_loaded(self) -> int:
        return sum(ln.startswith("-A ") for ln in self.body)


_JUMP = re.compile(r"(?<!\S)(?:-j|-g|--jump|--goto) (\S+)")


def _jump_targets(rest: str) -> list[str]:
    return _JUMP.findall(rest)


def reuse_chains(body: list[str], entry: str, loaded: dict[str, list]) -> Reused:
    """The chains of `body` (restore lines of one generation, ops.deploy's `body`) whose content is that of a chain
    the kernel holds from an earlier generation (`loaded`: as `in_use` recorded it) are not loaded
    again: the chains that jump to them jump to the kept one. A chain's digest covers its rules with each jump to one
    of the tool's chains written as that chain's digest (callees first), so a kept chain holds the same rules and
    reaches the same rules below it as the one it stands for: a frame walks the same rules either way, whatever
    generation's names it passes.
    `entry` (MAIN, which the base chain's jump names) is always loaded anew; where it keeps its name (the IPv6
    side's `HFv6_MAIN`, rewritten in place) no other chain is kept as it."""
    order: list[str] = []
    rules: dict[str, list[str]] = {}
    for ln in body:
        if ln.startswith(":"):
            name = ln[1:].split()[0]
            order.append(name)
            rules.setdefault(name, [])
        elif ln.startswith("-A "):
            name, _, rest = ln[3:].partition(" ")
            rules.setdefault(name, []).append(rest)
    known = {d: n for n, (d, _) in loaded.items() if n != entry}
    # each rule's jumps to the tool's chains (most rules jump to none: ACCEPT, DROP, the operator's chains)
    calls = {c: [[m for m in _JUMP.finditer(r) if m.group(1) in rules] for r in rs] for c, rs in rules.items()}
    resolved: dict[str, str] = {}
    digest: dict[str, str] = {}

    def resolve(name: str) -> str:
        # iterative post-order: callees before callers (trees nest 15 deep, dispatch levels more: no recursion limit)
        stack = [(name, False)]
        while stack:
            c, done = stack.pop()
            if c in resolved:
                continue
            if not done:
                stack.append((c, True))
                stack.extend((m.group(1), False) for ms in calls[c] for m in ms if m.group(1) not in resolved)
                continue
            h = hashlib.sha256()
            lines = rules[c]
            for j, ms in enumerate(calls[c]):
                r = lines[j]
                if not ms:
                    h.update(r.encode() + b"\n")
                    continue
                named, kept, at = [], [], 0
                for m in ms:  # the digest names the content below (whatever chain of it is kept), the rule the name
                    named += [r[at : m.start(1)], digest[m.group(1)]]
                    kept += [r[at : m.start(1)], resolved[m.group(1)]]
                    at = m.end(1)
                h.update(("".join(named) + r[at:]).encode() + b"\n")
                lines[j] = "".join(kept) + r[at:]
            d = h.hexdigest()[:32]
            digest[c] = d
            resolved[c] = known.get(d, c) if c != entry else c
        return resolved[name]

    for name in order:
        resolve(name)
    created = [n for n in order if resolved[n] == n]
    out = [f":{n} - [0:0]" for n in created] + [f"-A {n} {r}" for n in created for r in rules[n]]
    # in use: the chains loaded, the kept ones, and every chain a kept one jumps to in the kernel (of two kept chains
    # of the same rules, the one a kept chain was loaded with may not be the one the new chains name)
    in_use: dict[str, list] = {}
    todo = [resolved[n] for n in order]
    while todo:
        c = todo.pop()
        if c in in_use:
            continue
        if c in loaded and c not in rules:
            in_use[c] = loaded[c]
        else:
            in_use[c] = [
                digest[c],
                sorted({t for r in rules[c] for t in _jump_targets(r) if t in rules or t in loaded}),
            ]
        todo.extend(in_use[c][1])
    return Reused(out, created, in_use, {n: resolved[n] for n in order if resolved[n] != n})


def table_snapshot(ns: str | None, config: Config) -> str:
    """The whole table as iptables-save writes it: what `restore_table` puts back (an undo)."""
    return netns.run(["iptables-save", "-t", config.table], ns)


def restore_table(ns: str | None, text: str) -> None:
    """Replace the whole table with `text` (one atomic iptables-restore without --noflush)."""
    netns.run(["iptables-restore", "-w"], ns, input=text)


def has_jump(ns: str | None, config: Config, base: str, chain: str) -> bool:
    return netns.succeeds(["iptables", "-w", "-t", config.table, "-C", base, "-j", chain], ns)


def base_policy(ns: str | None, config: Config, base: str) -> str:
    """The built-in chain's policy as the kernel holds it (ACCEPT or DROP)."""
    for line in netns.run(["iptables", "-w", "-t", config.table, "-S", base], ns).splitlines():
        if line.startswith(f"-P {base} "):
            return line.split()[2]
    raise HypafilterError(f"{base} is not a built-in chain of table {config.table}")


SAVE = {4: "iptables-save", 6: "ip6tables-save"}


def chains_fingerprint(
    ns: str | None, config: Config, chains: list[str], text: str | None = None, family: int = 4
) -> str:
    """SHA-256 of the tool's chains as the kernel lists them (rules in order, no counters): any rule added,
    removed or changed by hand changes it. `text`: the table's iptables-save listing, if already read. `family` 6:
    the IPv6 side's chains, in ip6tables' filter table."""
    wanted = set(chains)
    if text is None:
        text = netns.run([SAVE[family], "-t", config.table if family == 4 else "filter"], ns)
    lines = [
        ln
        for ln in text.splitlines()
        if (ln.startswith(":") and ln[1:].split()[0] in wanted) or (ln.startswith("-A ") and ln.split()[1] in wanted)
    ]
    return hashlib.sha256(
        "\n".join(
            sorted(ln for ln in lines if ln.startswith(":")) + [ln for ln in lines if ln.startswith("-A ")]
        ).encode()
    ).hexdigest()


def restore(ns: str | None, text: str) -> None:
    netns.run(["iptables-restore", "-w", "--noflush"], ns, input=text)


def chain_counters(
    ns: str | None, config: Config, prefix: str | None = None, chains: list[str] | None = None
) -> dict[str, list[dict]]:
    """Per-rule packet/byte counters of the tool's chains (iptables-save -c): those named `prefix…`, and `chains`
    (a generation's chains kept from earlier ones carry an earlier prefix)."""
    prefix = prefix or config.chain_prefix
    wanted = set(chains or ())
    out: dict[str, list[dict]] = {}
    pat = re.compile(r"^\[(\d+):(\d+)\] -A (\S+) ?(.*)$")
    for line in netns.run(["iptables-save", "-c", "-t", config.table], ns).splitlines():
        m = pat.match(line)
        if m and (m.group(3).startswith(prefix) or m.group(3) in wanted):
            out.setdefault(m.group(3), []).append(
                {"packets": int(m.group(1)), "bytes": int(m.group(2)), "rule": m.group(4)}
            )
    return out
