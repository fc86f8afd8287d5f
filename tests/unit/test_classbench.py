"""Unit tests for hypafilter.tools.classbench and `hypafilter import-classbench`."""

from __future__ import annotations

import gzip

import numpy as np
import pytest
from hypafilter.cli import main
from hypafilter.config import Config
from hypafilter.errors import HypafilterError, PolicyError
from hypafilter.iptables.document import parse_policy
from hypafilter.tools.classbench import (
    classbench_policy,
    classbench_policy_text,
    complex_positions,
    read_filters,
    read_trace,
)

FILTERS = (
    "@192.168.0.0/16\t10.1.2.3/32\t0 : 65535\t80 : 80\t0x06/0xFF\t0x0000/0x0200\t\n"
    "@0.0.0.0/0\t10.0.0.0/8\t1024 : 65535\t0 : 65535\t0x11/0xFF\t0x0000/0x0000\t\n"
    "@1.2.3.4/32\t0.0.0.0/0\t0 : 65535\t1000 : 2000\t0x00/0x00\t0x0000/0x0000\t\n"
    "@5.6.7.0/24\t0.0.0.0/0\t53 : 53\t53 : 53\t0x11/0xFF\t0x0000/0x0000\t\n"
)


@pytest.fixture
def filters(tmp_path):
    f = tmp_path / "x.filters"
    f.write_text(FILTERS)
    return f


def test_positions_follow_the_issue_formula():
    assert complex_positions(10, 2) == [2, 7]
    assert complex_positions(1100, 4) == [137, 412, 687, 962]
    assert complex_positions(5, 0) == []
    with pytest.raises(HypafilterError):
        complex_positions(3, 4)


def test_policy_text(filters):
    lines = classbench_policy_text(filters, complex_rules=1, policy="DROP", actions="alternate").splitlines()
    rules = [ln for ln in lines if ln.startswith("-A")]
    assert ":FORWARD DROP [0:0]" in lines
    assert rules[0] == "-A FORWARD -s 192.168.0.0/16 -d 10.1.2.3/32 -p udp -m udp --dport 80 -j ACCEPT"
    assert rules[1] == "-A FORWARD -d 10.0.0.0/8 -p udp -m udp --sport 1024:65535 -j DROP"
    assert rules[2] == (
        "-A FORWARD -s 1.2.3.4/32 -p udp -m udp --dport 1000:2000 -m string --algo bm ! --string BAD "
        "-m statistic --mode random --probability 0.99 -j ACCEPT"
    )
    det = classbench_policy_text(filters, complex_rules=1, deterministic=True)
    assert "statistic" not in det and "! --string BAD -j ACCEPT" in det


def test_direct_ir_equals_parsed_text(filters):
    for det in (False, True):
        text = classbench_policy_text(filters, complex_rules=2, deterministic=det, actions="alternate")
        parsed = parse_policy(text, str(filters), "FORWARD", Config())
        direct = classbench_policy(filters, complex_rules=2, deterministic=det, actions="alternate")
        assert [r.boxes for r in parsed.rules] == [r.boxes for r in direct.rules]
        assert [r.is_simple for r in parsed.rules] == [r.is_simple for r in direct.rules] == [True, False, True, False]
        assert parsed.original_rules == direct.original_rules


def test_bad_filter_line_names_file_and_line(tmp_path):
    f = tmp_path / "bad.filters"
    f.write_text(FILTERS + "@300.1.1.1/32\t0.0.0.0/0\t0 : 1\t0 : 1\t0x11/0xFF\t0x0/0x0\n")
    with pytest.raises(PolicyError, match=r"bad.filters:5:1"):
        read_filters(f)


def test_read_trace_gz_and_plain(tmp_path):
    rows = "3232235521\t167837955\t1234\t80\t6\t0\t1\n16909060\t1\t0\t1500\t17\t0\t3\n"
    (tmp_path / "t.txt").write_text(rows)
    with gzip.open(tmp_path / "t.gz", "wt") as f:
        f.write(rows)
    a, b = read_trace(tmp_path / "t.txt"), read_trace(tmp_path / "t.gz")
    assert a.shape == (2, 7) and (a == b).all() and a[0, 0] == 3232235521
    with pytest.raises(HypafilterError, match="cannot read trace"):
        read_trace(tmp_path / "missing.gz")
    assert np.array_equal(read_filters_ok(tmp_path), [0, 0xFFFFFFFF])


def read_filters_ok(tmp_path):
    f = tmp_path / "w.filters"
    f.write_text("@0.0.0.0/0\t0.0.0.0/0\t0 : 65535\t0 : 65535\t0x00/0x00\t0x0000/0x0000\n")
    return read_filters(f)[0, :2]


def test_import_command(filters, tmp_path, capsys):
    out = tmp_path / "p.rules"
    assert main(["import-classbench", str(filters), "--complex", "2", "--deterministic", "-o", str(out)]) == 0
    assert out.read_text() == classbench_policy_text(filters, 2, deterministic=True)
    assert main(["import-classbench", str(filters), "--complex", "9"]) == 2
    assert "between 0 and" in capsys.readouterr().err
