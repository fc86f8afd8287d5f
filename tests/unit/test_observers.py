"""Observing rules' counters as verify compares them (ops.observers), and which policies verify accepts."""

from collections import Counter

import pytest
from hypafilter.config import Config
from hypafilter.errors import HypafilterError
from hypafilter.iptables.document import parse_policy
from hypafilter.ops import observers
from hypafilter.ops.verify import refuse_nondeterministic


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ('-p tcp -m tcp --dport 22 -j LOG --log-prefix "ssh: "', True),
        ("-s 10.0.0.0/8 -j NFLOG --nflog-group 7", True),
        ("-d 10.128.0.0/9 -m comment --comment obs4", True),
        ("-p tcp -j ACCEPT", False),
        ("-j HF1_MAIN", False),
        ("-m mark --mark 0x10/0xfff0 -g HF1_L1A1", False),
        ("-j MARK --set-xmark 0x0/0xffffffff", False),
        ('-m comment --comment "-j ACCEPT" -j LOG', True),
    ],
)
def test_observing(text, want):
    assert observers.observing(text) is want


def test_compare_sums_and_skips_incomparable():
    fw0 = Counter({"-p tcp -j LOG": 5})
    fw1 = Counter({"-p tcp -j LOG": 9, "-p udp -j NFLOG --nflog-group 1": 1, "-m limit --limit 1/s -j LOG": 0})
    pl0 = Counter()
    pl1 = Counter({"-p tcp -j LOG": 4, "-p udp -j NFLOG --nflog-group 1": 2, "-m limit --limit 1/s -j LOG": 7})
    r = observers.compare(fw0, fw1, pl0, pl1, comparable=lambda t: "limit" not in t)
    assert (r["rules"], r["not_comparable"], r["mismatches"]) == (3, 1, 1)
    assert r["examples"] == [{"rule": "-p udp -j NFLOG --nflog-group 1", "oracle": 2, "hybrid": 1, "comparable": True}]


def _policy(rule: str):
    return parse_policy(
        f"*filter\n:FORWARD DROP [0:0]\n-A FORWARD {rule}\n-A FORWARD -p tcp -j ACCEPT\nCOMMIT\n",
        filename="v.rules",
        base_chain="FORWARD",
        config=Config(),
    )


def test_verify_accepts_rate_limited_observers_only():
    """A rate limit on a LOG rule changes what is logged, never a verdict: verify compares the policy with nothing
    to check after the run; on a deciding rule it is a Limited rule (checked after the run, tests/unit/
    test_verify_limits.py), which a benchmark (limits=False) refuses, naming file and line."""
    assert refuse_nondeterministic(_policy('-p icmp -m limit --limit 3/min -j LOG --log-prefix "icmp: "')) == []
    assert refuse_nondeterministic(_policy("-p icmp -m statistic --mode random --probability 0.5")) == []
    assert [x.match for x in refuse_nondeterministic(_policy("-p icmp -m limit --limit 3/min -j ACCEPT"))] == ["limit"]
    with pytest.raises(HypafilterError, match=r"v.rules:3: verify refuses match 'limit'"):
        refuse_nondeterministic(_policy("-p icmp -m limit --limit 3/min -j ACCEPT"), limits=False)
    # a recent list other rules may read: never exempt on an observing rule, a Limited rule for its timer
    [x] = refuse_nondeterministic(_policy("-p icmp -m recent --set --name x --seconds 5 -j LOG"))
    assert (x.match, x.seconds, x.name) == ("recent", 5, "x")
    with pytest.raises(HypafilterError, match=r"v.rules:3: verify refuses match 'statistic'"):
        refuse_nondeterministic(_policy("-p icmp -m statistic --mode random --probability 0.5 -j DROP"))
