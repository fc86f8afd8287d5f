"""The kernel's ipsets followed into a NIC core's set tables (hw/hf_set_table.vhd; docs/hardware.md "Set tables"): the
set follower's counterpart of targets.xdp.sets.SetMaps for the emulated NIC. The host's ipset watcher
(driver/xdp/setwatch.bpf.c) counts the namespace's ipset commands and wakes the follower; a count beyond the one the
tables were read at makes every set slot uncertain at once (the core shunts what a set decides, reason 3), then the
sets are read again (`ipset save`), the elements that differ written, and the slots released only if no command
began meanwhile. A NIC cannot compare the counts in its data path as the xdp program does: frames between an
ipset command and the follower's hold are decided by the old tables (the lag, measured in tests/system/
test_emu_sets.py). Elements with a timeout: read again when one enters its uncertain window and once it has surely
expired."""

from __future__ import annotations

import contextlib
import hashlib
import os
import struct
import time
from dataclasses import dataclass
from pathlib import Path

from hypafilter.errors import HypafilterError
from hypafilter.hw import settable
from hypafilter.ir.sets import SetSlot
from hypafilter.netfilter import ipset
from hypafilter.targets.bpfmap import PinnedMap
from hypafilter.targets.nic import set_families
from hypafilter.targets.xdp import sets as setmaps
from hypafilter.targets.xdp.target import PIN_ROOT as XDP_PIN_ROOT

SYNC_NONE = setmaps.SYNC_NONE


@dataclass
class NicSyncResult:
    seq: int
    written: int
    seconds: float
    next_expiry_ns: int | None


class NicSets:
    """One emulated NIC's set slots (`tables`, the deployment's: "sets", "set_images") kept equal to the kernel's sets
    of network namespace `ns`; counts(), synced() and sync() as SetMaps has them."""

    def __init__(self, target, info: dict, tables: dict, ns: str | None, watcher: Path):
        self.target, self.info, self.ns = target, info, ns
        self.slots = [SetSlot(r[0], r[1], tuple(r[2])) for r in tables["sets"]]
        self.fams = set_families(tables["sets"])  # a dual-stack core's IPv6 slots (tables SET6_*) after the IPv4 ones
        self.images = list(tables.get("set_images") or [None] * len(self.slots))
        # per slot: its set's `ipset save` text at the last sync that loaded it and the expiry moment of that read; a
        # set whose text is unchanged (no command changed it, no timeout ticked) is not parsed or placed again
        self.texts: list[str] = [""] * len(self.slots)
        self.expiries: list[int | None] = [None] * len(self.slots)
        self.netns = struct.pack("<I", setmaps.netns_inum(ns))
        self.watcher = watcher
        self.seq = PinnedMap(watcher / "hfx_setseq")
        self.at = SYNC_NONE
        # a user of the watcher as an xdp program is one (setmaps.watcher_users), so that no xdp target's stop
        # unloads it while this NIC follows the sets through it
        key = hashlib.sha256(str(info.get("socket", "")).encode()).hexdigest()[:12]
        self.user = XDP_PIN_ROOT / f"nic-{key}" / "gnic"
        self.user.mkdir(parents=True, exist_ok=True)
        link = self.user / "hfx_setseq"
        if link.is_symlink() or link.exists():
            link.unlink()
        os.symlink(watcher / "hfx_setseq", link)

    def close(self) -> None:
        self.seq.close()
        with contextlib.suppress(OSError):
            (self.user / "hfx_setseq").unlink()
            self.user.rmdir()
            self.user.parent.rmdir()

    def counts(self) -> tuple[int, int]:
        v = self.seq.get(self.netns)
        return struct.unpack("<QQ", v) if v is not None else (0, 0)

    def synced(self) -> int:
        return self.at

    def sync(self, timeout: float = setmaps.SETTLE_TIMEOUT_S) -> NicSyncResult:
        t0 = time.monotonic()
        with self.target.client(self.info) as c, setmaps.host_lock():
            # a slot whose tag is not its image's was written by another (a deploy, a reset): loaded whole below
            tags = c.set_tags(self.fams)
            self.images = [
                img if img and img.get("tag") == t else None for img, t in zip(self.images, tags, strict=True)
            ]
            c.hold_sets(self.images, self.fams)  # fail safe first: nothing decided by the tables from here on
            written = 0
            while True:
                started, finished = self.counts()
                while started != finished:  # a command runs: its result is not readable yet
                    if time.monotonic() - t0 > timeout:
                        raise HypafilterError("an ipset command ran too long; the set slots stay uncertain")
                    time.sleep(0.001)
                    started, finished = self.counts()
                t_read = time.monotonic()
                chunks = setmaps.split_save(ipset.save_text(self.ns))
                changed = {
                    i
                    for i, slot in enumerate(self.slots)
                    if not (chunks.get(slot.name) and chunks[slot.name] == self.texts[i] and self.images[i] is not None)
                }
                sets = {}
                for i in changed:
                    chunk = chunks.get(self.slots[i].name, "")
                    sets.update(ipset.parse_save(chunk, "ipset save") if chunk else {})
                self.images, n = c.program_sets(
                    self.slots, sets, self.images, release=False, fams=self.fams, only=changed
                )  # fmt: skip
                for i in changed:
                    info = sets.get(self.slots[i].name)
                    loaded = info is not None and self.images[i] is not None
                    self.texts[i] = chunks.get(self.slots[i].name, "") if loaded else ""
                    self.expiries[i] = _next_expiry({self.slots[i].name: info}, t_read) if loaded else None
                written += n
                if self.counts()[0] == started:
                    break
            c.release_sets(self.images, self.fams)
        self.at = started
        soon = [e for e in self.expiries if e is not None]
        return NicSyncResult(started, written, time.monotonic() - t0, min(soon) if soon else None)


def _next_expiry(sets: dict, t_read: float) -> int | None:
    """When an element with a timeout next enters its uncertain window or surely expires (monotonic ns): a sync
    then marks it uncertain, or removes it."""
    soon = []
    for info in sets.values():
        for e in info.entries:
            if e.timeout_s is None:
                continue
            for at in (e.timeout_s - settable.UNCERTAIN_S, e.timeout_s + 1):
                if at > 0:
                    soon.append(at)
    if not soon:
        return None
    return int((t_read + min(soon)) * 1e9)
