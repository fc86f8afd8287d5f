"""Whether a conntrack miss in the xdp program may mean "NEW or INVALID" (ct 3) in a firewall namespace.

A frame that `bpf_xdp_ct_lookup` finds no entry for (it looks the frame's tuple up in the default zone's table, which
holds every confirmed connection under both its original and its reply tuple) is NEW or INVALID to the kernel unless
something makes it RELATED or UNTRACKED, or puts its connection in another zone: an expectation (created by a
conntrack helper, or by a program through ctnetlink), a helper assigned to connections (iptables' raw `-j CT
--helper`, nft `ct helper set`, or the old automatic assignment `net.netfilter.nf_conntrack_helper = 1`), a notrack
rule (`-j NOTRACK`, `-j CT --notrack`, nft `notrack`) or a zone (`-j CT --zone`, nft `ct zone set`). `why_not`
reads the namespace's configuration for any of these; the program gets HFX_CT_NONE only when it finds none and
could read everything. The policy sync service follows later changes with it (ops.policysync.newflows; docs/xdp.md
"Following the configuration").

`Gate`: the program's other half of the permission. The host's watcher (driver/xdp/setwatch.bpf.c) counts, per
namespace, every change that could bring one of these (a legacy raw table replaced, an nf_tables batch that adds a
rule or an object) as it enters the kernel; the program reads a miss as ct 3 only while that count is the one the
permission was granted at (hfx_ctsync), so a grant is made with the count read, settled, before the check began.
"""

from __future__ import annotations

import re
import struct
import time
from pathlib import Path

from hypafilter import netns

# nft's listing (native rules, and iptables-nft's xt targets), iptables-save's (nft and legacy back ends)
NFT_SIGNS = re.compile(r'\bnotrack\b|\bct helper\b|\bct zone set\b|\bct expectation\b|xt target "?(CT|NOTRACK)\b')
IPT_SIGNS = re.compile(r"-j (CT|NOTRACK)\b")


def why_not(ns: str | None) -> str:
    """'' when nothing in namespace `ns` can make a frame without a conntrack entry RELATED or UNTRACKED (or look it
    up in another zone); else the first reason found, or what could not be read."""
    try:
        ruleset = netns.run(["nft", "list", "ruleset"], ns)
    except netns.CommandError as e:
        return f"nft list ruleset: {e}"
    m = NFT_SIGNS.search(ruleset)
    if m:
        return f"the ruleset has {m.group(0)!r} (a helper, notrack or zone)"
    # ip6tables-legacy's raw table too: the IPv6 plan's misses are read the same way (ip6tables-nft's rules are in
    # nft's listing)
    for tool in ("iptables-save", "iptables-legacy-save", "ip6tables-legacy-save"):
        try:
            text = netns.run([tool], ns, check=tool == "iptables-save")
        except netns.CommandError as e:
            if tool == "iptables-save":
                return f"{tool}: {e}"
            continue  # no legacy back end installed: no legacy tables either
        m = IPT_SIGNS.search(text)
        if m:
            return f"{tool} has {m.group(0)!r} (a helper, notrack or zone)"
    try:
        if netns.run(["sysctl", "-n", "net.netfilter.nf_conntrack_helper"], ns, check=False).strip() == "1":
            return "net.netfilter.nf_conntrack_helper = 1 (helpers assigned automatically)"
    except netns.CommandError:
        pass  # the sysctl is gone since Linux 6.0: no automatic assignment
    try:
        exp = netns.run(["conntrack", "-L", "expect"], ns)
    except netns.CommandError as e:
        return f"conntrack -L expect: {e}"
    if exp.strip():
        return f"conntrack holds {len(exp.strip().splitlines())} expectation(s)"
    return ""


CTSYNC_SEQ, CTSYNC_NETNS = 0, 1  # hfx_ctsync (driver/xdp/hf_fastpath.h HFX_CTSYNC_*)
GRANT_NONE = (1 << 64) - 1  # no count equals it: no miss is ct 3 until a grant
SETTLE_S = 1.0  # how long a grant waits for changes that entered the kernel to return


class Gate:
    """hfx_ctseq and hfx_ctsync of the program pinned at `pin`, following namespace `ns`. `linked()`: its count map
    is the watcher's (else no change is counted and nothing may be granted)."""

    def __init__(self, pin: str | Path, ns: str | None):
        from hypafilter.targets.xdp.sets import netns_inum

        self.pin = Path(pin)
        self.netns = netns_inum(ns)

    def linked(self) -> bool:
        return (self.pin / "hfx_ctseq").is_symlink()

    def counts(self) -> tuple[int, int]:
        """(started, finished) changes of the namespace so far."""
        from hypafilter.targets.bpfmap import PinnedMap

        with PinnedMap(self.pin / "hfx_ctseq") as m:
            v = m.get(struct.pack("<I", self.netns))
        return struct.unpack("<QQ", v) if v is not None else (0, 0)

    def settled(self, timeout: float = 0.0) -> int | None:
        """The STARTED count once every change counted has returned (None: not linked, or not within `timeout`):
        a check begun after this read sees every change it counts."""
        if not self.linked():
            return None
        deadline = time.monotonic() + timeout
        while True:
            started, finished = self.counts()
            if started == finished:
                return started
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.002)

    def granted(self) -> int:
        from hypafilter.targets.bpfmap import PinnedArray

        with PinnedArray(self.pin / "hfx_ctsync") as m:
            return struct.unpack("<Q", m.read(CTSYNC_SEQ))[0]

    def current(self) -> bool:
        """Whether the program reads a miss as ct 3 now (HFX_CT_NONE aside)."""
        return self.granted() == self.counts()[0]

    def grant(self, seq: int | None) -> None:
        """Misses read as ct 3 while the count stays `seq` (None: GRANT_NONE, none)."""
        from hypafilter.targets.bpfmap import PinnedArray

        with PinnedArray(self.pin / "hfx_ctsync") as m:
            m.write(struct.pack("<Q", self.netns), CTSYNC_NETNS)
            m.write(struct.pack("<Q", GRANT_NONE if seq is None else seq), CTSYNC_SEQ)
