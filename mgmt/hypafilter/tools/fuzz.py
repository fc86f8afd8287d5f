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
from hypafilter.ops.verify import Six, verify

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
    return _unshadowed(lambda: _draw(rng, seed, conntrack, rules), shadowed_lines)


def _unshadowed(draw, shadowed) -> str:
    """The first of up to 50 draws in which no rule is shadowed (`shadowed(text)` empty), else the last."""
    text = ""
    for _ in range(50):
        text = draw()
        if not shadowed(text):
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


# ---- IPv6 (issue #25; docs/deploy.md "Fuzzing", docs/ipv6.md) -------------------------------------------------
# An ip6tables policy deployed beside an IPv4 one (dual stack), verify's IPv6 frames (ops.verify6: extension-header
# chains, AH, fragments, truncations, neighbour discovery, ICMPv6 errors quoting flows, jumbo) through both paths.

# Networks the IPv6 policies draw from: the lab's two paths (verify6.LAB_NETS: hybrid fd48:4600::/64, plain
# fd48:4601::/64), documentation space, a link-local and a multicast range, and (in prefix6) random addresses.
NETS6 = ("fd48:4600::/64", "fd48:4601::/64", "fd48:4600::/31", "2001:db8::/32", "fe80::/10", "ff02::/16")
# The smallest network holding both paths' (they differ in the second group): a policy checked with real
# connections treats both alike, its address matches contain all of it or miss it (as PATHS_NET for IPv4).
PATHS_NET6 = ipaddress.ip_network("fd48:4600::/31")
# Types as ip6tables reads them (names, unique prefixes, numbers, TYPE/CODE); verify6 sends echo, ND, errors and
# unknown types.
ICMP6_TYPES = (
    "echo-request",
    "echo-reply",
    "destination-unreachable",
    "port-unreachable",
    "packet-too-big",
    "time-exceeded",
    "parameter-problem",
    "neighbour-solicitation",
    "neighbour-advertisement",
    "router-solicitation",
    "router-advertisement",
    "dest",
    "128",
    "135",
    "1/4",
    "3/0",
    "200",
)
REJECT6 = (
    "icmp6-port-unreachable",
    "icmp6-adm-prohibited",
    "icmp6-no-route",
    "no-route",
    "icmp6-addr-unreachable",
    "addr-unreach",
    "adm-prohibited",
    "port-unreach",
    "icmp6-policy-fail",
    "icmp6-reject-route",
)
# The extension-header matches (complex: decided by ip6tables) and ipv6header's header names.
IPV6HEADER_NAMES = ("hop", "dst", "route", "frag", "auth", "esp", "none", "prot", "ipv6-frag", "ipv6-route")
# As FEATURES, in the oracle's `ip6tables-save -c` (tests/system/test_fuzz.py).
FEATURES6 = {
    "MARK6": "-j MARK",
    "RETURN6": "-j RETURN",
    "goto6": " -g U",
    "jump6": " -j U",
    "multiport6": "-m multiport",
    "iprange6": "-m iprange",
    "tcp-flags6": "--tcp-flags",
    "icmpv6": "--icmpv6-type",
    "conntrack6": "-m conntrack",
    "frag": "-m frag",
    "hl": "-m hl",
    "ipv6header": "-m ipv6header",
    "hbh": "-m hbh",
    "dst-opts": "-m dst",
    "rt": "-m rt",
    "ah": "-m ah",
    "REJECT6": "-j REJECT",
    "p-all-ext": "-p ah",
}


@dataclass
class _Gen6(_Gen):
    """IPv6 rules: _Gen's structure (chains, targets, negations) with IPv6 addresses, ICMPv6 types and the IPv6
    matches."""

    def prefix(self) -> str:
        rng = self.rng
        while True:
            r = rng.random()
            if r < 0.75:
                base = ipaddress.ip_network(rng.choice(NETS6))
                n = rng.choice((base.prefixlen, 64, 96, 112, 120, 127, 128, max(base.prefixlen, 48)))
                n = max(n, base.prefixlen)
                host = int(base.network_address) + rng.getrandbits(base.max_prefixlen - base.prefixlen)
                if rng.random() < 0.5:  # low addresses of the network (verify6 aims at the edges)
                    host = int(base.network_address) + rng.randint(0, 300)
            else:
                n = rng.choice((1, 3, 16, 32, 48, 64, 128))
                host = rng.getrandbits(128)
            net = ipaddress.ip_network((host & ((1 << 128) - 1), n), strict=False)
            if not self.symmetric or not net.overlaps(PATHS_NET6) or net.supernet_of(PATHS_NET6):
                return str(net)

    def iprange(self) -> str:
        rng = self.rng
        while True:
            base = ipaddress.ip_network(rng.choice(NETS6[:4]))
            lo = int(base.network_address) + rng.choice((0, rng.randint(0, 4000), rng.getrandbits(64)))
            hi = lo + rng.choice((0, rng.randint(0, 5000), rng.getrandbits(64) << rng.randint(0, 60)))
            hi = min(hi, (1 << 128) - 1)
            lo_a, hi_a = ipaddress.IPv6Address(lo), ipaddress.IPv6Address(hi)
            touches = not (hi_a < PATHS_NET6[0] or lo_a > PATHS_NET6[-1])
            covers = lo_a <= PATHS_NET6[0] and hi_a >= PATHS_NET6[-1]
            if not self.symmetric or not touches or covers:
                return f"{lo_a}-{hi_a}"

    def l4(self, proto: str) -> list[str]:
        rng = self.rng
        if proto == "ipv6-icmp":
            if rng.random() < 0.75:
                return ["-m", "icmp6", *self.neg(), "--icmpv6-type", rng.choice(ICMP6_TYPES)]
            return []
        return super().l4(proto)

    def ext(self) -> list[str]:
        """One of the IPv6 matches ip6tables decides (complex in the hybrid): fragment, hop limit, extension
        headers (ipv6header, hbh, dst, rt, ah)."""
        rng = self.rng
        kind = rng.choice(("frag", "hl", "hl", "ipv6header", "ipv6header", "hbh", "dst", "rt", "ah"))
        if kind == "frag":
            opt = rng.choice(
                (["--fragfirst"], ["--fragmore"], ["--fraglast"], ["--fragid", f"0:{rng.randint(1, 2**32 - 1)}"])
            )
            return ["-m", "frag", *(self.neg(0.3) if opt[0] == "--fragid" else []), *opt]
        if kind == "hl":
            op = rng.choice(("--hl-eq", "--hl-lt", "--hl-gt"))
            val = rng.choice((1, 2, 63, 64, 65, 254, 255))
            return ["-m", "hl", *(self.neg(0.3) if op == "--hl-eq" else []), op, str(val)]
        if kind == "ipv6header":
            names = sorted(set(rng.sample(IPV6HEADER_NAMES, rng.randint(1, 2))))
            soft = ["--soft"] if rng.random() < 0.6 else []
            return ["-m", "ipv6header", *self.neg(0.2), "--header", ",".join(names), *soft]
        if kind in ("hbh", "dst"):  # the header's whole length in bytes (ipv6_optlen): 8, 16, ...
            return ["-m", kind, *self.neg(0.2), f"--{kind}-len", str(rng.choice((8, 8, 16, 24, 1)))]
        if kind == "rt":
            out = ["-m", "rt", *self.neg(0.2), "--rt-type", str(rng.choice((0, 2, 4)))]
            if rng.random() < 0.4:
                out += ["--rt-segsleft", rng.choice(("0", "1", "0:1"))]
            return out
        return ["-m", "ah", *self.neg(0.2), "--ahspi", f"{rng.randint(0, 3000)}:{rng.randint(3000, 65535)}"]

    def matches(self, in_user_chain: bool) -> list[str]:
        rng, out = self.rng, []
        proto = rng.choice(("tcp", "tcp", "udp", "udp", "ipv6-icmp", "ipv6-icmp", None, None, "ext"))
        # A rule with an IPv6 match tests fewer header fields: the frame shapes it reads (chains, fragments, hop
        # limits) are a share of verify6's frames, so its other tests must leave it frames to match.
        ext = self.ext() if rng.random() < 0.25 else []
        if ext[:2] == ["-m", "ah"] and rng.random() < 0.7:
            # iptables-nft's -p stops at AH (meta l4proto 51): -m ah beside -p tcp/udp/icmpv6 matches nothing
            proto = rng.choice((None, "ah"))
            if proto:
                out += ["-p", proto]
                proto = None
        if proto == "ext":  # -p of an extension header or another protocol as ipv6_find_hdr reads it
            p = rng.choice(("ah", "esp", "59", "0", "ipv6-frag", "ipv6-opts", "gre"))
            out += [*(self.neg(0.3) if p != "0" else []), "-p", p]  # `! -p 0` never matches: ip6tables refuses it
            proto = None  # (-p 0, every protocol: the rule gets an IPv6 match below)
        elif proto and rng.random() < 0.12:
            out += ["!", "-p", proto]
            proto = None
        elif proto:
            out += ["-p", proto]
        if not ext and out and out[-1] == "0":  # -p 0 (every protocol): the rule tests something else
            ext = self.ext()
        for opt in ("-s", "-d"):
            if rng.random() < (0.12 if ext else 0.35):
                out += [*self.neg(), opt, self.prefix()]
        if proto:
            out += self.l4(proto) if not ext or rng.random() < 0.4 else []
        if rng.random() < (0.03 if ext else 0.12):
            out += ["-m", "iprange", *self.neg(), rng.choice(("--src-range", "--dst-range")), self.iprange()]
        if rng.random() < (0.3 if in_user_chain else 0.05):
            out += ["-m", "mark", *self.neg(0.3), "--mark", rng.choice(MARKS)]
        if self.conntrack and rng.random() < 0.25:
            out += ["-m", "conntrack", *self.neg(0.15), "--ctstate", rng.choice(CT_STATES)]
        return out + ext

    def target(self, chain_index: int | None) -> list[str]:
        rng = self.rng
        t = super().target(chain_index)
        if t[:1] == ["-j"] and t[1] in ("ACCEPT", "DROP") and rng.random() < 0.15:
            return ["-j", "REJECT", "--reject-with", rng.choice(REJECT6)]
        if t[:2] == ["-j", "CONNMARK"] or t[:2] == ["-j", "NFLOG"]:
            return ["-j", "LOG", "--log-prefix", f"fz6{rng.randint(0, 9)}: "]
        return t


def shadowed_lines6(text: str) -> list[int]:
    """shadowed_lines for an ip6tables policy: the containment test on the ranked boxes (ir.family.compress keeps
    containment exact: every address of one elementary interval lies in the same boxes)."""
    from hypafilter.analysis.geometry import BoxSet, contained_in_any
    from hypafilter.iptables.document import parse_policy
    from hypafilter.ir.family import compress

    pol, _ = compress(parse_policy(text, filename="<fuzz6>", base_chain="FORWARD", config=Config(), family=6))
    live: dict[int, bool] = {}
    for i, r in enumerate(pol.rules):
        line = r.origin.line if r.origin else -1
        earlier = [pol.rules[j].boxes for j in range(i) if pol.rules[j].is_simple]
        hidden = bool(r.boxes) and bool(earlier)
        if hidden:
            hidden = bool(contained_in_any(BoxSet.from_unions([r.boxes]), BoxSet.from_unions(earlier)).all())
        live[line] = live.get(line, False) or not hidden
    return sorted(line for line, ok in live.items() if not ok)


def random_policy6(seed: int, conntrack: bool | None = None, rules: int | None = None) -> str:
    """A random ip6tables FORWARD policy as ip6tables-save text, the same for the same arguments (its own random
    stream: seed 1's IPv6 policy is not drawn from seed 1's IPv4 one). What it draws: prefixes and iprange ranges
    over the lab's networks and elsewhere, tcp/udp ports, multiport, tcp-flags, ICMPv6 types (names, prefixes,
    numbers, TYPE/CODE), conntrack states, `-p` of extension headers and other protocols, the matches ip6tables
    decides (frag, hl, ipv6header, hbh, dst, rt, ah), user chains with RETURN, goto and MARK read back, LOG, and
    REJECT with the icmp6-* types. Drawn again while a rule is shadowed by an earlier one (as random_policy)."""
    rng = random.Random(seed * 7919 + 6)
    return _unshadowed(lambda: _draw6(rng, seed, conntrack, rules), shadowed_lines6)


def _draw6(rng: random.Random, seed: int, conntrack: bool | None, rules: int | None) -> str:
    ct = rng.random() < 0.4 if conntrack is None else conntrack
    g = _Gen6(rng, ct, symmetric=ct)
    g.chains = [f"U{i}" for i in range(rng.randint(1, 2))]
    doc = Restore("filter", comment=f"hypafilter fuzz IPv6 policy, seed {seed}")
    doc.chain("INPUT", "ACCEPT")
    doc.chain("FORWARD", rng.choice(("ACCEPT", "DROP")))
    doc.chain("OUTPUT", "ACCEPT")
    for c in g.chains:
        doc.chain(c)
    base = [g.checks(False) + g.target(None) for _ in range(rules if rules is not None else rng.randint(6, 18))]
    if rng.random() < 0.5:  # neighbour discovery accepted, as every real IPv6 policy does, somewhere
        for t in ("neighbour-solicitation", "neighbour-advertisement"):
            base.insert(
                rng.randint(0, len(base)), ["-p", "ipv6-icmp", "-m", "icmp6", "--icmpv6-type", t, "-j", "ACCEPT"]
            )
    if ct:
        rule = ["-m", "conntrack", "--ctstate", "ESTABLISHED,RELATED", "-j", "ACCEPT"]
        base.insert(0 if rng.random() < 0.6 else rng.randint(0, len(base)), rule)
    for c in g.chains:
        if not any(c in rule for rule in base):
            base.insert(rng.randint(0, len(base)), g.checks(False) + ["-j", c])
    for rule in base:
        doc.rule("FORWARD", rule)
    for i, c in enumerate(g.chains):
        if i == 0:
            doc.rule(c, g.checks(True) + ["-j", "MARK", "--set-xmark", rng.choice(MARKS[:4])])
        for _ in range(rng.randint(2, 5)):
            doc.rule(c, g.checks(True) + g.target(i))
    return doc.text()


def policy6(text: str, source: str = "fuzz6", base_chain: str = "FORWARD"):
    """The IPv6 side verify and deploy take (netfilter.ip6.V6Policy: the text as ip6tables loads it, checked by
    ip6tables-restore in a scratch namespace) with the IPv6 front end's reading of it (its rules aim verify6's
    frames; the xdp target plans it)."""
    import dataclasses

    from hypafilter.iptables.document import parse_policy
    from hypafilter.netfilter import ip6

    ir = parse_policy(text, filename=source, base_chain=base_chain, config=Config(), family=6)
    return dataclasses.replace(ip6.parse(text, source, base_chain), ir=ir)


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
        conns = (report.get("connections"), report.get("ipv6", {}).get("connections"))
        self.runs.append(
            {
                **where,
                **{k: report[k] for k in ("packets", "mismatches", "altered", "delivered_oracle")},
                "observer_mismatches": obs.get("mismatches", 0),
                "packets_ipv6": report.get("ipv6", {}).get("packets", 0),
                "unparsed": unparsed(report),
                # the IPv6 frames the NIC's core matched against its IPv6 rows and decided itself (emu, dual stack)
                "hw6": report.get("ipv6", {}).get("hw"),
                # verify --connections: connections run and those whose outcome differs (IPv4's and the dual
                # stack's IPv6 ones)
                "connections": sum((c or {}).get("connections", 0) for c in conns),
                "connection_mismatches": sum((c or {}).get("mismatches", 0) for c in conns),
            }
        )
        self.examples += [{**where, **ex} for ex in report["examples"][:3]]
        self.examples += [{**where, "observer": ex} for ex in obs.get("examples", [])[:3]]
        fam = ("ipv4", "ipv6")
        self.examples += [
            {**where, "connection": ex, "family": f}
            for f, c in zip(fam, conns, strict=True)
            for ex in (c or {}).get("examples", [])[:3]
        ]

    @property
    def frames(self) -> int:
        return sum(v["packets"] for v in self.by_kind.values())

    @property
    def mismatches(self) -> int:
        """Frames whose verdict or bytes differ, plus observing rules whose counters differ (verify's observers) and
        connections whose outcome differs (verify's connections)."""
        return sum(r["mismatches"] + r["observer_mismatches"] + r["connection_mismatches"] for r in self.runs)

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
    v6=None,
    frames6: int = 0,
    connections: int = 0,
) -> Tally:
    """`frames` frames per (mode, strategy) pair through verify, frame seed = seed·100 + the pair's number in
    COMBOS (so a subset of `pairs` sends the same frames per pair as the whole run); `after` runs after each pair
    with the deployment still up (the connection checks); `target`: the fast path (emu, xdp); `attack`: the
    attack shapes (verify.ATTACK_SHAPES) drawn for a share `attack_share` of the frames, counted by kind
    attack_<shape>. `v6` (a policy6()): the dual stack, that ip6tables policy deployed beside `policy` and
    `frames6` IPv6 frames of every verify6 kind after the IPv4 ones (kinds v6_<kind>); on xdp with `xdp_ipv6` on
    and on emu with `emu_ipv6` on, so that the program or the NIC's dual-stack core decides the IPv6 frames it
    parses.
    `connections`: verify's real connections after the frames of each pair (IPv4 ones, and IPv6 ones with `v6`)."""
    from hypafilter.ops.connections import ConnectionSpec

    tally = tally or Tally()
    six = Six(v6, packets=frames6) if v6 is not None else None
    for n, (mode, strategy) in enumerate(pairs):
        t = time.monotonic()
        frame_seed = seed * 100 + COMBOS.index((mode, strategy))
        config = Config(
            shunt_mode=mode,
            strategy=strategy,
            target=target,
            tree_min_segment=FUZZ_TREE_MIN_SEGMENT,
            xdp_ipv6=six is not None and target == "xdp",  # explicit: whatever the configuration's default is
            emu_ipv6=six is not None and target == "emu",
        )
        report = verify(
            policy,
            config,
            six=six,
            connections=ConnectionSpec(connections) if connections else None,
            packets=frames,
            seed=frame_seed,
            malformed=malformed,
            kinds=kinds,
            attack=attack,
            attack_share=attack_share,
        )
        tally.add(report, policy_seed=seed, mode=mode, strategy=strategy, frame_seed=frame_seed)
        v6_note = ""
        if six is not None:
            r6 = report["ipv6"]
            v6_note = f", IPv6 {r6['packets']} frames {r6['mismatches']} mismatches, {unparsed(report)} unparsed"
        log(
            f"seed {seed} {mode}/{strategy}: {report['packets']} frames, {report['mismatches']} mismatches "
            f"(frame seed {frame_seed}, {time.monotonic() - t:.1f} s{v6_note})"
        )
        if after:
            after(mode, strategy, n)
    return tally


def unparsed(report: dict) -> int:
    """Frames the fast path counted unparsed in a verify report (emu: CNT_SHUNT_UNPARSED; xdp: the same name)."""
    return int(report["nic"].get("CNT_SHUNT_UNPARSED", 0))


def counted_rules(ns: str, family: int = 4) -> list[tuple[int, str]]:
    """(packets, rule text) of every rule in the namespace's filter table, from iptables-save -c (ip6tables-save
    for family 6)."""
    import re

    from hypafilter import netns

    out = []
    save = "ip6tables-save" if family == 6 else "iptables-save"
    for ln in netns.run([save, "-c", "-t", "filter"], ns).splitlines():
        m = re.match(r"\[(\d+):\d+\] (-A .*)", ln)
        if m:
            out.append((int(m.group(1)), m.group(2)))
    return out


def pairs_named(text: str) -> tuple[tuple[str, str], ...]:
    """`--pairs`: `quick` (QUICK_COMBOS), `all` (COMBOS) or MODE/STRATEGY[,MODE/STRATEGY...]."""
    if text in ("quick", "all"):
        return QUICK_COMBOS if text == "quick" else COMBOS
    out = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        pair = tuple(part.split("/", 1))
        if pair not in COMBOS:
            raise ValueError(f"{part!r} is no (mode/strategy) pair deploy accepts: {', '.join(map('/'.join, COMBOS))}")
        out.append(pair)
    if not out:
        raise ValueError("no pair given")
    return tuple(out)


@dataclass
class Run:
    """A fuzz run over several policy seeds (`hypafilter fuzz`, `make fuzz-ipv6`): its tally and, per feature of
    FEATURES (FEATURES6 with IPv6), [rules carrying it, packets they matched in the oracle]."""

    tally: Tally = field(default_factory=Tally)
    coverage: dict[str, list[int]] = field(default_factory=dict)
    policies: int = 0
    seconds: float = 0.0

    @property
    def mismatches(self) -> int:
        return self.tally.mismatches + sum(r["altered"] for r in self.tally.runs)

    def summary(self) -> dict:
        v6 = {k: v for k, v in self.tally.by_kind.items() if k.startswith("v6_")}
        return {
            "policies": self.policies,
            "pairs": len(self.tally.runs),
            "frames": self.tally.frames,
            "frames_ipv6": sum(v["packets"] for v in v6.values()),
            "mismatches": self.mismatches,
            "mismatches_ipv6": sum(v["mismatches"] for v in v6.values()),
            "connections": sum(r["connections"] for r in self.tally.runs),
            "connection_mismatches": sum(r["connection_mismatches"] for r in self.tally.runs),
            "seconds": round(self.seconds, 1),
            "coverage": self.coverage,
            "unreached": sorted(f for f, (_, packets) in self.coverage.items() if not packets),
            "examples": self.tally.examples[:6],
        }


def run(
    seeds,
    frames: int,
    pairs: tuple[tuple[str, str], ...] = QUICK_COMBOS,
    target: str = "emu",
    ipv6: bool = False,
    frames6: int = 0,
    log: Callable[[str], None] = lambda s: None,
    attack_share: float = 0.3,
    connections: int = 0,
) -> Run:
    """Each policy seed on every pair of `pairs` (`frames` IPv4 frames per pair; with `ipv6`, the dual stack:
    random_policy6(seed) beside random_policy(seed) and `frames6` IPv6 frames per pair) through verify on the lab
    deploy points at; the oracle's rule counters read after every pair for the coverage. Even seeds read
    conntrack state (as tests/system/test_fuzz.py draws them) and get `connections` real connections per pair
    (verify's, both families with `ipv6`; their address matches treat the lab's two paths alike)."""
    from hypafilter.iptables.document import parse_policy
    from hypafilter.ops import deploy
    from hypafilter.ops.verify import ATTACK_SHAPES, FRAME_KINDS

    out = Run()
    t0 = time.monotonic()
    features = FEATURES6 if ipv6 else FEATURES
    for seed in seeds:
        conntrack = seed % 2 == 0
        text = random_policy(seed, conntrack=conntrack)
        policy = parse_policy(text, filename=f"fuzz-seed-{seed}", base_chain="FORWARD", config=Config())
        v6 = None
        if ipv6:
            text6 = random_policy6(seed, conntrack=conntrack)
            v6 = policy6(text6, f"fuzz6-seed-{seed}")
            log(f"policy seed {seed} (conntrack {conntrack}), IPv6 side:\n{text6}")
        else:
            log(f"policy seed {seed} (conntrack {conntrack}):\n{text}")
        hits: dict[str, int] = {}

        def after(mode: str, strategy: str, n: int, hits: dict[str, int] = hits) -> None:
            for packets, rule in counted_rules(f"{deploy.LAB_NAME}-plain", 6 if ipv6 else 4):
                hits[rule] = hits.get(rule, 0) + packets

        fuzz_policy(
            policy,
            seed,
            frames,
            FRAME_KINDS,
            0.5,
            pairs=pairs,
            tally=out.tally,
            after=after,
            log=log,
            target=target,
            attack=ATTACK_SHAPES if attack_share else (),
            attack_share=attack_share,
            v6=v6,
            frames6=frames6,
            connections=connections if conntrack else 0,
        )
        for feature, needle in features.items():
            rules = [r for r in hits if needle in r]
            cov = out.coverage.setdefault(feature, [0, 0])
            cov[0] += len(rules)
            cov[1] += sum(hits[r] for r in rules)
        out.policies += 1
    out.seconds = time.monotonic() - t0
    return out
