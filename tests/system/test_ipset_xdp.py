"""ipsets in the fast path on the xdp target (docs/sets.md), against the kernel: a 10,000-network hash:net blocklist
with nomatch entries and a hash:ip,port allow list (plus hash:net,port and bitmap:port, `!` matches) deployed and
verified with the kernel oracle; a ban added with `ipset add` while a banned source sends: none of its frames that
left after the command returned is forwarded (the kernel has the element from then on), and the fast path drops
them itself after the lag; an element with a timeout: dropped while it surely lives, passed once it surely expired.
"""

from __future__ import annotations

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

LAB = "ipx"
STATE = f"/run/hypafilter/test-{LAB}"
FW = f"{LAB}-fw"
hf = HfCli(LAB, STATE)
BANNED = "10.0.1.77"
CNT_FORWARDED, CNT_DROPPED, CNT_SETS_UNKNOWN = 2, 3, 13  # hfx_cnt indices (driver/xdp/hf_fastpath.h)


@pytest.fixture(scope="module")
def lab():
    with hf.xdp_lab():
        yield LAB


SCALE = int(os.environ.get("HF_SETS_SCALE", "10000"))  # networks in the blocklist (`make test-sets-scale`: 200,000)


def blocklist(n: int = SCALE, seed: int = 7) -> str:
    """`ipset save` text: bl (hash:net, n networks, some with nomatch holes), svc (hash:ip,port: tcp, udp, icmp),
    np (hash:net,port with a nomatch hole), bp (bitmap:port)."""
    rng = random.Random(seed)
    lines = [f"create bl hash:net family inet hashsize 4096 maxelem {max(65536, 2 * n)}"]
    nets = set()
    while len(nets) < n:
        plen = rng.choice((16, 20, 24, 24, 24, 28, 32))
        a = rng.getrandbits(32) & (0xFFFFFFFF << (32 - plen)) & 0xFFFFFFFF
        if a >> 24 in (0, 127, 224, 255):
            continue
        nets.add((a, plen))
    for i, (a, plen) in enumerate(sorted(nets)):
        lines.append(f"add bl {a >> 24}.{a >> 16 & 255}.{a >> 8 & 255}.{a & 255}/{plen}")
        if plen <= 24 and i % 50 == 0:  # a nomatch hole inside: the longest matching prefix decides
            h = a | (rng.getrandbits(32 - plen) & ~0xFF & ((1 << (32 - plen)) - 1))
            lines.append(f"add bl {h >> 24}.{h >> 16 & 255}.{h >> 8 & 255}.0/26 nomatch")
    lines += [
        "create svc hash:ip,port family inet hashsize 1024 maxelem 65536",
        "add svc 10.0.2.1,tcp:80",
        "add svc 10.0.2.1,udp:53",
        "add svc 10.0.2.1,icmp:echo-request",
        "add svc 10.0.2.2,tcp:443",
        "create np hash:net,port family inet hashsize 1024 maxelem 65536",
        "add np 10.0.0.0/16,tcp:22",
        "add np 10.0.1.0/24,tcp:22 nomatch",
        "create bp bitmap:port range 0-2048",
        "add bp 25",
        "add bp 1000",
    ]
    return "\n".join(lines) + "\n"


POLICY = """*filter
:FORWARD ACCEPT [0:0]
-A FORWARD -m set --match-set bl src -j DROP
-A FORWARD -m set --match-set svc dst,dst -j ACCEPT
-A FORWARD -p tcp -m set --match-set np src,dst -j DROP
-A FORWARD -p tcp -m set ! --match-set svc dst,dst -m tcp --dport 1:1024 -j DROP
-A FORWARD -m set --match-set bp dst -j ACCEPT
-A FORWARD -m set ! --match-set bl dst -p udp -j DROP
COMMIT
"""


def synced(timeout: float = 10.0) -> None:
    """Wait until the deployed program's set tables equal the kernel's sets (the policy sync service released them)."""
    from hypafilter.ops import deploy
    from hypafilter.targets.xdp import sets as setmaps
    from hypafilter.targets.xdp.target import _shape_of

    st = deploy.read_state(Path(STATE) / "state.json")
    sm = setmaps.SetMaps(st["nic"]["pin"], _shape_of(st["nic"])["sets"], FW)
    try:
        deadline = time.monotonic() + timeout
        while not sm.current():
            assert time.monotonic() < deadline, "the set tables were not released"
            time.sleep(0.005)
    finally:
        sm.close()


def counters():
    from hypafilter.ops import deploy
    from hypafilter.targets.bpfmap import PinnedArray, percpu_sum

    st = deploy.read_state(Path(STATE) / "state.json")
    m = PinnedArray(Path(st["nic"]["pin"]) / "hfx_cnt")
    return lambda i: percpu_sum(m, i)


def test_blocklist_and_allow_list_verify(lab, tmp_path):
    """10,000 networks with nomatch holes, an allow list by destination address and port, `!` matches: every set
    match a slot of the xdp program (lint says so), 0 mismatches against the kernel, frames decided in XDP."""
    sets, pol = tmp_path / "sets.save", tmp_path / "p.rules"
    sets.write_text(blocklist())
    pol.write_text(POLICY)
    out = hf("lint", str(pol), "--ipsets", str(sets), "--target", "xdp").stdout
    assert "set matches: 5 set slot(s)" in out and "complex:" not in out.split("set matches:")[1], out
    hf("deploy", str(pol), "--ipsets", str(sets), "--target", "xdp", "--json")
    synced()
    r = json.loads(hf("verify", str(pol), "--target", "xdp", "--packets", "4000", "--json").stdout)
    assert r["packets"] == 4000 and r["mismatches"] == 0, r["examples"][:3]
    assert r["hw_dropped"] > 200 and r["hw_forwarded"] > 200, r["nic"]
    assert r["nic"]["CNT_SETS_UNKNOWN"] == 0, r["nic"]


def _run_sender(src: str, seconds: float, rate: float, sent: list, stop: threading.Event) -> None:
    from hypafilter.ops.verify import DST_MAC, build_frame, raw_socket

    s = raw_socket(f"{LAB}-send", "hyb0")
    h = {"src": _ip(src), "dst": _ip("10.0.2.1"), "proto": 17, "sport": 4000, "dport": 9, "flags": 0}
    uid, t_end = 1, time.monotonic() + seconds
    try:
        while time.monotonic() < t_end and not stop.is_set():
            t = time.monotonic()
            s.send(build_frame(uid, h, b"x" * 16, DST_MAC))
            sent.append((uid, t))
            uid += 1
            time.sleep(max(0.0, 1.0 / rate - (time.monotonic() - t)))
    finally:
        s.close()


def _ip(text: str) -> int:
    a, b, c, d = (int(x) for x in text.split("."))
    return a << 24 | b << 16 | c << 8 | d


def _received(sock) -> set[int]:
    from hypafilter.ops.verify import frame_id, receive

    return {u for u in (frame_id(f) for f in receive(sock, quiet=0.3)) if u is not None}


def _deploy_ban(tmp_path, timeout: int) -> None:
    (tmp_path / "ban.save").write_text(
        f"create ban hash:ip family inet hashsize 1024 maxelem 65536 timeout {timeout}\n"
    )
    (tmp_path / "ban.rules").write_text(
        "*filter\n:FORWARD ACCEPT [0:0]\n-A FORWARD -m set --match-set ban src -j DROP\nCOMMIT\n"
    )
    hf("deploy", str(tmp_path / "ban.rules"), "--ipsets", str(tmp_path / "ban.save"), "--target", "xdp", "--json")
    synced()


def test_ban_added_during_traffic(lab, tmp_path):
    """`ipset add ban SRC` while SRC sends: no frame of SRC that left after the command returned is forwarded (the
    kernel drops them; a fast path still deciding by its old table would forward them), and after the lag the fast
    path drops them itself. The lag (command returned -> first frame dropped in XDP) is printed."""
    from hypafilter.ops.verify import raw_socket

    _deploy_ban(tmp_path, 600)
    cnt = counters()
    recv = raw_socket(f"{LAB}-recv", "hyb0")
    sent: list = []
    stop = threading.Event()
    th = threading.Thread(target=_run_sender, args=(BANNED, 1.6, 5000, sent, stop))
    th.start()
    time.sleep(0.5)
    dropped0 = cnt(CNT_DROPPED)
    t_call = time.monotonic()
    subprocess.run(["ip", "netns", "exec", FW, "ipset", "add", "ban", BANNED], check=True)
    t_ret = time.monotonic()
    lag = None
    while th.is_alive():
        if lag is None and cnt(CNT_DROPPED) > dropped0:
            lag = time.monotonic() - t_ret
        time.sleep(0.0002)
    got = _received(recv)
    recv.close()
    after = [u for u, t in sent if t > t_ret]
    before = [u for u, t in sent if t < t_call - 0.05]
    leaked = sorted(set(after) & got)
    assert not leaked, f"{len(leaked)} frames of the banned source forwarded after the ban: {leaked[:5]}"
    assert len(set(before) & got) >= 0.9 * len(before), "frames before the ban should pass"
    assert lag is not None, "the fast path never dropped the banned source itself"
    print(f"ban lag (ipset add returned -> first frame dropped in XDP): {lag * 1e3:.1f} ms")
    # once it dropped one, the fast path drops the banned source's frames itself: most of those sent after that
    # moment (not a share of all sent after the command: the lag is load's, 624 ms in a loaded run that sent half
    # of its frames before it)
    after_lag = [u for u, t in sent if t > t_ret + lag]
    assert cnt(CNT_DROPPED) - dropped0 >= 0.8 * len(after_lag) > 0, (len(after_lag), len(after))
    subprocess.run(["ip", "netns", "exec", FW, "ipset", "del", "ban", BANNED], check=True)


def test_timeout_entry_expires(lab, tmp_path):
    """An element added with `timeout 4`: its frames are dropped while it surely lives (by XDP itself until the
    window around its expiry), passed once it has surely expired, and the fast path forwards them again itself
    after the service removed the element (never deciding inside the window: those frames go to the stack)."""
    from hypafilter.ops.verify import raw_socket

    _deploy_ban(tmp_path, 600)
    cnt = counters()
    recv = raw_socket(f"{LAB}-recv", "hyb0")
    t_call = time.monotonic()
    subprocess.run(["ip", "netns", "exec", FW, "ipset", "add", "ban", BANNED, "timeout", "4"], check=True)
    t_ret = time.monotonic()
    synced()
    d0, f0, u0 = cnt(CNT_DROPPED), cnt(CNT_FORWARDED), cnt(CNT_SETS_UNKNOWN)
    sent: list = []
    _run_sender(BANNED, 5.8, 500, sent, threading.Event())
    got = _received(recv)
    recv.close()
    alive = [u for u, t in sent if t < t_call + 4 - 0.1]
    gone = [u for u, t in sent if t > t_ret + 4 + 0.1]
    assert alive and gone
    assert not set(alive) & got, "frames forwarded while the element lived"
    assert set(gone) <= got, f"{len(set(gone) - got)} frames dropped after the element expired"
    # `ipset save` says 3 s left (whole seconds, rounded down): the window opens 2 s after the read (targets.xdp.sets)
    early = [u for u, t in sent if t < t_ret + 1.8]
    assert cnt(CNT_DROPPED) - d0 >= 0.9 * len(early), "the fast path did not drop the live element's frames"
    assert cnt(CNT_SETS_UNKNOWN) > u0, "no frame was left to the stack around the expiry"
    assert cnt(CNT_FORWARDED) - f0 > 0, "the fast path never forwarded the frames after the element was removed"


NL_SENDS = r"""
import socket, struct
IPSET_ADD, IPSET_PROTOCOL = 9, 1  # ipset commands (linux/netfilter/ipset/ip_set.h); NFNL_SUBSYS_IPSET is 6


def msg(cmd, seq):
    attrs = struct.pack("=HHB3x", 5, 1, 7) + struct.pack("=HH12s", 16, 2, b"hfx-no-such")  # protocol 7, set name
    body = struct.pack("=BBH", socket.AF_INET, 0, 0) + attrs
    return struct.pack("=IHHII", 16 + len(body), 6 << 8 | cmd, 1 | 4, seq, 0) + body  # NLM_F_REQUEST | NLM_F_ACK


s = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, 12)  # NETLINK_NETFILTER
s.sendto(msg(IPSET_ADD, 1), (0, 0))  # a set-changing command (refused: no such set), by sendto
s.recv(65536)
s.sendmsg([msg(IPSET_ADD, 2)], [], 0, (0, 0))  # ... by sendmsg
s.recv(65536)
s.sendto(msg(IPSET_PROTOCOL, 3), (0, 0))  # a read-only one: not counted
s.recv(65536)
"""


def test_watcher_counts_only_set_changing_sends(lab, tmp_path):
    """The watcher counts an ipset command that changes a set into the socket's namespace, started and finished,
    whether sent by sendto or sendmsg, and not a read-only one; its programs sit on the per-syscall tracepoints of
    the sends and of setsockopt (perf_event links), not on the raw sys_enter/sys_exit tracepoints every syscall of the
    host would pay for (docs/sets.md "Its cost"). Its new-flow count (hfx_ctseq, docs/xdp.md "Following the
    configuration") takes an nf_tables batch that adds a rule and a legacy raw table replacement, not a batch that
    only adds a table and chain or deletes, a listing, nor a replacement of another legacy table."""
    import shutil
    import struct
    import sys

    from hypafilter import netns
    from hypafilter.ops import deploy
    from hypafilter.targets.bpfmap import PinnedMap
    from hypafilter.targets.xdp import sets as setmaps

    _deploy_ban(tmp_path, 600)
    pin = Path(deploy.read_state(Path(STATE) / "state.json")["nic"]["pin"])
    watcher = Path(os.readlink(pin / "hfx_setseq")).parent
    seq = PinnedMap(pin / "hfx_setseq")
    key = struct.pack("<I", setmaps.netns_inum(FW))
    counts = lambda: struct.unpack("<QQ", seq.get(key) or bytes(16))  # noqa: E731 (no entry before a first command)
    try:
        s0, f0 = counts()
        subprocess.run(["ip", "netns", "exec", FW, sys.executable, "-c", NL_SENDS], check=True)
        s1, f1 = counts()
    finally:
        seq.close()
    assert (s1 - s0, f1 - f0) == (2, 2), (s0, f0, s1, f1)
    ct = PinnedMap(watcher / "hfx_ctseq")
    ctc = lambda: struct.unpack("<QQ", ct.get(key) or bytes(16))  # noqa: E731
    try:
        c0 = ctc()
        netns.run(["nft", "add table ip q8t; add chain ip q8t c"], FW)
        netns.run(["nft", "list", "ruleset"], FW)
        netns.run(["nft", "delete table ip q8t"], FW)
        for op in ("-N", "-X"):
            netns.run(["iptables-legacy", "-t", "mangle", op, "q8x"], FW)
        c1 = ctc()
        netns.run(["nft", "add table ip q8t; add chain ip q8t c; add rule ip q8t c counter"], FW)
        for op in ("-N", "-X"):
            netns.run(["iptables-legacy", "-t", "raw", op, "q8x"], FW)
        c2 = ctc()
        netns.run(["nft", "delete table ip q8t"], FW)
    finally:
        ct.close()
    assert c1 == c0, (c0, c1)
    assert c2[0] - c1[0] >= 3 and c2[0] == c2[1], (c1, c2)  # (the policy sync service's own follow may add its own)
    links = sorted(watcher.glob("link_*"))
    assert len(links) == 8, links
    if shutil.which("bpftool"):
        for link in links:
            out = subprocess.run(["bpftool", "-j", "link", "show", "pinned", str(link)], capture_output=True, text=True)
            assert json.loads(out.stdout)["type"] == "perf_event", (link, out.stdout)


def test_a_target_without_set_tables_keeps_set_rules_complex(tmp_path):
    """sume's bitstream has no membership tables yet (`set_slots` 0): every set match stays complex there, while the
    emulated NIC (tables in its core) and xdp make it a slot."""
    sets, pol = tmp_path / "sets.save", tmp_path / "p.rules"
    sets.write_text(blocklist(50))
    pol.write_text(POLICY)
    out = hf("lint", str(pol), "--ipsets", str(sets), "--target", "sume", "--no-kernel").stdout
    assert "set matches: 0 set slot(s)" in out and "target sume has no set slots" in out, out
    out = hf("lint", str(pol), "--ipsets", str(sets), "--target", "emu", "--no-kernel").stdout
    assert "set matches: 0 set slot(s)" not in out, out


def test_live_rule_change_keeps_the_set_slots(lab, tmp_path):
    """A rule added with `iptables` while a set policy is deployed: the policy sync service reads the live ruleset
    with the live sets (not as set-less complex rules), so the program keeps its set slot and the ban stays a
    fast-path drop; status lists the slot as followed."""
    _deploy_ban(tmp_path, 600)
    subprocess.run(
        ["ip", "netns", "exec", FW, "iptables", "-A", "FORWARD", "-p", "tcp", "--dport", "7", "-j", "DROP"], check=True
    )
    hf.followed()
    st = json.loads(hf("status", "--json").stdout)
    assert st["sets"]["slots"] == ["ban (hash:ip) by src"] and st["drift"] == [], (st["sets"], st["drift"])
    assert st["policysync"]["sets"]["following"], st["policysync"]
    synced()
    out = hf("status").stdout
    assert "sets     1 slot(s) in the fast path: ban (hash:ip) by src; following the kernel's sets" in out, out
