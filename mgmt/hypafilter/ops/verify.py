"""The kernel as oracle: the same frames through the hybrid path and the plain netfilter path, verdicts compared.

Frames go from the lab's sender through the emulated NIC and the firewall namespace (hybrid) and through the
plain namespace that holds only the original policy (oracle), and are captured at the receiver. Every frame
carries its id in the source MAC address (0e:48:<id, 4 bytes>), which survives every path and needs no payload,
so truncated and non-IP frames are matched too. A frame's verdict is "delivered" or not; a frame delivered on
the hybrid path must also be byte-identical to what was sent (tag popped, nothing else changed).

Host mode (a policy of the INPUT chain; the deployment's `nic_mode`): the frames are addressed to the firewall
itself (lab.HOST_MAC; every destination address is local there and in the plain namespace, `Lab.host_mode`), and
"delivered" means that INPUT let the frame through to the local stack, as the lab's `hf_host` table records it in
each namespace; the bytes compared are those the bridge passed up to the stack.
"""

from __future__ import annotations

import contextlib
import ctypes
import gzip
import os
import random
import select
import shlex
import socket
import struct
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from hypafilter import netns
from hypafilter.config import Config
from hypafilter.errors import HypafilterError
from hypafilter.iptables.writer import policy_restore
from hypafilter.ir import MAXV, PROTO_ICMP, PROTO_TCP, PROTO_UDP, Policy
from hypafilter.ir.semantics import OBSERVING_TARGETS
from hypafilter.netfilter import ipset
from hypafilter.netfilter.bridge import unfilterable_nft
from hypafilter.ops import connections, deploy, observers, verify6
from hypafilter.ops import connections as connections_mod
from hypafilter.ops.connections import ConnectionSpec
from hypafilter.ops.lab import HOST_MAC, HOST_SEEN_MAX, Lab
from hypafilter.shared import pack_meta
from hypafilter.targets.base import DECIDED, DECISIONS, SHUNTED, CounterSource, Target, WindowStages, stage_met

ETH_P_ALL = 0x0003
PACKET_OUTGOING = 4


def raw_socket(ns: str | None, ifname: str, rcvbuf: int = 8 << 20) -> socket.socket:
    """An AF_PACKET socket on `ifname` in namespace `ns` (sends raw frames, receives every frame)."""
    with netns.inside(ns):
        s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, rcvbuf)
        s.bind((ifname, 0))
    s.setblocking(False)
    return s


def drain(s: socket.socket) -> None:
    while True:
        try:
            s.recv(65536)
        except BlockingIOError:
            return


def receive(s: socket.socket, quiet: float = 0.3, limit: float = 10.0, want: int | None = None) -> list[bytes]:
    """Frames that arrive on `s` (not the ones it sent) until `quiet` seconds pass without one, or `want` came."""
    got: list[bytes] = []
    deadline = time.monotonic() + limit
    last = time.monotonic()
    while True:
        now = time.monotonic()
        if now > deadline or now - last > quiet or (want is not None and len(got) >= want):
            return got
        r, _, _ = select.select([s], [], [], min(quiet, 0.05))
        if not r:
            continue
        while True:
            try:
                data, addr = s.recvfrom(65536)
            except BlockingIOError:
                break
            if addr[2] != PACKET_OUTGOING:
                got.append(data)
                last = time.monotonic()


def send(s: socket.socket, frames: list[bytes], pace_every: int = 256, pace: float = 0.0005) -> None:
    """Send frames, pausing briefly every `pace_every` frames so the receiving path's queues do not overflow."""
    s.setblocking(True)
    try:
        for i, f in enumerate(frames):
            s.send(f)
            if pace and pace_every and i % pace_every == pace_every - 1:
                time.sleep(pace)
    finally:
        s.setblocking(False)


# ---- what verify refuses ----------------------------------------------------------------------------------------

# Matches whose outcome depends on chance, time or on how many packets a namespace has seen: the hybrid path
# shows software only the shunted packets, so such a rule cannot give both paths the same verdict per frame.
NONDETERMINISTIC = {
    "statistic": "random or every-nth sampling",
    "random": "random sampling",
    "nth": "every-nth sampling",
    "limit": "rate limiting",
    "hashlimit": "rate limiting",
    "quota": "byte quotas",
    "connlimit": "connection counts",
    "recent": "recently-seen lists",
    "time": "time of day",
    "cpu": "the receiving CPU",
    "rateest": "rate estimates",
}


def _matches_in(tokens) -> list[str]:
    """The matches of a rule that the comparison cannot follow (see comparable_state)."""
    toks = list(tokens)
    starts = [i for i, t in enumerate(toks[:-1]) if t in ("-m", "--match")]
    out = []
    for n, i in enumerate(starts):
        end = starts[n + 1] if n + 1 < len(starts) else len(toks)
        if not comparable_state(toks[i + 1], toks[i + 2 : end]):
            out.append(toks[i + 1])
    return out


def _value(opts: list[str], name: str) -> str | None:
    return opts[opts.index(name) + 1] if name in opts and opts.index(name) + 1 < len(opts) else None


def comparable_state(match: str, opts: list[str]) -> bool:
    """Per-rule state whose outcome both paths reach alike: the hybrid lets software see every packet that reaches
    such a match in the kernel, in the same order (a rule's hardware region stops at its first stateful match), so
    state driven only by those packets is compared frame by frame. That is statistic nth, quota, recent without
    timers, and rate or connection limits that cannot trigger within a run (10000/s, the fastest iptables takes,
    with a burst of at least 1000; connlimit at 10000 or more). Timers, chance and rates that do trigger are not."""
    if match == "statistic":
        return _value(opts, "--mode") == "nth"
    if match == "quota":
        return True
    if match == "recent":
        return not {"--seconds", "--reap"} & set(opts)
    if match in ("limit", "hashlimit"):
        key = "--limit" if match == "limit" else next((k for k in ("--hashlimit-upto", "--hashlimit") if k in opts), "")
        burst = _value(opts, "--limit-burst" if match == "limit" else "--hashlimit-burst") or "0"
        rate = _value(opts, key) or ""
        return rate.split("/")[0] == "10000" and rate.split("/")[-1].startswith("s") and int(burst) >= 1000
    if match == "connlimit":
        n = _value(opts, "--connlimit-above") or _value(opts, "--connlimit-upto")
        return n is not None and n.isdigit() and int(n) >= 10000
    return False


# State only the rule itself reads: on a rule that only observes (LOG, NFLOG, no target...) it changes what is logged,
# never a verdict, so verify compares such a policy's verdicts (and reports those rules' counters as not comparable).
PER_RULE_STATE = frozenset({"statistic", "random", "nth", "limit", "quota", "time", "cpu", "rateest"})
LIMIT_BURST_DEFAULT = 5  # xt_limit's and xt_hashlimit's burst when the rule names none
RECENT_MARGIN = 1.0  # seconds of a timed recent list's window that a run leaves unused (clock reads, jiffies)


def observing_target(target: str) -> bool:
    """A target that never decides and changes no state another rule reads (or no target at all)."""
    return not target or target in OBSERVING_TARGETS


def _token_target(toks) -> str:
    toks = list(toks)
    for i, t in enumerate(toks[:-1]):
        if t in ("-j", "--jump", "-g", "--goto"):
            return toks[i + 1]
    return ""


def _groups(toks) -> list[tuple[str, list[str]]]:
    """(match name, its options) of every `-m` of a rule, in order; the options end at the next -m or the target."""
    toks = list(toks)
    starts = [i for i, t in enumerate(toks[:-1]) if t in ("-m", "--match")]
    out = []
    for n, i in enumerate(starts):
        end = starts[n + 1] if n + 1 < len(starts) else len(toks)
        opts = toks[i + 2 : end]
        for j, t in enumerate(opts):
            if t in ("-j", "--jump", "-g", "--goto"):
                opts = opts[:j]
                break
        out.append((toks[i + 1], opts))
    return out


def _shared_state(toks) -> bool:
    """Matches whose state other rules read: a recent list it writes (--set, --update, --remove), a hashlimit
    table (named, shared by every rule of that name)."""
    return any(m == "hashlimit" or (m == "recent" and "--rcheck" not in o) for m, o in _groups(toks))


def policy_groups(policy: Policy) -> list[tuple[str, list[str]]]:
    """(match name, options) of every match of every rule of the policy (_groups)."""
    return [g for rules in chains_of(policy).values() for toks in rules for g in _groups(toks)]


def chains_of(policy: Policy) -> dict[str, list[tuple[str, ...]]]:
    """The policy's chains as the oracle loads them (policy_restore): the base chain's rules as written, every user
    chain verbatim; each rule as its tokens after the chain name."""
    return {policy.base_chain: list(policy.original_rules), **{n: list(c.rules) for n, c in policy.user_chains.items()}}


def neutral_rules(chains: dict[str, list[tuple[str, ...]]]) -> set[tuple[str, int]]:
    """(chain, index) of the rules whose outcome changes no verdict and no state another rule reads: a rule that
    only observes (LOG, NFLOG, no target), a jump (-j, not -g) to a chain whose rules are all such, and a RETURN
    after which the chain holds only such rules (whether it returns or runs on to its end, the caller goes on from
    the same place); none of them writes a recent list or a hashlimit table. ufw's logging chains are such: their
    `-m limit` decides what is logged, never a verdict (ufw-logging-deny's `-m limit ... -j RETURN`)."""
    neutral: set[tuple[str, int]] = set()
    log_only: set[str] = set()
    changed = True
    while changed:
        changed = False
        for name, rules in chains.items():
            for i, toks in enumerate(rules):
                if (name, i) in neutral or _shared_state(toks):
                    continue
                t = _token_target(toks)
                goto = "-g" in toks or "--goto" in toks
                rest = all((name, j) in neutral for j in range(i + 1, len(rules)))
                if observing_target(t) or (t in log_only and not goto) or (t == "RETURN" and rest):
                    neutral.add((name, i))
                    changed = True
            if name not in log_only and all((name, i) in neutral for i in range(len(rules))):
                log_only.add(name)
                changed = True
    return neutral


RATE_UNITS = {
    "s": 1,
    "sec": 1,
    "second": 1,
    "m": 60,
    "min": 60,
    "minute": 60,
    "h": 3600,
    "hour": 3600,
    "d": 86400,
    "day": 86400,
}
HASHLIMIT_EXPIRE_DEFAULT = 10.0  # seconds: xt_hashlimit's --hashlimit-htable-expire when the rule names none


def token_seconds(rate: str) -> float | None:
    """Seconds one token of a packet rate takes to refill (`3/min` -> 20.0); None for a rate iptables would not
    take or a byte rate (`1kb/s`)."""
    n, _, unit = rate.partition("/")
    unit = unit.lower() or "s"
    if not n.isdigit() or int(n) == 0 or unit not in RATE_UNITS:
        return None
    return RATE_UNITS[unit] / int(n)


@dataclass(frozen=True)
class Limited:
    """A rule whose verdict a rate limit (-m limit, -m hashlimit) or a timed recent list (-m recent --seconds or
    --reap) can decide. verify makes both paths start the same (full buckets, empty lists) and compares it under
    conditions it checks after the run (limits_after; the argument: docs/verify.md)."""

    where: str
    chain: str
    index: int  # its position in `chain` as the oracle loads it
    match: str  # limit, hashlimit, recent
    opts: tuple[str, ...]
    upto: bool = False  # the match is true while within the rate (limit, --hashlimit-upto)
    last: bool = False  # the rule's last match
    burst: int = 0
    token: float = 0.0  # seconds one token takes to refill
    expire: float = 0.0  # hashlimit: seconds an idle entry lives
    seconds: int = 0  # recent: --seconds
    name: str = ""  # hashlimit table or recent list

    def describe(self) -> str:
        return f"{self.where}: -m {self.match} {' '.join(self.opts)}"


def _limited(where: str, chain: str, index: int, toks) -> tuple[list[Limited], list[str]]:
    """The Limited matches of a rule and the names of the matches verify cannot compare at all."""
    groups = _groups(toks)
    out, refused = [], []
    for k, (m, opts) in enumerate(groups):
        if m not in NONDETERMINISTIC or comparable_state(m, opts):
            continue
        last = k == len(groups) - 1
        if m == "limit":
            token = token_seconds(_value(opts, "--limit") or "3/hour")  # xt_limit's default rate
            burst = int(_value(opts, "--limit-burst") or LIMIT_BURST_DEFAULT)
            if token is None:
                refused.append(m)
                continue
            out.append(Limited(where, chain, index, m, tuple(opts), True, last, burst, token))
        elif m == "hashlimit":
            above = _value(opts, "--hashlimit-above")
            token = token_seconds(above or _value(opts, "--hashlimit-upto") or _value(opts, "--hashlimit") or "")
            # a byte rate (a packet's cost is its length) or the rate-match mode: not a bucket of packets
            if token is None or {"--hashlimit-rate-match", "--hashlimit-rate-interval"} & set(opts):
                refused.append(m)
                continue
            burst = int(_value(opts, "--hashlimit-burst") or LIMIT_BURST_DEFAULT)
            expire = int(_value(opts, "--hashlimit-htable-expire") or HASHLIMIT_EXPIRE_DEFAULT * 1000) / 1000
            name = _value(opts, "--hashlimit-name") or ""
            out.append(Limited(where, chain, index, m, tuple(opts), not above, last, burst, token, expire, name=name))
        elif m == "recent" and {"--seconds", "--reap"} & set(opts):
            seconds = int(_value(opts, "--seconds") or 0)
            if seconds <= 0:
                refused.append(m)
                continue
            name = _value(opts, "--name") or "DEFAULT"
            out.append(Limited(where, chain, index, m, tuple(opts), last=last, seconds=seconds, name=name))
        else:
            refused.append(m)
    return out, refused


def refuse_nondeterministic(policy: Policy, limits: bool = True) -> list[Limited]:
    """HypafilterError naming file:line of the first rule whose verdict is not a function of the frame; else the
    rules verify compares under run-time conditions (Limited). Per-rule state on a neutral rule (neutral_rules)
    never decides a verdict. `limits=False` (what a benchmark takes, which checks nothing after its run): the
    Limited rules are refused too."""
    chains = chains_of(policy)
    neutral = neutral_rules(chains)
    lines = list(dict.fromkeys(r.origin.line for r in policy.rules if r.origin))
    found: list[Limited] = []
    for chain, rules in chains.items():
        for i, toks in enumerate(rules):
            if chain == policy.base_chain:
                line = lines[i] if len(lines) == len(rules) else None
                where = f"{policy.source}:{line}" if line else f"{policy.source}: chain {chain} rule {i + 1}"
            else:
                where = f"{policy.source}: chain {chain} rule {i + 1}"
            matches = _matches_in(toks)
            skip = PER_RULE_STATE if (chain, i) in neutral else frozenset()
            bad = [m for m in matches if m in NONDETERMINISTIC and m not in skip]
            if not bad:
                continue
            limited, refused = _limited(where, chain, i, toks)
            limited = [x for x in limited if x.match not in skip]
            if not limits and limited:
                refused.append(limited[0].match)
            for m in refused:
                raise HypafilterError(
                    f"{where}: verify refuses match '{m}' ({NONDETERMINISTIC[m]}): its verdict is not a function "
                    "of the frame, so the hybrid path and the oracle cannot be compared frame by frame"
                )
            found += limited
    return found


# ---- rate limits and timed lists at run time ---------------------------------------------------------------------

HASHLIMIT_FULL_WAIT = 5.0  # seconds verify waits for spent hashlimit buckets of an earlier run to fill up again


def _saved_rules(ns: str, table: str) -> list[tuple[str, list[str], int]]:
    """(chain, tokens after the chain name, packets) of every rule in `ns`'s table, from `iptables-save -c`."""
    out = []
    for line in netns.run(["iptables-save", "-c", "-t", table], ns).splitlines():
        if line.startswith("[") and "] -A " in line:
            head, _, rest = line.partition("] -A ")
            chain, _, body = rest.partition(" ")
            out.append((chain, shlex.split(body), int(head[1:].split(":")[0])))
    return out


def _contains(toks: list[str], part: list[str]) -> bool:
    n = len(part)
    return any(toks[i : i + n] == part for i in range(len(toks) - n + 1))


def _count(saved: list[tuple[str, list[str], int]], part: list[str]) -> int:
    """Packets of the saved rules that hold the match `part` (every copy of a rule in the firewall adds up)."""
    return sum(n for _, toks, n in saved if _contains(toks, part))


def _fragment(lim: Limited, oracle: list[tuple[str, list[str], int]]) -> list[str]:
    """The limited match as the kernel renders it (`-m NAME` and its options, from the oracle's own rule)."""
    rules = [toks for chain, toks, _ in oracle if chain == lim.chain]
    if lim.index >= len(rules):
        raise HypafilterError(f"verify: {lim.where} is not in the oracle's table")
    for m, opts in _groups(rules[lim.index]):
        if m == lim.match and (lim.match != "recent" or {"--seconds", "--reap"} & set(opts)):
            return ["-m", m, *opts]
    raise HypafilterError(f"verify: {lim.where}: -m {lim.match} not found in the oracle's rendering of the rule")


def _proc_net(ns: str, path: str) -> str | None:
    """The text of /proc/net/<path> as namespace `ns` sees it; None when it does not exist."""
    with netns.inside(ns):
        try:
            with open(f"/proc/thread-self/net/{path}") as f:
                return f.read()
        except FileNotFoundError:
            return None


def clear_recent(ns: str, name: str) -> None:
    """Empty the recent list `name` in `ns` (xt_recent: writing "/" to its /proc file), if it exists."""
    with netns.inside(ns):
        try:
            with open(f"/proc/thread-self/net/xt_recent/{name}", "w") as f:
                f.write("/\n")
        except FileNotFoundError:
            pass


def hashlimit_spent(ns: str, name: str) -> int:
    """Entries of hashlimit table `name` in `ns` whose bucket is not full (credit below its cap, as the kernel
    prints it after refilling: /proc/net/ipt_hashlimit/<name>); a full entry acts as a new one."""
    text = _proc_net(ns, f"ipt_hashlimit/{name}") or ""
    spent = 0
    for line in text.splitlines():
        f = line.split()
        if len(f) >= 5 and int(f[-3]) < int(f[-2]):
            spent += 1
    return spent


RATE_MARGIN = 0.9  # a run must stay under this share of one token's refill time, less RECENT_MARGIN


def _renew_limits(limited: list[Limited], ns: str, table: str, oracle: list[tuple[str, list[str], int]]) -> None:
    """Every rule of `ns` that holds a Limited -m limit replaced by itself (`iptables -R`): a new rule instance,
    whose bucket the kernel fills when it loads it (xt_limit keeps its state per instance)."""
    parts = [_fragment(lim, oracle) for lim in limited if lim.match == "limit"]
    if not parts:
        return
    position: dict[str, int] = {}
    for chain, toks, _ in _saved_rules(ns, table):
        position[chain] = position.get(chain, 0) + 1
        if any(_contains(toks, part) for part in parts):
            netns.run(["iptables", "-w", "-t", table, "-R", chain, str(position[chain]), *toks], ns)


def limits_before(limited: list[Limited], policy: Policy, lab_ns: dict[str, str], table: str) -> dict:
    """Both paths' limit state made the same before the frames (docs/verify.md): every recent list of the policy
    emptied; every Limited -m limit a new rule instance in the firewall (the oracle's policy was just loaded); every
    hashlimit table of a Limited rule full (waiting up to HASHLIMIT_FULL_WAIT for buckets an earlier run spent).
    Then the rules' counters and the clock."""
    recent = {_value(o, "--name") or "DEFAULT" for m, o in policy_groups(policy) if m == "recent"}
    if not limited and not recent:
        return {"start": time.monotonic(), "fw": [], "plain": []}
    for name in sorted(recent):
        for role in ("fw", "plain"):
            clear_recent(lab_ns[role], name)
    _renew_limits(limited, lab_ns["fw"], table, _saved_rules(lab_ns["plain"], table))
    deadline = time.monotonic() + HASHLIMIT_FULL_WAIT
    for lim in limited:
        if lim.match != "hashlimit":
            continue
        for role in ("fw", "plain"):
            while (n := hashlimit_spent(lab_ns[role], lim.name)) and time.monotonic() < deadline:
                time.sleep(0.1)
            if n:
                raise HypafilterError(
                    f"verify: no verdict for {lim.where}: hashlimit table {lim.name} in {lab_ns[role]} still holds "
                    f"{n} spent buckets of an earlier run after {HASHLIMIT_FULL_WAIT:.0f} s; run verify again later"
                )
    return {
        "start": time.monotonic(),
        "fw": _saved_rules(lab_ns["fw"], table),
        "plain": _saved_rules(lab_ns["plain"], table),
    }


def limit_condition(lim: Limited, elapsed: float, delta: dict[str, int]) -> tuple[str, str]:
    """(the condition of docs/verify.md that held, "") or ("", why none did), for a Limited rule over a run of
    `elapsed` seconds from full buckets and empty lists, its rule having matched `delta` packets on each path."""
    if lim.match == "recent":
        if elapsed < lim.seconds - RECENT_MARGIN:
            return f"the run took {elapsed:.1f} s, under --seconds {lim.seconds}: every hit inside the window", ""
        return "", f"the run took {elapsed:.1f} s, not under --seconds {lim.seconds} less {RECENT_MARGIN:.0f} s"
    if not delta["hybrid"] and not delta["oracle"]:
        return "its rule matched no packet on either path", ""
    bound = lim.token * RATE_MARGIN - RECENT_MARGIN
    if lim.match == "hashlimit":
        bound = min(bound, lim.expire - RECENT_MARGIN)
    if elapsed < bound:
        return (
            f"the run took {elapsed:.1f} s, under one token's refill ({lim.token:g} s): the first {lim.burst} "
            "packets of each bucket pass, every later one is refused, on both paths",
            "",
        )
    if lim.upto and lim.last and max(delta.values()) < lim.burst:
        return f"its rule passed {max(delta.values())} packets, under the burst {lim.burst}: never refused one", ""
    return "", (
        f"matched {delta['oracle']} packets on the oracle path and {delta['hybrid']} on the hybrid one in "
        f"{elapsed:.1f} s, longer than {bound:.1f} s (one token's refill, {lim.token:g} s, less a margin), and "
        f"{'not under its burst' if lim.upto and lim.last else 'not as its rule last match of a rate'}: the "
        "paths' clocks may decide differently"
    )


def limits_after(limited: list[Limited], before: dict, lab_ns: dict[str, str], table: str) -> dict:
    """The Limited rules' counters on both paths over the run and the condition that held for each
    (limit_condition; HypafilterError, no verdict, when none did). A rule whose counters differ between the paths
    is a mismatch: the hybrid ran it on other frames than the kernel did."""
    elapsed = time.monotonic() - before["start"]
    rows: list[dict] = []
    if not limited:
        return {"rules": rows, "mismatches": 0, "examples": [], "seconds": round(elapsed, 3)}
    after = {role: _saved_rules(lab_ns[role], table) for role in ("fw", "plain")}
    examples = []
    for lim in limited:
        part = _fragment(lim, after["plain"])
        delta = {
            "hybrid": _count(after["fw"], part) - _count(before["fw"], part),
            "oracle": _count(after["plain"], part) - _count(before["plain"], part),
        }
        held, undecided = limit_condition(lim, elapsed, delta)
        row = {"rule": lim.describe(), **delta, "held": held}
        if delta["hybrid"] != delta["oracle"]:
            examples.append(row)
        elif undecided:
            raise HypafilterError(f"verify: no verdict for {lim.describe()}: it {undecided}; send fewer --packets")
        rows.append(row)
    return {"rules": rows, "mismatches": len(examples), "examples": examples[:10], "seconds": round(elapsed, 3)}


# ---- frames -------------------------------------------------------------------------------------------------------

ID_MAC_PREFIX = b"\x0e\x48"  # locally administered unicast; the other 4 bytes are the frame id
DST_MAC = bytes.fromhex("0e48fffffffe")  # owned by nobody: flooded by the bridges, ignored by the receiver's stack
# What `verify` sends by default besides well-formed frames.
MALFORMED_KINDS = (
    "ip_options",
    "fragment_first",
    "fragment_later",
    "truncated_ip",
    "truncated_l4",
    "bad_ethertype",
    "vlan",
    "smuggled_tag",
    "runt",
)
# Frames chosen to find where a hardware parser and the kernel bridge part ways (`--kinds` selects them; the
# fuzzer sends them all). See docs/deploy.md for what the kernel itself does with each.
ADVERSARIAL_KINDS = (
    "vlan_vid0",  # 802.1Q priority tag: VID 0, the frame belongs to the port's native VLAN
    "vlan_8021ad",  # one 802.1ad (0x88A8) service tag
    "qinq",  # two tags: 0x88A8 or 0x8100 outside, 0x8100 inside
    "fragment_middle",  # MF set, offset > 0
    "fragment_last",  # MF clear, offset > 0
    "bad_ip_checksum",
    "trailing_bytes",  # bytes after the IP datagram (total length shorter than the frame)
    "link_local_dst",  # destination 01:80:C2:00:00:00..0F, the bridge's reserved group addresses
    "unknown_ethertype",  # an ethertype nobody uses, never one the kernel knows
)
FRAME_KINDS = MALFORMED_KINDS + ADVERSARIAL_KINDS
# Attack shapes (`--attack`): frames of flows conntrack does not hold, from spoofed sources (docs/xdp.md "New flows").
# Their probes' kind is "attack_<shape>", so that the report counts them apart (by_kind).
ATTACK_SHAPES = (
    "syn",  # a SYN flood
    "ack",  # ACK segments without a connection
    "rst",  # RST scan
    "fin",  # FIN, FIN|PSH|URG (xmas) and no-flag (null) scans
    "udp",  # UDP flood
    "frag",  # a first or later fragment of a new TCP or UDP flow
    "icmp_error",  # ICMP destination unreachable quoting a flow sent before in this run, or an invented one
)
STRING_MARKER = b"BAD"  # what string-match payloads carry when the policy names no string of its own


@dataclass
class Probe:
    uid: int
    kind: str
    frame: bytes


def frame_id(frame: bytes) -> int | None:
    if len(frame) >= 12 and frame[6:8] == ID_MAC_PREFIX:
        return int.from_bytes(frame[8:12], "big")
    return None


def _csum(b: bytes) -> int:
    if len(b) % 2:
        b += b"\0"
    s = sum(int.from_bytes(b[i : i + 2], "big") for i in range(0, len(b), 2))
    while s >> 16:
        s = (s & 0xFFFF) + (s >> 16)
    return ~s & 0xFFFF


def _fix_ip(frame: bytearray, l3: int = 14) -> None:
    ihl = (frame[l3] & 0xF) * 4
    frame[l3 + 10 : l3 + 12] = b"\0\0"
    frame[l3 + 10 : l3 + 12] = _csum(bytes(frame[l3 : l3 + ihl])).to_bytes(2, "big")


def read_trace(path: str | Path, limit: int, rng: random.Random) -> list[dict]:
    """Headers from a ClassBench trace (SRC DST SPORT DPORT PROTO FLAGS FILTER, addresses as integers)."""
    opener = gzip.open if str(path).endswith(".gz") else open
    rows = []
    try:
        with opener(path, "rt") as f:
            for lineno, line in enumerate(f, 1):
                parts = line.split()
                if not parts:
                    continue
                try:
                    src, dst, sport, dport, proto = (int(x, 0) for x in parts[:5])
                    flags = int(parts[5], 0) if len(parts) > 5 else 0
                except ValueError:
                    raise HypafilterError(f"{path}:{lineno}: not a ClassBench trace line: {line.strip()!r}") from None
                rows.append({"src": src, "dst": dst, "sport": sport, "dport": dport, "proto": proto, "flags": flags})
    except OSError as e:
        raise HypafilterError(f"{path}: {e.strerror or e}") from e
    if not rows:
        raise HypafilterError(f"{path}: empty trace")
    return [rows[i] for i in sorted(rng.sample(range(len(rows)), limit))] if len(rows) > limit else rows


class FrameGen:
    """Random headers biased to the policy's own boxes (their corners and just outside them), some fully random."""

    COMMON_FLAGS = (0x02, 0x10, 0x12, 0x11, 0x04, 0x18, 0x00, 0x14, 0x29)

    def __init__(self, policy: Policy, rng: random.Random, bad_share: float = 0.2):
        self.rng = rng
        self.bad_share = bad_share
        self.boxes = [b for r in policy.rules for b in r.boxes]
        self.needles = [STRING_MARKER, *policy_strings(policy)]
        self.members = set_members(policy)

    def _pick(self, lo: int, hi: int, top: int) -> int:
        r = self.rng.random()
        if r < 0.25:
            return lo
        if r < 0.45:
            return hi
        if r < 0.55:
            return max(0, lo - 1)
        if r < 0.65:
            return min(top, hi + 1)
        return self.rng.randint(lo, hi)

    def header(self) -> dict:
        rng = self.rng
        box = rng.choice(self.boxes) if self.boxes and rng.random() < 0.85 else None
        h: dict = {}
        for i, name in enumerate(("src", "dst", "proto", "sport", "dport", "icmp_type", "icmp_code")):
            if box is not None and rng.random() < 0.9:
                h[name] = self._pick(box.lo[i], box.hi[i], MAXV[i])
            else:
                h[name] = rng.randint(0, MAXV[i])
        if box is None or box.hi[2] - box.lo[2] > 16 or rng.random() < 0.1:
            h["proto"] = rng.choice((PROTO_TCP, PROTO_TCP, PROTO_UDP, PROTO_UDP, PROTO_ICMP, 47, rng.randint(0, 255)))
        flags = rng.choice(self.COMMON_FLAGS)
        if box is not None and box.flags_mask and rng.random() < 0.6:
            flags = (flags & ~box.flags_mask) | box.flags_value
        h["flags"] = flags
        if self.members and rng.random() < 0.4:  # a set's element (or just beside it) by a set match's directions
            self.member(h, *rng.choice(self.members))
        return h

    def member(self, h: dict, settype: str, dirs: tuple[str, ...], e) -> None:
        """Header `h` made to hit element `e` of a set matched by `dirs`, or its edges and just outside them."""
        rng = self.rng
        if settype != "bitmap:port":
            a = dirs[0] if dirs else "src"
            h[a] = self._pick(e.addr_lo, e.addr_hi, MAXV[0])
        if settype in ("hash:ip,port", "hash:net,port") and len(dirs) > 1:
            proto = e.proto if rng.random() < 0.9 else rng.choice((PROTO_TCP, PROTO_UDP, PROTO_ICMP))
            h["proto"] = proto
            if proto == PROTO_ICMP:
                h["icmp_type"], h["icmp_code"] = e.port >> 8, e.port & 0xFF
            else:
                h["sport" if dirs[1] == "src" else "dport"] = self._pick(e.port, e.port, 0xFFFF)
        elif settype == "bitmap:port":
            if h["proto"] not in (PROTO_TCP, PROTO_UDP) or rng.random() < 0.5:
                h["proto"] = rng.choice((PROTO_TCP, PROTO_UDP))
            h["sport" if dirs[:1] == ("src",) else "dport"] = self._pick(e.port, e.port, 0xFFFF)

    def corners(self) -> list[dict]:
        """Two headers per box of the policy, in rule order: its low corner and its high corner (every field at the
        box's own bound; a protocol left free becomes UDP or TCP, so that the ports are read). What `--cover` sends
        first: each rule of the policy meets a frame at both ends of its ranges, where comparator bugs live."""
        out = []
        for box in self.boxes:
            for end in (box.lo, box.hi):
                h = {
                    n: end[i] for i, n in enumerate(("src", "dst", "proto", "sport", "dport", "icmp_type", "icmp_code"))
                }
                if box.hi[2] - box.lo[2] > 16:
                    h["proto"] = self.rng.choice((PROTO_TCP, PROTO_UDP))
                flags = self.rng.choice(self.COMMON_FLAGS)
                h["flags"] = (flags & ~box.flags_mask) | box.flags_value if box.flags_mask else flags
                out.append(h)
        return out

    def payload(self) -> bytes:
        n = self.rng.randint(0, 48)
        body = bytes(self.rng.getrandbits(8) for _ in range(n))
        if self.rng.random() < self.bad_share:
            at = self.rng.randint(0, n)
            body = body[:at] + self.rng.choice(self.needles) + body[at:]
        return body


def set_members(policy: Policy, per_set: int = 2000) -> list[tuple]:
    """(set type, directions, element) for the elements of every set the policy's -m set matches read (at most
    `per_set` of each, evenly spread), what verify's frames aim at besides the boxes (docs/sets.md)."""
    from hypafilter.iptables.sets import set_match

    out = []
    seen = set()
    for note in getattr(policy, "set_notes", ()):
        m = set_match(("-m", "set", *note.test.split()))
        if m is None:
            continue
        _, name, dirs_text, _ = m
        info = policy.sets.get(name)
        if info is None or (name, dirs_text) in seen or not info.entries:
            continue
        seen.add((name, dirs_text))
        step = max(1, len(info.entries) // per_set)
        dirs = tuple(dirs_text.split(","))
        out += [(info.settype, dirs, e) for e in info.entries[::step] if e.addr_hi or e.port or e.proto]
    return out


def _string_args(tokens) -> list[bytes]:
    toks = list(tokens)
    return [toks[i + 1].encode() for i, t in enumerate(toks[:-1]) if t == "--string"]


def policy_strings(policy: Policy) -> list[bytes]:
    """Every `-m string --string S` of the policy (rules and verbatim user chains), so that some payloads carry
    each S and string matches go both ways whatever their quotes, backslashes or `#`."""
    groups = [g for r in policy.rules for g in r.complex]
    groups += [toks for uc in policy.user_chains.values() for toks in uc.rules]
    return sorted({s for g in groups for s in _string_args(g)})


def build_frame(uid: int, h: dict, payload: bytes, dst_mac: bytes = DST_MAC) -> bytes:
    """Ethernet + IPv4 + TCP/UDP/ICMP bytes with valid checksums (struct, not scapy: 100x faster per frame)."""
    proto = h["proto"] & 0xFF
    src, dst = int(h["src"]).to_bytes(4, "big"), int(h["dst"]).to_bytes(4, "big")
    if proto == PROTO_TCP:
        l4 = struct.pack(
            "!HHIIBBHHH", h.get("sport", 0), h.get("dport", 0), uid, 0, 5 << 4, h.get("flags", 0) & 0xFF, 1024, 0, 0
        )
    elif proto == PROTO_UDP:
        l4 = struct.pack("!HHHH", h.get("sport", 0), h.get("dport", 0), 8 + len(payload), 0)
    elif proto == PROTO_ICMP:
        l4 = struct.pack("!BBHI", h.get("icmp_type", 8) & 0xFF, h.get("icmp_code", 0) & 0xFF, 0, uid)
    else:
        l4 = b""
    seg = bytearray(l4 + payload)
    if proto in (PROTO_TCP, PROTO_UDP):
        pseudo = src + dst + struct.pack("!BBH", 0, proto, len(seg))
        c = _csum(pseudo + bytes(seg))
        if proto == PROTO_UDP and c == 0:
            c = 0xFFFF
        off = 16 if proto == PROTO_TCP else 6
        seg[off : off + 2] = c.to_bytes(2, "big")
    elif proto == PROTO_ICMP:
        seg[2:4] = _csum(bytes(seg)).to_bytes(2, "big")
    ip = bytearray(struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + len(seg), uid & 0xFFFF, 0, 64, proto, 0, src, dst))
    ip[10:12] = _csum(bytes(ip)).to_bytes(2, "big")
    return dst_mac + ID_MAC_PREFIX + uid.to_bytes(4, "big") + b"\x08\x00" + bytes(ip) + bytes(seg)


def _ip(v: int) -> str:
    return socket.inet_ntoa(int(v).to_bytes(4, "big"))


def malform(kind: str, frame: bytes, rng: random.Random, generation: int = 0) -> bytes:
    """A malformed variant of a well-formed IPv4 frame (the id in the source MAC kept)."""
    f = bytearray(frame)
    ihl = (f[14] & 0xF) * 4
    total = int.from_bytes(f[16:18], "big")
    proto = f[23]
    if kind == "ip_options":
        words = rng.randint(1, 10)
        opts = b"\x01" * (4 * words - 1) + b"\x00"  # NOPs then end-of-list: valid options the kernel accepts
        f = f[: 14 + ihl] + bytearray(opts) + f[14 + ihl :]
        f[14] = 0x40 | (ihl // 4 + words)
        f[16:18] = (total + 4 * words).to_bytes(2, "big")
        _fix_ip(f)
    elif kind == "fragment_first":
        f[20:22] = (0x2000).to_bytes(2, "big")  # MF, offset 0
        _fix_ip(f)
    elif kind == "fragment_later":
        f[20:22] = ((0x2000 if rng.random() < 0.5 else 0) | rng.randint(1, 400)).to_bytes(2, "big")
        _fix_ip(f)
    elif kind == "truncated_ip":
        f = f[: rng.randint(min(14 + 20, len(f) - 1), len(f) - 1)]  # the header still claims the full length
    elif kind == "truncated_l4":
        keep = {PROTO_TCP: rng.randint(1, 19), PROTO_UDP: rng.randint(1, 7), PROTO_ICMP: rng.randint(1, 7)}
        cut = keep.get(proto, 0)
        if cut:
            f = f[: 14 + ihl + cut]
            f[16:18] = (ihl + cut).to_bytes(2, "big")
            _fix_ip(f)
    elif kind == "bad_ethertype":
        f[12:14] = rng.choice((0x1234, 0x88B6, 0x86DD, 0x0806, 0x9000)).to_bytes(2, "big")
    elif kind == "vlan":
        f = f[:12] + bytearray((0x8100).to_bytes(2, "big") + rng.randint(1, 4094).to_bytes(2, "big")) + f[12:]
    elif kind == "smuggled_tag":
        meta = pack_meta(rng.randint(0, 3), 1, 0, generation)
        f = f[:12] + bytearray((0x88B5).to_bytes(2, "big") + meta.to_bytes(8, "big")) + f[12:]
    elif kind == "runt":
        f = f[: rng.randint(15, 33)]
    elif kind in ("vlan_vid0", "vlan_8021ad", "qinq"):
        tags = {
            "vlan_vid0": [(0x8100, rng.randint(0, 7) << 13)],
            "vlan_8021ad": [(0x88A8, rng.randint(1, 4094))],
            "qinq": [(rng.choice((0x88A8, 0x8100)), rng.randint(0, 4094)), (0x8100, rng.randint(0, 4094))],
        }[kind]
        f = f[:12] + bytearray(b"".join(struct.pack("!HH", tpid, tci) for tpid, tci in tags)) + f[12:]
    elif kind in ("fragment_middle", "fragment_last"):
        f[20:22] = ((0x2000 if kind == "fragment_middle" else 0) | rng.randint(1, 0x1FFF)).to_bytes(2, "big")
        _fix_ip(f)
    elif kind == "bad_ip_checksum":
        f[24:26] = ((int.from_bytes(f[24:26], "big") + rng.randint(1, 0xFFFE)) % 0xFFFF).to_bytes(2, "big")
    elif kind == "trailing_bytes":
        f += bytearray(rng.getrandbits(8) for _ in range(rng.randint(1, 40)))
    elif kind == "link_local_dst":
        f[0:6] = bytes.fromhex("0180c20000") + bytes([rng.randint(0, 15)])
    elif kind == "unknown_ethertype":
        f[12:14] = rng.choice((0x0101, 0x1234, 0x5FFF, 0x88B6, 0x9999, 0xFFFF)).to_bytes(2, "big")
    else:
        raise ValueError(kind)
    return bytes(f)


@dataclass(frozen=True)
class ProbeSpec:
    """What to send: how many frames, from which seed, with headers from a trace or from the policy's boxes, the
    share of malformed frames (of `kinds`, any of FRAME_KINDS) and the share whose payload carries "BAD" or one
    of the policy's own strings, for string matches. `cover`: the first frames are the low and high corners of every
    rule's boxes in rule order (FrameGen.corners; as many as `packets` allows), then the drawn ones."""

    packets: int = 1000
    seed: int = 1
    trace: str | Path | None = None
    malformed: float = 0.1
    bad_share: float = 0.2
    kinds: tuple[str, ...] = MALFORMED_KINDS
    cover: bool = False
    attack: tuple[str, ...] = ()  # ATTACK_SHAPES to draw from for a share `attack_share` of the frames
    attack_share: float = 0.0

    def __post_init__(self) -> None:
        unknown_shapes = set(self.attack) - set(ATTACK_SHAPES)
        if unknown_shapes:
            raise HypafilterError(
                f"unknown attack shapes: {', '.join(sorted(unknown_shapes))} (choose from {', '.join(ATTACK_SHAPES)})"
            )
        if not 0.0 <= self.attack_share <= 1.0 or (self.attack_share and not self.attack):
            raise HypafilterError("--attack-share must be a share between 0 and 1, with --attack")
        if not 1 <= self.packets <= 0xFFFFFFFF:  # the frame id is 4 bytes of the source MAC
            raise HypafilterError("--packets must be between 1 and 2^32-1")
        if not 0.0 <= self.malformed <= 1.0:
            raise HypafilterError("--malformed must be a share between 0 and 1")
        unknown = set(self.kinds) - set(FRAME_KINDS)
        if unknown:
            raise HypafilterError(
                f"unknown frame kinds: {', '.join(sorted(unknown))} (choose from {', '.join(FRAME_KINDS)})"
            )
        if self.malformed and not self.kinds:
            raise HypafilterError("--malformed above 0 needs at least one frame kind")

    def probes(self, policy: Policy, generation: int = 0, dst_mac: bytes = DST_MAC) -> list[Probe]:
        """The frames, ids 1..packets; `generation` is what smuggled tags claim (the deployed one); `dst_mac`:
        the destination (host mode: the firewall's own address)."""
        rng = random.Random(self.seed)
        gen = FrameGen(policy, rng, self.bad_share)
        rows = read_trace(self.trace, self.packets, rng) if self.trace else None
        corners = gen.corners() if self.cover else []
        out: list[Probe] = []
        sent: list[dict] = []  # well-formed TCP/UDP headers sent so far: the flows ICMP errors quote
        for uid in range(1, self.packets + 1):
            if uid <= len(corners):  # well-formed: a corner checks the rule's comparators, not the parser
                out.append(Probe(uid, "normal", build_frame(uid, corners[uid - 1], gen.payload(), dst_mac)))
                continue
            k = uid - len(corners)
            h = rows[(k - 1) % len(rows)] if rows else gen.header()
            if self.attack and self.attack_share and rng.random() < self.attack_share:
                shape = rng.choice(self.attack)
                out.append(Probe(uid, f"attack_{shape}", attack_frame(uid, shape, h, rng, sent, dst_mac)))
                continue
            if h.get("proto") in (PROTO_TCP, PROTO_UDP):
                sent.append(h)
            frame = build_frame(uid, h, gen.payload(), dst_mac)
            kind = "normal"
            if rng.random() < self.malformed:
                kind = rng.choice(self.kinds)
                frame = malform(kind, frame, rng, generation)
            out.append(Probe(uid, kind, frame))
        return out


def spoofed_source(rng: random.Random) -> int:
    """A unicast address outside 0/8, 127/8 and class D/E (a spoofing sender's pick)."""
    while True:
        a = rng.randint(0x01000000, 0xDFFFFFFF)
        if a >> 24 != 127:
            return a


def attack_frame(uid: int, shape: str, h: dict, rng: random.Random, sent: list[dict], dst_mac: bytes) -> bytes:
    """One frame of attack `shape` (ATTACK_SHAPES) aimed at the destination and ports of header `h` (drawn from the
    policy's boxes or a trace), from a spoofed source; `sent`: the well-formed TCP/UDP headers sent before."""
    a = dict(h, src=spoofed_source(rng), sport=rng.randint(1024, 65535))
    if shape in ("syn", "ack", "rst", "fin"):
        flags = {"syn": 0x02, "ack": 0x10, "rst": 0x04, "fin": rng.choice((0x01, 0x29, 0x00))}[shape]
        return build_frame(uid, dict(a, proto=PROTO_TCP, flags=flags), b"", dst_mac)
    if shape == "udp":
        return build_frame(uid, dict(a, proto=PROTO_UDP), bytes(rng.randint(0, 64)), dst_mac)
    if shape == "frag":
        proto = rng.choice((PROTO_TCP, PROTO_UDP))
        f = build_frame(uid, dict(a, proto=proto, flags=0x02), bytes(rng.randint(0, 64)), dst_mac)
        return malform(rng.choice(("fragment_first", "fragment_later")), f, rng)
    if shape == "icmp_error":
        q = dict(rng.choice(sent)) if sent and rng.random() < 0.5 else dict(a, proto=rng.choice((PROTO_TCP, PROTO_UDP)))
        inner = build_frame(0, q, b"")[14:]  # the quoted datagram: its IPv4 header and first 8 bytes
        ihl = (inner[0] & 0xF) * 4
        err = {
            "proto": PROTO_ICMP,
            "icmp_type": 3,
            "icmp_code": rng.choice((1, 3, 13)),
            "src": q["dst"],
            "dst": q["src"],
        }
        return build_frame(uid, err, inner[: ihl + 8], dst_mac)
    raise ValueError(shape)


def make_probes(policy: Policy, packets: int, generation: int = 0, **options) -> list[Probe]:
    """`packets` probes as `options` (the other ProbeSpec fields) describe them."""
    return ProbeSpec(packets, **options).probes(policy, generation)


# The NIC's counters of the wire frames it decided itself: forwarded, dropped by a rule, dropped as unfilterable.
HW_DECIDED = DECIDED
# ---- closing the receive window on counters ------------------------------------------------------------------------

SOL_PACKET = 263
PACKET_STATISTICS = 6
PACKET_IGNORE_OUTGOING = 23
SO_ATTACH_FILTER = 26
# The NIC's decision counters: every wire frame it classified (PKTIN) counts in exactly one of them (hw.model).
NIC_SHUNTED = SHUNTED
NIC_DECISIONS = DECISIONS
WINDOW_GRACE = 0.05  # the counters must read the same twice this far apart (see CounterWindow)
WINDOW_TIMEOUT = 120.0  # last resort: counters that never reconcile are an error, not a verdict


class WindowError(HypafilterError):
    """The counters of a verify run never reconciled: frames were lost or are stuck in the lab, so no verdict."""


class _NetDev:
    """/proc/net/dev of one namespace, opened inside it (the open file keeps that namespace): per interface
    (rx packets, rx dropped, tx packets, tx dropped)."""

    def __init__(self, ns: str):
        with netns.inside(ns):
            self.fd = os.open("/proc/thread-self/net/dev", os.O_RDONLY)

    def read(self) -> dict[str, tuple[int, int, int, int]]:
        os.lseek(self.fd, 0, os.SEEK_SET)
        chunks = []
        while chunk := os.read(self.fd, 65536):
            chunks.append(chunk)
        out = {}
        for line in b"".join(chunks).decode().splitlines()[2:]:
            name, _, rest = line.partition(":")
            f = [int(x) for x in rest.split()]
            out[name.strip()] = (f[1], f[3], f[9], f[11])
        return out

    def close(self) -> None:
        os.close(self.fd)


def _tap(ns: str, ifname: str, ours: bool = False) -> socket.socket:
    """A socket that only counts the frames `ifname` receives (PACKET_STATISTICS: every frame that reached it,
    queued or dropped for want of buffer), at the point where the namespace starts processing the frame: before
    a bridge, whose forwarding or dropping of it then runs to its end in the same softirq. `ours`: only frames
    whose source MAC carries a frame id (a socket filter), not what the lab's own stacks send."""
    s = raw_socket(ns, ifname, rcvbuf=4096)
    s.setsockopt(SOL_PACKET, PACKET_IGNORE_OUTGOING, 1)
    if ours:
        prefix = int.from_bytes(ID_MAC_PREFIX, "big")
        code = [(0x28, 0, 0, 6), (0x15, 0, 1, prefix), (0x06, 0, 0, 0xFFFF), (0x06, 0, 0, 0)]  # ldh [6]; jeq; ret
        prog = ctypes.create_string_buffer(b"".join(struct.pack("HBBI", *c) for c in code))
        s.setsockopt(socket.SOL_SOCKET, SO_ATTACH_FILTER, struct.pack("HL", len(code), ctypes.addressof(prog)))
    return s


def _packets_seen(s: socket.socket) -> tuple[int, int]:
    """(frames that reached the packet socket since the last call, of which dropped for want of buffer)."""
    seen, drops = struct.unpack("II", s.getsockopt(SOL_PACKET, PACKET_STATISTICS, 8))
    return seen, drops


QUIET_TABLE = "hf_verify_quiet"


@contextlib.contextmanager
def quiet_stacks(lab_ns: dict[str, str]) -> Iterator[None]:
    """The sender's and receiver's own IP and ARP stacks send nothing while the frames are exchanged (an
    output-hook drop in their namespaces; verify's raw frames do not pass it): a late retransmission or an ARP
    probe of an earlier connection check would otherwise travel the paths beside the frames."""
    text = "\n".join(
        f"table {fam} {QUIET_TABLE}\ndelete table {fam} {QUIET_TABLE}\n"
        f"table {fam} {QUIET_TABLE} {{\n  chain out {{\n    type filter hook output priority -300; policy drop;\n  }}\n}}"
        for fam in ("inet", "arp")
    )
    done = []
    try:
        for role in ("send", "recv"):
            netns.run(["nft", "-f", "-"], lab_ns[role], input=text + "\n")
            done.append(role)
        yield
    finally:
        for role in done:
            for fam in ("inet", "arp"):
                netns.run(["nft", "delete", "table", fam, QUIET_TABLE], lab_ns[role], check=False)


class CounterWindow:
    """When every frame verify sent has met its fate on both paths, from counters (not from quiet time).

    Counting sockets (`_tap`) count what a namespace took from a veth, at the point where its bridge (or the
    emulator's socket) takes it; veth tx counters what a namespace sent. The hybrid path's stages are the target's
    (`Target.window_stages`: which veths and taps to read, which of its counters, and how they balance; the emulated
    NIC's registers, the XDP program's per-CPU counters), its counters read through the target's counter source.
    Oracle path: the plain namespace took all N (by id), and the receiver captured every frame its bridge
    forwarded. Host mode: the bridges are where the frames end, so the receiver's captures do not count. Each
    stage is checked against the one before it, whatever the frames are; the starting point is taken when the
    lab is idle (`open`), so no frame from before sits between two counters, and verify keeps the sender's and
    receiver's own stacks quiet meanwhile (`quiet_stacks`).

    A bridge decides a frame in the softirq that took it, so once the counts agree nothing is on its way; the
    last reading must also repeat WINDOW_GRACE later. A frame the lab itself loses (tx dropped on a veth, a capture
    socket's drops, a loss counter of the target such as CNT_FIFO_DROP) or counters that do not reconcile within
    WINDOW_TIMEOUT raise WindowError naming the counters: then there is no verdict, never a silent mismatch."""

    # The oracle path's stages, the same on every target.
    TX = (("send", "plain0"), ("plain", "nf1"))
    TAPS = (("plain", "nf0", True),)

    def __init__(self, lab_ns: dict[str, str], source: CounterSource, stages: WindowStages, host: bool = False):
        self.ns = lab_ns
        self.source = source
        self.stages = stages
        self.host = host
        self.tx = (*stages.tx, *self.TX)
        self.dev = {role: _NetDev(lab_ns[role]) for role in {r for r, _ in self.tx}}
        taps = (*stages.taps, *self.TAPS)
        self.taps = {f"{r}.{i}{'.ours' if o else ''}": _tap(lab_ns[r], i, o) for r, i, o in taps}
        self.sent = 0
        self.tapped = dict.fromkeys(self.taps, 0)
        self.captured = {"hybrid": 0, "plain": 0}
        self.capture_drops = 0
        self.nic0: dict = {}
        self.dev0: dict = {}

    @classmethod
    def of(cls, target: Target, info: dict, lab_ns: dict[str, str], host: bool = False) -> CounterWindow:
        """The window of the NIC `info` of `target` (its stages, its counter source; `close` closes both)."""
        if target.window_stages is None:
            raise HypafilterError(f"target {target.name} has no counter window (Target.window_stages)")
        source = target.counter_source(info)
        try:
            return cls(lab_ns, source, target.window_stages, host)
        except BaseException:
            source.close()
            raise

    def nic_counters(self) -> dict:
        return self.source.counters()

    def open(self, captures: dict[str, socket.socket], timeout: float = WINDOW_TIMEOUT) -> None:
        """Take the counters' starting point once the lab is idle: nothing counted anywhere and nothing captured
        for WINDOW_GRACE (so no frame from before is still between two counters), the capture sockets emptied."""
        start = time.monotonic()
        last = None
        while True:
            moved = any(_packets_seen(s)[0] for s in self.taps.values())
            for s in captures.values():
                drain(s)
                _packets_seen(s)
            now = (self.nic_counters(), {role: d.read() for role, d in self.dev.items()})
            if now == last and not moved:
                self.nic0, self.dev0 = now
                return
            if time.monotonic() - start > timeout:
                raise WindowError(f"verify: the lab never went idle within {timeout:.0f} s before the frames were sent")
            last = now
            time.sleep(WINDOW_GRACE)

    def close(self) -> None:
        for d in self.dev.values():
            d.close()
        for s in self.taps.values():
            s.close()
        self.source.close()

    def reading(self) -> dict:
        """The counters now, as deltas since the window opened (taps, then the NIC, then the veths: each later
        count can only be larger, so equal counts mean nothing was between them)."""
        for name, s in self.taps.items():
            self.tapped[name] += _packets_seen(s)[0]
        nic = _counter_delta(self.nic0, self.nic_counters())
        dev = {}
        for role, ifname in self.tx:
            a, b = self.dev0[role].get(ifname), self.dev[role].read().get(ifname)
            if a is None or b is None:
                raise WindowError(f"verify: interface {ifname} missing in {self.ns[role]}")
            dev[f"{role}.{ifname}"] = {"tx": b[2] - a[2], "tx_dropped": b[3] - a[3]}
        return {
            "sent": self.sent,
            "nic": {k: nic.get(k, 0) for k in self.stages.counters},
            "dev": dev,
            "tapped": dict(self.tapped),
            "captured": dict(self.captured),
            "capture_drops": self.capture_drops,
        }

    def missing(self, r: dict) -> list[str]:
        """What is still on its way (empty: every frame met its fate). Raises WindowError on a lost frame."""
        lost = [f"{k} tx dropped {v['tx_dropped']}" for k, v in r["dev"].items() if v["tx_dropped"]]
        lost += [f"{k} {r['nic'][k]}" for k in self.stages.lost if r["nic"][k]]
        if r["capture_drops"]:
            lost.append(f"capture sockets dropped {r['capture_drops']}")
        if lost:
            raise WindowError(f"verify: the lab lost frames ({', '.join(lost)}), so there is no verdict: {r}")
        n, tap = r["sent"], r["tapped"]
        tx = {k: v["tx"] for k, v in r["dev"].items()}
        over = [f"{k} {v} > {n}" for k, v in tap.items() if k.endswith(".ours") and v > n]
        if over:
            raise WindowError(f"verify: more frames with our ids than were sent ({', '.join(over)}): {r}")
        want = dict(self.stages.balance(r, self.host))
        want["plain took ours"] = (tap["plain.nf0.ours"], n)
        if not self.host:
            want["receiver captured, plain"] = (r["captured"]["plain"], tx["plain.nf1"])
        return [
            f"{k} {got}/{exp[0]}..{exp[1]}" if isinstance(exp, tuple) else f"{k} {got}/{exp}"
            for k, (got, exp) in want.items()
            if not stage_met(got, exp)
        ]


# ---- running the comparison ---------------------------------------------------------------------------------------


def collect(
    socks: dict[str, socket.socket], got: dict[str, dict[int, list[bytes]]], quiet: float, limit: float
) -> None:
    """Read every socket until none has had a frame for `quiet` seconds (or `limit` passed)."""
    start = last = time.monotonic()
    by_fd = {s.fileno(): name for name, s in socks.items()}
    while True:
        now = time.monotonic()
        if now - last > quiet or now - start > limit:
            return
        r, _, _ = select.select(list(socks.values()), [], [], quiet / 4)
        for s in r:
            if _take(s, got[by_fd[s.fileno()]])[0]:
                last = time.monotonic()


def _take(s: socket.socket, into: dict[int, list[bytes]]) -> tuple[int, int]:
    """Every incoming frame queued on `s` now (frames it sent itself skipped); those with an id go `into`.
    Returns (frames with an id, incoming frames)."""
    kept = seen = 0
    while True:
        try:
            data, addr = s.recvfrom(65536)
        except BlockingIOError:
            return kept, seen
        if addr[2] == PACKET_OUTGOING:
            continue
        seen += 1
        uid = frame_id(data)
        if uid is not None:
            into.setdefault(uid, []).append(data)
            kept += 1


def exchange(
    lab_ns: dict[str, str],
    probes: list[Probe],
    chunk: int = 128,
    quiet: float = 0.08,
    lab: Lab | None = None,
    window: CounterWindow | None = None,
) -> dict[str, dict[int, list[bytes]]]:
    """Send every probe on both paths (chunk by chunk, each chunk drained before the next) and capture them.

    With `window` the receive window closes on counters (CounterWindow: every frame met its fate; a lost frame or
    counters that never reconcile raise WindowError); without, after `quiet` seconds without a frame (what bare
    captures without a NIC use). With `lab` (host mode): captured where the bridges pass frames up to the local
    stack, and kept only for the frames INPUT let through (the lab's record of local delivery)."""
    tx = {"hybrid": raw_socket(lab_ns["send"], "hyb0"), "plain": raw_socket(lab_ns["send"], "plain0")}
    if lab is not None:
        for role in ("fw", "plain"):
            lab.host_seen(role, reset=True)
        rx = {"hybrid": raw_socket(lab_ns["fw"], lab.fw_bridge), "plain": raw_socket(lab_ns["plain"], lab.plain_bridge)}
    else:
        rx = {"hybrid": raw_socket(lab_ns["recv"], "hyb0"), "plain": raw_socket(lab_ns["recv"], "plain0")}
    got: dict[str, dict[int, list[bytes]]] = {"hybrid": {}, "plain": {}}
    try:
        for s in rx.values():
            drain(s)
            _packets_seen(s)  # zero its drop count
        if window is not None:
            window.open(rx)
        for start in range(0, len(probes), chunk):
            part = probes[start : start + chunk]
            for path in ("hybrid", "plain"):
                send(tx[path], [p.frame for p in part], pace_every=0)
            if window is None:
                collect(rx, got, quiet, 10.0)
            else:
                window.sent += len(part)
                settle(window, rx, got, final=start + chunk >= len(probes))
        if window is None:
            collect(rx, got, max(quiet, 0.4), 10.0)
    finally:
        for s in (*tx.values(), *rx.values()):
            s.close()
    if lab is not None:
        for path, role in (("hybrid", "fw"), ("plain", "plain")):
            seen = lab.host_seen(role)
            got[path] = {uid: got[path].get(uid) or [b""] for uid in seen}
    return got


def _read_all(socks: dict[str, socket.socket], got: dict[str, dict[int, list[bytes]]], window: CounterWindow) -> None:
    """Everything queued on the capture sockets now: frames with an id into `got`, every incoming frame counted."""
    for name, s in socks.items():
        window.captured[name] += _take(s, got[name])[1]
        window.capture_drops += _packets_seen(s)[1]


def settle(
    window: CounterWindow,
    socks: dict[str, socket.socket],
    got: dict[str, dict[int, list[bytes]]],
    final: bool = True,
    timeout: float = WINDOW_TIMEOUT,
) -> dict:
    """Capture until the window's counters account for every frame sent so far; `final`: also read the same twice
    WINDOW_GRACE apart. Returns the last reading; WindowError when they do not reconcile within `timeout`."""
    start = time.monotonic()
    last: dict | None = None
    while True:
        _read_all(socks, got, window)
        reading = window.reading()
        missing = window.missing(reading)
        if not missing:
            if not final or reading == last:
                return reading
            last = reading
            time.sleep(WINDOW_GRACE)
            continue
        last = None
        if time.monotonic() - start > timeout:
            raise WindowError(
                f"verify: the counters did not reconcile within {timeout:.0f} s (still missing: {'; '.join(missing)}); "
                f"frames are lost or stuck in the lab, so there is no verdict: {reading}"
            )
        select.select(list(socks.values()), [], [], 0.005)


def compare(probes: list[Probe], got: dict[str, dict[int, list[bytes]]]) -> dict:
    mismatches, altered, dups = [], [], 0
    by_kind: dict[str, dict[str, int]] = {}
    for p in probes:
        h = got["hybrid"].get(p.uid, [])
        o = got["plain"].get(p.uid, [])
        dups += max(0, len(h) - 1)
        k = by_kind.setdefault(p.kind, {"packets": 0, "delivered": 0, "mismatches": 0})
        k["packets"] += 1
        k["delivered"] += bool(o)
        if bool(h) != bool(o):
            k["mismatches"] += 1
            mismatches.append(
                {"id": p.uid, "kind": p.kind, "oracle": bool(o), "hybrid": bool(h), "frame": p.frame.hex()}
            )
        elif h and h[0] != o[0]:
            altered.append({"id": p.uid, "kind": p.kind, "oracle": o[0].hex(), "hybrid": h[0].hex()})
    return {
        "packets": len(probes),
        "delivered_oracle": sum(1 for p in probes if got["plain"].get(p.uid)),
        "delivered_hybrid": sum(1 for p in probes if got["hybrid"].get(p.uid)),
        "mismatches": len(mismatches) + len(altered),
        "verdict_mismatches": len(mismatches),
        "altered": len(altered),
        "duplicates": dups,
        "by_kind": by_kind,
        "examples": (mismatches + altered)[:10],
    }


def _counter_delta(before: dict, after: dict) -> dict:
    return {k: after[k] - before.get(k, 0) for k in after if isinstance(after[k], int)}


def load_oracle(ns: str, policy: Policy, table: str = "filter", unfilterable: str = "drop", fw: str = "") -> None:
    """The original policy alone into the plain namespace (the whole table replaced), with the deployment's
    handling of frames the bridge cannot filter (netfilter.bridge). The sets its -m set matches read first, as the
    firewall has them now (`fw`, its namespace; docs/sets.md): the same contents on both paths. A policy with
    hashlimit tables starts from an empty table first, until the kernel has dropped the tables of the last load: a
    table outlives a reload that keeps its name, buckets an earlier run spent included (limits_before)."""
    if policy.set_notes:
        text = ipset.save_text(fw) if fw else policy.ipsets_text
        if text:
            ipset.restore(ns, text)
    names = {_value(o, "--hashlimit-name") or "" for m, o in policy_groups(policy) if m == "hashlimit"} - {""}
    try:
        if names:
            netns.run(["iptables-restore", "-w"], ns, input=f"*{table}\nCOMMIT\n")
            deadline = time.monotonic() + 5.0
            while any(_proc_net(ns, f"ipt_hashlimit/{n}") is not None for n in names) and time.monotonic() < deadline:
                time.sleep(0.05)
        netns.run(["iptables-restore", "-w"], ns, input=policy_restore(policy, table))
        netns.run(["nft", "-f", "-"], ns, input=unfilterable_nft(unfilterable))
    except netns.CommandError as e:
        raise HypafilterError(f"loading the original policy into {ns} failed: {e}") from e


def _deployed(
    policy: Policy, config: Config, log: Callable[[str], None], live: bool = False, six: Six | None = None
) -> tuple[Lab, dict]:
    """The lab up, this policy deployed, the original policy alone in the plain namespace: (lab, state). `live`:
    the policy is the firewall's live ruleset, which the deployment must already follow (nothing is deployed)."""
    if live:
        state = deploy.read_state()
        if not state:
            raise HypafilterError("nothing is deployed")
        lab = Lab(deploy.LAB_NAME, target=state.get("target", "emu"))
        load_oracle(lab.ns_plain, policy, config.table, config.unfilterable, lab.ns_fw)
        if six is not None:  # ip6tables' live ruleset alone in the oracle's ip6tables (docs/ipv6.md)
            verify6.load_oracle6(lab.ns_plain, six.policy, lab.ns_fw)
        netns.run(["sysctl", "-qw", "net.bridge.bridge-nf-filter-vlan-tagged=1"], lab.ns_plain)
        return lab, state
    lab = Lab(deploy.LAB_NAME, target=config.target)
    if not lab.status()["complete"]:
        log(f"lab {lab.name} is not (fully) up for target {config.target}: bringing it up")
        lab.up()
    if policy.ipsets_file:  # --ipsets: the sets created in the lab's firewall before the policy that reads them
        ipset.restore(lab.ns_fw, policy.ipsets_text)
    state = deploy.read_state()
    if not state or state.get("policy_hash") != policy.policy_hash():
        log("policy not deployed: deploying it")
    # deploy() returns at once when exactly this policy and configuration are live (and its NIC runs).
    state = deploy.deploy(policy, config, target=config.target, log=log, v6=six.policy if six else None)
    load_oracle(lab.ns_plain, policy, config.table, config.unfilterable, lab.ns_fw)
    if six is not None:  # the IPv6 side alone in the oracle's ip6tables (docs/ipv6.md)
        verify6.load_oracle6(lab.ns_plain, six.policy, lab.ns_fw)
    # VLAN-tagged IPv4 is filtered on both bridges: the hardware parses VLAN tags and classifies the frame, so the
    # oracle must see it through iptables too (the kernel default, 0, lets such frames bypass the policy).
    for n in (lab.ns_fw, lab.ns_plain):
        netns.run(["sysctl", "-qw", "net.bridge.bridge-nf-filter-vlan-tagged=1"], n)
    return lab, state


def flush_conntrack(lab: Lab, tgt, state: dict) -> None:
    """Both paths from empty conntrack tables, and the fast path holding none of the flushed flows: entries left by
    an earlier run (or by connection checks) age out on their own clocks in each namespace, so they could decide a
    frame differently on the two paths."""
    for role in ("fw", "plain"):
        lab.flush_conntrack(role)
    tgt.forget_flushed_flows(state["nic"])


def _hits6(tgt, state: dict) -> list[int]:
    """HITS of the NIC core's IPv6 rows ([] where no core decides IPv6: the xdp target, an IPv4-only core)."""
    if tgt.name != "emu" or not (state.get("tables") or {}).get("v6"):
        return []
    from hypafilter.targets.emu.v6 import hits6

    with tgt.client(state["nic"]) as c:
        return hits6(c, state["tables"])


def hw_share(nic: dict) -> float | None:
    """Share of the wire frames the NIC classified (PKTIN) that it decided itself (HW_DECIDED), from a counter
    delta; None when no wire frame came."""
    wire = nic.get("PKTIN", 0)
    return round(sum(nic.get(k, 0) for k in HW_DECIDED) / wire, 4) if wire else None


@dataclass(frozen=True)
class Six:
    """The IPv6 side of a verify run (docs/ipv6.md): the IPv6 policy deployed beside the IPv4 one (None: mode
    kernel, the oracle then gets the firewall's ip6tables as they are), `packets` IPv6 frames sent after the IPv4
    ones, and whether IPv4 frames are sent at all (`verify -6`: none)."""

    policy: object | None
    packets: int = 1000
    ipv4: bool = True


def verify(
    policy: Policy,
    config: Config,
    log: Callable[[str], None] = lambda s: None,
    connections: ConnectionSpec | None = None,
    live: bool = False,
    six: Six | None = None,
    **probes,
) -> dict:
    """Deploy if needed (`live`: never; the policy is the live ruleset the deployment follows), send the probes (`probes`: ProbeSpec fields) through both paths, compare per frame; with
    `connections`, then run those real connections on both paths and compare them too (report["connections"]).
    Returns the report dict. The policy sync service's lazy rebuild does not replace the NIC (program) while it runs
    (deploy.measuring)."""
    limited = refuse_nondeterministic(policy)
    spec = ProbeSpec(**probes)
    with deploy.measuring():
        return _verify(policy, config, log, connections, live, spec, limited, six)


def _verify(
    policy: Policy,
    config: Config,
    log: Callable[[str], None],
    connections: ConnectionSpec | None,
    live: bool,
    spec: ProbeSpec,
    limited: list[Limited] = (),
    six: Six | None = None,
) -> dict:
    lab, state = _deployed(policy, config, log, live, six)
    host = state.get("nic_mode") == "host"
    if host and spec.packets > HOST_SEEN_MAX:
        raise HypafilterError(f"host mode observes at most {HOST_SEEN_MAX} frames per run: use fewer --packets")
    lab.host_mode(host, ipv6=six is not None)
    ns = {"send": lab.ns_send, "recv": lab.ns_recv, "fw": lab.ns_fw, "plain": lab.ns_plain, "nic": lab.ns_nic}
    t0 = time.monotonic()
    dst_mac = bytes.fromhex(HOST_MAC.replace(":", "")) if host else DST_MAC
    sent = spec.probes(policy, state["generation"], dst_mac) if six is None or six.ipv4 else []
    sent6 = []
    if six is not None and six.packets:
        sent6 = [
            Probe(*f)
            for f in verify6.probes6(six.policy, len(sent) + 1, six.packets, spec.seed, dst_mac, ID_MAC_PREFIX)
        ]
        sent = sent + sent6
    t_gen = time.monotonic() - t0
    tgt = deploy.target_of(state, config)
    nic_before = tgt.counters(state["nic"])
    hits6_before = _hits6(tgt, state) if six is not None else []
    sh = deploy.shim_of(state)
    shim_before = sh.stats()
    flush_conntrack(lab, tgt, state)
    if six is not None:
        verify6.flush6(lab.ns_fw, lab.ns_plain)
    obs_before = {role: observers.snapshot(ns[role], config.table) for role in ("fw", "plain")}
    lim_before = limits_before(list(limited), policy, ns, config.table)
    t1 = time.monotonic()
    closed = None
    if tgt.window_stages is not None:
        with quiet_stacks(ns):
            window = CounterWindow.of(tgt, state["nic"], ns, host)
            try:
                got = exchange(ns, sent, lab=lab if host else None, window=window)
                closed = window.reading()
            finally:
                window.close()
    else:
        # A target without window stages (SUME: no lab of veths to count on) closes after a quiet time.
        with quiet_stacks(ns):
            got = exchange(ns, sent, lab=lab if host else None)
    t_run = time.monotonic() - t1
    report_limited = limits_after(list(limited), lim_before, ns, config.table)
    nic = _counter_delta(nic_before, tgt.counters(state["nic"]))
    shim = _counter_delta({k: v for k, v in shim_before.items() if k != "config"}, sh.stats())
    shim.pop("config", None)
    report = compare(sent, got)
    report["observers"] = observers.compare(
        obs_before["fw"],
        observers.settled(ns["fw"], config.table),
        obs_before["plain"],
        observers.settled(ns["plain"], config.table),
        comparable=lambda text: not NONDETERMINISTIC.keys() & set(_matches_in(shlex.split(text))),
    )
    report["limited"] = report_limited
    if six is not None:  # the IPv6 frames' own figures (they are counted in the totals too)
        r6 = compare(sent6, got)
        report["ipv6"] = {
            k: r6[k] for k in ("packets", "delivered_oracle", "delivered_hybrid", "mismatches", "altered", "by_kind")
        }
        report["ipv6"]["mode"] = (state.get("ipv6") or {}).get("mode", "kernel")
        if hits6_before:  # the NIC's core decides IPv6 frames (docs/ipv6.md "## emu"): its IPv6 rows' HITS
            from hypafilter.targets.emu.v6 import deciding_rows

            delta = [b - a for a, b in zip(hits6_before, _hits6(tgt, state), strict=True)]
            rows = deciding_rows(state.get("tables") or {})
            report["ipv6"]["hw"] = {
                "matched": sum(delta),
                "decided": sum(d for d, r in zip(delta, rows, strict=True) if r),
            }
    report.update(
        {
            "shunted": sum(v for k, v in nic.items() if k.startswith("CNT_SHUNT_") and k != "CNT_SHUNT_FORCED"),
            "hw_forwarded": nic.get("CNT_FORWARDED", 0),
            "hw_dropped": nic.get("CNT_DROPPED", 0),
            "hw_mirrored": nic.get("CNT_MIRROR", 0),
            "hw_share": hw_share(nic),
            "nic": nic,
            "shim": shim,
            "policy_hash": policy.policy_hash(),
            "generation": state["generation"],
            "nic_mode": state.get("nic_mode", "bridge"),
            "seconds_generate": round(t_gen, 3),
            "seconds_exchange": round(t_run, 3),
            "pps": round(2 * spec.packets / t_run, 1) if t_run else None,
            "seed": spec.seed,
            "trace": str(spec.trace) if spec.trace else None,
            "window": {"closed_by": "counters", **closed} if closed is not None else {"closed_by": "quiet time"},
        }
    )
    if connections is not None and six is not None:
        conns6 = verify6.conns6(six.policy, connections, host=host)
        before = tgt.counters(state["nic"])
        flush_conntrack(lab, tgt, state)
        verify6.flush6(lab.ns_fw, lab.ns_plain)
        t = time.monotonic()
        with connections_mod.host_connections(lab, ipv6=True) if host else contextlib.nullcontext():
            got6 = connections_mod.run_both(lab, conns6, connections.nbytes)
        c6 = connections_mod.compare(conns6, got6, connections.nbytes)
        d6 = _counter_delta(before, tgt.counters(state["nic"]))
        c6.update(
            {
                "hw_share": hw_share(d6),
                # the connections' wire frames the NIC's core knew to have no conntrack entry (ct 3: CNT_CT_NONE; an
                # xdp target counts none here)
                "ct_none": d6.get("CNT_CT_NONE", 0),
                "nic": d6,
                "seconds": round(time.monotonic() - t, 3),
            }
        )
        report["ipv6"]["connections"] = c6
    if connections is not None and (six is None or six.ipv4):
        report["connections"] = verify_connections(
            lab,
            policy,
            connections,
            lambda: tgt.counters(state["nic"]),
            lambda: flush_conntrack(lab, tgt, state),
            host=host,
        )
    return report


def verify_connections(
    lab: Lab,
    policy: Policy,
    spec: ConnectionSpec,
    counters: Callable[[], dict],
    flush: Callable[[], None],
    host: bool = False,
) -> dict:
    """The connections of `spec` on both paths (ops.connections), compared per connection, from empty conntrack
    tables in the firewall and the plain namespace (`flush` empties them); `counters` reads the NIC's, for
    hw_share. `host` (host mode, INPUT): connections into the host and out of it (the host's replies and its own
    connections leave through OUTPUT, which the policy leaves alone; INPUT judges what comes in), between the sender
    and the firewall on the hybrid path, the sender and the plain namespace on the oracle's."""
    conns = spec.conns(policy, host=host)
    flush()
    before = counters()
    t = time.monotonic()
    with connections.host_connections(lab) if host else contextlib.nullcontext():
        got = connections.run_both(lab, conns, spec.nbytes)
    seconds = time.monotonic() - t
    nic = _counter_delta(before, counters())
    report = connections.compare(conns, got, spec.nbytes)
    report.update({"hw_share": hw_share(nic), "nic": nic, "seconds": round(seconds, 3)})
    return report
