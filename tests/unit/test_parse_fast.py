"""Equivalence of the parser's whole-line fast path with the general path: identical Policy objects and errors."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypafilter.config import Config
from hypafilter.errors import PolicyError
from hypafilter.iptables import document as parse
from hypafilter.tools.classbench import classbench_policy_text

ROOT = Path(__file__).resolve().parents[2]

# Lines near the edge of the fast path's shape: non-canonical spellings, full ranges, noncontiguous masks,
# service names, bad values (which the fast path must leave to the general path's error), user chains.
EDGE = """*filter
:FORWARD DROP [0:0]
:U - [0:0]
-A FORWARD -s 1.2.3.4 -j ACCEPT
-A FORWARD -s 1.2.3.4/24 -d 0.0.0.0/0 -j DROP
-A FORWARD -s 10.1 -d 10.0.0.0/255.0.255.0 -j ACCEPT
-A FORWARD -d 10.0.0.0/255.255.0.0 -p tcp -j ACCEPT
-A FORWARD -p udp -m udp -j ACCEPT
-A FORWARD -p udp --sport 0:65535 --dport 80:80 -j ACCEPT
-A FORWARD -p tcp --dport 1024: -j DROP
-A FORWARD -p tcp -m tcp --sport :1023 --dport http -j ACCEPT
-A FORWARD -p tcp -m tcp --dport 22 --sport 1 -j ACCEPT
-A FORWARD -p TCP --dport 22 -j ACCEPT
-A FORWARD -s 1.2.3.0/24,5.6.7.0/24 -p udp -j ACCEPT
-A FORWARD -d 1.2.3.4/32 -s 5.6.7.8/32 -j ACCEPT
-A FORWARD -p udp -j U
-A U -s 9.9.9.9/32 -j RETURN
-A U -s 9.9.0.0/16 -p udp --dport 53 -j DROP
-A U -j ACCEPT
-A FORWARD -j ACCEPT
-A FORWARD -j DROP
COMMIT
"""
BAD = [
    "-A FORWARD -s 1.2.3.256/32 -j ACCEPT",
    "-A FORWARD -s 1.2.3.4/33 -j ACCEPT",
    "-A FORWARD -p udp --dport 70000 -j ACCEPT",
    "-A FORWARD -p udp --dport 20:10 -j ACCEPT",
    "-A FORWARD -p udp --dport nosuchservice -j ACCEPT",
    "-A NOCHAIN -s 1.2.3.4/32 -j ACCEPT",
    "-A FORWARD -s -j ACCEPT",
    "-A FORWARD -s host.example -j DROP",
    "-A FORWARD -p tcp -m udp --dport 22 -j ACCEPT",
]


FAST_TAKEN = [0]  # lines the fast path took, so the tests can show it really ran


def both(text: str, name: str = "t.rules"):
    """(fast-path result, general-path result) of parse_policy; a PolicyError is returned as its text."""
    out = []
    for fast in (True, False):
        old, parse.FAST_PATH = parse.FAST_PATH, fast
        try:
            out.append(parse.parse_policy(text, name, "FORWARD", Config()))
        except PolicyError as e:
            out.append(str(e))
        finally:
            parse.FAST_PATH = old
    return out


@pytest.fixture(autouse=True)
def count_fast(monkeypatch):
    real = parse._Document._fast

    def counted(self, no, raw):
        took = real(self, no, raw)
        FAST_TAKEN[0] += took
        return took

    FAST_TAKEN[0] = 0
    monkeypatch.setattr(parse._Document, "_fast", counted)


def test_edge_lines_identical():
    fast, general = both(EDGE)
    assert not isinstance(fast, str), fast
    assert fast == general
    assert fast.canonical_text() == general.canonical_text()
    assert FAST_TAKEN[0] == 11


@pytest.mark.parametrize("line", BAD)
def test_bad_lines_same_error(line):
    fast, general = both(f"*filter\n:FORWARD ACCEPT [0:0]\n{line}\nCOMMIT\n")
    assert isinstance(fast, str) and fast == general


@pytest.mark.parametrize("path", sorted((ROOT / "rulesets").glob("*.rules")), ids=lambda p: p.name)
def test_rulesets_identical(path):
    fast, general = both(path.read_text(), path.name)
    assert fast == general


@pytest.mark.shared
def test_classbench_sample_identical(shared_dir):
    """The first 2,000 rules of acl1_10k with complex rules mixed in (the benchmark's shape)."""
    text = classbench_policy_text(shared_dir / "data/classbench/acl1_10k.filters", complex_rules=200)
    lines = text.splitlines()
    head = [ln for ln in lines if not ln.startswith("-A ")][:-1]  # comment, *filter, chain line (COMMIT last)
    rules = [ln for ln in lines if ln.startswith("-A ")][:2000]
    fast, general = both("\n".join(head + rules + ["COMMIT"]) + "\n", "acl1_10k")
    assert not isinstance(fast, str), fast
    assert len(fast.rules) == 2000
    assert FAST_TAKEN[0] > 1500
    assert fast == general
    assert [r.levels for r in fast.rules] == [r.levels for r in general.rules]


@pytest.mark.shared
def test_conformance_lines_identical(shared_dir):
    """Every rule line of the iptables conformance corpus, appended to FORWARD: same policy or same error."""
    n = 0
    for path in sorted((shared_dir / "peer-tests" / "iptables-extensions").glob("*.t")):
        for line in path.read_text().splitlines():
            parts = line.rsplit(";", 2)
            if line.startswith(("#", ":")) or len(parts) != 3:
                continue
            for rule in {parts[0], parts[1]} - {"", "="}:
                fast, general = both(f"*filter\n:FORWARD ACCEPT [0:0]\n-A FORWARD {rule}\nCOMMIT\n", path.name)
                assert fast == general, rule
                n += 1
    assert n > 500
