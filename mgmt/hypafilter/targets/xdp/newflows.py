"""Whether a conntrack miss in the xdp program may mean "NEW or INVALID" (ct 3) in a firewall namespace.

A frame that `bpf_xdp_ct_lookup` finds no entry for (it looks the frame's tuple up in the default zone's table, which
holds every confirmed connection under both its original and its reply tuple) is NEW or INVALID to the kernel unless
something makes it RELATED or UNTRACKED, or puts its connection in another zone: an expectation (created by a
conntrack helper, or by a program through ctnetlink), a helper assigned to connections (iptables' raw `-j CT
--helper`, nft `ct helper set`, or the old automatic assignment `net.netfilter.nf_conntrack_helper = 1`), a notrack
rule (`-j NOTRACK`, `-j CT --notrack`, nft `notrack`) or a zone (`-j CT --zone`, nft `ct zone set`). `why_not`
reads the namespace's configuration for any of these; the program gets HFX_CT_NONE only when it finds none and
could read everything. The policy sync service follows later changes with it (ops.policysync.newflows; docs/xdp.md
"Following the configuration").
"""

from __future__ import annotations

import re

from hypafilter import netns

# nft's listing (native rules, and iptables-nft's xt targets), iptables-save's (nft and legacy back ends)
NFT_SIGNS = re.compile(r'\bnotrack\b|\bct helper\b|\bct zone set\b|\bct expectation\b|xt target "?(CT|NOTRACK)\b')
IPT_SIGNS = re.compile(r"-j (CT|NOTRACK)\b")


def why_not(ns: str | None) -> str:
    """'' when nothing in namespace `ns` can make a frame without a conntrack entry RELATED or UNTRACKED (or look it
    up in another zone); else the first reason found, or what could not be read."""
    try:
        ruleset = netns.run(["nft", "list", "ruleset"], ns)
    except netns.CommandError as e:
        return f"nft list ruleset: {e}"
    m = NFT_SIGNS.search(ruleset)
    if m:
        return f"the ruleset has {m.group(0)!r} (a helper, notrack or zone)"
    for tool in ("iptables-save", "iptables-legacy-save"):
        try:
            text = netns.run([tool], ns, check=tool == "iptables-save")
        except netns.CommandError as e:
            if tool == "iptables-save":
                return f"{tool}: {e}"
            continue  # no legacy back end installed: no legacy tables either
        m = IPT_SIGNS.search(text)
        if m:
            return f"{tool} has {m.group(0)!r} (a helper, notrack or zone)"
    try:
        if netns.run(["sysctl", "-n", "net.netfilter.nf_conntrack_helper"], ns, check=False).strip() == "1":
            return "net.netfilter.nf_conntrack_helper = 1 (helpers assigned automatically)"
    except netns.CommandError:
        pass  # the sysctl is gone since Linux 6.0: no automatic assignment
    try:
        exp = netns.run(["conntrack", "-L", "expect"], ns)
    except netns.CommandError as e:
        return f"conntrack -L expect: {e}"
    if exp.strip():
        return f"conntrack holds {len(exp.strip().splitlines())} expectation(s)"
    return ""
