"""The reference test topology (ARCHITECTURE §7) in network namespaces: `hypafilter lab up|down|status`.

    <name>-send  hyb0 ──── wire0 ┐ <name>-nic (emulated NIC, started by deploy) ┌ wire1 ──── hyb0  <name>-recv
                                 └ host0 ── nf0 ┐ <name>-fw br0 ┌ nf1 ── host1 ┘
                 plain0 ── nf0 ┐ <name>-plain br0 (original policy only) ┌ nf1 ── plain0

Hybrid path: sender 10.0.1.1/16, receiver 10.0.2.1/16. Plain path: sender 10.1.1.1/16, receiver 10.1.2.1/16
(its own addresses, so sender and receiver route each path by subnet). Both bridges have br_netfilter on
(net.bridge.bridge-nf-call-iptables=1 in that namespace), so their iptables FORWARD chains see bridged
packets. The plain bridge and its ports have the firewall's names (br0, nf0 in, nf1 out), so a policy's interface
checks (-i/-o, physdev) see the same devices on both paths and the oracle judges them as the firewall would.
All offloads are off on every lab interface.

IPv6 (docs/ipv6.md, "Deploy and verify"): the sender and the receiver carry it, with static addresses beside their
IPv4 ones (hybrid path fd48:4600::1:1/64 and ::2:1, plain path fd48:4601::1:1/64 and ::2:1) and nothing they would
send on their own: no link-local address (addr_gen_mode 1), no duplicate address detection, no router solicitation
or advertisement handling, and their MLD reports dropped at output (the nftables table `hf_lab6`), so every frame on
the paths is one verify sent or one of a connection it runs. The NIC, firewall and plain namespaces keep IPv6 off:
their bridges still hand IPv6 frames to ip6tables (br_netfilter needs no IPv6 address), and their own stacks take
no IPv6 frame, so nothing there answers one.

Host mode (`Lab.host_mode(True)`, for policies of the INPUT chain): the firewall and the plain namespace terminate
the traffic. Both bridges get the same MAC (HOST_MAC) and address, and every IPv4 destination is local to them
(`local 0.0.0.0/0 dev lo`, accept_local), so a frame sent to HOST_MAC reaches INPUT whatever its destination
address and the policy's -d rules mean the same on both. The nftables table `hf_host` records every frame that
INPUT let through (chain at hook input, priority 100, after the filter table: its source MAC, which carries the
frame id, goes into the set `seen`) and drops everything the namespace itself would send (replies, RSTs, ICMP
errors: output hook before conntrack), so no reply loops back into INPUT.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from hypafilter import netns
from hypafilter.errors import HypafilterError
from hypafilter.targets import shim as shim_mod
from hypafilter.targets.xdp.target import PIN_ROOT as XDP_PIN_ROOT

HOST_MTU = 1600  # host0/host1 and nf0/nf1 carry frames grown by the 10-byte in-band tag
IPV6_ROLES = ("send", "recv")  # the lab namespaces whose stacks carry IPv6 (the module text)
# Before any interface exists, so each gets these: no link-local address, no DAD, no router discovery.
IPV6_QUIET = {
    "disable_ipv6": "0",
    "addr_gen_mode": "1",
    "accept_dad": "0",
    "dad_transmits": "0",
    "router_solicitations": "0",
    "accept_ra": "0",
    "autoconf": "0",
}
LAB6_TABLE = "hf_lab6"
# MLD reports and dones (130-132, 143) and router solicitations (133) the endpoints' stacks would send on their own
LAB6_NFT = f"""table ip6 {LAB6_TABLE}
delete table ip6 {LAB6_TABLE}
table ip6 {LAB6_TABLE} {{
  chain out {{
    type filter hook output priority -300; policy accept;
    icmpv6 type {{ 130, 131, 132, 133, 143 }} drop
  }}
}}
"""


class LabError(HypafilterError):
    """A lab name, role or address that does not exist (a failed command raises netns.CommandError)."""


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
    Link("send", "plain0", "plain", "nf0"),
    Link("plain", "nf1", "recv", "plain0"),
)
# Target xdp (docs/xdp.md): no NIC between the wire and the firewall; the firewall's bridge ports face the wire and
# carry the XDP fast path. The nic namespace stays (empty), so every lab has the same namespaces.
XDP_LINKS = (
    Link("send", "hyb0", "fw", "nf0"),
    Link("fw", "nf1", "recv", "hyb0"),
    Link("send", "plain0", "plain", "nf0"),
    Link("plain", "nf1", "recv", "plain0"),
)
LAB_TARGETS = {"emu": LINKS, "xdp": XDP_LINKS}
BRIDGES = {"fw": ("br0", ("nf0", "nf1")), "plain": ("br0", ("nf0", "nf1"))}
ADDRS = (
    Addr("send", "hyb0", "10.0.1.1/16", "02:48:46:00:01:01"),
    Addr("recv", "hyb0", "10.0.2.1/16", "02:48:46:00:02:01"),
    Addr("send", "plain0", "10.1.1.1/16", "02:48:46:01:01:01"),
    Addr("recv", "plain0", "10.1.2.1/16", "02:48:46:01:02:01"),
)
ADDRS6 = (
    Addr("send", "hyb0", "fd48:4600::1:1/64", "02:48:46:00:01:01"),
    Addr("recv", "hyb0", "fd48:4600::2:1/64", "02:48:46:00:02:01"),
    Addr("send", "plain0", "fd48:4601::1:1/64", "02:48:46:01:01:01"),
    Addr("recv", "plain0", "fd48:4601::2:1/64", "02:48:46:01:02:01"),
)
NIC_INTERFACES = {"wire0": "wire0", "wire1": "wire1", "host0": "host0", "host1": "host1"}
# Host mode: the address the firewall and the oracle share, and the table that observes local delivery.
HOST_MAC = "02:48:46:00:fe:01"
HOST_CIDR = "10.254.0.1/16"
HOST_TABLE = "hf_host"
HOST_SEEN_MAX = 1 << 20  # frames one run can observe (size of the set)
HOST_ROLES = ("fw", "plain")


def host_nft(bridge: str) -> str:
    """The observing table of host mode (see the module text)."""
    return f"""table inet {HOST_TABLE}
delete table inet {HOST_TABLE}
table inet {HOST_TABLE} {{
  set seen {{ type ether_addr; size {HOST_SEEN_MAX}; flags dynamic; }}
  chain observe {{
    type filter hook input priority 100; policy accept;
    iifname "{bridge}" ether saddr & ff:ff:00:00:00:00 == 0e:48:00:00:00:00 add @seen {{ ether saddr }}
  }}
  chain quiet {{
    type filter hook output priority -300; policy drop;
  }}
}}
"""


class _RoleNs:
    """`lab.ns_<role>`: the full name of that role's namespace."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.role = name.removeprefix("ns_")

    def __get__(self, lab: Lab, owner: type | None = None) -> str:
        return lab.ns(self.role)


class Lab:
    """The lab of one name; every namespace it owns is `<name>-<role>`."""

    def __init__(self, name: str = "hf", target: str = "emu"):
        if not name or len(name) > 8 or name[0] == "-" or not name.replace("_", "").replace("-", "").isalnum():
            raise LabError(f"lab name '{name}' must be 1-8 letters, digits, _ or - (not first)")
        if target not in LAB_TARGETS:
            raise LabError(f"no lab topology for target '{target}' (one of {', '.join(LAB_TARGETS)})")
        self.name = name
        self.target = target
        self.links = LAB_TARGETS[target]

    def built_for(self) -> str | None:
        """The target the existing lab was built for (None: no firewall namespace yet)."""
        names = netns.names()
        if self.ns_fw not in names:
            return None
        if self.ns_nic in names and any(self._has_link("nic", i) for i in NIC_INTERFACES):
            return "emu"
        # nf0 is one end of a veth pair: with no NIC interface left, its other end is the sender's (xdp topology).
        return "xdp" if self._has_link("fw", "nf0") else None

    # ---- names the deploy/verify code uses ----
    def ns(self, role: str) -> str:
        if role not in ROLES:
            raise LabError(f"unknown lab role '{role}' (one of {', '.join(ROLES)})")
        return f"{self.name}-{role}"

    ns_send = _RoleNs()
    ns_nic = _RoleNs()
    ns_fw = _RoleNs()
    ns_recv = _RoleNs()
    ns_plain = _RoleNs()

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
    def ip6(role: str, path: str = "hyb") -> str:
        """IPv6 address (no prefix) of the sender or receiver on the hybrid ("hyb") or plain ("plain") path."""
        for a in ADDRS6:
            if a.role == role and a.ifname == f"{path}0":
                return a.cidr.split("/")[0]
        raise LabError(f"no IPv6 address for {role}/{path}0")

    @staticmethod
    def mac(role: str, path: str = "hyb") -> str:
        return Lab.address(role, f"{path}0").mac

    def _full(self, ns: str) -> str:
        return self.ns(ns) if ns in ROLES else ns

    def exec_in(self, ns: str, argv: list[str], **kw) -> str:
        """Run argv inside namespace `ns` (a full name or a role); returns its stdout. `kw`: netns.run's input,
        check and timeout."""
        return netns.run(argv, self._full(ns), **kw)

    def popen_in(self, ns: str, argv: list[str], **kw) -> subprocess.Popen:
        return netns.popen(argv, self._full(ns), **kw)

    # ---- state ----
    def namespaces(self) -> list[str]:
        present = set(netns.names())
        return [self.ns(r) for r in ROLES if self.ns(r) in present]

    def _has_link(self, role: str, ifname: str) -> bool:
        return netns.succeeds(["ip", "-n", self.ns(role), "link", "show", "dev", ifname])

    def up(self) -> None:
        """Create whatever is missing; running it again changes nothing."""
        built = self.built_for()
        if built not in (None, self.target):
            raise LabError(f"lab {self.name} is up for target {built}: take it down first (hypafilter lab down)")
        existing = set(self.namespaces())
        for role in ROLES:
            ns = self.ns(role)
            if ns not in existing:
                netns.add(ns)
            # Before any interface exists, so none of them ever gets an address of its own or sends solicitations.
            if role in IPV6_ROLES:
                self._ipv6_quiet(ns)
            else:
                for key in ("all", "default"):
                    self.exec_in(ns, ["sysctl", "-qw", f"net.ipv6.conf.{key}.disable_ipv6=1"], check=False)
            netns.run(["ip", "-n", ns, "link", "set", "lo", "up"])
        for link in self.links:
            a, b = self._has_link(link.a_role, link.a_if), self._has_link(link.b_role, link.b_if)
            if not (a and b):
                # Half of a pair (broken, or a lab from before an end was renamed): replace it.
                for role, ifname, present in ((link.a_role, link.a_if, a), (link.b_role, link.b_if, b)):
                    if present:
                        netns.run(["ip", "-n", self.ns(role), "link", "del", ifname])
                netns.veth(link.a_if, self.ns(link.a_role), link.b_if, self.ns(link.b_role), link.mtu)
        for role, (br, ports) in BRIDGES.items():
            ns = self.ns(role)
            if not self._has_link(role, br):
                netns.run(["ip", "-n", ns, "link", "add", br, "type", "bridge", "stp_state", "0", "forward_delay", "0"])
            for port in ports:
                netns.run(["ip", "-n", ns, "link", "set", port, "master", br])
            self._bridge_nf(role)
        for a in ADDRS:
            ns = self.ns(a.role)
            netns.run(["ip", "-n", ns, "link", "set", a.ifname, "address", a.mac])
            netns.run(["ip", "-n", ns, "addr", "replace", a.cidr, "dev", a.ifname])
        for a in ADDRS6:
            netns.run(["ip", "-n", self.ns(a.role), "addr", "replace", a.cidr, "dev", a.ifname, "nodad"])
        for link in self.links:
            for role, ifname in ((link.a_role, link.a_if), (link.b_role, link.b_if)):
                netns.offloads_off(ifname, self.ns(role))
                netns.run(["ip", "-n", self.ns(role), "link", "set", ifname, "up"])
        if self.target == "xdp":
            # A native XDP_REDIRECT into a veth lands in its peer's NAPI ring, which exists only while the peer
            # has an XDP program or GRO: the wire ends of the hybrid path get GRO (docs/xdp.md, Lab).
            for role in ("send", "recv"):
                netns.run(["ethtool", "-K", "hyb0", "gro", "on"], self.ns(role))
        for role, (br, _) in BRIDGES.items():
            netns.run(["ip", "-n", self.ns(role), "link", "set", br, "up"])

    def _ipv6_quiet(self, ns: str) -> None:
        """IPv6 on in `ns` with nothing sent on its own (IPV6_QUIET, LAB6_NFT): the default for new interfaces and
        each existing one (a lab built while IPv6 was off) set first, IPv6 switched on last."""
        self.exec_in(ns, ["nft", "-f", "-"], input=LAB6_NFT)
        links = [ln["ifname"] for ln in json.loads(netns.run(["ip", "-n", ns, "-j", "link", "show"]) or "[]")]
        quiet = {k: v for k, v in IPV6_QUIET.items() if k != "disable_ipv6"}
        for key in ("default", *links, "all"):
            sets = [f"net.ipv6.conf.{key}.{k}={v}" for k, v in quiet.items()]
            self.exec_in(ns, ["sysctl", "-qw", *sets], check=False)
        for key in ("default", *links, "all"):
            self.exec_in(ns, ["sysctl", "-qw", f"net.ipv6.conf.{key}.disable_ipv6=0"], check=False)

    def host_mode(self, on: bool, ipv6: bool = False) -> None:
        """Host mode on (the bridges terminate traffic, local delivery observed) or off (bridge mode as built).
        `ipv6`: the bridges take IPv6 frames to their own stacks too (every IPv6 destination local, as IPv4's; no
        address of their own, nothing sent: IPV6_QUIET, and the observing table drops all output); else IPv6 stays
        off there."""
        for role in HOST_ROLES:
            ns, br = self.ns(role), BRIDGES[role][0]
            self._host6(ns, br, on and ipv6)
            if on:
                netns.run(["ip", "-n", ns, "link", "set", br, "address", HOST_MAC])
                netns.run(["ip", "-n", ns, "addr", "replace", HOST_CIDR, "dev", br])
                netns.run(["ip", "-n", ns, "route", "replace", "local", "0.0.0.0/0", "dev", "lo", "table", "local"])
                for key in ("all", br):
                    self.exec_in(ns, ["sysctl", "-qw", f"net.ipv4.conf.{key}.accept_local=1"])
                    self.exec_in(ns, ["sysctl", "-qw", f"net.ipv4.conf.{key}.rp_filter=0"])
                self.exec_in(ns, ["nft", "-f", "-"], input=host_nft(br))
            else:
                self.exec_in(ns, ["nft", "delete", "table", "inet", HOST_TABLE], check=False)
                netns.run(
                    ["ip", "-n", ns, "route", "del", "local", "0.0.0.0/0", "dev", "lo", "table", "local"], check=False
                )
                netns.run(["ip", "-n", ns, "addr", "del", HOST_CIDR, "dev", br], check=False)

    def _host6(self, ns: str, br: str, on: bool) -> None:
        local6 = ["ip", "-n", ns, "-6", "route"]
        if on:
            quiet = [
                f"net.ipv6.conf.{i}.{k}={v}" for i in (br, "lo") for k, v in IPV6_QUIET.items() if k != "disable_ipv6"
            ]
            self.exec_in(ns, ["sysctl", "-qw", *quiet])
            self.exec_in(ns, ["sysctl", "-qw", f"net.ipv6.conf.{br}.disable_ipv6=0", "net.ipv6.conf.lo.disable_ipv6=0"])
            netns.run([*local6, "replace", "local", "::/0", "dev", "lo", "table", "local"])
        else:
            netns.run([*local6, "del", "local", "::/0", "dev", "lo", "table", "local"], check=False)
            self.exec_in(
                ns,
                ["sysctl", "-qw", f"net.ipv6.conf.{br}.disable_ipv6=1", "net.ipv6.conf.lo.disable_ipv6=1"],
                check=False,
            )

    def host_seen(self, role: str, reset: bool = False) -> set[int]:
        """Frame ids INPUT let through in `role`'s namespace since the last reset (host mode)."""
        ns = self.ns(role)
        out = json.loads(self.exec_in(ns, ["nft", "-j", "list", "set", "inet", HOST_TABLE, "seen"]))
        ids = set()
        for item in out.get("nftables", []):
            for e in item.get("set", {}).get("elem", []):
                mac = e if isinstance(e, str) else e.get("elem", {}).get("val", "")
                ids.add(int(mac.replace(":", "")[4:], 16))
        if reset:
            self.exec_in(ns, ["nft", "flush", "set", "inet", HOST_TABLE, "seen"])
        return ids

    def flush_conntrack(self, role: str) -> None:
        """Forget every connection `role`'s namespace tracks, so that one run's entries never decide the next's."""
        flush_conntrack(self.ns(role))

    def _bridge_nf(self, role: str) -> None:
        key = Path("/proc/sys/net/bridge/bridge-nf-call-iptables")
        if not key.exists():
            netns.run(["modprobe", "br_netfilter"], check=False)
        if not netns.succeeds(["sysctl", "-qw", "net.bridge.bridge-nf-call-iptables=1"], self.ns(role)):
            raise LabError(f"cannot turn on br_netfilter in {self.ns(role)} (is the br_netfilter module loaded?)")

    def down(self) -> list[str]:
        """Delete this lab's namespaces (and with them every interface and bridge); returns what was removed."""
        removed = []
        for ns in self.namespaces():
            for pid in netns.pids(ns):
                # Processes still inside (an emulated NIC, a capture) would keep the namespace's interfaces alive.
                netns.run(["kill", str(pid)], check=False)
            netns.run(["ip", "netns", "del", ns])
            removed.append(ns)
        # The shim's pinned maps outlive the namespace: without this a new lab of the name would find them.
        shutil.rmtree(shim_mod.pin_dir(self.ns_fw), ignore_errors=True)
        shutil.rmtree(XDP_PIN_ROOT / self.name, ignore_errors=True)  # the xdp target's program, maps and links
        return removed

    def status(self) -> dict:
        """Per namespace: its interfaces with state, MTU and IPv4 addresses; missing namespaces are absent."""
        out: dict = {"name": self.name, "namespaces": {}, "complete": False}
        present = self.namespaces()
        for ns in present:
            links = json.loads(netns.run(["ip", "-n", ns, "-j", "addr", "show"]) or "[]")
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
        need = {(lk.a_role, lk.a_if) for lk in self.links} | {(lk.b_role, lk.b_if) for lk in self.links}
        out["complete"] = len(present) == len(ROLES) and all(
            ifname in out["namespaces"].get(self.ns(role), {}) for role, ifname in need
        )
        return out


def flush_conntrack(ns: str) -> None:
    """Forget every connection network namespace `ns` tracks (ctnetlink through pyroute2)."""
    from pyroute2 import Conntrack

    with netns.inside(ns):
        ct = Conntrack()
        # pyroute2 opens its netlink socket on first use: open it here, inside the namespace, where it then stays
        # (else the flush below emptied the caller's namespace's table and left this one's as it was).
        ct.asyncore.socket  # noqa: B018
    try:
        ct.flush()
    finally:
        ct.close()
