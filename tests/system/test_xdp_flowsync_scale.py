"""The flow sync service over a conntrack table of real size on the xdp lab (issue #24), the twin of
test_flowsync_scale.py: the same HF_CT_SCALE entries in the firewall namespace, the same deploy, `kill -9`, restart
and failed start through the command line; the table here is the liberal marks (docs/flowsync.md, "The xdp target:
liberal marks"): every TCP entry marked liberal in both directions, read back with pyroute2 on a sample."""

from __future__ import annotations

import pytest
from hypafilter import netns
from test_flowsync_scale import liberal_of, run_scale, sample

from conftest import need_tool
from tests.hfcli import HfCli

pytestmark = pytest.mark.system

LAB = "fscx"
STATE = f"/run/hypafilter/test-{LAB}"

hf = HfCli(LAB, STATE)


@pytest.fixture(scope="module")
def xdp_lab():
    need_tool("conntrack")
    with hf.xdp_lab():
        yield LAB
        netns.run(["conntrack", "-F"], f"{LAB}-fw", check=False)


def test_liberal_marks_over_a_large_conntrack_table(xdp_lab, tmp_path):
    def check_table(flows):
        tcp = [f for f in flows if f[0] == "tcp"]
        marks = liberal_of(f"{LAB}-fw", sample(tcp))
        assert all(marks.values()), f"{list(marks.values()).count(False)} of {len(marks)} TCP entries not liberal"

    run_scale(hf, "xdp", tmp_path, check_table)
