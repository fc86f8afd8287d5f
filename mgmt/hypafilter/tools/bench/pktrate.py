"""Measures the host's per-packet netfilter cost: a bridged namespace firewall, a C frame blaster, receive counters.

Topology (all created fresh, removed afterwards): `<tag>-s` (sender, veth s0) ─ `<tag>-f` (f0 and f1 in bridge br0,
br_netfilter on, the rules under test in FORWARD) ─ `<tag>-r` (receiver, veth r0). The blaster sends prebuilt UDP
frames out of s0 as fast as AF_PACKET takes them; the rate is what reaches r0. On veth the whole path runs in the
sender's softirq context, so the measured rate is the CPU cost of sender + bridge + netfilter per packet.

For hybrid runs the hardware's mark is carried in the IPv4 ID field and copied into skb->mark by one nftables rule
at bridge prerouting (`meta mark set @nh,32,32 >> 16`, DF and offset are 0), standing in for the shim's TC program,
whose cost is of the same kind (one map lookup and a store per packet).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import struct
import time
from collections.abc import Iterable
from pathlib import Path

from hypafilter import netns
from hypafilter.errors import HypafilterError
from hypafilter.iptables.writer import BUILTIN_FILTER_CHAINS, Restore, body_of
from hypafilter.paths import build_lock

HERE = Path(__file__).resolve().parent
BLAST_SRC = HERE / "hf_blast.c"
DST_MAC = bytes.fromhex("020000000002")
SRC_MAC = bytes.fromhex("020000000001")
PAYLOAD = b"hf-xy"  # five bytes, as in the paper; never contains "BAD"
MARK_RULE = "meta mark set @nh,32,32 >> 16"


def build_cached(src: Path, build_dir: Path, compiler: list[str], suffix: str = "", libs: tuple[str, ...] = ()) -> Path:
    """`src` compiled with `compiler` (its command before the source and -o; `libs` after them) into build_dir,
    cached by the hash of the source and the command: <stem>-<hash><suffix>."""
    if shutil.which(compiler[0]) is None:
        raise HypafilterError(f"{compiler[0]} is needed to build {src.name} (apt-get install {compiler[0]})")
    text = src.read_bytes()
    # The source's own quoted includes beside it (hf_sender.h) are part of what is built.
    local = [src.parent / m.decode() for m in re.findall(rb'#include "([^"/]+)"', text)]
    text += b"".join(h.read_bytes() for h in local if h.exists())
    digest = hashlib.sha256(text + " ".join([*compiler, *libs]).encode()).hexdigest()[:12]
    out = build_dir / f"{src.stem.removesuffix('.bpf')}-{digest}{suffix}"
    if out.exists():
        return out
    # One builder at a time (bench runs and pytest-xdist workers build the same senders): the others wait and find it
    # built; the file appears whole or not at all (written under a temporary name, then renamed).
    with build_lock(build_dir / ".bench-build.lock"):
        if not out.exists():
            tmp = out.with_name(f".{out.name}.{os.getpid()}")
            try:
                netns.run([*compiler, str(src), "-o", str(tmp), *libs], timeout=None)
            except netns.CommandError as e:
                tmp.unlink(missing_ok=True)
                raise HypafilterError(f"building {src.name} failed: {e}") from e
            tmp.replace(out)
    return out


def build_blaster(build_dir: Path) -> Path:
    """hf_blast.c compiled with gcc into build_dir (cached by the source's and the command's hash)."""
    return build_cached(BLAST_SRC, build_dir, ["gcc", "-O2", "-Wall"])


def _csum(data: bytes) -> int:
    s = sum(struct.unpack(f"!{len(data) // 2}H", data))
    s = (s & 0xFFFF) + (s >> 16)
    s = (s & 0xFFFF) + (s >> 16)
    return ~s & 0xFFFF


def udp_frame(src: int, dst: int, sport: int, dport: int, ip_id: int = 0) -> bytes:
    """One Ethernet/IPv4/UDP frame with the bench payload; ip_id carries the hybrid mark (0 = none)."""
    udp_len = 8 + len(PAYLOAD)
    ip = struct.pack("!BBHHHBBHII", 0x45, 0, 20 + udp_len, ip_id & 0xFFFF, 0, 64, 17, 0, src, dst)
    ip = ip[:10] + struct.pack("!H", _csum(ip)) + ip[12:]
    # UDP checksum 0 (allowed for IPv4): the receiver never verifies it and it keeps the build fast.
    udp = struct.pack("!HHHH", sport, dport, udp_len, 0) + PAYLOAD
    return DST_MAC + SRC_MAC + b"\x08\x00" + ip + udp


def udp6_frame(src: int, dst: int, sport: int, dport: int, src_mac: bytes = SRC_MAC) -> bytes:
    """One Ethernet/IPv6/UDP frame with the bench payload (128-bit addresses; the UDP checksum IPv6 requires)."""
    udp_len = 8 + len(PAYLOAD)
    s16, d16 = src.to_bytes(16, "big"), dst.to_bytes(16, "big")
    udp = struct.pack("!HHHH", sport, dport, udp_len, 0) + PAYLOAD
    pseudo = s16 + d16 + struct.pack("!IxxxB", udp_len, 17) + udp
    c = _csum(pseudo + b"\0" * (len(pseudo) & 1)) or 0xFFFF
    udp = udp[:6] + struct.pack("!H", c) + udp[8:]
    ip = struct.pack("!IHBB", 6 << 28, udp_len, 17, 64) + s16 + d16
    return DST_MAC + src_mac + b"\x86\xdd" + ip + udp


def write_frames(path: Path, rows: Iterable[tuple[int, int, int, int, int]], family: int = 4) -> int:
    """Writes (src, dst, sport, dport, mark) rows as blaster records; returns the number of frames. `family` 6:
    IPv6 frames (128-bit addresses, no mark)."""
    n = 0
    with open(path, "wb") as f:
        for src, dst, sport, dport, mark in rows:
            if family == 6:
                fr = udp6_frame(int(src), int(dst), int(sport), int(dport))
            else:
                fr = udp_frame(int(src), int(dst), int(sport), int(dport), int(mark))
            f.write(struct.pack("<H", len(fr)) + fr)
            n += 1
    return n


class RateBench:
    """Creates the three namespaces on enter and removes them on exit (also after errors)."""

    def __init__(self, blaster: Path, tag: str | None = None, backend: str = "nft", family: int = 4):
        """`backend`: the iptables back end the rules are loaded with, "nft" (iptables-nft, the default tools) or
        "legacy" (iptables-legacy: the x_tables interpreter, whose tcp/udp matches drop a truncated header).
        `family` 6: the rules under test are ip6tables' (br_netfilter hands the bridged IPv6 frames to them)."""
        if backend not in ("nft", "legacy"):
            raise HypafilterError(f"unknown iptables back end {backend!r} (nft or legacy)")
        self.blaster = blaster
        self.backend = backend
        self.family = family
        tool = "ip6tables" if family == 6 else "iptables"
        self.iptables = f"{tool}-legacy" if backend == "legacy" else tool
        self.tag = tag or f"hfb{os.getpid() % 100000}"
        self.ns_s, self.ns_f, self.ns_r = f"{self.tag}-s", f"{self.tag}-f", f"{self.tag}-r"

    def __enter__(self) -> RateBench:
        if os.geteuid() != 0:
            raise HypafilterError("the packet-rate bench needs root (network namespaces, netfilter)")
        try:
            self._up()
        except BaseException:
            self._down()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self._down()

    def _up(self) -> None:
        for ns in (self.ns_s, self.ns_f, self.ns_r):
            netns.add(ns)
            netns.run(["sysctl", "-qw", "net.ipv6.conf.all.disable_ipv6=1", "net.ipv6.conf.default.disable_ipv6=1"], ns)
            netns.run(["ip", "link", "set", "lo", "up"], ns)
        netns.veth("s0", self.ns_s, "f0", self.ns_f)
        netns.veth("r0", self.ns_r, "f1", self.ns_f)
        f = ["ip", "-n", self.ns_f]
        netns.run([*f, "link", "add", "br0", "type", "bridge"])
        for dev in ("f0", "f1"):
            netns.run([*f, "link", "set", dev, "master", "br0"])
            netns.run([*f, "link", "set", dev, "up"])
        netns.run([*f, "link", "set", "br0", "up"])
        netns.run(["ip", "-n", self.ns_s, "link", "set", "s0", "up"])
        netns.run(["ip", "-n", self.ns_r, "link", "set", "r0", "up"])
        # A static entry so that frames are forwarded to f1, not flooded; the bridge never learns DST_MAC.
        netns.run(["bridge", "fdb", "add", DST_MAC.hex(":"), "dev", "f1", "master", "static"], self.ns_f)
        netns.run(["sysctl", "-qw", "net.bridge.bridge-nf-call-iptables=1"], self.ns_f)
        if self.family == 6:
            netns.run(["sysctl", "-qw", "net.bridge.bridge-nf-call-ip6tables=1"], self.ns_f)

    def _down(self) -> None:
        for ns in (self.ns_s, self.ns_f, self.ns_r):
            netns.delete(ns)

    def reset_firewall(self) -> None:
        """Empty FORWARD (policy ACCEPT), no tool chains, no mark rule."""
        empty = Restore()
        for chain in BUILTIN_FILTER_CHAINS:
            empty.chain(chain, "ACCEPT")
        netns.run([f"{self.iptables}-restore"], self.ns_f, input=empty.text())
        netns.run(["nft", "delete", "table", "bridge", "hfbench"], self.ns_f, check=False)

    def load_restore(self, text: str, jump: str | None = None, marks: bool = False) -> float:
        """Loads iptables-restore text (flushing the filter table first); `jump` adds `-A FORWARD -j JUMP`.

        Returns the load time in seconds (the restore alone)."""
        self.reset_firewall()
        t0 = time.perf_counter()
        netns.run([f"{self.iptables}-restore", "--noflush"], self.ns_f, input=text)
        dt = time.perf_counter() - t0
        if jump:
            netns.run([self.iptables, "-A", "FORWARD", "-j", jump], self.ns_f)
        if marks:
            netns.run(
                [
                    "nft",
                    "add table bridge hfbench; add chain bridge hfbench pre { type filter hook prerouting priority -300; };"
                    f" add rule bridge hfbench pre {MARK_RULE}",
                ],
                self.ns_f,
            )
        return dt

    def _rx(self) -> int:
        out = netns.run(["ip", "-n", self.ns_r, "-s", "-j", "link", "show", "dev", "r0"])
        return int(json.loads(out)[0]["stats64"]["rx"]["packets"])

    def measure(self, frames: Path, seconds: float) -> dict:
        """Blasts `frames` for `seconds`; returns sent, received and the received packets per second."""
        rx0 = self._rx()
        res = json.loads(netns.run([str(self.blaster), "s0", str(frames), str(seconds)], self.ns_s, timeout=None))
        # Packets in flight are delivered within the blaster's last syscall, which ran in this context.
        received = self._rx() - rx0
        res["received"] = received
        res["pps"] = received / res["seconds"] if res["seconds"] > 0 else 0.0
        return res

    def switch(self, restore: str, prefix: str, old_prefix: str | None) -> float:
        """One atomic update like deploy's: the new generation's chains, the FORWARD jump moved to them and the old
        generation's chains removed, all in one `iptables-restore --noflush`. Returns its wall time in seconds."""
        if restore.rstrip().splitlines()[-1:] != ["COMMIT"]:
            raise HypafilterError("generated iptables-restore text does not end in COMMIT")
        doc = Restore().extend(body_of(restore)).insert("FORWARD", 1, ["-j", f"{prefix}MAIN"])
        if old_prefix:
            old = netns.run(["iptables", "-S"], self.ns_f).splitlines()
            chains = [ln.split()[1] for ln in old if ln.startswith(f"-N {old_prefix}")]
            doc.delete("FORWARD", ["-j", f"{old_prefix}MAIN"]).remove(chains)
        text = doc.text()
        t0 = time.perf_counter()
        netns.run(["iptables-restore", "--noflush"], self.ns_f, input=text)
        return time.perf_counter() - t0
