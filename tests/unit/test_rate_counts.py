"""bench rate's arithmetic without a lab: the delivered count a counted run must show, the medians and the
firewall-side ratios, and the refusals that come before anything is deployed."""

import pytest
from hypafilter.config import Config
from hypafilter.errors import HypafilterError
from hypafilter.iptables.document import parse_policy
from hypafilter.tools.bench.rate import _expected, _medians, rate


def test_expected_cycles_through_the_verdicts():
    acc = [True, False, True, True]
    assert _expected(acc, 0) == 0
    assert _expected(acc, 3) == 2
    assert _expected(acc, 4) == 3
    assert _expected(acc, 11) == 2 * 3 + 2


def _run(sent, seconds, cpu_ns):
    return {"sent": sent, "seconds": seconds, "cpu_ns": cpu_ns, "pps": sent / seconds}


def test_medians_subtract_the_sink_per_round():
    rounds = [
        {"sink": _run(100, 1, 1000), "hybrid": _run(50, 1, 1500), "iptables": _run(10, 1, 6000)},
        {"sink": _run(100, 1, 1200), "hybrid": _run(40, 1, 1700), "iptables": _run(8, 1, 7200)},
        {"sink": _run(100, 1, 900), "hybrid": _run(45, 1, 1400), "iptables": _run(9, 1, 5900)},
    ]
    m = _medians(rounds)
    assert m["paths"]["hybrid"]["fw_ns"] == 500 and m["paths"]["iptables"]["fw_ns"] == 5000
    assert m["fw_speedup"] == {"iptables": 10.0}  # every round: (6000-1000)/(1500-1000) = 10, 12, 10
    assert m["speedup"] == {"iptables": 5.0}
    assert "nft" not in m["speedup"] and m["paths"]["sink"]["pps"] == 100


@pytest.mark.parametrize(
    ("kw", "msg"),
    [
        ({"established": True}, "--established needs --trace"),
        ({"seconds": 0}, "--seconds"),
        ({"repeats": -1}, "--repeats"),  # 0: no rate pass
        ({"blocklist": 10}, "parts of --attack's mix"),
        ({"legit": ("tcp", 80)}, "parts of --attack's mix"),
        ({"attack": "syn", "blocklist_as": "bpf"}, "--blocklist-as"),
        ({"target": "nope"}, "unknown target"),
        ({"sender": "nope"}, "unknown sender"),
        ({"target": "emu", "sender": "live"}, "--sender live needs --target xdp"),
    ],
)
def test_refusals_before_the_lab(kw, msg):
    policy = parse_policy("*filter\n:FORWARD DROP [0:0]\n-A FORWARD -p udp -j ACCEPT\nCOMMIT\n")
    with pytest.raises(HypafilterError, match=msg):
        rate(policy, Config(), **({"target": "xdp"} | kw))


def test_results_page_keeps_its_hand_kept_part(tmp_path):
    from hypafilter.tools.bench.report import KEEP_MARK, kept

    md = tmp_path / "results.md"
    assert kept(md) == ""
    md.write_text("# generated\n\n" + KEEP_MARK + "\n\n## XDP target rates\n")
    assert kept(md) == "\n" + KEEP_MARK + "\n\n## XDP target rates\n"
