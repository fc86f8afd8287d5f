"""`hypafilter bench rate --target xdp --sender live` on the lab: the frames reach the firewall's wire ends as
xdp_frames (hf_live.c: BPF_PROG_TEST_RUN with BPF_F_TEST_XDP_LIVE_FRAMES), the correctness pass compares every frame
with iptables and nft, and the counted rate pass checks that every frame sent arrived and was delivered as the
verdicts predict. Also: a frame the veth drops (no NAPI on the receiving end) fails the run instead of being
counted. The long measurements are `make bench-xdp-rate` (docs/results.md), not tests."""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys

import pytest

from conftest import need_root, need_tool

pytestmark = pytest.mark.system

LAB = "wlr"
STATE = f"/run/hypafilter/test-{LAB}"
HF = [sys.executable, "-m", "hypafilter"]
SHORT = ("--seconds", "0.3", "--repeats", "1", "--prog-repeat", "0", "--json")


def hf(*args: str) -> dict:
    env = dict(os.environ, HF_LAB=LAB, HF_STATE_DIR=STATE)
    p = subprocess.run(HF + list(args), capture_output=True, text=True, env=env)
    assert p.returncode == 0, f"hypafilter {' '.join(args)}: {p.stderr[-3000:]}"
    return json.loads(p.stdout.splitlines()[-1]) if "--json" in args else {}


@pytest.fixture(scope="module")
def lab():
    need_root()
    need_tool("ip", "iptables-restore", "clang", "cc", "ethtool", "nft", "conntrack")
    env = dict(os.environ, HF_LAB=LAB, HF_STATE_DIR=STATE)
    subprocess.run(HF + ["lab", "down", "--name", LAB], capture_output=True, env=env)
    shutil.rmtree(STATE, ignore_errors=True)
    hf("lab", "up", "--target", "xdp", "--name", LAB)
    yield LAB
    subprocess.run(HF + ["undeploy", "-q"], capture_output=True, env=env)
    subprocess.run(HF + ["lab", "down", "--name", LAB], capture_output=True, env=env)
    shutil.rmtree(STATE, ignore_errors=True)


def test_bench_rate_live_established(lab, shared_dir, tmp_path):
    """Conntrack-first, established flows, the live sender: every frame compared and delivered on every path, every
    frame of the rate pass counted at the path's first receiver and delivered."""
    filters = tmp_path / "acl1_60.filters"
    src = shared_dir / "data" / "classbench" / "acl1_1100.filters"
    filters.write_text("".join(src.read_text().splitlines(keepends=True)[:60]))
    trace = shared_dir / "data" / "classbench" / "acl1_1100_trace.gz"
    r = hf("bench", "rate", "--target", "xdp", "--sender", "live", "--classbench", str(filters), "--policy", "DROP",
           "--ct-first", "--established", "--trace", str(trace), "--frames", "1000", *SHORT)  # fmt: skip
    assert r["sender"] == "live" and r["mismatches"] == 0 and r["established_flows"] > 0, r
    assert r["mismatches_vs_iptables"] == 0 and r["mismatches_vs_nft"] == 0
    assert r["delivered"] == {"hybrid": 1000, "iptables": 1000, "nft": 1000}
    assert r["hw_share"] == 1.0 and r["nic"]["CNT_FORWARDED"] == 1000, r["nic"]
    (rnd,) = r["rounds"]
    assert set(rnd) == {"sink", "hybrid", "iptables", "nft"}
    assert all(c["sent"] > 0 and c["arrived"] == c["delivered"] == c["sent"] for c in rnd.values()), rnd
    assert all(c["cpu_seconds"] > 0 for c in rnd.values()), rnd
    assert set(r["fw_ns"]) == {"hybrid", "iptables", "nft"} and r["sink_pps"] > 0


def test_live_sender_loss_fails(lab, tmp_path):
    """The live sender into a veth whose peer has no NAPI (no XDP program, GRO off): veth drops every xdp_frame and
    the sender cannot see it; the pass's count at the receiving end refuses the run."""
    from hypafilter import netns
    from hypafilter.errors import HypafilterError
    from hypafilter.ops.verify import raw_socket
    from hypafilter.paths import BUILD_ROOT
    from hypafilter.tools.bench import rate

    ns = "wlr-loss"
    netns.run(["ip", "netns", "del", ns], check=False)
    netns.run(["ip", "netns", "add", ns])
    try:
        # No IPv6: its neighbour and router solicitations would be frames on the wire besides the sender's.
        for key in ("all", "default"):
            netns.run(["sysctl", "-qw", f"net.ipv6.conf.{key}.disable_ipv6=1"], ns)
        netns.run(["ip", "-n", ns, "link", "add", "wla", "type", "veth", "peer", "name", "wlb"])
        for ifname in ("wla", "wlb"):
            netns.offloads_off(ifname, ns)
            netns.run(["ip", "-n", ns, "link", "set", ifname, "up"])
        frames = tmp_path / "frames.bin"
        frame = bytes.fromhex("020000000002020000000001") + b"\x08\x00" + bytes(46)
        frames.write_bytes((struct.pack("<H", len(frame)) + frame) * 100)
        snd = rate.build_sender("live", BUILD_ROOT / "bench")
        rx = raw_socket(ns, "wlb")
        try:
            with pytest.raises(HypafilterError, match="received 0 frames for the 100 sent"):
                rate._run(ns, "wla", rx, snd, frames, 100, None, 0, (ns, "wlb"), quiet=0.05)
            # With an XDP program on the peer (NAPI), the same frames all arrive.
            rate._xdp_drop(ns, "wlb", rate.build_sink(BUILD_ROOT / "bench"))
            rate._run(ns, "wla", rx, snd, frames, 100, None, 0, (ns, "wlb"), quiet=0.05)
        finally:
            rx.close()
    finally:
        netns.run(["ip", "netns", "del", ns], check=False)
