"""The bench's frame senders send exactly the frames of their file, in its order, as many as they say: `live`
(hf_live.c, BPF_PROG_TEST_RUN with BPF_F_TEST_XDP_LIVE_FRAMES), `packet` (hf_blast.c, AF_PACKET sendmmsg) and `xsk`
(hf_xsk.c, AF_XDP copy mode: measured against them, tools/bench/senders.py), each into a veth pair of its own
namespace. Once mode: every frame captured on the peer (an AF_PACKET socket, the peer
with an XDP_PASS program so that veth takes the live sender's xdp_frames), byte for byte and in order. The timed mode
(the rate pass's) at full speed, where no capture keeps up: the peer's XDP program (hf_seqcheck.bpf.c) checks that
each frame is the one after the previous in the file's cyclic order and has its length, and counts them; the count
must be the sender's. The rate pass's own checks (the wire end's rx counter against every run's sent count) are in
test_bench_rate_xdp.py."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import time
from pathlib import Path

import pytest

from conftest import need_root, need_tool

pytestmark = pytest.mark.system

NS = "w7s"
A, B = "w7sa", "w7sb"
N = 400  # frames in the file: lengths 60..1024 (the live sender's largest), every one distinct
SEQCHECK_SRC = Path(__file__).resolve().parent / "hf_seqcheck.bpf.c"
SLOTS = ("arrived", "next", "bad_order", "bad_len", "first", "n")  # hf_seqcheck.bpf.c's state, in order


def frame(i: int) -> bytes:
    """Test frame i: to the peer's broadcast, ethertype 0x88b5 (local experimental), its index, then bytes of i;
    its length 60 + (37 i mod 965), as hf_seqcheck.bpf.c's len_of."""
    n = 60 + (i * 37) % 965
    head = b"\xff" * 6 + bytes.fromhex("024837000001") + b"\x88\xb5" + struct.pack("!I", i)
    return head + bytes((i + k) & 0xFF for k in range(n - len(head)))


@pytest.fixture(scope="module")
def pair():
    need_root()
    need_tool("ip", "ethtool", "clang", "gcc", "bpftool")
    from hypafilter import netns

    netns.run(["ip", "netns", "del", NS], check=False)
    netns.run(["ip", "netns", "add", NS])
    try:
        # No IPv6: its solicitations would be frames on the wire besides the sender's.
        for key in ("all", "default"):
            netns.run(["sysctl", "-qw", f"net.ipv6.conf.{key}.disable_ipv6=1"], NS)
        netns.run(["ip", "-n", NS, "link", "add", A, "type", "veth", "peer", "name", B])
        for ifname in (A, B):
            netns.offloads_off(ifname, NS)
            netns.run(["ip", "-n", NS, "link", "set", ifname, "up"])
        yield NS
    finally:
        netns.run(["ip", "netns", "del", NS], check=False)


@pytest.fixture(scope="module")
def frames_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("senders") / "frames.bin"
    path.write_bytes(b"".join(struct.pack("<H", len(f)) + f for f in map(frame, range(N))))
    return path


def _sender(name: str):
    from hypafilter.paths import BUILD_ROOT
    from hypafilter.tools.bench import rate

    return rate.build_xsk(BUILD_ROOT / "bench") if name == "xsk" else rate.build_sender(name, BUILD_ROOT / "bench")


def _attach(obj: Path | None) -> None:
    from hypafilter.tools.bench import rate

    rate._xdp_drop(NS, B, obj)


def _send(argv: list[str]) -> dict:
    """A sender run to its end, stdin closed (once mode: no allowance limit); its closing JSON line."""
    p = subprocess.run(["ip", "netns", "exec", NS, *argv], stdin=subprocess.DEVNULL, capture_output=True, text=True,
                       timeout=60)  # fmt: skip
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout.splitlines()[-1])


@pytest.mark.parametrize("sender", ["live", "packet", "xsk"])
def test_once_sends_every_frame_in_order(pair, frames_file, sender):
    from hypafilter.ops.verify import raw_socket
    from hypafilter.paths import BUILD_ROOT
    from hypafilter.tools.bench import pktrate, rate

    snd = _sender(sender)
    # XDP_PASS on the peer: its NAPI takes the live sender's xdp_frames, then its stack hands them to the capture.
    _attach(pktrate.build_cached(rate.PASS_SRC, BUILD_ROOT / "bench", rate.BPF_CC, suffix=".o"))
    rx = raw_socket(NS, B, rcvbuf=64 << 20)
    try:
        out = _send(snd.argv(A, frames_file, "once"))
        got = []
        deadline = time.monotonic() + 5
        while len(got) < N and time.monotonic() < deadline:
            try:
                data = rx.recv(65536)
            except BlockingIOError:
                time.sleep(0.01)
                continue
            if data[12:14] == b"\x88\xb5":
                got.append(data)
        time.sleep(0.1)  # nothing more may come
        try:
            extra = rx.recv(65536)
        except BlockingIOError:
            extra = None
    finally:
        rx.close()
        _attach(None)
    assert out["sent"] == N and out["frames"] == N and out["errors"] == 0, out
    assert len(got) == N, f"{len(got)} frames captured of {N}"
    want = [frame(i) for i in range(N)]
    wrong = [i for i in range(N) if got[i] != want[i]]
    assert not wrong, f"frames {wrong[:10]} differ (first: {got[wrong[0]][:20].hex()} != {want[wrong[0]][:20].hex()})"
    assert extra is None or extra[12:14] != b"\x88\xb5", "a frame more than the file's"


def _map_of_xdp() -> int:
    """The id of hf_seqcheck's state map: from the peer's XDP program."""
    link = json.loads(subprocess.run(["ip", "-n", NS, "-j", "-d", "link", "show", "dev", B], check=True,
                                     capture_output=True, text=True).stdout)[0]  # fmt: skip
    prog_id = link["xdp"]["prog"]["id"]
    prog = json.loads(subprocess.run(["bpftool", "-j", "prog", "show", "id", str(prog_id)], check=True,
                                     capture_output=True, text=True).stdout)  # fmt: skip
    (map_id,) = prog["map_ids"]
    return map_id


def _state(map_id: int) -> dict:
    rows = json.loads(subprocess.run(["bpftool", "-j", "map", "dump", "id", str(map_id)], check=True,
                                     capture_output=True, text=True).stdout)  # fmt: skip
    vals = {}
    for row in rows:
        key = row.get("key")
        val = row.get("value")
        k = struct.unpack("<I", bytes(int(x, 16) for x in key))[0] if isinstance(key, list) else int(key)
        v = struct.unpack("<Q", bytes(int(x, 16) for x in val))[0] if isinstance(val, list) else int(val)
        vals[SLOTS[k]] = v
    return vals


@pytest.mark.parametrize("sender", ["live", "packet", "xsk"])
def test_timed_cycles_in_order_and_counts_exactly(pair, frames_file, sender):
    from hypafilter.paths import BUILD_ROOT
    from hypafilter.tools.bench import pktrate

    snd = _sender(sender)
    obj = pktrate.build_cached(SEQCHECK_SRC, BUILD_ROOT / "bench", ["clang", "-O2", "-g", "-target", "bpf", "-c"],
                               suffix=".o")  # fmt: skip
    _attach(obj)
    try:
        map_id = _map_of_xdp()
        subprocess.run(["bpftool", "map", "update", "id", str(map_id), "key", *f"{SLOTS.index('n')} 0 0 0".split(),
                        "value", *[str(b) for b in struct.pack("<Q", N)]], check=True)  # fmt: skip
        cpu = (os.cpu_count() or 1) - 1
        out = _send(snd.argv(A, frames_file, "0.3", cpu))
        st = _state(map_id)
    finally:
        _attach(None)
    sent = out["sent"]
    assert out["errors"] == 0 and out["frames"] == N and sent > 2 * N, out  # cycled through the file several times
    assert st["arrived"] == sent, (st, out)
    assert st["first"] == 1, st  # frame 0 first
    assert st["bad_order"] == 0 and st["bad_len"] == 0, st
    assert st["next"] == sent % N, (st, out)  # the last frame sent was frame sent - 1 (mod N)
