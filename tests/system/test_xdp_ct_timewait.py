"""test_ct_timewait.py's segments on the xdp lab: the XDP program takes ct from conntrack's own table
(bpf_xdp_ct_lookup) and decides only ESTABLISHED TCP flows (docs/xdp.md), so every segment of a TIME_WAIT flow
goes to conntrack; the hybrid path must still deliver exactly what the policy alone delivers, and leave conntrack
in the same state. Both paths track liberally here (the program needs it), so the out-of-window cases agree too."""

from __future__ import annotations

import pytest
from test_ct_timewait import (  # noqa: F401  (env: the fixture the imported tests use)
    env,
    test_a_normal_close,
    test_late_segments_of_a_closed_connection,
    test_out_of_window_segments,
    test_syn_after_a_normal_close,
    test_syn_from_the_server,
    test_syn_reusing_the_tuple,
)

pytestmark = pytest.mark.system

LAB = "tcx"
TARGET = "xdp"  # conftest's lab fixture brings up an xdp lab
