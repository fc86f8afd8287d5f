"""The Target interface: what deploy needs from a place a Plan runs (build, start, program, switch over, stop).

A target is stateless between commands: everything needed to find a started NIC again is in the `info` dict that
`start` returns, which deploy keeps in its state file. Register access is the same on every target (`NicClient`
over the target's transport), so the table writes, counters and shunt-all switch are implemented here once.
"""

from __future__ import annotations

import contextlib
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from hypafilter.config import Config
from hypafilter.paths import BUILD_ROOT
from hypafilter.targets.nic import NicClient

PORTS = ("wire0", "wire1", "host0", "host1")  # the core's four ports: two to the wire, two to the host

# Counter names every target uses with the NIC's meanings (hw/regmap.txt): every wire frame a target classified
# (PKTIN) counts in exactly one of DECISIONS, decided by the target itself (DECIDED) or shunted to software for one
# of four reasons (SHUNTED; reason 3, "state unknown", is a flow-cache miss forced to conntrack by CONTROL bits 4/5).
DECIDED = ("CNT_FORWARDED", "CNT_DROPPED", "CNT_DROP_UNFILTERABLE")
SHUNTED = ("CNT_SHUNT_OVERRULE", "CNT_SHUNT_POLICY", "CNT_SHUNT_UNPARSED", "CNT_SHUNT_STATE")
DECISIONS = DECIDED + SHUNTED


class CounterSource(Protocol):
    """An open reader of a running NIC's counters (`Target.counter_source`): what the dashboard samples every
    second and verify's counter window polls, kept open between readings where the target has a connection."""

    def counters(self) -> dict[str, int]:
        """PKTIN, PKTOUT and CNT_* with the NIC's meanings, plus any counter of the target's own."""
        ...

    def hits(self, count: int) -> list[int]:
        """Per-entry first matches (the NIC's HITS table) of entries 0..count-1 (count - 1: the policy entry)."""
        ...

    def close(self) -> None: ...


# What a counter window stage must be (WindowStages.balance): a count, or bounds (low, high), both included
# (high math.inf: no upper bound).
Expected = int | tuple[int, int | float]


def stage_met(count: int, expected: Expected) -> bool:
    """Whether a stage's count is what WindowStages.balance says it must be."""
    if isinstance(expected, tuple):
        low, high = expected
        return low <= count <= high
    return count == expected


@dataclass(frozen=True)
class WindowStages:
    """How verify's receive window (ops.verify.CounterWindow) follows the hybrid path's frames through this target's
    part of the lab, from counters: which veth tx counters (`tx`, (lab role, interface)) and counting sockets
    (`taps`, (role, interface, only frames carrying verify's ids)) to read, which of the target's counters
    (`counters`; `lost`: frames the target itself lost, any of them ends the run without a verdict) and `balance`:
    for a reading (ops.verify.CounterWindow.reading) and host mode, each stage's count and what it must be once every
    frame sent has met its fate: a count it must equal, or bounds (low, high) it must lie within, both included.
    The oracle path's stages are the window's own."""

    tx: tuple[tuple[str, str], ...]
    taps: tuple[tuple[str, str, bool], ...]
    counters: tuple[str, ...]
    lost: tuple[str, ...]
    balance: Callable[[dict, bool], dict[str, tuple[int, Expected]]]


@dataclass(frozen=True)
class Site:
    """Where a target's NIC sits on this host: the network namespace holding its ports, the interface of each
    port (PORTS; empty: the target's own defaults) and a name for what it leaves behind (sockets, logs)."""

    name: str = "hf"
    netns: str | None = None
    interfaces: dict[str, str] = field(default_factory=dict)
    run_dir: Path | None = None  # the NIC's sockets, pid files and logs (None: the target's default)


class Target(ABC):
    """One kind of NIC running the core generated for a Plan."""

    name = ""
    # In bridge mode the NIC bridges a port pair and its frames reach the host's bridged FORWARD chain only; in
    # host mode (Config.nic_mode) the host terminates them and INPUT decides. OUTPUT sees none of its frames.
    base_chains: tuple[str, ...] = ("FORWARD", "INPUT")
    # How the flow sync service serves the fast path's conntrack state (ops.flowsync.service.MODES,
    # docs/flowsync.md): "flowcache", the NIC's flow cache follows conntrack; "liberal", the fast path reads
    # conntrack's own table and the service only marks the TCP entries it would offload liberal. And what is left
    # undone while the service that should run does not (its drift).
    flowsync_mode = "flowcache"
    flowsync_down = "the NIC's flow cache does not follow conntrack"
    # Sets in the fast path (docs/sets.md): how many set slots the target's matcher tests (ir.sets.MAX_SET_SLOTS at
    # most; 0: every -m set match stays a complex rule) and the most elements one slot's table holds.
    set_slots = 0
    set_capacity = 0
    set_slots6 = False  # whether an IPv6 plan's set matches on family inet6 sets can be set slots (docs/sets.md)

    def __init__(self, config: Config, site: Site | None = None, build_root: Path = BUILD_ROOT):
        self.config = config
        self.site = site or Site()
        self.build_root = Path(build_root)  # artifacts go under <build_root>/<target name>

    def same_sets(self, info: dict, plan) -> bool:
        """Whether the running NIC (`info`) tests the set slots `plan` needs (docs/sets.md); a target without set
        slots has none to differ."""
        return True

    def missing(self) -> str | None:
        """What this host lacks to run the target (None: nothing), for the error that refuses it."""
        return None

    @abstractmethod
    def build(self, plan) -> str:
        """The artifact that runs `plan`'s matcher (a binary, a project), built or taken from a cache."""

    @abstractmethod
    def start(self, artifact: str, generation: int, standby: bool = True) -> dict:
        """Run the artifact; `standby`: beside the running NIC, taking no frames until `activate`. Returns the
        NIC's info (JSON-able)."""

    @abstractmethod
    def transport(self, info: dict, timeout: float = 30.0):
        """A register transport (read/write/read_table/write_table_many/request_many/close) to the NIC of `info`
        (`timeout`: how long one request may take, where the transport has such a bound)."""

    @abstractmethod
    def activate(self, info: dict) -> None:
        """Take the frames from the wire."""

    @abstractmethod
    def standby(self, info: dict) -> None:
        """Stop taking frames (frames already inside still leave)."""

    @abstractmethod
    def alive(self, info: dict) -> bool:
        """Whether the NIC of `info` still runs (a state file can outlive it)."""

    @abstractmethod
    def stop(self, info: dict) -> None:
        """Stop the NIC of `info`, also one started by an earlier command."""

    @contextlib.contextmanager
    def client(self, info: dict) -> Iterator[NicClient]:
        c = NicClient(self.transport(info))
        try:
            yield c
        finally:
            c.close()

    def new_flows_why_not(self, plan, info: dict) -> str:
        """[ctm] Why a frame the NIC's conntrack membership structure does not hold is not ct 3 (NEW or INVALID; "":
        it is, while the flow sync service keeps the structure complete; docs/flowsync.md "New flows on the NIC"): the
        policy does not read conntrack, the core has no structure, or the firewall namespace has what can make a
        frame without an entry RELATED or UNTRACKED (the xdp target's check, targets.xdp.newflows)."""

        def reads(p) -> bool:
            return any(getattr(p, "miss_shunt", (False, False))) and getattr(p, "shunt_none", None) is not None

        plan6 = getattr(plan, "plan6", None)
        reads4, reads6 = reads(plan), plan6 is not None and reads(plan6)
        if not reads4 and not reads6:
            return "the policy's hardware entries do not read conntrack state"
        try:
            with self.client(info) as c:
                if not hasattr(c, "ctm_config") or c.ctm_config() is None:
                    return "the NIC has no conntrack membership structure (CTM_CONFIG reads 0)"
                if not reads4 and not c.ctm_v6():
                    return "the NIC's conntrack membership structure holds IPv4 tuples only (CTM_CONFIG bit 24 clear)"
        except Exception as e:
            return f"reading the NIC's CTM_CONFIG: {e}"
        from hypafilter.targets.xdp import newflows

        return newflows.why_not(self.site.netns)

    def flowsync_why_not(self, plan, info: dict) -> str:
        """Why the flow sync service does not run for `plan` on the NIC of `info` ("": it runs, the policy's
        hardware entries reading conntrack state): the NIC has no flow cache."""
        try:
            with self.client(info) as c:
                if not hasattr(c, "flow_config"):
                    return "this NIC client has no flow cache API"
                if c.flow_config() is None:
                    return "the NIC has no flow cache (FC_CONFIG reads 0)"
                return ""
        except Exception as e:  # an unreachable NIC shows as drift; the service is not started for it
            return f"reading the NIC's flow cache configuration: {e}"

    def program(self, info: dict, plan, generation: int, known: dict | None = None) -> dict:
        """Write the plan's tables (only what differs from `known`); returns what the core now holds."""
        with self.client(info) as c:
            return c.program(
                plan, generation, known=known, unfilterable=self.config.unfilterable, nic_mode=self.config.nic_mode
            )

    def sync_sets(self, info: dict, slots, sets: dict, known: list | None = None) -> list:
        """Bring the NIC's set tables to the kernel's sets (ir.sets.SetInfo by name) for the plan's set slots: the
        element inserts and deletes that differ from `known` (the images this or `program` returned last: its
        tables' "set_images"), each one table write; without them, or when they no longer fit, a slot is cleared
        and reloaded with its lookups uncertain meanwhile (its frames go to the host). Returns the new images."""
        with self.client(info) as c:
            images, _ = c.program_sets(tuple(slots), sets, known)
            return images

    def write_tables(self, info: dict, tables: dict, generation: int, known: dict | None = None) -> dict:
        """Put tables as `program` returned them back (deploy's rollback of a register-only update)."""
        with self.client(info) as c:
            return c.write_tables(tables, generation, known=known)

    def shunt_all(self, info: dict, on: bool) -> None:
        with self.client(info) as c:
            c.set_shunt_all(on)

    def buffer_depth(self) -> int:
        """Update-buffer slots (ARCHITECTURE §8) of what `build` makes for this configuration (the core's BUF_DEPTH:
        Config.update_buffer; 0, none)."""
        return self.config.update_buffer

    def shunt_all_now(self, info: dict) -> None:
        """Shunt everything, as fast as the target allows (the policy sync service's fail safe)."""
        self.shunt_all(info, True)

    def set_lease(self, info: dict, ms: int) -> None:
        """Arm (re-arm) the fast path's policy sync lease for `ms` milliseconds; 0 disarms it. Expired, the fast path
        decides nothing (docs/deploy.md, "Live policy")."""
        with self.client(info) as c:
            c.set_lease(ms)

    def lease(self, info: dict) -> dict:
        """The fast path's policy sync lease: {armed, expired, left_ms, ...}."""
        with self.client(info) as c:
            return c.lease()

    def counters(self, info: dict) -> dict:
        with self.client(info) as c:
            return c.counters()

    def forget_flushed_flows(self, info: dict, wait: float = 3.0) -> None:
        """Conntrack was just flushed: return once the fast path holds none of the flushed flows. A NIC's flow cache
        loses them only when the flow sync service has read their destroy events, and until then a frame of such a
        flow is a hit, which a policy's ESTABLISHED entry decides in hardware while the flushed kernel sees NEW
        (`make fuzz`, policy seed 14, found it). Waits up to `wait` seconds for the service to empty the cache, then
        clears it itself (a miss is always safe: the frame goes to conntrack). A NIC without a cache: nothing."""
        with self.client(info) as c:
            if c.flow_config() is None:
                return
            end = time.monotonic() + wait
            while c.flow_counters()["occupancy"] and time.monotonic() < end:
                time.sleep(0.02)
            if c.flow_counters()["occupancy"]:
                c.flow_clear()

    def counter_source(self, info: dict, timeout: float = 30.0) -> CounterSource:
        """The NIC's counters and HITS table over a register connection kept open until `close` (`timeout`: how
        long one reading may take, where the transport has such a bound)."""
        return NicClient(self.transport(info, timeout))

    # How verify's counter window reconciles this target's lab (None: the target has no lab verify runs on).
    window_stages: WindowStages | None = None
