"""`hypafilter flowsync run|status`: the flow sync service (started by deploy, stopped by undeploy) and its state."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from hypafilter.errors import HypafilterError


def cmd_run(args: argparse.Namespace) -> int:
    from hypafilter.ops import deploy
    from hypafilter.ops.flowsync import service

    state_dir = Path(args.state_dir)
    deploy.configure(state_dir=state_dir)
    st = deploy.read_state()
    if not st or not st.get("nic"):
        raise HypafilterError(f"{deploy.state_file()}: nothing deployed, no NIC to synchronise")
    tgt, nic = deploy.target_of(st, deploy.state_config(st)), st["nic"]
    open_table = service.table_opener(args.mode, tgt, nic)
    return service.supervise(
        args.ns, open_table, state_dir, args.interval, nic=nic.get("name", ""), members=args.members
    )


def cmd_status(args: argparse.Namespace) -> int:
    from hypafilter.ops import deploy
    from hypafilter.ops.flowsync.service import SERVICE

    st = deploy.read_state() or {}
    print(json.dumps(SERVICE.status(deploy.STATE_DIR, st.get("flowsync")), indent=1, default=str))
    return 0


def register(sub) -> None:
    p = sub.add_parser("flowsync", help="the flow sync service: conntrack -> the NIC's flow cache (docs/flowsync.md)")
    s = p.add_subparsers(dest="flowsync_command", metavar="SUBCOMMAND")
    s.required = True
    r = s.add_parser("run", help="run the service in the foreground (deploy starts it)")
    r.add_argument("--ns", required=True, help="the firewall's network namespace")
    r.add_argument("--state-dir", required=True, help="the deployment's state directory (state.json)")
    r.add_argument("--interval", type=float, default=1.0, help="seconds between hardware polls (default 1)")
    r.add_argument(
        "--mode",
        choices=("flowcache", "liberal"),
        default="flowcache",
        help="flowcache: the NIC's flow cache follows conntrack; liberal (the xdp target): only mark the TCP entries "
        "it would offload liberal (default flowcache)",
    )
    r.add_argument(
        "--members",
        action="store_true",
        help="also keep the NIC's conntrack membership structure complete (its misses are then NEW: ct 3)",
    )
    r.set_defaults(func=cmd_run)
    q = s.add_parser("status", help="the service's state and counters (JSON)")
    q.set_defaults(func=cmd_status)
