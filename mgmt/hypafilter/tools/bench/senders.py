"""What each frame sender costs per frame on veth, alone: `packet` (hf_blast.c, AF_PACKET sendmmsg), `live`
(hf_live.c, BPF_PROG_TEST_RUN with BPF_F_TEST_XDP_LIVE_FRAMES) and `xsk` (hf_xsk.c, an AF_XDP socket's TX ring in copy
mode, the only AF_XDP mode veth has). Each sends the same frames (UDP frames of the bench's kind, `frames` distinct
ones cycled) into one end of a veth pair whose other end drops them in XDP (hf_sink.bpf.c), the sink of `bench rate`,
pinned to `cpu`, for `seconds`, `rounds` times alternated; every run's frames must all arrive at the sink end's rx
counter. The figure is the sender's CPU time (user + system, including the veth hand-off done in its softirq context,
plus its CPU's ksoftirqd's, as `bench rate` counts a path's) per frame sent: `bench rate`'s `sender_ns`. Run: `make bench-senders` (docs/results.md, "Which sender is cheapest on veth")."""

from __future__ import annotations

import json
import os
import shutil
import statistics
import struct
import tempfile
from pathlib import Path

from hypafilter import netns
from hypafilter.errors import HypafilterError
from hypafilter.paths import BUILD_ROOT
from hypafilter.tools.bench import pktrate, rate

NAMES = ("packet", "xsk", "live")
ENDS = ("snd0", "snd1")


def sender_costs(lab: str, seconds: float = 1.0, rounds: int = 3, cpu: int | None = None, frames: int = 2000) -> dict:
    """{sender: {ns_per_frame, fps, runs}} (medians over the rounds; runs: each run's ns per frame)."""
    build = BUILD_ROOT / "bench"
    senders = {n: rate.build_xsk(build) if n == "xsk" else rate.build_sender(n, build) for n in NAMES}
    sink = rate.build_sink(build)
    cpu = (os.cpu_count() or 1) - 1 if cpu is None else cpu
    ns = f"{lab}-snd"
    work = Path(tempfile.mkdtemp(prefix="hf-senders-"))
    netns.run(["ip", "netns", "del", ns], check=False)
    netns.run(["ip", "netns", "add", ns])
    try:
        for key in ("all", "default"):  # no IPv6: its solicitations would be frames besides the sender's
            netns.run(["sysctl", "-qw", f"net.ipv6.conf.{key}.disable_ipv6=1"], ns)
        netns.run(["ip", "-n", ns, "link", "add", ENDS[0], "type", "veth", "peer", "name", ENDS[1]])
        for ifname in ENDS:
            netns.offloads_off(ifname, ns)
            netns.run(["ip", "-n", ns, "link", "set", ifname, "up"])
        rate._xdp_drop(ns, ENDS[1], sink)
        path = work / "frames.bin"
        with open(path, "wb") as f:
            for i in range(frames):
                fr = pktrate.udp_frame(0x0A000001 + i, 0x0B000001 + (i * 7919) % 65536, 1024 + i % 5000, 53)
                f.write(struct.pack("<H", len(fr)) + fr)
        runs: dict[str, list] = {n: [] for n in NAMES}
        for _ in range(rounds):
            for name, snd in senders.items():
                # As in bench rate's rounds: the sender's CPU time plus its CPU's ksoftirqd's.
                c = rate._count(ns, ENDS[0], (ns, ENDS[1]), snd, path, seconds, cpu, (ns, ENDS[1]))
                if c.arrived != c.sent or not c.sent:
                    raise HypafilterError(f"bench senders: {name} sent {c.sent} frames, the sink got {c.arrived}")
                runs[name].append((c.cpu_ns, c.pps))
        return {
            n: {
                "ns_per_frame": round(statistics.median(r[0] for r in rs), 1),
                "fps": round(statistics.median(r[1] for r in rs)),
                "runs": [round(r[0], 1) for r in rs],
            }
            for n, rs in runs.items()
        } | {"cpu": cpu, "seconds": seconds, "frames": frames, "load": [round(x, 2) for x in os.getloadavg()]}
    finally:
        netns.run(["ip", "netns", "del", ns], check=False)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    print(json.dumps(sender_costs(os.environ.get("HF_LAB", "hf"))))
