"""Issue #13's established measure with the flow sync service's figures: where the sync lag goes, and the emulated
NIC's control-request latency while frames flow.

Run (root): nice -n 10 .venv/bin/python bench/flowsync_lag.py [--lab lfs] [--runs 1] [--probe-lines 16]
Each run: a lab of its own (down, up), `hypafilter verify` of tests/system/test_ctstate.py's POLICY_TCP with 20 TCP
connections of 200 KB (the test's arguments), then one JSON line: the share (connections.hw_share) and, from the
service's flowsync.json, the sync lag (p50/max), its parts (lag_read/liberal/nic: event read until the batch is
applied, the liberal-flag batch, the flow-cache batch) and the poll's longest stretch without reading events
(poll_block); with --probe-lines N, the round trip of an N-line request (R FC_STATUS) sent beside the run whenever
frames moved across it (STATS fed before and after). docs/flowsync.md and docs/emulator.md quote its output.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import shutil
import socket
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from hypafilter.cli import main as cli  # noqa: E402
from hypafilter.ops import deploy  # noqa: E402
from hypafilter.ops.lab import Lab  # noqa: E402

from tests.system.test_ctstate import POLICY_TCP  # noqa: E402

KEYS = ("lag_p50_ms", "lag_max_ms", "lag_read_p50_ms", "lag_liberal_p50_ms", "lag_nic_p50_ms", "lag_nic_max_ms")
KEYS += ("poll_block_max_ms", "echoes", "restarts", "errors")


def probe(state: str, lines: int, stop: threading.Event, out: list[float]) -> None:
    """Round trips of `lines`-line requests to the deployed emulated NIC while frames flow (reconnects when the
    NIC is replaced)."""
    sock = None

    def req(batch: list[str]) -> list[str]:
        sock.sendall("".join(x + "\n" for x in batch).encode())
        buf = b""
        while buf.count(b"\n") < len(batch):
            chunk = sock.recv(65536)
            if not chunk:
                raise OSError("closed")
            buf += chunk
        return buf.decode().splitlines()

    while not stop.is_set():
        try:
            if sock is None:
                path = json.loads(Path(state, "state.json").read_text())["nic"]["socket"]
                sock = socket.socket(socket.AF_UNIX)
                sock.settimeout(5)
                sock.connect(path)
            fed = json.loads(req(["STATS"])[0][3:])["fed"]
            t = time.perf_counter()
            req(["R 0x7c"] * lines)
            dt = time.perf_counter() - t
            if json.loads(req(["STATS"])[0][3:])["fed"] > fed:
                out.append(dt)
        except (OSError, ValueError, KeyError):
            sock = None
            time.sleep(0.1)
            continue
        time.sleep(0.003)


def run(name: str, probe_lines: int) -> dict:
    state = f"/run/hypafilter/test-{name}"
    deploy.configure(lab=name, state_dir=state)
    shutil.rmtree(state, ignore_errors=True)
    lab = Lab(name, target="emu")
    lab.down()
    lab.up()
    stop, lat = threading.Event(), []
    th = threading.Thread(target=probe, args=(state, probe_lines, stop, lat), daemon=True) if probe_lines else None
    try:
        policy = Path(f"/tmp/{name}-policy.rules")
        policy.write_text(POLICY_TCP)
        args = ["verify", str(policy), "--packets", "50", "--connections", "20", "--connection-kinds", "tcp"]
        buf = io.StringIO()
        if th:
            th.start()
        with contextlib.redirect_stdout(buf):
            status = cli([*args, "--connection-bytes", str(200 * 1024), "--json"])
        stop.set()
        r = json.loads(buf.getvalue())
        fs = json.loads((Path(state) / "flowsync.json").read_text())
        out = {"status": status, "mismatches": r["mismatches"], "hw_share": r["connections"]["hw_share"]}
        out.update({k: fs.get(k) for k in KEYS})
        if lat:
            lat.sort()
            q = {p: round(lat[min(len(lat) - 1, int(p * len(lat)))] * 1000, 2) for p in (0.5, 0.9, 1.0)}
            out["probe"] = {
                "lines": probe_lines,
                "samples": len(lat),
                "p50_ms": q[0.5],
                "p90_ms": q[0.9],
                "max_ms": q[1.0],
            }
        return out
    finally:
        stop.set()
        try:
            deploy.undeploy()
        finally:
            lab.down()
            shutil.rmtree(state, ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lab", default="lfs")
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--probe-lines", type=int, default=0)
    a = ap.parse_args()
    for _ in range(a.runs):
        print(json.dumps(run(a.lab, a.probe_lines)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
