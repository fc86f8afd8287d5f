"""inet6 ipsets in the xdp program's IPv6 path (docs/sets.md "IPv6 sets", issues #24/#25), against the kernel: an
IPv6 policy (`-6`) reading a `family inet6` hash:net blocklist with nomatch holes and a `family inet6` hash:ip,port
allow list, deployed and verified with the kernel oracle (0 mismatches; the set rules decided in XDP: their entries'
hits in the IPv6 table set, frames dropped and forwarded there); a ban added with `ipset add` to an inet6 set while
the banned source sends: none of its frames that left after the command returned is forwarded, and the fast path
drops them itself after the lag."""

from __future__ import annotations

import ipaddress
import json
import os
import random
import subprocess
import threading
import time
from pathlib import Path

import pytest

from tests.hfcli import HfCli

pytestmark = pytest.mark.system

LAB = "w3a"
STATE = f"/run/hypafilter/test-{LAB}"
FW = f"{LAB}-fw"
hf = HfCli(LAB, STATE)
BANNED = "fd48:4600::1:5"  # in bl6's nomatch hole fd48:4600::1:0/124: not blocked until banned
RECEIVER = "fd48:4600::2:1"
CNT_FORWARDED, CNT_DROPPED, CNT_SETS_UNKNOWN = 2, 3, 13  # hfx_cnt indices (driver/xdp/hf_fastpath.h)

SETS = """create ban6 hash:ip family inet6 hashsize 1024 maxelem 65536 timeout 600
create bl6 hash:net family inet6 hashsize 1024 maxelem 65536
add bl6 2001:db8:bad::/48
add bl6 2001:db8:bad:1::/64 nomatch
add bl6 2001:db8:bad:1:8000::/65
add bl6 fd48:4600::1:0/120
add bl6 fd48:4600::1:0/124 nomatch
add bl6 fd48:4601::1:0/120
add bl6 fd48:4601::1:0/124 nomatch
add bl6 fd48:4600::2:80/121
add bl6 fd48:4601::2:80/121
create svc6 hash:ip,port family inet6 hashsize 1024 maxelem 65536
add svc6 fd48:4600::2:1,tcp:80
add svc6 fd48:4601::2:1,tcp:80
add svc6 fd48:4600::2:1,udp:53
add svc6 fd48:4601::2:1,udp:53
add svc6 2001:db8:1::1,tcp:443
add svc6 fd48:4600::2:1,ipv6-icmp:echo-request
add svc6 fd48:4601::2:1,ipv6-icmp:128/0
"""

V6 = """*filter
:INPUT ACCEPT [0:0]
:FORWARD ACCEPT [0:0]
:OUTPUT ACCEPT [0:0]
-A FORWARD -m set --match-set ban6 src -j DROP
-A FORWARD -m set --match-set bl6 src -j DROP
-A FORWARD -m set --match-set svc6 dst,dst -j ACCEPT
-A FORWARD -p ipv6-icmp --icmpv6-type echo-request -j DROP
-A FORWARD -p tcp -j DROP
-A FORWARD -p udp -m set ! --match-set bl6 dst -j DROP
COMMIT
"""


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    d = tmp_path_factory.mktemp(LAB)
    (d / "sets.save").write_text(SETS)
    (d / "v6.rules").write_text(V6)
    with hf.xdp_lab():
        yield d


def state() -> dict:
    from hypafilter.ops import deploy

    return deploy.read_state(Path(STATE) / "state.json")


def synced(timeout: float = 10.0) -> None:
    """Wait until the program's set tables (both families') equal the kernel's sets."""
    from hypafilter.targets.xdp import sets as setmaps
    from hypafilter.targets.xdp.target import _shape_of

    nic = state()["nic"]
    sm = setmaps.SetMaps(nic["pin"], setmaps.slots_of(_shape_of(nic)), FW)
    try:
        deadline = time.monotonic() + timeout
        while not sm.current():
            assert time.monotonic() < deadline, "the set tables were not released"
            time.sleep(0.005)
    finally:
        sm.close()


def counters(name: str = "hfx_cnt"):
    from hypafilter.targets.bpfmap import PinnedArray, percpu_sum

    m = PinnedArray(Path(state()["nic"]["pin"]) / name)
    return lambda i: percpu_sum(m, i)


def test_inet6_sets_decided_in_xdp(lab):
    """lint: the set matches slots of the IPv6 plan on xdp, and on the emulated NIC too (its dual-stack core's IPv6
    set tables); verify -6 with the kernel oracle: 0 mismatches, the set rules' entries hit in XDP."""
    args = ["-6", str(lab / "v6.rules"), "--ipsets", str(lab / "sets.save"), "--no-kernel"]  # (verify loads it)
    out = hf("lint", *args, "--target", "xdp").stdout
    assert "set matches: 4 set slot(s)" in out and "complex:" not in out.split("set matches:")[1], out
    out = hf("lint", *args, "--target", "emu").stdout
    assert "set matches: 4 set slot(s)" in out and "complex:" not in out.split("set matches:")[1], out
    p = hf(
        "verify",
        "-6",
        str(lab / "v6.rules"),
        "--ipsets",
        str(lab / "sets.save"),
        "--target",
        "xdp",
        "--packets",
        "200",
        "--json",
        check=False,
    )
    assert p.stdout, p.stderr[-3000:]
    r = json.loads(p.stdout)
    six = r["ipv6"]
    assert p.returncode == 0 and r["mismatches"] == 0 and six["mismatches"] == 0, (r["examples"][:3], six)
    assert six["packets"] == 200
    st = state()
    assert st["tables"]["sets"]["slots"] == ["ban6", "bl6", "svc6", "bl6"], st["tables"].get("sets")
    hits = counters("hfx6_hits")
    assert hits(1) > 0 and hits(2) > 0, (hits(1), hits(2))  # bl6's DROP and svc6's ACCEPT decided by the IPv6 tables
    out = hf("status").stdout
    assert "sets     4 slot(s) in the fast path: ban6 (hash:ip) by src [IPv6]; " in out, out
    assert "following the kernel's sets" in out, out
    cnt = counters()
    assert cnt(CNT_DROPPED) > 20 and cnt(CNT_FORWARDED) > 5, r["nic"]
    assert r["nic"]["CNT_SETS_UNKNOWN"] == 0, r["nic"]


def _frame(uid: int, src: str) -> bytes:
    from hypafilter.ops.verify import DST_MAC, ID_MAC_PREFIX
    from hypafilter.ops.verify6 import _scapy

    sc = _scapy()
    src_mac = (ID_MAC_PREFIX + uid.to_bytes(4, "big")).hex(":")
    pkt = sc.Ether(dst=DST_MAC.hex(":"), src=src_mac) / sc.IPv6(src=src, dst=RECEIVER) / sc.UDP(sport=4000, dport=53)
    return bytes(pkt / (b"x" * 16))


def _run_sender(frame: bytearray, seconds: float, rate: float, sent: list, stop: threading.Event) -> None:
    """`frame` sent `rate` times a second, each copy's id in its source MAC (bytes 8-11)."""
    from hypafilter.ops.verify import raw_socket

    s = raw_socket(f"{LAB}-send", "hyb0")
    uid, t_end = 1, time.monotonic() + seconds
    try:
        while time.monotonic() < t_end and not stop.is_set():
            t = time.monotonic()
            frame[8:12] = uid.to_bytes(4, "big")
            s.send(bytes(frame))
            sent.append((uid, t))
            uid += 1
            time.sleep(max(0.0, 1.0 / rate - (time.monotonic() - t)))
    finally:
        s.close()


def test_inet6_ban_added_during_traffic(lab):
    """`ipset add ban6 SRC` (an inet6 hash:ip) while SRC sends IPv6 UDP that the allow list accepts (SRC in bl6's
    nomatch hole): no frame that left after the command returned is forwarded, and after the lag the fast path drops
    them itself. (The deployment verify left: the policy above.)"""
    from hypafilter.ops.verify import frame_id, raw_socket, receive

    synced()
    cnt = counters()
    recv = raw_socket(f"{LAB}-recv", "hyb0")
    sent: list = []
    stop = threading.Event()
    frame = bytearray(_frame(0, BANNED))  # (built here: scapy's first import takes longer than the lead-in)
    th = threading.Thread(target=_run_sender, args=(frame, 1.0, 3000, sent, stop))
    th.start()
    time.sleep(0.3)
    dropped0 = cnt(CNT_DROPPED)
    t_call = time.monotonic()
    subprocess.run(["ip", "netns", "exec", FW, "ipset", "add", "ban6", BANNED], check=True)
    t_ret = time.monotonic()
    lag = None
    while th.is_alive():
        if lag is None and cnt(CNT_DROPPED) > dropped0:
            lag = time.monotonic() - t_ret
        time.sleep(0.0002)
    got = {u for u in (frame_id(f) for f in receive(recv, quiet=0.3)) if u is not None}
    recv.close()
    after = [u for u, t in sent if t > t_ret]
    before = [u for u, t in sent if t < t_call - 0.05]
    leaked = sorted(set(after) & got)
    assert after and not leaked, f"{len(leaked)} frames of the banned source forwarded after the ban: {leaked[:5]}"
    assert len(before) > 100 and len(set(before) & got) >= 0.9 * len(before), "frames before the ban should pass"
    assert lag is not None, "the fast path never dropped the banned source itself"
    print(f"inet6 ban lag (ipset add returned -> first frame dropped in XDP): {lag * 1e3:.1f} ms")
    assert cnt(CNT_DROPPED) - dropped0 > 0.5 * len(after)
    subprocess.run(["ip", "netns", "exec", FW, "ipset", "del", "ban6", BANNED], check=True)


SCALE = int(os.environ.get("HF_SETS6_SCALE", "0"))  # `make test-sets6`: 10,000 networks and 3,000 frames


def blocklist6(n: int, seed: int = 25) -> str:
    """`ipset save` text: bl6 (hash:net inet6, n networks of /32 to /128 in 2001:db8::/32 and the lab's prefixes,
    one in 40 with a nomatch hole inside), svc6 (hash:ip,port: tcp, udp, an icmpv6 type), np6 (hash:net,port with
    a nomatch hole), bp (bitmap:port: family-less, read by the IPv6 policy too)."""
    rng = random.Random(seed)
    lines = [f"create bl6 hash:net family inet6 hashsize 4096 maxelem {max(65536, 2 * n)}"]
    nets = set()
    while len(nets) < n:
        plen = rng.choice((32, 40, 48, 48, 56, 64, 64, 96, 120, 128))
        base = rng.choice((0x20010DB8 << 96, 0xFD484600 << 96, 0xFD484601 << 96))
        lo = base | rng.getrandbits(96) if plen > 32 else base
        lo &= ((1 << 128) - 1) ^ ((1 << (128 - plen)) - 1)
        nets.add((lo, plen))
    for i, (lo, plen) in enumerate(sorted(nets)):
        lines.append(f"add bl6 {ipaddress.IPv6Address(lo)}/{plen}")
        if plen <= 64 and i % 40 == 0:
            hole = lo | (rng.getrandbits(128 - plen) & ~((1 << 48) - 1) & ((1 << (128 - plen)) - 1))
            lines.append(f"add bl6 {ipaddress.IPv6Address(hole)}/{plen + 16} nomatch")
    lines += [
        "create svc6 hash:ip,port family inet6 hashsize 1024 maxelem 65536",
        "add svc6 fd48:4600::2:1,tcp:80",
        "add svc6 fd48:4601::2:1,tcp:80",
        "add svc6 fd48:4600::2:1,udp:53",
        "add svc6 fd48:4601::2:1,udp:53",
        "add svc6 fd48:4600::2:1,ipv6-icmp:echo-request",
        "create np6 hash:net,port family inet6 hashsize 1024 maxelem 65536",
        "add np6 fd48:4600::/64,tcp:22",
        "add np6 fd48:4600::1:0/112,tcp:22 nomatch",
        "add np6 fd48:4601::/64,tcp:22",
        "add np6 fd48:4601::1:0/112,tcp:22 nomatch",
        "create bp bitmap:port range 0-2048",
        "add bp 25",
        "add bp 1000",
    ]
    return "\n".join(lines) + "\n"


POLICY6_SCALE = """*filter
:INPUT ACCEPT [0:0]
:FORWARD ACCEPT [0:0]
:OUTPUT ACCEPT [0:0]
-A FORWARD -m set --match-set bl6 src -j DROP
-A FORWARD -m set --match-set svc6 dst,dst -j ACCEPT
-A FORWARD -p tcp -m set --match-set np6 src,dst -j DROP
-A FORWARD -p tcp -m set ! --match-set svc6 dst,dst -m tcp --dport 1:1024 -j DROP
-A FORWARD -m set --match-set bp dst -j ACCEPT
-A FORWARD -m set ! --match-set bl6 dst -p udp -j DROP
COMMIT
"""


@pytest.mark.optin("HF_SETS6_SCALE")  # make test-sets6
def test_inet6_blocklist_at_scale(lab):
    """A blocklist of HF_SETS6_SCALE inet6 networks with nomatch holes, hash:net,port with a hole, bitmap:port, `!`
    matches: every set match a slot of the IPv6 plan, 0 mismatches against the kernel over 3,000 frames and real
    connections, frames decided in XDP."""
    (lab / "scale.save").write_text(blocklist6(SCALE))
    (lab / "scale.rules").write_text(POLICY6_SCALE)
    args = ["-6", str(lab / "scale.rules"), "--ipsets", str(lab / "scale.save"), "--target", "xdp"]
    out = hf("lint", *args).stdout
    assert "set matches: 5 set slot(s)" in out and "complex:" not in out.split("set matches:")[1], out
    p = hf("verify", *args, "--packets", "3000", "--connections", "8", "--json", check=False)
    assert p.stdout, p.stderr[-3000:]
    r = json.loads(p.stdout)
    six = r["ipv6"]
    assert p.returncode == 0 and r["mismatches"] == 0 and six["mismatches"] == 0, (r["examples"][:3], six)
    assert six["connections"]["mismatches"] == 0, six["connections"]
    assert r["hw_dropped"] > 200 and r["hw_forwarded"] > 100, r["nic"]
    assert r["nic"]["CNT_SETS_UNKNOWN"] == 0, r["nic"]
