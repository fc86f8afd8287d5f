"""NicClient: register access to a hypafilter core on any target, and the emulated NIC's socket transport.

Register offsets and table ids come from hw/regmap.txt (hypafilter.hw.regmap). A transport moves 32-bit words
(EmuTransport here, SumeTransport in targets/sume.py); everything above it (identity check, counters, programming
a Plan) is target-independent.
"""

from __future__ import annotations

import dataclasses
import json
import secrets
import socket
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from hypafilter.analysis.overlay import Overlay
from hypafilter.analysis.plan import action_words
from hypafilter.errors import HypafilterError
from hypafilter.hw import ctmember, flowcache, regmap, settable, updatebuffer
from hypafilter.hw.flowcache import Flow, Flow6
from hypafilter.hw.model import CONTROL_ENABLE as CONTROL_ENABLE  # the targets' name for it
from hypafilter.hw.model import (
    CONTROL_HOST_MODE,
    CONTROL_MISS_SHUNT,
    CONTROL_MISS_SHUNT6,
    CONTROL_PASS_UNFILTERABLE,
    CONTROL_SHUNT_ALL,
    LEASE_MAX,
    lease_status,
    miss_shunt6_control,
    miss_shunt_control,
    nic_mode_control,
    unfilterable_control,
)
from hypafilter.hw.updatebuffer import Image, Image6
from hypafilter.hw.vhdl import buffer6_depth, matcher_hash

CORE_ID = 0x48594641  # "HYPA", the ID register's fixed value
PIPELINE = 256  # requests sent before their replies are read (the server answers in order)
STREAM_CHUNK = 512  # table words per stream-write request (a line of ~6 kB)
# More reply wait per table word a pipelined chunk streams: the emulated NIC answers what one read of its socket
# brought (64 KiB: up to ~16,000 words) once it has run all of it. An 11,100-entry core under load 15 ran 3.3 ms a
# word: table 1's 11,264 words took 37 s, past the 30 s timeout, and deploy's registers step failed (issue #24).
STREAM_WORD_SECONDS = 0.01


class NicError(HypafilterError):
    """A register access failed or the NIC is not the expected core."""


@dataclass(frozen=True)
class RegRequest:
    """One register access of a batch (a transport's `request_many`): `op` "read" or "write", the register's byte
    offset and, for a write, the value. Each transport renders it in its own wire format."""

    op: str
    addr: int
    value: int = 0

    def __post_init__(self):
        if self.op not in ("read", "write"):
            raise NicError(f"not a register request: op {self.op!r} (read or write)")


class EmuTransport:
    """The emulated NIC's Unix control socket (docs/internals.md, "Emulated NIC control socket")."""

    def __init__(self, path: str | Path, timeout: float = 30.0):
        self.path = str(path)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout)
        self.timeout = timeout
        try:
            self.sock.connect(self.path)
        except OSError as e:
            self.sock.close()
            raise NicError(f"cannot connect to emulated NIC at {self.path}: {e.strerror or e}") from e
        self._buf = b""

    def close(self) -> None:
        self.sock.close()

    def _readline(self) -> str:
        while b"\n" not in self._buf:
            try:
                chunk = self.sock.recv(65536)
            except TimeoutError as e:
                raise NicError(f"{self.path}: no reply from emulated NIC") from e
            if not chunk:
                raise NicError(f"{self.path}: emulated NIC closed the control socket")
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return line.decode()

    def request_lines(self, lines: Sequence[str]) -> list[str]:
        """Send request lines in pipelined chunks; returns the reply payloads (text after OK). ERR raises NicError."""
        out: list[str] = []
        for start in range(0, len(lines), PIPELINE):
            chunk = lines[start : start + PIPELINE]
            words = sum(x.count(" ") - 3 for x in chunk if x.startswith("T WS "))
            if self.timeout is not None:
                self.sock.settimeout(self.timeout + STREAM_WORD_SECONDS * words)
            self.sock.sendall("".join(f"{x}\n" for x in chunk).encode())
            for req in chunk:
                reply = self._readline()
                if reply == "OK" or reply.startswith("OK "):
                    out.append(reply[3:])
                elif reply.startswith("ERR"):
                    raise NicError(f"emulated NIC refused '{req}': {reply[4:]}")
                else:
                    raise NicError(f"emulated NIC sent a malformed reply to '{req}': {reply!r}")
        return out

    def request(self, line: str) -> str:
        return self.request_lines([line])[0]

    def request_many(self, reqs: Sequence[RegRequest]) -> list[int | None]:
        """Register accesses in order, pipelined (the `R`/`W` lines): per request the value read, None for a write."""
        lines = [f"R 0x{r.addr:x}" if r.op == "read" else f"W 0x{r.addr:x} 0x{r.value:x}" for r in reqs]
        replies = self.request_lines(lines)
        return [int(v, 0) if r.op == "read" else None for r, v in zip(reqs, replies, strict=True)]

    def read(self, addr: int) -> int:
        return self.request_many([RegRequest("read", addr)])[0]

    def write(self, addr: int, value: int) -> None:
        self.request_many([RegRequest("write", addr, value)])

    def write_many(self, pairs: Iterable[tuple[int, int]]) -> None:
        self.request_many([RegRequest("write", a, v) for a, v in pairs])

    def read_table(self, table: int, index: int) -> int:
        return int(self.request(f"T R {table} {index}"), 0)

    def read_many(self, addrs: Sequence[int]) -> list[int]:
        return self.request_many([RegRequest("read", a) for a in addrs])

    def read_table_many(self, table: int, start: int, count: int) -> list[int]:
        """`count` entries from `start`, pipelined (PIPELINE requests per round trip instead of one each)."""
        return self.read_table_at(table, range(start, start + count))

    def read_table_at(self, table: int, indices: Iterable[int]) -> list[int]:
        """The entries at `indices` (any order), pipelined."""
        return [int(v, 0) for v in self.request_lines([f"T R {table} {i}" for i in indices])]

    def write_table_many(self, table: int, start: int, values: Sequence[int]) -> None:
        """Stream writes (IND_COMMAND bit 8): one request per STREAM_CHUNK words, the index counted by the core."""
        self.request_lines(
            [
                f"T WS {table} {start + i} " + " ".join(f"0x{v:x}" for v in values[i : i + STREAM_CHUNK])
                for i in range(0, len(values), STREAM_CHUNK)
            ]
        )

    # Emulator-only requests (not register accesses).
    def stats(self) -> dict:
        return json.loads(self.request("STATS"))

    def command(self, word: str) -> None:
        self.request(word)


@dataclass(frozen=True)
class FlowCacheConfig:
    """The flow cache's geometry (FC_CONFIG): 2**log2_sets sets of `ways` entries, last-seen times ts_w bits."""

    log2_sets: int
    ways: int
    ts_w: int
    v6: bool = False  # the cache holds IPv6 tuples too (FC_CONFIG bit 24: a dual-stack core's)

    @property
    def entries(self) -> int:
        return self.ways << self.log2_sets


@dataclass(frozen=True)
class FlowRecord:
    """A valid flow-cache entry: its slot, the flow in its original direction, whether it was hit since its insert
    (counted), its last-seen time (FC_NOW ticks, 0 when not counted) and its hits since the insert."""

    slot: int
    flow: Flow | Flow6
    counted: bool
    seen: int
    hits: int


# How long FC_STATUS may read busy before a command is an error. A command takes ~12 cycles, but after a reset
# (and for a clear) the cache sweeps 2**LOG2_SETS sets first: 16,384 cycles at 64k entries, and the emulated clock
# advances only with the register reads that poll it.
FC_COMMAND_SECONDS = 10.0
CTM_IDLE_SECONDS = 30.0
CTM_IDLE_BURST = 256  # CTM_STATUS reads per request while waiting for a sweep (the emulator's clock runs for them)
CTM_BATCH_WORDS = 1 << 20  # CTM_CMD words per stream (its index is 24 bits; the word is the index mod 4)
# Status reads after each FC_CMD write of a batch (NicClient.flow_commands). An insert or delete runs 14-16 cycles and
# an emulated register access takes 2 (an idle emulated core is clocked only by the accesses): with one read the
# next command's FC_CMD came while the core was still busy, and was ignored. Eight reads give it 16 cycles; on a
# board an access takes far longer than a command. Correctness does not depend on it (a busy reading before a
# command's FC_CMD is detected and the rest of the batch runs again), only the number of round trips.
FC_STATUS_READS = 8
FC_KEY6_REGS = tuple(f"FC_KEY{i}" for i in range(4, 10))  # an IPv6 key's upper address bits


def _check_flow(flow: Flow | Flow6) -> None:
    ab = 128 if flowcache.is_v6(flow) else 32
    for name, value, bits in (
        ("src", flow.src, ab),
        ("dst", flow.dst, ab),
        ("proto", flow.proto, 8),
        ("sport", flow.sport, 16),
        ("dport", flow.dport, 16),
    ):
        if not isinstance(value, int) or not 0 <= value < 1 << bits:
            raise NicError(f"flow {flow}: {name} {value!r} is not a {bits}-bit value")


def _admits_ct0(plan) -> list[bool]:
    """Per entry of `plan`, then its policy entry: whether a frame with ct 0 (the flow cache does not know it) can
    match it (some box's ct range holds 0)."""
    from hypafilter.ir.box import FIELD_INDEX

    ct = FIELD_INDEX["ct"]
    return [any(b.lo[ct] == 0 for b in e.boxes if not b.is_empty()) for e in plan.entries] + [True]


COUNTER_REGS = tuple(r.name for r in regmap.MAP.registers if r.name.startswith("CNT_")) + ("PKTIN", "PKTOUT")


class NicClient:
    """Register-level interface to one hypafilter core, whatever carries the accesses."""

    # What its flow API is as a table of the flow sync service (ops.flowsync.syncer.Syncer): the NIC's flow cache,
    # which holds TCP and UDP flows and counts their hits, in sets of `ways` entries (`flow_set`). Its families
    # (`families`): IPv4, and IPv6 when the core's cache holds IPv6 tuples (FC_CONFIG bit 24, a dual-stack core).
    mode = "flowcache"
    protocols = (flowcache.PROTO_TCP, flowcache.PROTO_UDP)
    hit_counters = True
    set_limited = True

    def __init__(self, transport):
        self.t = transport
        self.map = regmap.MAP

    @property
    def families(self) -> tuple[int, ...]:
        """The address families the flow cache holds: AF_INET, and AF_INET6 when its keys take IPv6 tuples (a NIC that
        cannot be read says IPv4 only: an IPv6 entry then stays in conntrack, never one the cache cannot key)."""
        try:
            cfg = self.flow_config()
        except NicError:
            return (socket.AF_INET,)
        return (socket.AF_INET, socket.AF_INET6) if cfg is not None and cfg.v6 else (socket.AF_INET,)

    @classmethod
    def emu(cls, socket_path: str | Path, timeout: float = 30.0) -> NicClient:
        return cls(EmuTransport(socket_path, timeout))

    def close(self) -> None:
        self.t.close()

    def __enter__(self) -> NicClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _addr(self, reg: int | str) -> int:
        if isinstance(reg, str):
            try:
                return self.map.reg(reg).offset
            except KeyError as e:
                raise NicError(f"unknown register '{reg}' (not in hw/regmap.txt)") from e
        return reg

    def _table(self, name: int | str):
        if isinstance(name, int):
            for t in self.map.tables:
                if t.id == name:
                    return t
            raise NicError(f"unknown table id {name}")
        try:
            return self.map.table(name)
        except KeyError as e:
            raise NicError(f"unknown table '{name}' (not in hw/regmap.txt)") from e

    def read(self, addr: int | str) -> int:
        return self.t.read(self._addr(addr))

    def write(self, addr: int | str, value: int) -> None:
        self.t.write(self._addr(addr), value & 0xFFFFFFFF)

    def write_many(self, pairs: Iterable[tuple[int | str, int]]) -> None:
        self.t.write_many([(self._addr(a), v & 0xFFFFFFFF) for a, v in pairs])

    def read_table(self, name: int | str, index: int) -> int:
        t = self._table(name)
        if not 0 <= index < t.depth:
            raise NicError(f"table {t.name}: index {index} out of range 0..{t.depth - 1}")
        return self.t.read_table(t.id, index)

    def read_table_many(self, name: int | str, start: int, count: int) -> list[int]:
        """Entries start..start+count-1, in bulk when the transport can (the emulator pipelines its requests)."""
        t = self._table(name)
        if start < 0 or count < 0 or start + count > t.depth:
            raise NicError(f"table {t.name}: indices {start}..{start + count - 1} out of range 0..{t.depth - 1}")
        bulk = getattr(self.t, "read_table_many", None)
        if bulk is not None:
            return bulk(t.id, start, count)
        return [self.t.read_table(t.id, i) for i in range(start, start + count)]

    def write_table(self, name: int | str, index: int, value: int) -> None:
        self.write_table_many(name, index, [value])

    def write_table_many(self, name: int | str, start: int, values: Sequence[int]) -> None:
        t = self._table(name)
        if t.access == "RO":
            raise NicError(f"table {t.name} is read-only")
        if start < 0 or start + len(values) > t.depth:
            raise NicError(f"table {t.name}: indices {start}..{start + len(values) - 1} out of range")
        mask = (1 << t.width) - 1
        self.t.write_table_many(t.id, start, [v & mask for v in values])

    def info(self) -> dict[str, int]:
        """Identity block; refuses anything that is not a hypafilter core."""
        ident = self.read("ID")
        if ident != CORE_ID:
            raise NicError(f"not a hypafilter core: ID register reads 0x{ident:08x}, expected 0x{CORE_ID:08x}")
        return {
            "ID": ident,
            "VERSION": self.read("VERSION"),
            "MATCHER_HASH": self.read("MATCHER_HASH"),
            "NUM_ENTRIES": self.read("NUM_ENTRIES"),
            "GENERATION": self.read("GENERATION"),
            "CONTROL": self.read("CONTROL"),
        }

    def counters(self, hits: bool | Sequence[int] = False) -> dict:
        """CNT_*, PKTIN and PKTOUT; with hits=True (all entries) or a list of indices, also per-entry HITS."""
        bulk = getattr(self.t, "read_many", None)
        if bulk is not None:
            out: dict = dict(zip(COUNTER_REGS, bulk([self._addr(n) for n in COUNTER_REGS]), strict=True))
        else:
            out = {name: self.read(name) for name in COUNTER_REGS}
        if hits is True:
            out["HITS"] = dict(enumerate(self.read_table_many("HITS", 0, self.read("NUM_ENTRIES") + 1)))
        elif hits is not False:
            out["HITS"] = {i: self.read_table("HITS", i) for i in hits}
        return out

    def hits(self, count: int) -> list[int]:
        """HITS of entries 0..count-1, in bulk (the counter-source interface, targets.base.CounterSource)."""
        return self.read_table_many("HITS", 0, count)

    def clear_counters(self) -> None:
        self.write("RESET", 1)

    def program(
        self, plan, generation: int, known: dict | None = None, unfilterable: str = "drop", nic_mode: str = "bridge"
    ) -> dict:
        """Load a plan's run-time state: CONTROL bit 2 from `unfilterable` (Config.unfilterable: "drop" or
        "pass"), bit 3 from `nic_mode` (Config.nic_mode: "bridge" or "host"), bits 4/5 from Plan.miss_shunt,
        packed SHUNT words, ACTION codes, the update buffer (VALID, BUF), then GENERATION.

        `plan` is a Plan (its n + 1 rows; the buffer's rows shunted with no action, the buffer empty) or an
        analysis.overlay.View (its n + 1 + δ rows, valid mask and slots). The core must have been generated from a
        plan with the same hardware entries and buffer depth (NUM_ENTRIES and MATCHER_HASH are checked); shunt bits,
        actions and the buffer's contents are free. `known` is what an earlier `program` returned for this core:
        only words that differ from it are written (an insertion of a complex rule changes a few shunt words, not
        thousands). It is trusted only while GENERATION still reads what it was written with.
        Returns the tables as now written, with the number of writes issued.
        """
        n = len(plan.entries)
        have = self.read("NUM_ENTRIES")
        if have != n:
            raise NicError(f"core has {have} hardware entries, the plan {n}: it was generated from another plan")
        # a dual-stack core's IPv6 side (docs/ipv6.md "## emu"): the family-6 plan the deployment hangs on the IPv4
        # plan (or View); its rows follow the IPv4 ones and the buffer's slots, at V6_BASE = n + 1 + δ
        plan6 = getattr(plan, "plan6", None)
        # an IPv6 side changed through the IPv6 update buffer is analysis.overlay.align6's View over the static IPv6
        # plan the core was generated from (`static6`, targets.emu.v6.view6): that plan is the matcher's identity
        static6 = getattr(plan6, "static6", None) or plan6
        want_hash = int(matcher_hash(plan, static6)[-8:], 16)
        got_hash = self.read("MATCHER_HASH")
        if got_hash != want_hash:
            raise NicError(
                f"core MATCHER_HASH 0x{got_hash:08x} does not match the plan's 0x{want_hash:08x}: the plan's hardware "
                "entries differ from the core's (a new core must be generated)"
            )
        rows = updatebuffer.rows(plan)
        shunt, actions = [int(b) for b in plan.shunt], action_words(plan)  # action code | HF_ACTION_MIRROR_BIT
        if len(shunt) not in (n + 1, rows):
            raise NicError(f"plan has {len(shunt)} table rows; the core {rows} (entries, policy entry, buffer slots)")
        # a Plan's buffer rows as after reset: shunted, no action (no enabled slot reaches them)
        shunt += [1] * (rows - len(shunt))
        actions += [0] * (rows - len(actions))
        miss = [bool(x) for x in getattr(plan, "miss_shunt", (False, False))]
        v6 = None
        if plan6 is not None:
            # the IPv6 entries' rows and the IPv6 policy entry's; the IPv6 plan's miss forcing in CONTROL bits 6/7 (an
            # IPv6 frame the flow cache does not know, ct 0); per row whether a frame with ct 0 can match it (`ct0`:
            # only such a row's frames can be forced, targets.emu.v6.deciding_rows)
            # then the IPv6 update buffer's slots' rows (δ6; a Plan's: shunted, no action, no slot enabled)
            n6, d6 = len(static6.entries), buffer6_depth(plan, static6)
            ov6 = getattr(plan6, "overlay", None)
            if ov6 is not None:  # a View: its n6 + 1 + δ6 rows, valid mask and slots
                if (ov6.n_static, ov6.depth) != (n6, d6):
                    raise NicError(
                        f"IPv6 overlay for {ov6.n_static} entries and {ov6.depth} slots; the core has {n6} and {d6}"
                    )
                shunt += [int(b) for b in plan6.shunt]
                actions += action_words(plan6)
            else:
                ov6 = Overlay.empty(n6, d6)
                shunt += [int(b) for b in plan6.shunt] + [1] * d6
                actions += action_words(plan6) + [0] * d6
            v6 = {"entries": n6, "index_base": rows, "matcher": v6_matcher(static6), "ct0": _admits_ct0(static6),
                  "depth": d6, "overlay": updatebuffer.image6(ov6).as_dict(),
                  # the IPv6 policy the core's IPv6 matcher was generated from: the static entries of its IPv6
                  # update buffer (ops.deploy plans it again and aligns a new IPv6 plan to it)
                  "static": getattr(static6, "source6", None)}  # fmt: skip
        ov = getattr(plan, "overlay", None) or Overlay.empty(n, updatebuffer.buffer_depth(plan))
        tables = {
            "matcher_hash": f"{want_hash:08x}",
            "shunt": pack_shunt(shunt),
            "actions": actions,
            "overlay": updatebuffer.image(ov).as_dict(),
            "unfilterable": unfilterable,
            "nic_mode": nic_mode,
            # CONTROL bits 4/5 (shunt a flow-cache miss decided ACCEPT / DROP): the plan's miss forcing, none for a
            # plan without the field
            "miss_shunt": miss,
        }
        if v6 is not None:
            tables["v6"] = v6
            tables["miss_shunt6"] = [bool(x) for x in getattr(plan6, "miss_shunt", (False, False))]
        slots = tuple(getattr(plan, "set_slots", ()) or ())
        slots6 = tuple(getattr(plan6, "set_slots", ()) or ()) if plan6 is not None else ()
        if slots or slots6:
            # the set slots' contents: the kernel's sets as the front end read them (Policy.sets); a dual-stack
            # core's IPv6 slots (tables SET6_*) after the IPv4 ones, marked by a 4th field 6 (`set_families`)
            sets = getattr(getattr(plan, "policy", None), "sets", None) or {}
            sets6 = getattr(getattr(plan6, "policy", None), "sets", None) or {}
            tables["sets"] = [[s.name, s.settype, list(s.dirs)] for s in slots] + [
                [s.name, s.settype, list(s.dirs), 6] for s in slots6
            ]
            tables["set_elems"] = [
                None if s.name not in have else [list(dataclasses.astuple(e)) for e in
                                                 settable.elems_of(have[s.name], tuple(s.dirs))]
                for have, group in ((sets, slots), (sets6, slots6)) for s in group
            ]  # fmt: skip
        if self.ctm_config() is not None:  # [ctm] the shunt bits of frames with ct 3 (Plan.shunt_none; else shunt's)
            none = getattr(plan, "shunt_none", None)
            bits = shunt[:rows] if none is None else [int(b) for b in none] + [1] * (rows - len(none))
            if len(shunt) > rows:
                # the IPv6 rows at V6_BASE: the IPv6 plan's, when the structure takes IPv6 keys (CTM_CONFIG bit 24);
                # else all shunted (an IPv6 frame never has ct 3 there)
                n6rows = len(shunt) - rows
                none6 = getattr(plan6, "shunt_none", None)
                if not self.ctm_v6():
                    bits += [1] * n6rows
                elif none6 is None:
                    bits += shunt[rows:]
                else:
                    bits += [int(b) for b in none6] + [1] * (n6rows - len(none6))
            tables["shunt_none"] = pack_shunt(bits)
        return self.write_tables(tables, generation, known)

    def write_tables(self, tables: dict, generation: int, known: dict | None = None) -> dict:
        """Write the unfilterable setting, SHUNT words, ACTION codes and the update buffer's image as `program`
        returned them (also to put earlier ones back), then GENERATION; with `known` (the core's tables as last
        written, still valid: same matcher, GENERATION unchanged since) only the words that differ are written, and
        without it the buffer's image is read back to compare. CONTROL keeps its other bits; tables recorded without
        an unfilterable setting, NIC mode, miss forcing or buffer image leave those bits and the buffer as they are.

        When the buffer is not empty before or after, the writes run inside CONTROL bit 1 (shunt everything) unless
        the caller set it already: a frame is then decided only with the tables and buffer from before or after."""
        shunt, actions = list(tables["shunt"]), list(tables["actions"])
        writes = 0
        keep, bits = ~0, 0
        try:
            if tables.get("unfilterable") is not None:
                keep &= ~CONTROL_PASS_UNFILTERABLE
                bits |= unfilterable_control(tables["unfilterable"])
            if tables.get("nic_mode") is not None:
                keep &= ~CONTROL_HOST_MODE
                bits |= nic_mode_control(tables["nic_mode"])
            if tables.get("miss_shunt") is not None:
                keep &= ~CONTROL_MISS_SHUNT
                bits |= miss_shunt_control(tables["miss_shunt"])
            # a dual-stack core's IPv6 miss forcing (bits 6/7); tables without an IPv6 side clear them
            if tables.get("miss_shunt") is not None or tables.get("miss_shunt6") is not None:
                keep &= ~CONTROL_MISS_SHUNT6
                bits |= miss_shunt6_control(tables.get("miss_shunt6") or (False, False))
        except ValueError as e:
            raise NicError(str(e)) from e
        if keep != ~0:
            control = self.read("CONTROL")
            if (control & keep) | bits != control:
                self.write("CONTROL", ((control & keep) | bits) & 0xFFFFFFFF)
                writes += 1
        old_shunt: list[int | None] = [None] * len(shunt)
        old_actions: list[int | None] = [None] * len(actions)
        shunt_none = list(tables.get("shunt_none") or [])
        old_none: list[int | None] = [None] * len(shunt_none)
        new_img = Image.from_dict(tables["overlay"]) if tables.get("overlay") is not None else None
        old_img: Image | None = None
        old6: Image6 | None = None
        if (
            known
            and known.get("matcher_hash") == tables.get("matcher_hash")
            and known.get("generation") == self.read("GENERATION")
            and len(known.get("shunt", ())) == len(shunt)
            and len(known.get("actions", ())) == len(actions)
        ):
            old_shunt, old_actions = list(known["shunt"]), list(known["actions"])
            if shunt_none and len(known.get("shunt_none") or ()) == len(shunt_none):
                old_none = list(known["shunt_none"])
            if known.get("overlay") is not None:
                old_img = Image.from_dict(known["overlay"])
            if (known.get("v6") or {}).get("overlay") is not None:
                old6 = Image6.from_dict(known["v6"]["overlay"])
        buffer_writes: list = []
        if new_img is not None:
            if old_img is None or (old_img.n, old_img.depth) != (new_img.n, new_img.depth):
                old_img = self.read_image(new_img.depth, new_img.n)
            buffer_writes = updatebuffer.writes(old_img, new_img)
            busy = not (old_img.pristine and new_img.pristine)
        else:
            busy = False
        # a dual-stack core's IPv6 update buffer (tables VALID6, BUF6), written as IPv4's
        v6 = tables.get("v6") or {}
        if v6.get("overlay") is not None:
            new6 = Image6.from_dict(v6["overlay"])
            if old6 is None or (old6.n, old6.depth) != (new6.n, new6.depth):
                old6 = self.read_image6(new6.depth, new6.n)
            buffer_writes += updatebuffer.writes6(old6, new6)
            busy = busy or not (old6.pristine and new6.pristine)
        runs: list[tuple[str, int, list[int]]] = []  # the changed words of SHUNT and ACTION, in runs
        for name, new, old in (
            ("SHUNT", shunt, old_shunt),
            ("ACTION", actions, old_actions),
            ("SHUNT_NONE", shunt_none, old_none),
        ):
            i = 0
            while i < len(new):
                if new[i] == old[i]:
                    i += 1
                    continue
                j = i
                while j < len(new) and new[j] != old[j]:
                    j += 1
                runs.append((name, i, new[i:j]))
                i = j
        runs += buffer_writes
        # CONTROL bit 1 around the writes when the buffer is involved, unless the caller brackets them already
        bracket = busy and bool(runs) and not self.read("CONTROL") & CONTROL_SHUNT_ALL
        if bracket:
            self.set_shunt_all(True)
            writes += 1
        for name, start, words in runs:
            self.write_table_many(name, start, words)  # a run of changed words, pipelined
            writes += len(words)
        images = None
        set_errors: list[str] = []
        if tables.get("sets") is not None:
            from hypafilter.targets.xdp.sets import host_lock

            known_images = known.get("set_images") if known and known.get("sets") == tables["sets"] else None
            images = []
            ids = set_slot_ids(set_families(tables["sets"]))
            with host_lock():  # the set follower writes the same tables (ops.policysync.nicsets)
                for i, row in enumerate(tables["sets"]):
                    settype = row[1]
                    v6, slot = ids[i]
                    elems = tables["set_elems"][i]
                    k = known_images[i] if known_images is not None and i < len(known_images) else None
                    if elems is None:
                        self.set_slot_uncertain(slot, True, clear=True, v6=v6)
                        images.append(None)
                        writes += 1
                        continue
                    try:
                        img, n = self.load_set(slot, settype, [settable.Elem(*e) for e in elems], known=k, v6=v6)
                    except NicError as e:
                        # too large for this table: the slot stays cleared and uncertain, its frames go to the host
                        # (never a wrong verdict); said in the deployment's tables and by status
                        set_errors.append(str(e))
                        images.append(None)
                        continue
                    images.append(img)
                    writes += n
        self.write("GENERATION", generation & 0xFFFF)
        writes += 1
        if bracket:
            self.set_shunt_all(False)
            writes += 1
        out = {**tables, "generation": generation & 0xFFFF, "shunt": shunt, "actions": actions, "writes": writes}
        if images is not None:
            out["set_images"] = images
            out["set_errors"] = set_errors
        return out

    # ---- set membership tables (hw/hf_set_table.vhd; tables SET_*; placement of hypafilter.hw.settable)

    def set_config(self, v6: bool = False) -> list[dict]:
        """Each set slot's table of this core (SET_CONFIG, SET_INFO): [{settype, dirs, geometry}] in slot order;
        [] for a core without tables (or from before register map 1.9). `v6`: a dual-stack core's IPv6 slots
        (SET_CONFIG bits 23:16, SET6_INFO; none before register map 1.14)."""
        n = self.read("SET_CONFIG") >> (16 if v6 else 0) & 0xFF
        out = []
        names = {v: k for k, v in settable.SETTYPES.items()}
        info = "SET6_INFO" if v6 else "SET_INFO"
        for i in range(n):
            w = self.read_table(info, i << settable.SLOT_SHIFT)
            t = names.get(w & 0xF)
            if t is None or bool(w & settable.INFO_V6) != v6:
                raise NicError(f"set slot {i}: {info} {w:#x} names no set type of its family")
            adir, pdir = "dst" if w >> 4 & 1 else "src", "dst" if w >> 5 & 1 else "src"
            dirs = (
                (pdir,) if t == "bitmap:port" else (adir, pdir) if t in ("hash:ip,port", "hash:net,port") else (adir,)
            )
            geom = settable.Geometry(w >> 8 & 0xFF, w >> 16 & 0xFF, w >> 24 & 0xFF)
            out.append({"settype": t, "dirs": dirs, "geometry": geom})
        return out

    def _set_write(self, writes) -> int:
        for table, start, words in settable.runs(writes):
            self.write_table_many(table, start, words)
        return len(writes)

    def set_slot_uncertain(self, slot: int, on: bool, clear: bool = False, v6: bool = False) -> None:
        """SET_CTL of a slot: bit 0 every lookup uncertain (frames it could decide go to the host), bit 1 clear."""
        self.write_table(_ctl(v6), slot << settable.SLOT_SHIFT, int(on) | int(clear) << 1)

    def load_set(
        self, slot: int, settype: str, elems, known: dict | None = None, release: bool = True, v6: bool = False
    ) -> tuple[dict, int]:
        """Make slot `slot` hold `elems` (settable.Elem): with `known` (its image as this returned it last) by the
        inserts and deletes that differ, each write one element (a lookup sees the element before or after it);
        else, or when the changes do not fit, the slot cleared and loaded whole, every lookup of it uncertain
        meanwhile. Returns (the image now held, writes). A set that does not fit at all leaves the slot cleared and
        uncertain (its frames go to the host) and raises NicError. `v6`: IPv6 slot `slot` (tables SET6_*)."""
        cfg = self.set_config(v6)
        if not 0 <= slot < len(cfg) or cfg[slot]["settype"] != settype:
            have = cfg[slot]["settype"] if 0 <= slot < len(cfg) else "none"
            fam = "IPv6 set slot" if v6 else "set slot"
            raise NicError(f"{fam} {slot}: the core's table is {have}, not {settype}")
        geom = cfg[slot]["geometry"]
        ctl_t = _ctl(v6)
        ctl = self.read_table(ctl_t, slot << settable.SLOT_SHIFT)
        tag = secrets.randbits(24) | 1
        if known is not None and known.get("tag") == ctl >> 8:
            # the copy is trusted only while the slot's tag is the one written with it: any other writer (a
            # deploy, the set follower, a reset) changed it
            img = settable.image_from_dict(known)
            if (img.slot, img.settype, img.geom, img.v6) == (slot, settype, geom, v6):
                try:
                    writes = settable.diff_writes(img, elems)
                except settable.TableFull:
                    pass  # placed anew below, from an empty table
                else:
                    n = self._set_write(writes)
                    self.write_table(ctl_t, slot << settable.SLOT_SHIFT, tag << 8 | int(not release))
                    return {**settable.image_dict(img), "tag": tag}, n + 1
        self.set_slot_uncertain(slot, True, clear=True, v6=v6)
        try:
            img, writes = settable.image_of(slot, settype, elems, geom, v6=v6)
        except settable.TableFull as e:
            raise NicError(f"{e} (the slot stays uncertain: its frames go to the host)") from e
        n = self._set_write(writes)
        # certain again (unless the caller releases it), the new tag
        self.write_table(ctl_t, slot << settable.SLOT_SHIFT, tag << 8 | int(not release))
        return {**settable.image_dict(img), "tag": tag}, n + 2

    def set_tags(self, fams: list[bool]) -> list[int]:
        """Per slot (`fams` as for hold_sets) the tag its control word holds (SET_CTL / SET6_CTL bits 31:8)."""
        return [self.read_table(_ctl(v6), slot << settable.SLOT_SHIFT) >> 8 for v6, slot in set_slot_ids(fams)]

    def hold_sets(self, images: list, fams: list[bool] | None = None) -> None:
        """Every set slot uncertain (its frames go to the host), its tag kept: the set follower's fail safe from a
        change seen until the tables are the kernel's sets again (`release_sets`). `fams`: per slot whether it is
        an IPv6 slot (set_families; None: all IPv4)."""
        ids = set_slot_ids(fams or [False] * len(images))
        for i, img in enumerate(images):
            tag = img.get("tag", 0) if img else 0
            v6, slot = ids[i]
            self.write_table(_ctl(v6), slot << settable.SLOT_SHIFT, tag << 8 | 1)

    def release_sets(self, images: list, fams: list[bool] | None = None) -> None:
        ids = set_slot_ids(fams or [False] * len(images))
        for i, img in enumerate(images):
            if img:  # a slot without an image (its set unknown, too large) stays uncertain
                v6, slot = ids[i]
                self.write_table(_ctl(v6), slot << settable.SLOT_SHIFT, img["tag"] << 8)

    def program_sets(
        self,
        slots,
        sets: dict,
        known: list | None = None,
        release: bool = True,
        fams: list[bool] | None = None,
        only: set[int] | None = None,
    ) -> tuple[list[dict], int]:
        """Load every set slot's table from the kernel's sets by name (ir.sets.SetInfo; Policy.sets); `known`:
        the images program_sets returned last for this core; `fams` per slot whether it is an IPv6 slot; `only`: the
        slots to load (the others keep their `known` image, untouched). A slot whose set is unknown is cleared and
        left uncertain. Returns (the images, writes)."""
        images, writes = [], 0
        ids = set_slot_ids(fams or [False] * len(slots))
        for i, s in enumerate(slots):
            info = sets.get(s.name)
            k = known[i] if known is not None and i < len(known) else None
            if only is not None and i not in only:
                images.append(k)
                continue
            v6, slot = ids[i]
            if info is None:
                self.set_slot_uncertain(slot, True, clear=True, v6=v6)
                images.append(None)
                writes += 1
                continue
            try:
                elems = settable.elems_of(info, tuple(s.dirs))
                img, n = self.load_set(slot, s.settype, elems, known=k, release=release, v6=v6)
            except NicError:
                images.append(None)  # too large: the slot stays uncertain
                continue
            images.append(img)
            writes += n
        return images, writes

    # ---- the update buffer (hw/hf_update_buffer.vhd; tables VALID and BUF; layouts of hypafilter.hw.updatebuffer)

    def buffer_depth(self) -> int:
        """The core's update buffer slots (BUF_CONFIG[15:0]; 0: none)."""
        return self.read("BUF_CONFIG") & 0xFFFF

    def read_image(self, depth: int | None = None, n: int | None = None) -> Image:
        """The VALID words and every slot's words as the core holds them (depth and entries: BUF_CONFIG and
        NUM_ENTRIES unless given)."""
        depth = self.buffer_depth() if depth is None else depth
        n = self.read("NUM_ENTRIES") if n is None else n
        valid = self.read_table_many("VALID", 0, (n + 31) // 32) if n else []
        idx = [b * updatebuffer.WORDS + w for b in range(depth) for w in range(updatebuffer.USED)]
        buf = self._read_table_at("BUF", idx) if idx else []
        return Image(n, tuple(valid), tuple(buf))

    def read_image6(self, depth: int, n: int) -> Image6:
        """The VALID6 words and every IPv6 slot's words as a dual-stack core holds them (`depth` slots, `n` static
        IPv6 entries)."""
        valid = self.read_table_many("VALID6", 0, (n + 31) // 32) if n else []
        idx = [b * updatebuffer.WORDS6 + w for b in range(depth) for w in range(updatebuffer.USED6)]
        buf = self._read_table_at("BUF6", idx) if idx else []
        return Image6(n, tuple(valid), tuple(buf))

    def buffer6_depth(self) -> int:
        """The IPv6 update buffer's slots (BUF6_CONFIG bits 15:0; 0 for an IPv4-only core or one from before
        register map 1.12)."""
        return self.read("BUF6_CONFIG") & 0xFFFF

    def write_overlay(self, overlay: Overlay, known: Image | None = None) -> dict:
        """Make the core's valid mask and slots those of `overlay` (analysis.overlay): the words that differ from
        `known` (default: read back from the core), every enabled slot that changes disabled first, its fields
        then written with the control word (enable) last, slots the overlay does not use disabled; all inside
        CONTROL bit 1 (shunt everything) unless already set. The rows of the slots (SHUNT, ACTION) are the
        caller's: program(View) writes both. Returns {"overlay": the image now written, "writes": count}."""
        depth, n = self.buffer_depth(), self.read("NUM_ENTRIES")
        if (overlay.depth, overlay.n_static) != (depth, n):
            raise NicError(
                f"overlay for {overlay.n_static} entries and {overlay.depth} slots; the core has {n} and {depth}"
            )
        new = updatebuffer.image(overlay)
        old = known if known is not None else self.read_image(depth, n)
        ops = updatebuffer.writes(old, new)
        writes = 0
        bracket = bool(ops) and not self.read("CONTROL") & CONTROL_SHUNT_ALL
        if bracket:
            self.set_shunt_all(True)
            writes += 1
        for name, start, words in ops:
            self.write_table_many(name, start, words)
            writes += len(words)
        if bracket:
            self.set_shunt_all(False)
            writes += 1
        return {"overlay": new.as_dict(), "writes": writes}

    def read_overlay(self) -> tuple[list[bool], list[tuple | None]]:
        """(valid bit of every static entry, the slots up to the last enabled one) as the core holds them, each
        slot as analysis.overlay.box_key gives it, (lo, hi, flags mask, flags value, pos), None for a disabled one:
        `read_overlay() == (list(ov.valid), box_key(ov))` checks a core against an overlay (drift)."""
        n = self.read("NUM_ENTRIES")
        img = self.read_image(None, n)
        slots = [updatebuffer.slot_of(img.slot(b)) for b in range(img.depth)]
        last = max((b for b, s in enumerate(slots) if s is not None), default=-1)
        out = [
            None if s is None else (s.box.lo, s.box.hi, s.box.flags_mask, s.box.flags_value, s.pos)
            for s in slots[: last + 1]
        ]
        return [bool(v) for v in updatebuffer.valid_of(img.valid, n)], out

    # ---- the flow cache (hw/hf_flow_cache.vhd; FC_* registers, FLOW_* tables; codes of hypafilter.hw.flowcache)

    def flow_config(self) -> FlowCacheConfig | None:
        """The flow cache's geometry, or None when this core has none (FC_CONFIG reads 0). A core's geometry never
        changes, so the first non-zero reading is kept (a flow command then costs no extra register read)."""
        cached = getattr(self, "_fc_config", None)
        if cached is not None:
            return cached
        v = self.read("FC_CONFIG")
        if v == 0:
            return None
        self._fc_config = FlowCacheConfig(v & 0xFF, (v >> 8) & 0xFF, (v >> 16) & 0xFF, bool(v & flowcache.FC_CONFIG_V6))
        return self._fc_config

    def flow_set(self, flow: Flow | Flow6) -> int:
        """The set a flow's entry goes to (either direction: the canonical key's CRC-32, as the core computes it):
        an insert finds a free way among its set's `ways`, or answers ST_FULL."""
        cfg = self._need_flow_cache()
        if flowcache.is_v6(flow) and not cfg.v6:
            raise NicError(f"flow {flow}: this core's flow cache holds no IPv6 tuples (FC_CONFIG bit 24 clear)")
        key, _ = flowcache.canonical(flow, wide=cfg.v6)
        return flowcache.set_index(key, cfg.log2_sets, wide=cfg.v6)

    def _need_flow_cache(self) -> FlowCacheConfig:
        cfg = self.flow_config()
        if cfg is None:
            raise NicError("this core has no flow cache (FC_CONFIG reads 0)")
        return cfg

    def _flow_command(self, op: int, flow: Flow | None = None, slot: int = 0) -> tuple[int, int]:
        """Run one FC_CMD command; (status, slot) from FC_STATUS once its busy bit reads 0."""
        return self.flow_commands([(op, flow, slot)])[0]

    def flow_commands(self, cmds: Sequence[tuple]) -> list[tuple[int, int]]:
        """Run FC_CMD commands in order, as one batch of requests; per command (status, slot) from FC_STATUS.

        `cmds`: (op, flow) or (op, flow, slot) tuples (flow None for the commands without a key). Every command
        is its key writes (FC_KEY0..3, of an IPv6 flow also FC_KEY4..9; FC_SLOT), a status read, the FC_CMD write and FC_STATUS_READS status
        reads, and the whole batch goes to the transport's `request_many` at once: the emulated NIC's socket
        pipelines it (one round trip for a batch of inserts: the flow sync service's insert latency), the SUME
        transport runs it in order.

        The core ignores FC_CMD while FC_STATUS bit 31 (busy) is set, and a running command latched its key when
        it started, so key writes do not disturb it. The status read just before a command's FC_CMD write tells
        whether that write starts it: not busy, it does (the cache has one writer, the flow sync service), and
        the reading is the previous command's final status. A command's result is the first status read after
        its FC_CMD write that is not busy, else the next command's pre-write reading; the last one polls. Busy
        before the first command means another client's command runs: refused with NicError (this batch ran
        only if that command ended in between). Busy before a later command means ours before it was still
        running (the host writes faster than the core finishes a command): from that earlier command on, the
        outcomes are not known from the readings, so once the cache is idle those commands run again one by one
        (an insert that ran the first time then answers ST_EXISTS, a delete ST_NOT_FOUND)."""
        if not cmds:
            return []
        cfg = self._need_flow_cache()
        status_reg, cmd_reg = self._addr("FC_STATUS"), self._addr("FC_CMD")
        reqs: list[RegRequest] = []
        for c in cmds:
            op, flow = c[0], c[1]
            writes: list[tuple[int | str, int]] = []
            if flow is not None:
                _check_flow(flow)
                if flowcache.is_v6(flow):
                    if not cfg.v6:
                        raise NicError(f"flow {flow}: this core's flow cache holds no IPv6 tuples (FC_CONFIG bit 24)")
                    writes += list(zip(FC_KEY6_REGS, flowcache.fc_key6_regs(flow), strict=True))
                writes += list(
                    zip(("FC_KEY0", "FC_KEY1", "FC_KEY2", "FC_KEY3"), flowcache.fc_key_regs(flow), strict=True)
                )
            writes.append(("FC_SLOT", c[2] if len(c) > 2 else 0))
            reqs += [RegRequest("write", self._addr(a), v & 0xFFFFFFFF) for a, v in writes]
            reqs += [RegRequest("read", status_reg), RegRequest("write", cmd_reg, op & 0xFFFFFFFF)]
            reqs += [RegRequest("read", status_reg)] * FC_STATUS_READS
        replies = self.t.request_many(reqs)
        reads = [v for r, v in zip(reqs, replies, strict=True) if r.op == "read"]
        per = 1 + FC_STATUS_READS
        pre = reads[0::per]
        post = [[st for st in reads[k * per + 1 : (k + 1) * per] if not st >> 31] for k in range(len(cmds))]
        if pre[0] >> 31:
            raise NicError("the flow cache is busy with a command (FC_STATUS bit 31): another client is using it")
        out: list[tuple[int, int]] = []
        for k in range(len(cmds)):
            if k + 1 < len(cmds) and pre[k + 1] >> 31:
                # ours (k) still ran when k + 1's FC_CMD was written: k's result and whether k + 1 ran are unknown
                self._flow_wait(cmds[k][0])
                return out + [self.flow_commands([c])[0] for c in cmds[k:]]
            st = post[k][0] if post[k] else pre[k + 1] if k + 1 < len(cmds) else self._flow_wait(cmds[k][0])
            out.append(((st >> 24) & 0xF, st & 0xFFFFFF))
        return out

    def _flow_wait(self, op: int) -> int:
        """FC_STATUS once its busy bit reads 0 (the running command's final status)."""
        deadline = time.monotonic() + FC_COMMAND_SECONDS
        while True:
            st = self.read("FC_STATUS")
            if not st >> 31:
                return st
            if time.monotonic() > deadline:
                raise NicError(f"flow cache command {op} still busy (FC_STATUS) after {FC_COMMAND_SECONDS:.0f} s")

    def flow_insert(self, flow: Flow) -> tuple[int, int]:
        """Insert a flow (its original direction): (ST_OK, slot), (ST_EXISTS, its slot) or (ST_FULL, 0)."""
        self._need_flow_cache()
        return self._flow_command(flowcache.OP_INSERT, flow)

    def flow_delete(self, flow: Flow) -> tuple[int, int]:
        """Delete a flow (either direction): (ST_OK, the slot it had) or (ST_NOT_FOUND, 0)."""
        self._need_flow_cache()
        return self._flow_command(flowcache.OP_DELETE, flow)

    def flow_find(self, flow: Flow) -> tuple[int, int]:
        """(ST_OK, slot) of a flow in the cache (either direction), or (ST_NOT_FOUND, 0)."""
        self._need_flow_cache()
        return self._flow_command(flowcache.OP_FIND, flow)

    def flow_clear(self) -> None:
        """Invalidate every entry (FC_INSERTS, FC_DELETES and FC_FULL keep counting)."""
        self._need_flow_cache()
        status, _ = self._flow_command(flowcache.OP_CLEAR)
        if status != flowcache.ST_OK:
            raise NicError(f"flow cache clear answered status {status}")

    def _read_table_at(self, name: str, indices: Sequence[int]) -> list[int]:
        t = self._table(name)
        bulk = getattr(self.t, "read_table_at", None)
        if bulk is not None:
            return bulk(t.id, indices)
        return [self.t.read_table(t.id, i) for i in indices]

    def flow_entries(self, slots: Iterable[int] | None = None) -> list[FlowRecord]:
        """Every valid entry of `slots` (default: all), by slot: FLOW_KEY word 3 of every slot, then the other
        words, FLOW_SEEN and FLOW_HITS of the valid ones. Entries inserted or deleted while it reads may or may
        not be in the list."""
        cfg = self._need_flow_cache()
        slots = sorted(set(range(cfg.entries) if slots is None else slots))
        if slots and not 0 <= slots[0] <= slots[-1] < cfg.entries:
            raise NicError(f"flow cache slots {slots[0]}..{slots[-1]}: out of range 0..{cfg.entries - 1}")
        w3 = dict(zip(slots, self._read_table_at("FLOW_KEY", [4 * s + 3 for s in slots]), strict=True))
        valid = [s for s, w in w3.items() if w >> 31]
        words = self._read_table_at("FLOW_KEY", [4 * s + w for s in valid for w in range(3)])
        seen = self._read_table_at("FLOW_SEEN", valid)
        hits = self._read_table_at("FLOW_HITS", valid)
        # an IPv6 entry's upper address bits (FLOW_KEY6), in a cache with IPv6 tuples
        v6 = [s for s in valid if w3[s] & flowcache.FLOW_KEY_V6] if cfg.v6 else []
        stride = flowcache.FLOW_KEY6_STRIDE
        w6 = self._read_table_at("FLOW_KEY6", [stride * s + w for s in v6 for w in range(6)]) if v6 else []
        hi = {s: tuple(w6[6 * k : 6 * k + 6]) for k, s in enumerate(v6)}
        out = []
        for k, s in enumerate(valid):
            words6 = hi.get(s, (0,) * 6) if cfg.v6 else None
            entry, counted = flowcache.words_to_entry((*words[3 * k : 3 * k + 3], w3[s]), words6)
            out.append(FlowRecord(s, entry.flow, counted, seen[k], hits[k]))
        return out

    def flow_counters(self) -> dict:
        """{now, occupancy, inserts, deletes, full}: FC_NOW (ticks) and the flow cache's counters."""
        self._need_flow_cache()
        names = ("FC_NOW", "FC_OCCUPANCY", "FC_INSERTS", "FC_DELETES", "FC_FULL")
        bulk = getattr(self.t, "read_many", None)
        values = bulk([self._addr(x) for x in names]) if bulk is not None else [self.read(x) for x in names]
        return dict(zip(("now", "occupancy", "inserts", "deletes", "full"), values, strict=True))

    def set_shunt_all(self, on: bool) -> None:
        control = self.read("CONTROL")
        self.write("CONTROL", (control | CONTROL_SHUNT_ALL) if on else (control & ~CONTROL_SHUNT_ALL))

    def set_lease(self, ms: int) -> None:
        """Arm the policy sync lease for `ms` ticks of 1 ms (a re-arm ends an expiry); 0 disarms it (LEASE)."""
        if not isinstance(ms, int) or not 0 <= ms <= LEASE_MAX:
            raise NicError(f"a lease of {ms!r} ms: the LEASE register takes 0..{LEASE_MAX}")
        self.write("LEASE", ms)

    def lease(self) -> dict:
        """The policy sync lease: {armed, expired, expiries, left_ms} (LEASE_STATUS, LEASE); a core from before the
        lease (register map 1.7 or older) reads as disarmed."""
        return {**lease_status(self.read("LEASE_STATUS")), "left_ms": self.read("LEASE")}

    # ---- [ctm] the conntrack membership structure (hw/hf_ct_member.vhd; CTM_* registers, table CTM_CMD)

    def ctm_config(self) -> tuple[int, int] | None:
        """(LOG2, EGRESS_LOG2) of the core's conntrack membership structure, None when it has none."""
        cached = getattr(self, "_ctm_config", None)
        if cached is None:
            cached = self._ctm_config = (ctmember.parse_config(self.read("CTM_CONFIG")),)
        return cached[0]

    def ctm_v6(self) -> bool:
        """Whether the core's conntrack membership structure takes IPv6 keys (CTM_CONFIG bit 24: a dual-stack core)."""
        cached = getattr(self, "_ctm_v6", None)
        if cached is None:
            cached = self._ctm_v6 = ctmember.config_v6(self.read("CTM_CONFIG"))
        return cached

    def ctm_commands(self, cmds: Sequence[tuple[int, Flow | Flow6 | None]]) -> None:
        """Inserts, deletes and clears (ctmember.OP_*, flow) in order, as stream writes of CTM_CMD (a word that finds
        the structure busy waits on the bus: the writes are the flow control). An IPv6 tuple (Flow6, or the folded
        ctmember.Folded6) only to a structure that takes IPv6 keys: else nothing is written and NicError says why."""
        if self.ctm_config() is None:
            raise NicError("this core has no conntrack membership structure (CTM_CONFIG reads 0)")
        words = [w for op, f in cmds for w in ctmember.cmd_words(op, f)]
        if any(words[i] & ctmember.CMD_V6 for i in range(3, len(words), 4)) and not self.ctm_v6():
            raise NicError(
                "this core's conntrack membership structure holds IPv4 tuples only (CTM_CONFIG bit 24 clear)"
            )
        for i in range(0, len(words), CTM_BATCH_WORDS):
            self.write_table_many("CTM_CMD", 0, words[i : i + CTM_BATCH_WORDS])

    def ctm_idle(self) -> bool:
        """Whether CTM_STATUS says the structure is idle (a clear's sweep of 2**LOG2 cycles, or the one after reset,
        done: lookups answer "member" meanwhile, and a CTM_CMD write waits on the bus). The emulated core runs its
        clock only for work, so this reads the status in one pipelined burst, which also clocks it: a caller that
        must not block (the flow sync service, between its events) asks again until it is."""
        addr = self._addr("CTM_STATUS")
        bulk = getattr(self.t, "read_many", None)
        values = bulk([addr] * CTM_IDLE_BURST) if bulk is not None else [self.read(addr)]
        return not values[-1] >> 31

    def ctm_wait_idle(self, timeout: float = CTM_IDLE_SECONDS) -> None:
        """Until the structure is idle (`ctm_idle`)."""
        deadline = time.monotonic() + timeout
        while True:
            if self.ctm_idle():
                return
            if time.monotonic() > deadline:
                raise NicError(f"the conntrack membership structure still busy (CTM_STATUS) after {timeout:.0f} s")

    def ctm_complete(self, lease_ms: int) -> None:
        """Say the structure holds every conntrack entry, for `lease_ms` (0: it does not; ct 3 stops at once)."""
        if lease_ms:
            self.write_many([("CTM_LEASE", lease_ms), ("CTM_CONTROL", ctmember.CONTROL_COMPLETE)])
        else:
            self.write_many([("CTM_CONTROL", 0), ("CTM_LEASE", 0)])

    def ctm_counters(self) -> dict:
        names = ("CTM_CONTROL", "CTM_LEASE", "CTM_WINDOW", "CTM_STATUS", "CTM_MEMBERS", "CTM_SATURATED", "CNT_CT_NONE")
        bulk = getattr(self.t, "read_many", None)
        v = dict(
            zip(names, bulk([self._addr(x) for x in names]) if bulk else [self.read(x) for x in names], strict=True)
        )
        return {
            "complete": bool(v["CTM_CONTROL"] & ctmember.CONTROL_COMPLETE),
            "lease_ms": v["CTM_LEASE"],
            "window_ms": v["CTM_WINDOW"],
            "members": v["CTM_MEMBERS"],
            "saturated": v["CTM_SATURATED"],
            "refused": v["CTM_STATUS"] & 0xFFFF,
            "ct_none_frames": v["CNT_CT_NONE"],
        }


def _ctl(v6: bool) -> str:
    return "SET6_CTL" if v6 else "SET_CTL"


def set_families(rows) -> list[bool]:
    """Per row of a deployment's tables' "sets" ([name, type, dirs] or, an IPv6 slot, [name, type, dirs, 6]) whether
    it is a dual-stack core's IPv6 slot."""
    return [len(r) > 3 and r[3] == 6 for r in rows]


def set_slot_ids(fams) -> list[tuple[bool, int]]:
    """(IPv6, the slot's number among its family's tables) per slot, the IPv4 slots and the IPv6 ones numbered apart."""
    seen = [0, 0]
    out = []
    for v6 in fams:
        out.append((bool(v6), seen[bool(v6)]))
        seen[bool(v6)] += 1
    return out


def v6_matcher(plan6) -> str:
    """The low 32 bits (hex) of the IPv6 side's own matcher hash: what a dual-stack core's IPv6 rows were generated
    from, whatever its IPv4 side (the state's tables "v6", which the update buffer's path compares)."""
    from hypafilter.hw.vhdl import _Empty

    return matcher_hash(_Empty(), plan6)[-8:]


def pack_shunt(bits: Sequence[int]) -> list[int]:
    """Shunt vector packed 32 entries per word (word w bit j = entry 32*w + j)."""
    words = [0] * ((len(bits) + 31) // 32)
    for i, b in enumerate(bits):
        if b:
            words[i // 32] |= 1 << (i % 32)
    return words
