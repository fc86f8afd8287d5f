"""`hypafilter bench churn`: a deployed policy under traffic while single-source DROP and REJECT rules are inserted
and deleted with the real `iptables` command, as fail2ban does, at given rates (issue #23).

For each rate r, for `seconds`: every 1/r s one `iptables -w` command in the firewall namespace, alternately an
insert at the top of FORWARD of `-s ADDR/32 -j DROP` or `-j REJECT` (a new address each time) and, once `live` bans
stand, the delete of the oldest. The lag of a command is the time from its return to the moment the fast path no
longer decides by the old policy: the shim's generation differs from the NIC's while the NIC shunts everything (the
policy sync service's fail safe: every frame to the live rules, which hold the change), or the NIC's generation moved
on (the change applied). It is read by polling the shim's map through the bpf() syscall and the NIC's registers
(every POLL_S); a command issued while the fast path already shunts everything has lag 0. The frames flow meanwhile
(the lab's sender cycling through verify's probes); `hw_share` is the share of the hybrid's wire frames the fast path
decided during the rate's window, `cores_built` the updates that started a new core or program (the policy sync
service's counters, as `applied` and `buffer_updates`: the state's history keeps the last deploys only), `mismatches` what
`verify --live` finds after the window (the same frames through the hybrid and through the live ruleset alone)."""

from __future__ import annotations

import contextlib
import ipaddress
import statistics
import struct
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from hypafilter import netns, shared
from hypafilter.config import Config
from hypafilter.errors import HypafilterError
from hypafilter.ir import Policy
from hypafilter.ops import deploy
from hypafilter.ops.lab import Lab
from hypafilter.ops.policysync import live
from hypafilter.ops.policysync.service import SERVICE as POLICYSYNC
from hypafilter.ops.verify import ProbeSpec, verify
from hypafilter.paths import BUILD_ROOT
from hypafilter.targets.base import DECIDED
from hypafilter.targets.bpfmap import PinnedArray
from hypafilter.tools.bench.pktrate import build_blaster

FIELDS = ("target", "updates", "rate_per_s", "lag_p50_ms", "lag_p99_ms", "cores_built", "mismatches", "hw_share")
POLL_S = 0.0002
LAG_TIMEOUT_S = 30.0
REOPEN_S = 10.0  # how long a replaced NIC's successor may take to appear in the state file
BAN_BASE = ipaddress.IPv4Address("10.0.1.16")  # banned sources, one new address per insert: inside the lab's /24s


class FastPathProbe:
    """Reads, cheaply and often, whether the fast path decides by the deployed generation: (NIC generation,
    shunting everything, shim generation)."""

    def __init__(self, st: dict):
        self.shim = PinnedArray(Path(st["shim"]["pin"]) / shared.HF_MAP_CONFIG)
        self.xdp = self.nic = self.nic_client = None
        self._open(st)

    def _open(self, st: dict) -> None:
        self.st = st
        if st.get("target") == "xdp":
            self.xdp = PinnedArray(Path(st["nic"]["pin"]) / "hfx_cfg")
        else:
            tgt = deploy.target_of(st, deploy.state_config(st))
            self.nic_client = tgt.client(st["nic"])
            self.nic = self.nic_client.__enter__()

    def _close_nic(self) -> None:
        if self.xdp is not None:
            self.xdp.close()
        if self.nic_client is not None:
            with contextlib.suppress(Exception):
                self.nic_client.__exit__(None, None, None)
        self.xdp = self.nic = self.nic_client = None

    def read(self) -> tuple[int, bool, int]:
        shim_gen = struct.unpack_from("=I", self.shim.read(), 4 * shared.C["HF_CFG_GENERATION"])[0]
        deadline = time.monotonic() + REOPEN_S
        while True:
            try:
                if self.xdp is None and self.nic is None:
                    self._open(deploy.read_state())
                if self.xdp is not None:
                    control, gen = struct.unpack_from("=II", self.xdp.read(), 0)
                    return gen, control == 0, shim_gen
                return self.nic.read("GENERATION"), bool(self.nic.read("CONTROL") & 2), shim_gen
            except (HypafilterError, OSError):
                # the update replaced the NIC (a new core) or the program; the state file names the new one once
                # the update has committed (the old NIC stops a moment before)
                self._close_nic()
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.01)

    def close(self) -> None:
        self.shim.close()
        self._close_nic()


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return round(s[min(len(s) - 1, int(q * len(s)))], 3)


def churn(
    policy: Policy,
    config: Config,
    target: str = "emu",
    rates: tuple[float, ...] = (1.0, 10.0, 100.0),
    seconds: float = 60.0,
    live_bans: int = 4,
    frames: int = 2000,
    verify_packets: int = 1000,
    log: Callable[[str], None] = lambda s: None,
) -> list[dict]:
    if any(r <= 0 for r in rates) or seconds <= 0:
        raise HypafilterError("bench churn: rates and --seconds must be above 0")
    lab = Lab(deploy.LAB_NAME, target=target)
    if not lab.status()["complete"]:
        log(f"lab {lab.name} is not (fully) up for target {target}: bringing it up")
        lab.up()
    log(f"deploying {policy.source} ({len(policy.rules)} rules) on {target}")
    deploy.deploy(policy, config, target=target, log=log)
    st = deploy.read_state()
    ns = lab.ns_fw
    blaster = build_blaster(BUILD_ROOT / "bench")
    work = Path(tempfile.mkdtemp(prefix="hf-churn-"))
    frames_file = work / "frames.bin"
    with open(frames_file, "wb") as f:
        for p in ProbeSpec(frames, seed=1, malformed=0.0).probes(policy, st["generation"]):
            f.write(struct.pack("<H", len(p.frame)) + p.frame)
    results = []
    address = int(BAN_BASE)
    for rate in rates:
        st = deploy.read_state()
        tgt = deploy.target_of(st, deploy.state_config(st))
        service_before = POLICYSYNC.status(deploy.STATE_DIR)
        total = max(1.0, seconds + 5.0)
        sender = netns.popen([str(blaster), "hyb0", str(frames_file), f"{total:g}"], lab.ns_send)
        time.sleep(0.5)
        before = tgt.counters(st["nic"])
        probe = FastPathProbe(st)
        bans: list[tuple[str, str]] = []
        lags: list[float] = []
        updates = 0
        t_start = time.monotonic()
        period = 1.0 / rate
        try:
            k = 0
            while time.monotonic() - t_start < seconds:
                due = t_start + k * period
                k += 1
                wait = due - time.monotonic()
                if wait > 0:
                    time.sleep(wait)
                gen0, _, _ = probe.read()
                if len(bans) >= live_bans:
                    addr, verdict = bans.pop(0)
                    argv = ["iptables", "-w", "-D", "FORWARD", "-s", f"{addr}/32", "-j", verdict]
                else:
                    addr = str(ipaddress.IPv4Address(address))
                    address += 1
                    verdict = "DROP" if updates % 2 == 0 else "REJECT"
                    bans.append((addr, verdict))
                    argv = ["iptables", "-w", "-I", "FORWARD", "1", "-s", f"{addr}/32", "-j", verdict]
                netns.run(argv, ns)
                t_ret = time.monotonic()
                updates += 1
                while True:
                    gen, shunting, shim_gen = probe.read()
                    if gen != gen0 or (shunting and shim_gen != gen):
                        lags.append((time.monotonic() - t_ret) * 1000)
                        break
                    if time.monotonic() - t_ret > LAG_TIMEOUT_S:
                        raise HypafilterError(
                            f"bench churn: the fast path still decided by generation {gen0} {LAG_TIMEOUT_S:g} s after "
                            f"`{' '.join(argv)}` (is the policy sync service running? `hypafilter status`)"
                        )
                    time.sleep(POLL_S)
            elapsed = time.monotonic() - t_start
            st_now = deploy.read_state()
            after = tgt.counters(st_now["nic"]) if st_now["nic"] == st["nic"] else None
        finally:
            probe.close()
            sender.wait(timeout=total + 30)
            for addr, verdict in bans:  # the policy as it was, for the next rate
                netns.run(["iptables", "-w", "-D", "FORWARD", "-s", f"{addr}/32", "-j", verdict], ns, check=False)
        hw_share = None
        if after is not None:
            delta = {k: after.get(k, 0) - before.get(k, 0) for k in ("PKTIN", *DECIDED)}
            if delta["PKTIN"]:
                hw_share = round(sum(delta[k] for k in DECIDED) / delta["PKTIN"], 4)
        # settle, then the kernel as oracle over the live ruleset (every ban of this rate removed again)
        deadline = time.monotonic() + 120
        live_pol = None
        while time.monotonic() < deadline:
            st_now = deploy.read_state()
            cfg_now = deploy.site_config(deploy.deployed_config(st_now))
            text = netns.run(["iptables-save", "-t", cfg_now.table], ns)
            try:
                live_pol = live.followed(text, st_now, cfg_now)
                break
            except HypafilterError:
                pass
            time.sleep(0.5)
        if live_pol is None:
            raise HypafilterError("bench churn: the deployment did not follow the live ruleset within 120 s")
        report = verify(live_pol, cfg_now, live=True, packets=verify_packets, seed=3)
        # the service's own counters (the state's history keeps the last deploys only)
        service_after = POLICYSYNC.status(deploy.STATE_DIR)

        counted = {
            k: int(service_after.get(k, 0)) - int(service_before.get(k, 0))
            for k in ("applied", "applied_buffer", "applied_new_core", "rebuilds")
        }
        results.append(
            {
                "target": target,
                "updates": updates,
                "rate_per_s": round(updates / elapsed, 2),
                "rate_asked_per_s": rate,
                "seconds": round(elapsed, 1),
                "lag_p50_ms": _pct(lags, 0.5),
                "lag_p99_ms": _pct(lags, 0.99),
                "lag_max_ms": round(max(lags), 3) if lags else None,
                "lag_mean_ms": round(statistics.fmean(lags), 3) if lags else None,
                "cores_built": counted["applied_new_core"] + counted["rebuilds"],
                "applied": counted["applied"],
                "buffer_updates": counted["applied_buffer"],
                "mismatches": report["mismatches"],
                "hw_share": hw_share,
                "rules": len(policy.rules),
            }
        )
        log(f"rate {rate:g}/s: {results[-1]}")
    return results
