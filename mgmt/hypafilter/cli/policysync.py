"""`hypafilter policysync run|status`: the policy sync service (started by deploy, stopped by undeploy) and its
state: it follows the firewall's live ruleset (docs/deploy.md, "Live policy")."""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def cmd_run(args: argparse.Namespace) -> int:
    from hypafilter.ops.policysync import worker

    return worker.supervise(args.ns, Path(args.state_dir))


def cmd_status(args: argparse.Namespace) -> int:
    from hypafilter.ops import deploy
    from hypafilter.ops.policysync.service import SERVICE

    st = deploy.read_state() or {}
    print(json.dumps(SERVICE.status(deploy.STATE_DIR, st.get("policysync")), indent=1, default=str))
    return 0


def register(sub) -> None:
    p = sub.add_parser("policysync", help="the policy sync service: the live ruleset -> the fast path")
    s = p.add_subparsers(dest="policysync_command", metavar="SUBCOMMAND")
    s.required = True
    r = s.add_parser("run", help="run the service in the foreground (deploy starts it)")
    r.add_argument("--ns", required=True, help="the firewall's network namespace")
    r.add_argument("--state-dir", required=True, help="the deployment's state directory (state.json)")
    r.set_defaults(func=cmd_run)
    q = s.add_parser("status", help="the service's state and counters (JSON)")
    q.set_defaults(func=cmd_status)
