"""Per-rule state and conntrack state against the kernel: the hardware must not decide a frame whose walk through
the original policy would have touched state (a limit's bucket, conntrack's view of a connection). Each test sends
the same traffic through the hybrid path and the policy alone in the plain namespace, in a lab of its own, and
failed on the code before its fix."""

from __future__ import annotations

import socket
import time

import pytest
from hypafilter.netns import inside

pytestmark = pytest.mark.system

LAB = "tex2"


def parse(text: str, name: str):
    from hypafilter.config import Config
    from hypafilter.iptables.document import parse_policy

    return parse_policy(text, filename=name, base_chain="FORWARD", config=Config())


def deploy_both(lab, policy, **cfg) -> None:
    """The policy deployed and alone in the plain namespace; then both ends resolve each other's address on both
    paths (static neighbour entries), so the first datagram is not lost to address resolution on a loaded
    machine."""
    from hypafilter import netns
    from hypafilter.config import Config
    from hypafilter.ops import deploy
    from hypafilter.ops.verify import load_oracle

    deploy.deploy(policy, Config(**cfg))
    load_oracle(lab.ns_plain, policy)
    for path in ("hyb", "plain"):
        for a, b in (("send", "recv"), ("recv", "send")):
            ip = ["ip", "neigh", "replace", lab.ip(b, path), "lladdr", lab.mac(b, path), "dev", f"{path}0"]
            netns.run([*ip, "nud", "permanent"], lab.ns(a))


@pytest.mark.parametrize(("mode", "strategy"), [("selective", "interval"), ("exact", "full"), ("index", "interval")])
def test_header_checks_after_a_limit_do_not_skip_it(lab, mode, strategy):
    """`-m limit ... -m udp --dport 80`: the kernel takes a token for every UDP datagram before it tests the port.
    The rule's hardware region used to be UDP/80 only, so datagrams to port 81 were accepted by the hardware
    without touching the bucket and the later port-80 datagrams still found tokens (3 delivered; kernel: 0)."""
    from hypafilter.ops.connections import udp_delivered

    pol = parse(
        "*filter\n:FORWARD DROP [0:0]\n"
        "-A FORWARD -p udp -m limit --limit 1/hour --limit-burst 3 -m udp --dport 80 -j ACCEPT\n"
        "-A FORWARD -p udp -m udp --dport 81 -j ACCEPT\nCOMMIT\n",
        "limitport.rules",
    )
    deploy_both(lab, pol, shunt_mode=mode, strategy=strategy)
    sends = [(81, b"x%d" % i) for i in range(3)] + [(80, b"y%d" % i) for i in range(3)]
    plain = udp_delivered(lab.ns_send, lab.ns_recv, lab.ip("recv", "plain"), sends)
    hyb = udp_delivered(lab.ns_send, lab.ns_recv, lab.ip("recv", "hyb"), sends)
    assert [p for p, _ in plain] == [81, 81, 81], plain  # the three tokens went to the port-81 datagrams
    assert hyb == plain


def test_recent_set_sees_every_packet_before_its_port_check(lab):
    """`-m recent --set -m tcp --dport 22`: every TCP packet that reaches the rule is added to the list, whatever
    its port; a later rule that reads the list must see the same addresses on both paths."""
    from hypafilter.ops.connections import TcpServers, tcp_talk

    pol = parse(
        "*filter\n:FORWARD ACCEPT [0:0]\n"
        "-A FORWARD -p tcp -m recent --set --name seen --rsource -m tcp --dport 22 -j ACCEPT\n"
        "-A FORWARD -p tcp -m tcp --dport 8080 -j ACCEPT\n"
        "-A FORWARD -p tcp -m recent --rcheck --hitcount 3 --name seen --rsource -m tcp --dport 5001 --syn -j DROP\n"
        "COMMIT\n",
        "recentport.rules",
    )
    deploy_both(lab, pol, shunt_mode="selective")
    got = {}
    with TcpServers(lab.ns_recv, [8080, 5001]):
        for path in ("plain", "hyb"):
            dst = lab.ip("recv", path)
            first = tcp_talk(lab.ns_send, dst, 8080, timeout=1.0)
            then = tcp_talk(lab.ns_send, dst, 5001, timeout=1.0)
            got[path] = (first is not None, then is not None)
    # The kernel: the packets of the connection to 8080 put the sender on the list, so the SYN to 5001 finds
    # at least 3 entries and is dropped; on the code before the fix the hardware accepted them unseen.
    assert got["plain"] == (True, False), got
    assert got["hyb"] == got["plain"]


def _udp_dialogue(lab, path: str, sport: int, rounds: int = 2) -> list[bytes]:
    """The sender sends to the receiver's port 5353 from `sport`; the receiver answers each datagram it gets
    (from 5353, back to `sport`). Returns what the receiver got, in order."""
    dst = lab.ip("recv", path)
    with inside(lab.ns_recv):
        srv = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        srv.bind(("0.0.0.0", 5353))
        srv.settimeout(2.0)
    with inside(lab.ns_send):
        cli = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        cli.bind(("0.0.0.0", sport))
    got = []
    try:
        for i in range(rounds):
            cli.sendto(b"q%d" % i, (dst, 5353))
            try:
                data, peer = srv.recvfrom(2048)
            except TimeoutError:
                continue
            got.append(data)
            srv.sendto(b"r" + data, peer)  # the reply the policy drops
            time.sleep(0.2)
    finally:
        cli.close()
        srv.close()
    return got


@pytest.mark.parametrize("mode", ["selective", "exact", "index"])
def test_a_dropped_reply_still_establishes_the_connection(lab, mode):
    """The kernel's conntrack sees a reply in PREROUTING before the filter drops it: the connection is then
    ESTABLISHED, and the next datagram of the original direction is no longer NEW. The hardware dropped the
    reply itself (only ACCEPT was shunted when the policy reads conntrack), so on the hybrid the second datagram
    was still NEW and was accepted (kernel: dropped)."""
    pol = parse(
        "*filter\n:FORWARD DROP [0:0]\n"
        "-A FORWARD -p udp -m udp --sport 5353 -j DROP\n"
        "-A FORWARD -p udp -m udp --dport 5353 -m conntrack --ctstate NEW -j ACCEPT\nCOMMIT\n",
        "ctreply.rules",
    )
    deploy_both(lab, pol, shunt_mode=mode)
    sport = {"selective": 40001, "exact": 40002, "index": 40003}[mode]
    plain = _udp_dialogue(lab, "plain", sport)
    hyb = _udp_dialogue(lab, "hyb", sport)
    assert plain == [b"q0"], plain
    assert hyb == plain


def test_trailing_bytes_reach_the_receiver_as_the_kernel_sends_them(lab):
    """A frame with bytes after its IPv4 datagram: br_netfilter trims it to the total length before the filter
    runs, so the kernel forwards the trimmed frame. The hardware forwarded what it accepted untrimmed (altered
    frames); now such frames are unparsed and netfilter forwards them as the kernel does."""
    from hypafilter.config import Config
    from hypafilter.ops.verify import verify

    pol = parse(
        "*filter\n:FORWARD DROP [0:0]\n-A FORWARD -p udp -j ACCEPT\n-A FORWARD -p tcp -j ACCEPT\nCOMMIT\n",
        "trailing.rules",
    )
    r = verify(pol, Config(), packets=300, seed=3, malformed=1.0, kinds=("trailing_bytes",))
    assert r["delivered_oracle"] > 100
    assert r["altered"] == 0 and r["mismatches"] == 0, r["examples"][:2]
