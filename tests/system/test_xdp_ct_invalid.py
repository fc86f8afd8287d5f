"""test_ct_invalid.py's frames on the xdp lab: the XDP program takes ct from conntrack's own table
(bpf_xdp_ct_lookup), which finds the flow's entry without running conntrack's error checks (tcp_error,
udp_error), so it must not call a frame ESTABLISHED that conntrack itself would call INVALID."""

from __future__ import annotations

import pytest
from test_ct_invalid import CSUM_CASES, FLAG_CASES, LENGTH_CASES, check, known_divergence, run

pytestmark = pytest.mark.system

LAB = "ecx"
TARGET = "xdp"  # conftest's lab fixture brings up an xdp lab


def test_segments_without_ack_are_not_established(lab):
    check(run(lab, FLAG_CASES, target=TARGET))


def test_bad_lengths_are_not_established(lab):
    check(run(lab, LENGTH_CASES, target=TARGET))


def test_bad_checksums_are_an_open_divergence(lab):
    """XDP does not see the checksum state conntrack trusts instead of summing (CHECKSUM_PARTIAL on veth), so it
    does not sum the segment (docs/flowsync.md)."""
    known_divergence(run(lab, CSUM_CASES, target=TARGET))
