"""The IPv6 side of a deployment on the emulated NIC (docs/ipv6.md "## emu"): the dual-stack core decides the IPv6
frames it parses by the family-6 plan (`plan.plan6`, targets.xdp.v6.plan6_for with target "emu"); what deploy needs
beyond the IPv4 path is the shim's k of the IPv6 indices and whether the running core's IPv6 matcher is the plan's."""

from __future__ import annotations

from hypafilter.targets.nic import v6_matcher


def intervals(intervals4: list[int], plan6) -> list[int]:
    """The shim's interval table (hardware index -> k) of a dual-stack core: the IPv4 side's rows (`intervals4`: its
    entries, its policy entry and, for a View, the update buffer's slots), zeros up to V6_BASE = n4 + 1 + δ
    (`plan6.index_base`; slots a Plan does not fill: no enabled slot's index reaches the shim), then the IPv6 entries'
    and the IPv6 policy entry's k, numbered after the IPv4 plan's (`plan6.k_base`, as the chains in ip6tables are);
    all 0 for a verbatim plan (ip6tables holds the policy alone: every IPv6 frame the core passes runs it whole)."""
    rows = list(intervals4)
    base = int(plan6.index_base)
    if len(rows) > base:
        raise ValueError(f"the IPv4 side has {len(rows)} rows, the IPv6 entries start at {base}")
    rows += [0] * (base - len(rows))
    if getattr(plan6, "overlay", None) is not None:  # a View6: its rows' k offset already (align6's k_base)
        return rows + [int(k) for k in plan6.interval]
    kb = int(getattr(plan6, "k_base", 0) or 0)
    verbatim = bool(getattr(plan6, "verbatim", False))
    rows += [0 if verbatim or int(k) == 0 else int(k) + kb for k in plan6.interval]
    return rows


def view6(static6, master6, depth6: int):
    """The IPv6 side of a dual-stack deployment changed through the core's IPv6 update buffer (docs/ipv6.md "## emu"):
    analysis.overlay.align6's View of the new IPv6 plan `master6` over the core generated from the plan `static6`
    (its `depth6` slots, hw.vhdl.buffer6_depth), with what the deployment reads of an IPv6 plan: `static6` (the
    matcher's identity: hash, rows), index_base, k_base, verbatim and source6 of the new plan. Raises
    analysis.overlay.BufferFull when the change needs more slots."""
    from hypafilter.analysis.overlay import align6

    kb = int(getattr(master6, "k_base", 0) or 0)
    verbatim = bool(getattr(master6, "verbatim", False))
    v = align6(static6, master6, depth6, k_base=kb, verbatim=verbatim)
    v.static6 = static6
    v.family = 6
    v.index_base = static6.index_base
    v.k_base = kb
    v.verbatim = verbatim
    v.source6 = getattr(master6, "source6", None)
    v.k0_tree = bool(getattr(master6, "k0_tree", False))
    return v


def core_keeps_v6(tables: dict, plan6) -> bool:
    """Whether the running core (its tables as the last deploy wrote them) has exactly `plan6`'s IPv6 matcher (or, for
    `plan6` None, none): then an IPv4 change through the update buffer keeps the IPv6 side by register writes."""
    have = (tables.get("v6") or {}).get("matcher")
    if plan6 is None:
        return have is None
    return have == v6_matcher(plan6)


def deciding_rows(tables: dict) -> list[bool]:
    """Per IPv6 row of the core (its entries, then its policy entry), whether a parsed IPv6 frame that row matches is
    decided in hardware by the tables as written (`tables`: what NicClient.program returned): not shunted, a
    deciding action (ACCEPT or DROP, mirrored or not), not forced to the host by the IPv6 side's miss forcing
    (CONTROL bits 6/7), which reach only a frame the flow cache does not know (ct 0): a row no frame with ct 0 can
    match (`tables.v6.ct0`, e.g. an ESTABLISHED row) is never forced, a row that some can is counted as forced (its
    frames of known flows are decided too, so this is a lower bound). For counting verify's IPv6 frames decided on
    the NIC (HITS of those rows); the verdicts themselves are compared with the kernel's."""
    v6 = tables.get("v6") or {}
    if not v6:
        return []
    base, n = int(v6["index_base"]), int(v6["entries"]) + 1
    words, actions = tables["shunt"], tables["actions"]
    accept, drop = (tables.get("miss_shunt6") or [False, False])[:2]
    ct0 = v6.get("ct0") or [True] * n  # a state without it: every row may meet ct 0
    out = []
    for i in range(base, base + n):
        a = int(actions[i]) & 0x7
        shunted = (int(words[i // 32]) >> (i % 32)) & 1
        forced = ((a == 1 and accept) or (a == 2 and drop)) and ct0[i - base]
        out.append(not shunted and a in (1, 2) and not forced)
    return out


def hits6(client, tables: dict) -> list[int]:
    """HITS of the core's IPv6 rows (entries, then the IPv6 policy entry); [] for a core without them."""
    v6 = tables.get("v6") or {}
    if not v6:
        return []
    return client.read_table_many("HITS", int(v6["index_base"]), int(v6["entries"]) + 1)
