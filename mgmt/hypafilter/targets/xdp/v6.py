"""The IPv6 side of an xdp deployment (docs/ipv6.md "## xdp"): the family-6 plan whose table set the program decides
IPv6 frames by, or why IPv6 frames stay unparsed (stage 1: every one to ip6tables with k = 0)."""

from __future__ import annotations


def plan6_for(
    v6, config, plan4, k_base: int | None = None, verbatim: bool = False, target: str = "xdp", sets=None
) -> tuple[object | None, str]:
    """(family-6 Plan, "") for the deployment's IPv6 side `v6` (netfilter.ip6.V6Policy) beside the IPv4 `plan4`, or
    (None, why not). The plan's hardware indices follow the IPv4 side's (index_base n4 + 1 + the update buffer's
    slots, which XdpTarget.program sets from the running program) and its interval numbers the IPv4 plan's largest k
    (`k_base`, default `plan4.num_intervals`): ip6tables holds the IPv6 policy live with the plan's interval chains
    and the mark give-back before it (netfilter.ip6.render_chains, with_chains), so a shunted IPv6 frame carries its
    k and runs its interval's rules only. Built for the live ruleset (`live`, as the IPv4 plan of a deployment).
    `verbatim`: ip6tables holds the policy alone (no interval chains): every k is 0 and every IPv6 frame passed to
    software has value 0, the whole policy decides it (stage 1's form). `target`: "xdp", or "emu" (the emulated NIC's
    dual-stack core, docs/ipv6.md "## emu": switched by `emu_ipv6`; its index base is the core's V6_BASE, the same
    n4 + 1 + δ)."""
    from hypafilter.analysis.plan import build_plan

    switch = f"{target}_ipv6"
    if not getattr(config, switch, False):
        return None, f"{switch} is off in the configuration"
    if v6 is None or getattr(v6, "kind", "policy") != "policy":
        return None, "no IPv6 policy (ip6tables as the operator has it, or --ipv6-default drop)"
    if tuple(v6.tables) != ("filter",):
        return None, f"the IPv6 policy has tables besides filter ({', '.join(v6.tables)}): decided by ip6tables"
    ir = getattr(v6, "ir", None)
    if ir is None:  # the IPv6 side as the state keeps it (update, the policy sync service): read its text again
        from hypafilter.errors import HypafilterError
        from hypafilter.iptables.document import parse_policy

        try:
            ir = parse_policy(v6.text, v6.source, base_chain=v6.base_chain, config=config, family=6, sets=sets)
        except HypafilterError as e:
            return None, f"the IPv6 policy as deployed does not read again: {e}"
    if getattr(ir, "set_slots", ()):
        from hypafilter.targets import set_capability6

        if not set_capability6(target):  # (the front end keeps them complex there: never met)
            return None, f"the IPv6 policy's set matches are set slots: target {target} has no IPv6 set slots"
    plan6 = build_plan(ir, config, live=True)
    plan6.index_base = len(plan4.entries) + 1 + config.update_buffer
    plan6.k_base = int(plan4.num_intervals if k_base is None else k_base)
    plan6.verbatim = bool(verbatim)
    # the IPv6 policy the plan was built from: what the state keeps of the table set a program holds (the static
    # entries of its IPv6 update buffer, docs/ipv6.md "The update buffer for IPv6")
    plan6.source6 = {"text": v6.text, "source": v6.source, "base_chain": v6.base_chain}
    # strategy tree, live: the IPv6 side's k = 0 frames the xdp program passes unparsed walk HFv6_K0T, as the IPv4
    # side's walk K0T (docs/optimize.md); the emulated NIC's shim marks IPv4 frames only
    plan6.k0_tree = target == "xdp" and bool(getattr(plan4, "k0_tree", False))
    return plan6, ""


def buffer_keeps_v6(old_nic: dict, plan4, v6_changed: bool) -> bool:
    """Whether an IPv4 change through the update buffer (the running program, its tables but the overlay unchanged)
    leaves the IPv6 side right: the running program has an IPv6 table set exactly when the new plan has one, the
    IPv6 policy did not change, and the new IPv6 plan's tables fit the running program's IPv6 table set (the
    overlay's write rewrites them): the same IPv6 policy planned in another shunting mode has other entries (exact
    mode's reductions), which may not fit (found by the fuzzer: the deploy was refused at `registers`)."""
    import json
    from pathlib import Path

    from hypafilter.targets.xdp.tables import build_tables6, fits6

    plan6 = getattr(plan4, "plan6", None)
    try:
        shape = json.loads(Path(old_nic.get("binary", "")).with_name("shape.json").read_text())
    except (OSError, ValueError):
        return plan6 is None and not v6_changed
    has = bool(shape.get("v6"))
    if has != (plan6 is not None) or (has and v6_changed):
        return False
    return not has or fits6(build_tables6(plan6), shape["v6"])
