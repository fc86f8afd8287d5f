"""`hypafilter bench rate`: frames per second through the hybrid path and through the policy alone in iptables and nft.

The same frames (verify's probes: headers biased to the policy's boxes, or a ClassBench trace) leave the lab's sender
namespace three times, from the same C sender (`hf_blast.c`, "once" mode: sendmmsg batches, qdisc bypassed): through the lab's hybrid path (sender → NIC → firewall → receiver), then through the plain
namespace with the original policy loaded alone by `iptables-restore` (as verify loads its oracle), then with the
same policy rendered for nftables (`netfilter.nft`, strategy full, one base chain at the forward hook). Each run
counts what reaches the receiver, per frame, so the three verdicts of every frame are compared (`mismatches`).

Rates are wire frames per second: frames / (first send → the fast path has decided every frame and the last
delivered frame arrived). The hybrid sender keeps at most `window` frames ahead of what the fast path has decided
(its own counter, e.g. `EmuFast.decided`), so no queue overflows and no frame is lost to the measurement; the plain path
decides each frame inside the sender's own send call (veth → bridge → netfilter run in its softirq).

Targets slot in through FAST_PATHS: a fast path deploys the policy on the lab and reports decided wire frames and
how many of them it decided itself (hw_share).
"""

from __future__ import annotations

import json
import select
import shutil
import struct
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from hypafilter import netns
from hypafilter.config import Config
from hypafilter.errors import HypafilterError
from hypafilter.ir import Policy
from hypafilter.ops import deploy
from hypafilter.ops.lab import Lab
from hypafilter.ops.verify import (
    PACKET_OUTGOING,
    Probe,
    ProbeSpec,
    compare,
    drain,
    frame_id,
    hw_share,
    load_oracle,
    raw_socket,
    refuse_nondeterministic,
)
from hypafilter.paths import BUILD_ROOT
from hypafilter.targets.nic import NicClient
from hypafilter.tools.bench.pktrate import build_blaster

FIELDS = (
    "target",
    "frames",
    "hybrid_pps",
    "iptables_pps",
    "nft_pps",
    "speedup_vs_iptables",
    "speedup_vs_nft",
    "hw_share",
    "mismatches",
)
NFT_TABLE = "hfrate"  # the plain namespace's nft table while the nft run lasts (removed afterwards)


class EmuFast:
    """Fast path `emu`: the policy deployed on the lab's emulated NIC (deploy, cached build); decided frames are
    the core's PKTIN counter, hardware decisions its forward/drop counters."""

    name = "emu"

    def __init__(self, policy: Policy, config: Config, log: Callable[[str], None]):
        self.state = deploy.deploy(policy, config, target="emu", log=log)
        self.target = deploy.target_of(self.state, config)
        self.nic = NicClient(self.target.transport(self.state["nic"]))
        self.generation = self.state["generation"]

    def decided(self) -> int:
        return self.nic.read("PKTIN")

    def counters(self) -> dict:
        return self.nic.counters()

    def close(self) -> None:
        self.nic.close()


class XdpFast:
    """Fast path `xdp`: the policy deployed as the XDP program on the firewall's wire-facing ports of the lab's xdp
    topology; decided frames are its PKTIN counter (read through the loader, a process per read)."""

    name = "xdp"

    def __init__(self, policy: Policy, config: Config, log: Callable[[str], None]):
        self.state = deploy.deploy(policy, config, target="xdp", log=log)
        self.target = deploy.target_of(self.state, config)
        self.generation = self.state["generation"]

    def decided(self) -> int:
        return int(self.counters()["PKTIN"])

    def counters(self) -> dict:
        out = self.target.counters(self.state["nic"])
        out.pop("HITS", None)
        return out

    def close(self) -> None:
        pass


FAST_PATHS = {"emu": EmuFast, "xdp": XdpFast}


@dataclass
class Run:
    got: dict[int, list[bytes]]
    seconds: float

    def pps(self, frames: int) -> float:
        return round(frames / self.seconds, 1) if self.seconds > 0 else 0.0


def _read(rx, got: dict[int, list[bytes]]) -> float | None:
    """Everything waiting on the receiver socket into `got`; the time of the last frame read, if any."""
    last = None
    while True:
        try:
            data, addr = rx.recvfrom(65536)
        except BlockingIOError:
            return last
        if addr[2] == PACKET_OUTGOING:
            continue
        uid = frame_id(data)
        if uid is not None:
            got.setdefault(uid, []).append(data)
            last = time.perf_counter()


def _run(
    ns: str,
    ifname: str,
    rx,
    blaster: Path,
    frames_file: Path,
    n: int,
    decided: Callable[[], int] | None,
    window: int,
    quiet: float = 0.3,
) -> Run:
    """Send every frame of `frames_file` once from `ifname` in `ns` (the C sender, sendmmsg batches) and capture at
    `rx`. With `decided` (a counter of the path's decided frames) the sender never gets more than `window` frames
    ahead of it; the run ends when every frame is decided and the receiver has been quiet for `quiet` seconds."""
    got: dict[int, list[bytes]] = {}
    drain(rx)
    base = decided() if decided else 0
    done = 0
    proc = netns.popen(
        [str(blaster), ifname, str(frames_file), "once"],
        ns,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        if proc.stdout.readline().strip() != "start":
            raise HypafilterError(f"the frame sender did not start: {proc.stderr.read()[-500:]}")
        t0 = time.perf_counter()
        t_end = t0
        if decided:
            proc.stdin.write(f"{window}\n")
            proc.stdin.flush()
        else:
            proc.stdin.close()
        while proc.poll() is None:
            if decided:
                t_end = _read(rx, got) or t_end
                done = decided() - base
                try:
                    proc.stdin.write(f"{done + window}\n")
                    proc.stdin.flush()
                except BrokenPipeError:
                    break
            else:
                r, _, _ = select.select([rx], [], [], 0.005)
                if r:
                    t_end = _read(rx, got) or t_end
        proc.wait()
        if proc.returncode != 0:
            raise HypafilterError(f"the frame sender failed: {proc.stderr.read()[-500:]}")
        report = json.loads(proc.stdout.read())
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for f in (proc.stdin, proc.stdout, proc.stderr):
            try:
                f.close()
            except (OSError, ValueError):
                pass
    if report["sent"] != n:
        raise HypafilterError(f"the frame sender sent {report['sent']} of {n} frames")
    t_decided = t0 + report["seconds"]
    if decided:
        deadline = time.perf_counter() + 60.0
        while done < n and time.perf_counter() < deadline:
            t_end = _read(rx, got) or t_end
            done = decided() - base
        if done < n:
            raise HypafilterError(f"the fast path decided {done} of {n} frames within 60 s")
        t_decided = max(t_decided, time.perf_counter())
    last = time.perf_counter()
    while time.perf_counter() - last < quiet:
        r, _, _ = select.select([rx], [], [], quiet / 4)
        if r:
            t = _read(rx, got)
            if t:
                t_end = last = t
    return Run(got, max(t_decided, t_end) - t0)


def nft_text(policy: Policy, config: Config) -> str:
    """The policy alone for nftables: the full strategy's chains and one base chain at the forward hook."""
    from hypafilter.analysis.plan import build_plan
    from hypafilter.netfilter.nft import to_nft

    prefix = NFT_TABLE.upper() + "_"
    body = to_nft(build_plan(policy, config, strategy="full"), "full", prefix, table=NFT_TABLE)
    hook = (
        f"table ip {NFT_TABLE} {{\n\tchain forward {{\n\t\ttype filter hook forward priority filter; policy accept;\n"
        f"\t\tjump {prefix}MAIN\n\t}}\n}}\n"
    )
    return body + hook


def _empty_filter(ns: str, table: str) -> None:
    netns.run(
        ["iptables-restore", "-w"],
        ns,
        input=f"*{table}\n:INPUT ACCEPT [0:0]\n:FORWARD ACCEPT [0:0]\n:OUTPUT ACCEPT [0:0]\nCOMMIT\n",
    )


def rate(
    policy: Policy,
    config: Config,
    target: str = "emu",
    frames: int = 20000,
    seed: int = 1,
    trace: str | None = None,
    malformed: float = 0.0,
    window: int = 2048,
    log: Callable[[str], None] = lambda s: None,
) -> dict:
    """Deploy on `target`, send the same frames through the three paths, compare them per frame; the report."""
    if target not in FAST_PATHS:
        raise HypafilterError(f"bench rate: unknown target '{target}' (choose from {', '.join(FAST_PATHS)})")
    refuse_nondeterministic(policy)
    lab = Lab(deploy.LAB_NAME, target=target)
    if not lab.status()["complete"]:
        log(f"lab {lab.name} is not (fully) up for target {target}: bringing it up")
        lab.up()
    blaster = build_blaster(BUILD_ROOT / "bench")
    fast = FAST_PATHS[target](policy, config, log)
    work = Path(tempfile.mkdtemp(prefix="hf-rate-"))
    try:
        probes: list[Probe] = ProbeSpec(frames, seed=seed, trace=trace, malformed=malformed).probes(
            policy, fast.generation
        )
        frames_file = work / "frames.bin"
        with open(frames_file, "wb") as f:
            for p in probes:
                f.write(struct.pack("<H", len(p.frame)) + p.frame)
        n = len(probes)
        for ns in (lab.ns_fw, lab.ns_plain):
            netns.run(["sysctl", "-qw", "net.bridge.bridge-nf-filter-vlan-tagged=1"], ns)
        rx = {"hybrid": raw_socket(lab.ns_recv, "hyb0"), "plain": raw_socket(lab.ns_recv, "plain0")}
        try:
            log(f"hybrid ({target}): {n} frames")
            before = fast.counters()
            hybrid = _run(lab.ns_send, "hyb0", rx["hybrid"], blaster, frames_file, n, fast.decided, window)
            after = fast.counters()
            delta = {k: after[k] - before.get(k, 0) for k in after if isinstance(after[k], int)}
            log("plain path, iptables")
            load_oracle(lab.ns_plain, policy, config.table, config.unfilterable)
            ipt = _run(lab.ns_send, "plain0", rx["plain"], blaster, frames_file, n, None, window)
            nft, nft_error = None, None
            try:
                text = nft_text(policy, config)
            except HypafilterError as e:
                nft_error = str(e)
            if nft_error is None:
                log("plain path, nft")
                _empty_filter(lab.ns_plain, config.table)
                try:
                    netns.run(["nft", "-f", "-"], lab.ns_plain, input=text)
                    nft = _run(lab.ns_send, "plain0", rx["plain"], blaster, frames_file, n, None, window)
                finally:
                    netns.run(["nft", "delete", "table", "ip", NFT_TABLE], lab.ns_plain, check=False)
                    load_oracle(lab.ns_plain, policy, config.table, config.unfilterable)
        finally:
            for s in rx.values():
                s.close()
    finally:
        fast.close()
        shutil.rmtree(work, ignore_errors=True)
    vs_ipt = compare(probes, {"hybrid": hybrid.got, "plain": ipt.got})
    vs_nft = compare(probes, {"hybrid": hybrid.got, "plain": nft.got}) if nft else None
    mismatched = _mismatched(probes, hybrid.got, ipt.got) | (_mismatched(probes, hybrid.got, nft.got) if nft else set())
    report = {
        "target": target,
        "frames": n,
        "hybrid_pps": hybrid.pps(n),
        "iptables_pps": ipt.pps(n),
        "nft_pps": nft.pps(n) if nft else None,
        "speedup_vs_iptables": round(ipt.seconds / hybrid.seconds, 3) if hybrid.seconds else None,
        "speedup_vs_nft": round(nft.seconds / hybrid.seconds, 3) if nft and hybrid.seconds else None,
        "hw_share": hw_share(delta) or 0.0,
        "mismatches": len(mismatched),
        "mismatches_vs_iptables": vs_ipt["mismatches"],
        "mismatches_vs_nft": vs_nft["mismatches"] if vs_nft else None,
        "nft_error": nft_error,
        "delivered": {
            "hybrid": sum(1 for p in probes if hybrid.got.get(p.uid)),
            "iptables": sum(1 for p in probes if ipt.got.get(p.uid)),
            "nft": sum(1 for p in probes if nft.got.get(p.uid)) if nft else None,
        },
        "seconds": {"hybrid": round(hybrid.seconds, 3), "iptables": round(ipt.seconds, 3)}
        | ({"nft": round(nft.seconds, 3)} if nft else {}),
        "nic": {k: v for k, v in delta.items() if v},
        "examples": vs_ipt["examples"][:5],
        "policy_hash": policy.policy_hash(),
        "seed": seed,
        "trace": trace,
    }
    return report


def _mismatched(probes: list[Probe], a: dict[int, list[bytes]], b: dict[int, list[bytes]]) -> set[int]:
    """Ids of frames delivered on one path and not the other, or delivered with other bytes."""
    out = set()
    for p in probes:
        x, y = a.get(p.uid, []), b.get(p.uid, [])
        if bool(x) != bool(y) or (x and x[0] != y[0]):
            out.add(p.uid)
    return out
