"""`hypafilter dashboard`: serves live shunting statistics, a per-rule view, /api JSON and Prometheus /metrics."""

from __future__ import annotations

import argparse
import ipaddress
import sys

from hypafilter.errors import HypafilterError

DEFAULT_LISTEN = "127.0.0.1:8080"


def parse_listen(text: str) -> tuple[str, int]:
    """HOST:PORT (IPv6 in brackets: [::1]:8080) -> (host, port)."""
    host, sep, port = text.rpartition(":")
    if not sep or not host:
        raise HypafilterError(f"--listen {text!r}: expected HOST:PORT, e.g. {DEFAULT_LISTEN}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        raise HypafilterError(f"--listen {text!r}: write IPv6 addresses in brackets, e.g. [::1]:8080")
    try:
        p = int(port)
    except ValueError:
        p = -1
    if not 0 <= p <= 65535:
        raise HypafilterError(f"--listen {text!r}: port must be 0..65535")
    return host, p


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name could resolve anywhere: treat it as reachable from outside


def check_exposure(host: str, token: str | None) -> None:
    if not is_loopback(host) and not token:
        raise HypafilterError(
            f"listening on {host} (not loopback) needs a token: --token or HYPAFILTER_DASHBOARD_TOKEN; "
            "clients then send 'Authorization: Bearer <token>' (or ?token=)"
        )


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "dashboard",
        help="web dashboard: hardware vs shunted traffic, per-rule hits, /api and /metrics",
        description="Serve a read-only dashboard of the deployed system (page, /api/ JSON, Prometheus /metrics).",
    )
    p.add_argument("--listen", default=DEFAULT_LISTEN, metavar="HOST:PORT", help=f"default {DEFAULT_LISTEN}")
    p.add_argument(
        "--token",
        help="required when HOST is not loopback (default: $HYPAFILTER_DASHBOARD_TOKEN; the variable keeps it out of ps)",
    )
    p.add_argument("--interval", type=float, default=1.0, metavar="S", help="sampling interval in seconds (default 1)")
    p.add_argument("--keep", type=int, default=600, metavar="N", help="snapshots kept for the charts (default 600)")
    p.add_argument(
        "--rule-metrics",
        type=int,
        default=1000,
        metavar="N",
        help="export per-rule series in /metrics when the policy has at most N rules (default 1000; 0: never); "
        "/api/rules always pages through every rule",
    )
    p.add_argument("--state", metavar="FILE", help="deploy state file (default: the one `hypafilter deploy` writes)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from hypafilter.ops.deploy import read_state
    from hypafilter.tools.dashboard.collector import Collector, Sampler, env_token

    host, port = parse_listen(args.listen)
    token = args.token or env_token()
    check_exposure(host, token)
    if args.interval <= 0 or args.keep < 2:
        raise HypafilterError("--interval must be > 0 and --keep at least 2")

    import uvicorn

    from hypafilter.tools.dashboard.app import LOOPBACK_NAMES, create_app

    state_path = args.state
    collector = Collector(state_reader=lambda: read_state(state_path), rules_async=True)
    sampler = Sampler(collector, interval=args.interval, keep=args.keep)
    sampler.sample()
    sampler.start()
    shown = f"[{host}]" if ":" in host else host
    print(
        f"hypafilter dashboard on http://{shown}:{port}/ (read-only{', token required' if token else ''})",
        file=sys.stderr,
    )
    try:
        # On loopback without a token, only requests for this machine's own names are answered (DNS rebinding).
        allowed = None if token else LOOPBACK_NAMES | {host.lower()}
        app = create_app(sampler, token=token, allowed_hosts=allowed, rule_series_limit=args.rule_metrics)
        uvicorn.run(app, host=host, port=port, log_level="warning", access_log=False)
    finally:
        sampler.stop()
    return 0
