"""What the flow sync service reads from the deployment: whether the policy's hardware entries decide frames by
their conntrack state (`decides_established`: the service is wanted at all), and the conntrack timeouts a refresh
sets (`read_timeouts`, from the firewall namespace's sysctls)."""

from __future__ import annotations

from hypafilter import netns

# The conntrack timeouts a refresh sets, read from these sysctls of the firewall namespace (seconds).
TIMEOUT_SYSCTLS = {
    "tcp": "net.netfilter.nf_conntrack_tcp_timeout_established",
    "tcp_fin_wait": "net.netfilter.nf_conntrack_tcp_timeout_fin_wait",
    "tcp_close_wait": "net.netfilter.nf_conntrack_tcp_timeout_close_wait",
    "tcp_time_wait": "net.netfilter.nf_conntrack_tcp_timeout_time_wait",
    "udp": "net.netfilter.nf_conntrack_udp_timeout",
    "udp_stream": "net.netfilter.nf_conntrack_udp_timeout_stream",
}


def read_timeouts(ns: str | None) -> dict[str, int]:
    return {k: int(netns.run(["sysctl", "-n", key], ns).strip()) for k, key in TIMEOUT_SYSCTLS.items()}


def decides_established(policy, plan) -> bool:
    """Whether the policy's hardware entries can decide a frame by its flow-cache state, so that the flow cache
    matters: the plan's own answer if it has one (`decides_established`); else, once the IR has the `ct` field,
    whether some hardware entry's box does not span every ct value (it reads the flow cache); else (an IR without
    it) whether the policy reads conntrack."""
    own = getattr(plan, "decides_established", None)
    if own is not None:
        return bool(own)
    from hypafilter.ir import box

    ct = box.FIELD_INDEX.get("ct")
    if ct is not None:
        top = box.MAXV[ct]
        return any(b.lo[ct] != 0 or b.hi[ct] != top for e in plan.entries for b in e.boxes)
    return bool(getattr(policy, "reads_conntrack", False))
