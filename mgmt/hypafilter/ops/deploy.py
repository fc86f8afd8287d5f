"""Deploy, update and undeploy a policy on a target, all or nothing, with a journal of deployments in a state file.

A deployment is: the hardware (the target's NIC running the matcher generated for the policy, its registers), the
software chains (`<prefix><gen>_*` in the firewall namespace, one jump from the base chain) and the shim (its
generation, mark bits and interval table). Every step registers its undo before the next one runs; any failure
undoes what was done, in reverse, and raises DeployError naming the step. An update is make-before-break (see
docs/deploy.md for why no packet gets a wrong verdict at any point).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import os
import re
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace

from hypafilter import netns, shared, targets
from hypafilter.analysis.overlay import BufferFull, align
from hypafilter.analysis.plan import build_plan
from hypafilter.analysis.program import k0_tree_wanted, user_chain_names
from hypafilter.config import Config, Interfaces
from hypafilter.errors import DeployError, HypafilterError
from hypafilter.hw.model import CONTROL_MISS_SHUNT, CONTROL_MISS_SHUNT6, miss_shunt6_control, miss_shunt_control
from hypafilter.hw.updatebuffer import Image6
from hypafilter.iptables import kernel
from hypafilter.iptables.writer import body_of, policy_restore
from hypafilter.ir import Policy
from hypafilter.netfilter import ip6
from hypafilter.netfilter.bridge import TABLE as BRIDGE_TABLE
from hypafilter.netfilter.bridge import unfilterable_nft
from hypafilter.netfilter.restore import to_iptables_restore
from hypafilter.ops import services
from hypafilter.ops.buffer import overlay_json, read_static, static_path, write_static
from hypafilter.ops.daemon import READY_TIMEOUT
from hypafilter.ops.locks import flock_now
from hypafilter.ops.policysync import live
from hypafilter.ops.policysync.nftevents import NfTables
from hypafilter.ops.ruleset import (
    base_policy,
    chain_counters,
    chain_prefix,
    chains_fingerprint,
    delete_text,
    has_jump,
    live_text,
    orphans,
    owned_chains,
    restore,
    restore_table,
    reuse_chains,
    switch_text,
    table_snapshot,
)
from hypafilter.ops.transaction import FAIL_ENV, Transaction
from hypafilter.paths import BUILD_ROOT
from hypafilter.targets import shim as shim_mod
from hypafilter.targets.base import Site, Target
from hypafilter.targets.emu import v6 as emu_v6
from hypafilter.targets.nic import CONTROL_ENABLE, CONTROL_HOST_MODE, CONTROL_PASS_UNFILTERABLE, CONTROL_SHUNT_ALL
from hypafilter.targets.xdp import v6 as xdp_v6

STATE_DIR = Path(os.environ.get("HF_STATE_DIR", "/run/hypafilter"))
HISTORY_KEEP = 50
# seconds deploy, update and undeploy wait for the lock: the policy sync service holds it while it applies a change
# of the live ruleset or swaps in a lazily rebuilt core (a fraction of a second; a new core: the build is done first)
LOCK_WAIT = 60.0
VLAN_SYSCTL = "net.bridge.bridge-nf-filter-vlan-tagged"

# The reference lab topology (ops.lab creates it; ARCHITECTURE §7). One lab per machine for deploy.
LAB_NAME = os.environ.get("HF_LAB", "hf")
NS_NIC, NS_FW, NS_PLAIN = f"{LAB_NAME}-nic", f"{LAB_NAME}-fw", f"{LAB_NAME}-plain"
NIC_IFACES = {"wire0": "wire0", "wire1": "wire1", "host0": "host0", "host1": "host1"}
FW_IFACES = ("nf0", "nf1")  # FW_IFACES[n]: the firewall's end of the veth from host<n>, the DMA port of MACn
FW_BRIDGE = "br0"  # the bridge the firewall's FW_IFACES are ports of (ops.lab)
SITE_PORTS = False  # configure_ports: real interfaces given by --ports instead of the lab's


def configure(lab: str | None = None, state_dir: str | Path | None = None) -> None:
    """Point this module at another lab and state directory (tests run their own lab beside the default one)."""
    global LAB_NAME, NS_NIC, NS_FW, NS_PLAIN, STATE_DIR
    if lab:
        LAB_NAME = lab
        NS_NIC, NS_FW, NS_PLAIN = f"{lab}-nic", f"{lab}-fw", f"{lab}-plain"
    if state_dir:
        STATE_DIR = Path(state_dir)


def configure_ports(ports: list[str] | tuple[str, ...], ns: str | None = None) -> None:
    """Deploy on these two interfaces of namespace `ns` (None: this one) instead of the lab's firewall: target xdp
    on real interfaces (docs/xdp.md). In bridge mode they must be ports of one bridge (br_netfilter on); the bridge
    is taken from them."""
    global NS_FW, FW_IFACES, FW_BRIDGE, SITE_PORTS
    if len(ports) != 2 or ports[0] == ports[1] or not all(ports):
        raise HypafilterError(f"--ports needs two interfaces, a port pair: IF0,IF1 (got {','.join(ports)!r})")
    links = {ln["ifname"]: ln for ln in json.loads(netns.run(["ip", "-j", "link", "show"], ns) or "[]")}
    missing = [p for p in ports if p not in links]
    if missing:
        raise HypafilterError(f"--ports: no interface {', '.join(missing)} in {ns or 'this network namespace'}")
    masters = {links[p].get("master") for p in ports}
    NS_FW, FW_IFACES = ns, tuple(ports)
    FW_BRIDGE = masters.pop() if len(masters) == 1 and None not in masters else ""
    SITE_PORTS = True


def configure_from_state() -> None:
    """Undeploy and status of a deployment made with --ports: the interfaces it recorded; and the lab it was made
    in (a service started by deploy, whatever its environment says)."""
    st = read_state()
    site = (st or {}).get("site") or {}
    if site.get("lab") and not site.get("ports"):
        configure(lab=site["lab"])
    if site.get("ports"):
        configure_ports(site["ifaces"], site.get("netns"))


def state_file() -> Path:
    return STATE_DIR / "state.json"


def read_state(path: str | Path | None = None) -> dict | None:
    """The deploy state (what is deployed, generation, history) in `path`, by default this state directory's
    `state_file`; None when there is none."""
    p = state_file() if path is None else Path(path)
    try:
        return json.loads(p.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise HypafilterError(f"{p}: unreadable deployment state: {e}") from e


def state_config(st: dict, plan: bool = False) -> Config:
    """The site configuration a deployment in the state `st` was made with, as far as the state keeps it: the
    netfilter table and chain prefix (what drift, undeploy, status and the flow sync service need; the rest the
    defaults) and, with `plan`, also what planning the deployed policy again needs (the dashboard): the shunting
    mode, the strategy, the NIC mode and the mark bits."""
    cfg = Config(table=st.get("table", "filter"), chain_prefix=st.get("chain_prefix", "HF"))
    if plan:
        cfg.shunt_mode = st.get("mode", "selective")
        cfg.strategy = st.get("strategy", "interval")
        cfg.nic_mode = st.get("nic_mode", "bridge")
        if "mark_mask" in st:
            cfg.mark_mask = int(st["mark_mask"])
        if "mark_shift" in st:
            cfg.mark_shift = int(st["mark_shift"])
        cfg.tree_min_segment = int(st.get("tree_min_segment", 16))
    return cfg


def write_state(state: dict) -> None:
    _write_private(state_file(), json.dumps(state, indent=1, sort_keys=True) + "\n")


def TREE_BASES_FILE(family: int = 4) -> Path:  # a function: the state directory is configured at run time
    """Strategy tree's live trees (K0T's and the interval chains'): the flattened rules (analysis.trees.rule_key) each
    was last built from, so that the policy sync worker's follows divert the changes since instead of building
    them again (docs/optimize.md, "Lazy trees"). Family 6: the IPv6 side's, in ip6tables."""
    return STATE_DIR / ("tree_bases.json" if family == 4 else "tree_bases6.json")


def TREE_CACHE_FILE(family: int = 4) -> Path:
    """The live trees themselves (analysis.trees.cache_json: each base's regions and built trees), so that the
    policy sync worker's first follow after a deploy or a restart of the service writes them without a build."""
    return STATE_DIR / ("tree_cache.json" if family == 4 else "tree_cache6.json")


def _write_trees(plan, family: int, warnings: list[str]) -> None:
    """The bases and trees a program built for `plan` (build_program's `tree_bases_built`, `tree_cache_built`), for
    the next follow's process."""
    if getattr(plan, "tree_bases_built", None) is not None:  # the live trees' bases: the rules they were built from
        try:
            _write_private(TREE_BASES_FILE(family), json.dumps(plan.tree_bases_built) + "\n")
        except OSError as e:
            warnings.append(f"writing {TREE_BASES_FILE(family)}: {e}")
    if getattr(plan, "tree_cache_built", None) is not None:  # the trees built: a new process writes them unbuilt
        try:
            _write_private(TREE_CACHE_FILE(family), json.dumps(plan.tree_cache_built, separators=(",", ":")) + "\n")
        except OSError as e:
            warnings.append(f"writing {TREE_CACHE_FILE(family)}: {e}")


def CHAINS_FILE(family: int = 4) -> Path:
    """The tool's chains as the kernel holds them (ops.ruleset.reuse_chains' `in_use`: digests and jumps): a follow
    loads only the chains whose content is not among them (docs/optimize.md, "What a follow loads"). Family 6: the
    IPv6 side's chains in ip6tables."""
    return STATE_DIR / ("chains.json" if family == 4 else "chains6.json")


def _write_chains(in_use: dict, family: int, warnings: list[str]) -> None:
    try:
        _write_private(CHAINS_FILE(family), json.dumps({"in_use": in_use}, separators=(",", ":")) + "\n")
    except OSError as e:
        warnings.append(f"writing {CHAINS_FILE(family)}: {e}")


def _loaded_chains(names, family: int = 4) -> dict[str, list]:
    """The previous generation's chains ({name: [digest, the tool's chains it jumps to]}), when they are the chains
    the state records (`names`: the state's `chains`, the IPv6 side's `chains_in_use`) and hold every chain they jump
    to (else none is kept: the follow loads every chain)."""
    try:
        doc = json.loads(CHAINS_FILE(family).read_text())
        got = {str(k): [str(d), [str(t) for t in refs]] for k, (d, refs) in doc["in_use"].items()}
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return {}
    whole = all(t in got for _, refs in got.values() for t in refs)
    return got if whole and names and set(got) == set(names) else {}


def _set_rows(plan) -> list:
    """The set slots a NIC's tables hold for `plan` as NicClient.program records them (`tables["sets"]`: name, type,
    directions; a 4th field 6 for a dual-stack core's IPv6 slots), [] for none."""
    plan6 = getattr(plan, "plan6", None)
    slots6 = tuple(getattr(plan6, "set_slots", ()) or ()) if plan6 is not None else ()
    return [[s.name, s.settype, list(s.dirs)] for s in tuple(getattr(plan, "set_slots", ()) or ())] + [
        [s.name, s.settype, list(s.dirs), 6] for s in slots6
    ]


def _chains_as_loaded(rec: dict, config: Config, family: int = 4, text: str | None = None) -> bool:
    """The tool's chains in the kernel are the ones the last update loaded and fingerprinted (`chains_sha256`, as
    drift compares them): only then may a follow keep any of them. A chain changed by hand is loaded anew, not kept
    (keeping it would also make its change the new fingerprint, and so no longer drift). `rec`: the state (family 4:
    `chains`) or its IPv6 side (family 6: `chains_in_use`); `text`: the table's listing, if already read."""
    want = rec.get("chains_sha256")
    if not want:
        return False
    names = list(rec.get("chains" if family == 4 else "chains_in_use") or ())
    try:
        return chains_fingerprint(NS_FW, config, names, text, family) == want
    except HypafilterError:
        return False


def _kept_chains(rec: dict | None, config: Config, log: Callable[[str], None], family: int = 4, text=None) -> dict:
    """The chains a follow may keep (`_loaded_chains`), none when they are not as the last update left them."""
    rec = rec or {}
    kept = _loaded_chains(rec.get("chains" if family == 4 else "chains_in_use"), family)
    if kept and not _chains_as_loaded(rec, config, family, text):
        what = "the tool's chains" if family == 4 else "the tool's IPv6 chains"
        log(f"{what} are not as the last update left them (changed by hand?): every chain loaded anew")
        return {}
    return kept


def _tree_cache(family: int = 4) -> dict:
    from hypafilter.analysis.trees import cache_of_json

    try:
        return cache_of_json(json.loads(TREE_CACHE_FILE(family).read_text()))
    except (OSError, ValueError, TypeError, KeyError, AttributeError, IndexError):
        return {}  # none kept (or unreadable, or of another version): the trees are built anew


def _tree_bases(family: int = 4) -> dict | None:
    from hypafilter.analysis.trees import bases_of_json

    try:
        return bases_of_json(json.loads(TREE_BASES_FILE(family).read_text()))
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return None  # none recorded (or unreadable): the follow builds the trees anew


def _write_private(path: Path, text: str) -> None:
    """A file of the state directory: it holds the whole policy, so readable by root only (created so, never
    world-readable for a moment), and replaced whole (readers such as status and the dashboard never see half)."""
    STATE_DIR.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(tmp, 0o600)
    tmp.replace(path)


@contextlib.contextmanager
def _lock(wait: float = 0.0, abort: Callable[[], bool] = lambda: False) -> Iterator[None]:
    """The deployment's lock; `wait`: seconds to wait for it (the policy sync service waits out a deploy that is
    starting it), unless `abort()` says to give up first (the service is being stopped)."""
    STATE_DIR.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + wait
    with open(STATE_DIR / "deploy.lock", "w") as f:
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline or abort():
                    raise HypafilterError("another deploy/update/undeploy is running (lock held)") from None
                time.sleep(0.01)
        yield


@contextlib.contextmanager
def measuring() -> Iterator[None]:
    """Held (shared) by what reads the NIC's counters across a window (verify): the policy sync service's lazy
    rebuild does not replace the NIC or program meanwhile (`unmeasured`), which would cut the window (a closed
    control socket, counters from zero). Changes of the live ruleset are still followed."""
    STATE_DIR.mkdir(parents=True, exist_ok=True)
    with open(STATE_DIR / "measure.lock", "a+") as f:
        fcntl.flock(f, fcntl.LOCK_SH)
        yield


@contextlib.contextmanager
def unmeasured() -> Iterator[bool]:
    """The measurement lock held exclusively if nothing measures now (True), else False at once: the lazy rebuild
    swaps its core only under it, and tries again later otherwise."""
    STATE_DIR.mkdir(parents=True, exist_ok=True)
    with flock_now(STATE_DIR / "measure.lock") as free:
        yield free


def drift(st: dict, tgt: Target | None = None) -> list[str]:
    """How the live system differs from what `st` says was deployed (empty: no drift): the base chain's jump and
    policy, the tool's chains, the shim, the NIC, the services it wants."""
    cfg = state_config(st)
    base, main = st.get("base_chain", "FORWARD"), st.get("main_chain")
    out = []
    try:
        if not has_jump(NS_FW, cfg, base, main):
            out.append(f"netfilter: the jump {base} -> {main} is missing")
        want = st.get("base_policy")
        have = base_policy(NS_FW, cfg, base)
        if want and have != want:
            out.append(f"netfilter: {base} has policy {have}, deployed with {want}")
        if st.get("chains_sha256") and chains_fingerprint(NS_FW, cfg, st.get("chains", [])) != st["chains_sha256"]:
            out.append("netfilter: the tool's chains were changed since the deploy")
    except HypafilterError as e:
        out.append(f"netfilter: {e}")
    out += bridge_drift(st)
    out += ipv6_drift(st)
    try:
        sh = shim_of(st)
        if not sh.loaded:
            out.append("shim: not loaded")
        else:
            out += shim_drift(sh, st)
    except (HypafilterError, KeyError, ValueError) as e:
        out.append(f"shim: {e}")
    try:
        tgt = tgt or target_of(st, cfg)
        if not tgt.alive(st["nic"]):
            out.append(f"nic: {st['nic'].get('name')} (pid {st['nic'].get('pid')}) is not running")
        else:
            own = getattr(tgt, "drift", None)
            if own is not None:
                out += own(st["nic"], st)
            else:
                with tgt.client(st["nic"]) as c:
                    out += nic_drift(c, st)
            out += lease_drift(tgt.lease(st["nic"]), st)
    except Exception as e:  # an unreachable NIC is drift, whatever the transport raised
        out.append(f"nic: {e}")
    # tgt None: the state names no known target (said above); the services' wording is then the NIC's
    out += services.drift(st, STATE_DIR, tgt or Target)
    return out


def lease_drift(lease: dict, st: dict) -> list[str]:
    """The fast path's policy sync lease against the deployment's: expired (the fast path shunts everything: the
    service has not renewed it in time), or not armed though the deployment wants one."""
    want = int(st.get("lease_ms") or 0)
    if lease.get("expired"):
        return [
            "policysync: the fast path shunts everything: policy sync lease expired (not renewed within "
            f"{want or '?'} ms; the policy sync service renews it while it runs)"
        ]
    if want and not lease.get("armed"):
        return [f"policysync: the policy sync lease ({want} ms) is not armed: the fast path decides without it"]
    return []


def shim_drift(sh: shim_mod.Shim, st: dict) -> list[str]:
    """The shim's configuration and interval map (match_index -> k) against what was deployed."""
    out = []
    cfg = sh.stats()["config"]
    want = {"generation": st["generation"], "mark_mask": st.get("mark_mask"), "mark_shift": st.get("mark_shift")}
    want["control"] = st.get("shim_control")  # None (a state from before it): not compared
    for key, value in want.items():
        if value is not None and cfg.get(key) != value:
            out.append(f"shim: {key} {cfg.get(key)}, deployed {value}")
    intervals = st.get("intervals")
    if intervals is not None:
        have = sh.dump(len(intervals))
        wrong = [i for i, (a, b) in enumerate(zip(have, intervals, strict=False)) if a != b]
        if wrong or len(have) != len(intervals):
            out.append(f"shim: {len(wrong)} interval entries differ from the deployed ones (first: {wrong[:1]})")
    return out


def nic_drift(c, st: dict) -> list[str]:
    """The NIC's GENERATION, CONTROL bits and SHUNT/ACTION tables against what was deployed."""
    out = []
    info = c.info()
    if info["GENERATION"] != st["generation"]:
        out.append(f"nic: GENERATION register {info['GENERATION']}, deployed {st['generation']}")
    control = info["CONTROL"]
    if not control & CONTROL_ENABLE:
        out.append("nic: classification is off (CONTROL bit 0): every frame is shunted")
    if control & CONTROL_SHUNT_ALL:
        out.append("nic: shunt everything is on (CONTROL bit 1), left by an interrupted update")
    tables = st.get("tables") or {}
    for key, bit, want in (
        ("unfilterable", CONTROL_PASS_UNFILTERABLE, tables.get("unfilterable") == "pass"),
        ("nic_mode", CONTROL_HOST_MODE, tables.get("nic_mode") == "host"),
    ):
        if tables.get(key) is not None and bool(control & bit) != want:
            out.append(f"nic: CONTROL {key} bit is {int(bool(control & bit))}, deployed {tables[key]}")
    if tables.get("miss_shunt") is not None:
        want_bits = miss_shunt_control(tables["miss_shunt"])
        if control & CONTROL_MISS_SHUNT != want_bits:
            out.append(
                f"nic: CONTROL miss forcing bits 4/5 are {(control & CONTROL_MISS_SHUNT) >> 4:02b} (drop, accept), "
                f"deployed {want_bits >> 4:02b}"
            )
    if tables.get("miss_shunt6") is not None:  # a dual-stack core's IPv6 miss forcing (docs/ipv6.md "## emu")
        want_bits = miss_shunt6_control(tables["miss_shunt6"])
        if control & CONTROL_MISS_SHUNT6 != want_bits:
            out.append(
                f"nic: CONTROL IPv6 miss forcing bits 6/7 are {(control & CONTROL_MISS_SHUNT6) >> 6:02b} (drop, "
                f"accept), deployed {want_bits >> 6:02b}"
            )
    for name, key in (("SHUNT", "shunt"), ("ACTION", "actions")):
        want = tables.get(key)
        if want is None:
            continue
        have = c.read_table_many(name, 0, len(want))
        wrong = [i for i, (a, b) in enumerate(zip(have, want, strict=True)) if a != b]
        if wrong:
            out.append(f"nic: {len(wrong)} {name} words differ from the deployed ones (first at index {wrong[0]})")
    # a dual-stack core's IPv6 update buffer (docs/ipv6.md "## emu"): VALID6 and the slots' words as written
    v6 = tables.get("v6") or {}
    if v6.get("overlay") is not None:
        want6 = Image6.from_dict(v6["overlay"])
        have6 = c.read_image6(want6.depth, want6.n)
        if not have6.same(want6):
            bad = [b for b in range(want6.depth) if not have6.same_slot(want6, b)]
            what = f"slots {bad}" if bad else "the valid mask VALID6"
            out.append(f"nic: the IPv6 update buffer differs from the deployed one ({what})")
    return out


def _unfilterable_drift(st: dict) -> bool:
    """Whether the bridge's unfilterable table is not as the deployment `st` left it (a recreated namespace)."""
    return any(BRIDGE_TABLE in d for d in bridge_drift(st, vlan=False))


def bridge_drift(st: dict, vlan: bool = True) -> list[str]:
    """The firewall bridge's own settings: tagged frames filtered by iptables, and the table that drops two-tag
    frames present exactly when the deployment drops them."""
    out = []
    try:
        value = netns.sysctl(VLAN_SYSCTL, NS_FW) if vlan else "1"
        if value != "1":
            out.append(f"bridge: {VLAN_SYSCTL} is {value}, deployed 1 (tagged frames would cross without iptables)")
    except (HypafilterError, OSError) as e:
        out.append(f"bridge: {e}")
    want = st.get("unfilterable", "pass") == "drop"
    try:
        listing = netns.run(["nft", "list", "table", "bridge", BRIDGE_TABLE], NS_FW)
    except netns.CommandError:
        listing = None
    except HypafilterError as e:
        return out + [f"bridge: {e}"]
    if want and (listing is None or " drop" not in listing):
        out.append(f"bridge: table {BRIDGE_TABLE} (drops two-tag frames) is missing or changed")
    elif not want and listing is not None:
        out.append(f"bridge: table {BRIDGE_TABLE} is present, deployed with unfilterable = pass")
    return out


# ---- the NIC ---------------------------------------------------------------------------------------------------


def _target(name: str, config: Config) -> Target:
    """Target `name` with its NIC in the lab's nic namespace on its four veths (xdp: its program on the firewall's
    two wire-facing interfaces, FW_IFACES). The module globals are read at each call: configure() moves the lab,
    and a benchmark points BUILD_ROOT at an empty cache for a cold build."""
    if name == "xdp":
        ports = {"wire0": FW_IFACES[0], "wire1": FW_IFACES[1]}
        return targets.get(name, config, Site(LAB_NAME, NS_FW, ports, STATE_DIR / "nic"), BUILD_ROOT)
    return targets.get(name, config, Site(LAB_NAME, NS_NIC, dict(NIC_IFACES), STATE_DIR / "nic"), BUILD_ROOT)


def target_of(state: dict, config: Config) -> Target:
    """The target a deployment in the state file runs on."""
    return _target(state.get("target", "emu"), config)


K0_SHIM = shared.C["HF_SHIM_CONTROL_K0_TREE"]  # hf_config.control: the live K0 tree's mark (docs/shim.md)


def _fw_shim(target: str = "emu") -> shim_mod.Shim:
    """The shim on the firewall's interfaces; with the xdp target only its TC program (the fast path is the XDP
    program and leaves the mark value in the metadata itself)."""
    return shim_mod.Shim(NS_FW, list(FW_IFACES), tc_only=target == "xdp")


def shim_of(st: dict) -> shim_mod.Shim:
    """The shim of a deployment in the state file."""
    return shim_mod.Shim(st["shim"]["netns"], st["shim"]["ifaces"], tc_only=bool(st["shim"].get("tc_only")))


def _check_lab(target: str = "emu") -> None:
    if SITE_PORTS:
        if target != "xdp":
            raise HypafilterError(f"--ports deploys the xdp target only, not {target}")
        return
    need = (NS_FW,) if target == "xdp" else (NS_NIC, NS_FW)
    missing = [ns for ns in need if not netns.exists(ns)]
    if missing:
        raise HypafilterError(f"lab namespaces missing ({', '.join(missing)}): run `hypafilter lab up` first")


def site_interfaces() -> Interfaces:
    """The lab's interfaces as the NIC's frames meet netfilter: MACn's frames enter the firewall by FW_IFACES[n],
    a port of FW_BRIDGE (docs/configuration.md)."""
    return Interfaces(FW_BRIDGE, tuple((name, n) for n, name in enumerate(FW_IFACES)))


def site_config(config: Config) -> Config:
    """`config` with the deployment's interfaces filled in, for parsing a policy that is to be deployed here.

    A configuration that names none gets the lab's; one that names them must name the lab's (a port map without
    a bridge gets the lab's bridge). Anything else is refused: a policy resolved against other interfaces would
    get hardware entries this firewall does not agree with."""
    site = site_interfaces()
    if not config.hw_ports and not config.bridge:
        return dataclasses.replace(config, bridge=site.bridge, hw_ports=dict(site.ports))
    if config.interfaces.ports != site.ports or config.bridge not in ("", site.bridge):
        raise HypafilterError(
            f"the configuration's interfaces ({config.interfaces.describe()}) are not this deployment's "
            f"({site.describe()}): leave bridge and hw_ports out, or give these"
        )
    return dataclasses.replace(config, bridge=site.bridge)


def _check_interfaces(policy: Policy) -> None:
    """The interfaces the policy's checks were resolved against are the firewall's: each named port is a port of
    the named bridge in the firewall namespace, and they are this deployment's (site_interfaces)."""
    bridge, ports = policy.interfaces
    if not policy.resolved:  # no check depended on them
        return
    site = site_interfaces()
    if ports != site.ports or bridge not in ("", site.bridge):
        raise HypafilterError(
            f"{policy.source}: its interface checks were resolved against {Interfaces(bridge, ports).describe()}, "
            f"but this deployment's interfaces are {site.describe()}: parse it with deploy.site_config(config)"
        )
    links = {ln["ifname"]: ln for ln in json.loads(netns.run(["ip", "-j", "link", "show"], NS_FW) or "[]")}
    for name, _ in ports:
        master = links.get(name, {}).get("master")
        if bridge and master != bridge:
            raise HypafilterError(f"{NS_FW}: {name} is not a port of {bridge} (master: {master})")


def _kernel_check(policy: Policy, config: Config) -> None:
    if kernel.available() is not None:
        return
    errors = kernel.check(
        *kernel.policy_lines(policy, config.table), table=config.table, sets_text=policy.ipsets_text or None
    )
    if errors:
        raise HypafilterError(
            "; ".join(str(e) for e in errors[:5]) + (f" (and {len(errors) - 5} more)" if len(errors) > 5 else "")
        )


def _in_background(fn: Callable[[], object]) -> Callable[[], object]:
    """Start `fn` in a thread; the function returned waits for it and returns its result or raises its error."""
    done: dict = {}

    def run() -> None:
        try:
            done["result"] = fn()
        except BaseException as e:  # handed to the caller, which raises it in its own thread
            done["error"] = e

    t = threading.Thread(target=run, name="hf-deploy-read", daemon=True)
    t.start()

    def result() -> object:
        t.join()
        if "error" in done:
            raise done["error"]
        return done.get("result")

    return result


def live_sets6(target: str):
    """The firewall namespace's live ipsets (the deployment's: NS_FW, the lab's or the site's), read only
    if the IPv6 policy has a set match, as the front end reads them for `target`."""
    from hypafilter import netns
    from hypafilter.targets import live_set_env

    return live_set_env(NS_FW if NS_FW and netns.exists(NS_FW) else None, target)


def sets_state(policy: Policy, v6=None, plan6=None) -> dict:
    """What became of the policy's -m set matches (docs/sets.md): the set slots of the fast path, and each match
    that stays complex with why (what `status` says). `v6`/`plan6`: the deployment's IPv6 side and its plan in the
    fast path (None: ip6tables decides every IPv6 frame), whose inet6 set slots are listed as "[IPv6]"."""
    out = {
        "slots": [f"{s.name} ({s.settype}) by {','.join(s.dirs)}" for s in policy.set_slots],
        "complex": [
            {"where": f"{n.origin.file}:{n.origin.line}" if n.origin else "?", "test": n.test, "why": n.why}
            for n in policy.set_notes
            if n.slot < 0
        ],
    }
    ir6 = getattr(v6, "ir", None)
    if ir6 is None:
        return out
    slots6 = tuple(getattr(getattr(plan6, "policy", None), "set_slots", ()) or ())
    out["slots"] += [f"{s.name} ({s.settype}) by {','.join(s.dirs)} [IPv6]" for s in slots6]
    for n in ir6.set_notes:
        if n.slot >= 0 and slots6:
            continue
        why = n.why or "the IPv6 side has no plan in the fast path: ip6tables decides every IPv6 frame"
        where = f"{n.origin.file}:{n.origin.line}" if n.origin else "?"
        out["complex"].append({"where": where, "test": n.test + " [IPv6]", "why": why})
    return out


def partition_counts(policy: Policy, plan) -> dict:
    n = len(plan.entries)
    return {
        "rules": len(policy.rules),
        "simple": len(policy.simple_indices),
        "complex": len(policy.complex_indices),
        "entries": n,
        "shunted_entries": int(sum(bool(b) for b in plan.shunt)),
    }


def deploy(
    policy: Policy,
    config: Config,
    target: str = "emu",
    force: bool = False,
    log: Callable[[str], None] = lambda s: None,
    v6: ip6.V6Policy | None = None,
) -> dict:
    """Deploy `policy` (or update to it), with `v6` the IPv6 side (None: ip6tables as the operator has it; an
    ip6tables policy or --ipv6-default drop: loaded into ip6tables in the same transaction, both families applied or
    neither). Returns the new state; raises DeployError with everything as before."""
    tgt = _target(target, config)
    missing = tgt.missing()
    if missing:
        raise HypafilterError(f"target '{target}' is not available here (only 'emu'; {missing})")
    try:
        mode = config.nic_mode_for(policy.base_chain)
    except HypafilterError as e:
        raise HypafilterError(f"{policy.source}: {e}") from e
    if policy.base_chain not in tgt.base_chains:
        raise HypafilterError(
            f"{policy.source}: chain {policy.base_chain} on target '{tgt.name}': its frames reach only the "
            f"{' or '.join(tgt.base_chains)} chain"
        )
    if mode != config.nic_mode:
        config = dataclasses.replace(config, nic_mode=mode)
        tgt = _target(target, config)
    if v6 is not None and v6.base_chain != policy.base_chain:
        raise HypafilterError(
            f"{v6.source}: the IPv6 policy is for chain {v6.base_chain}, the IPv4 policy for {policy.base_chain}"
        )
    with _lock(LOCK_WAIT):
        return _deploy_locked(policy, config, force, log, tgt, v6=v6)


def follow(
    policy: Policy,
    log: Callable[[str], None] = lambda s: None,
    rebuild: bool = False,
    watch: FollowWatch | None = None,
    abort: Callable[[], bool] = lambda: False,
    digest: str | None = None,
    v6: ip6.V6Policy | None = None,
    live6: str | None = None,
) -> dict:
    """Bring the deployment into step with `policy`, the live ruleset as the policy sync service read it (the
    fast path already shunts everything, every tag stale: ops.policysync). The operator's chains are live already:
    only the tool's chains, the jump (first again), the shim and the NIC change; through the update buffer when
    the running matcher can hold the change. A failure leaves the fast path shunting (fail closed). `rebuild`: the
    lazy rebuild — a new core (program) for `policy`, the deployed one, built beforehand (the build is cached),
    swapped make-before-break, the update buffer empty after it. `watch` (FollowWatch): the service's eye on the
    ruleset while the update runs. The lock is waited for (30 s at most, or until `abort()`). `v6`: the IPv6 side
    as ip6tables now holds it (follow6, when its tables need a new program); None: as deployed. `live6`: the digest
    of the operator's part of the ip6tables listing `v6` was read from (follow6's `live_digest`): the state's IPv6 side
    is then that listing, not ip6tables as it is once the update ends (a change made meanwhile stays a change)."""
    with _lock(30.0, abort):
        old = read_state()
        if not old:
            raise HypafilterError("nothing is deployed")
        config = deployed_config(old)
        return _deploy_locked(
            policy, config, rebuild, log, target_of(old, config), follow=True, watch=watch, digest=digest, v6=v6,
            live6=live6,
        )  # fmt: skip


def follow6(
    v6: ip6.V6Policy,
    live_digest: str,
    log: Callable[[str], None] = lambda s: None,
    abort: Callable[[], bool] = lambda: False,
    rebuild: bool = False,
) -> dict:
    """Bring the deployment's IPv6 side into step with `v6`, ip6tables' live ruleset as the policy sync service
    read it (docs/ipv6.md "Following ip6tables"; the xdp program's IPv6 path is held meanwhile: the service's IPv6
    fail safe). Nothing of the IPv4 side changes: ip6tables already holds the change, so what remains is the state's
    IPv6 side (what drift, `update` and a later IPv4 follow read) and, where the xdp program decides IPv6 frames,
    its IPv6 table set rebuilt from `v6` and written into the running program (the update buffer is IPv4's: a
    ranked IPv6 plan has no overlay yet). Returns {"state", "how", "why"}: how "tables" (written; the caller
    releases the hold), "ip6tables" (no fast path decides IPv6 here: nothing to release), "held" (the program has an
    IPv6 table set but this policy cannot go into it, `why`: the hold stays, every IPv6 frame to ip6tables) or "new
    program" (the tables do not fit the running program: the caller runs `follow` with `v6`). On xdp the change goes
    into the program's IPv6 update buffer when it can ("buffer", docs/ipv6.md "The update buffer for IPv6"), else
    the whole table set is rewritten, which empties the buffer; `rebuild`: that rewrite at once (the buffer's lazy
    rebuild when idle)."""
    t0 = time.monotonic()
    with _lock(30.0, abort):
        st = read_state()
        if not st:
            raise HypafilterError("nothing is deployed")
        config = deployed_config(st)
        tgt = target_of(st, config)
        old6 = st.get("ipv6") or {}
        # the interval chains the deployment wrote into ip6tables (docs/ipv6.md "Interval chains in ip6tables"): the
        # new plan keeps their k_base (the IPv4 plan is the deployed one), or is verbatim (k = 0) where there are none
        chains = old6.get("chains")
        how, why, tables, loaded6 = "ip6tables", "", st.get("tables") or {}, None
        if tgt.name == "xdp" and (tables.get("v6") or tgt.ipv6_held(st["nic"]) is not None):
            # plan6_for's index base (unused), and whether the deployed program marks IPv6 frames for HFv6_K0T
            n4 = SimpleNamespace(entries=range(int(tables.get("entries", 0))), k0_tree=bool(tables.get("k0_tree6")))
            kb = int((chains or {}).get("k_base", 0))
            plan6, why = xdp_v6.plan6_for(v6, config, n4, k_base=kb, verbatim=not chains, sets=live_sets6("xdp"))
            if plan6 is None:
                how, tables = "held", {k: v for k, v in tables.items() if k != "v6"}
            else:
                if chains:
                    # The new plan's chains into ip6tables before any table tags a frame with its k: the tool's
                    # chains only, in one restore (the operator's rules, which are the policy, untouched), while the
                    # hold passes every IPv6 frame with k = 0 (HFv6_K0: the whole policy). A failure leaves the hold.
                    st, loaded6 = _load_chains6(plan6, v6, config, st, log, fresh=rebuild)
                    old6 = st["ipv6"]
                try:
                    # the IPv6 update buffer first (docs/ipv6.md "The update buffer for IPv6"), else the whole
                    # table set rewritten (which empties the buffer: its lazy rebuild)
                    static6 = (
                        None
                        if rebuild or (tables.get("v6") or {}).get("writing")
                        else _static6(tables, config, n4, kb, chains)
                    )
                    # The program's IPv6 maps change from here: until the state written below says what they hold,
                    # it says they hold nothing known. A failure in between leaves it so: the follower keeps its
                    # hold and rewrites the whole table set when it tries again (Follower6.sync), never a buffer
                    # aligned to a static plan the maps no longer hold, and never a release over half-written maps.
                    write_state({**st, "tables": {**tables, "v6": {**(tables.get("v6") or {}), "static": None,
                                                                   "writing": True}}})  # fmt: skip
                    done = tgt.write_buffer6(st["nic"], plan6, tables, static6) if static6 is not None else None
                    if done is not None:
                        tables, how = done, "buffer"
                        b = tables["v6"]["buffer"]
                        log(f"IPv6 update buffer: {b['used']} of {b['depth']} slots, {len(b['invalid'])} masked")
                    else:
                        tables = tgt.write_tables6(st["nic"], plan6, tables)
                        how = "tables"
                except HypafilterError as e:
                    return {"state": st, "how": "new program", "why": str(e)}
        elif tgt.name == "emu" and tables.get("v6"):
            # the NIC's dual-stack core (docs/ipv6.md "## emu"): the IPv6 rows, the shim's IPv6 k and perhaps the core
            # change with the plan, so the change is an update of the deployment (deploy.follow with `v6`: register
            # writes on the running core when its IPv6 matcher is the new plan's, else a new core), while the whole
            # fast path stays held (the IPv4 fail safe). The new plan's chains go into ip6tables first, as on xdp.
            kb = int((chains or {}).get("k_base", 0))
            n4 = SimpleNamespace(entries=(), num_intervals=kb)
            plan6, why = xdp_v6.plan6_for(
                v6, config, n4, k_base=kb, verbatim=not chains, target="emu", sets=live_sets6("emu")
            )
            if plan6 is not None and chains:
                _load_chains6(plan6, v6, config, st, log)  # (the state says so: the update reads it)
            return {"state": st, "how": "update", "why": why or "the NIC's core takes the IPv6 plan by an update"}
        warnings: list[str] = []
        # (read after the chains were written: the fingerprint of ip6tables as it is now, the tool's chains included)
        six = {**ipv6_state(v6, warnings), "live_digest": live_digest}
        six.update({k: old6[k] for k in CHAINS6_KEYS if k in old6})
        if warnings:
            raise HypafilterError("; ".join(warnings))
        if isinstance(tables.get("v6"), dict) and "writing" in tables["v6"]:
            tables = {**tables, "v6": {k: v for k, v in tables["v6"].items() if k != "writing"}}
        new = {**st, "ipv6": six, "tables": tables}
        new["history"] = (st.get("history") or [])[-HISTORY_KEEP + 1 :] + [
            {
                "time": time.time(),
                "policy_hash": st["policy_hash"],
                "generation": st["generation"],
                "result": "ok",
                "kind": "follow6",
                "how": how,
                "ipv6_hash": six["hash"],
                "duration_s": round(time.monotonic() - t0, 4),
                **(loaded6 or {}),
            }
        ]
        write_state(new)
        if why:
            log(f"IPv6 frames to ip6tables unparsed: {why}")
        return {"state": new, "how": how, "why": why}


# the IPv6 side's record of its chains in ip6tables (docs/ipv6.md "Interval chains in ip6tables"): the plan's chains
# (main, strategy, k_base), the digest of the text a deploy loaded, the chains in use and their fingerprint
CHAINS6_KEYS = ("chains", "loaded", "chains_in_use", "chains_sha256")


def _record_chains6(in_use: dict, config: Config, warnings: list[str], text: str | None = None) -> dict:
    """The state's record of the IPv6 side's chains in use (ops.ruleset.reuse_chains' `in_use`, written to
    chains6.json) and their fingerprint as ip6tables now lists them (`text`, if already read)."""
    _write_chains(in_use, 6, warnings)
    try:
        fp = chains_fingerprint(NS_FW, config, list(in_use), text, 6)
    except HypafilterError as e:
        fp = None
        warnings.append(f"reading back the IPv6 chains: {e}")
    return {"chains_in_use": list(in_use), "chains_sha256": fp}


def _load_chains6(plan6, v6: ip6.V6Policy, config: Config, st: dict, log: Callable[[str], None], fresh=False):
    """A follow of ip6tables: the new IPv6 plan's chains into ip6tables, only those whose content ip6tables does not
    hold yet, as an IPv4 follow loads its chains (ops.ruleset.reuse_chains; docs/optimize.md "What a follow loads"):
    the chains created are named after a generation no chain in ip6tables carries (`HFv6_<g>_…`), the kept ones keep
    the name an earlier write gave them, MAIN (which the base chain's jump names) is rewritten in place, and the
    chains no longer in use are deleted, all in one restore (nf_tables commits it whole, or nothing). Chains that
    are not as the last write left them (a rule added by hand) are all loaded anew. Strategy tree's trees are the last
    rebuild's with the changes since diverted ahead of them (docs/optimize.md "Lazy trees"; the IPv6 side's bases and
    tree cache), built anew when `fresh` (the IPv6 update buffer's lazy rebuild). Returns the state with the IPv6
    side's new record of its chains (written: whatever follows reads it) and what the load did (the history's
    `rules_loaded`, `chains_kept` and `load6_s`, the restore's time)."""
    old6 = st.get("ipv6") or {}
    chains = old6["chains"]
    prefix = (chains.get("main") or "")[: -len("MAIN")]
    kb = int(chains.get("k_base", 0))
    listing = netns.run(["ip6tables-save", "-t", "filter"], NS_FW)
    kept = _kept_chains(old6, config, log, 6, listing)
    own = re.compile(rf":{re.escape(prefix)}(\d+)_")
    gens = {int(m.group(1)) for ln in listing.splitlines() for m in [own.match(ln)] if m}
    gen = max(gens, default=0) % 0xFFFF + 1
    while gen in gens:
        gen = gen % 0xFFFF + 1
    plan6.trees_fresh = fresh
    if not fresh:
        plan6.tree_bases = _tree_bases(6)
        plan6.tree_cache = lambda: _tree_cache(6)  # read only by a process that holds no trees of those bases
    c6 = ip6.render_chains(plan6, config, prefix, gen)
    if c6.main != chains.get("main") or c6.k_base != kb:
        raise HypafilterError(f"the IPv6 chains would move ({c6.state()} after {chains})")
    reused = reuse_chains(ip6.body_lines(c6), c6.main, kept)
    body = dataclasses.replace(c6, text="\n".join(reused.body) + "\n")
    t_load = time.monotonic()
    ip6.load_chains(NS_FW, body, v6.base_chain, listing, reused.in_use)
    load_s = round(time.monotonic() - t_load, 4)
    warnings: list[str] = []
    rec = _record_chains6(reused.in_use, config, warnings)
    _write_trees(plan6, 6, warnings)
    for w in warnings:
        log(w)
    log(
        f"IPv6 interval chains rewritten in ip6tables (k_base {kb}): {reused.rules_loaded} rules loaded, "
        f"{len(reused.kept)} chains kept"
    )
    new = {**st, "ipv6": {**old6, **rec}}
    write_state(new)
    stats = getattr(plan6, "tree_stats", None) or {}
    lazy = {k: stats[k] for k in ("lazy_trees", "lazy_changed", "trees_built", "k0_tree") if k in stats}
    return new, {"rules_loaded": reused.rules_loaded, "chains_kept": len(reused.kept), "load6_s": load_s, **lazy}


def _plan6(v6, config: Config, plan, old6: dict, follow: bool, target: str) -> tuple[object | None, str]:
    """Step compile6: the IPv6 plan hung on `plan` (xdp_v6.plan6_for). Following the live IPv4 ruleset, ip6tables
    stays as deployed (`old6`): the IPv6 plan keeps the k its chains there were written with (or none: verbatim)."""
    kb6 = (old6.get("chains") or {}).get("k_base", 0) if follow else None
    verb6 = follow and not old6.get("chains")
    return xdp_v6.plan6_for(v6, config, plan, kb6, verb6, target=target, sets=live_sets6(target))


def _host_verbatim6(plan6, config: Config, target: str) -> bool:
    """A verbatim IPv6 plan in the NIC's core in host mode: the core's host-mode ACCEPT reaches ip6tables marked
    "decided" (the shim's value 1), which only the interval chains' DA rule takes, so the IPv6 side stays in
    ip6tables alone (not planned into the core)."""
    return target == "emu" and plan6 is not None and plan6.verbatim and config.nic_mode == "host"


def rebuild_plan(policy: Policy, st: dict, config: Config):
    """The plan whose core (program) the lazy rebuild's `follow(policy, rebuild=True)` builds on the deployment `st`,
    compiled as that follow compiles it: what the policy sync service builds beforehand in a thread, so that the
    follow finds the build in the cache. On the NIC with a dual-stack core the IPv6 side as deployed is part of it
    (its entries are part of the core: docs/ipv6.md "## emu")."""
    plan = build_plan(policy, config, live=True)
    old6 = st.get("ipv6") or {}
    if st.get("target", "emu") == "emu" and config.emu_ipv6 and old6.get("mode", "kernel") != "kernel":
        plan6, why = _plan6(ip6.V6Policy.from_state(old6), config, plan, old6, True, "emu")
        plan.plan6 = None if why or _host_verbatim6(plan6, config, "emu") else plan6
    return plan


def _emu_view6(tables: dict, plan, config: Config, log: Callable[[str], None]):
    """The new IPv6 plan (`plan.plan6`) as the running dual-stack core's IPv6 update buffer holds it: align6's View
    over the IPv6 plan the core was generated from (the state's `tables.v6.static`, planned again and used only when
    its IPv6 matcher is the core's, `tables.v6.matcher`), numbered at the core's V6_BASE; None when the state does
    not say, the change does not fit the δ6 slots, or it would fill more than half of them (the lazy rebuild: a new
    core, whose buffer is empty)."""
    v6t = tables.get("v6") or {}
    plan6, src, d6 = getattr(plan, "plan6", None), v6t.get("static"), int(v6t.get("depth", 0) or 0)
    if plan6 is None or not src or not d6:
        return None
    old = ip6.V6Policy(source=src["source"], text=src["text"], base_chain=src["base_chain"], tables=("filter",))
    static6, _ = xdp_v6.plan6_for(
        old, config, plan, plan6.k_base, plan6.verbatim, target="emu", sets=live_sets6("emu")
    )  # fmt: skip
    if static6 is None or emu_v6.v6_matcher(static6) != v6t.get("matcher"):
        return None
    from hypafilter.hw.vhdl import set_generics

    if set_generics(static6) != set_generics(plan6):
        # the new IPv6 plan tests other IPv6 set slots than the core has tables for (a buffer slot would test a set
        # bit no table gives): a new core
        log("IPv6 update buffer: the IPv6 set slots differ from the core's tables; building a new core")
        return None
    try:
        view = emu_v6.view6(static6, plan6, d6)
    except BufferFull as e:
        log(f"IPv6 update buffer: {e}; building a new core")
        return None
    if view.overlay.used > d6 // 2:
        log(f"IPv6 update buffer: the change needs {view.overlay.used} of {d6} slots; a new core (lazy rebuild)")
        return None
    view.index_base = int(v6t.get("index_base", static6.index_base))
    log(f"IPv6 update buffer: {view.overlay.used} of {d6} slots, {int((~view.valid).sum())} entries masked")
    return view


def _static6(tables: dict, config: Config, n4, k_base: int, chains) -> object | None:
    """The family-6 plan the running xdp program's IPv6 table set was written from (the static entries of its IPv6
    update buffer: the state's `tables.v6.static`), or None when the state does not say."""
    src = (tables.get("v6") or {}).get("static")
    if not src:
        return None
    old = ip6.V6Policy(source=src["source"], text=src["text"], base_chain=src["base_chain"], tables=("filter",))
    plan6, _ = xdp_v6.plan6_for(old, config, n4, k_base=k_base, verbatim=not chains, sets=live_sets6("xdp"))
    return plan6


def first_lease_ms(config: Config) -> int:
    """The lease a deploy arms the fast path with: the configured one (0: disarmed), plus the time the policy sync
    service may take to start (ops.daemon.READY_TIMEOUT), whose first act is to renew it to the configured length;
    a service that never starts leaves the fast path deciding nothing once this runs out."""
    ms = config.policysync_lease_ms
    return ms + int(READY_TIMEOUT * 1000) if ms else 0


class FollowWatch:
    """What the policy sync service does while `follow` applies a change (ops.policysync.worker.Follower):

    - `hold()`, asked just before the fast path would decide again: True when a newer change is pending; then
      everything stays with software, every tag stale (the new state's `held`);
    - `applied(generation, nic)`, once the fast path decides by the new policy: from here a newer change must be
      failed safe on this NIC and generation (the state file still names the old ones);
    - `poll()`, between the steps of the tidying up that follows (old chains, read-back, state): read the events
      queued meanwhile and fail safe at once for a newer change, instead of after the update."""

    def hold(self) -> bool:
        return False

    def applied(self, generation: int, nic: dict) -> None:
        pass

    def poll(self) -> None:
        pass

    def starting(self, nic: dict) -> None:
        """A new NIC (program) of this update, before it decides anything: the service's IPv6 fail safe, when in
        force, is written to it too (a new program's IPv6 path starts deciding)."""


def stale_generation(gen: int) -> int:
    """A generation no tag of generation `gen` carries: the shim takes every such tag for stale (k = 0)."""
    return gen + 1 if gen < 0xFFFF else 1


def deployed_config(st: dict) -> Config:
    """The whole configuration a deployment was made with (the state keeps it since live policies: `config`),
    else what state_config knows."""
    doc = st.get("config")
    if not doc:
        return state_config(st, plan=True)
    known = {f.name for f in dataclasses.fields(Config)}
    return Config(**{k: v for k, v in doc.items() if k in known})


def _deploy_locked(
    policy: Policy,
    config: Config,
    force: bool,
    log,
    tgt: Target,
    follow: bool = False,
    watch: FollowWatch | None = None,
    digest: str | None = None,
    v6: ip6.V6Policy | None = None,
    live6: str | None = None,
) -> dict:
    t0 = time.monotonic()
    watch = watch or FollowWatch()
    old = read_state()
    old6 = (old or {}).get("ipv6") or {"mode": "kernel"}
    kept6 = follow and v6 is None
    if kept6:  # following the live IPv4 ruleset: the IPv6 side stays as deployed
        v6 = ip6.V6Policy.from_state(old6) if old6.get("mode") != "kernel" else None
    v6_hash = v6.policy_hash() if v6 is not None else None
    # ip6tables' tables as they were before the first deploy that loaded an IPv6 side: what undeploy gives back
    before6 = (old or {}).get("ipv6_before")
    if old and old.get("target", "emu") != tgt.name:
        raise HypafilterError(f"a policy is deployed on target '{old.get('target', 'emu')}': undeploy it first")
    phash = policy.policy_hash()
    same = (
        old
        and all(
            old.get(k) == v
            for k, v in (
                ("policy_hash", phash),
                ("mode", config.shunt_mode),
                ("strategy", config.strategy),
                ("mark_mask", config.mark_mask),
                ("mark_shift", config.mark_shift),
                ("unfilterable", config.unfilterable),
                ("interfaces", _interfaces_state(policy)),
                ("nic_mode", config.nic_mode),
                ("update_buffer", config.update_buffer),
                ("lease_ms", config.policysync_lease_ms),
            )
        )
        and old6.get("hash") == v6_hash
        # each target's own IPv6 switch: the other target's is not part of this deployment
        and (tgt.name != "xdp" or bool(old.get("xdp_ipv6")) == config.xdp_ipv6)
        and (tgt.name != "emu" or bool(old.get("emu_ipv6")) == config.emu_ipv6)
    )
    same = same and old.get("tree_min_segment", 16) == config.tree_min_segment  # (states before strategy tree: 16)
    if same and follow and not force:
        log("the live ruleset is the deployed policy")
        return old
    if same and not force and tgt.alive(old["nic"]):
        found = drift(old, tgt)
        if not found:
            log("policy already deployed; nothing to do (use --force to redeploy)")
            return old
        log("the live system drifted from the deployment (" + "; ".join(found) + "): redeploying")
        force = True
    site = {"ports": SITE_PORTS, "netns": NS_FW, "ifaces": list(FW_IFACES)}
    if old and "site" in old and {k: old["site"].get(k) for k in site} != site:
        raise HypafilterError(
            f"a policy is deployed on {old['site'].get('ifaces')} ({old['site'].get('netns') or 'this namespace'}), "
            f"not on {site['ifaces']} ({site['netns'] or 'this namespace'}): undeploy it first"
        )
    if old and old.get("nic_mode", "bridge") != config.nic_mode:
        raise HypafilterError(
            f"the deployed policy runs the NIC in {old.get('nic_mode', 'bridge')} mode ({old.get('base_chain')}); "
            f"{policy.base_chain} needs {config.nic_mode} mode: undeploy first"
        )
    _check_lab(tgt.name)
    fwshim = _fw_shim(tgt.name)
    base = policy.base_chain
    # The reads before the first change, each a short command waiting on the kernel: run side by side (an update
    # waited ~40 ms for them one after the other); each result is taken where the sequence needs it, its error
    # raised there, so what is reported and in which order does not change.
    pre = {
        "foreign": (lambda: live.foreign_chains(NS_FW, config.table, config.nic_mode)) if not follow else None,
        "backend": (lambda: live.backend(NS_FW)) if not follow else None,
        "jump": (lambda: has_jump(NS_FW, config, base, old["main_chain"])) if old else None,
        "attached": fwshim.attached if old else None,
        "unfilterable": (lambda: _unfilterable_drift(old)) if old else None,
        "kernel": (lambda: _kernel_check(policy, config)) if not follow else None,
    }
    ready = {k: _in_background(fn) for k, fn in pre.items() if fn is not None}
    if not follow and (others := ready["foreign"]()):
        raise HypafilterError(
            f"nftables base chains besides iptables' {config.table} table filter the frames the fast path would "
            f"decide without them: {'; '.join(others)}. hypafilter accelerates an iptables policy; remove them or "
            "move their rules into the policy (docs/deploy.md, Live policy)"
        )
    if not follow and ready["backend"]() != "nf_tables":
        raise HypafilterError(
            "iptables here is the legacy xtables backend, which announces no ruleset change: hypafilter follows the "
            "live ruleset through nf_tables events (docs/deploy.md, Live policy); use iptables-nft "
            "(update-alternatives --set iptables /usr/sbin/iptables-nft)"
        )
    if not follow and v6 is not None and ip6.backend(NS_FW) != "nf_tables":
        raise HypafilterError(
            "ip6tables here is the legacy xtables backend while iptables is nf_tables: the IPv6 policy goes into the "
            "same backend as the IPv4 one (update-alternatives --set ip6tables /usr/sbin/ip6tables-nft)"
        )
    gen = (old["generation"] + 1) if old else 1
    gen = gen if gen <= 0xFFFF else 1  # the hardware carries 16 bits of generation
    # chains a follow kept from earlier generations keep their names: a generation number they carry is not reused
    own = re.compile(rf"^{re.escape(config.chain_prefix)}(\d+)_")
    kept_gens = {int(m.group(1)) for c in (old or {}).get("chains") or () for m in [own.match(c)] if m}
    while gen in kept_gens:
        gen = gen + 1 if gen < 0xFFFF else 1
    tx = Transaction(log=log)
    prefix = chain_prefix(config, gen)
    new_main = f"{prefix}MAIN"
    old_main = old["main_chain"] if old and ready["jump"]() else None
    old_nic = old["nic"] if old else None
    if old_nic and not tgt.alive(old_nic):
        log(f"previous NIC (pid {old_nic.get('pid')}) is gone; deploying as new")
        old_nic = None

    held = False
    nft_gen = None
    loaded = None  # (generation before, after) the deploy's load of the ruleset
    # A running policy sync service stays: it leaves the ruleset to a deploy that holds the lock and takes the
    # commits up to the generation the deploy records (`nft_generation`) for the deploy's own.
    keep = ("policysync",) if services.POLICYSYNC.running_pid(STATE_DIR) and not follow else ()
    # The kernel's own parser (a scratch namespace) reports a rule it refuses at the user's line. Its verdict is
    # awaited before a build (minutes for a new core) and whenever a step fails (its words then explain the
    # failure); an update through the update buffer or the registers does not wait for it: the load of the
    # ruleset itself refuses the same rules, atomically, and the transaction rolls back.
    kernel = ready.get("kernel")
    # the IPv6 side's ip6tables text (the policy, with the IPv6 plan's interval chains when the xdp program writes k)
    chains6, text6 = None, (v6.text if v6 is not None else None)
    loaded6 = False  # the deploy loaded ip6tables (the IPv6 side's chains among it)
    try:
        try:
            tx.step("interfaces", lambda: _check_interfaces(policy))
            plan = tx.step("compile", lambda: build_plan(policy, config, live=True))
            # strategy tree's live trees (K0T, long interval chains): a follow reuses the last rebuild's trees with the
            # changes diverted ahead of them (docs/optimize.md, "Lazy trees"); a deploy and a lazy rebuild build anew
            # the fast paths that mark the frames they pass unparsed while they vouch for their tables: the xdp
            # program, and the NIC's shim (its core shunts a frame it does not judge with no index, docs/shim.md)
            plan.k0_tree = tgt.name in ("xdp", "emu")
            plan.trees_fresh = bool(force or not follow)
            if not plan.trees_fresh:
                plan.tree_bases = _tree_bases()
                plan.tree_cache = _tree_cache  # read only by a process that holds no trees of those bases
            if (tgt.name == "xdp" and config.xdp_ipv6) or (tgt.name == "emu" and config.emu_ipv6):
                # the fast path's hook: IPv6 decided in XDP, or in the emulated NIC's dual-stack core (docs/ipv6.md)
                plan.plan6, why6 = tx.step("compile6", lambda: _plan6(v6, config, plan, old6, follow, tgt.name))
                if why6:
                    log(f"IPv6 frames to ip6tables unparsed: {why6}")
                elif not follow:
                    chains6, text6 = _chains6(plan.plan6, v6, config, log)
                if _host_verbatim6(plan.plan6, config, tgt.name):
                    plan.plan6 = None
                    log("IPv6 frames to ip6tables unparsed: host mode without the IPv6 interval chains")
        except DeployError:
            if kernel is not None:
                tx.step("kernel-check", kernel)
            raise
        # The update buffer first (SFL, docs/deploy.md "Update buffer"): the running matcher with an overlay that
        # makes it decide as the new plan; a new core (program) only when the change does not fit.
        view = view6 = None
        static = read_static(STATE_DIR, old_nic.get("binary", ""), plan) if old_nic and not force else None
        if (
            static is not None
            and tgt.name == "xdp"
            and not xdp_v6.buffer_keeps_v6(old_nic, plan, old6.get("hash") != v6_hash)
        ):
            static = None  # the update buffer changes IPv4 entries only: a new IPv6 side is a tables write
        if (
            static is not None
            and tgt.name == "emu"
            and not emu_v6.core_keeps_v6((old or {}).get("tables") or {}, getattr(plan, "plan6", None))
        ):
            # the running core's IPv6 matcher is not the new IPv6 plan's: the IPv6 update buffer (align6's View over
            # the core's static IPv6 plan, docs/ipv6.md "## emu"), else a new core
            view6 = _emu_view6((old or {}).get("tables") or {}, plan, config, log)
            if view6 is None:
                static = None
            else:
                plan6_new, plan.plan6 = plan.plan6, view6
        # a configuration with another buffer depth builds a new core (program): the depth is part of its build
        # the running program's set slots must be the plan's (their maps are part of its build: docs/sets.md)
        if static is not None and not tgt.same_sets(old_nic, plan):
            static = None
        if (
            static is not None
            and tgt.name == "emu"
            and _set_rows(plan) != ((old or {}).get("tables") or {}).get("sets", [])
        ):
            # the NIC's set follower (ops.policysync.nicsets) writes each set into the slot the running core's tables
            # gave it: a plan that numbers the slots otherwise (a rule testing a set first now) on the same core
            # would have the follower write one set's elements into the slot another rule reads. A new NIC, whose
            # follower starts with the new slots.
            log("set slots numbered otherwise than in the running core's tables: a new core")
            static = None
        if static is not None and static[1] > 0 and static[1] == tgt.buffer_depth():
            t_ov = time.monotonic()
            try:
                view = align(static[0], plan, static[1])
                view.plan6 = getattr(plan, "plan6", None)  # xdp: the IPv6 table set is written with the overlay
            except BufferFull as e:
                log(f"update buffer: {e}; building a new core")
            tx.timings["overlay"] = round(time.monotonic() - t_ov, 4)
        if view is None and view6 is not None:
            plan.plan6 = plan6_new  # a new core after all (the IPv4 side does not fit): built for the new IPv6 plan
        hw = view if view is not None else plan
        if kernel is not None and (view is None or not old_nic):  # a build may come: the kernel's verdict first
            tx.step("kernel-check", kernel)
            kernel = None
        binary = old_nic["binary"] if view is not None else tx.step("build", lambda: tgt.build(plan))
        intervals = [int(k) for k in hw.interval]
        if tgt.name == "emu" and getattr(plan, "plan6", None) is not None:
            # the dual-stack core's IPv6 indices (V6_BASE = n + 1 + δ ..): the shim maps them to the IPv6 plan's k
            intervals = emu_v6.intervals(intervals, plan.plan6)
        nf_text = tx.step(
            "render",
            lambda: to_iptables_restore(
                plan,
                config.strategy,
                prefix,
                config.mark_mask,
                config.mark_shift,
                table=config.table,
                nic_mode=config.nic_mode,
            ),
        )
        body = body_of(nf_text)
        if os.environ.get(FAIL_ENV) == "netfilter":
            body.append(f"-A {new_main} -m hf-no-such-match -j ACCEPT")
        if new_main not in {ln[1:].split()[0] for ln in body if ln.startswith(":")}:
            raise DeployError("render", f"netfilter rules do not define the entry chain {new_main}")
        # A follow loads only the chains whose content the kernel does not hold yet: the others stay under the
        # earlier generation's name, and the new ones jump to them (docs/optimize.md, "What a follow loads").
        t_reuse = time.monotonic()
        kept_before = _kept_chains(old, config, log) if follow and not force else {}
        reused = reuse_chains(body, new_main, kept_before)
        tx.timings["reuse"] = round(time.monotonic() - t_reuse, 4)
        new_chains = list(reused.in_use)
        body = reused.body

        # 1. Everything to software on the running hardware (its metadata stays valid for the old chains).
        if old_nic:
            # following the live ruleset, the old tables no longer hold: a failure leaves everything to software
            tx.step(
                "shunt-all",
                lambda: tgt.shunt_all(old_nic, True),
                None if follow else lambda: tgt.shunt_all(old_nic, False),
            )
        # 2. Shim generation first: from here every hardware tag is stale → k = 0 → full policy in software.
        #    An update of a running deployment with the same mark bits writes the one word through the bpf()
        #    syscall; anything else (a fresh deploy, a repair, other mark bits) goes through the shim's loader.
        quick = (
            bool(old_nic)
            and not force
            and fwshim.pinned
            and all(old.get(k) == getattr(config, k) for k in ("mark_mask", "mark_shift"))
            and ready["attached"]() == fwshim.ifaces  # pins can outlive a deleted namespace's programs
        )
        if quick:
            old_gen = old["generation"]
            tx.step(
                "shim-generation",
                lambda: fwshim.set_generation(gen),
                None if follow else lambda: fwshim.set_generation(old_gen),
            )
        else:
            if fwshim.clear_stale():
                log(f"removed the shim's stale pins in {fwshim.pin} (their namespace was deleted without an unload)")
            was_loaded = fwshim.loaded
            old_cfg = fwshim.stats()["config"] if was_loaded else None

            def shim_gen():
                if not fwshim.loaded:
                    fwshim.load()
                fwshim.update(generation=gen, mark_mask=config.mark_mask, mark_shift=config.mark_shift)

            def shim_gen_undo():
                if not was_loaded:
                    fwshim.unload()
                else:
                    fwshim.update(
                        generation=old_cfg["generation"],
                        mark_mask=old_cfg["mark_mask"],
                        mark_shift=old_cfg["mark_shift"],
                    )

            tx.step("shim-generation", shim_gen, None if follow and was_loaded else shim_gen_undo)
        # Single-tagged (802.1Q) IPv4 frames are classified by the hardware, so netfilter must filter them too
        # when they are shunted: the kernel default (0) lets them cross the bridge without any iptables rule.
        old_vlan = netns.sysctl(VLAN_SYSCTL, NS_FW)
        if old_vlan != "1":
            tx.step(
                "bridge-vlan",
                lambda: netns.run(["sysctl", "-qw", f"{VLAN_SYSCTL}=1"], NS_FW),
                lambda: netns.run(["sysctl", "-qw", f"{VLAN_SYSCTL}={old_vlan}"], NS_FW),
            )
        # Two-tag frames cross the bridge without iptables: dropped by the NIC (unfilterable = "drop"), and by
        # the host too for frames the NIC hands it while it is not classifying (reset, standby, loading). An update
        # with the same setting leaves the table as the last deploy wrote it (drift names a change by hand).
        old_unfilterable = (old or {}).get("unfilterable", "pass")
        if force or not old or old_unfilterable != config.unfilterable or ready["unfilterable"]():
            tx.step(
                "bridge-unfilterable",
                lambda: netns.run(["nft", "-f", "-"], NS_FW, input=unfilterable_nft(config.unfilterable)),
                lambda: netns.run(["nft", "-f", "-"], NS_FW, input=unfilterable_nft(old_unfilterable)),
            )
        # 3. New chains and the jump to them, in one atomic restore.
        # The policy goes live under its own names, the tool's chains beside it, the jump first: one atomic restore;
        # its undo puts the whole table back as it was.
        if follow:
            # the operator's chains are the policy already: only the tool's chains and the jump, moved first
            tx.step(
                "netfilter",
                lambda: restore(NS_FW, switch_text(config, base, body, new_main, old_main)),
                lambda: (
                    restore(NS_FW, switch_text(config, base, [], old_main, new_main)),
                    restore(NS_FW, delete_text(config, reused.created)),
                ),
            )
        else:
            # The IPv6 side first (docs/ipv6.md): its tables replaced by the IPv6 policy (or given back to the
            # operator when the deployment no longer has one); the undo puts them back as they were just before.
            # Loaded before the IPv4 ruleset, so that the IPv4 load stays the deploy's last commit (nft_generation).
            if (
                v6_hash != old6.get("hash")
                or force
                or (v6 is not None and old6.get("fingerprint") != ip6.fingerprint(NS_FW, v6.tables))
                or ((chains6 is not None or old6.get("chains")) and old6.get("loaded") != _digest(text6))
            ):
                tables6 = tuple(dict.fromkeys((*(v6.tables if v6 else ()), *old6.get("tables", ()))))
                snap6 = ip6.snapshot(NS_FW, tables6)
                if v6 is not None:
                    before6 = {**snap6, **(before6 or {})}
                    # the tables the deployed IPv6 policy named and this one does not (firewalld's mangle, raw,
                    # security and nat after a filter-only policy): given back as they were before the deployment,
                    # as undeploy does, not left deciding frames beside the new policy
                    gone6 = {t: before6.get(t) for t in old6.get("tables", ()) if t not in v6.tables}
                    text6_load = text6
                    if os.environ.get(FAIL_ENV) == "netfilter6":  # a real ip6tables-restore error (tests)
                        text6_load = text6.replace("COMMIT", f"-A {v6.base_chain} -m hf-no-such-match\nCOMMIT", 1)
                    tx.step(
                        "netfilter6",
                        lambda: ip6.load_text(NS_FW, text6_load, gone6),
                        lambda: ip6.give_back(NS_FW, snap6),
                    )
                    loaded6 = True
                elif (old or {}).get("ipv6_before") is not None:
                    tx.step(
                        "netfilter6",
                        lambda: ip6.give_back(NS_FW, old["ipv6_before"]),
                        lambda: ip6.give_back(NS_FW, snap6),
                    )
                    before6 = None
            snapshot = table_snapshot(NS_FW, config)
            gone = orphans(snapshot, policy, config.chain_prefix)
            nft = NfTables(NS_FW)
            try:
                g0 = nft.generation()
                tx.step(
                    "netfilter",
                    lambda: restore(NS_FW, live_text(config, policy, body, new_main, old_main, gone)),
                    lambda: restore_table(NS_FW, snapshot),
                )
                # Ours when the load was the one commit since g0: a concurrent change must be read by the service,
                # not taken as ours. The listing of it (for the digest) is read once the new policy holds.
                g1 = nft.generation()
                loaded = (g0, g1)
                nft_gen = g1 if g1 == g0 + 1 else None
            finally:
                nft.close()
        # 4. Interval table of the new plan (read by nobody yet: everything is stale).
        old_intervals = old.get("intervals") if old else None
        # the NIC's shim marks the frames its core judged unparsed for the live K0 tree (strategy tree, live; the
        # xdp target's TC-only shim never sees a tag: its fast path marks them itself, CONTROL bit 64)
        shim_control = 0 if fwshim.tc_only or not k0_tree_wanted(plan, config.strategy) else K0_SHIM
        old_control = (old or {}).get("shim_control", 0)

        def shim_tables_undo():
            if old_intervals is not None:
                fwshim.update(old_intervals, num_entries=len(old_intervals), control=old_control)

        tx.step(
            "shim-tables",
            lambda: fwshim.update(intervals, num_entries=len(intervals), control=shim_control),
            shim_tables_undo,
        )
        # 5. Hardware: a new NIC for a new matcher (standby until programmed), else rewrite the registers. The
        #    build is keyed on the matcher (hw.vhdl.matcher_hash), so only a change of the hardware entries replaces it.
        replace = not old_nic or old_nic.get("binary") != binary or force
        if replace:
            # Beside a running NIC the new one waits in standby until it is programmed. Alone it starts active: the
            # core powers up shunting every entry with GENERATION 0, which the shim (generation >= 1) treats as
            # stale, so until `registers` every frame gets the full policy in software — always right.
            standby = bool(old_nic)
            new_nic = tx.step("nic", lambda: tgt.start(binary, gen, standby=standby), None)
            tx.undo.append(("nic", lambda: tgt.stop(new_nic)))
            written = tx.step("registers", lambda: tgt.program(new_nic, plan, gen))
            tx.step("lease", lambda: tgt.set_lease(new_nic, first_lease_ms(config)))
            watch.starting(new_nic)
            if watch.hold():  # a newer change of the live ruleset: the new NIC decides nothing yet
                tgt.shunt_all(new_nic, True)
                fwshim.set_generation(stale_generation(gen))
                held = True
            # Activate the new NIC before silencing the old one: frames in the overlap may be seen by both
            # (a duplicate with the right verdict), never by neither.
            tx.step("activate", lambda: tgt.activate(new_nic), lambda: tgt.standby(new_nic))
            if old_nic:
                tx.step("standby-old", lambda: tgt.standby(old_nic), lambda: tgt.activate(old_nic))
        else:
            # Same matcher: the running core takes the new shunt vector and actions by register writes, only the
            # words that changed (a complex-only change in index/selective mode touches a few).
            new_nic = old_nic
            old_tables = old.get("tables")
            done: dict = {}

            def registers():
                # a View's tables carry the buffer: its slots and valid mask are written with the rows they index
                done.update(tgt.program(new_nic, hw, gen, known=old_tables))
                return dict(done)

            def registers_undo():
                if old_tables:  # the tables as the last update wrote them, the buffer's image included
                    tgt.write_tables(new_nic, old_tables, old["generation"], known=done or None)
                else:  # a state from before tables were recorded: the old plan's tables are unknown
                    raise HypafilterError("previous tables unknown; redeploy the previous policy to restore them")

            written = tx.step("registers", registers, registers_undo, undo_first=True)
            tx.step("lease", lambda: tgt.set_lease(new_nic, first_lease_ms(config)))
            if watch.hold():  # a newer change of the live ruleset: everything stays with software
                fwshim.set_generation(stale_generation(gen))
                held = True
            else:
                tx.step("release", lambda: tgt.shunt_all(new_nic, False))
        # the new policy holds from here (the fast path decides by it, or shunts while `held`): what an operator
        # waits for; the rest (old chains, state) is tidying up
        applied = round(time.monotonic() - t0, 4)
        tx.undo.clear()  # committed: from here on, failures are clean-up warnings, not rollbacks
        if not held:
            watch.applied(gen, new_nic)
    except DeployError as e:
        tx.rollback()
        err = e
        if kernel is not None and e.step != "kernel-check":
            try:  # the kernel check not awaited yet: a rule it refuses explains the failure at the user's line
                kernel()
            except HypafilterError as refused:
                err = DeployError("kernel-check", str(refused))
        if tx.rollback_errors:
            raise DeployError(err.step, f"{err}; rollback also failed: {'; '.join(tx.rollback_errors)}") from e
        _journal_failure(old, policy, gen, err, tx, t0)
        if err is not e:
            raise err from e
        raise

    # The running services follow the old NIC and policy; new ones start below when wanted. Following the live
    # ruleset (the policy sync service itself runs this), only a service of a replaced NIC starts again.
    restart = (
        (("flowsync",) if replace else ()) if follow else tuple(s.name for s in services.SERVICES if s.name not in keep)
    )
    warnings = [f"stopping {svc.title}: {e}" for svc, e in services.stop_all(STATE_DIR, only=restart)]
    watch.poll()
    if replace:
        try:
            write_static(STATE_DIR, plan, tgt.buffer_depth(), binary, _write_private)
        except OSError as e:
            warnings.append(f"writing {static_path(STATE_DIR)}: {e}")
    _write_chains(reused.in_use, 4, warnings)
    _write_trees(plan, 4, warnings)
    if loaded6 and chains6 is not None:  # the IPv6 side's trees as ip6tables now holds them
        _write_trees(plan.plan6, 6, warnings)
    if old_nic and replace:
        try:
            tgt.stop(old_nic)
        except Exception as e:
            warnings.append(f"stopping the old NIC: {e}")
    if kernel is not None:  # not awaited: the load succeeded, so the kernel took every rule
        try:
            kernel()
        except HypafilterError as refused:
            warnings.append(f"the kernel check refused what the load took: {refused}")
    watch.poll()
    if loaded is not None:
        # The listing as the kernel now shows the loaded policy (iptables-save orders and omits options its own way):
        # its digest lets the policy sync service know it without parsing it; none when another commit came since.
        digest = None
        if nft_gen is not None:
            nft = NfTables(NS_FW)
            try:
                text, g2 = live.listing(NS_FW, config.table, nft.generation)
                digest = live.digest(text, config.chain_prefix) if g2 == nft_gen else None
            except HypafilterError as e:
                warnings.append(f"reading back the loaded ruleset: {e}")
            finally:
                nft.close()
    try:
        stale = [c for cs in owned_chains(NS_FW, config).values() for c in cs if c not in reused.in_use]
        if stale:
            nft_gen = _own_commit(lambda: restore(NS_FW, delete_text(config, stale)), nft_gen)
    except HypafilterError as e:
        warnings.append(f"removing old chains: {e}")
    watch.poll()

    try:
        fingerprint = chains_fingerprint(NS_FW, config, new_chains)
    except HypafilterError as e:
        fingerprint = None
        warnings.append(f"reading back the chains: {e}")
    took = round(time.monotonic() - t0, 3)
    if follow:  # ip6tables as the deploy before this one loaded it
        six_chains = {k: old6[k] for k in CHAINS6_KEYS if k in old6}
    else:
        six_chains = {"loaded": _digest(text6)} if v6 is not None else {}
        if chains6 is not None:
            six_chains["chains"] = chains6.state()
            if loaded6:  # every chain of the IPv6 side loaded: what the IPv6 side's follows may keep
                six_chains.update(_record_chains6(reuse_chains(ip6.body_lines(chains6), chains6.main, {}).in_use,
                                                  config, warnings))  # fmt: skip
            else:  # ip6tables as the last update left it
                six_chains.update({k: old6[k] for k in ("chains_in_use", "chains_sha256") if k in old6})
    state = {
        "target": tgt.name,
        "policy_hash": phash,
        "policy_source": policy.source,
        "base_chain": base,
        "table": config.table,
        "chain_prefix": config.chain_prefix,
        "prefix": prefix,
        "main_chain": new_main,
        "base_policy": policy.default,
        "user_chains": user_chain_names(prefix, policy.user_chains),
        "chains": new_chains,
        # chains of this generation kept from an earlier one (unchanged, not loaded again): {its name: the kernel's}
        "chains_kept": reused.kept,
        "chains_sha256": fingerprint,
        # the digest (ops.policysync.live.digest) of the live listing this policy was read from (a follow) or that
        # loading it gave (a deploy; None if another commit came between): a listing with this digest is this policy
        "live_digest": digest,
        "generation": gen,
        "mode": config.shunt_mode,
        "strategy": config.strategy,
        "tree_min_segment": config.tree_min_segment,
        # strategy tree: the trees the chains hold, and how many a follow kept (docs/optimize.md, "Lazy trees")
        "trees": getattr(plan, "tree_stats", None) if config.strategy == "tree" else None,
        "mark_mask": config.mark_mask,
        "mark_shift": config.mark_shift,
        "unfilterable": config.unfilterable,
        "interfaces": _interfaces_state(policy),
        "nic_mode": config.nic_mode,
        "update_buffer": config.update_buffer,
        # the policy sync lease the service renews (0: none; docs/deploy.md "Live policy")
        "lease_ms": config.policysync_lease_ms,
        "xdp_ipv6": config.xdp_ipv6,
        "emu_ipv6": config.emu_ipv6,
        # The firewall's VLAN setting found before the first deploy, given back at undeploy.
        "vlan_filter_before": (old or {}).get("vlan_filter_before", old_vlan),
        "partition": partition_counts(policy, plan),
        "sets": sets_state(policy, v6, getattr(plan, "plan6", None)),
        # the IPv6 side (docs/ipv6.md): the ip6tables policy, and the IPv6 plan's interval chains there (`chains`) when
        # the xdp program decides IPv6 frames and passes the shunted ones with their k
        "ipv6": {
            **ipv6_state(v6, warnings),
            **six_chains,
            # followed from ip6tables (live6): that listing is the IPv6 side; no fingerprint of ip6tables as it is now
            **({"live_digest": live6, "fingerprint": None} if live6 else {}),
            # an IPv4 follow keeps the IPv6 side as recorded (ip6tables may hold a change the service has not read)
            **({k: old6[k] for k in ("live_digest", "fingerprint") if k in old6} if kept6 and v6 is not None else {}),
        },
        "ipv6_before": before6,
        "intervals": intervals,
        "shim_control": shim_control,
        "nic": new_nic,
        "tables": {k: v for k, v in written.items() if k != "writes"},
        "shim": {"netns": NS_FW, "ifaces": list(FW_IFACES), "pin": str(fwshim.pin), "tc_only": fwshim.tc_only},
        "site": {"ports": SITE_PORTS, "netns": NS_FW, "ifaces": list(FW_IFACES), "bridge": FW_BRIDGE, "lab": LAB_NAME},
        "deployed_at": time.time(),
        "plain_rules": policy_restore(policy, config.table),
        "config": dataclasses.asdict(config),
        # a newer change of the live ruleset came while this one was applied: the fast path shunts everything
        "held": held,
        # nf_tables' generation of this deploy's load of the ruleset: the policy sync service takes the commits up to
        # it for the deploy's own (later ones, made while the lock is held, it reads again once it is free); a
        # follow keeps the deploy's (the service knows its own commits by their pids)
        "nft_generation": (old or {}).get("nft_generation") if follow else nft_gen,
        # the update buffer's contents over the running matcher (docs/deploy.md "Update buffer"); None: not in use
        "overlay": overlay_json(view.overlay) if view is not None else None,
        "history": ((old or {}).get("history") or [])[-HISTORY_KEEP + 1 :]
        + [
            {
                "time": time.time(),
                "policy_hash": phash,
                "generation": gen,
                "result": "ok",
                "kind": "follow" if follow else "update" if old else "deploy",
                "overlay_slots": view.overlay.used if view is not None else None,
                "replaced_nic": bool(replace),
                "register_writes": written["writes"],
                # the tool's rules this load wrote, and its chains kept from earlier generations (unchanged)
                "rules_loaded": reused.rules_loaded,
                "chains_kept": len(reused.kept),
                "duration_s": took,
                "applied_s": applied,
                "steps": tx.timings,
                "warnings": warnings,
            }
        ],
    }
    if (follow or keep) and old:  # the records of the services that keep running
        state.update(
            {svc.name: old[svc.name] for svc in services.SERVICES if svc.name in old and svc.name not in restart}
        )
    watch.poll()
    write_state(state)
    watch.poll()
    started = services.start_wanted(NS_FW, STATE_DIR, policy, plan, tgt, new_nic, warnings, log, only=restart)
    state.update(started)
    # A wanted service that did not start: the policy holds (committed above; no service decides a verdict), but
    # the deployment is degraded: said in the state and its history, drift in status, and deploy exits non-zero.
    state["degraded"] = services.failed(started)
    state["history"][-1]["degraded"] = state["degraded"]
    write_state(state)
    for w in warnings:
        log(f"warning: {w}")
    log(f"deployed generation {gen} in {took:.2f}s")
    return state


def _digest(text: str | None) -> str | None:
    return hashlib.sha256(text.encode()).hexdigest() if text is not None else None


def _chains6(plan6, v6: ip6.V6Policy, config: Config, log) -> tuple[ip6.Chains6 | None, str]:
    """The IPv6 plan's interval chains and the ip6tables text that carries them (docs/ipv6.md "### Interval chains in
    ip6tables"), or (None, the policy's text) with the plan made verbatim (k = 0 for every IPv6 frame: the whole
    policy in ip6tables, exact as in stage 1) when they cannot be written, which is said."""
    try:
        chains = ip6.render_chains(plan6, config, f"{config.chain_prefix}v6_")
        return chains, ip6.with_chains(v6, chains)
    except HypafilterError as e:
        log(f"IPv6 interval chains not written ({e}): every IPv6 frame the program passes gets k = 0")
        plan6.verbatim = True
        return None, v6.text


def ipv6_state(v6: ip6.V6Policy | None, warnings: list[str]) -> dict:
    """What the state keeps of the IPv6 side: the policy (or drop) with a fingerprint of its tables as loaded, or
    mode "kernel" (ip6tables as the operator has it)."""
    if v6 is None:
        return {"mode": "kernel"}
    out = v6.state()
    try:
        out["fingerprint"] = ip6.fingerprint(NS_FW, v6.tables)
    except HypafilterError as e:
        warnings.append(f"reading back ip6tables: {e}")
    return out


def ipv6_drift(st: dict) -> list[str]:
    """ip6tables against the IPv6 side the deployment loaded (nothing to compare in mode kernel)."""
    six = st.get("ipv6") or {"mode": "kernel"}
    if six.get("mode") == "kernel":
        return []
    try:
        if six.get("fingerprint"):
            if ip6.fingerprint(NS_FW, six.get("tables", ())) != six["fingerprint"]:
                return [f"ip6tables: changed since the deploy of the IPv6 side ({six.get('source')})"]
        elif six.get("live_digest"):
            # A follow on the NIC's dual-stack core records the listing its update read, not a fingerprint of
            # ip6tables at its end (a change made during a core build stays a change): ip6tables' operator's part
            # against that listing's (docs/ipv6.md "Following ip6tables"). A change the policy sync service has not
            # applied (stopped, or one it cannot follow) is drift, as after a deploy.
            text = netns.run(["ip6tables-save"], NS_FW)
            if ip6.digest6(ip6.strip6(text, ip6.tool_prefix(six))) != six["live_digest"]:
                return [f"ip6tables: changed since the policy sync service followed it ({six.get('source')})"]
    except HypafilterError as e:
        return [f"ip6tables: {e}"]
    return []


def ipv6_status(st: dict) -> dict:
    """The IPv6 line's facts: what happens to IPv6 frames and the ip6tables rules in the base chain's table."""
    six = dict(st.get("ipv6") or {"mode": "kernel"})
    six.pop("text", None)
    base = six.get("base_chain") or st.get("base_chain", "FORWARD")
    try:
        live = ip6.counts(NS_FW, "filter")
        six["live_rules"] = sum(live.values())
        six["live_base_rules"] = live.get(base, 0)
        six["live_base_policy"] = _ip6_policy(base) if live else "ACCEPT"
    except HypafilterError as e:
        six["error"] = str(e)
    six["base_chain"] = base
    if (st.get("tables") or {}).get("v6"):  # the xdp program or the NIC's core decides IPv6 frames too (docs/ipv6.md)
        # (without `static`: the text of the IPv6 policy the table set was written from, the update buffer's base)
        fast = {k: v for k, v in st["tables"]["v6"].items() if k != "static"}
        six["nic" if st.get("target", "emu") == "emu" else "xdp"] = fast
    return six


def _ip6_policy(base: str) -> str:
    for ln in netns.run(["ip6tables", "-w", "-S", base], NS_FW).splitlines():
        if ln.startswith(f"-P {base} "):
            return ln.split()[2]
    return "?"


def _own_commit(commit: Callable[[], object], recorded: int | None) -> int | None:
    """Run `commit` (one nf_tables transaction of this deploy) and return the generation the deploy records as its
    last own commit: the new one when nothing else committed since `recorded` and `commit` was the one commit, else
    `recorded` (the policy sync service then reads the ruleset once more: a commit it cannot vouch for is never
    taken as the deploy's). None stays None."""
    if recorded is None:
        commit()
        return None
    nft = NfTables(NS_FW)
    try:
        g0 = nft.generation()
        commit()
        g1 = nft.generation()
    finally:
        nft.close()
    return g1 if g0 == recorded and g1 == g0 + 1 else recorded


def _interfaces_state(policy: Policy) -> dict:
    """What the policy's interface checks were resolved against, as the state file keeps it (nothing when no check
    was resolved: then the plan does not depend on the interfaces)."""
    bridge, ports = policy.interfaces if policy.resolved else ("", ())
    return {"bridge": bridge, "ports": {name: port for name, port in ports}}


def _journal_failure(old: dict | None, policy: Policy, gen: int, e: DeployError, tx: Transaction, t0: float) -> None:
    """A failed update in the journal of the deployment that stays: what was attempted (the generation it would
    have had, the policy) and where it failed."""
    if not old:
        return
    old.setdefault("history", []).append(
        {
            "time": time.time(),
            "kind": "update",
            "generation": gen,
            "policy_hash": policy.policy_hash(),
            "policy_source": policy.source,
            "result": "failed",
            "step": e.step,
            "error": str(e),
            "duration_s": round(time.monotonic() - t0, 3),
            "steps": tx.timings,
        }
    )
    old["history"] = old["history"][-HISTORY_KEEP:]
    write_state(old)


def undeploy(log: Callable[[str], None] = lambda s: None) -> bool:
    """Remove the deployment: stop the NIC, remove the tool's chains and the jump, unload the shim."""
    with _lock(LOCK_WAIT):
        st = read_state()
        if not st:
            return False
        cfg = state_config(st)
        # The services before the NIC: the flow sync service clears the flow table as it stops.
        errors = [f"{svc.name}: {e}" for svc, e in services.stop_all(STATE_DIR)]
        if st.get("nic"):
            try:
                target_of(st, cfg).stop(st["nic"])
            except Exception as e:
                errors.append(f"nic: {e}")
        if netns.exists(NS_FW):
            try:
                chains = [c for cs in owned_chains(NS_FW, cfg).values() for c in cs]
                # the policy stays: the operator's chains are the firewall's ruleset, with or without the fast path
                base, main = st.get("base_chain"), st.get("main_chain")
                jump = main if base and main and has_jump(NS_FW, cfg, base, main) else None
                restore(NS_FW, delete_text(cfg, chains, base, jump))
            except HypafilterError as e:
                errors.append(f"netfilter: {e}")
            try:  # ip6tables as it was before the first deploy of an IPv6 side
                if st.get("ipv6_before") is not None:
                    ip6.give_back(NS_FW, st["ipv6_before"])
            except HypafilterError as e:
                errors.append(f"ip6tables: {e}")
            try:
                netns.run(["nft", "-f", "-"], NS_FW, input=unfilterable_nft("pass"))  # the bridge as it was
            except HypafilterError as e:
                errors.append(f"bridge table: {e}")
            try:
                vlan = st.get("vlan_filter_before")
                if vlan is not None:
                    netns.run(["sysctl", "-qw", f"{VLAN_SYSCTL}={vlan}"], NS_FW)
            except HypafilterError as e:
                errors.append(f"{VLAN_SYSCTL}: {e}")
            try:
                sh = shim_of(st)
                if sh.pinned:  # pinned but detached (its interfaces gone) is unloaded too: the pins go
                    sh.unload()
            except HypafilterError as e:
                errors.append(f"shim: {e}")
        st["history"].append({"time": time.time(), "result": "undeployed", "errors": errors})
        _write_private(STATE_DIR / "last-undeployed.json", json.dumps(st, indent=1) + "\n")
        state_file().unlink()
        if errors:
            raise HypafilterError("undeploy finished with errors: " + "; ".join(errors))
        log("undeployed")
        return True


def lab_down(lab, log: Callable[[str], None] = lambda s: None) -> list[str]:
    """Take the lab `lab` (an `ops.lab.Lab`) down with what runs in it: the deployment in it is undeployed first
    (NIC stopped, chains removed, state.json kept as last-undeployed.json), then its namespaces go, then whatever
    files its NICs left in the state directory. Returns the namespaces removed."""
    if lab.name == LAB_NAME and read_state():
        try:
            undeploy(log)
        except HypafilterError as e:  # the namespaces go anyway; what was left undone goes with them
            log(str(e))
    removed = lab.down()
    for f in (STATE_DIR / "nic").glob(f"{lab.name}-g*"):
        if f.suffix in (".sock", ".pid", ".log"):
            f.unlink(missing_ok=True)
    return removed


STATUS_WAIT = 60.0  # seconds `status` waits for a deploy, update or the policy sync service's apply to end


def status() -> dict:
    """What is deployed, with live NIC counters, shim statistics and the tool's chain counters. Read while no deploy,
    update or apply of the policy sync service runs (each holds the lock; status waits up to STATUS_WAIT for it):
    half-way through one, the state file and the live system disagree, which is not drift. Past the wait it reads
    anyway and says `busy`."""
    with contextlib.ExitStack() as stack:
        busy = False
        try:
            stack.enter_context(_lock(STATUS_WAIT))
        except HypafilterError:
            busy = True  # still running after the wait: read what is there
        except OSError:
            pass  # a state directory this user cannot lock: nothing of ours can be running from it
        out = _status()
        if out.get("deployed"):
            out["busy"] = busy
        return out


def _status() -> dict:
    st = read_state()
    if not st:
        return {"deployed": False}
    out = {k: v for k, v in st.items() if k not in ("intervals", "plain_rules", "ipv6_before")}
    out["deployed"] = True
    cfg = state_config(st)
    try:
        out["nic_counters"] = target_of(st, cfg).counters(st["nic"])
    except Exception as e:  # status reports what it can
        out["nic_counters"] = {"error": str(e)}
    try:
        out["shim_stats"] = shim_of(st).stats()
    except HypafilterError as e:
        out["shim_stats"] = {"error": str(e)}
    try:
        out["netfilter"] = chain_counters(NS_FW, cfg, st["prefix"], st.get("chains"))
    except HypafilterError as e:
        out["netfilter"] = {"error": str(e)}
    out["ipv6"] = ipv6_status(st)
    out.update(services.status(st, STATE_DIR))
    out["drift"] = drift(st)
    return out
