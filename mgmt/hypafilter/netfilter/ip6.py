"""The IPv6 side of a deployment in stage 1 (docs/ipv6.md, "Deploy and verify"): an ip6tables policy loaded verbatim
into the firewall's ip6tables, every IPv6 frame decided there (the fast paths hand every IPv6 frame to the stack with
k = 0, the full policy in software).

`V6Policy` is an ip6tables-save file as ip6tables itself reads it: checked by `ip6tables-restore --test` in a
scratch namespace (an error names the file and line), the tables it names replaced whole when it is loaded, as
`ip6tables-restore` of the file would. `--ipv6-default drop` is the policy `drop_policy` (the base chain's policy
DROP, no rule: every IPv6 frame that chain sees dropped) and `kernel` no IPv6 policy at all (ip6tables as the
operator has it). What the tables held before the first deploy (`snapshot`) is given back at undeploy (`give_back`).

The addresses, protocols and ports the file names (`aims`) are read here only to aim verify's frames at them; no
verdict is derived from them (the kernel is the oracle).
"""

from __future__ import annotations

import hashlib
import ipaddress
import os
import re
import shlex
from dataclasses import dataclass, field

from hypafilter import netns
from hypafilter.errors import PolicyError
from hypafilter.iptables.document import read_policy_text
from hypafilter.netfilter import ipset

DEFAULTS = ("kernel", "drop")  # --ipv6-default
BUILTIN = {
    "filter": ("INPUT", "FORWARD", "OUTPUT"),
    "raw": ("PREROUTING", "OUTPUT"),
    "mangle": ("PREROUTING", "INPUT", "FORWARD", "OUTPUT", "POSTROUTING"),
    "security": ("INPUT", "FORWARD", "OUTPUT"),
    "nat": ("PREROUTING", "INPUT", "OUTPUT", "POSTROUTING"),
}


@dataclass(frozen=True)
class V6Policy:
    """An IPv6 policy as deploy and verify take it: the ip6tables-restore text, where it came from, and the chain a
    frame of the deployment meets (FORWARD in bridge mode, INPUT in host mode). `kind`: "policy" (a file) or "drop"
    (--ipv6-default drop)."""

    source: str
    text: str
    base_chain: str = "FORWARD"
    kind: str = "policy"
    tables: tuple[str, ...] = ()
    rules: dict[str, int] = field(default_factory=dict)  # "table/chain" -> rules
    policies: dict[str, str] = field(default_factory=dict)  # "table/chain" -> policy of a built-in chain
    # the IPv6 front end's reading of the file (an ir.Policy of family 6), for aiming verify's frames only
    ir: object | None = field(default=None, compare=False, repr=False)
    # the `ipset save` text of the sets its -m set matches read (checked with them; verify aims at their elements)
    sets_text: str = field(default="", compare=False, repr=False)

    @property
    def family(self) -> int:
        return 6

    def policy_hash(self) -> str:
        return hashlib.sha256(f"{self.kind}\n{self.base_chain}\n{self.text}".encode()).hexdigest()

    @property
    def rule_count(self) -> int:
        return sum(self.rules.values())

    @property
    def default(self) -> str:
        return self.policies.get(f"filter/{self.base_chain}", "ACCEPT")

    def describe(self) -> str:
        if self.kind == "drop":
            return f"dropped: ip6tables {self.base_chain} policy DROP, no rule (--ipv6-default drop)"
        return (
            f"policy {self.source} in ip6tables ({self.rule_count} rules, family 6; {self.base_chain} policy "
            f"{self.default}); every IPv6 frame to software (k = 0)"
        )

    def state(self) -> dict:
        return {
            "mode": self.kind,
            "source": self.source,
            "hash": self.policy_hash(),
            "base_chain": self.base_chain,
            "tables": list(self.tables),
            "rules": dict(self.rules),
            "policies": dict(self.policies),
            "text": self.text,
        }

    @classmethod
    def from_state(cls, d: dict) -> V6Policy:
        return cls(
            d["source"],
            d["text"],
            d.get("base_chain", "FORWARD"),
            d.get("mode", "policy"),
            tuple(d.get("tables") or ()),
            dict(d.get("rules") or {}),
            dict(d.get("policies") or {}),
        )


def _structure(text: str, source: str) -> tuple[tuple[str, ...], dict[str, int], dict[str, str]]:
    """Tables, rules per chain and built-in chain policies of an ip6tables-save text; a line that is none of
    *table, :chain, -A/-I rule, COMMIT or a comment is refused with its line."""
    tables: list[str] = []
    rules: dict[str, int] = {}
    policies: dict[str, str] = {}
    table = None
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("*"):
            table = line[1:].strip()
            if table not in BUILTIN:
                raise PolicyError(f"unknown ip6tables table '{table}'", source, lineno, 1)
            tables.append(table)
        elif table is None:
            raise PolicyError(
                f"'{line.split()[0]}' before any *table line (an ip6tables-save file starts with *filter)",
                source,
                lineno,
                1,
            )
        elif line == "COMMIT":
            table = None
        elif line.startswith(":"):
            parts = line[1:].split()
            if len(parts) >= 2 and parts[1] != "-":
                policies[f"{table}/{parts[0]}"] = parts[1]
            rules.setdefault(f"{table}/{parts[0]}", 0)
        elif line.startswith(("-A ", "-I ", "--append ", "--insert ")):
            try:
                toks = shlex.split(line, comments=False)
            except ValueError as e:
                raise PolicyError(f"unbalanced quotes: {e}", source, lineno, 1) from e
            if "-4" in toks or "--ipv4" in toks:
                raise PolicyError("an IPv4-only rule (-4) in an IPv6 policy", source, lineno, line.find("-4") + 1)
            key = f"{table}/{toks[1] if len(toks) > 1 else '?'}"
            rules[key] = rules.get(key, 0) + 1
        else:
            raise PolicyError(f"not an ip6tables-save line: {line[:60]!r}", source, lineno, 1)
    if table is not None:
        raise PolicyError(f"table {table} has no COMMIT line", source, len(text.splitlines()), 1)
    if not tables:
        raise PolicyError("no *table in the file: not an ip6tables-save file", source, 1, 1)
    return tuple(dict.fromkeys(tables)), rules, policies


def uses_sets(text: str) -> bool:
    """Whether the policy reads or writes ipsets (-m set, -j SET)."""
    return any(opt in text for opt in ("--match-set", "--add-set", "--del-set"))


def check(text: str, source: str, sets_text: str = "") -> None:
    """The text loaded for real by `ip6tables-restore` into a scratch network namespace (`--test` alone takes a
    jump to a missing chain): a line the kernel or its parser refuses raises PolicyError naming the file and line.
    `sets_text`: the `ipset save` text of the sets its -m set matches read, created there first (a named scratch
    namespace then; else a private one, `unshare --net`)."""
    ns = f"hf6chk-{os.getpid()}" if sets_text else None
    try:
        if ns:
            netns.add(ns)
            ipset.restore(ns, sets_text)
            netns.run(["ip6tables-restore", "-w"], ns, input=text)
        else:
            netns.run(["unshare", "--net", "ip6tables-restore", "-w"], None, input=text)
    except netns.CommandError as e:
        msg = e.stderr or str(e)
        m = re.search(r"line:? (\d+)", msg)
        line = int(m.group(1)) if m else 1
        lines = text.splitlines()
        bad = lines[line - 1].strip() if 0 < line <= len(lines) else ""
        first = next((ln for ln in msg.splitlines() if ln.strip()), msg).split("): ", 1)[-1]
        raise PolicyError(
            f"ip6tables refuses it: {first.strip()}" + (f" ({bad[:80]})" if bad else ""), source, line, 1
        ) from e
    finally:
        if ns:
            netns.delete(ns)


def _last_line(msg: str) -> str:
    lines = [ln.strip() for ln in msg.splitlines() if ln.strip()]
    return lines[-1] if lines else msg


def parse(text: str, source: str, base_chain: str = "FORWARD", validate: bool = True, sets_text: str = "") -> V6Policy:
    """The V6Policy of an ip6tables-save text (checked by the kernel's parser unless `validate` is off; `sets_text`:
    the sets its -m set matches read, `check`)."""
    tables, rules, policies = _structure(text, source)
    if "filter" not in tables:
        raise PolicyError("no *filter table: the IPv6 policy's rules go in ip6tables' filter table", source, 1, 1)
    if f"filter/{base_chain}" not in policies:
        raise PolicyError(
            f"the filter table does not declare :{base_chain} (the chain IPv6 frames meet here)", source, 1, 1
        )
    if validate:
        check(text, source, sets_text if uses_sets(text) else "")
    return V6Policy(
        source,
        text if text.endswith("\n") else text + "\n",
        base_chain,
        "policy",
        tables,
        rules,
        policies,
        sets_text=sets_text if uses_sets(text) else "",
    )


def read(path: str, base_chain: str = "FORWARD", sets_text: str = "") -> V6Policy:
    text = read_policy_text(path)
    return parse(text, path, base_chain, sets_text=sets_text)


def drop_policy(base_chain: str = "FORWARD") -> V6Policy:
    """--ipv6-default drop: ip6tables' filter table with the base chain's policy DROP and no rule."""
    chains = "".join(f":{c} {'DROP' if c == base_chain else 'ACCEPT'} [0:0]\n" for c in BUILTIN["filter"])
    text = f"*filter\n{chains}COMMIT\n"
    return V6Policy(
        "--ipv6-default drop",
        text,
        base_chain,
        "drop",
        ("filter",),
        {f"filter/{c}": 0 for c in BUILTIN["filter"]},
        {f"filter/{c}": "DROP" if c == base_chain else "ACCEPT" for c in BUILTIN["filter"]},
    )


# ---- the kernel's ip6tables in a namespace ---------------------------------------------------------------------


def backend(ns: str | None) -> str:
    out = netns.run(["ip6tables", "-V"], ns)
    return "nf_tables" if "nf_tables" in out else "legacy"


def table_exists(ns: str | None, table: str) -> bool:
    """Whether ip6tables' `table` exists in `ns` (nf_tables: an ip6 table of that name; listing it must not
    create it)."""
    return netns.succeeds(["nft", "list", "table", "ip6", table], ns)


def snapshot(ns: str | None, tables) -> dict[str, str | None]:
    """Each table as ip6tables-save writes it, None for one that does not exist: what `give_back` puts back."""
    return {t: netns.run(["ip6tables-save", "-t", t], ns) if table_exists(ns, t) else None for t in tables}


def give_back(ns: str | None, snap: dict[str, str | None]) -> None:
    """The tables as `snapshot` found them: restored whole, or deleted if they did not exist."""
    text = "".join(v for v in snap.values() if v)
    if text:
        netns.run(["ip6tables-restore", "-w"], ns, input=text)
    for t, v in snap.items():
        if v is None and table_exists(ns, t):
            netns.run(["nft", "delete", "table", "ip6", t], ns)


def load(ns: str | None, policy: V6Policy) -> None:
    """The policy into ip6tables of `ns`: the tables it names replaced whole, in one ip6tables-restore (atomic per
    call: nf_tables commits the whole input as one transaction)."""
    netns.run(["ip6tables-restore", "-w"], ns, input=policy.text)


# ---- stage 2: the IPv6 plan's interval chains in ip6tables (docs/ipv6.md "### Interval chains in ip6tables") ------

# Every strategy is written for the IPv6 side as for the IPv4 side: strategy tree's trees cut the ranks of their own
# run's 128-bit addresses and are written back as ip6tables tests (analysis.trees, docs/ipv6.md).
STRATEGY6: dict[str, str] = {}


@dataclass(frozen=True)
class Chains6:
    """The tool's chains for the IPv6 plan: ip6tables-restore text (table filter, the tool's chains only, as the
    IPv4 writer renders them), the entry chain, the strategy they were written for and the k added to the plan's."""

    text: str
    main: str
    strategy: str
    k_base: int

    def state(self) -> dict:
        return {"main": self.main, "strategy": self.strategy, "k_base": self.k_base}


def render_chains(plan6, config, prefix: str, gen: int | None = None) -> Chains6:
    """The IPv6 plan's chains through the one iptables writer (netfilter.restore, analysis.program), with the
    family's only differences: the IPv6 plan's k numbered after the IPv4 plan's (`plan6.k_base`), the filter table
    (the IPv6 policy's); strategy tree's trees over 128-bit addresses (analysis.trees). The policy rules in them
    are the file's own tokens (the ranked plan keeps each rule's levels), so they carry the real IPv6 addresses.
    `gen` (a follow): every chain but MAIN named `<prefix><gen>_…`, apart from the chains an earlier write left in
    ip6tables, which the follow may keep (docs/optimize.md "What a follow loads"); MAIN keeps its name (the base
    chain's jump names it) and is rewritten in place."""
    from hypafilter.netfilter.restore import to_iptables_restore

    strategy = STRATEGY6.get(config.strategy, config.strategy)
    kb = int(getattr(plan6, "k_base", 0))
    names = f"{prefix}{gen}_" if gen else prefix
    text = to_iptables_restore(
        plan6,
        strategy,
        names,
        config.mark_mask,
        config.mark_shift,
        table="filter",
        nic_mode=config.nic_mode,
        k_base=kb,
    )
    if gen:
        text = re.sub(rf"{re.escape(names)}MAIN\b", f"{prefix}MAIN", text)
    return Chains6(text, f"{prefix}MAIN", strategy, kb)


def body_lines(chains: Chains6) -> list[str]:
    """The restore lines of the tool's chains (declarations and rules, no table or COMMIT line)."""
    return [ln for ln in chains.text.splitlines() if ln.strip() and not ln.startswith(("*", "COMMIT", "#"))]


def with_chains(policy: V6Policy, chains: Chains6) -> str:
    """The ip6tables-restore text a deploy loads: the policy's file as it is, its filter table with the tool's chains
    declared first, their rules after the policy's own, and the base chain's jump to MAIN inserted first (`-I base 1`),
    the IPv4 live ruleset's form (ops.ruleset.live_text). One restore: nf_tables commits it whole."""
    body = body_lines(chains)
    decls = [ln for ln in body if ln.startswith(":")]
    rules = [ln for ln in body if not ln.startswith(":")]
    ours = {ln[1:].split()[0] for ln in decls}
    out: list[str] = []
    table = None
    done = False
    for lineno, raw in enumerate(policy.text.splitlines(), 1):
        line = raw.strip()
        if line.startswith("*"):
            table = line[1:].strip()
        if table == "filter" and line.startswith(":") and line[1:].split()[0] in ours:
            raise PolicyError(
                f"chain {line[1:].split()[0]} is the tool's (chain_prefix {chains.main[:-4]!r}): rename it",
                policy.source,
                lineno,
                2,
            )
        if table == "filter" and line == "COMMIT" and not done:
            out += [*rules, f"-I {policy.base_chain} 1 -j {chains.main}"]
            done = True
            table = None
        out.append(raw)
        if line == "*filter":
            out += decls
    if not done:
        raise PolicyError("no *filter table: the IPv6 chains go in ip6tables' filter table", policy.source, 1, 1)
    return "\n".join(out) + "\n"


def chains_text(chains: Chains6, base: str, listing: str, keep=()) -> str:
    """The ip6tables-restore --noflush text a follow of ip6tables loads (docs/ipv6.md "Following ip6tables"): the
    tool's chains replaced by `chains` (declared: created, or flushed if they exist), the tool's chains of the filter
    table `listing` (ip6tables-save of it now) that neither `chains` nor `keep` (the chains kept from an earlier
    write: ops.ruleset.reuse_chains) names removed, and the base chain's jump to MAIN moved first again (an
    operator's `-I base 1` put a rule before it). The operator's rules and chains are not touched. One restore:
    nf_tables commits it whole."""
    body = body_lines(chains)
    decls = [ln for ln in body if ln.startswith(":")]
    ours = {ln[1:].split()[0] for ln in decls} | set(keep)
    prefix = chains.main[: -len("MAIN")]
    had = [ln[1:].split()[0] for ln in listing.splitlines() if ln.startswith(f":{prefix}")]
    stale = [c for c in had if c not in ours]
    jump = f"-A {base} -j {chains.main}" in listing.splitlines()
    return "\n".join(
        [
            "*filter",
            *decls,
            *(f"-F {c}" for c in stale),
            *(f"-X {c}" for c in stale),
            *(ln for ln in body if not ln.startswith(":")),
            *([f"-D {base} -j {chains.main}"] if jump else []),
            f"-I {base} 1 -j {chains.main}",
            "COMMIT",
            "",
        ]
    )


def load_chains(ns: str | None, chains: Chains6, base: str, listing: str | None = None, keep=()) -> None:
    """`chains` into ip6tables of `ns` in place of the tool's chains there but `keep` (`chains_text`: one restore,
    --noflush). `listing`: ip6tables-save of the filter table, if already read."""
    if listing is None:
        listing = netns.run(["ip6tables-save", "-t", "filter"], ns)
    netns.run(["ip6tables-restore", "-w", "--noflush"], ns, input=chains_text(chains, base, listing, keep))


def load_text(ns: str | None, text: str, gone: dict[str, str | None] | None = None) -> None:
    """An ip6tables-restore text (`with_chains`) into `ns`, in one restore. `gone`: tables the text does not name
    that go back to what `snapshot` found (a text: restored whole in the same restore; None: deleted after it)."""
    gone = gone or {}
    netns.run(["ip6tables-restore", "-w"], ns, input=text + "".join(v for v in gone.values() if v))
    for t, v in gone.items():
        if v is None and table_exists(ns, t):
            netns.run(["nft", "delete", "table", "ip6", t], ns)


def _normal(text: str) -> list[str]:
    out = []
    for ln in text.splitlines():
        if not ln or ln.startswith("#"):
            continue
        if ln.startswith(":"):
            ln = ln.rsplit(" [", 1)[0]
        out.append(re.sub(r"^\[\d+:\d+\] ", "", ln))
    return out


def fingerprint(ns: str | None, tables) -> str:
    """SHA-256 of the tables as the kernel lists them (no counters): a rule changed by hand changes it."""
    lines = []
    for t in tables:
        if table_exists(ns, t):
            lines += _normal(netns.run(["ip6tables-save", "-t", t], ns))
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()


def tool_prefix(six: dict) -> str | None:
    """The prefix of the tool's chains in ip6tables (`HFv6_`: docs/ipv6.md "Interval chains in ip6tables") when the
    deployment wrote the IPv6 plan's interval chains there (the state's `ipv6.chains`), else None."""
    main = (six.get("chains") or {}).get("main") or ""
    return main[: -len("MAIN")] if main.endswith("MAIN") else None


def strip6(text: str, prefix: str | None) -> str:
    """A listing without the tool's chains (`prefix...` in the filter table) and the base chain's jump to their MAIN:
    the operator's part, which is the IPv6 policy (as ops.policysync.live.strip_tool for iptables)."""
    if not prefix:
        return text
    own = re.compile(rf"^(:|-A ){re.escape(prefix)}")
    jump = re.compile(rf"^-A \S+ -j {re.escape(prefix)}MAIN$")
    out, table = [], None
    for ln in text.splitlines():
        if ln.startswith("*"):
            table = ln[1:].strip()
        if table == "filter" and (own.match(ln) or jump.match(ln)):
            continue
        out.append(ln)
    return "\n".join(out) + "\n" if out else ""


def digest6(text: str) -> str:
    """SHA-256 of a listing as the policy reads it (no comments, no counters)."""
    return hashlib.sha256("\n".join(_normal(text)).encode()).hexdigest()


def counts(ns: str | None, table: str = "filter") -> dict[str, int]:
    """Rules per chain of ip6tables' `table` in `ns` as the kernel holds them (empty: no such table)."""
    if not table_exists(ns, table):
        return {}
    out: dict[str, int] = {}
    for ln in netns.run(["ip6tables-save", "-t", table], ns).splitlines():
        if ln.startswith(":"):
            out.setdefault(ln[1:].split()[0], 0)
        elif ln.startswith("-A "):
            c = ln.split()[1]
            out[c] = out.get(c, 0) + 1
    return out


# ---- what verify aims at ----------------------------------------------------------------------------------------


@dataclass
class Aims:
    """The networks, protocols, ports and ICMPv6 types an IPv6 policy's rules name (for verify's frames)."""

    nets: list[ipaddress.IPv6Network] = field(default_factory=list)
    ports: list[int] = field(default_factory=list)
    protos: list[int] = field(default_factory=list)
    icmp: list[tuple[int, int]] = field(default_factory=list)


PROTO_NAMES = {"tcp": 6, "udp": 17, "icmpv6": 58, "ipv6-icmp": 58, "icmp6": 58, "sctp": 132, "esp": 50, "ah": 51}
ICMP6_NAMES = {
    "destination-unreachable": (1, -1),
    "no-route": (1, 0),
    "communication-prohibited": (1, 1),
    "address-unreachable": (1, 3),
    "port-unreachable": (1, 4),
    "packet-too-big": (2, -1),
    "time-exceeded": (3, -1),
    "ttl-exceeded": (3, -1),
    "parameter-problem": (4, -1),
    "echo-request": (128, -1),
    "echo-reply": (129, -1),
    "router-solicitation": (133, -1),
    "router-advertisement": (134, -1),
    "neighbour-solicitation": (135, -1),
    "neighbor-solicitation": (135, -1),
    "neighbour-advertisement": (136, -1),
    "neighbor-advertisement": (136, -1),
    "redirect": (137, -1),
}


def _net(text: str) -> list[ipaddress.IPv6Network]:
    out = []
    for part in text.split(","):
        try:
            out.append(ipaddress.IPv6Network(part.lstrip("!"), strict=False))
        except ValueError:
            continue
    return out


def aims(policy: V6Policy) -> Aims:
    a = Aims()
    for ln in policy.text.splitlines():
        if not ln.startswith(("-A ", "-I ")):
            continue
        try:
            toks = shlex.split(ln)
        except ValueError:
            continue
        for i, t in enumerate(toks[:-1]):
            v = toks[i + 1]
            if t in ("-s", "-d", "--source", "--destination", "--src-range", "--dst-range"):
                if "-" in v and "range" in t:
                    lo, _, hi = v.partition("-")
                    a.nets += _net(lo) + _net(hi)
                else:
                    a.nets += _net(v)
            elif t in ("--dport", "--sport", "--dports", "--sports", "--destination-port", "--source-port"):
                for p in re.split(r"[,:]", v):
                    if p.isdigit():
                        a.ports.append(int(p))
            elif t in ("-p", "--protocol"):
                p = v.lstrip("!").lower()
                if p.isdigit():
                    a.protos.append(int(p))
                elif p in PROTO_NAMES:
                    a.protos.append(PROTO_NAMES[p])
            elif t == "--icmpv6-type":
                v = v.lstrip("!")
                if v in ICMP6_NAMES:
                    a.icmp.append(ICMP6_NAMES[v])
                else:
                    ty, _, code = v.partition("/")
                    if ty.isdigit():
                        a.icmp.append((int(ty), int(code) if code.isdigit() else -1))
    for ln in policy.sets_text.splitlines():  # the elements of the sets the policy reads: nets, ports, ICMPv6 types
        parts = ln.split()
        if len(parts) >= 3 and parts[0] == "add":
            elem = parts[2].split(",")
            a.nets += _net(elem[0])
            for part in elem[1:] if len(elem) > 1 else elem if elem[0].isdigit() else ():  # hash:*,port; bitmap:port
                proto, _, port = part.rpartition(":")
                if proto in ("ipv6-icmp", "icmpv6", "58"):
                    ty, _, code = port.partition("/")
                    if port in ICMP6_NAMES or port in ipset.ICMPV6_NAMES:
                        a.icmp.append(ICMP6_NAMES.get(port) or ipset.ICMPV6_NAMES[port])
                    elif ty.isdigit():
                        a.icmp.append((int(ty), int(code) if code.isdigit() else -1))
                elif port.isdigit():
                    a.ports.append(int(port))
                    if proto in PROTO_NAMES:
                        a.protos.append(PROTO_NAMES[proto])
    a.nets = list(dict.fromkeys(a.nets))
    a.ports = sorted(set(a.ports))
    a.protos = sorted(set(a.protos))
    a.icmp = list(dict.fromkeys(a.icmp))
    return a
