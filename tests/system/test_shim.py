"""System test of the eBPF shim: tagged frames into a bridged firewall namespace; popped frames and marks checked."""

from __future__ import annotations

import re
import time

import pytest
from hypafilter import netns

from conftest import need_root, need_tool

pytestmark = pytest.mark.system

S, F, R = "hfts-send", "hfts-fw", "hfts-recv"
GEN = 5
INTERVALS = [3, 7, 9, 0, 11]  # k per match_index; index 3 maps to k = 0 (no interval: full policy)


def teardown() -> None:
    for n in (S, F, R):
        netns.delete(n)


@pytest.fixture(scope="module")
def topo():
    need_root()
    need_tool("ip", "iptables", "clang", "tc", "make")
    from hypafilter.targets.shim import Shim

    teardown()
    for n in (S, F, R):
        netns.add(n)
    netns.veth("s0", S, "nf0", F)
    netns.veth("r0", R, "nf1", F)
    for n, ifs in ((S, ["s0"]), (R, ["r0"]), (F, ["nf0", "nf1"])):
        netns.run(["sysctl", "-qw", "net.ipv6.conf.all.disable_ipv6=1"], n)
        for i in ifs:
            netns.run(["ip", "-n", n, "link", "set", i, "up"])
    netns.run(["ip", "-n", F, "link", "add", "br0", "type", "bridge"])
    for i in ("nf0", "nf1"):
        netns.run(["ip", "-n", F, "link", "set", i, "master", "br0"])
    netns.run(["ip", "-n", F, "link", "set", "br0", "up"])
    netns.run(["sysctl", "-qw", "net.bridge.bridge-nf-call-iptables=1"], F)
    shim = Shim(F, ["nf0", "nf1"])
    shim.load()
    yield shim
    shim.unload()
    teardown()


def load_rules(marks: dict[int, int | None]) -> None:
    """FORWARD: UDP to port P is accepted only with mark marks[P] (None: with any mark, for frames that must never
    get here at all); everything else on those ports is dropped."""
    lines = ["*filter", ":FORWARD ACCEPT [0:0]"]
    for port, mark in marks.items():
        with_mark = "" if mark is None else f" -m mark --mark {mark:#x}"
        lines.append(f"-A FORWARD -p udp --dport {port}{with_mark} -j ACCEPT")
        lines.append(f"-A FORWARD -p udp --dport {port} -j DROP")
    lines.append("COMMIT")
    netns.run(["iptables-restore"], F, input="\n".join(lines) + "\n")


def rule_counts() -> dict[tuple[str, int], int]:
    """Packets per (ACCEPT|DROP, destination port) rule of FORWARD."""
    out = netns.run(["iptables", "-w", "-L", "FORWARD", "-nvx"], F)
    counts: dict[tuple[str, int], int] = {}
    for line in out.splitlines():
        m = re.match(r"\s*(\d+)\s+\d+\s+(ACCEPT|DROP)\s.*dpt:(\d+)", line)
        if m:
            counts[(m.group(2), int(m.group(3)))] = int(m.group(1))
    return counts


def accept_counts() -> dict[int, int]:
    return {port: n for (target, port), n in rule_counts().items() if target == "ACCEPT"}


def frame(port: int, uid: int) -> bytes:
    from scapy.layers.inet import IP, UDP
    from scapy.layers.l2 import Ether

    payload = b"HFID%08d" % uid + b"x" * 24
    pkt = (
        Ether(src="02:00:00:00:00:01", dst="02:00:00:00:00:02")
        / IP(src="10.9.0.1", dst="10.9.0.2")
        / UDP(sport=4000, dport=port)
    )
    return bytes(pkt / payload)


def exchange(frames: list[bytes]) -> list[bytes]:
    from hypafilter.ops.verify import drain, raw_socket, receive, send

    tx = raw_socket(S, "s0")
    rx = raw_socket(R, "r0")
    drain(rx)
    send(tx, frames)
    got = [f for f in receive(rx, quiet=0.3) if b"HFID" in f]
    tx.close()
    rx.close()
    return got


def test_native_xdp_attached(topo):
    for i in ("nf0", "nf1"):
        out = netns.run(["ip", "-n", F, "-d", "link", "show", i])
        assert "prog/xdp " in out and "xdpgeneric" not in out, out
        assert "hf_tc" in netns.run(["tc", "-n", F, "filter", "show", "dev", i, "ingress"])


def test_marks_and_pop(topo):
    from hypafilter import shared
    from hypafilter.targets.shim import mark_value, tag_frame

    shim = topo
    shim.update(INTERVALS, generation=GEN, mark_mask=0xFFFFFFFF, mark_shift=0, num_entries=len(INTERVALS))
    shim.stats(reset=True)
    pm = shared.pack_meta
    cases = {
        # port: (metadata or None for untagged, expected mark)
        5001: (pm(0, 1, 0, GEN), mark_value(3, 1)),
        5002: (pm(1, 2, 0, GEN), mark_value(7, 2)),
        5003: (pm(4, 0, 1, GEN), mark_value(11, 0)),
        5004: (pm(2, 1, 0, GEN) ^ (1 << 60), 0),  # bad magic
        5005: (pm(1, 1, 0, GEN + 1), 0),  # stale generation
        5006: (pm(1, 1, 2, GEN), 0),  # unparsed
        5007: (pm(len(INTERVALS), 1, 0, GEN), 0),  # index out of range
        5008: (pm(3, 1, 0, GEN), 0),  # interval k = 0
        5009: (None, 0),  # untagged
    }
    assert mark_value(3, 1) == 0x31
    load_rules({p: m for p, (_, m) in cases.items()})
    originals, sent = {}, []
    for i, (port, (meta, _)) in enumerate(cases.items()):
        f = frame(port, i)
        originals[i] = f
        sent.append(f if meta is None else tag_frame(f, meta))
    got = exchange(sent)
    # Every frame came out of the bridge exactly as it was before the NIC tagged it.
    by_id = {int(g[g.index(b"HFID") + 4 : g.index(b"HFID") + 12]): g for g in got}
    assert sorted(by_id) == sorted(originals), f"arrived {sorted(by_id)}"
    for i, f in originals.items():
        assert by_id[i] == f, f"frame {i} changed"
    counts = accept_counts()
    assert counts == {p: 1 for p in cases}, counts
    st = shim.stats()
    assert st["tagged"] == 8 and st["bad_magic"] == 1 and st["stale_gen"] == 1 and st["unparsed"] == 1, st
    assert st["marked"] == 3, st
    assert st["untagged"] >= 1


def test_mark_mask_and_shift(topo):
    from hypafilter import shared
    from hypafilter.targets.shim import mark_value, tag_frame

    shim = topo
    shim.update(INTERVALS, generation=GEN, mark_mask=0x0000FFF0, mark_shift=4, num_entries=len(INTERVALS))
    want = (mark_value(9, 2) << 4) & 0xFFF0
    load_rules({5101: want, 5102: 0})
    got = exchange(
        [
            tag_frame(frame(5101, 101), shared.pack_meta(2, 2, 0, GEN)),
            tag_frame(frame(5102, 102), shared.pack_meta(2, 2, 2, GEN)),
        ]
    )
    assert len(got) == 2
    assert accept_counts() == {5101: 1, 5102: 1}
    shim.update(mark_mask=0xFFFFFFFF, mark_shift=0)


def test_bulk_update_fast(topo):
    shim = topo
    values = [(i * 7919) % 100000 + 1 for i in range(120000)]
    t = time.monotonic()
    shim.update(values, num_entries=len(values))
    took = time.monotonic() - t
    assert shim.dump(len(values))[-1100:] == values[-1100:]
    assert took < 2.0, f"120000 entries took {took:.2f}s"


# --- log mirroring (reason 4): a trusted copy gets the mark (k << 4) | 0x4 | action; an untrusted one (bad magic,
# stale generation, no interval, a non-decisive action) is dropped in XDP: it never reaches netfilter and is never
# forwarded. Counted in the shim's mirror / mirror_dropped statistics.


def test_mirror_copies_marked_or_dropped(topo):
    from hypafilter import shared
    from hypafilter.targets.shim import mark_value, tag_frame

    shim = topo
    shim.update(INTERVALS, generation=GEN, mark_mask=0xFFFFFFFF, mark_shift=0, num_entries=len(INTERVALS))
    shim.stats(reset=True)
    pm, mirror = shared.pack_meta, shared.HF_REASON_MIRROR
    cases = {
        # port: (metadata, expected mark; None: dropped by the shim)
        5201: (pm(0, 1, mirror, GEN), mark_value(3, 1, mirror=True)),  # copy of an ACCEPT: 0x35
        5202: (pm(1, 2, mirror, GEN), mark_value(7, 2, mirror=True)),  # copy of a DROP: 0x76
        5203: (pm(0, 1, mirror, GEN) ^ (1 << 60), None),  # bad magic
        5204: (pm(0, 1, mirror, GEN + 1), None),  # stale generation
        5205: (pm(len(INTERVALS), 1, mirror, GEN), None),  # index out of range
        5206: (pm(3, 1, mirror, GEN), None),  # interval k = 0
        5207: (pm(0, 0, mirror, GEN), None),  # not a decided action
        5208: (pm(0, 1, 0, GEN), mark_value(3, 1)),  # an ordinary shunt beside them: 0x31
    }
    assert (mark_value(3, 1, mirror=True), mark_value(7, 2, mirror=True)) == (0x35, 0x76)
    load_rules({p: m for p, (_, m) in cases.items()})
    sent = [tag_frame(frame(port, i), meta) for i, (port, (meta, _)) in enumerate(cases.items())]
    got = exchange(sent)
    ids = sorted(int(g[g.index(b"HFID") + 4 : g.index(b"HFID") + 12]) for g in got)
    # only the trusted ones reach netfilter (here accepted on their exact mark, so they come out)
    assert ids == [0, 1, 7], ids
    counts = rule_counts()
    for port, (_, mark) in cases.items():
        want_accept = 0 if mark is None else 1
        assert counts[("ACCEPT", port)] == want_accept and counts[("DROP", port)] == 0, (port, counts)
    st = shim.stats()
    assert st["tagged"] == 8 and st["mirror"] == 2 and st["mirror_dropped"] == 5, st
    assert st["marked"] == 3 and st["bad_magic"] == 1 and st["stale_gen"] == 1, st


def test_mirror_mark_under_mask_and_shift(topo):
    from hypafilter import shared
    from hypafilter.targets.shim import mark_value, tag_frame

    shim = topo
    shim.update(INTERVALS, generation=GEN, mark_mask=0x0000FFF0, mark_shift=4, num_entries=len(INTERVALS))
    want = (mark_value(9, 2, mirror=True) << 4) & 0xFFF0
    assert want == 0x960
    load_rules({5301: want})
    got = exchange([tag_frame(frame(5301, 301), shared.pack_meta(2, 2, shared.HF_REASON_MIRROR, GEN))])
    assert len(got) == 1
    assert rule_counts()[("ACCEPT", 5301)] == 1
    shim.update(mark_mask=0xFFFFFFFF, mark_shift=0)


# --- the live K0 tree (strategy tree, docs/shim.md): with HF_SHIM_CONTROL_K0_TREE an IPv4 frame the core judged
# unparsed (reason 2, match_index n) gets HF_MARK_K0_TREE = 0x3; one it did not judge (CONTROL bit 0 clear, its lease
# expired: match_index 0xFFFFFF), a stale one, a frame that is not IPv4, and every frame without the bit get 0.


def test_judged_unparsed_ipv4_frames_marked_for_the_k0_tree(topo):
    from hypafilter import shared
    from hypafilter.targets.shim import mark_value, tag_frame
    from scapy.layers.inet import UDP
    from scapy.layers.inet6 import IPv6
    from scapy.layers.l2 import Ether

    shim, pm, unp = topo, shared.pack_meta, shared.HF_REASON_UNPARSED
    n, k0 = len(INTERVALS) - 1, shared.HF_MARK_K0_TREE
    cases = {
        # port: (metadata, mark with the control bit, mark without it)
        5401: (pm(n, 0, unp, GEN), k0, 0),  # judged unparsed
        5402: (pm(shared.HF_META_NO_INDEX, 0, unp, GEN), 0, 0),  # not judged: fail safe, lease expired
        5403: (pm(n, 0, unp, GEN + 1), 0, 0),  # stale generation
        5404: (pm(0, 1, 0, GEN), mark_value(3, 1), mark_value(3, 1)),  # an ordinary shunt beside them
    }
    netns.run(["sysctl", "-qw", "net.bridge.bridge-nf-call-ip6tables=1"], F)
    six = "*filter\n:FORWARD ACCEPT [0:0]\n-A FORWARD -p udp --dport 5405 -m mark ! --mark 0 -j DROP\nCOMMIT\n"
    netns.run(["ip6tables-restore"], F, input=six)
    v6 = bytes(
        Ether(src="02:00:00:00:00:01", dst="02:00:00:00:00:02")
        / IPv6(src="fd00::1", dst="fd00::2")
        / UDP(sport=4000, dport=5405)
        / (b"HFID%08d" % 99 + b"x" * 24)
    )
    try:
        for control, col in ((shared.HF_SHIM_CONTROL_K0_TREE, 1), (0, 2)):
            shim.update(INTERVALS, generation=GEN, mark_mask=0xFFFFFFFF, mark_shift=0, num_entries=n + 1)
            shim.update(control=control)
            assert shim.stats()["config"]["control"] == control
            load_rules({p: c[col] for p, c in cases.items()})
            sent = [tag_frame(frame(p, i), c[0]) for i, (p, c) in enumerate(cases.items())]
            got = exchange([*sent, tag_frame(v6, pm(n, 0, unp, GEN))])  # IPv6: never the K0 tree's (no DROP)
            ids = sorted(int(g[g.index(b"HFID") + 4 : g.index(b"HFID") + 12]) for g in got)
            assert ids == [0, 1, 2, 3, 99], (control, ids)
            assert accept_counts() == {p: 1 for p in cases}, (control, rule_counts())
    finally:
        shim.update(control=0)
        netns.run(["ip6tables", "-w", "-F", "FORWARD"], F)
        netns.run(["sysctl", "-qw", "net.bridge.bridge-nf-call-ip6tables=0"], F)
