"""Where a Plan runs: the Target interface with the emulated NIC and NetFPGA SUME behind it, the register
client, and the eBPF shim that turns hardware metadata into the netfilter mark."""

from pathlib import Path

from hypafilter.config import Config
from hypafilter.errors import HypafilterError
from hypafilter.paths import BUILD_ROOT
from hypafilter.targets.base import Site, Target
from hypafilter.targets.emu.target import EmuTarget
from hypafilter.targets.sume import SumeTarget
from hypafilter.targets.xdp.target import XdpTarget

TARGETS: dict[str, type[Target]] = {cls.name: cls for cls in (EmuTarget, SumeTarget, XdpTarget)}


def get(name: str, config: Config, site: Site | None = None, build_root: Path = BUILD_ROOT) -> Target:
    """The target called `name` for this configuration, its NIC at `site`, its artifacts under `build_root`."""
    try:
        cls = TARGETS[name]
    except KeyError:
        raise HypafilterError(f"unknown target '{name}' (one of {', '.join(TARGETS)})") from None
    return cls(config, site, build_root)


def set_capability(name: str) -> tuple[int, int]:
    """(set slots, elements per slot) of target `name` (docs/sets.md): the one place a target's set support is
    read from (Target.set_slots, Target.set_capacity). Unknown targets: none."""
    cls = TARGETS.get(name)
    return (cls.set_slots, cls.set_capacity) if cls is not None else (0, 0)


def set_capability6(name: str) -> bool:
    """Whether target `name` has IPv6 set slots (Target.set_slots6; docs/sets.md "IPv6 sets")."""
    cls = TARGETS.get(name)
    return bool(getattr(cls, "set_slots6", False)) if cls is not None else False


def live_set_env(ns: str | None, target: str):
    """The live ipsets of namespace `ns` (None: this one) as the front end reads them for `target` (a SetEnv whose
    loader runs `ipset save` only if the policy has a set match; docs/sets.md)."""
    from hypafilter.iptables.sets import SetEnv
    from hypafilter.netfilter import ipset

    def load() -> tuple[dict, str]:
        text = ipset.save_text(ns)
        return ipset.parse_save(text, f"ipset save ({ns or 'this namespace'})"), text

    return SetEnv(
        {},
        *set_capability(target),
        target,
        f"live sets of {ns or 'this namespace'}",
        loader=load,
        v6_slots=set_capability6(target),
    )


__all__ = ["TARGETS", "Site", "Target", "get", "live_set_env", "set_capability", "set_capability6"]
