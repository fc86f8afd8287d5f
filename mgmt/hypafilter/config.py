"""Site configuration (TOML): mark bits, interface-to-hardware-port mapping, flattening bound, targets."""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path

from hypafilter.errors import HypafilterError

# The shunting modes (paper §V: index-based, Alg. 1 selective; exact: complex reductions in hardware) and the
# software strategies (paper §VI, plus interval_geo), named once for the analysis, the CLI and the configuration.
MODES = ("index", "selective", "exact")
STRATEGIES = ("full", "cut", "hsa_cut", "interval", "interval_geo", "tree")
# Log mirroring (docs/compiler.md) applies to these modes and strategies only: the copy of a decided frame runs the
# interval chain above its entry and is then discarded; full/cut/hsa_cut would run deciding simple rules on it, and
# exact mode has no interval chain of that shape.
MIRROR_MODES = ("index", "selective")
MIRROR_STRATEGIES = ("interval", "interval_geo", "tree")


def mirrors(mode: str, strategy: str) -> bool:
    """Whether observing rules (LOG, NFLOG, no target) are mirrored rather than shunted for this mode and strategy."""
    return mode in MIRROR_MODES and strategy in MIRROR_STRATEGIES


# How the NIC meets the host ("auto": from the policy's chain), and the base chain each mode's frames reach.
NIC_MODES = ("bridge", "host")
MODE_CHAIN = {"bridge": "FORWARD", "host": "INPUT"}
NIC_PORTS = 4  # MAC0..MAC3 (ARCHITECTURE §3)
# The SFL update buffer of the generated core (ARCHITECTURE §8): slots by default and at most. Each slot costs
# about 200 LUTs and 290 FFs (docs/hardware.md, "Update buffer (SFL)"), so the bound keeps a typo from asking for a
# huge core.
UPDATE_BUFFER_DEFAULT = 16
UPDATE_BUFFER_MAX = 256
# The policy sync lease (Config.policysync_lease_ms): the service renews it every POLICYSYNC_LEASE_RENEW_S; a lease
# shorter than a few renewals would run out under ordinary scheduling delays, one longer than an hour is no bound.
POLICYSYNC_LEASE_DEFAULT_MS = 1000
POLICYSYNC_LEASE_RENEW_S = 0.15
POLICYSYNC_LEASE_MIN_MS = 500
POLICYSYNC_LEASE_MAX_MS = 3_600_000
IFNAMSIZ = 16  # the kernel's limit: names of at most 15 characters


def pair(port: int) -> int:
    """The port a bridged frame leaves by: MAC0 <-> MAC1, MAC2 <-> MAC3 (hw/hf_output.vhd, bridge mode)."""
    return port ^ 1


def valid_ifname(name: str) -> bool:
    return 0 < len(name) < IFNAMSIZ and not any(c.isspace() or c in "/:" for c in name) and name not in (".", "..")


@dataclass(frozen=True)
class Interfaces:
    """What the deployment knows about the interfaces the NIC's frames reach netfilter through.

    ports  -- (host interface name, NIC port MACn) of every NIC port in use, by port; a NIC frame that came in on
              port n enters the firewall by the interface of n and leaves by the interface of pair(n)
    bridge -- the bridge device those interfaces are ports of ("" = unknown: then the frames' input and output
              device are unknown and -i/-o stay checks for software; no port is guessed either)
    """

    bridge: str = ""
    ports: tuple[tuple[str, int], ...] = ()

    @property
    def bridged(self) -> bool:
        return bool(self.bridge)

    def port(self, name: str) -> int | None:
        return next((p for n, p in self.ports if n == name), None)

    @property
    def all_ports(self) -> set[int]:
        return {p for _, p in self.ports}

    def name(self, port: int) -> str | None:
        return next((n for n, p in self.ports if p == port), None)

    def describe(self) -> str:
        ports = ", ".join(f"{n}=MAC{p}" for n, p in self.ports)
        if not self.bridge:
            return f"ports {ports} (no bridge)" if ports else "nothing known"
        return f"bridge {self.bridge}, ports {ports}"


@dataclass
class Config:
    # Mark: value (k << 4 | action) is written as (mark & ~mark_mask) | ((value << mark_shift) & mark_mask).
    mark_mask: int = 0xFFFFFFFF
    mark_shift: int = 0
    # The deployment's interfaces (docs/configuration.md, Interfaces): the host interface of each NIC port
    # (name -> MAC index 0..3) and the bridge those interfaces are ports of. Without `bridge` only
    # `--physdev-in NAME` of a mapped NAME is resolved (field iport); every other interface check stays complex.
    hw_ports: dict[str, int] = field(default_factory=dict)
    bridge: str = ""
    # Upper bound on the rules one jump may expand to when flattening user chains; above it the jump stays
    # a complex rule and the user chain is loaded verbatim in software.
    flatten_bound: int = 4096
    # Shunting mode: "index", "selective" (paper Alg. 1) or "exact" (complex reductions in hardware).
    shunt_mode: str = "selective"
    # Software strategy: one of STRATEGIES.
    strategy: str = "interval"
    # Strategy tree (docs/optimize.md, "The hybrid's software side"): the shortest run of movable rules walked as a
    # decision tree (2..; chains of twice as many policy lines get trees, leaves hold up to half as many rules).
    tree_min_segment: int = 16
    # Netfilter table/base chain the tool hooks into, and the prefix of every chain it owns.
    table: str = "filter"
    chain_prefix: str = "HF"
    # Frames the bridge's netfilter cannot filter (two VLAN tags, 802.1Q or 802.1ad): "drop" them in the NIC
    # (counted in CNT_DROP_UNFILTERABLE), or "pass" them to the host bridge, which forwards them unfiltered
    # exactly as the kernel does (CONTROL bit 2, PASS_UNFILTERABLE).
    unfilterable: str = "drop"
    # How the NIC meets the host: "bridge" (a port pair; the policy is the bridged FORWARD chain), "host" (the
    # host terminates the traffic; the policy is INPUT, and a hardware ACCEPT reaches the host marked "decided":
    # CONTROL bit 3, HOST_MODE) or "auto" (the mode of the policy's chain: INPUT host, FORWARD bridge).
    nic_mode: str = "auto"
    # Where deploy, verify and bench run the fast path: "emu" (the emulated NIC), "xdp" (an XDP program on the
    # firewall's wire-facing interfaces, docs/xdp.md) or "sume". `--target` overrides it.
    target: str = "emu"
    # xdp: attach in generic (skb) mode instead of native (driver) mode.
    xdp_generic: bool = False
    # xdp with an IPv6 policy (--ipv6): the XDP program decides IPv6 frames by it as well (docs/ipv6.md "## xdp"),
    # IPv6 TCP on the conntrack entries the flow sync service marks liberal as IPv4's; false: every IPv6 frame goes
    # to ip6tables unparsed (stage 1).
    xdp_ipv6: bool = True
    # emu with an IPv6 policy (--ipv6): the emulated NIC's core is built with the IPv6 plan too (a dual-stack core,
    # docs/ipv6.md "## emu") and decides the IPv6 frames it parses, passing the shunted ones with their interval's k to
    # ip6tables' interval chains; false: every IPv6 frame goes to ip6tables unparsed (stage 1).
    emu_ipv6: bool = True
    # Hardware generation parameters.
    tdata_width: int = 256
    encoder_fanin: int = 8
    # The flow cache built into the emulated NIC's core: "LOG2_SETS:WAYS" (2**LOG2_SETS sets of WAYS entries,
    # 4,096..65,536 entries in all, at most 16 ways), or "none" for a core without one (ct is then always 0).
    flow_cache: str = "10:4"
    # Slots (δ) of the core's update buffer (ARCHITECTURE §8, analysis.overlay): rule changes the running matcher
    # takes without a rebuild, 0..UPDATE_BUFFER_MAX; 0 = none (the valid mask over the static entries remains).
    # It shapes the hardware: hw.vhdl.matcher_hash includes it, so a change of it builds a new core.
    update_buffer: int = UPDATE_BUFFER_DEFAULT
    # The policy sync lease (docs/deploy.md, "Live policy"): the fast path decides only while the policy sync service
    # renewed it within this many milliseconds (it renews every POLICYSYNC_LEASE_RENEW_S); a service killed for good
    # leaves every frame to the live ruleset at most this long after. 0: no lease (the fast path keeps deciding by
    # the last tables when the service is gone), else POLICYSYNC_LEASE_MIN_MS..POLICYSYNC_LEASE_MAX_MS.
    policysync_lease_ms: int = POLICYSYNC_LEASE_DEFAULT_MS

    @classmethod
    def load(cls, path: str | Path | None) -> Config:
        if path is None:
            return cls()
        p = Path(path)
        try:
            data = tomllib.loads(p.read_text())
        except (OSError, tomllib.TOMLDecodeError) as e:
            raise HypafilterError(f"{p}: cannot read configuration: {e}") from e
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise HypafilterError(f"{p}: unknown configuration keys: {', '.join(sorted(unknown))}")
        cfg = cls(**data)
        cfg.validate(str(p))
        return cfg

    def validate(self, where: str = "configuration") -> None:
        if self.shunt_mode not in MODES:
            raise HypafilterError(f"{where}: shunt_mode must be one of {', '.join(MODES)}")
        if self.strategy not in STRATEGIES:
            raise HypafilterError(f"{where}: strategy must be one of {', '.join(STRATEGIES)}")
        if not isinstance(self.tree_min_segment, int) or self.tree_min_segment < 2:
            raise HypafilterError(f"{where}: tree_min_segment must be an integer of at least 2")
        if self.unfilterable not in ("drop", "pass"):
            raise HypafilterError(f"{where}: unfilterable must be drop or pass")
        if self.nic_mode not in ("auto", *NIC_MODES):
            raise HypafilterError(f"{where}: nic_mode must be auto, bridge or host")
        if self.target not in ("emu", "xdp", "sume"):
            raise HypafilterError(f"{where}: target must be emu, xdp or sume")
        if self.tdata_width not in (256, 512):
            raise HypafilterError(f"{where}: tdata_width must be 256 or 512")
        self.flow_cache_geometry(where)
        if (
            not isinstance(self.update_buffer, int)
            or isinstance(self.update_buffer, bool)
            or not 0 <= self.update_buffer <= UPDATE_BUFFER_MAX
        ):
            raise HypafilterError(
                f"{where}: update_buffer must be a whole number of slots, 0..{UPDATE_BUFFER_MAX} (0: no update "
                f"buffer), not {self.update_buffer!r}"
            )
        lease = self.policysync_lease_ms
        if (
            not isinstance(lease, int)
            or isinstance(lease, bool)
            or not (lease == 0 or POLICYSYNC_LEASE_MIN_MS <= lease <= POLICYSYNC_LEASE_MAX_MS)
        ):
            raise HypafilterError(
                f"{where}: policysync_lease_ms must be 0 (no lease) or {POLICYSYNC_LEASE_MIN_MS}.."
                f"{POLICYSYNC_LEASE_MAX_MS} milliseconds, not {lease!r}"
            )
        for name, port in self.hw_ports.items():
            if not isinstance(port, int) or not 0 <= port < NIC_PORTS:
                raise HypafilterError(f"{where}: hw_ports[{name!r}] must be 0..{NIC_PORTS - 1}")
            if not valid_ifname(name):
                raise HypafilterError(f"{where}: hw_ports: {name!r} is not an interface name")
        taken = sorted(self.hw_ports.values())
        if len(set(taken)) != len(taken):
            raise HypafilterError(f"{where}: hw_ports maps two interfaces to one NIC port")
        if self.bridge:
            if not valid_ifname(self.bridge):
                raise HypafilterError(f"{where}: bridge {self.bridge!r} is not an interface name")
            if self.bridge in self.hw_ports:
                raise HypafilterError(f"{where}: bridge {self.bridge!r} is also listed in hw_ports")
            if not self.hw_ports:
                raise HypafilterError(f"{where}: bridge needs hw_ports (the NIC's host interfaces in it)")
            lonely = sorted(p for p in taken if pair(p) not in taken)
            if lonely:
                raise HypafilterError(
                    f"{where}: hw_ports names MAC{lonely[0]} but not its pair MAC{pair(lonely[0])}: in bridge mode "
                    "frames in on one port of a pair leave on the other, so both ports' interfaces are needed"
                )

    def flow_cache_geometry(self, where: str = "configuration") -> tuple[int, int] | None:
        """(LOG2_SETS, WAYS) of `flow_cache`, or None for "none"."""
        text = str(self.flow_cache).strip()
        if text == "none":
            return None
        try:
            log2_sets, ways = (int(x) for x in text.split(":"))
        except ValueError:
            raise HypafilterError(
                f"{where}: flow_cache must be LOG2_SETS:WAYS (e.g. 10:4) or none, not {self.flow_cache!r}"
            ) from None
        if not 1 <= ways <= 16 or log2_sets < 1 or not 4096 <= ways << log2_sets <= 65536:
            raise HypafilterError(
                f"{where}: flow_cache {self.flow_cache!r}: WAYS must be 1..16 and WAYS * 2**LOG2_SETS 4,096..65,536"
            )
        return log2_sets, ways

    @property
    def interfaces(self) -> Interfaces:
        return Interfaces(self.bridge, tuple(sorted(self.hw_ports.items(), key=lambda kv: kv[1])))

    def mode_for(self, chain: str) -> str:
        """The NIC mode a policy of base chain `chain` is compiled for: nic_mode, or with "auto" host for INPUT and
        bridge otherwise (nic_mode_for says whether it can be deployed)."""
        if self.nic_mode != "auto":
            return self.nic_mode
        return "host" if chain == MODE_CHAIN["host"] else "bridge"

    def nic_mode_for(self, chain: str) -> str:
        """The NIC mode that deploys a policy of base chain `chain` ("bridge" or "host"), or an error saying why
        none does: OUTPUT never (the NIC never sees locally generated packets), INPUT in host mode, FORWARD in
        bridge mode."""
        if chain == "OUTPUT":
            raise HypafilterError(
                "chain OUTPUT cannot be deployed on a NIC: the NIC never sees the packets the host itself generates "
                "(deploy INPUT in host mode or FORWARD in bridge mode)"
            )
        for mode, base in MODE_CHAIN.items():
            if chain == base:
                if self.nic_mode not in ("auto", mode):
                    raise HypafilterError(
                        f"chain {chain} needs nic_mode = {mode!r} (the configuration says {self.nic_mode!r}): in "
                        f"{self.nic_mode} mode the NIC's frames reach the {MODE_CHAIN[self.nic_mode]} chain"
                    )
                return mode
        raise HypafilterError(f"chain {chain} cannot be deployed on a NIC (INPUT in host mode, FORWARD in bridge mode)")
