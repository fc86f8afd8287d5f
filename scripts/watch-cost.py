#!/usr/bin/env python3
"""What the ipset watcher costs the host's syscalls (docs/sets.md, "Its cost").

Runs two loops of a small C program, without the watcher and with it loaded, alternately (--rounds times; the best of
5 runs each time, thread CPU time per call):
  getppid  `syscall(SYS_getppid)` 2,000,000 times (a syscall the watcher does not look at)
  udp      `sendto` of 64-byte UDP datagrams 300,000 times, in a namespace of its own (HF_LAB, default "wcost") whose
           veth sends them to a static neighbour (a send the watcher looks at, not netlink)
  setsockopt  `setsockopt(SOL_SOCKET, SO_PRIORITY)` on a UDP socket 2,000,000 times (a setsockopt the watcher looks at
           and lets go after two compares: only a legacy xtables table replacement is counted)
The watcher is the working tree's driver/xdp/setwatch.bpf.c, or `--ref REV`'s (git show), loaded with `hf_xdp watch`
into a pin directory of its own and unloaded after each round. Another watcher loaded on the host (a deployed xdp
program with set slots) changes the baseline: the script refuses to run while one is.
Prints JSON: ns per call, median over the rounds, for "none" and "watcher".

    PYTHONPATH=mgmt .venv/bin/python scripts/watch-cost.py [--ref main] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "mgmt"))

from hypafilter.targets.xdp.build import BUILD_ROOT, build_loader  # noqa: E402
from hypafilter.targets.xdp.sets import SETWATCH_PIN  # noqa: E402

LAB = os.environ.get("HF_LAB", "wcost")
PIN = Path("/sys/fs/bpf/hypafilter-watchcost")
XDP = ROOT / "driver" / "xdp"

BENCH = r"""
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>
static double now(void) { struct timespec t; clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t); return t.tv_sec * 1e9 + t.tv_nsec; }
int main(int argc, char **argv) {
	long n = atol(argv[2]);
	double best = 1e18;
	for (int r = 0; r < 5; r++) {
		double t0 = now(), dt;
		if (!strcmp(argv[1], "getppid")) {
			for (long i = 0; i < n; i++) syscall(SYS_getppid);
		} else if (!strcmp(argv[1], "setsockopt")) {
			int s = socket(AF_INET, SOCK_DGRAM, 0), v = 1;
			for (long i = 0; i < n; i++)
				if (setsockopt(s, SOL_SOCKET, SO_PRIORITY, &v, sizeof v) < 0) { perror("setsockopt"); return 1; }
			close(s);
		} else {
			int s = socket(AF_INET, SOCK_DGRAM, 0);
			struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons(9)};
			char b[64] = {0};
			a.sin_addr.s_addr = inet_addr("10.77.0.2");
			for (long i = 0; i < n; i++)
				if (sendto(s, b, sizeof b, 0, (void *)&a, sizeof a) < 0) { perror("sendto"); return 1; }
			close(s);
		}
		dt = (now() - t0) / n;
		if (dt < best) best = dt;
	}
	printf("%.1f\n", best);
	return 0;
}
"""


def sh(*argv: str) -> str:
    return subprocess.run(argv, check=True, capture_output=True, text=True).stdout


def watcher_links() -> bool:
    return SETWATCH_PIN.exists() and any(SETWATCH_PIN.iterdir())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ref", help="measure this revision's setwatch.bpf.c (default: the working tree's)")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    if watcher_links():
        sys.exit(f"an ipset watcher is loaded on this host ({SETWATCH_PIN}): the baseline would include it")
    tmp = Path(tempfile.mkdtemp(prefix="watch-cost-"))
    try:
        (tmp / "bench.c").write_text(BENCH)
        sh("cc", "-O2", "-o", str(tmp / "bench"), str(tmp / "bench.c"))
        src = tmp / "setwatch.bpf.c"
        if args.ref:
            src.write_text(sh("git", "-C", str(ROOT), "show", f"{args.ref}:driver/xdp/setwatch.bpf.c"))
        else:
            shutil.copy(XDP / "setwatch.bpf.c", src)
        machine = sh("cc", "-dumpmachine").strip()
        obj = tmp / "setwatch.o"
        sh(*"clang -O2 -g -target bpf".split(), f"-I{XDP}", f"-I{ROOT / 'driver'}", f"-I/usr/include/{machine}",
           "-c", str(src), "-o", str(obj))  # fmt: skip
        loader = build_loader(BUILD_ROOT)
        sh("ip", "netns", "add", LAB)
        sh("ip", "-n", LAB, "link", "add", "wc0", "type", "veth", "peer", "name", "wc1")
        sh("ip", "-n", LAB, "addr", "add", "10.77.0.1/24", "dev", "wc0")
        for dev in ("wc0", "wc1"):
            sh("ip", "-n", LAB, "link", "set", dev, "up")
        sh("ip", "-n", LAB, "neigh", "add", "10.77.0.2", "lladdr", "02:00:00:00:77:02", "dev", "wc0")
        runs: dict[str, dict[str, list[float]]] = {"none": {}, "watcher": {}}
        for _ in range(args.rounds):
            for mode in ("none", "watcher"):
                if mode == "watcher":
                    sh(str(loader), "watch", "--obj", str(obj), "--pin", str(PIN))
                try:
                    for loop, argv in (
                        ("getppid", [str(tmp / "bench"), "getppid", "2000000"]),
                        ("udp", ["ip", "netns", "exec", LAB, str(tmp / "bench"), "udp", "300000"]),
                        ("setsockopt", [str(tmp / "bench"), "setsockopt", "2000000"]),
                    ):
                        runs[mode].setdefault(loop, []).append(float(sh(*argv)))
                finally:
                    shutil.rmtree(PIN, ignore_errors=True)  # unpinning the links detaches the programs
        result = {
            "ref": args.ref or "working tree",
            "rounds": args.rounds,
            "ns_per_call": {m: {k: statistics.median(v) for k, v in r.items()} for m, r in runs.items()},
        }
        print(json.dumps(result))
    finally:
        shutil.rmtree(PIN, ignore_errors=True)
        subprocess.run(["ip", "netns", "del", LAB], capture_output=True)
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
