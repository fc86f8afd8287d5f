"""The kernel-differential fuzzer: random policies from a seed, run through `verify` over shunting modes ×
software strategies, mismatches counted by frame kind (tests/system/test_fuzz.py drives it; docs/deploy.md).

A policy is iptables-save text built from one integer seed, so a failure reproduces from the seed alone
(`random_policy(seed)`). What it draws: user chains with RETURN, goto and jumps to later chains, MARK and
CONNMARK in user chains read back by `-m mark`/`-m connmark`, conntrack state rules, string matches whose
strings hold quotes, backslashes, blanks and `#`, multiport, iprange, tcp-flags, ICMP types, negations of each,
observing rules (LOG, NFLOG, no target), and rules with per-rule state in the forms whose verdict the kernel and the hybrid reach alike from the same
frames in the same order (`verify.comparable_state`): statistic nth, quota, recent without timers, and limit,
hashlimit and connlimit at settings that never trigger within a run. No rule is unconditional (every rule tests a
header field or a selective match), and no rule lies wholly inside one earlier ACCEPT/DROP rule, so every
feature can be reached; tests/system/test_fuzz.py checks from the oracle's own rule counters that it was.
"""

from __future__ import annotations

import ipaddress
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from hypafilter.analysis.plan import MODES
from hypafilter.analysis.program import STRATEGIES
from hypafilter.config import Config
from hypafilter.iptables.writer import Restore
from hypafilter.ir import Policy
from hypafilter.ops.verify import verify

# Strings for `-m string`: every character iptables-restore treats specially inside a quoted token, plus `#`
# (a comment only in column 1) and blanks.
STRINGS = ("BAD", 'say "hi"', "back\\slash", "#hash", "it's", 'a b#c"d\\e', 'x\\"y', "GET /#frag")
# Ports the policies favour: well-known services and the ones the connection checks use (tests/system/test_fuzz.py, through ops.connections).
PORTS = (22, 53, 80, 123, 443, 5001, 5002, 8080)
ICMP_TYPES = ("echo-request", "echo-reply", "destination-unreachable", "time-exceeded", "8", "0", "3/1", "11/0")
TCP_FLAGS = (("SYN,ACK,FIN,RST", "SYN"), ("SYN,ACK", "ACK"), ("ALL", "NONE"), ("FIN,SYN", "FIN,SYN"), ("RST", "RST"))
CT_STATES = ("NEW", "ESTABLISHED", "RELATED", "INVALID", "ESTABLISHED,RELATED", "NEW,ESTABLISHED", "UNTRACKED")
MARKS = ("0x1", "0x2", "0x1/0x1", "0x2/0x3", "0x4/0x4", "0x0/0x6", "0x10/0xf0")
# What the coverage check looks for in the oracle's `iptables-save -c` (a feature counts when a rule carrying it
# matched at least one packet): the rule's text holds the needle.
FEATURES = {
    "MARK": "-j MARK",
    "CONNMARK": "-j CONNMARK",
    "RETURN": "-j RETURN",
    "goto": " -g U",
    "jump": " -j U",
    "multiport": "-m multiport",
    "iprange": "-m iprange",
    "tcp-flags": "--tcp-flags",
    "icmp": "--icmp-type",
    "mark": "-m mark",
    "connmark": "-m connmark",
    "string": "-m string",
    "conntrack": "-m conntrack",
    "limit": "-m limit",
    "hashlimit": "-m hashlimit",
    "quota": "-m quota",
    "statistic": "-m statistic",
    "recent": "-m recent",
    "connlimit": "-m connlimit",
    "LOG": "-j LOG",
    "NFLOG": "-j NFLOG",
}
# The lab's two paths use 10.0.0.0/16 (hybrid) and 10.1.0.0/16 (plain). A policy checked with real connections
# treats both alike: its address matches either contain all of 10.0.0.0/15 or miss it.
PATHS_NET = ipaddress.ip_network("10.0.0.0/15")

# Every (mode, strategy) pair deploy accepts: hsa_cut with index shunting is refused by design (a shunted packet
# may first match a simple rule that hsa_cut left out of software; analysis.program says so and refuses it).
REFUSED = {("index", "hsa_cut")}
# Strategy tree's pairs come last, so that the other pairs keep their numbers (frame seeds, test_fuzz's thirds).
COMBOS = tuple(
    (m, s) for s0 in (False, True) for m in MODES for s in STRATEGIES if (m, s) not in REFUSED and (s == "tree") == s0
)
# test_fuzz's default run: tree with one mode only (its K0 tree is the same in every mode, and its interval part is
# interval's), the 15th pair, which falls in the third that had 4 pairs; `make fuzz` (HF_FUZZ_ALL_PAIRS) runs all.
QUICK_COMBOS = tuple(p for p in COMBOS if p[1] != "tree") + (("selective", "tree"),)
# Strategy tree's deployments in the fuzzer walk trees on runs of 2 rules (leaves of 1), so that a random policy of
# a few rules already has them (Config.tree_min_segment, like test_optimize's small trees).
FUZZ_TREE_MIN_SEGMENT = 2


@dataclass
class _Gen:
    rng: random.Random
    conntrack: bool
    symmetric: bool
    chains: list[str] = field(default_factory=list)

    def neg(self, share: float = 0.2) -> list[str]:
        return ["!"] if self.rng.random() < share else []

    def prefix(self) -> str:
        rng = self.rng
        while True:
            n = rng.choice((8, 12, 15, 16, 20, 24, 24, 28, 32))
            base = rng.choice((0x0A000000, 0x0A010000, 0xC0A80000, 0xAC100000, rng.getrandbits(32)))
            net = ipaddress.ip_network(((base + rng.getrandbits(16)) & 0xFFFFFFFF, n), strict=False)
            if not self.symmetric or not net.overlaps(PATHS_NET) or net.supernet_of(PATHS_NET):
                return str(net)

    def iprange(self) -> str:
        while True:
            lo = ipaddress.ip_address(self.rng.choice((0x0A000000, 0xC0A80000, 0xAC100000)) + self.rng.getrandbits(12))
            hi = lo + self.rng.randint(0, 5000)
            inside = PATHS_NET[0] <= lo and hi <= PATHS_NET[-1]
            touches = not (hi < PATHS_NET[0] or lo > PATHS_NET[-1])
            if not self.symmetric or (not touches) or (lo <= PATHS_NET[0] and hi >= PATHS_NET[-1] and not inside):
                return f"{lo}-{hi}"

    def port(self) -> str:
        rng = self.rng
        p = rng.choice(PORTS) if rng.random() < 0.6 else rng.randint(0, 65535)
        if rng.random() < 0.3:
            return f"{p}:{min(65535, p + rng.randint(0, 2000))}"
        return str(p)

    def l4(self, proto: str) -> list[str]:
        rng, out = self.rng, []
        if proto in ("tcp", "udp"):
            if rng.random() < 0.25:
                ports = sorted({rng.choice(PORTS) if rng.random() < 0.7 else rng.randint(1, 65535) for _ in range(4)})
                out += ["-m", "multiport", *self.neg(), rng.choice(("--dports", "--sports", "--ports"))]
                out.append(",".join(map(str, ports)))
            else:
                out += ["-m", proto]
                if rng.random() < 0.7:
                    out += [*self.neg(), "--dport", self.port()]
                if rng.random() < 0.3:
                    out += [*self.neg(), "--sport", self.port()]
                if proto == "tcp" and rng.random() < 0.35:
                    if rng.random() < 0.3:
                        out += [*self.neg(), "--syn"]
                    else:
                        out += [*self.neg(), "--tcp-flags", *rng.choice(TCP_FLAGS)]
        elif proto == "icmp" and rng.random() < 0.7:
            out += ["-m", "icmp", *self.neg(), "--icmp-type", rng.choice(ICMP_TYPES)]
        return out

    def checks(self, in_user_chain: bool) -> list[str]:
        """matches() that test something: never empty, so no rule decides every packet that reaches it."""
        while True:
            m = self.matches(in_user_chain)
            if m:
                return m

    def matches(self, in_user_chain: bool) -> list[str]:
        rng, out = self.rng, []
        proto = rng.choice(("tcp", "tcp", "udp", "udp", "icmp", None, None))
        if proto and rng.random() < 0.12:
            out += ["!", "-p", proto]
            proto = None
        elif proto:
            out += ["-p", proto]
        for opt in ("-s", "-d"):
            if rng.random() < 0.35:
                out += [*self.neg(), opt, self.prefix()]
        if proto:
            out += self.l4(proto)
        if rng.random() < 0.1:
            out += ["-m", "iprange", *self.neg(), rng.choice(("--src-range", "--dst-range")), self.iprange()]
        # Marks are what the user chains write: read them more often where they can have been written.
        if rng.random() < (0.3 if in_user_chain else 0.12):
            out += ["-m", rng.choice(("mark", "connmark")), *self.neg(0.3), "--mark", rng.choice(MARKS)]
        if self.conntrack and rng.random() < 0.25:
            if rng.random() < 0.7:
                out += ["-m", "conntrack", *self.neg(0.15), "--ctstate", rng.choice(CT_STATES)]
            else:
                out += ["-m", "state", "--state", rng.choice(CT_STATES[:5])]
        if rng.random() < 0.15:
            out += ["-m", "string", "--algo", rng.choice(("bm", "kmp")), *self.neg(0.25), "--string"]
            out.append(rng.choice(STRINGS))
        return out

    def state(self, name: str) -> list[str]:
        """A match with per-rule state in a form verify can compare (verify.comparable_state)."""
        rng = self.rng
        kinds = ["limit", "hashlimit", "quota", "statistic", "recent", "recent"] + (
            ["connlimit"] if self.conntrack else []
        )
        kind = rng.choice(kinds)
        if kind == "limit":
            return ["-m", "limit", "--limit", "10000/sec", "--limit-burst", str(rng.choice((5000, 10000)))]
        if kind == "hashlimit":
            mode = rng.choice(("srcip", "dstip", "srcip,dstport"))
            return [
                "-m",
                "hashlimit",
                "--hashlimit-upto",
                "10000/sec",
                "--hashlimit-burst",
                "10000",
                "--hashlimit-mode",
                mode,
                "--hashlimit-name",
                f"{name}h{rng.randint(0, 9)}",
            ]
        if kind == "quota":
            return ["-m", "quota", *self.neg(0.3), "--quota", str(rng.choice((2000, 20000, 200000)))]
        if kind == "statistic":
            every = rng.randint(2, 7)
            return ["-m", "statistic", "--mode", "nth", "--every", str(every), "--packet", str(rng.randrange(every))]
        if kind == "recent":
            verb = rng.choice(("--set", "--rcheck", "--update", "--rcheck", "--remove"))
            extra = (
                ["--hitcount", str(rng.randint(2, 4))]
                if verb in ("--rcheck", "--update") and rng.random() < 0.3
                else []
            )
            return [
                "-m",
                "recent",
                *self.neg(0.2),
                verb,
                "--name",
                f"{name}r",
                rng.choice(("--rsource", "--rdest")),
                *extra,
            ]
        # --connlimit-upto 100000 holds for every packet of a run (never more connections than that): the rule's
        # target applies and the oracle's counters show it matched; --connlimit-above would never match at all.
        return ["-m", "connlimit", "--connlimit-upto", "100000", "--connlimit-mask", "32"]

    def target(self, chain_index: int | None) -> list[str]:
        """chain_index: None in the base chain, else the user chain's position (it may jump only further on)."""
        rng = self.rng
        later = self.chains[(0 if chain_index is None else chain_index + 1) :]
        r = rng.random()
        if later and r < 0.25:
            return [rng.choice(("-j", "-j", "-g")), rng.choice(later)]
        if chain_index is not None and r < 0.45:
            roll = rng.random()
            if roll < 0.35:
                return ["-j", "RETURN"]
            if roll < 0.7:
                verb = rng.choice(("--set-xmark", "--set-mark", "--or-mark"))
                return ["-j", "MARK", verb, rng.choice(MARKS[:2] if verb == "--or-mark" else MARKS[:4])]
            return [
                "-j",
                "CONNMARK",
                *rng.choice((("--set-xmark", rng.choice(MARKS)), ("--save-mark",), ("--restore-mark",))),
            ]
        if r > 0.88:
            return self.observer()
        return ["-j", rng.choice(("ACCEPT", "DROP"))]

    def observer(self) -> list[str]:
        """A target that only observes (a LOG, an NFLOG or none: a counting rule): the fast path decides the frame
        and mirrors a copy to netfilter, whose observer counters verify compares with the oracle's."""
        rng = self.rng
        roll = rng.random()
        if roll < 0.45:
            return ["-j", "LOG", "--log-prefix", f"fz{rng.randint(0, 9)}: "]
        if roll < 0.8:
            return ["-j", "NFLOG", "--nflog-group", str(rng.randint(1, 9))]
        return []


def shadowed_lines(text: str) -> list[int]:
    """Lines of the policy whose every flattened copy lies wholly inside one earlier ACCEPT/DROP rule (a cheap,
    sound test: such a rule can never match a packet)."""
    from hypafilter.analysis.geometry import BoxSet, contained_in_any
    from hypafilter.iptables.document import parse_policy

    pol = parse_policy(text, filename="<fuzz>", base_chain="FORWARD", config=Config())
    live: dict[int, bool] = {}
    for i, r in enumerate(pol.rules):
        line = r.origin.line if r.origin else -1
        earlier = [pol.rules[j].boxes for j in range(i) if pol.rules[j].is_simple]
        hidden = bool(r.boxes) and bool(earlier)
        if hidden:
            hidden = bool(contained_in_any(BoxSet.from_unions([r.boxes]), BoxSet.from_unions(earlier)).all())
        live[line] = live.get(line, False) or not hidden
    return sorted(line for line, ok in live.items() if not ok)


def random_policy(seed: int, conntrack: bool | None = None, rules: int | None = None) -> str:
    """A random FORWARD policy as iptables-save text, the same for the same arguments. conntrack: whether it reads
    conntrack state (then its address matches treat the lab's two paths alike, for real connections); None lets
    the seed decide. Drawn again (from the same random stream) while a rule is shadowed by an earlier one."""
    rng = random.Random(seed)
    text = ""
    for _ in range(50):
        text = _draw(rng, seed, conntrack, rules)
        if not shadowed_lines(text):
            return text
    return text


def _draw(rng: random.Random, seed: int, conntrack: bool | None, rules: int | None) -> str:
    ct = rng.random() < 0.4 if conntrack is None else conntrack
    g = _Gen(rng, ct, symmetric=ct)
    g.chains = [f"U{i}" for i in range(rng.randint(1, 3))]
    doc = Restore("filter", comment=f"hypafilter fuzz policy, seed {seed}")
    doc.chain("FORWARD", rng.choice(("ACCEPT", "DROP")))
    for c in g.chains:
        doc.chain(c)
    base = []
    for _ in range(rules if rules is not None else rng.randint(6, 18)):
        m = g.checks(False)
        if rng.random() < 0.3:
            # Per-rule state, sometimes before the header matches (the kernel evaluates it for every packet that
            # reaches it, whatever the ports written after it), sometimes after them.
            at = next((i for i, t in enumerate(m) if t == "-m"), len(m)) if rng.random() < 0.5 else len(m)
            m = m[:at] + g.state(f"fz{seed}") + m[at:]
            t = g.target(None)
            base.append(m + (["-j", t[1]] if t and t[0] == "-g" else t))  # a stateful goto cannot be flattened
            continue
        base.append(m + g.target(None))
    if ct:
        # Services the connection checks use, so that some connections complete and others do not; and the
        # usual rule for the rest of an accepted connection, somewhere.
        for _ in range(rng.randint(1, 4)):
            proto = rng.choice(("tcp", "udp"))
            rule = ["-p", proto, "-m", proto, "--dport", str(rng.choice(PORTS))]
            rule += ["-m", "conntrack", "--ctstate", "NEW"] if rng.random() < 0.5 else []
            base.insert(rng.randint(0, len(base)), rule + g.target(None))
        rule = ["-m", "conntrack", "--ctstate", "ESTABLISHED,RELATED", "-j", "ACCEPT"]
        base.insert(0 if rng.random() < 0.6 else rng.randint(0, len(base)), rule)
    for c in g.chains:  # every user chain is reached from the base chain, not only from another user chain
        if not any(c in rule for rule in base):
            base.insert(rng.randint(0, len(base)), g.checks(False) + ["-j", c])
    for rule in base:
        doc.rule("FORWARD", rule)
    for i, c in enumerate(g.chains):
        if i == 0:  # one MARK at least, so that the mark reads have something to read
            doc.rule(c, g.checks(True) + ["-j", "MARK", "--set-xmark", rng.choice(MARKS[:4])])
        for _ in range(rng.randint(2, 6)):
            doc.rule(c, g.checks(True) + g.target(i))
    return doc.text()


def combos(modes=MODES, strategies=STRATEGIES) -> Iterator[tuple[str, str]]:
    """The (mode, strategy) pairs deploy accepts, index and selective first: they share the hardware (register
    writes only), exact needs another emulator build."""
    yield from ((m, s) for m, s in COMBOS if m in modes and s in strategies)


@dataclass
class Tally:
    """Frames, deliveries and mismatches by frame kind over many verify reports."""

    by_kind: dict[str, dict[str, int]] = field(default_factory=dict)
    runs: list[dict] = field(default_factory=list)
    examples: list[dict] = field(default_factory=list)

    def add(self, report: dict, **where) -> None:
        for kind, counts in report["by_kind"].items():
            mine = self.by_kind.setdefault(kind, {"packets": 0, "delivered": 0, "mismatches": 0})
            for k in mine:
                mine[k] += counts[k]
        obs = report.get("observers", {})
        self.runs.append(
            {
                **where,
                **{k: report[k] for k in ("packets", "mismatches", "altered", "delivered_oracle")},
                "observer_mismatches": obs.get("mismatches", 0),
            }
        )
        self.examples += [{**where, **ex} for ex in report["examples"][:3]]
        self.examples += [{**where, "observer": ex} for ex in obs.get("examples", [])[:3]]

    @property
    def frames(self) -> int:
        return sum(v["packets"] for v in self.by_kind.values())

    @property
    def mismatches(self) -> int:
        """Frames whose verdict or bytes differ, plus observing rules whose counters differ (verify's observers)."""
        return sum(r["mismatches"] + r["observer_mismatches"] for r in self.runs)

    def table(self) -> str:
        rows = [f"{'kind':<20} {'frames':>9} {'delivered':>9} {'mismatches':>10}"]
        for kind, v in sorted(self.by_kind.items()):
            rows.append(f"{kind:<20} {v['packets']:>9} {v['delivered']:>9} {v['mismatches']:>10}")
        return "\n".join(rows)


def fuzz_policy(
    policy: Policy,
    seed: int,
    frames: int,
    kinds: tuple[str, ...],
    malformed: float,
    pairs: tuple[tuple[str, str], ...] = COMBOS,
    tally: Tally | None = None,
    after: Callable[[str, str, int], None] | None = None,
    log: Callable[[str], None] = lambda s: None,
    target: str = "emu",
    attack: tuple[str, ...] = (),
    attack_share: float = 0.0,
) -> Tally:
    """`frames` frames per (mode, strategy) pair through verify, frame seed = seed·100 + the pair's number in
    COMBOS (so a subset of `pairs` sends the same frames per pair as the whole run); `after` runs after each pair
    with the deployment still up (the connection checks); `target`: the fast path (emu, xdp); `attack`: the
    attack shapes (verify.ATTACK_SHAPES) drawn for a share `attack_share` of the frames, counted by kind
    attack_<shape>."""
    tally = tally or Tally()
    for n, (mode, strategy) in enumerate(pairs):
        t = time.monotonic()
        frame_seed = seed * 100 + COMBOS.index((mode, strategy))
        report = verify(
            policy,
            Config(shunt_mode=mode, strategy=strategy, target=target, tree_min_segment=FUZZ_TREE_MIN_SEGMENT),
            packets=frames,
            seed=frame_seed,
            malformed=malformed,
            kinds=kinds,
            attack=attack,
            attack_share=attack_share,
        )
        tally.add(report, policy_seed=seed, mode=mode, strategy=strategy, frame_seed=frame_seed)
        log(
            f"seed {seed} {mode}/{strategy}: {report['packets']} frames, {report['mismatches']} mismatches "
            f"(frame seed {frame_seed}, {time.monotonic() - t:.1f} s)"
        )
        if after:
            after(mode, strategy, n)
    return tally
