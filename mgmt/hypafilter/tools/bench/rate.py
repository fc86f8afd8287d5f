"""`hypafilter bench rate`: frames per second through the hybrid path and through the policy alone in iptables and nft.

The same frames (verify's probes: headers biased to the policy's boxes, or a ClassBench trace) leave the lab's sender
namespace through each path, from the same C sender (`hf_blast.c`: sendmmsg batches of pre-built frames on an
AF_PACKET socket with PACKET_QDISC_BYPASS; a frame the device refuses is sent again, never skipped), or with
`sender="live"` (target xdp) from `hf_live.c`: BPF_PROG_TEST_RUN with BPF_F_TEST_XDP_LIVE_FRAMES runs `hf_live.bpf.c`,
which writes the same frames into page-pool frames and sends them with XDP_TX into the sender's veth, so that they
reach the firewall's wire end as xdp_frames, as from a native-XDP NIC driver (no skb; veth's ndo_xdp_xmit needs the
receiving end to have NAPI: the hybrid's wire end has its XDP program, the plain path's gets `hf_pass.bpf.c` while
the bench runs). Every pass checks that the firewall's wire end received every frame sent (its rx counter; a frame a
full veth ring dropped fails the run). Two passes:

1. **Correctness** (every frame once, captured per frame at the receiver): the lab's hybrid path (sender → fast path
   → firewall → receiver), then the plain namespace with the original policy loaded alone by `iptables-restore` (as
   verify loads its oracle), then the same policy rendered for nftables (`netfilter.nft`, strategy full, one base
   chain at the forward hook). The three verdicts of every frame are compared (`mismatches`). The hybrid sender of
   the emu target keeps at most `window` frames ahead of the NIC's decided counter (the emulator is slower than the
   sender). On the xdp target the sender keeps at most CAPTURE_WINDOW frames ahead of each path's wire-end rx counter
   (unpaced, it overruns the receiver's capture under load).
2. **Rate** (`repeats` rounds; in each, every path for `seconds`, the sender cycling through the frames, pinned to
   `cpu`): no per-frame capture; frames sent (= decided: nothing is lost, a refused frame is resent), frames
   delivered from the receiver interface's rx counter (checked against the correctness pass: the delivered count
   must be what the per-frame verdicts predict for the frames sent), the fast path's own counters, and CPU time.
   On veth the whole path (sender's syscall, veth, XDP or bridge + netfilter, the receiver's stack) runs in the
   sender's softirq context on its CPU, so a path's CPU time is the sender's user + system time (tick accounting
   charges softirq work done in its context to it) plus that CPU's ksoftirqd's. The round also runs a **sink**:
   the same sender into a veth whose peer only drops the frames (the receive stack's first check, dst MAC not its
   own). Figures per path (medians over the rounds):
   - `pps`: frames per wall-clock second (what the other load on the machine leaves us: noisy);
   - `cpu_ns`: CPU ns per frame of the whole path; `fw_ns` = `cpu_ns` − the sink's `cpu_ns`: the firewall side's
     own cost per frame (sender and veth hand-off subtracted); `fw_pps` = 1e9 / `fw_ns`;
   speedups: wall (`speedup_vs_*`) and firewall side (`fw_speedup_vs_*`), each the median over the rounds of the
   per-round ratio.

`established`: the frames are the trace's TCP (flags ACK) and UDP headers as established connections: before
anything is sent, conntrack entries (ESTABLISHED, SEEN_REPLY, ASSURED) for every flow are created with `conntrack
-I` in the firewall and the plain namespace (conntrack -F first), their TCP entries marked liberal as the flow sync
service marks the ones it offloads (the XDP program decides established TCP only on such entries, docs/xdp.md), and
`nf_conntrack_tcp_be_liberal=1` is set in both, so that the plain path tracks no window either. For a conntrack-first policy (ESTABLISHED,RELATED accept as the first rule) every path then
accepts every frame through its conntrack lookup.

Targets slot in through FAST_PATHS: a fast path deploys the policy on the lab and reports decided wire frames and
how many of them it decided itself (hw_share).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import select
import shutil
import statistics
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
from hypafilter.netfilter import ipset
from hypafilter.ops import deploy
from hypafilter.ops.lab import Lab
from hypafilter.ops.verify import (
    PACKET_OUTGOING,
    FrameGen,
    Probe,
    ProbeSpec,
    build_frame,
    compare,
    drain,
    frame_id,
    hw_share,
    load_oracle,
    raw_socket,
    read_trace,
    refuse_nondeterministic,
    spoofed_source,
)
from hypafilter.paths import BUILD_ROOT
from hypafilter.targets.nic import NicClient
from hypafilter.tools.bench import attack as attack_mod
from hypafilter.tools.bench import pktrate
from hypafilter.tools.bench.ctflows import open_flows
from hypafilter.tools.bench.pktrate import build_blaster

SENDERS = ("packet", "live")  # hf_blast.c (AF_PACKET, the default) or hf_live.c (xdp_frames, target xdp)
CAPTURE_WINDOW = 512  # xdp: frames the sender may be ahead of the wire end's rx counter in the correctness pass

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
)  # the short report (issue #13's fields); --json adds the rest
NFT_TABLE = "hfrate"  # the plain namespace's nft table while the nft run lasts (removed afterwards)
SINK = ("hfsink0", "hfsink1")  # the sink's veth pair, both ends in the sender's namespace while the bench runs
SINK_MAC = bytes.fromhex("02484600ff01")  # the sink end's own address; frames go to the lab's DST_MAC, not to it
CT_COMPLETE_SECONDS = 300.0  # emu: how long the bench waits for the conntrack membership structure's COMPLETE


class EmuFast:
    """Fast path `emu`: the policy deployed on the lab's emulated NIC (deploy, cached build); decided frames are
    the core's PKTIN counter, hardware decisions its forward/drop counters."""

    name = "emu"
    counted = False  # the emulator (a user-space process) is slower than the sender: only the paced pass

    def __init__(self, policy: Policy, config: Config, log: Callable[[str], None], v6=None):
        if policy.ipsets_file:  # --ipsets: the sets in the lab's firewall before the policy that reads them
            ipset.restore(deploy.NS_FW, policy.ipsets_text)
        self.state = deploy.deploy(policy, config, target="emu", log=log, v6=v6)
        self.target = deploy.target_of(self.state, config)
        self.nic = NicClient(self.target.transport(self.state["nic"]))
        self.generation = self.state["generation"]
        self.ct_complete_after = self._await_new_flows(log)

    def _await_new_flows(self, log: Callable[[str], None]) -> float | None:
        """[ctm] Seconds from the end of deploy until the conntrack membership structure is COMPLETE (a miss is NEW:
        ct 3), when the deployment decides new flows; None when it does not (or its flow sync service did not
        start). The service is ready before its clear's sweep is over (9-44 s on an 11,100-entry core, which clocks
        for work only), and frames meanwhile go to the host (safe): the bench measures the fast path once it
        decides."""
        fs = self.state.get("flowsync") or {}
        if fs.get("new_flows") != "decided" or any(d.startswith("flowsync") for d in self.state.get("degraded", [])):
            return None
        t0 = time.monotonic()
        while not self.nic.ctm_counters()["complete"]:
            if time.monotonic() - t0 > CT_COMPLETE_SECONDS:
                log(f"the conntrack membership structure not COMPLETE after {CT_COMPLETE_SECONDS:g} s: measuring")
                return None
            time.sleep(0.2)
        log(f"the conntrack membership structure COMPLETE {time.monotonic() - t0:.1f} s after deploy")
        return round(time.monotonic() - t0, 2)

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
    counted = True  # runs in the sender's softirq context: the unpaced, counted rate pass

    def __init__(self, policy: Policy, config: Config, log: Callable[[str], None], v6=None):
        if policy.ipsets_file:  # --ipsets: the sets in the lab's firewall before the policy that reads them
            ipset.restore(deploy.NS_FW, policy.ipsets_text)
        self.state = deploy.deploy(policy, config, target="xdp", log=log, v6=v6)
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


@dataclass(frozen=True)
class Sender:
    """A frame sender program and its batch size in the rate pass; `wire` (role, interface) per sending interface:
    where the path's first receiver counts what arrived."""

    name: str
    argv0: tuple[str, ...]
    batch: int

    def argv(self, ifname: str, frames_file: Path, what: str, cpu: int | None = None) -> list[str]:
        out = [*self.argv0, ifname, str(frames_file), what]
        return out + [str(self.batch), str(cpu)] if cpu is not None else out


LIVE_SRC = Path(__file__).resolve().parent / "hf_live.c"
LIVE_BPF_SRC = Path(__file__).resolve().parent / "hf_live.bpf.c"
PASS_SRC = Path(__file__).resolve().parent / "hf_pass.bpf.c"
BPF_CC = ["clang", "-O2", "-target", "bpf", "-c"]


def build_sender(name: str, build_dir: Path) -> Sender:
    """The sender `name` (SENDERS) built into build_dir."""
    if name == "packet":
        return Sender(name, (str(build_blaster(build_dir)),), 256)
    if name == "live":
        exe = pktrate.build_cached(LIVE_SRC, build_dir, ["gcc", "-O2", "-Wall"], libs=("-lbpf",))
        obj = pktrate.build_cached(LIVE_BPF_SRC, build_dir, [*BPF_CC, "-g"], suffix=".o")  # BTF: its maps
        # 64: the kernel's default batch; a batch's frames wait in the peer's NAPI ring (256) until it ends.
        return Sender(name, (str(exe), str(obj)), 64)
    raise HypafilterError(f"bench rate: unknown sender '{name}' (choose from {', '.join(SENDERS)})")


XSK_SRC = Path(__file__).resolve().parent / "hf_xsk.c"


def build_xsk(build_dir: Path) -> Sender:
    """hf_xsk.c (AF_XDP copy mode) built into build_dir: measured against the bench's senders (tools/bench/senders.py),
    not one of them."""
    return Sender("xsk", (str(pktrate.build_cached(XSK_SRC, build_dir, ["gcc", "-O2", "-Wall"])),), 256)


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
    sender: Sender,
    frames_file: Path,
    n: int,
    decided: Callable[[], int] | None,
    window: int,
    wire: tuple[str, str],
    quiet: float = 0.3,
) -> Run:
    """Send every frame of `frames_file` once from `ifname` in `ns` (the C sender, sendmmsg batches) and capture at
    `rx`. With `decided` (a counter of the path's decided frames) the sender never gets more than `window` frames
    ahead of it; the run ends when every frame is decided and the receiver has been quiet for `quiet` seconds.
    `wire` (namespace, interface): the path's first receiver, whose rx counter must grow by `n`."""
    got: dict[int, list[bytes]] = {}
    drain(rx)
    wire0 = _rx_packets(*wire)
    base = decided() if decided else 0
    done = 0
    proc = netns.popen(
        sender.argv(ifname, frames_file, "once"),
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
        netns.reap(proc)
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
    arrived = _rx_packets(*wire) - wire0
    if arrived != n:
        raise HypafilterError(
            f"{wire[1]} in {wire[0]} received {arrived} frames for the {n} sent (frames lost, or others on the wire)"
        )
    return Run(got, max(t_decided, t_end) - t0)


def nft_text(
    policy: Policy, config: Config, blocklist: list[tuple[int, int]] = (), v6=None, hotdrop6=None, blocklist6=()
) -> str:
    """The policy alone for nftables: the full strategy's chains and one base chain at the forward hook; with
    `blocklist` (networks) an interval set of them and a rule dropping their sources ahead of the policy's chains.
    With `v6` (netfilter.ip6.V6Policy) its filter table too, in a table of family ip6 of the same name (nft_text6,
    `hotdrop6` its `hotdrop`, `blocklist6` its `blocklist`)."""
    from hypafilter.analysis.plan import build_plan
    from hypafilter.netfilter.nft import to_nft

    prefix = NFT_TABLE.upper() + "_"
    body = to_nft(build_plan(policy, config, strategy="full"), "full", prefix, family="ip", table=NFT_TABLE)
    decl, drop = attack_mod.nft_blocklist(blocklist) if blocklist else ("", "")
    hook = (
        f"table ip {NFT_TABLE} {{\n{decl}\tchain forward {{\n\t\ttype filter hook forward priority filter; policy accept;\n"
        + (f"\t\t{drop}\n" if drop else "")
        + f"\t\tjump {prefix}MAIN\n\t}}\n}}\n"
    )
    return body + hook + (nft_text6(v6, config, hotdrop6, blocklist6) if v6 is not None else "")


def nft_text6(v6, config: Config, hotdrop=None, blocklist: list[tuple[int, int]] = ()) -> str:
    """The IPv6 side alone for nftables: its ip6tables policy (the front end's reading of the file, `v6.ir`) as the
    full strategy's chains in table `ip6 NFT_TABLE`, jumped to from a base chain at the forward hook; ip6tables'
    hotdrops (a tcp, udp, icmp6 or multiport match drops a frame whose transport header is short) as guards, which
    only frames with fewer than 20 bytes of transport header meet (netfilter.nft.to_nft's `fast_prefix`), for the
    matches in `hotdrop` (default: every one, as x_tables runs them; the bench passes xt_matches6 of its oracle's
    namespace, the matches the loaded ip6tables policy runs as xtables matches). `blocklist` (IPv6 networks): an
    interval set of them and a rule dropping their sources ahead of the policy's chains, as nft_text's. HypafilterError
    (the bench's `nft_error`) when the file has more than its filter table, or matches nft text cannot express."""
    from hypafilter.analysis.plan import build_plan
    from hypafilter.netfilter.nft import to_nft

    if v6.kind != "policy" or v6.ir is None:
        raise HypafilterError(f"the IPv6 side {v6.source} is not an ip6tables policy the front end read: no nft form")
    other = [t for t in v6.tables if t != "filter"]
    if other:
        raise HypafilterError(
            f"{v6.source}: tables {', '.join(other)} beside filter have no nft form in the bench (its filter table only)"
        )
    prefix = NFT_TABLE.upper() + "_"
    plan = build_plan(v6.ir, config, strategy="full")
    # the rules with ip6tables' hotdrop guards for frames a match can drop, without them for the others (to_nft)
    body = to_nft(
        plan,
        "full",
        prefix,
        family="ip6",
        table=NFT_TABLE,
        fast_prefix=NFT_TABLE.upper() + "F_",
        **({"hotdrop": hotdrop} if hotdrop is not None else {}),
    )
    decl, drop = attack_mod.nft_blocklist(blocklist, 6) if blocklist else ("", "")
    hook = (
        f"table ip6 {NFT_TABLE} {{\n{decl}\tchain forward {{\n\t\ttype filter hook forward priority filter; "
        "policy accept;\n" + (f"\t\t{drop}\n" if drop else "") + f"\t\tjump {prefix}ENTRY\n\t}}\n}}\n"
    )
    return body + hook


def _empty_filter(ns: str, table: str, restore: str = "iptables-restore") -> None:
    netns.run(
        [restore, "-w"],
        ns,
        input=f"*{table}\n:INPUT ACCEPT [0:0]\n:FORWARD ACCEPT [0:0]\n:OUTPUT ACCEPT [0:0]\nCOMMIT\n",
    )


def _ksoftirqd_ticks(cpu: int) -> int:
    """User + system clock ticks of ksoftirqd/`cpu` so far (0 when there is none to read)."""
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            if (d / "comm").read_text().strip() != f"ksoftirqd/{cpu}":
                continue
            fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        return int(fields[11]) + int(fields[12])  # utime, stime (fields 14, 15 of stat)
    return 0


def _rx_packets(ns: str, ifname: str) -> int:
    out = netns.run(["ip", "-s", "-j", "link", "show", "dev", ifname], ns)
    return int(json.loads(out)[0]["stats64"]["rx"]["packets"])


SINK_SRC = Path(__file__).resolve().parent / "hf_sink.bpf.c"


def build_sink(build_dir: Path) -> Path:
    """hf_sink.bpf.c compiled with clang into build_dir (cached by the source's and the command's hash)."""
    return pktrate.build_cached(SINK_SRC, build_dir, ["clang", "-O2", "-target", "bpf", "-c"], suffix=".o")


def _xdp_drop(ns: str, ifname: str, obj: Path | None) -> None:
    """Attach the XDP program obj (the sink, or hf_pass) to `ifname`, or take it off (None)."""
    if obj is None:
        netns.run(["ip", "-n", ns, "link", "set", "dev", ifname, "xdp", "off"], check=False)
    else:
        netns.run(["ip", "-n", ns, "link", "set", "dev", ifname, "xdp", "obj", str(obj), "sec", "xdp"])


def _sink_up(ns: str, obj: Path) -> None:
    """The sink: a veth pair in the sender's namespace; the far end drops every frame in XDP."""
    _sink_down(ns)
    netns.run(["ip", "-n", ns, "link", "add", SINK[0], "type", "veth", "peer", "name", SINK[1]])
    netns.run(["ip", "-n", ns, "link", "set", SINK[1], "address", SINK_MAC.hex(":")])
    for ifname in SINK:
        netns.offloads_off(ifname, ns)
        netns.run(["ip", "-n", ns, "link", "set", ifname, "up"])
    _xdp_drop(ns, SINK[1], obj)


def _sink_down(ns: str) -> None:
    netns.run(["ip", "-n", ns, "link", "del", SINK[0]], check=False)


@dataclass
class Count:
    """One rate run: frames sent (all decided), delivered at the receiver, wall and CPU seconds of the path."""

    sent: int
    delivered: int
    seconds: float
    cpu_seconds: float
    errors: int
    arrived: int  # at the path's first receiver (rx counter): must be `sent`

    @property
    def pps(self) -> float:
        return self.sent / self.seconds if self.seconds > 0 else 0.0

    @property
    def cpu_ns(self) -> float:
        return 1e9 * self.cpu_seconds / self.sent if self.sent else 0.0


def _count(
    ns: str,
    ifname: str,
    rx: tuple[str, str],
    sender: Sender,
    frames_file: Path,
    seconds: float,
    cpu: int,
    wire: tuple[str, str],
) -> Count:
    """The sender cycling through `frames_file` out of `ifname` for `seconds`; `rx` (namespace, interface): where
    delivered frames are counted; `wire`: the path's first receiver (where every frame sent must arrive)."""
    tick = os.sysconf("SC_CLK_TCK")
    rx0 = _rx_packets(*rx)
    w0 = _rx_packets(*wire)
    k0 = _ksoftirqd_ticks(cpu) if cpu >= 0 else 0
    out = netns.run(sender.argv(ifname, frames_file, f"{seconds:g}", cpu), ns, timeout=None)
    k1 = _ksoftirqd_ticks(cpu) if cpu >= 0 else 0
    rep = json.loads(out)
    # Frames still in a NAPI ring or backlog when the sender returned are processed within milliseconds.
    time.sleep(0.05)
    return Count(
        rep["sent"],
        _rx_packets(*rx) - rx0,
        rep["seconds"],
        rep["cpu_seconds"] + (k1 - k0) / tick,
        rep["errors"],
        _rx_packets(*wire) - w0,
    )


def _expected(accepted: list[bool], sent: int) -> int:
    """Frames the receiver gets when the sender sent `sent` frames cycling through frames with these verdicts."""
    n = len(accepted)
    return (sent // n) * sum(accepted) + sum(accepted[: sent % n])


ATTACKS = ("syn", "udp")


def attacker_pool(seed: int, attackers: int, family: int = 4) -> list[int]:
    """The `attackers` spoofed sources of attack_probes (the same seed gives the same pool). `family` 6: each IPv4
    pick mapped into IPv6 as the ClassBench mapping maps addresses (tools.classbench6: 2001:db8:(a >> 16):(a &
    0xffff):<64 random bits>), so the spoofed sources spread over the space the mapped policy's rules name."""
    rng = random.Random(seed)
    pool = [spoofed_source(rng) for _ in range(attackers)]
    if family == 6:
        from hypafilter.tools.classbench6 import BASE

        return [BASE | (a << 64) | rng.getrandbits(64) for a in pool]
    return pool


def headers6(v6, mapped: list[dict] | None, count: int, rng: random.Random) -> list[dict]:
    """`count` IPv6 headers with 128-bit int addresses (as verify's IPv4 headers have them): the trace mapped into
    IPv6 (`mapped`, tools.classbench6.v6_trace) in turn, or verify6's aimed at the policy `v6`."""
    import ipaddress

    from hypafilter.ops.verify6 import Gen6

    gen = None if mapped else Gen6(v6, rng)
    out = []
    for i in range(count):
        h = dict(mapped[i % len(mapped)]) if mapped else gen.header()
        h["src"], h["dst"] = (int(ipaddress.IPv6Address(h[k])) for k in ("src", "dst"))
        out.append(h)
    return out


def attack_probes(
    policy: Policy,
    config: Config,
    trace: str | None,
    count: int,
    seed: int,
    shape: str,
    attackers: int,
    blocklist: list[tuple[int, int]] = (),
    blocklist_share: float = 0.5,
    v6=None,
    v6_headers: list[dict] | None = None,
) -> list[Probe]:
    """`count` attack frames (`shape`: TCP SYN or UDP). Of them, a share `blocklist_share` (when there is a
    `blocklist`: networks) comes from addresses in the blocklist's networks, aimed at any of the trace's (or the
    policy's boxes') destinations and ports (kind "blocklist_<shape>", last); the others (kind "attack_<shape>",
    first) come from a pool of `attackers` spoofed sources, aimed at the destinations and ports that `policy` (the
    policy without the blocklist) drops when the kernel reads the frame as NEW or INVALID (the plan's entry for ct 3
    is a DROP): a flood of new flows the policy refuses. `v6` (netfilter.ip6.V6Policy, without the blocklist): IPv6
    frames instead (kinds "v6_attack_<shape>", "v6_blocklist_<shape>"), aimed by its front end's reading `v6.ir`,
    headers from `v6_headers` (the trace mapped into IPv6) or verify6's, spoofed sources attacker_pool's family 6."""
    from hypafilter.analysis.decision import decision
    from hypafilter.analysis.plan import build_plan
    from hypafilter.ir import ACTION_DROP, PROTO_TCP, PROTO_UDP, Header
    from hypafilter.ir.box import CT_NONE
    from hypafilter.tools.bench.attack import address_in

    if shape not in ATTACKS or attackers < 1:
        raise HypafilterError(f"bench rate: --attack is one of {', '.join(ATTACKS)}, with --attackers at least 1")
    if not 0.0 <= blocklist_share <= 1.0:
        raise HypafilterError("bench rate: --blocklist-share must be a share between 0 and 1")
    rng = random.Random(seed)
    plan = build_plan(v6.ir if v6 is not None else policy, config)
    ranks = plan.addr_map.header if plan.addr_map is not None else (lambda h: h)
    if v6 is not None:
        import ipaddress

        from hypafilter.ops.verify import DST_MAC, ID_MAC_PREFIX
        from hypafilter.ops.verify6 import PREFIX, build6

        pool = attacker_pool(seed, attackers, 6)
        rows = headers6(v6, v6_headers, len(v6_headers) if v6_headers else 2000, rng)
        kind = PREFIX + "{}_" + shape

        def frame(uid: int, a: dict, payload: bytes) -> bytes:
            a = dict(a, src=str(ipaddress.IPv6Address(a["src"])), dst=str(ipaddress.IPv6Address(a["dst"])))
            return build6(uid, "normal", a, rng, [], DST_MAC, ID_MAC_PREFIX, payload=payload)

        def payload() -> bytes:
            return bytes(rng.getrandbits(8) for _ in range(rng.randint(0, 32)))
    else:
        pool = [spoofed_source(rng) for _ in range(attackers)]  # (attacker_pool's: the same draws)
        rows = read_trace(trace, 10**9, rng) if trace else None
        gen = FrameGen(policy, rng)
        kind, frame, payload = "{}_" + shape, build_frame, gen.payload
    proto, flags = (PROTO_TCP, 0x02) if shape == "syn" else (PROTO_UDP, 0)
    from_list = round(count * blocklist_share) if blocklist else 0
    out: list[Probe] = []
    for _ in range((count - from_list) * 100):
        if len(out) == count - from_list:
            break
        h = rows[rng.randrange(len(rows))] if rows else gen.header()
        a = dict(h, proto=proto, src=rng.choice(pool), sport=rng.randint(1024, 65535), flags=flags)
        hdr = Header(a["src"], a["dst"], proto, a["sport"], a["dport"], 0, 0, 0, flags, CT_NONE)
        if decision(plan, ranks(hdr))[2] != ACTION_DROP:
            continue
        uid = len(out) + 1
        out.append(Probe(uid, kind.format("attack"), frame(uid, a, payload() if shape == "udp" else b"")))
    if len(out) < count - from_list:
        raise HypafilterError(f"bench rate --attack: the policy drops too few of the destinations ({len(out)} found)")
    for _ in range(from_list):
        h = rows[rng.randrange(len(rows))] if rows else gen.header()
        src = address_in(blocklist[rng.randrange(len(blocklist))], rng)
        a = dict(h, proto=proto, src=src, sport=rng.randint(1024, 65535), flags=flags)
        uid = len(out) + 1
        out.append(Probe(uid, kind.format("blocklist"), frame(uid, a, payload() if shape == "udp" else b"")))
    return out


def _parts(probes: list[Probe], work: Path) -> list[tuple[str, Path, int]]:
    """The attack mix's frames by source ("spoofed": attack_*, then "blocklist": blocklist_*; IPv6's with verify6's
    prefix v6_), each part a frames file: (part, file, frames)."""
    out = []
    for name, prefix in (("spoofed", "attack_"), ("blocklist", "blocklist_")):
        part = [p for p in probes if p.kind.removeprefix("v6_").startswith(prefix)]
        if part:
            path = work / f"frames-{name}.bin"
            with open(path, "wb") as f:
                for p in part:
                    f.write(struct.pack("<H", len(p.frame)) + p.frame)
            out.append((name, path, len(part)))
    return out


def established_probes(policy: Policy, trace: str, count: int, seed: int) -> tuple[list[Probe], list[tuple]]:
    """`count` frames of the trace's TCP and UDP headers (TCP with flags ACK), and their flows (proto, src, dst,
    sport, dport)."""
    rng = random.Random(seed)
    rows = [r for r in read_trace(trace, 10**9, rng) if r["proto"] in (6, 17)]
    if not rows:
        raise HypafilterError(f"{trace}: no TCP or UDP headers for established flows")
    if len(rows) > count:
        rows = [rows[i] for i in sorted(rng.sample(range(len(rows)), count))]
    gen = FrameGen(policy, rng)
    probes, flows = [], {}
    for uid in range(1, count + 1):
        h = dict(rows[(uid - 1) % len(rows)], flags=0x10)
        probes.append(Probe(uid, "established", build_frame(uid, h, gen.payload())))
        flows[(h["proto"], h["src"], h["dst"], h["sport"], h["dport"])] = None
    return probes, list(flows)


def rate(
    policy: Policy,
    config: Config,
    target: str = "emu",
    frames: int = 20000,
    seed: int = 1,
    trace: str | None = None,
    malformed: float = 0.0,
    window: int = 2048,
    seconds: float = 2.0,
    repeats: int = 3,
    cpu: int | None = None,
    established: bool = False,
    nft_policy: Policy | None = None,
    nft_v6=None,
    prog_repeat: int = 100,
    prog_frames: int = 500,
    sender: str = "packet",
    attack: str | None = None,
    attackers: int = 1000,
    blocklist: int | None = None,
    blocklist_as: str = "ipset",
    blocklist_share: float = 0.5,
    legit: tuple[str, int] | None = None,
    legit_connections: int = 20,
    legit_timeout: float = 5.0,
    legit_queue: float = attack_mod.LEGIT_QUEUE_S,
    v6=None,
    v6_frames: float = 0.0,
    v6_headers: list[dict] | None = None,
    log: Callable[[str], None] = lambda s: None,
) -> dict:
    """Deploy on `target`, send the same frames through the three paths, compare them per frame, then count rates;
    the report. `nft_policy`: what the nft path loads when `policy` has matches nft cannot express (the caller says
    what it is; frames are then compared with nft only where the two policies mean the same: payloads without the
    string "BAD", the ClassBench complex rules' string); `nft_v6` the same for the IPv6 side `v6`. `sender`: SENDERS
    ("live" only with target xdp).

    `attack` (ATTACKS): every frame an attack frame (attack_probes), `blocklist` networks (default 10,000 with
    `attack`) dropped ahead of the policy as `blocklist_as` (tools/bench/attack.py), and `legit_connections` real
    connections the policy accepts (`legit`: (proto, port) forced) run on the hybrid path and on the policy alone in
    iptables while the attack frames flood each; on a paced fast path (emu) the flood is then held `legit_queue`
    seconds of the correctness pass's rate ahead of the NIC (0: `window` frames, as in the correctness pass).
    `repeats` 0: no rate pass (the correctness pass's figures).

    `v6` (netfilter.ip6.V6Policy): the IPv6 side deployed beside `policy` (docs/ipv6.md "bench rate with IPv6"), and
    the share `v6_frames` of the frames IPv6 ones (1: `bench rate -6`, every frame IPv6; `policy` is then the IPv4
    side deploy -6 takes): verify6's frames aimed at the IPv6 policy's boxes and networks (`v6_headers`: a trace
    mapped into IPv6, tools.classbench6.v6_trace), their share of malformed kinds `malformed`. The plain path loads
    the IPv6 side alone into its ip6tables beside the IPv4 policy; the nft path both sides in nft tables `ip` and
    `ip6` (nft_text, nft_text6) with iptables' and ip6tables' filter tables emptied."""
    if target not in FAST_PATHS:
        raise HypafilterError(f"bench rate: unknown target '{target}' (choose from {', '.join(FAST_PATHS)})")
    if sender not in SENDERS:
        raise HypafilterError(f"bench rate: unknown sender '{sender}' (choose from {', '.join(SENDERS)})")
    if sender == "live" and target != "xdp":
        raise HypafilterError(
            "bench rate: --sender live needs --target xdp (the emulated NIC reads frames from a socket)"
        )
    if seconds <= 0 or repeats < 0:
        raise HypafilterError("bench rate: --seconds must be above 0 and --repeats at least 0")
    if established and not trace:
        raise HypafilterError("bench rate: --established needs --trace (its TCP and UDP headers are the flows)")
    if established and attack:
        raise HypafilterError("bench rate: --attack sends new flows only; without --established")
    if (blocklist or legit) and not attack:
        raise HypafilterError("bench rate: --blocklist and --legit are parts of --attack's mix")
    if blocklist_as not in attack_mod.BLOCKLIST_AS:
        raise HypafilterError(f"bench rate: --blocklist-as is one of {', '.join(attack_mod.BLOCKLIST_AS)}")
    if attack and blocklist is None:
        blocklist = attack_mod.DEFAULT_BLOCKLIST
    if v6 is not None and established:
        raise HypafilterError("bench rate: --established sends IPv4 flows only; not with -6 or --ipv6")
    if v6 is not None and attack and (v6_frames < 1 or target != "xdp" or v6.ir is None):
        raise HypafilterError(
            "bench rate: --attack with IPv6 is -6's on the xdp target (every frame IPv6, an ip6tables policy): not with"
            " POLICY --ipv6 V6POLICY or --target emu"
        )
    if v6 is None and v6_frames:
        raise HypafilterError("bench rate: IPv6 frames need an IPv6 policy (-6 V6POLICY or --ipv6 V6POLICY)")
    refuse_nondeterministic(policy, limits=False)  # a benchmark checks no limit after its run
    cpu = (os.cpu_count() or 1) - 1 if cpu is None else cpu
    lab = Lab(deploy.LAB_NAME, target=target)
    if not lab.status()["complete"]:
        log(f"lab {lab.name} is not (fully) up for target {target}: bringing it up")
        lab.up()
    snd = build_sender(sender, BUILD_ROOT / "bench")
    if established:
        # The plain path tracks no window either (the hybrid's entries are marked liberal: tools/bench/ctflows.py).
        for ns in (lab.ns_fw, lab.ns_plain):
            netns.run(["sysctl", "-qw", "net.netfilter.nf_conntrack_tcp_be_liberal=1"], ns)
    base, base6, networks, flow = policy, v6, [], None
    if attack:
        # The mix's parts from the policy without the blocklist: the attackers aim at what it drops, the legitimate
        # connections at what it accepts; the blocklist avoids both (tools/bench/attack.py). With -6 all of it IPv6:
        # the IPv6 side's policy, its headers, an inet6 blocklist.
        family = 6 if v6 is not None else 4
        pool = attacker_pool(seed, attackers, family)
        rng = random.Random(seed)
        if v6 is not None:
            headers = headers6(v6, v6_headers, len(v6_headers) if v6_headers else 5000, rng)
        else:
            headers = read_trace(trace, 20000, rng) if trace else [FrameGen(policy, rng).header() for _ in range(20000)]
        aimed = v6.ir if v6 is not None else policy
        flow = attack_mod.legit_flow(aimed, config, headers, legit_connections, seed, legit, set(pool))
        networks = attack_mod.blocklist_networks(blocklist or 0, seed, set(pool) | {flow.client, flow.server}, family)
        if networks:
            log(f"blocklist: {len(networks)} networks as {blocklist_as}, ahead of the policy")
            if blocklist_as == "ipset":
                attack_mod.create_ipset([lab.ns_fw, lab.ns_plain], networks, family)
            if v6 is not None:
                v6 = attack_mod.with_blocklist(base6, config, networks, blocklist_as, lab.ns_fw, target)
            else:
                policy = attack_mod.with_blocklist(base, config, networks, blocklist_as, lab.ns_fw, target)
    host_set = networks and blocklist_as == "ipset" and v6 is None  # (the IPv6 side's check creates its own)
    with attack_mod.host_set_for_check() if host_set else contextlib.nullcontext():
        fast = FAST_PATHS[target](policy, config, log, v6=v6)
    work = Path(tempfile.mkdtemp(prefix="hf-rate-"))
    flows: list[tuple] = []
    wire = {"hybrid": (lab.ns_fw, "nf0") if target == "xdp" else (lab.ns_nic, "wire0"), "plain": (lab.ns_plain, "nf0")}
    if sender == "live":
        # ndo_xdp_xmit into the plain path's wire end needs NAPI there (the hybrid's has its XDP program).
        _xdp_drop(lab.ns_plain, "nf0", pktrate.build_cached(PASS_SRC, BUILD_ROOT / "bench", BPF_CC, suffix=".o"))
    try:
        if established:
            probes, flows = established_probes(policy, trace, frames, seed)
            log(f"established: {len(flows)} flows into conntrack of {lab.ns_fw} and {lab.ns_plain}")
            for ns in (lab.ns_fw, lab.ns_plain):
                open_flows(ns, flows)
        elif attack:
            probes = attack_probes(
                base, config, trace, frames, seed, attack, attackers, networks, blocklist_share, base6, v6_headers
            )
            log(
                f"attack: {frames} {attack} frames from {attackers} spoofed sources to destinations the policy drops"
                f" and from {len(networks)} blocklisted networks"
            )
        else:
            n6 = round(frames * v6_frames) if v6 is not None else 0
            probes = []
            if frames - n6:
                spec = ProbeSpec(frames - n6, seed=seed, trace=trace if not v6_headers else None, malformed=malformed)
                probes = spec.probes(policy, fast.generation)
            if n6:
                from hypafilter.ops.verify import DST_MAC, ID_MAC_PREFIX
                from hypafilter.ops.verify6 import probes6

                log(f"{n6} IPv6 frames" + (" of the trace mapped into IPv6" if v6_headers else ""))
                first = len(probes) + 1
                probes += [
                    Probe(*f) for f in probes6(v6, first, n6, seed, DST_MAC, ID_MAC_PREFIX, 1.0 - malformed, v6_headers)
                ]
        frames_file = work / "frames.bin"
        with open(frames_file, "wb") as f:
            for p in probes:
                f.write(struct.pack("<H", len(p.frame)) + p.frame)
        n = len(probes)
        for ns in (lab.ns_fw, lab.ns_plain):
            netns.run(["sysctl", "-qw", "net.bridge.bridge-nf-filter-vlan-tagged=1"], ns)
        nft_text_, nft_error = None, None

        def render_nft() -> None:
            """The nft path's text (nft_error when there is none); with an IPv6 side, after its oracle is loaded: the
            hotdrop guards of the matches that ip6tables runs as xtables matches there."""
            nonlocal nft_text_, nft_error
            try:
                if networks and blocklist_as == "ipset" and v6 is None:
                    nft_text_ = nft_text(nft_policy or base, config, networks)
                elif networks and nft_policy is not None and v6 is None:
                    nft_text_ = nft_text(attack_mod.with_blocklist(nft_policy, config, networks, blocklist_as), config)
                else:
                    hot, side6, block6 = None, nft_v6 or v6, ()
                    if v6 is not None:
                        from hypafilter.netfilter.nft import xt_matches6

                        hot = xt_matches6(lab.ns_plain)
                        if networks and blocklist_as == "ipset":  # the set in nft, the policy's rules without it
                            side6, block6 = nft_v6 or base6, networks
                        elif networks and nft_v6 is not None:
                            side6 = attack_mod.with_blocklist(nft_v6, config, networks, blocklist_as)
                    nft_text_ = nft_text(nft_policy or policy, config, v6=side6, hotdrop6=hot, blocklist6=block6)
            except HypafilterError as e:
                nft_error = str(e)

        def drop_nft() -> None:
            for fam in ("ip", "ip6"):
                netns.run(["nft", "delete", "table", fam, NFT_TABLE], lab.ns_plain, check=False)

        def load_ipt() -> None:
            drop_nft()
            load_oracle(lab.ns_plain, policy, config.table, config.unfilterable, lab.ns_fw)
            if v6 is not None:  # the IPv6 side alone in the plain namespace's ip6tables, as verify's oracle
                from hypafilter.ops.verify6 import load_oracle6

                load_oracle6(lab.ns_plain, v6, lab.ns_fw)

        def load_nft() -> None:
            _empty_filter(lab.ns_plain, config.table)
            if v6 is not None:  # nft_text6 is the IPv6 side's filter table (its only one): ip6tables' accepts all
                _empty_filter(lab.ns_plain, "filter", "ip6tables-restore")
            drop_nft()
            netns.run(["nft", "-f", "-"], lab.ns_plain, input=nft_text_)

        rx = {"hybrid": raw_socket(lab.ns_recv, "hyb0"), "plain": raw_socket(lab.ns_recv, "plain0")}
        try:
            log(f"correctness pass, hybrid ({target}): {n} frames")
            before = fast.counters()
            paced = fast.decided if target == "emu" else None
            paced_plain = None
            if target == "xdp":
                # Unpaced, the sender outruns the capture (the receiver socket's buffer fills and the rest of the
                # frames is dropped there, e.g. an skb veth builds around an xdp_frame takes a page of it): the
                # sender keeps at most CAPTURE_WINDOW frames ahead of the wire end's rx counter.
                paced = lambda: _rx_packets(*wire["hybrid"])  # noqa: E731
                paced_plain = lambda: _rx_packets(*wire["plain"])  # noqa: E731
                window = min(window, CAPTURE_WINDOW)
            # An attack mix goes in parts (the spoofed sources' frames, then the blocklist's), each part's counter
            # delta its own share of frames decided in the fast path.
            parts = _parts(probes, work) if attack else [("all", frames_file, n)]
            hybrid, delta, by_part = Run({}, 0.0), {}, {}
            for name, path_file, count in parts:
                run_ = _run(lab.ns_send, "hyb0", rx["hybrid"], snd, path_file, count, paced, window, wire["hybrid"])
                hybrid.got.update(run_.got)
                hybrid.seconds += run_.seconds
                after = fast.counters()
                d = {k: after[k] - before.get(k, 0) for k in after if isinstance(after[k], int)}
                by_part[name] = {"frames": count, "hw_share": hw_share(d) or 0.0}
                delta = {k: delta.get(k, 0) + v for k, v in d.items()}
                before = after
            log("correctness pass, plain path, iptables")
            load_ipt()
            render_nft()
            ipt = _run(lab.ns_send, "plain0", rx["plain"], snd, frames_file, n, paced_plain, window, wire["plain"])
            nft = None
            if nft_text_ is not None:
                log("correctness pass, plain path, nft")
                try:
                    load_nft()
                    nft = _run(
                        lab.ns_send, "plain0", rx["plain"], snd, frames_file, n, paced_plain, window, wire["plain"]
                    )
                finally:
                    load_ipt()
        finally:
            for s in rx.values():
                s.close()
        accepted = [bool(ipt.got.get(p.uid)) for p in probes]
        # the nft path's own verdicts: with `nft_policy` (no string match) it differs from iptables on frames whose
        # payload the complex rules' string test reads (compared with the hybrid only on the others)
        accepted_nft = [bool(nft.got.get(p.uid)) for p in probes] if nft else None
        rounds = []
        if fast.counted and repeats > 0:
            rounds = _rate_rounds(
                lab,
                fast,
                snd,
                wire,
                frames_file,
                {"iptables": accepted, "nft": accepted_nft},
                seconds,
                repeats,
                cpu,
                load_ipt,
                load_nft if nft else None,
                log,
            )
            sink_ns = statistics.median(r["sink"]["cpu_ns"] for r in rounds)
            log(f"the {sender} sender's own cost: {sink_ns:.0f} CPU ns per frame (into the sink, median of the rounds)")
        prog = None
        if prog_repeat > 0 and target == "xdp" and v6 is None:  # (xdpcost runs the IPv4 plan's program)
            from hypafilter.analysis.plan import build_plan
            from hypafilter.targets.xdp.target import control_of
            from hypafilter.tools.bench.xdpcost import xdp_cost

            log("the program's own cost: BPF_PROG_TEST_RUN" + (" on the established flows" if established else ""))
            plan = build_plan(policy, config)
            extra = {}
            if established:
                # The bench's frames, their flows established in the test run's namespace, the deployed CONTROL.
                extra = {
                    "frame_list": [p.frame for p in probes],
                    "flows": flows,
                    "control": control_of(config.unfilterable, config.nic_mode, plan.miss_shunt),
                }
            c = xdp_cost(plan, policy, frames=min(n, prog_frames), repeat=prog_repeat, seed=seed, trace=trace, **extra)
            keys = ("frames", "repeat", "ns_mean", "ns_median", "ns_p99")
            prog = {k: c[k] for k in keys + (("established_flows", "counters") if established else ())}
        # Last: the connections leave conntrack entries and neighbour traffic behind them.
        legit_report = None
        if attack:
            legit_report = {**flow.summary(), "completed": {}, "flood_pps": {}, "seconds": {}, "connection_s": {},
                            "datagrams": {}, "window": {}}  # fmt: skip
            # The emulated NIC decides a few hundred to a few ten thousand frames a second: the flood's queue ahead of
            # it is bounded in time (its rate in the correctness pass), not in frames (attack.LEGIT_QUEUE_S).
            legit_window = window
            if target == "emu":
                legit_window = attack_mod.legit_window(window, n, hybrid.seconds, legit_queue)
                log(f"the flood: {legit_window} frames ahead of the NIC ({legit_queue:g} s of its correctness pass)")
            for path, label, decided in (("hyb", "hybrid", fast.decided if target == "emu" else None),
                                         ("plain", "iptables", None)):  # fmt: skip
                log(f"{len(flow.sports)} legitimate {flow.proto} connections on the {label} path under the flood")
                got = attack_mod.legit_under_flood(
                    lab, path, flow, snd, frames_file, cpu, decided, legit_window, timeout=legit_timeout
                )
                for key in ("completed", "flood_pps", "seconds", "connection_s", "datagrams", "window"):
                    legit_report[key][label] = got[key]
    finally:
        fast.close()
        shutil.rmtree(work, ignore_errors=True)
        if sender == "live":
            _xdp_drop(lab.ns_plain, "nf0", None)
    vs_ipt = compare(probes, {"hybrid": hybrid.got, "plain": ipt.got})
    stringless = nft_policy is not None or nft_v6 is not None  # the nft path loads the rules without string matches
    nft_probes = [p for p in probes if b"BAD" not in p.frame] if stringless else probes
    vs_nft = compare(nft_probes, {"hybrid": hybrid.got, "plain": nft.got}) if nft else None
    mismatched = _mismatched(probes, hybrid.got, ipt.got) | (
        _mismatched(nft_probes, hybrid.got, nft.got) if nft else set()
    )
    if rounds:
        med = _medians(rounds)
        paths = med["paths"]
        figures = {
            "hybrid_pps": round(paths["hybrid"]["pps"], 1),
            "iptables_pps": round(paths["iptables"]["pps"], 1),
            "nft_pps": round(paths["nft"]["pps"], 1) if "nft" in paths else None,
            "speedup_vs_iptables": med["speedup"].get("iptables"),
            "speedup_vs_nft": med["speedup"].get("nft"),
            "fw_ns": {k: round(v["fw_ns"], 1) for k, v in paths.items() if k != "sink"},
            "fw_speedup_vs_iptables": med["fw_speedup"].get("iptables"),
            "fw_speedup_vs_nft": med["fw_speedup"].get("nft"),
            "sink_pps": round(paths["sink"]["pps"], 1),
            # the sender's own cost per frame: its CPU ns into the sink (XDP drop at the peer), in every path's cpu_ns
            "sender_ns": round(paths["sink"]["cpu_ns"], 1),
            "limit": _limit(paths),
            "paths": {k: {m: round(x, 1) for m, x in v.items()} for k, v in paths.items()},
        }
    else:
        # The paced correctness pass is the measurement: frames / (first send -> every frame decided and the last
        # delivered one received).
        figures = {
            "hybrid_pps": hybrid.pps(n),
            "iptables_pps": ipt.pps(n),
            "nft_pps": nft.pps(n) if nft else None,
            "speedup_vs_iptables": round(ipt.seconds / hybrid.seconds, 3) if hybrid.seconds else None,
            "speedup_vs_nft": round(nft.seconds / hybrid.seconds, 3) if nft and hybrid.seconds else None,
            "fw_ns": None,
            "fw_speedup_vs_iptables": None,
            "fw_speedup_vs_nft": None,
            "sink_pps": None,
            "sender_ns": None,
            "limit": f"the {target} fast path paces the sender (correctness pass only)",
            "paths": None,
        }
    report = {
        "target": target,
        "frames": n,
        **figures,
        "rounds": rounds,
        "xdp_prog": prog,
        "hw_share": hw_share(delta) or 0.0,
        "mismatches": len(mismatched),
        "mismatches_vs_iptables": vs_ipt["mismatches"],
        "mismatches_vs_nft": vs_nft["mismatches"] if vs_nft else None,
        "nft_error": nft_error,
        "nft_policy": "complex matches removed (nft has no string match); compared on frames without 'BAD'"
        if stringless
        else "the policy",
        "delivered": {
            "hybrid": sum(1 for p in probes if hybrid.got.get(p.uid)),
            "iptables": sum(1 for p in probes if ipt.got.get(p.uid)),
            "nft": sum(1 for p in probes if nft.got.get(p.uid)) if nft else None,
        },
        "correctness_seconds": {"hybrid": round(hybrid.seconds, 3), "iptables": round(ipt.seconds, 3)}
        | ({"nft": round(nft.seconds, 3)} if nft else {}),
        "nic": {k: v for k, v in delta.items() if v},
        "ct_complete_after": getattr(fast, "ct_complete_after", None),  # emu: seconds the bench waited for it
        "examples": vs_ipt["examples"][:5],
        "examples_vs_nft": vs_nft["examples"][:5] if vs_nft else None,
        "established_flows": len(flows) if established else None,
        # every frame an attack frame: the share of them decided in the fast path (and per part of the mix)
        "attack": {
            "shape": attack,
            "attackers": attackers,
            "blocklist": len(networks),
            "blocklist_as": blocklist_as if networks else None,
            "hw_share": by_part,
        }
        if attack
        else None,
        "attack_hw_share": (hw_share(delta) or 0.0) if attack else None,
        # every legitimate connection completed on the hybrid path under the flood (real sockets, counted)
        "legit_connections_ok": legit_report["completed"]["hybrid"] == legit_report["connections"]
        if legit_report
        else None,
        "legit": legit_report,
        "sender": sender,
        "seconds": seconds,
        "repeats": repeats,
        "cpu": cpu,
        "load": [round(x, 2) for x in os.getloadavg()],
        "policy_hash": policy.policy_hash(),
        # the IPv6 side: its policy and the IPv6 frames among `frames` (None: IPv4 alone)
        "ipv6": {
            "policy": v6.source,
            "policy_hash": v6.policy_hash(),
            "rules": v6.rule_count,
            "frames": sum(1 for p in probes if p.kind.startswith("v6_")),
            "trace": bool(v6_headers),
            "hw_entries": ((fast.state.get("tables") or {}).get("v6") or {}).get("entries"),
        }
        if v6 is not None
        else None,
        "seed": seed,
        "trace": trace,
    }
    return report


def _rate_rounds(lab, fast, snd, wire, frames_file, verdicts, seconds, repeats, cpu, load_ipt, load_nft, log) -> list:
    """`repeats` rounds of sink, hybrid, iptables and nft runs with the sender `snd`; each run's count at the path's
    first receiver (`wire`) must be the frames sent and its delivered count what the correctness pass's verdicts
    predict (a difference means frames were lost or counted wrongly: the run is refused); `verdicts`: each plain
    path's per-frame deliveries in the correctness pass (the hybrid's are iptables')."""
    rounds = []
    obj = build_sink(BUILD_ROOT / "bench")
    _sink_up(lab.ns_send, obj)
    for ifname in ("hyb0", "plain0"):
        _xdp_drop(lab.ns_recv, ifname, obj)
    try:
        for r in range(repeats):
            log(f"rate round {r + 1}/{repeats}: sink, hybrid, iptables" + (", nft" if load_nft else ""))
            sink = (lab.ns_send, SINK[1])
            rnd = {"sink": _count(lab.ns_send, SINK[0], sink, snd, frames_file, seconds, cpu, sink)}
            before = fast.decided()
            rnd["hybrid"] = _count(
                lab.ns_send, "hyb0", (lab.ns_recv, "hyb0"), snd, frames_file, seconds, cpu, wire["hybrid"]
            )
            decided = fast.decided() - before
            if decided != rnd["hybrid"].sent:
                raise HypafilterError(f"the fast path decided {decided} of {rnd['hybrid'].sent} frames sent")
            load_ipt()
            rnd["iptables"] = _count(
                lab.ns_send, "plain0", (lab.ns_recv, "plain0"), snd, frames_file, seconds, cpu, wire["plain"]
            )
            if load_nft:
                try:
                    load_nft()
                    rnd["nft"] = _count(
                        lab.ns_send, "plain0", (lab.ns_recv, "plain0"), snd, frames_file, seconds, cpu, wire["plain"]
                    )
                finally:
                    load_ipt()
            for path, c in rnd.items():
                if c.arrived != c.sent:
                    raise HypafilterError(
                        f"rate round {r + 1}, {path}: the path's first receiver got {c.arrived} of {c.sent} frames"
                        " sent (frames lost before it)"
                    )
                want = c.sent if path == "sink" else _expected(verdicts.get(path) or verdicts["iptables"], c.sent)
                if c.delivered != want:
                    raise HypafilterError(
                        f"rate round {r + 1}, {path}: {c.delivered} frames delivered of {c.sent} sent, the verdicts"
                        f" of the correctness pass give {want}"
                    )
            rounds.append({k: vars(c) | {"pps": round(c.pps, 1), "cpu_ns": round(c.cpu_ns, 1)} for k, c in rnd.items()})
    finally:
        _sink_down(lab.ns_send)
        for ifname in ("hyb0", "plain0"):
            _xdp_drop(lab.ns_recv, ifname, None)
    return rounds


def _medians(rounds: list[dict]) -> dict:
    """Per path the median wall rate, CPU ns/frame and firewall-side ns/frame (CPU ns − the same round's sink's);
    per plain path the median over rounds of the wall and firewall-side speedups of the hybrid path."""
    paths: dict[str, dict] = {}
    speed: dict[str, list] = {}
    fw_speed: dict[str, list] = {}
    for rnd in rounds:
        sink = rnd["sink"]["cpu_ns"]
        for k, c in rnd.items():
            p = paths.setdefault(k, {"pps": [], "cpu_ns": [], "fw_ns": []})
            p["pps"].append(c["pps"])
            p["cpu_ns"].append(c["cpu_ns"])
            p["fw_ns"].append(c["cpu_ns"] - sink)
        h = rnd["hybrid"]
        for k in ("iptables", "nft"):
            if k in rnd:
                speed.setdefault(k, []).append(rnd[k]["seconds"] / rnd[k]["sent"] / (h["seconds"] / h["sent"]))
                fh = h["cpu_ns"] - sink
                if fh > 0:
                    fw_speed.setdefault(k, []).append((rnd[k]["cpu_ns"] - sink) / fh)
    out = {k: {m: statistics.median(v) for m, v in p.items()} for k, p in paths.items()}
    for v in out.values():
        v["fw_pps"] = 1e9 / v["fw_ns"] if v["fw_ns"] > 0 else 0.0
        v["cpu_pps"] = 1e9 / v["cpu_ns"] if v["cpu_ns"] > 0 else 0.0
    return {
        "paths": out,
        "speedup": {k: round(statistics.median(v), 2) for k, v in speed.items()},
        "fw_speedup": {k: round(statistics.median(v), 2) for k, v in fw_speed.items() if v},
    }


def _limit(paths: dict) -> str:
    """What bounds the hybrid path's wall rate: the sender (and veth) when it comes within 25 % of the sink's."""
    h, s = paths["hybrid"]["pps"], paths["sink"]["pps"]
    if s and h >= 0.75 * s:
        return "sender: the hybrid path runs within 25 % of the sender's rate into a sink"
    return "path: the hybrid path's own cost (the sender alone is faster)"


def _mismatched(probes: list[Probe], a: dict[int, list[bytes]], b: dict[int, list[bytes]]) -> set[int]:
    """Ids of frames delivered on one path and not the other, or delivered with other bytes."""
    out = set()
    for p in probes:
        x, y = a.get(p.uid, []), b.get(p.uid, [])
        if bool(x) != bool(y) or (x and x[0] != y[0]):
            out.add(p.uid)
    return out
