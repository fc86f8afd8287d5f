"""The policy sync service's place among the deployment's services (ops.services, on the generic ops.daemon.Service):
wanted by every deployment, its files policysync.{pid,json,log}, and what `status` makes of its state. The worker
that follows the ruleset is ops.policysync.worker."""

from __future__ import annotations

from pathlib import Path

from hypafilter.ops.daemon import READY_TIMEOUT, Service


class PolicySync(Service):
    """The policy sync service: every deployment wants it (the live ruleset is the policy); deploy refuses a
    firewall whose iptables is legacy xtables, which sends no change events."""

    def why_not(self, policy, plan, tgt, nic: dict) -> str:
        return ""

    def record(self, tgt) -> dict:
        return {}

    def launch(self, ns: str | None, state_dir: Path, tgt) -> int:
        return self.start(ns, state_dir, [], READY_TIMEOUT)

    def down(self, tgt) -> str:
        return (
            "changes to the live ruleset are not followed: the fast path decides by the deployed policy until its "
            "policy sync lease runs out (for good without one: policysync_lease_ms = 0)"
        )

    def problems(self, state_dir: Path) -> list[str]:
        """What makes the running service not vouch for the fast path: a change it could not apply (then the fast
        path shunts everything, fail closed, until it can)."""
        doc = self.read_status_file(state_dir) or {}
        out = []
        if doc.get("running") and doc.get("error"):
            out.append(f"{self.name}: cannot follow the live ruleset ({doc['error']}); the fast path shunts everything")
        six = doc.get("ipv6") or {}
        if doc.get("running") and six.get("error"):
            out.append(f"{self.name}: cannot follow ip6tables ({six['error']}); every IPv6 frame goes to ip6tables")
        return out


SERVICE = PolicySync("policysync", "policy sync service")
