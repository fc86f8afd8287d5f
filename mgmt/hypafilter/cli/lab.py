"""`hypafilter lab up|down|status`: the reference network-namespace topology (see hypafilter.lab)."""

from __future__ import annotations

import argparse
import json
import os
import sys


def register(sub) -> None:
    p = sub.add_parser("lab", help="create, remove or show the reference namespace topology")
    p.add_argument("action", choices=("up", "down", "status"))
    p.add_argument(
        "--name",
        default=os.environ.get("HF_LAB", "hf"),
        help="lab name: namespaces are NAME-send, NAME-nic, ... (default $HF_LAB, else hf; deploy uses the same)",
    )
    p.add_argument(
        "--target", choices=("emu", "xdp"), help="topology for this target (default: the existing lab's, else emu)"
    )
    p.add_argument("--json", action="store_true", help="status as JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from hypafilter.ops.lab import ROLES, Lab

    lab = Lab(args.name, target=args.target or Lab(args.name).built_for() or "emu")
    if args.action == "up":
        lab.up()
        print(f"lab {args.name}: up ({', '.join(lab.ns(r) for r in ROLES)})")
        return 0
    if args.action == "down":
        from hypafilter.ops import deploy

        removed = deploy.lab_down(lab, lambda s: print(f"lab {args.name}: {s}", file=sys.stderr))
        print(f"lab {args.name}: removed {', '.join(removed)}" if removed else f"lab {args.name}: nothing to remove")
        return 0
    st = lab.status()
    if args.json:
        print(json.dumps(st, indent=2))
    else:
        print(f"lab {args.name}: {'complete' if st['complete'] else 'incomplete or absent'}")
        for ns, links in st["namespaces"].items():
            print(f"  {ns}")
            for ifname, info in links.items():
                addrs = " ".join(info["ipv4"])
                master = f" master {info['master']}" if info["master"] else ""
                print(f"    {ifname:8} {info['state']:8} mtu {info['mtu']}{master} {addrs}".rstrip())
    return 0 if st["complete"] else 1
