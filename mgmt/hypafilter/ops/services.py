"""The deployment's services (SERVICES, each an ops.daemon.Service): started after deploy's commit when the
deployment wants them, stopped by every later deploy and by undeploy, drift when wanted and not running, shown by
status. Each service says itself whether it runs for a deployment and why not, how it runs and what its absence
leaves undone; the state file keeps a record of each under its name: {wanted, reason, pid, ...how it runs}."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path

from hypafilter.errors import HypafilterError
from hypafilter.ops.daemon import Service
from hypafilter.ops.flowsync.service import SERVICE as FLOWSYNC
from hypafilter.ops.policysync.service import SERVICE as POLICYSYNC
from hypafilter.ops.transaction import FAIL_ENV

SERVICES: tuple[Service, ...] = (FLOWSYNC, POLICYSYNC)


def start_wanted(
    ns: str | None,
    state_dir: Path,
    policy,
    plan,
    tgt,
    nic: dict,
    warnings: list[str],
    log: Callable[[str], None],
    services: Sequence[Service] = SERVICES,
    only: Sequence[str] | None = None,
) -> dict[str, dict]:
    """Start each service the deployment wants (`only`: of these names); its record, by name, says why not when it
    does not run. It runs after the commit: a service that fails to start is not a rollback (the policy holds
    without it; what it adds is fast-path share) but a warning, drift, and a degraded deployment (`failed`), for
    which deploy exits non-zero. FAIL_ENV=service-NAME (the tests' failure injection) makes NAME's start fail."""
    out = {}
    for svc in services:
        if only is not None and svc.name not in only:
            continue
        reason, how = svc.why_not(policy, plan, tgt, nic), svc.record(tgt)
        if reason:
            out[svc.name] = {"wanted": False, **how, "reason": reason}
            continue
        try:
            if os.environ.get(FAIL_ENV) == f"service-{svc.name}":
                raise HypafilterError(f"injected failure ({FAIL_ENV}=service-{svc.name})")
            pid = svc.launch(ns, state_dir, tgt)
        except (OSError, HypafilterError) as e:
            warnings.append(f"starting {svc.title}: {e}")
            out[svc.name] = {"wanted": True, **how, "pid": None, "reason": f"failed to start: {e}"}
            continue
        log(f"{svc.noun} running (pid {pid}" + "".join(f", {k} {v}" for k, v in how.items()) + ")")
        out[svc.name] = {"wanted": True, **how, "pid": pid, "reason": ""}
    return out


def stop_all(
    state_dir: Path, services: Sequence[Service] = SERVICES, only: Sequence[str] | None = None
) -> list[tuple[Service, Exception]]:
    """Stop every service that runs (`only`: of these names); the ones that could not be stopped, with why."""
    errors: list[tuple[Service, Exception]] = []
    for svc in services:
        if only is not None and svc.name not in only:
            continue
        try:
            svc.stop(state_dir)
        except (OSError, HypafilterError) as e:
            errors.append((svc, e))
    return errors


def drift(st: dict, state_dir: Path, tgt, services: Sequence[Service] = SERVICES) -> list[str]:
    """The services the deployment in `st` (on target `tgt`) wants that do not serve: not running, or running with
    their worker restarting or not started yet (`Service.not_serving`), and what the running ones report."""
    out = []
    for svc in services:
        if not (st.get(svc.name) or {}).get("wanted"):
            continue
        if why := svc.not_serving(state_dir):
            out.append(f"{svc.name}: {svc.title} {why} ({svc.down(tgt)})")
        else:
            out += svc.problems(state_dir)
    return out


def failed(records: dict[str, dict]) -> list[str]:
    """Of the services' records (`start_wanted`), the ones wanted that did not start, each as "NAME: why": a
    deployment with any is degraded (deploy exits non-zero; docs/deploy.md)."""
    return [f"{name}: {r.get('reason')}" for name, r in records.items() if r.get("wanted") and not r.get("pid")]


def status(st: dict, state_dir: Path, services: Sequence[Service] = SERVICES) -> dict[str, dict]:
    """Each service as `status` shows it, by name: wanted (from the deployment's record), running, its counters."""
    return {svc.name: svc.status(state_dir, st.get(svc.name)) for svc in services}
