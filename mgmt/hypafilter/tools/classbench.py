"""ClassBench filter sets → iptables policies (as the paper uses them), and the header-trace reader.

Every filter becomes `-p udp` with its prefixes and port ranges (the protocol and flags columns are ignored, as
in the paper). K rules, at 0-based positions floor((2j+1)·N/(2K)), j = 0..K−1, get the complex checks
`-m string --algo bm ! --string BAD -m statistic --mode random --probability 0.99` (deterministic: without
the statistic match, so verdicts can be compared packet by packet).
"""

from __future__ import annotations

import gzip
import ipaddress
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hypafilter.errors import HypafilterError, PolicyError
from hypafilter.iptables.writer import Restore, rule_line
from hypafilter.ir import FIELD_INDEX, MAXV, NDIM, PROTO_UDP, Box, Level, Origin, Policy, Rule

STRING = ("-m", "string", "--algo", "bm", "!", "--string", "BAD")
STATISTIC = ("-m", "statistic", "--mode", "random", "--probability", "0.99")


def read_filters(path: str | Path) -> np.ndarray:
    """int64 [N, 8]: src_lo, src_hi, dst_lo, dst_hi, sport_lo, sport_hi, dport_lo, dport_hi."""
    p = Path(path)
    try:
        lines = p.read_text().splitlines()
    except OSError as e:
        raise HypafilterError(f"{p}: {e.strerror}") from e
    out = []
    for no, line in enumerate(lines, 1):
        if not line.strip():
            continue
        parts = line.lstrip("@").split("\t")
        try:
            s_lo, s_hi = _prefix(parts[0])
            d_lo, d_hi = _prefix(parts[1])
            sp = [int(x) for x in parts[2].split(":")]
            dp = [int(x) for x in parts[3].split(":")]
            if len(sp) != 2 or len(dp) != 2 or not (0 <= sp[0] <= sp[1] <= 65535 and 0 <= dp[0] <= dp[1] <= 65535):
                raise ValueError("bad port range")
        except (ValueError, IndexError) as e:
            raise PolicyError(f"not a ClassBench filter ({e})", str(p), no, 1, line.split("\t")[0][:40]) from e
        out.append((s_lo, s_hi, d_lo, d_hi, *sp, *dp))
    if not out:
        raise HypafilterError(f"{p}: no filters")
    return np.array(out, dtype=np.int64)


def _prefix(text: str) -> tuple[int, int]:
    """ "a.b.c.d/len" → (lo, hi); ipaddress is too slow for 100k-rule sets."""
    addr, _, plen = text.strip().partition("/")
    octets = [int(o) for o in addr.split(".")]
    n = int(plen) if plen else 32
    if len(octets) != 4 or not all(0 <= o <= 255 for o in octets) or not 0 <= n <= 32:
        raise ValueError(f"bad prefix {text.strip()!r}")
    v = (octets[0] << 24) | (octets[1] << 16) | (octets[2] << 8) | octets[3]
    host = (1 << (32 - n)) - 1
    return v & ~host, (v & ~host) | host


def complex_positions(n: int, k: int) -> list[int]:
    """floor((2j+1)·N/(2K)) for j = 0..K−1."""
    if k < 0 or k > n:
        raise HypafilterError(f"--complex must be between 0 and the number of rules ({n})")
    return [((2 * j + 1) * n) // (2 * k) for j in range(k)]


def _cidr(lo: int, hi: int) -> str | None:
    if lo == 0 and hi == 0xFFFFFFFF:
        return None
    size = hi - lo + 1
    return f"{ipaddress.IPv4Address(lo)}/{32 - size.bit_length() + 1}"


def _options(row, extra: tuple[str, ...]) -> list[str]:
    opts: list[str] = []
    s, d = _cidr(row[0], row[1]), _cidr(row[2], row[3])
    if s:
        opts += ["-s", s]
    if d:
        opts += ["-d", d]
    opts += ["-p", "udp"]
    ports = []
    for flag, lo, hi in (("--sport", row[4], row[5]), ("--dport", row[6], row[7])):
        if (lo, hi) != (0, 65535):
            ports += [flag, str(lo) if lo == hi else f"{lo}:{hi}"]
    if ports:
        opts += ["-m", "udp", *ports]
    return opts + list(extra)


@dataclass(frozen=True)
class Conversion:
    """How a filter set becomes a policy: how many rules get the complex checks (and whether the random statistic
    match is among them), the rules' actions (all ACCEPT, or alternating with DROP), the base chain and its policy."""

    complex_rules: int = 0
    policy: str = "ACCEPT"
    actions: str = "accept"
    deterministic: bool = False
    chain: str = "FORWARD"

    def __post_init__(self) -> None:
        if self.policy not in ("ACCEPT", "DROP"):
            raise HypafilterError("--policy must be ACCEPT or DROP")
        if self.actions not in ("accept", "alternate"):
            raise HypafilterError("--actions must be accept or alternate")

    def rules(self, filters_path: str | Path):
        """(index, filter row, complex checks, target) per filter, in order."""
        rows = read_filters(filters_path)
        cx = set(complex_positions(len(rows), self.complex_rules))
        extra = STRING if self.deterministic else STRING + STATISTIC
        for i, row in enumerate(rows.tolist()):
            target = "DROP" if self.actions == "alternate" and i % 2 else "ACCEPT"
            yield i, row, (extra if i in cx else ()), target


def classbench_policy_text(filters_path: str | Path, *conversion, **options) -> str:
    """An iptables-save text of the filter set; the other arguments are `Conversion`'s, by position or by name."""
    conv = Conversion(*conversion, **options)
    doc = Restore(
        comment=f"ClassBench {Path(filters_path).name}: complex={conv.complex_rules} deterministic={conv.deterministic}"
    )
    doc.chain(conv.chain, conv.policy)
    for _i, row, extra, target in conv.rules(filters_path):
        doc.rule(conv.chain, (*_options(row, extra), "-j", target))
    return doc.text()


def classbench_policy(filters_path: str | Path, *conversion, **options) -> Policy:
    """The same policy built straight into the IR (no text round trip; for benchmarks and large analyses)."""
    conv = Conversion(*conversion, **options)
    chain = conv.chain
    rules, orig = [], []
    src = str(filters_path)
    for i, row, extra, target in conv.rules(filters_path):
        tokens = (*_options(row, extra), "-j", target)
        # FIELDS order: src, dst, proto, sport, dport, icmp_type, icmp_code, iport, ct.
        b = Box(
            (row[0], row[2], PROTO_UDP, row[4], row[6], 0, 0, 0, 0),
            (row[1], row[3], PROTO_UDP, row[5], row[7], MAXV[5], MAXV[6], MAXV[7], MAXV[8]),
        )
        complex_ = (STRING, STATISTIC) if extra and not conv.deterministic else ((STRING,) if extra else ())
        rules.append(
            Rule(
                boxes=(b,),
                target=target,
                complex=complex_,
                levels=(Level(options=tokens[:-2]),),
                # Line i + 4 of the text: the comment, *filter and the chain line come first.
                origin=Origin(src, i + 4, chain, rule_line(chain, tokens)),
            )
        )
        orig.append(tokens)
    return Policy(rules=rules, default=conv.policy, base_chain=chain, source=src, original_rules=orig)


def read_trace(path: str | Path) -> np.ndarray:
    """int64 [P, 7]: SRC DST SPORT DPORT PROTO FLAGS FILTER_NUMBER per header (gzip or plain text)."""
    p = Path(path)
    try:
        opener = gzip.open if p.suffix == ".gz" else open
        with opener(p, "rt") as f:
            data = np.loadtxt(f, dtype=np.int64, ndmin=2)
    except (OSError, ValueError, EOFError) as e:
        raise HypafilterError(f"{p}: cannot read trace: {e}") from e
    if data.size == 0:
        return np.zeros((0, 7), dtype=np.int64)
    if data.shape[1] < 5:
        raise HypafilterError(f"{p}: a trace line needs at least SRC DST SPORT DPORT PROTO")
    if data.shape[1] < 7:
        data = np.hstack([data, np.zeros((len(data), 7 - data.shape[1]), dtype=np.int64)])
    return data[:, :7]


def trace_udp_values(trace: np.ndarray) -> np.ndarray:
    """Header points [P, NDIM] in FIELDS order, every header taken as UDP (as in the paper)."""
    v = np.zeros((len(trace), NDIM), dtype=np.int64)
    v[:, FIELD_INDEX["src"]] = trace[:, 0]
    v[:, FIELD_INDEX["dst"]] = trace[:, 1]
    v[:, FIELD_INDEX["sport"]] = trace[:, 2]
    v[:, FIELD_INDEX["dport"]] = trace[:, 3]
    v[:, FIELD_INDEX["proto"]] = PROTO_UDP
    return v
