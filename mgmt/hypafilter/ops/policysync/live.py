"""The live ruleset as the policy: the firewall namespace's table as iptables-save lists it, consistent with one
nf_tables generation, without the tool's own chains and jump, parsed as a Policy of the deployed base chain."""

from __future__ import annotations

import hashlib
import re

from hypafilter import netns
from hypafilter.config import Config
from hypafilter.errors import HypafilterError
from hypafilter.ir import Policy
from hypafilter.netfilter.bridge import TABLE as BRIDGE_TABLE
from hypafilter.ops.lab import HOST_TABLE
from hypafilter.ops.policysync.nftevents import NfTables

SNAPSHOT_TRIES = 5  # listings taken while the generation moved, before the service gives up for this round


def backend(ns: str | None) -> str:
    """'nf_tables' or 'legacy': which backend `iptables` writes. Legacy xtables sends no change events, so a
    deployment there cannot follow the live ruleset (deploy refuses it: docs/deploy.md, "Live policy")."""
    out = netns.run(["iptables", "-V"], ns)
    return "nf_tables" if "nf_tables" in out else "legacy"


def strip_tool(text: str, prefix: str) -> str:
    """An iptables-save listing without the tool's chains (`prefix<gen>_...`) and the base chain's jumps to them."""
    own = re.compile(rf"^(:|-A ){re.escape(prefix)}\d+_")
    jump = re.compile(rf"^-A \S+ -j {re.escape(prefix)}\d+_MAIN$")
    return "\n".join(ln for ln in text.splitlines() if not own.match(ln) and not jump.match(ln)) + "\n"


# The hooks a NIC frame meets before the deployed chain decides it, per NIC mode: a base chain of another table there
# filters frames the fast path decides without it.
HOOKS = {"bridge": ("prerouting", "forward"), "host": ("prerouting", "input")}


def foreign_chains(ns: str | None, table: str, nic_mode: str) -> list[str]:
    """Base chains of nftables tables other than iptables' own `table` (and the tool's and the lab's tables) that
    filter at the hooks a NIC frame meets (HOOKS), and every netdev-family chain (ingress or egress of a device, which
    sees the frames the kernel handles and not those the fast path forwards): firewalld's nftables backend, an `nft`
    table of the operator's, fail2ban's nftables actions, Docker's raw-table drops. The fast path decides frames
    without them, so a deployment refuses them and the policy sync service stops deciding (fail closed) while one
    exists. Read through nf_tables' netlink dump (no `nft` process)."""
    own = {("ip", table), ("bridge", BRIDGE_TABLE), ("inet", HOST_TABLE)}
    nft = NfTables(ns)
    try:
        chains = nft.base_chains()
    finally:
        nft.close()
    found = []
    for c in chains:
        if c.family == "netdev" or (
            c.family in ("ip", "inet", "bridge")
            and c.type == "filter"
            and c.hook in (*HOOKS[nic_mode], "ingress")
            and (c.family, c.table) not in own
        ):
            found.append(f"{c.family} {c.table} {c.name} (hook {c.hook}, priority {c.prio})")
    return found


def percentiles(xs) -> dict:
    """Count, p50, p99, max and last of a series (ms): how the service's status file gives its lags."""
    if not xs:
        return {"n": 0}
    s = sorted(xs)
    return {
        "n": len(s),
        "p50": round(s[len(s) // 2], 3),
        "p99": round(s[min(len(s) - 1, int(len(s) * 0.99))], 3),
        "max": round(s[-1], 3),
        "last": round(xs[-1], 3),
    }


def digest(text: str, prefix: str) -> str:
    """SHA-256 of a listing as the policy reads it: the tool's chains stripped, the chain counters and comment
    lines left out. Equal digests, equal live policies: a follow records the digest of the listing its policy was
    read from (`live_digest`), so the service need not parse that listing again."""
    lines = []
    for ln in strip_tool(text, prefix).splitlines():
        if ln.startswith("#"):
            continue
        if ln.startswith(":"):
            ln = ln.rsplit(" [", 1)[0]
        lines.append(ln)
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()


def followed(text: str, st: dict, config: Config) -> Policy:
    """The live policy of listing `text`, which the deployment `st` must be deciding by: the listing it recorded
    (`live_digest`: the deployed policy, however its file spelled it) or a policy with the deployed hash; else
    HypafilterError (the policy sync service has not applied it yet, or cannot)."""
    policy = live_policy(text, st, config)
    if digest(text, config.chain_prefix) != st.get("live_digest") and policy.policy_hash() != st.get("policy_hash"):
        raise HypafilterError(
            "the deployment has not followed the live ruleset (the policy sync service has not applied it yet)"
        )
    return policy


def listing(ns: str | None, table: str, generation) -> tuple[str, int]:
    """(iptables-save of `table`, the generation it shows): taken between two reads of the same generation
    (`generation()`), so no commit fell between; HypafilterError after SNAPSHOT_TRIES moving ones."""
    for _ in range(SNAPSHOT_TRIES):
        g0 = generation()
        text = netns.run(["iptables-save", "-t", table], ns)
        if generation() == g0:
            return text, g0
    raise HypafilterError(f"the ruleset kept changing while it was read ({SNAPSHOT_TRIES} tries)")


def live_policy(text: str, st: dict, config: Config) -> Policy:
    """The deployed base chain's policy as the live listing `text` has it (the tool's chains stripped)."""
    from hypafilter.iptables.document import parse_policy

    body = strip_tool(text, config.chain_prefix)
    return parse_policy(
        body,
        filename=f"live ruleset ({st['site'].get('netns') or 'this namespace'})",
        base_chain=st["base_chain"],
        config=config,
        allow_empty=True,
        sets=live_sets(st),
    )


def live_sets(st: dict):
    """The firewall's live ipsets as the front end reads them for the deployed target (docs/sets.md), read only if
    the policy has a set match."""
    from hypafilter.targets import live_set_env

    return live_set_env(st["site"].get("netns"), st.get("target", "emu"))
