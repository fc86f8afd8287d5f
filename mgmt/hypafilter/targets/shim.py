"""Builds, loads and fills the eBPF shim (driver/shim.bpf.c) through its loader driver/hf_shim.c."""

from __future__ import annotations

import json
import shutil
import struct
from collections.abc import Iterable, Sequence
from pathlib import Path

from hypafilter import netns, shared
from hypafilter.errors import HypafilterError
from hypafilter.paths import ROOT, build_lock
from hypafilter.targets.bpfmap import PinnedArray

DRIVER = ROOT / "driver"


def build(build_root: str | Path = ROOT / "build") -> tuple[Path, Path]:
    """(shim.bpf.o, hf_shim loader), rebuilt by make only when their sources changed. One build at a time per
    build folder (deploys of several labs start together); the Makefile renames each output into place."""
    out = (Path(build_root) / "shim").resolve()
    try:
        with build_lock(out / ".build.lock"):
            netns.run(["make", "-s", "-C", str(DRIVER), f"OUT={out}"], timeout=None)
    except netns.CommandError as e:
        raise HypafilterError(f"building the eBPF shim failed: {e}") from e
    return out / "shim.bpf.o", out / "hf_shim"


def pin_dir(netns: str | None) -> Path:
    return Path(shared.HF_PIN_DIR) / (netns or "root")


class Shim:
    """The shim on `ifaces` of network namespace `netns` (None: this namespace); its maps pinned in pin_dir()."""

    def __init__(
        self, netns: str | None, ifaces: Sequence[str], build_root: str | Path = ROOT / "build", tc_only: bool = False
    ):
        self.netns = netns
        self.tc_only = tc_only  # TC ingress only: the XDP target's fast path writes the metadata (docs/xdp.md)
        self.ifaces = list(ifaces)
        self.pin = pin_dir(netns)
        self.build_root = Path(build_root)
        self._obj: Path | None = None
        self._tool: Path | None = None

    def _paths(self) -> tuple[Path, Path]:
        if self._tool is None:
            self._obj, self._tool = build(self.build_root)
        assert self._obj is not None
        return self._obj, self._tool

    def _run(self, step: str, args: list[str], stdin: str | None = None) -> str:
        _, tool = self._paths()
        try:
            return netns.run([str(tool), *args], input=stdin)
        except netns.CommandError as e:
            raise HypafilterError(f"shim {step} failed: {e}") from e

    def _ns_args(self) -> list[str]:
        return ["--netns", self.netns] if self.netns else []

    @property
    def pinned(self) -> bool:
        return (self.pin / shared.HF_MAP_CONFIG).exists()

    def attached(self) -> list[str]:
        """The interfaces that carry both shim programs (hf_xdp at XDP, hf_tc at TC ingress; TC alone if tc_only).
        Two listings of the whole namespace (the links with their XDP program, bpftool's TC attachments), not two
        per interface: `tc filter show` alone took 7.5 ms a call here."""
        try:
            links = json.loads(netns.run(["ip", "-j", "-d", "link", "show"], self.netns) or "[]")
            net = json.loads(netns.run(["bpftool", "-j", "net", "show"], self.netns) or "[]")
        except (netns.CommandError, ValueError):
            return []
        xdp = {ln.get("ifname"): ((ln.get("xdp") or {}).get("prog") or {}).get("name") for ln in links}
        tc = {
            t.get("devname")
            for block in net
            for t in block.get("tc") or []
            if t.get("kind") in ("clsact/ingress", "tcx/ingress") and str(t.get("name", "")).split(":")[0] == "hf_tc"
        }
        return [i for i in self.ifaces if i in tc and (self.tc_only or xdp.get(i) == "hf_xdp")]

    @property
    def loaded(self) -> bool:
        """Pinned maps and both programs on every interface. Pins alone say nothing: they outlive a namespace
        deleted without an unload, and a new namespace of that name has interfaces without programs, whose tagged
        frames would cross the bridge unfiltered."""
        return self.pinned and self.attached() == self.ifaces

    def clear_stale(self) -> bool:
        """Remove pins that no attached program uses (left by a namespace deleted without an unload); True if
        there were any. The maps' contents are the deployment's and are written again by the next deploy."""
        if not self.pinned or self.attached():
            return False
        shutil.rmtree(self.pin, ignore_errors=True)
        return True

    def load(self, generic: bool = False) -> None:
        """Attach XDP (native unless `generic`) and TC ingress on every interface; maps pinned and reused."""
        obj, _ = self._paths()
        args = ["load", "--obj", str(obj), "--pin", str(self.pin), *self._ns_args()]
        args += ["--generic"] if generic else []
        args += ["--tc-only"] if self.tc_only else []
        self._run("load", args + self.ifaces)

    def unload(self) -> None:
        self._run("unload", ["unload", "--pin", str(self.pin), *self._ns_args(), *self.ifaces])

    def update(
        self,
        intervals: Iterable[int] | None = None,
        generation: int | None = None,
        mark_mask: int | None = None,
        mark_shift: int | None = None,
        num_entries: int | None = None,
        control: int | None = None,
    ) -> None:
        """Write intervals (match_index 0.. → k, one batch syscall) first, then the given hf_config fields (one
        write of the config element), through the bpf() system call into the pinned maps: no helper process.
        `control`: HF_SHIM_CONTROL_* (K0_TREE: the live K0 tree's mark for the frames the core judged unparsed);
        pins from before the control word have none, and a bit to set there is an error (0 is what they do)."""
        if intervals is not None:
            with PinnedArray(self.pin / shared.HF_MAP_INTERVALS) as m:
                m.write_many([struct.pack("=I", int(k) & 0xFFFFFFFF) for k in intervals])
        fields = (
            ("HF_CFG_GENERATION", generation),
            ("HF_CFG_MARK_MASK", mark_mask),
            ("HF_CFG_MARK_SHIFT", mark_shift),
            ("HF_CFG_NUM_ENTRIES", num_entries),
            ("HF_CFG_CONTROL", control),
        )
        if any(v is not None for _, v in fields):
            with PinnedArray(self.pin / shared.HF_MAP_CONFIG) as m:
                cur = bytearray(m.read())
                for name, v in fields:
                    if name == "HF_CFG_CONTROL" and v is not None and 4 * shared.C[name] >= len(cur):
                        if v:
                            raise HypafilterError(
                                f"shim: the pinned hf_config in {self.pin} predates its control word; unload the "
                                "shim (hypafilter undeploy) and deploy again"
                            )
                        continue
                    if v is not None:
                        struct.pack_into("=I", cur, 4 * shared.C[name], int(v) & 0xFFFFFFFF)
                m.write(bytes(cur))

    def set_generation(self, generation: int) -> None:
        """Only hf_config's generation, through the bpf() syscall (no helper process): the policy sync service's
        fail safe makes every tag stale with it within a millisecond."""
        with PinnedArray(self.pin / shared.HF_MAP_CONFIG) as m:
            m.set_word(shared.C["HF_CFG_GENERATION"], generation)

    def stats(self, reset: bool = False) -> dict:
        out = self._run("stats", ["stats", "--pin", str(self.pin)] + (["--reset"] if reset else []))
        return json.loads(out)

    def dump(self, count: int) -> list[int]:
        return [int(x) for x in self._run("dump", ["dump", "--pin", str(self.pin), "--count", str(count)]).split()]


def mark_value(k: int, action: int, mirror: bool = False) -> int:
    """The value the shim computes (ARCHITECTURE §5); k = 0 means no valid hardware metadata. `mirror`: a mirror
    copy (reason 4), whose value has HF_MARK_MIRROR in the action nibble (0x5 copy of an ACCEPT, 0x6 of a DROP)."""
    if k == shared.HF_K_NONE:
        return 0
    return (
        (k << shared.HF_MARK_K_SHIFT) | (action & shared.HF_MARK_ACTION_MASK) | (shared.HF_MARK_MIRROR if mirror else 0)
    )


def tag_frame(frame: bytes, meta: int) -> bytes:
    """`frame` with the in-band tag inserted after the source MAC, as the NIC delivers it to the host."""
    tag = shared.HF_TAG_ETHERTYPE.to_bytes(2, "big") + meta.to_bytes(8, "big")
    return frame[:12] + tag + frame[12:]
