"""Pinned BPF maps read and written from Python through the bpf() system call (no helper process): what a service
that must react within milliseconds uses for a single word (the policy sync service's fail safe: the shim's
generation, the xdp program's control word). Array maps with a u32 key; values as bytes, patched as u32 words; any
map with byte keys (PinnedMap); a ring buffer as a wake-up (PinnedRingbuf)."""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import platform
import select
import struct
from pathlib import Path

from hypafilter.errors import HypafilterError

_NR_BPF = {"x86_64": 321, "aarch64": 280}.get(platform.machine(), 321)
BPF_MAP_LOOKUP_ELEM, BPF_MAP_UPDATE_ELEM, BPF_OBJ_GET, BPF_OBJ_GET_INFO_BY_FD = 1, 2, 7, 15
BPF_MAP_UPDATE_BATCH = 26
ENOTSUPP = 524  # the kernel's own "operation not supported" (not in errno's table)
_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


def _bpf(cmd: int, attr: ctypes.Array) -> int:
    r = _libc.syscall(_NR_BPF, cmd, ctypes.byref(attr), ctypes.sizeof(attr))
    if r < 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))
    return r


class PinnedArray:
    """An array map pinned at `path` (its value size as the kernel reports it)."""

    def __init__(self, path: str | Path):
        self.path = str(path)
        name = ctypes.create_string_buffer(self.path.encode())
        attr = ctypes.create_string_buffer(128)
        struct.pack_into("=Q", attr, 0, ctypes.addressof(name))
        try:
            self.fd = _bpf(BPF_OBJ_GET, attr)
        except OSError as e:
            raise HypafilterError(f"{self.path}: cannot open the pinned map: {e.strerror}") from e
        info = ctypes.create_string_buffer(80)  # struct bpf_map_info: type, id, key_size, value_size, ...
        attr = ctypes.create_string_buffer(128)
        struct.pack_into("=IIQ", attr, 0, self.fd, len(info), ctypes.addressof(info))
        _bpf(BPF_OBJ_GET_INFO_BY_FD, attr)
        self.key_size, self.value_size = struct.unpack_from("=II", info, 8)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> PinnedArray:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _elem(self, cmd: int, index: int, value: ctypes.Array) -> None:
        key = ctypes.c_uint32(index)
        attr = ctypes.create_string_buffer(128)
        struct.pack_into("=IIQQQ", attr, 0, self.fd, 0, ctypes.addressof(key), ctypes.addressof(value), 0)
        try:
            _bpf(cmd, attr)
        except OSError as e:
            raise HypafilterError(f"{self.path}[{index}]: {e.strerror}") from e

    def read(self, index: int = 0) -> bytes:
        buf = ctypes.create_string_buffer(self.value_size)
        self._elem(BPF_MAP_LOOKUP_ELEM, index, buf)
        return buf.raw

    def write(self, value: bytes, index: int = 0) -> None:
        if len(value) != self.value_size:
            raise HypafilterError(f"{self.path}: a value of {len(value)} bytes, the map holds {self.value_size}")
        self._elem(BPF_MAP_UPDATE_ELEM, index, ctypes.create_string_buffer(value, self.value_size))

    def write_many(self, values: list[bytes], start: int = 0) -> None:
        """Elements start, start + 1, ... set to `values`, in one BPF_MAP_UPDATE_BATCH system call (element by
        element where the kernel has no batch operation for the map)."""
        if not values:
            return
        if any(len(v) != self.value_size for v in values):
            raise HypafilterError(f"{self.path}: every value must be {self.value_size} bytes")
        n = len(values)
        keys = (ctypes.c_uint32 * n)(*range(start, start + n))
        vals = ctypes.create_string_buffer(b"".join(values), n * self.value_size)
        count = n
        attr = ctypes.create_string_buffer(128)
        # union bpf_attr, batch ops: in_batch, out_batch, keys, values (u64 each), count, map_fd, elem_flags, flags
        struct.pack_into(
            "=QQQQIIQQ", attr, 0, 0, 0, ctypes.addressof(keys), ctypes.addressof(vals), count, self.fd, 0, 0
        )
        try:
            _bpf(BPF_MAP_UPDATE_BATCH, attr)
            return
        except OSError as e:
            if e.errno not in (errno.EINVAL, ENOTSUPP):  # no batch operation for this map here
                raise HypafilterError(f"{self.path}: batch update of {n} elements: {e.strerror}") from e
        for i, v in enumerate(values):
            self.write(v, start + i)

    def set_word(self, word: int, v: int, index: int = 0) -> int:
        """Read element `index`, set its u32 word `word` to v, write it back; returns the old word."""
        cur = bytearray(self.read(index))
        old = struct.unpack_from("=I", cur, 4 * word)[0]
        struct.pack_into("=I", cur, 4 * word, v & 0xFFFFFFFF)
        self.write(bytes(cur), index)
        return old


BPF_MAP_DELETE_ELEM, BPF_MAP_GET_NEXT_KEY = 3, 4


class PinnedMap(PinnedArray):
    """Any pinned map (hash, LPM trie, array) with byte keys: look-ups, updates, deletes and the keys it holds."""

    def _kv(self, cmd: int, key: bytes, value: ctypes.Array | None) -> int:
        if len(key) != self.key_size:
            raise HypafilterError(f"{self.path}: a key of {len(key)} bytes, the map's are {self.key_size}")
        k = ctypes.create_string_buffer(key, self.key_size)
        attr = ctypes.create_string_buffer(128)
        struct.pack_into(
            "=IIQQQ", attr, 0, self.fd, 0, ctypes.addressof(k), ctypes.addressof(value) if value is not None else 0, 0
        )
        try:
            return _bpf(cmd, attr)
        except OSError as e:
            if e.errno == errno.ENOENT:
                return -1
            raise HypafilterError(f"{self.path}: {e.strerror}") from e

    def get(self, key: bytes) -> bytes | None:
        buf = ctypes.create_string_buffer(self.value_size)
        return None if self._kv(BPF_MAP_LOOKUP_ELEM, key, buf) < 0 else buf.raw

    def put(self, key: bytes, value: bytes) -> None:
        if len(value) != self.value_size:
            raise HypafilterError(f"{self.path}: a value of {len(value)} bytes, the map holds {self.value_size}")
        self._kv(BPF_MAP_UPDATE_ELEM, key, ctypes.create_string_buffer(value, self.value_size))

    def delete(self, key: bytes) -> bool:
        """Remove `key`; False when it was not there."""
        return self._kv(BPF_MAP_DELETE_ELEM, key, None) >= 0

    def keys(self) -> list[bytes]:
        """Every key the map holds now (BPF_MAP_GET_NEXT_KEY from none)."""
        out: list[bytes] = []
        nxt = ctypes.create_string_buffer(self.key_size)
        attr = ctypes.create_string_buffer(128)
        cur = None
        while True:
            struct.pack_into(
                "=IIQQQ", attr, 0, self.fd, 0, ctypes.addressof(cur) if cur is not None else 0, ctypes.addressof(nxt), 0
            )
            try:
                _bpf(BPF_MAP_GET_NEXT_KEY, attr)
            except OSError as e:
                if e.errno == errno.ENOENT:
                    return out
                raise HypafilterError(f"{self.path}: {e.strerror}") from e
            out.append(nxt.raw)
            cur = ctypes.create_string_buffer(nxt.raw, self.key_size)


def possible_cpus() -> int:
    """The kernel's possible CPUs (what a per-CPU map value holds one slot of each)."""
    text = Path("/sys/devices/system/cpu/possible").read_text().strip()
    n = 0
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        n = max(n, int(hi or lo) + 1)
    return n


def percpu_sum(m: PinnedArray, index: int) -> int:
    """Element `index` of a per-CPU array of u64 counters, summed over the CPUs."""
    n = possible_cpus()
    buf = ctypes.create_string_buffer(8 * n)
    m._elem(BPF_MAP_LOOKUP_ELEM, index, buf)
    return sum(struct.unpack(f"<{n}Q", buf.raw))


class PinnedRingbuf(PinnedArray):
    """A pinned BPF ring buffer read only as a wake-up: `wait` blocks until a record came (or `timeout`), then
    consumes everything (the records themselves are not read)."""

    def __init__(self, path: str | Path):
        super().__init__(path)
        page = mmap.PAGESIZE
        self.cons = mmap.mmap(self.fd, page, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE, offset=0)
        self.prod = mmap.mmap(self.fd, page, mmap.MAP_SHARED, mmap.PROT_READ, offset=page)
        self.poller = select.poll()
        self.poller.register(self.fd, select.POLLIN)

    def wait(self, timeout: float) -> bool:
        """True when records came (all consumed now)."""
        got = bool(self.poller.poll(max(0, int(timeout * 1000))))
        struct.pack_into("<Q", self.cons, 0, struct.unpack_from("<Q", self.prod, 0)[0])
        return got

    def close(self) -> None:
        if self.fd >= 0:
            self.cons.close()
            self.prod.close()
        super().close()
