"""Target `xdp`: the fast path as an XDP program on the site's wire-facing interfaces (docs/xdp.md).

`info` (kept in deploy's state file) names the program's bpffs pins: `pin` (the program and its maps, one
directory per started program) and `links` (the bpf_links that attach a program to each interface, shared by
every generation, so that activating a program replaces the one on each link atomically).

Register-level operations of the NIC map onto the program's maps: `program` writes the tables built from the
Plan (hypafilter.targets.xdp.tables) in one loader call, which holds CONTROL at 0 while rows change; `shunt_all`
sets CONTROL 0: every frame is passed with the mark value 0, the full policy in software (the NIC's shunt-all keeps
the metadata valid; here the interval values of the old tables would reach the new chains, so k = 0 is the only
safe answer while netfilter changes).

The SFL update buffer (docs/xdp.md "Update buffer (SFL)"): every program has `Config.update_buffer` slots and a
valid mask over its static entries. `program` takes an `analysis.overlay.View` as well as a Plan (its static
entries' tables, the rows of every hardware index, the overlay); `write_overlay` changes only the buffer, the mask
and the rows, with every frame still decided by the program; `read_overlay` reads them back (drift).
"""

from __future__ import annotations

import dataclasses
import json
import math
import struct
import tempfile
import time
from pathlib import Path

import numpy as np

from hypafilter import netns
from hypafilter.analysis.overlay import Overlay, Slot, View, box_key
from hypafilter.analysis.program import k0_tree_wanted
from hypafilter.errors import HypafilterError
from hypafilter.ir import Box
from hypafilter.ir.sets import MAX_SET_SLOTS
from hypafilter.targets.base import DECISIONS, SHUNTED, Expected, Target, WindowStages
from hypafilter.targets.bpfmap import PinnedArray
from hypafilter.targets.xdp import newflows
from hypafilter.targets.xdp import sets as setmaps
from hypafilter.targets.xdp.build import build_loader, build_program
from hypafilter.targets.xdp.sets import SET_CAPACITY
from hypafilter.targets.xdp.tables import (
    BUFFER6_MAPS,
    CONFIG,
    CONFIG6,
    CT_NONE_FLAG,
    CtConfig,
    Tables,
    buffer6_words,
    build_tables,
    build_tables6,
    entry_rows,
    fits6,
    lookup6_digest,
    overlay_records,
    read_slot,
    set_maps,
    set_maps6,
    shape6,
    shape_id,
    slot_rows6,
    split_records,
    tables6_records,
    tables_file,
    with_v6_records,
    words6_digest,
)

PIN_ROOT = Path("/sys/fs/bpf/hypafilter-xdp")
CLOCK_MONOTONIC_COARSE = getattr(time, "CLOCK_MONOTONIC_COARSE", 6)  # Linux's clock id; Python names it on few builds
LEASE_MAP = "hfx_lease"  # the policy sync lease: u64 CLOCK_MONOTONIC ns until which the tables are vouched for
HOLD6_MAP = "hfx6_hold"  # the policy sync service's IPv6 fail safe: u32, nonzero = the IPv6 path decides nothing
CONTROL_ENABLE, CONTROL_PASS_UNFILTERABLE, CONTROL_HOST_MODE = 1, 4, 8
CONTROL_MISS_SHUNT_ACCEPT, CONTROL_MISS_SHUNT_DROP = 16, 32  # Plan.miss_shunt (hw/regmap.txt CONTROL bits 4/5)
CONTROL_MISS_SHUNT = CONTROL_MISS_SHUNT_ACCEPT | CONTROL_MISS_SHUNT_DROP
CONTROL_K0_TREE = 64  # HFX_CONTROL_K0_TREE (strategy tree, live): unparsed IPv4 frames get HF_MARK_K0_TREE
CONTROL_K0_TREE6 = 128  # HFX_CONTROL_K0_TREE6: the IPv6 program's unparsed frames too (ip6tables holds HFv6_K0T)
DEFAULT_PORTS = {"wire0": "wire0", "wire1": "wire1"}


def window_balance(r: dict, host: bool) -> dict[str, tuple[int, Expected]]:
    """verify's counter window on the xdp lab (WindowStages.balance), where the fast path runs on the firewall's
    bridge ports: the sender's veth carried all N frames (quiet stacks: only those; the veth counts a frame once
    the firewall's end took it from its queue, or as it is sent) and the fast path classified every frame that
    reached the two ports (PKTIN: what the sender's and the receiver's veths carried); it decided each (DECISIONS)
    and passed or redirected every frame it did not drop (PKTOUT = forwarded + shunted); the firewall's bridge took
    every frame it passed (the shunted ones; in host mode also the accepted ones, passed up with the decided mark);
    the receiver captured every frame the firewall sent it, redirected or bridged (not in host mode).
    Log mirroring (docs/xdp.md): a mirrored frame (CNT_MIRROR, also counted as forwarded or dropped) is passed once
    (PKTOUT): the counters do not tell mirrored ACCEPTs from DROPs, so PKTOUT is only bounded by them; every
    mirrored frame reaches the firewall (bridge mode: a mirrored ACCEPT's copy, the frame itself leaving nf1 as
    the TC program's clone, which nf1's transmit count and the receiver see)."""
    n, nic, tap = r["sent"], r["nic"], r["tapped"]
    tx = {k: v["tx"] for k, v in r["dev"].items()}
    shunted = sum(nic[k] for k in SHUNTED)
    mirrored = nic.get("CNT_MIRROR", 0)
    sent = nic["CNT_FORWARDED"] + shunted
    want = {
        "sender's veth carried ours": (tx["send.hyb0"], (n, math.inf)),
        "fast path classified": (nic["PKTIN"], tx["send.hyb0"] + tx["recv.hyb0"]),
        "fast path decided": (sum(nic[k] for k in DECISIONS), nic["PKTIN"]),
        "fast path sent": (nic["PKTOUT"], (sent, sent + mirrored)),
        "firewall took": (tap["fw.nf0"] + tap["fw.nf1"], nic["PKTOUT"] if host else shunted + mirrored),
    }
    if not host:
        want["receiver captured, hybrid"] = (r["captured"]["hybrid"], tx["fw.nf1"])
    return want


# The taps on the firewall's ports count what the fast path passed (XDP runs before them, native or generic).
WINDOW = WindowStages(
    tx=(("send", "hyb0"), ("recv", "hyb0"), ("fw", "nf0"), ("fw", "nf1")),
    taps=(("fw", "nf0", False), ("fw", "nf1", False)),
    counters=("PKTIN", "PKTOUT", *DECISIONS, "CNT_MIRROR"),
    lost=(),
    balance=window_balance,
)


class XdpCounters:
    """The program's per-CPU counters (summed over CPUs) and per-entry hits, read from its pinned maps
    (`hf_xdp stats`): the counter-source interface (targets.base.CounterSource)."""

    def __init__(self, target: XdpTarget, info: dict):
        self.target, self.pin = target, info["pin"]

    def _stats(self, hits: bool) -> dict:
        args = ["stats", "--pin", self.pin] + ([] if hits else ["--no-hits"])
        out = json.loads(self.target._tool("stats", args))
        out.pop("config", None)
        return out

    def counters(self) -> dict[str, int]:
        return self._stats(False)

    def hits(self, count: int) -> list[int]:
        hits = self._stats(True)["HITS"]
        if len(hits) < count:
            raise HypafilterError(f"xdp: the program counts hits of {len(hits)} entries, not the {count} asked for")
        return hits[:count]

    def close(self) -> None:
        pass


class XdpTarget(Target):
    name = "xdp"
    window_stages = WINDOW
    flowsync_mode = "liberal"  # no flow cache: the program reads conntrack, the service marks entries liberal
    flowsync_down = "no new TCP entry is marked liberal"
    set_slots = MAX_SET_SLOTS  # one BPF map per slot (docs/sets.md)
    set_capacity = SET_CAPACITY
    set_slots6 = True  # the IPv6 program's own 128-bit-key maps (hfx6_set*, docs/sets.md "IPv6 sets")
    _new_flows_why_not = ""  # why a conntrack miss is not ct 3, from the last ct_config (newflows.why_not)

    def missing(self) -> str | None:
        import shutil

        for tool in ("clang", "cc", "make"):
            if shutil.which(tool) is None:
                return f"{tool} is not installed"
        return None

    # --- where things are ------------------------------------------------------------------------------------------

    def _ports(self) -> list[str]:
        ifs = self.site.interfaces or DEFAULT_PORTS
        return [ifs[p] for p in ("wire0", "wire1") if p in ifs]

    def _root(self) -> Path:
        return PIN_ROOT / self.site.name

    def _run_dir(self) -> Path:
        d = (self.site.run_dir or self.build_root / "xdp-run") / "xdp"
        d.mkdir(parents=True, exist_ok=True)
        return d

    def _tool(self, step: str, args: list[str], ns: bool = False) -> str:
        # The loader is built (make) once per target object: a write_overlay is otherwise mostly make's time.
        tool = self.__dict__.get("_loader") or self.__dict__.setdefault("_loader", build_loader(self.build_root))
        if ns and self.site.netns:
            args = [*args, "--netns", self.site.netns]
        try:
            return netns.run([str(tool), *args])
        except netns.CommandError as e:
            raise HypafilterError(f"xdp {step} failed: {e}") from e

    def control(self, plan, plan6=None) -> int:
        """CONTROL for `plan`; with the IPv6 plan `plan6` whose chains ip6tables gets (not verbatim), bit 7 when those
        chains hold an IPv6 K0 tree (docs/optimize.md, "The hybrid's software side": the IPv6 side)."""
        c = control_of(self.config.unfilterable, self.config.nic_mode, plan.miss_shunt)
        master = getattr(plan, "plan", None) or plan  # an overlay's View: its master rule set's Plan
        if getattr(master, "family", 4) == 4 and k0_tree_wanted(
            master, self.config.strategy
        ):  # unparsed frames walk the live K0 tree (docs/optimize.md)
            c |= CONTROL_K0_TREE
        if plan6 is not None and not getattr(plan6, "verbatim", False) and k0_tree_wanted(plan6, self.config.strategy):
            c |= CONTROL_K0_TREE6
        return c

    # --- Target ----------------------------------------------------------------------------------------------------

    def _tables(self, plan, plan6=None) -> tuple[Tables, Tables | None, dict, object]:
        """The tables of `plan`, those of its IPv6 plan (`plan6`, or the plan's `plan6` attribute: a dual-stack
        deployment's family-6 Plan, docs/ipv6.md "## xdp"), the program's shape, the IPv6 plan."""
        t = build_tables(plan)
        shape = t.shape(self.config.update_buffer)
        p6 = plan6 if plan6 is not None else getattr(plan, "plan6", None)
        if p6 is None:
            return t, None, shape, None
        try:
            t6 = build_tables6(p6)
        except ValueError as e:
            raise HypafilterError(f"the IPv6 plan cannot go into the XDP program: {e}") from e
        return t, t6, {**shape, "v6": shape6(t6, self.config.update_buffer)}, p6

    def build(self, plan, plan6=None) -> str:
        return str(build_program(self._tables(plan, plan6)[2], self.build_root))

    def _attached_ids(self, links: Path) -> set[int]:
        out = self._tool("links", ["links", "--links", str(links)])
        return {int(x.split()[1]) for x in out.splitlines() if x.strip()}

    def _clear_stale(self, links: Path) -> None:
        """Programs of this site that no link runs (left by an interrupted command): removed, so that a later stop
        never takes one for the previous program."""
        on = self._attached_ids(links)
        for p in self._root().glob("g*-*"):
            if not (p / "prog").exists():
                continue
            first = self._tool("links", ["links", "--pin", str(p), "--links", str(links)]).splitlines()[0]
            if int(first.split()[1]) not in on:
                self._tool("stop", ["stop", "--pin", str(p)])

    def start(self, artifact: str, generation: int, standby: bool = True) -> dict:
        obj = Path(artifact)
        self._clear_stale(self._root() / "links")
        pin = self._root() / f"g{generation}-{obj.parent.name}"
        ports = self._ports()
        args = ["start", "--obj", str(obj), "--pin", str(pin)]
        for i, name in enumerate(ports):
            mate = ports[i ^ 1] if (i ^ 1) < len(ports) else None
            args += ["--port", f"{name}={i}" + (f":{mate}" if mate and self.config.nic_mode == "bridge" else "")]
        shape = json.loads(obj.with_name("shape.json").read_text())
        slots = setmaps.slots_of(shape)
        # Every program can look conntrack up (the tables' HFX_CT_LOOKUP: a plan that forces misses, whatever its
        # fields read), so every program counts through the host's watcher the changes that make a miss RELATED or
        # UNTRACKED (docs/xdp.md "Following the configuration"); without it no miss would ever be read as ct 3, and a
        # stateless policy's new flows would all be forced to the stack. The watcher and its count maps are shared
        # with this program (docs/sets.md).
        with setmaps.host_lock():  # no release of the watcher between its load and this program's start
            watcher = setmaps.ensure_watcher(self.build_root)
            # hfx_setseq linked also without set slots (the program then has no such map, and libbpf ignores the
            # link): tools that know only that name as the mark of the watcher's users (older builds on the same
            # host) would otherwise unload the watcher this program counts through
            setmaps.link_seq(pin, watcher)
            setmaps.link_seq(pin, watcher, "hfx_ctseq")
            self._tool("start", args, ns=True)
        newflows.Gate(pin, self.site.netns).grant(None)  # no miss is ct 3 before a grant
        if slots:
            sm = setmaps.SetMaps(pin, slots, self.site.netns)
            try:
                sm.hold()  # nothing decided by the (empty) set tables before their first sync
            finally:
                sm.close()
        info = {
            "binary": str(obj),
            "shape": obj.parent.name,
            "name": f"{self.site.name}-g{generation}",
            "pin": str(pin),
            "links": str(self._root() / "links"),
            "netns": self.site.netns,
            "ifaces": ports,
            "generic": bool(self.config_generic()),
        }
        if not standby:
            self.activate(info)
        return info

    def config_generic(self) -> bool:
        """Generic (skb) XDP instead of native: for interfaces whose driver cannot redirect natively."""
        return bool(getattr(self.config, "xdp_generic", False))

    def transport(self, info: dict, timeout: float = 30.0):
        raise HypafilterError("the xdp target has no register transport: its tables are BPF maps")

    def activate(self, info: dict) -> None:
        # Which program this one replaces (deploy keeps `info` in its state): a rollback's stop puts it back.
        links = Path(info["links"])
        on = self._attached_ids(links) if links.exists() else set()
        for p in self._root().glob("g*-*"):
            if str(p) != info["pin"] and (p / "prog").exists():
                first = self._tool("links", ["links", "--pin", str(p), "--links", str(links)]).splitlines()[0]
                if int(first.split()[1]) in on:
                    info["replaced"] = str(p)
        args = ["attach", "--pin", info["pin"], "--links", info["links"]]
        args += ["--generic"] if info.get("generic") else []
        self._tool("attach", args + list(info["ifaces"]), ns=True)

    def standby(self, info: dict) -> None:
        # A program stops deciding: every frame it still sees goes to software with the full policy.
        if self.alive(info):
            self._tool("control", ["control", "--pin", info["pin"], "--value", "0"])

    def alive(self, info: dict) -> bool:
        return (Path(info.get("pin", "/nonexistent")) / "prog").exists()

    def stop(self, info: dict) -> None:
        """Remove a program. Interfaces whose link still runs it (a rolled-back update stops the new program) get
        the program it replaced back (`activate` recorded it); without one (undeploy) they are detached."""
        args = ["stop", "--pin", info["pin"], "--links", info["links"]]
        before = info.get("replaced")  # the program this one replaced on the links (activate), if still there
        if before and before != info["pin"] and (Path(before) / "prog").exists():
            args += ["--fallback", before]
        self._tool("stop", args)
        if setmaps.SETWATCH_PIN.exists():
            with setmaps.host_lock():  # the last program with set slots gone: the watcher's cost goes too
                setmaps.release_watcher(PIN_ROOT)
        for f in self._run_dir().glob(f"{info.get('name', '')}-*.tables"):
            f.unlink(missing_ok=True)
        for d in (Path(info["links"]), Path(info["links"]).parent):
            try:
                d.rmdir()  # only when nothing is left in it
            except OSError:
                pass

    def running(self, info: dict) -> bool:
        """Whether every interface's link runs this program."""
        out = self._tool("links", ["links", "--pin", info["pin"], "--links", info["links"]])
        lines = [ln.split() for ln in out.splitlines()]
        prog = next((int(x[1]) for x in lines if x[0] == "prog"), None)
        on = {x[0] for x in lines if x[0] != "prog" and int(x[1]) == prog}
        return set(info["ifaces"]) <= on

    def drift(self, info: dict, st: dict) -> list[str]:
        """How the running program differs from the deployment `st` (deploy.drift's NIC part)."""
        out = []
        if not self.running(info):
            out.append(f"xdp: {info.get('name')} is not the program on every interface ({', '.join(info['ifaces'])})")
        cfg = json.loads(self._tool("stats", ["stats", "--pin", info["pin"]]))["config"]
        if cfg.get("generation") != st.get("generation", 0) & 0xFFFF:
            out.append(f"xdp: generation {cfg.get('generation')}, deployed {st.get('generation')}")
        want_ov = (st.get("tables") or {}).get("overlay")  # states from before the update buffer: none to compare
        if want_ov is not None:
            try:
                have_ov = overlay_state(self.read_overlay(info))
            except HypafilterError as e:
                out.append(f"xdp: update buffer: {e}")
            else:
                if have_ov != want_ov:
                    out.append(
                        f"xdp: update buffer: {len(have_ov['slots'])} slots and {len(have_ov['invalid'])} static "
                        f"entries masked off, deployed {len(want_ov['slots'])} and {len(want_ov['invalid'])}"
                    )
        out += self._buffer6_drift(info, st)
        miss = (st.get("tables") or {}).get("miss_shunt")
        want = control_of(st.get("unfilterable", "drop"), st.get("nic_mode", "bridge"), miss or (False, False))
        want |= CONTROL_K0_TREE if (st.get("tables") or {}).get("k0_tree") else 0
        want |= CONTROL_K0_TREE6 if (st.get("tables") or {}).get("k0_tree6") else 0
        have = cfg.get("control", 0) & (~0 if miss is not None else ~CONTROL_MISS_SHUNT)  # older states: no bits 4/5
        if have != want:
            out.append(f"xdp: CONTROL {cfg.get('control')}, deployed {want}")
        if _ct_flags(info) & CT_NONE_FLAG:
            # misses are decided as NEW or INVALID now: nothing may have made such a frame RELATED or UNTRACKED (the
            # policy sync service withdraws HFX_CT_NONE when something does: ops.policysync.newflows)
            why = newflows.why_not(self.site.netns)
            if why:
                out.append(
                    f"xdp: new flows are decided in XDP, but {why}: the policy sync service has not withdrawn it "
                    "(redeploy: misses then go to conntrack)"
                )
        out += self._sets_drift(info)
        return out

    def _buffer6_drift(self, info: dict, st: dict) -> list[str]:
        """The IPv6 update buffer (docs/ipv6.md "The update buffer for IPv6") not what the state says it holds: its
        scan bound and every slot in use, word for word, and every map a write of the buffer rewrites whole (the
        rows of the static entries and of the slots, hfx6_ent; the slots, hfx6_buf; the valid mask, hfx6_vbox)
        against the digest of what was written (`words`; states and programs without them: nothing to compare)."""
        buf = ((st.get("tables") or {}).get("v6") or {}).get("buffer")
        pin = Path(info["pin"])
        if not buf or not (pin / "hfx6_buf").exists():
            return []
        slots = tuple(
            Slot(Box(tuple(k[0]), tuple(k[1]), k[2], k[3], *(k[5:7] if len(k) > 5 else ())), k[4], -1)
            for k in buf.get("slots") or ()
        )
        depth = int(buf.get("depth", 0))
        try:
            with PinnedArray(pin / "hfx6_cfg") as m:
                scan = CONFIG6.unpack(m.read()[: CONFIG6.size])[-1]
            with PinnedArray(pin / "hfx6_buf") as m:
                have = b"".join(m.read(b) for b in range(min(depth, len(slots) + 1)))
        except (OSError, HypafilterError, struct.error) as e:
            return [f"xdp: IPv6 update buffer: {e}"]
        want = slot_rows6(_Slots(slots), depth)[: len(have)]
        out = []
        if scan != len(slots) or have != want:
            out.append(f"xdp: IPv6 update buffer: {scan} slots scanned, deployed {len(slots)}, or their words differ")
        words = buf.get("words") or {}
        for name in (n for n in BUFFER6_MAPS if n in words):
            count, digest = words[name]
            try:
                with PinnedArray(pin / name) as m:
                    vals = [m.read(i) for i in range(count)]
            except (OSError, HypafilterError) as e:
                out.append(f"xdp: IPv6 update buffer: {e}")
                continue
            if words6_digest(b"".join(vals)) != digest:
                where = self._first_differing(st, name, vals)
                out.append(
                    f"xdp: IPv6 update buffer: {name} ({BUFFER6_WHAT[name]}) is not what the deployment wrote"
                    + (f" (first at element {where})" if where is not None else "")
                )
        return out

    @staticmethod
    def _first_differing(st: dict, name: str, vals: list[bytes]) -> int | None:
        """The first element of map `name` that differs from the state's tables file (None: no such file, or the
        file's record is not the one the state's digest was taken of)."""
        path = Path((st.get("tables") or {}).get("file", ""))
        try:
            rec = next((r for r in split_records(path.read_bytes()) if r[0] == name), None) if path.is_file() else None
        except (OSError, struct.error, UnicodeDecodeError):
            return None
        if rec is None or rec[2] != len(vals):
            return None
        size = rec[1]
        return next((i for i, v in enumerate(vals) if v[:size] != rec[3][i * size : (i + 1) * size]), None)

    def _sets_drift(self, info: dict, grace: float = 1.0) -> list[str]:
        """The set tables not released for `grace` seconds (an ipset command's resync takes tens of ms): the policy
        sync service does not follow the kernel's sets, and the program leaves every frame to the stack."""
        slots = setmaps.slots_of(_shape_of(info))
        if not slots:
            return []
        sm = setmaps.SetMaps(info["pin"], slots, self.site.netns)
        try:
            deadline = time.monotonic() + grace
            while not sm.current():
                if time.monotonic() > deadline:
                    started, finished = sm.counts()
                    return [
                        f"xdp: the set tables ({', '.join(s['name'] for s in slots)}) are not known to equal the "
                        f"kernel's sets (ipset commands {started} started, {finished} finished, tables read at "
                        f"{sm.synced()}): every frame goes to the stack until the policy sync service reads them"
                    ]
                time.sleep(0.01)
        finally:
            sm.close()
        return []

    def detach_all(self) -> None:
        """Undeploy: every link of this site."""
        self._tool("detach", ["detach", "--pin", str(self._root() / "links")])

    def program(self, info: dict, plan, generation: int, known: dict | None = None, plan6=None) -> dict:
        """The tables of `plan` into the program (CONTROL 0 meanwhile): a Plan, or an analysis.overlay.View (its
        static entries' tables, the rows of every hardware index, its valid mask and buffer).

        An in-place rewrite of the running program (`known`: its tables; the update's shunt-all brackets it) leaves
        CONTROL at 0, the tables' CONTROL as the word that ends it (`armed`, what shunt_all(off) writes), as the NIC
        keeps CONTROL bit 1 through its register writes: a change of the live ruleset that comes meanwhile
        (FollowWatch.hold) must find the program still shunting everything, not deciding by the tables being
        applied.

        `plan6` (or the plan's `plan6` attribute): the family-6 plan of a dual-stack deployment, whose table set
        decides IPv6 frames with its own miss forcing and conntrack lookup (docs/ipv6.md "## xdp")."""
        t, t6, shape, p6 = self._tables(plan, plan6)
        running = _shape_of(info)
        if t6 is not None:  # after every row of the IPv4 side: its entries, policy entry and update-buffer slots
            t6.index_base = t.n + 1 + running.get("buf", 0)
        fits = t.fits(running) and (fits6(t6, running.get("v6")) if t6 is not None else not running.get("v6"))
        if shape_id(shape) != info["shape"].split("-")[0] and not fits:
            raise HypafilterError(f"the plan's tables do not fit the running program (shape {info['shape']})")
        path = self._run_dir() / f"{info['name']}-{generation}.tables"
        sets = self.sync_sets(info)  # the set tables equal the kernel's sets before the tables enable anything
        # the count of changes read (settled) before the checks below: a grant of ct 3 holds only while it stays
        gate = newflows.Gate(info["pin"], self.site.netns)
        seq = gate.settled(newflows.SETTLE_S)
        ct6 = self.ct_config(p6, seq) if p6 is not None else None
        ct = self.ct_config(plan, seq)  # after ct6: the state's new_flows line is the IPv4 plan's
        gate.grant(seq if ct.none or (ct6 is not None and ct6.none) else None)
        control = self.control(plan, p6)
        data = tables_file(
            t,
            running,
            control,
            generation,
            ct,
            hold=known is not None,
            t6=t6,
            control6=self.control(p6) if p6 is not None else None,
            ct6=ct6,
        )
        path.write_bytes(data)
        self._tool("update", ["update", "--pin", info["pin"], "--tables", str(path)])
        keep = {path.name, Path((known or {}).get("file", "")).name}  # the previous tables: a rollback's
        for f in self._run_dir().glob(f"{info['name']}-*.tables"):
            if f.name not in keep:
                f.unlink(missing_ok=True)
        miss = [bool(x) for x in plan.miss_shunt]
        return {
            "file": str(path),
            "generation": generation,
            "entries": t.n,
            "writes": len(data),
            "miss_shunt": miss,
            "k0_tree": bool(control & CONTROL_K0_TREE),  # unparsed frames marked for the live K0 tree
            "k0_tree6": bool(control & CONTROL_K0_TREE6),  # and the IPv6 ones for HFv6_K0T
            # new flows: a conntrack miss is ct 3 (decided when dropped), or why not (docs/xdp.md "New flows")
            "new_flows": "decided" if ct.none else (self._new_flows_why_not or "no conntrack lookup"),
            "overlay": overlay_state(t.overlay if t.overlay is not None else Overlay.empty(t.n, 0)),
            **({"sets": sets} if sets else {}),
            **({"v6": _v6_state(t6, p6, ct6, running.get("v6"), data)} if t6 is not None else {}),
        }

    def same_sets(self, info: dict, plan) -> bool:
        try:
            shape = _shape_of(info)
            p6 = getattr(plan, "plan6", None)
            v6 = set_maps6(p6) if p6 is not None else []
            return shape.get("sets", []) == set_maps(plan) and (shape.get("v6") or {}).get("sets", []) == v6
        except OSError:
            return False

    def sync_sets(self, info: dict) -> dict:
        """The program's set tables made equal to the kernel's sets now and released (docs/sets.md); {} for a
        program without set slots."""
        slots = setmaps.slots_of(_shape_of(info))
        if not slots:
            return {}
        sm = setmaps.SetMaps(info["pin"], slots, self.site.netns)
        try:
            r = sm.sync()
        finally:
            sm.close()
        return {
            "slots": [s["name"] for s in slots],
            "elements": r.elements,
            "seq": r.seq,
            "ms": round(r.seconds * 1e3, 2),
        }

    def write_overlay(self, info: dict, overlay: Overlay | View) -> dict:
        """The update buffer and valid mask of `overlay` into the running program, every frame decided by it
        throughout (`hf_xdp overlay`: changing slots disabled first, their fields written, the valid mask, enabled
        last). Given a View, the rows of every hardware index (shunt bit, action, interval) that differ are written
        too, a slot's while it is disabled. Returns the loader's account (`slots_changed`, `rows_changed`,
        `buf_scan`, `us` inside the loader) and `overlay` (what drift compares, for the state file's tables)."""
        view = overlay if isinstance(overlay, View) else None
        ov = view.overlay if view is not None else overlay
        shape = _shape_of(info)
        if ov.depth > shape.get("buf", 0):
            raise HypafilterError(f"an overlay of {ov.depth} slots for a program of {shape.get('buf', 0)}")
        try:
            data = overlay_records(ov, shape, entry_rows(view) if view is not None else None)
        except ValueError as e:
            raise HypafilterError(f"xdp overlay: {e}") from e
        with tempfile.NamedTemporaryFile(dir=self._run_dir(), prefix="overlay-", suffix=".bin") as f:
            f.write(data)
            f.flush()
            out = json.loads(self._tool("overlay", ["overlay", "--pin", info["pin"], "--tables", f.name]))
        return {**out, "overlay": overlay_state(ov)}

    def read_overlay(self, info: dict) -> Overlay:
        """What the program's buffer and valid mask hold (slots' master entries unknown: -1). Raises when they are
        not an overlay the target writes: enabled slots not the first ones or not sorted by position, the scan bound
        short of them, or the valid mask's projection onto the boxes out of step."""
        raw = json.loads(self._tool("overlay", ["overlay", "--pin", info["pin"]]))
        n, depth = raw["num_entries"], raw["buf_depth"]
        if not raw["vbox_ok"]:
            raise HypafilterError("the valid mask over the boxes (hfx_vbox) is not the projection of hfx_valid")
        words = np.array(raw["valid"], dtype=np.uint64)
        valid = np.unpackbits(words.astype("<u8").view(np.uint8), bitorder="little")[:n].astype(bool)
        rows = [read_slot(bytes.fromhex(h)) for h in raw["slots"]]
        used = sum(on for _, on in rows)
        if any(on for _, on in rows[used:]) or used > raw["buf_scan"]:
            raise HypafilterError(
                f"enabled slots {[b for b, (_, on) in enumerate(rows) if on]}, scan bound {raw['buf_scan']}"
            )
        try:
            return Overlay(n, depth, valid, tuple(s for s, _ in rows[:used]))
        except ValueError as e:
            raise HypafilterError(str(e)) from e

    def ct_config(self, plan, seq: int | None = 0) -> CtConfig:
        """Conntrack state from the kernel's table for a policy that reads it (docs/xdp.md): the timeouts conntrack
        sets for established TCP and replied UDP, read from the firewall namespace's sysctls now, and whether a miss
        is ct 3 (NEW or INVALID: newflows.why_not finds nothing that makes such a frame RELATED or UNTRACKED).
        Unreadable: no lookup (ct 0 everywhere, every frame conntrack must see goes to it). `seq`: the watcher's
        count of such changes, read before (None: not counted for this program, or changes still running: no ct 3)."""
        if not any(plan.miss_shunt):
            return CtConfig()
        ct = read_ct_config(self.site.netns)
        self._new_flows_why_not = newflows.why_not(self.site.netns) if ct.lookup else ""
        if ct.lookup and not self._new_flows_why_not and seq is None:
            self._new_flows_why_not = "changes to the firewall's configuration are not counted or still running"
        if ct.lookup and not self._new_flows_why_not:
            ct = dataclasses.replace(ct, none=True)
        return ct

    def flowsync_why_not(self, plan, info: dict) -> str:
        """The service marks the TCP entries it would offload liberal (ops.flowsync.marks.LiberalMarks), whatever
        nf_conntrack_tcp_be_liberal says (the program reads only the marks: the sysctl can change after deploy),
        unless the program does no lookup."""
        if not any(plan.miss_shunt) or not read_ct_config(self.site.netns).lookup:
            return (
                "the XDP program does not look up conntrack (the plan forces no miss, or the sysctls were unreadable)"
            )
        return ""

    def write_tables(self, info: dict, tables: dict, generation: int, known: dict | None = None) -> dict:
        if not Path(tables.get("file", "")).exists():
            raise HypafilterError("previous tables unknown; redeploy the previous policy to restore them")
        self._tool("update", ["update", "--pin", info["pin"], "--tables", tables["file"]])
        return dict(tables)

    def shunt_all(self, info: dict, on: bool) -> None:
        # Off: back to the CONTROL the current tables were written with (their miss forcing included); tables
        # never written (armed 0) stay at 0, every frame to software.
        value = 0
        if not on:
            value = json.loads(self._tool("stats", ["stats", "--pin", info["pin"]]))["config"].get("armed", 0)
        self._tool("control", ["control", "--pin", info["pin"], "--value", str(value)])

    def buffer_depth(self) -> int:
        return self.config.update_buffer

    def shunt_all_now(self, info: dict) -> None:
        """Control word 0 (every frame to software) through the bpf() syscall, without the loader process."""
        with PinnedArray(Path(info["pin"]) / "hfx_cfg") as m:
            m.set_word(0, 0)

    def set_lease(self, info: dict, ms: int) -> None:
        """The lease word (hfx_lease): CLOCK_MONOTONIC now + `ms` (the program compares it with the coarse clock of the
        same timeline, at most a kernel tick behind); 0 disarms it. One u64 through the bpf() syscall, without the
        loader process."""
        if not isinstance(ms, int) or ms < 0:
            raise HypafilterError(f"a lease of {ms!r} ms")
        value = time.monotonic_ns() + ms * 1_000_000 if ms else 0
        path = Path(info["pin"]) / LEASE_MAP
        if not path.exists() and Path(info["pin"]).exists():
            raise HypafilterError(
                f"the running XDP program ({info['pin']}) has no policy sync lease (built before it): "
                "`deploy --force` starts one that has"
            )
        with PinnedArray(path) as m:
            m.write(struct.pack("=Q", value))

    def hold_ipv6(self, info: dict, on: bool) -> bool:
        """The policy sync service's IPv6 fail safe (docs/ipv6.md "Following ip6tables"): `on`, the program's IPv6
        path decides nothing (every IPv6 frame unparsed, value 0: ip6tables decides it whole); off, it decides by
        its IPv6 table set again. One u32 through the bpf() syscall; the IPv4 path and CONTROL are untouched. False
        when the program has no IPv6 table set (its IPv6 frames are unparsed anyway)."""
        path = Path(info["pin"]) / HOLD6_MAP
        if not path.exists():
            return False
        with PinnedArray(path) as m:
            m.write(struct.pack("=I", 1 if on else 0))
        return True

    def ipv6_held(self, info: dict) -> bool | None:
        """Whether the IPv6 fail safe is in force (None: no IPv6 table set)."""
        path = Path(info["pin"]) / HOLD6_MAP
        if not path.exists():
            return None
        with PinnedArray(path) as m:
            return struct.unpack("=I", m.read())[0] != 0

    def write_tables6(self, info: dict, plan6, known: dict) -> dict:
        """The IPv6 table set of the family-6 `plan6` into the running program, with the IPv4 tables, the update
        buffer and CONTROL untouched: the IPv6 path must be held meanwhile (hold_ipv6), and this does not release
        it. The maps are written through the bpf() syscall (the loader's `update` would set CONTROL 0, every IPv4
        frame to software, while it writes); the tables file of `known` (the state's tables, what a rollback writes
        back) is rewritten with the new IPv6 records. Returns the state's tables with the new file and `v6`.
        HypafilterError when the program has no IPv6 table set or the tables do not fit it (a new program is
        needed); nothing is written then."""
        running = _shape_of(info)
        if not running.get("v6"):
            raise HypafilterError("the running XDP program has no IPv6 table set")
        try:
            t6 = build_tables6(plan6)
        except ValueError as e:
            raise HypafilterError(f"the IPv6 plan cannot go into the XDP program: {e}") from e
        t6.index_base = int((known.get("v6") or {}).get("index_base", plan6.index_base))
        if not fits6(t6, running["v6"]):
            raise HypafilterError("the IPv6 tables do not fit the running program's IPv6 table set")
        ct6 = self.ct_config(plan6)
        records = tables6_records(t6, running["v6"], self.control(plan6), ct6)
        old_file = Path(known.get("file", ""))
        data = with_v6_records(old_file.read_bytes(), records) if old_file.is_file() else None
        for name, vsize, count, vals in split_records(records):
            with PinnedArray(Path(info["pin"]) / name) as m:
                m.write_many([vals[i * vsize : (i + 1) * vsize] for i in range(count)])
        out = {**known, "v6": _v6_state(t6, plan6, ct6, running["v6"], records)}
        return self._keep_v6_tables(info, known, data, out)

    def _keep_v6_tables(self, info: dict, known: dict, data: bytes | None, out: dict) -> dict:
        """`out` with `file`: the tables file a rollback writes back, rewritten whole with the new IPv6 records (`data`;
        None: no file known, `out` as it is)."""
        if data is not None:
            path = self._run_dir() / f"{info['name']}-{known.get('generation', 0)}-v6.tables"
            tmp = path.with_suffix(".tmp")
            tmp.write_bytes(data)
            tmp.replace(path)
            out["file"] = str(path)
        return out

    def write_buffer6(self, info: dict, plan6, known: dict, static6) -> dict | None:
        """The family-6 `plan6` (the master rule set: ip6tables' live IPv6 policy) into the running program through
        its IPv6 update buffer (docs/ipv6.md "The update buffer for IPv6"): the lookup maps stay those of `static6`
        (the plan the running IPv6 table set was written from, `known["v6"]["static"]`); the slots (raw 128-bit
        address intervals), the valid mask over the static boxes, every row (the master's, its k) and the scan bound
        are written through the bpf() syscall. The IPv6 path must be held meanwhile (hold_ipv6). Returns the state's
        tables with the new `v6`, or None when the buffer cannot take the change (no buffer in the program, the
        static plan is not the running table set, set slots, or the change needs more than half the slots: the
        lazy rebuild, write_tables6, writes the whole table set and empties the buffer); nothing is written then."""
        from hypafilter.analysis.overlay import BufferFull, align6

        running = _shape_of(info)
        v6shape = running.get("v6") or {}
        depth = int(v6shape.get("buf", 0))
        old = known.get("v6") or {}
        if not depth or static6 is None or not old.get("lookup"):
            return None
        if getattr(static6, "set_slots", ()) or getattr(plan6, "set_slots", ()):
            return None
        try:
            t6 = build_tables6(static6)
        except ValueError:
            return None
        t6.index_base = int(old.get("index_base", plan6.index_base))
        if not fits6(t6, v6shape) or lookup6_digest(t6, v6shape) != old["lookup"]:
            return None
        try:
            view = align6(static6, plan6, depth, int(plan6.k_base), bool(plan6.verbatim))
        except BufferFull:
            return None
        if 2 * view.overlay.used > depth:
            return None  # more than half full: the lazy rebuild
        ct6 = self.ct_config(plan6)
        miss = self.control(plan6)
        records = tables6_records(t6, v6shape, miss, ct6, view=view, lookup=False)
        whole = tables6_records(t6, v6shape, miss, ct6, view=view)
        old_file = Path(known.get("file", ""))
        data = with_v6_records(old_file.read_bytes(), whole) if old_file.is_file() else None
        # in record order (the rows, the slots, the mask; the scan bound, hfx6_cfg, last), all under the IPv6 hold
        for name, vsize, count, vals in split_records(records):
            with PinnedArray(Path(info["pin"]) / name) as m:
                m.write_many([vals[i * vsize : (i + 1) * vsize] for i in range(count)])
        st6 = _v6_state(t6, plan6, ct6, v6shape)
        st6.update(
            entries=t6.n,
            static=old.get("static"),
            lookup=old["lookup"],
            buffer={
                **overlay_state(view.overlay),
                "used": view.overlay.used,
                "depth": depth,
                "words": buffer6_words(records),
            },
        )
        out = {**known, "v6": st6}
        return self._keep_v6_tables(info, known, data, out)

    def lease(self, info: dict) -> dict:
        """{armed, expired, left_ms} of the lease word (a program from before the lease has none: disarmed)."""
        path = Path(info["pin"]) / LEASE_MAP
        if not path.exists():
            return {"armed": False, "expired": False, "left_ms": 0}
        with PinnedArray(path) as m:
            (until,) = struct.unpack("=Q", m.read())
        now = time.clock_gettime_ns(CLOCK_MONOTONIC_COARSE)  # the clock the program compares with
        return {"armed": until != 0, "expired": until != 0 and now >= until, "left_ms": max(0, until - now) // 10**6}

    def forget_flushed_flows(self, info: dict, wait: float = 3.0) -> None:
        """The program looks flows up in the kernel's own conntrack table (bpf_xdp_ct_lookup): a flushed flow is
        gone from it at once."""

    def counters(self, info: dict) -> dict:
        out = XdpCounters(self, info)._stats(True)
        out["HITS"] = dict(enumerate(out.pop("HITS", [])))
        return out

    def counter_source(self, info: dict, timeout: float = 30.0) -> XdpCounters:
        return XdpCounters(self, info)


def _ct_flags(info: dict) -> int:
    """hfx_config.ct_flags of the running program (HFX_CT_*; the policy sync service clears and sets HFX_CT_NONE in
    place: ops.policysync.newflows)."""
    with PinnedArray(Path(info["pin"]) / "hfx_cfg") as m:
        return CONFIG.unpack(m.read()[: CONFIG.size])[9]


def read_ct_config(ns: str | None) -> CtConfig:
    """The conntrack lookup's configuration from namespace `ns`'s sysctls (XdpTarget.ct_config); unreadable: no
    lookup."""
    keys = (
        "nf_conntrack_tcp_timeout_established",
        "nf_conntrack_udp_timeout_stream",
        "nf_conntrack_udp_timeout",
        "nf_conntrack_tcp_timeout_close_wait",
    )
    try:
        out = netns.run(["sysctl", "-n", *(f"net.netfilter.{k}" for k in keys)], ns).split()
        tcp_s, udp_s, udp_unreplied_s, tcp_cw_s = (int(x) for x in out)
    except (netns.CommandError, ValueError):
        return CtConfig()
    ms = lambda s: min(s * 1000, 0xFFFFFFFF)  # noqa: E731
    return CtConfig(True, ms(tcp_s), ms(udp_s), ms(udp_unreplied_s), tcp_cw_ms=ms(tcp_cw_s))


def control_of(unfilterable: str, nic_mode: str, miss_shunt=(False, False)) -> int:
    """CONTROL for Config.unfilterable, the NIC mode and Plan.miss_shunt, the bits of the NIC's register of that
    name."""
    c = CONTROL_ENABLE
    c |= CONTROL_MISS_SHUNT_ACCEPT if miss_shunt[0] else 0
    c |= CONTROL_MISS_SHUNT_DROP if miss_shunt[1] else 0
    if unfilterable == "pass":
        c |= CONTROL_PASS_UNFILTERABLE
    if nic_mode == "host":
        c |= CONTROL_HOST_MODE
    return c


def overlay_state(ov: Overlay) -> dict:
    """What the state file keeps of an overlay, and drift compares with `read_overlay`: the static entries masked off
    and each slot's box and insert position, in slot order."""
    return {
        "invalid": [int(j) for j in np.flatnonzero(~ov.valid)],
        "slots": [[[int(x) for x in k[0]], [int(x) for x in k[1]], *(int(x) for x in k[2:])] for k in box_key(ov)],
    }


BUFFER6_WHAT = {
    "hfx6_ent": "the rows of the static entries and the slots: action, shunt, k",
    "hfx6_buf": "the slots",
    "hfx6_vbox": "the valid mask",
}


class _Slots:
    """The slots of an IPv6 overlay as the state keeps them (what slot_rows6 reads)."""

    def __init__(self, slots: tuple):
        self.slots = slots


def _v6_state(t6: Tables, plan6, ct6: CtConfig, v6shape: dict | None = None, records: bytes | None = None) -> dict:
    """What the state records of the IPv6 table set (docs/ipv6.md "## xdp"); with the program's IPv6 shape, what its
    update buffer's static entries are (`static`: the IPv6 policy the table set was written from, `lookup`: the
    digest of its lookup maps; the buffer empty; `words`: what `records`, the tables written, put into the buffer's
    maps, buffer6_words)."""
    out = {
        "entries": t6.n,
        "index_base": t6.index_base,
        "miss_shunt": [bool(x) for x in plan6.miss_shunt],
        "ct_lookup": ct6.lookup,
        "new_flows": "decided" if ct6.none else "not decided",
    }
    src = getattr(plan6, "source6", None)
    if v6shape and v6shape.get("buf") and src:
        buf = {"used": 0, "depth": v6shape["buf"], **({"words": buffer6_words(records)} if records else {})}
        out.update(static=src, lookup=lookup6_digest(t6, v6shape), buffer=buf)
    return out


def _shape_of(info: dict) -> dict:
    """The shape a started program was rendered for (kept beside its object)."""
    src = Path(info["binary"]).with_name("shape.json")
    return json.loads(src.read_text())
