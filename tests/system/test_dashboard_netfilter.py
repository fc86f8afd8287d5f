"""Dashboard collector against the real kernel: the compiler's chains loaded in a fresh namespace, packets sent
through them with the marks the shim would write, and the per-rule netfilter counts checked against iptables."""

from __future__ import annotations

import sys

import pytest
from hypafilter import netns
from hypafilter.analysis.plan import build_plan
from hypafilter.analysis.program import build_program, mark_for
from hypafilter.config import Config
from hypafilter.iptables.document import parse_policy
from hypafilter.netfilter.restore import to_iptables_restore
from hypafilter.tools.dashboard.collector import Collector

from conftest import need_root, need_tool

pytestmark = pytest.mark.system

NS = "hfdash-nf"
GEN = 5
POLICY = """-P OUTPUT ACCEPT
-A OUTPUT -p udp --dport 53 -j ACCEPT
-A OUTPUT -p udp --dport 9999 -m string --string "BAD" --algo bm -j DROP
-A OUTPUT -p udp --dport 9999 -j ACCEPT
-A OUTPUT -p udp --dport 7000 -j DROP
"""

SEND = r"""
import socket, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
for spec in sys.argv[1:]:
    port, payload, count = spec.split(":")
    for _ in range(int(count)):
        try:
            s.sendto(payload.encode(), ("10.9.0.2", int(port)))
        except PermissionError:
            pass  # an OUTPUT DROP
"""


def nsx(*argv: str, input: str | None = None) -> str:
    return netns.run(argv, NS, input=input)


@pytest.fixture
def namespace():
    need_root()
    need_tool("ip", "iptables", "iptables-save", "iptables-restore")
    netns.delete(NS)
    netns.add(NS)
    try:
        nsx("ip", "link", "set", "lo", "up")
        # A veth pair inside the namespace with a static neighbour: packets leave without ARP and vanish.
        nsx("ip", "link", "add", "v0", "type", "veth", "peer", "name", "v1")
        nsx("ip", "addr", "add", "10.9.0.1/24", "dev", "v0")
        nsx("ip", "link", "set", "v0", "up")
        nsx("ip", "link", "set", "v1", "up")
        nsx("ip", "neigh", "add", "10.9.0.2", "lladdr", "02:00:00:00:09:02", "dev", "v0")
        yield
    finally:
        netns.delete(NS)


def test_netfilter_counts_per_rule_from_the_kernel(namespace, tmp_path):
    config = Config()
    path = tmp_path / "out.rules"
    path.write_text(POLICY)
    policy = parse_policy(POLICY, str(path), "OUTPUT", config)
    plan = build_plan(policy, config)
    prefix = f"HF{GEN}_"
    nsx("iptables-restore", "-w", "--noflush", input=to_iptables_restore(plan, "interval", prefix))
    nsx("iptables", "-w", "-I", "OUTPUT", "1", "-j", f"{prefix}MAIN")
    # What the shim would write for packets that first match rule 2 (dport 9999) in hardware.
    entry = next(e for e, en in enumerate(plan.entries) if en.rule_index == 2)
    assert plan.shunt[entry], "rule 2 shunts: the string rule above it may overrule it"
    mark = mark_for(build_program(plan, "interval", prefix), int(plan.interval[entry]), int(plan.actions[entry]))
    nsx(
        "iptables",
        "-w",
        "-t",
        "mangle",
        "-A",
        "OUTPUT",
        "-p",
        "udp",
        "--sport",
        "40000",
        "-j",
        "MARK",
        "--set-mark",
        hex(mark),
    )

    state = {
        "generation": GEN,
        "prefix": prefix,
        "policy_hash": policy.policy_hash(),
        "policy_source": str(path),
        "base_chain": "OUTPUT",
        "mode": config.shunt_mode,
        "strategy": "interval",
        "shim": {"netns": NS},
        "nic": {"socket": str(tmp_path / "no-nic.sock")},
    }
    collector = Collector(state_reader=lambda: state)

    # Marked (shunted with rule 2's interval): 5 BAD (the string rule in C<k> drops them), 3 clean (leaf ACCEPT).
    marked = r"""
import socket
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.bind(("10.9.0.1", 40000))
for payload, n in ((b"BAD!", 5), (b"fine", 3)):
    for _ in range(n):
        try:
            s.sendto(payload, ("10.9.0.2", 9999))
        except PermissionError:
            pass
"""
    nsx(sys.executable, "-c", marked)
    # Unmarked (k = 0, the full policy): 4 DNS (rule 0), 2 BAD to 9999 (rule 1), 6 to 7000 (rule 3).
    nsx(sys.executable, "-c", SEND, "53:q:4", "9999:BAD:2", "7000:x:6")

    snap = collector.snapshot()
    assert snap.deployment is not None and snap.deployment.prefix == prefix
    assert [e for e in snap.errors if not e.startswith("NIC:")] == []  # no NIC here: that source fails alone
    assert snap.nf_main[0] == 5 + 3 + 4 + 2 + 6
    assert snap.nf[0][0] == 4
    assert snap.nf[1][0] == 5 + 2  # in C<k> for the shunted ones, in FULL for the unmarked ones
    assert snap.nf[3][0] == 6
    assert snap.nf.get(2, (0, 0))[0] == 0  # decided by the leaf's action, not a line of its own in C<k>

    # Independent read: the string rules' counters as `iptables -L -v -x` prints them.
    listing = nsx("iptables", "-w", "-L", "-v", "-x", "-n")
    string_packets = sum(int(line.split()[0]) for line in listing.splitlines() if "STRING match" in line)
    assert string_packets == snap.nf[1][0]
