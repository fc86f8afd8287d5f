"""The emulated NIC's ports as veth pairs between two fresh network namespaces: its own side and the outside one
from which a benchmark or a test sends and captures frames (the bare setup, without the lab's netfilter host)."""

from __future__ import annotations

from collections.abc import Iterable

from hypafilter import netns


def veth_ports(ns_nic: str, ns_out: str, pairs: Iterable[tuple[str, str]], mtu: int) -> None:
    """Recreate ns_nic and ns_out (IPv6 off, so no router solicitation lands among the frames counted) and join
    them by one veth pair per (interface in ns_nic, peer in ns_out), every link up at `mtu`."""
    remove(ns_nic, ns_out)
    for ns in (ns_nic, ns_out):
        netns.add(ns)
        for scope in ("all", "default"):
            netns.run(["sysctl", "-qw", f"net.ipv6.conf.{scope}.disable_ipv6=1"], ns)
    for nic_if, peer in pairs:
        here = [nic_if, "netns", ns_nic, "mtu", str(mtu)]
        there = [peer, "netns", ns_out, "mtu", str(mtu)]
        netns.run(["ip", "link", "add", *here, "type", "veth", "peer", "name", *there])
        netns.run(["ip", "-n", ns_nic, "link", "set", nic_if, "up"])
        netns.run(["ip", "-n", ns_out, "link", "set", peer, "up"])


def remove(*namespaces: str) -> None:
    """Delete the namespaces (their veth ends, and so the pairs, go with them); absent ones are skipped."""
    for ns in namespaces:
        netns.delete(ns)
