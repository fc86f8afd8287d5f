"""The xdp target's set slots (docs/sets.md): one BPF map per slot, filled from the kernel's set and kept equal to it.

Map contents (driver/xdp/hf_fastpath.h): hash:ip keys the address masked by the set's netmask; hash:ip,port
(address, port, protocol); hash:net and hash:net,port LPM tries over the (protocol, port,) address, nomatch elements
kept as such (the trie's longest prefix is the kernel's first matching net, most specific first); bitmap:port an
array over the ports. An element with a timeout gets the CLOCK_MONOTONIC time from which the kernel may have expired
it (`expire`): the program leaves frames that find it to the stack from then on, and the next synchronisation removes
it once it has surely expired.

The kernel reports an element's remaining timeout in whole seconds, rounded down (and 1 for less than a second:
ip_set_timeout_get), and expires it at a jiffy: read between monotonic times t0 and t1 with `timeout T`, the element
expires in (t0 + T - 1 s, t1 + T + 1 s]. `expire` is the earliest of that window less MARGIN_NS; the element is
removed from the map only after the latest plus MARGIN_NS (sync_set).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import ipaddress
import os
import shutil
import struct
import time
from dataclasses import dataclass
from pathlib import Path

from hypafilter import netns
from hypafilter.errors import HypafilterError
from hypafilter.ir.sets import SetElem, SetInfo
from hypafilter.netfilter import ipset
from hypafilter.paths import DRIVER_DIR
from hypafilter.targets.bpfmap import PinnedArray, PinnedMap
from hypafilter.targets.xdp.build import XDP_DIR, _arch_include, build_loader

SET_CAPACITY = 1 << 20  # the most elements one slot's map holds (a set's maxelem above it: its rules stay complex)
MARGIN_NS = 20_000_000  # slack around the window in which the kernel may expire an element (clock reads, jiffies)
PRESENT, NOMATCH = 1, 2  # HFX_SETVAL_PRESENT, HFX_SETVAL_NOMATCH (driver/xdp/hf_fastpath.h)
VALUE = struct.Struct("<QII")  # struct hfx_setval: expire, flags, pad


@dataclass(frozen=True)
class Window:
    """When an element read with a timeout expires in the kernel: surely not before `lo`, surely by `hi` (ns)."""

    lo: int
    hi: int


def expiry(e: SetElem, t0: int, t1: int) -> Window | None:
    """The expiry window of an element read between monotonic times t0 and t1 (ns); None: no timeout."""
    if e.timeout_s is None:
        return None
    return Window(
        t0 + (e.timeout_s - 1) * 1_000_000_000 - MARGIN_NS, t1 + (e.timeout_s + 1) * 1_000_000_000 + MARGIN_NS
    )


def _a16(a: int) -> bytes:
    return a.to_bytes(16, "big")


def key_of(settype: str, e: SetElem, family: int = 4) -> bytes:
    """The map key of element e in a slot of this type (hf_fastpath.h's layouts; `family` 6: the IPv6 program's
    hfx6_setkey_*, the address as its 16 bytes in network order)."""
    if family == 6 and settype != "bitmap:port":
        if settype == "hash:ip":
            return _a16(e.addr_lo)
        if settype == "hash:ip,port":
            return _a16(e.addr_lo) + struct.pack("<HBB", e.port, e.proto, 0)
        if settype == "hash:net":
            return struct.pack("<I", e.prefix) + _a16(e.addr_lo)
        if settype == "hash:net,port":
            return struct.pack("<I", 32 + e.prefix) + struct.pack(">BBH", e.proto, 0, e.port) + _a16(e.addr_lo)
        raise ValueError(settype)
    if settype == "hash:ip":
        return struct.pack("<I", e.addr_lo)
    if settype == "hash:ip,port":
        return struct.pack("<IHBB", e.addr_lo, e.port, e.proto, 0)
    if settype == "hash:net":
        return struct.pack("<I", e.prefix) + struct.pack(">I", e.addr_lo)
    if settype == "hash:net,port":
        return struct.pack("<I", 32 + e.prefix) + struct.pack(">BBHI", e.proto, 0, e.port, e.addr_lo)
    if settype == "bitmap:port":
        return struct.pack("<I", e.port)
    raise ValueError(settype)


def value_of(e: SetElem, w: Window | None) -> bytes:
    return VALUE.pack(max(w.lo, 1) if w is not None else 0, PRESENT | (NOMATCH if e.nomatch else 0), 0)


def contents(info: SetInfo, t0: int, t1: int, family: int = 4) -> dict[bytes, bytes]:
    """Every element of `info` (read between t0 and t1) as map key -> value, for a slot of the IPv`family` path."""
    return {key_of(info.settype, e, family): value_of(e, expiry(e, t0, t1)) for e in info.entries}


def slots_of(shape: dict) -> list[dict]:
    """Every set slot's map of a program of `shape`: the IPv4 path's ("sets", maps hfx_set<i>), then the IPv6 path's
    ("v6"'s "sets", maps hfx6_set<i>, family 6). One follower keeps them all equal to the kernel's sets and releases
    them with one count (hfx_setsync), which both paths compare."""
    return list(shape.get("sets", [])) + list((shape.get("v6") or {}).get("sets", []))


def map_name(slot: dict, i: int) -> str:
    return slot.get("map", f"hfx_set{i}")


def split_save(text: str) -> dict[str, str]:
    """An `ipset save` text cut into each set's part (its create line and its add lines), by name."""
    out: dict[str, str] = {}
    start, name = 0, None
    pos = 0
    for line in text.splitlines(keepends=True):
        if line.startswith("create "):
            if name is not None:
                out[name] = text[start:pos]
            name, start = line.split(None, 2)[1], pos
        pos += len(line)
    if name is not None:
        out[name] = text[start:pos]
    return out


def describe_key(settype: str, key: bytes, family: int = 4) -> str:
    """A map key back as ipset writes the element (for messages and tests)."""
    if family == 6 and settype != "bitmap:port":
        if settype == "hash:ip":
            return str(ipaddress.IPv6Address(key[:16]))
        if settype == "hash:ip,port":
            port, proto, _ = struct.unpack("<HBB", key[16:20])
            return f"{ipaddress.IPv6Address(key[:16])},{proto}:{port}"
        p = struct.unpack("<I", key[:4])[0]
        if settype == "hash:net":
            return f"{ipaddress.IPv6Address(key[4:20])}/{p}"
        proto, _, port = struct.unpack(">BBH", key[4:8])
        return f"{ipaddress.IPv6Address(key[8:24])}/{p - 32},{proto}:{port}"
    if settype == "hash:ip":
        return str(ipaddress.IPv4Address(struct.unpack("<I", key)[0]))
    if settype == "hash:ip,port":
        a, port, proto, _ = struct.unpack("<IHBB", key)
        return f"{ipaddress.IPv4Address(a)},{proto}:{port}"
    if settype == "hash:net":
        p = struct.unpack("<I", key[:4])[0]
        return f"{ipaddress.IPv4Address(key[4:8])}/{p}"
    if settype == "hash:net,port":
        p = struct.unpack("<I", key[:4])[0]
        proto, _, port, a = struct.unpack(">BBHI", key[4:12])
        return f"{ipaddress.IPv4Address(a)}/{p - 32},{proto}:{port}"
    return str(struct.unpack("<I", key)[0])


def now_ns() -> int:
    return time.monotonic_ns()


# --- the maps of a started program ---------------------------------------------------------------------------------

SETWATCH_PIN = Path("/sys/fs/bpf/hypafilter-setwatch")  # the host's ipset watcher (driver/xdp/setwatch.bpf.c)
SYNC_NONE = (1 << 64) - 1  # hfx_setsync of a program whose set tables were never read: no count equals it
LOCK = Path("/run/hypafilter-sets.lock")  # one set synchronisation at a time on this host (deploy and service)
SETTLE_TIMEOUT_S = 10.0  # an ipset command running longer than this: the sync gives up (the fast path keeps shunting)


def watcher_object(build_root: Path) -> Path:
    """setwatch.bpf.o, compiled unless cached (named by its source's hash)."""
    src = XDP_DIR / "setwatch.bpf.c"
    text = src.read_bytes() + (XDP_DIR / "hf_fastpath.h").read_bytes()
    out = Path(build_root) / "xdp" / f"setwatch-{hashlib.sha256(text).hexdigest()[:12]}.o"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    argv = ["clang", "-O2", "-g", "-target", "bpf", "-Wall", f"-I{XDP_DIR}", f"-I{DRIVER_DIR}", f"-I{_arch_include()}"]
    try:
        netns.run([*argv, "-c", str(src), "-o", str(out)], timeout=None)
    except netns.CommandError as e:
        raise HypafilterError(f"compiling the ipset watcher failed: {e}") from e
    return out


def ensure_watcher(build_root: Path) -> Path:
    """The host's ipset watcher loaded (once per build of it: `hf_xdp watch` does nothing when its pins exist); its
    pin directory, SETWATCH_PIN/<its object's name> (a changed watcher loads beside the old one, which the programs
    started with it keep using)."""
    obj = watcher_object(build_root)
    loader = build_loader(build_root)
    pin = SETWATCH_PIN / obj.stem
    try:
        netns.run([str(loader), "watch", "--obj", str(obj), "--pin", str(pin)])
    except netns.CommandError as e:
        raise HypafilterError(f"loading the ipset watcher failed: {e}") from e
    return pin


def link_seq(pin: Path, watcher: Path, name: str = "hfx_setseq") -> None:
    """Before `hf_xdp start`: the program's count map pin (hfx_setseq: ipset commands; hfx_ctseq: changes of what
    makes a conntrack miss RELATED or UNTRACKED) made a link to the watcher's map, so that loading the program reuses
    that map (libbpf reuses a pinned map by path) instead of creating its own."""
    pin.mkdir(parents=True, exist_ok=True)
    link = pin / name
    if link.is_symlink() or link.exists():
        link.unlink()
    os.symlink(watcher / name, link)


@contextlib.contextmanager
def host_lock():
    """One set synchronisation, watcher load or watcher release at a time on this host."""
    with open(LOCK, "a") as lk:
        fcntl.flock(lk, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lk, fcntl.LOCK_UN)


WATCHED = ("hfx_setseq", "hfx_ctseq")  # the count maps a program may share with the watcher


def _watcher_links(pin_root: Path) -> list[Path]:
    return [p for name in WATCHED for p in sorted(Path(pin_root).glob(f"*/g*/{name}")) if p.is_symlink()]


def watcher_users(pin_root: Path) -> list[Path]:
    """The started programs (of every site under `pin_root`) that share a count map with the watcher."""
    return list(dict.fromkeys(p.parent for p in _watcher_links(pin_root)))


def release_watcher(pin_root: Path) -> bool:
    """Unload every loaded build of the watcher that no started program uses (while attached, its syscall
    tracepoints cost every syscall of the host ~40 ns and every send ~400 ns: docs/sets.md); True when one was
    unloaded. Call with host_lock() held."""
    if not SETWATCH_PIN.exists():
        return False
    used = {Path(os.readlink(p)).parent for p in _watcher_links(pin_root)}
    gone = False
    for d in SETWATCH_PIN.iterdir():
        if d not in used:
            shutil.rmtree(d, ignore_errors=True)  # unpinning the links detaches the programs
            gone = True
    with contextlib.suppress(OSError):
        SETWATCH_PIN.rmdir()
    return gone


def netns_inum(ns: str | None) -> int:
    """The inode number of network namespace `ns` (None: this process's), as the kernel's ns.inum."""
    return os.stat(f"/run/netns/{ns}" if ns else "/proc/self/ns/net").st_ino


@dataclass
class SyncResult:
    seq: int  # the STARTED count the tables now equal the kernel's sets at
    elements: int  # elements in the slots' maps
    written: int  # map writes and deletes it took
    seconds: float
    next_expiry_ns: int | None  # when an element's expiry window ends next (a sync then removes it)
    read_s: float = 0.0  # of `seconds`: reading the kernel's sets (ipset save)
    wait_s: float = 0.0  # ... waiting for running commands and the lock


class SetMaps:
    """The set slots' maps of a started program (`pin`, slots_of its shape: both families'), synchronised with the kernel's sets of
    network namespace `ns`. A sync waits until no ipset command runs (STARTED == FINISHED), reads every set with
    `ipset save`, writes what differs, and releases (hfx_setsync[0] = the STARTED count read first) only if no
    command began meanwhile; else it reads again. Syncs of this host take turns (LOCK)."""

    def __init__(self, pin: str | Path, slots: list[dict], ns: str | None):
        self.pin, self.slots, self.ns = Path(pin), slots, ns
        self.netns = struct.pack("<I", netns_inum(ns))
        self.watcher = Path(os.readlink(self.pin / "hfx_setseq")).parent  # the watcher's pins (its wake-up ring)
        self.seq = PinnedMap(self.pin / "hfx_setseq")
        self.sync_map = PinnedArray(self.pin / "hfx_setsync")
        self.maps = [PinnedMap(self.pin / map_name(s, i)) for i, s in enumerate(slots)]
        self.token = int.from_bytes(os.urandom(8), "little") | 1
        self.shadow: list[dict[bytes, bytes] | None] = [None] * len(slots)
        self.texts = [""] * len(slots)  # each slot's set as `ipset save` wrote it when last read
        self.expiries: list[int | None] = [None] * len(slots)  # the end of the earliest expiry window of that read

    def close(self) -> None:
        for m in (self.seq, self.sync_map, *self.maps):
            m.close()

    def counts(self) -> tuple[int, int]:
        """(started, finished) ipset commands of the namespace so far."""
        v = self.seq.get(self.netns)
        return struct.unpack("<QQ", v) if v is not None else (0, 0)

    def synced(self) -> int:
        return struct.unpack("<Q", self.sync_map.read(0))[0]

    def current(self) -> bool:
        """Whether the program decides by its set tables now (no ipset command since they were read)."""
        return self.counts()[0] == self.synced()

    def hold(self) -> None:
        """Decide nothing by the set tables until the next sync (a program just started); the namespace whose
        commands it follows."""
        self.sync_map.write(struct.pack("<Q", SYNC_NONE), 0)
        self.sync_map.write(struct.pack("<Q", struct.unpack("<I", self.netns)[0]), 2)

    def sync(self, timeout: float = SETTLE_TIMEOUT_S) -> SyncResult:
        t_start = time.monotonic()
        with host_lock():
            return self._sync(t_start, timeout)

    def _sync(self, t_start: float, timeout: float) -> SyncResult:
        if struct.unpack("<Q", self.sync_map.read(1))[0] != self.token:
            self.shadow = [None] * len(self.slots)  # another process wrote the maps since: read them anew
            self.texts = [""] * len(self.slots)
        while True:
            started, finished = self.counts()
            if started != finished:
                if time.monotonic() - t_start > timeout:
                    raise HypafilterError(
                        f"an ipset command has run for over {timeout:.0f} s (counts {started}/{finished}): the fast "
                        "path keeps leaving frames to the stack"
                    )
                time.sleep(0.0002)
                continue
            t_wait = time.monotonic() - t_start
            t0 = time.monotonic_ns()
            chunks = split_save(ipset.save_text(self.ns))
            t1 = time.monotonic_ns()
            written = elements = 0
            nxt: int | None = None
            self.sync_map.write(struct.pack("<Q", 0), 1)  # the maps change: no process's shadow holds
            for i, slot in enumerate(self.slots):
                chunk = chunks.get(slot["name"], "")
                if chunk and chunk == self.texts[i] and self.shadow[i] is not None:
                    # the same text as the last read (a set no command changed, no timeout ticked): the same contents;
                    # the expiry windows of that read still hold
                    elements += len(self.shadow[i])
                    w = self.expiries[i]
                else:
                    info = ipset.parse_save(chunk, f"ipset save ({self.ns})").get(slot["name"]) if chunk else None
                    if info is None or info.settype != slot["type"]:
                        self.texts[i] = ""
                        raise HypafilterError(
                            f"set {slot['name']} ({slot['type']}) is not in the kernel as deployed"
                            + (f" (now {info.settype})" if info is not None else "")
                            + ": the fast path keeps leaving frames to the stack; redeploy"
                        )
                    want = contents(info, t0, t1, slot.get("family", 4))
                    written += self._apply(i, slot["type"], want)
                    elements += len(want)
                    ends = [x.hi for x in (expiry(e, t0, t1) for e in info.entries) if x is not None]
                    w = self.expiries[i] = min(ends) if ends else None
                    self.texts[i] = chunk
                if w is not None and (nxt is None or w < nxt):
                    nxt = w
            self.sync_map.write(struct.pack("<Q", self.token), 1)
            if self.counts()[0] == started:
                self.sync_map.write(struct.pack("<Q", started), 0)
                return SyncResult(started, elements, written, time.monotonic() - t_start, nxt, (t1 - t0) / 1e9, t_wait)

    def _apply(self, i: int, settype: str, want: dict[bytes, bytes]) -> int:
        m = self.maps[i]
        if settype == "bitmap:port":
            vals = [VALUE.pack(0, 0, 0)] * 65536
            for k, v in want.items():
                vals[struct.unpack("<I", k)[0]] = v
            m.write_many(vals, 0)
            self.shadow[i] = dict(want)
            return 1
        have = self.shadow[i]
        if have is None:
            have = {k: m.get(k) or b"" for k in m.keys()}
        n = 0
        for k in have.keys() - want.keys():
            m.delete(k)
            n += 1
        for k, v in want.items():
            if have.get(k) != v:
                m.put(k, v)
                n += 1
        self.shadow[i] = dict(want)
        return n
