"""Established connections without opening them: conntrack entries created with `conntrack -R` in a namespace, as
conntrack has them once it has seen the reply (`bench rate --established`, and its `xdp_prog` measure in the test
run's namespace: tools/bench/xdpcost.py). The TCP entries are marked liberal as the flow sync service marks the ones
it offloads (the XDP program decides established TCP only on such entries, docs/xdp.md)."""

from __future__ import annotations

import tempfile

from hypafilter import netns
from hypafilter.errors import HypafilterError

CONNTRACK_TIMEOUT = 600  # seconds: the pre-created entries outlive any run


def _ip(v: int) -> str:
    return ".".join(str((v >> s) & 0xFF) for s in (24, 16, 8, 0))


def open_flows(ns: str, flows: list[tuple], liberal: bool = True) -> None:
    """conntrack entries for `flows` in namespace `ns`, as conntrack has them for an established connection whose
    reply it has seen (TCP: state ESTABLISHED); every other entry removed first. `liberal`: the TCP entries marked
    as the flow sync service marks them (`mark_liberal`)."""
    netns.run(["conntrack", "-F"], ns, check=False)
    lines = []
    for proto, src, dst, sport, dport in flows:
        name = "tcp" if proto == 6 else "udp"
        line = (
            f"-I -s {_ip(src)} -d {_ip(dst)} -r {_ip(dst)} -q {_ip(src)} -p {name} --sport {sport} --dport {dport}"
            f" --reply-port-src {dport} --reply-port-dst {sport} -t {CONNTRACK_TIMEOUT} -u SEEN_REPLY,ASSURED"
        )
        lines.append(line + (" --state ESTABLISHED" if proto == 6 else ""))
    if not flows:
        return
    with tempfile.NamedTemporaryFile("w", suffix=".ct") as f:
        f.write("\n".join(lines) + "\n")
        f.flush()
        try:
            netns.run(["conntrack", "-R", f.name], ns, timeout=None)
        except netns.CommandError as e:
            raise HypafilterError(f"creating {len(flows)} conntrack entries in {ns} failed: {e}") from e
    have = netns.run(["conntrack", "-C"], ns).strip()
    if int(have or 0) < len(flows):
        raise HypafilterError(f"{ns}: {have} conntrack entries after creating {len(flows)}")
    if liberal:
        mark_liberal(ns)


def mark_liberal(ns: str) -> None:
    """IP_CT_TCP_FLAG_BE_LIBERAL in both directions on every TCP entry of `ns` (Conntrack's batch update)."""
    from hypafilter.hw.flowcache import PROTO_TCP
    from hypafilter.ops.flowsync.ctnetlink import Conntrack

    ct = Conntrack(ns)
    try:
        tcp = [ev for ev in ct.dump() if ev.proto == PROTO_TCP]
        done = ct.set_liberal_many(tcp)
    finally:
        ct.close()
    if not all(done):
        raise HypafilterError(
            f"{ns}: {done.count(False)} of {len(tcp)} TCP entries gone before they were marked liberal"
        )
