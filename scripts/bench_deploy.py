#!/usr/bin/env python3
"""Measures deploy time (cold and cached build), update latency and packets per second through the hybrid path.

Usage (root, from the repo root): .venv/bin/python scripts/bench_deploy.py [--rules N] [--frames N] [--lab NAME]
Prints one line per figure with the command that produced it. Runs in a lab of its own (default `hfb`), removed
at the end; the cold build goes to a fresh build directory so that it really is cold.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "mgmt"))

from hypafilter.config import Config  # noqa: E402
from hypafilter.iptables.document import parse_policy  # noqa: E402
from hypafilter.ops import deploy  # noqa: E402
from hypafilter.ops.lab import Lab  # noqa: E402
from hypafilter.ops.verify import collect, drain, raw_socket  # noqa: E402
from hypafilter.tools.classbench import classbench_policy_text  # noqa: E402

CMD = "sudo .venv/bin/python " + " ".join(sys.argv)


def cb_policy(n: int, k: int, tmp: Path, shared: Path, insert_complex_at: int | None = None):
    """The first n rules of acl1_1100 with k complex ones; insert_complex_at: also a copy of that rule (0-based)
    with a complex match put in front of it — the hardware entries stay the same (a register-only update)."""
    src = shared / "data" / "classbench" / "acl1_1100.filters"
    sub = tmp / f"acl1_{n}.filters"
    sub.write_text("".join(src.read_text().splitlines(keepends=True)[:n]))
    text = classbench_policy_text(sub, complex_rules=k, policy="DROP", actions="alternate", deterministic=True)
    if insert_complex_at is not None:
        lines = text.splitlines()
        rules = [i for i, ln in enumerate(lines) if ln.startswith("-A ")]
        at = rules[insert_complex_at]
        head, _, target = lines[at].rpartition(" -j ")
        lines.insert(at, f"{head} -m string --algo bm --string BAD -j {target}")
        text = "\n".join(lines) + "\n"
    return parse_policy(text, filename=str(sub), base_chain="FORWARD", config=Config())


def blast(lab: Lab, frames: list[bytes], seconds: float = 3.0) -> tuple[int, int, float]:
    """Send the frames round-robin as fast as one AF_PACKET socket takes them; count what reaches the receiver."""
    tx, rx = raw_socket(lab.ns_send, "hyb0"), raw_socket(lab.ns_recv, "hyb0")
    drain(rx)
    got: dict = {"r": {}}
    sent, t0 = 0, time.monotonic()
    tx.setblocking(True)
    while time.monotonic() - t0 < seconds:
        for f in frames:
            tx.send(f)
        sent += len(frames)
        collect({"r": rx}, got, 0.0005, 0.002)
    t_send = time.monotonic() - t0
    collect({"r": rx}, got, 0.5, 20.0)
    t_all = time.monotonic() - t0 - 0.5
    received = sum(len(v) for v in got["r"].values())
    tx.close()
    rx.close()
    return sent, received, max(t_send, t_all)


def timed_update(policy, label: str) -> dict:
    """Deploy `policy` over the running deployment; print its latency and register writes; its history entry."""
    t = time.monotonic()
    h = deploy.deploy(policy, Config())["history"][-1]
    print(f"{label}: {time.monotonic() - t:.2f} s, {h['register_writes']} register writes   [{CMD}]")
    print(f"  steps: {h['steps']}")
    return h


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rules", type=int, default=200, help="first N rules of acl1_1100 (default 200)")
    ap.add_argument("--frames", type=int, default=256, help="distinct frames per blast round")
    ap.add_argument("--lab", default="hfb")
    args = ap.parse_args()
    shared = ROOT.parent / "shared"
    deploy.configure(lab=args.lab, state_dir=f"/run/hypafilter/bench-{args.lab}")
    lab = Lab(args.lab)
    lab.up()
    tmp = Path(tempfile.mkdtemp(prefix="hfbench-"))
    try:
        p0 = cb_policy(args.rules, 10, tmp, shared)
        p1 = cb_policy(args.rules, 11, tmp, shared)
        p0c = cb_policy(args.rules, 10, tmp, shared, insert_complex_at=args.rules // 2)
        cold_root = tmp / "build"
        deploy.BUILD_ROOT = cold_root
        t = time.monotonic()
        deploy.deploy(p0, Config())
        print(f"deploy cold ({args.rules} rules, emulator build included): {time.monotonic() - t:.1f} s   [{CMD}]")
        deploy.undeploy()
        t = time.monotonic()
        st = deploy.deploy(p0, Config())
        print(f"deploy cached ({args.rules} rules): {time.monotonic() - t:.2f} s   [{CMD}]")
        print(f"  steps: {st['history'][-1]['steps']}")
        from hypafilter.analysis.plan import build_plan
        from hypafilter.targets import emu

        h = timed_update(p0c, "update, a complex rule inserted (same hardware entries: registers only, core kept)")
        assert not h["replaced_nic"], "a complex-only change must not replace the core"
        emu.build(build_plan(p1, Config()), Config(), build_root=cold_root)
        timed_update(p1, "update, K 10 -> 11 (other hardware entries: a new core takes over; build cached)")
        # Frames the deployed policy accepts, split by where the verdict is made (the hardware model says which).
        from hypafilter.hw.model import Kind, Regs, decide
        from hypafilter.ops.verify import exchange, make_probes

        plan = build_plan(p1, Config())
        regs = Regs.from_plan(plan)
        probes = make_probes(p1, 4000, seed=5, malformed=0.0, bad_share=0.0)
        got = exchange({"send": lab.ns_send, "recv": lab.ns_recv}, probes)
        kinds = {p.uid: decide(plan, p.frame, 0x01, regs).kind for p in probes}
        for name, kind in (("hardware-forwarded", Kind.FORWARD), ("shunted, accepted in netfilter", Kind.SHUNT)):
            frames = [p.frame for p in probes if p.uid in got["hybrid"] and kinds[p.uid] == kind][: args.frames]
            if not frames:
                print(f"hybrid path, {name}: no accepted frames of this kind among 4000 probes")
                continue
            before = deploy.status()["nic_counters"]
            sent, received, secs = blast(lab, frames)
            after = deploy.status()["nic_counters"]
            delta = {k: after[k] - before[k] for k in after if isinstance(after[k], int) and after[k] != before[k]}
            print(f"hybrid path, {name} ({len(frames)} distinct frames): {sent} offered in {secs:.1f} s, "
                  f"{received} delivered = {received / secs:.0f} frames/s (offered {sent / secs:.0f}/s)   [{CMD}]")  # fmt: skip
            print(f"  NIC counter deltas: {delta}")
    finally:
        try:
            deploy.undeploy()
        finally:
            lab.down()
            shutil.rmtree(tmp, ignore_errors=True)
            shutil.rmtree(f"/run/hypafilter/bench-{args.lab}", ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
