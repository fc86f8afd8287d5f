"""The reference test topology (ARCHITECTURE §7) in network namespaces: `hypafilter lab up|down|status`.

    <name>-send  hyb0 ──── wire0 ┐ <name>-nic (emulated NIC, started by deploy) ┌ wire1 ──── hyb0  <name>-recv
                                 └ host0 ── nf0 ┐ <name>-fw br0 ┌ nf1 ── host1 ┘
                 plain0 ── p0 ┐ <name>-plain br0 (original policy only) ┌ p1 ── plain0

Hybrid path: sender 10.0.1.1/16, receiver 10.0.2.1/16. Plain path: sender 10.1.1.1/16, receiver 10.1.2.1/16
(its own addresses, so sender and receiver route each path by subnet). Both bridges have br_netfilter on
(net.bridge.bridge-nf-call-iptables=1 in that namespace), so their iptables FORWARD chains see bridged
packets. IPv6 is off in every lab namespace and all offloads are off on every lab interface.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

from hypafilter.errors import HypafilterError

HOST_MTU = 1600  # host0/host1 and nf0/nf1 carry frames grown by the 10-byte in-band tag
OFFLOADS = ("gro", "gso", "tso", "tx", "rx", "sg", "rxvlan", "txvlan", "lro")


class LabError(HypafilterError):
    """A lab step failed; names the command and quotes its stderr."""


@dataclass(frozen=True)
class Link:
    """A veth pair: (namespace role, interface) at each end, plus link options."""

    a_role: str
    a_if: str
    b_role: str
    b_if: str
    mtu: int = 1500


@dataclass(frozen=True)
class Addr:
    role: str
    ifname: str
    cidr: str
    mac: str


ROLES = ("send", "nic", "fw", "recv", "plain")
LINKS = (
    Link("send", "hyb0", "nic", "wire0"),
    Link("nic", "wire1", "recv", "hyb0"),
    Link("nic", "host0", "fw", "nf0", HOST_MTU),
    Link("nic", "host1", "fw", "nf1", HOST_MTU),
    Link("send", "plain0", "plain", "p0"),
    Link("plain", "p1", "recv", "plain0"),
)
BRIDGES = {"fw": ("br0", ("nf0", "nf1")), "plain": ("br0", ("p0", "p1"))}
ADDRS = (
    Addr("send", "hyb0", "10.0.1.1/16", "02:48:46:00:01:01"),
    Addr("recv", "hyb0", "10.0.2.1/16", "02:48:46:00:02:01"),
    Addr("send", "plain0", "10.1.1.1/16", "02:48:46:01:01:01"),
    Addr("recv", "plain0", "10.1.2.1/16", "02:48:46:01:02:01"),
)
NIC_INTERFACES = {"wire0": "wire0", "wire1": "wire1", "host0": "host0", "host1": "host1"}


def _run(argv: list[str], check: bool = True, input: str | None = None, timeout: float | None = 60):
    try:
        p = subprocess.run(argv, capture_output=True, text=True, input=input, timeout=timeout)
    except FileNotFoundError as e:
        raise LabError(f"{argv[0]} is not installed (scripts/setup.sh system installs it)") from e
    if check and p.returncode != 0:
        raise LabError(f"command failed ({p.returncode}): {' '.join(argv)}\n{p.stderr.strip()[-2000:]}")
    return p


class Lab:
    """The lab of one name; every namespace it owns is `<name>-<role>`."""

    def __init__(self, name: str = "hf"):
        if not name or len(name) > 8 or not name.replace("_", "").isalnum():
            raise LabError(f"lab name '{name}' must be 1-8 letters, digits or _")
        self.name = name

    # ---- names the deploy/verify code uses ----
    def ns(self, role: str) -> str:
        if role not in ROLES:
            raise LabError(f"unknown lab role '{role}' (one of {', '.join(ROLES)})")
        return f"{self.name}-{role}"

    @property
    def ns_send(self) -> str:
        return self.ns("send")

    @property
    def ns_nic(self) -> str:
        return self.ns("nic")

    @property
    def ns_fw(self) -> str:
        return self.ns("fw")

    @property
    def ns_recv(self) -> str:
        return self.ns("recv")

    @property
    def ns_plain(self) -> str:
        return self.ns("plain")

    nic_interfaces = NIC_INTERFACES
    fw_ports = ("nf0", "nf1")
    fw_bridge = "br0"
    plain_bridge = "br0"

    @staticmethod
    def address(role: str, ifname: str) -> Addr:
        for a in ADDRS:
            if a.role == role and a.ifname == ifname:
                return a
        raise LabError(f"no address for {role}/{ifname}")

    @staticmethod
    def ip(role: str, path: str = "hyb") -> str:
        """IPv4 address (no prefix) of the sender or receiver on the hybrid ("hyb") or plain ("plain") path."""
        return Lab.address(role, f"{path}0").cidr.split("/")[0]

    @staticmethod
    def mac(role: str, path: str = "hyb") -> str:
        return Lab.address(role, f"{path}0").mac

    def exec_in(
        self, ns: str, argv: list[str], check: bool = True, input: str | None = None, timeout: float | None = 60
    ):
        """Run argv inside namespace `ns` (a full name or a role); returns the CompletedProcess (text)."""
        if ns in ROLES:
            ns = self.ns(ns)
        return _run(["ip", "netns", "exec", ns, *argv], check=check, input=input, timeout=timeout)

    def popen_in(self, ns: str, argv: list[str], **kw) -> subprocess.Popen:
        if ns in ROLES:
            ns = self.ns(ns)
        return subprocess.Popen(["ip", "netns", "exec", ns, *argv], **kw)

    # ---- state ----
    def namespaces(self) -> list[str]:
        out = _run(["ip", "netns", "list"]).stdout.split()
        return [self.ns(r) for r in ROLES if self.ns(r) in out]

    def _has_link(self, role: str, ifname: str) -> bool:
        return _run(["ip", "-n", self.ns(role), "link", "show", "dev", ifname], check=False).returncode == 0

    def up(self) -> None:
        """Create whatever is missing; running it again changes nothing."""
        existing = set(self.namespaces())
        for role in ROLES:
            ns = self.ns(role)
            if ns not in existing:
                _run(["ip", "netns", "add", ns])
            # Before any interface exists, so none of them ever gets an IPv6 address or sends solicitations.
            for key in ("all", "default"):
                self.exec_in(ns, ["sysctl", "-qw", f"net.ipv6.conf.{key}.disable_ipv6=1"], check=False)
            _run(["ip", "-n", ns, "link", "set", "lo", "up"])
        for link in LINKS:
            if not self._has_link(link.a_role, link.a_if):
                if self._has_link(link.b_role, link.b_if):  # half of a broken pair: replace it
                    _run(["ip", "-n", self.ns(link.b_role), "link", "del", link.b_if])
                _run(
                    ["ip", "link", "add", link.a_if, "netns", self.ns(link.a_role), "mtu", str(link.mtu), "type",
                     "veth", "peer", "name", link.b_if, "netns", self.ns(link.b_role), "mtu", str(link.mtu)]
                )  # fmt: skip
        for role, (br, ports) in BRIDGES.items():
            ns = self.ns(role)
            if not self._has_link(role, br):
                _run(["ip", "-n", ns, "link", "add", br, "type", "bridge", "stp_state", "0", "forward_delay", "0"])
            for port in ports:
                _run(["ip", "-n", ns, "link", "set", port, "master", br])
            self._bridge_nf(role)
        for a in ADDRS:
            ns = self.ns(a.role)
            _run(["ip", "-n", ns, "link", "set", a.ifname, "address", a.mac])
            _run(["ip", "-n", ns, "addr", "replace", a.cidr, "dev", a.ifname])
        for link in LINKS:
            for role, ifname in ((link.a_role, link.a_if), (link.b_role, link.b_if)):
                self._offloads_off(role, ifname)
                _run(["ip", "-n", self.ns(role), "link", "set", ifname, "up"])
        for role, (br, _) in BRIDGES.items():
            _run(["ip", "-n", self.ns(role), "link", "set", br, "up"])

    def _bridge_nf(self, role: str) -> None:
        key = Path("/proc/sys/net/bridge/bridge-nf-call-iptables")
        if not key.exists():
            _run(["modprobe", "br_netfilter"], check=False)
        p = self.exec_in(role, ["sysctl", "-qw", "net.bridge.bridge-nf-call-iptables=1"], check=False)
        if p.returncode != 0:
            raise LabError(f"cannot turn on br_netfilter in {self.ns(role)} (is the br_netfilter module loaded?)")

    def _offloads_off(self, role: str, ifname: str) -> None:
        for feature in OFFLOADS:
            self.exec_in(role, ["ethtool", "-K", ifname, feature, "off"], check=False)

    def down(self) -> list[str]:
        """Delete this lab's namespaces (and with them every interface and bridge); returns what was removed."""
        removed = []
        for ns in self.namespaces():
            pids = _run(["ip", "netns", "pids", ns], check=False).stdout.split()
            for pid in pids:
                # Processes still inside (an emulated NIC, a capture) would keep the namespace's interfaces alive.
                _run(["kill", pid], check=False)
            _run(["ip", "netns", "del", ns])
            removed.append(ns)
        return removed

    def status(self) -> dict:
        """Per namespace: its interfaces with state, MTU and IPv4 addresses; missing namespaces are absent."""
        import json  # noqa: PLC0415

        out: dict = {"name": self.name, "namespaces": {}, "complete": False}
        present = self.namespaces()
        for ns in present:
            links = json.loads(_run(["ip", "-n", ns, "-j", "addr", "show"]).stdout or "[]")
            out["namespaces"][ns] = {
                link["ifname"]: {
                    "state": link.get("operstate"),
                    "mtu": link.get("mtu"),
                    "mac": link.get("address"),
                    "master": link.get("master"),
                    "ipv4": [
                        f"{a['local']}/{a['prefixlen']}" for a in link.get("addr_info", []) if a["family"] == "inet"
                    ],
                    "ipv6": [a["local"] for a in link.get("addr_info", []) if a["family"] == "inet6"],
                }
                for link in links
            }
        need = {(lk.a_role, lk.a_if) for lk in LINKS} | {(lk.b_role, lk.b_if) for lk in LINKS}
        out["complete"] = len(present) == len(ROLES) and all(
            ifname in out["namespaces"].get(self.ns(role), {}) for role, ifname in need
        )
        return out
