"""`hypafilter bench rate` with IPv6 (docs/ipv6.md "bench rate with IPv6"): on xdp `-6 --classbench` (the filter set
and its trace mapped into IPv6 as the analysis benchmark maps them) and a dual stack (`POLICY --ipv6 V6POLICY`), each
frame of the correctness pass compared with the kernel alone (iptables and ip6tables of the plain namespace), a short
rate pass whose delivered counts the bench checks against those verdicts; on the emulated NIC a dual stack through
its dual-stack core. Opt-in (`make test-bench-v6`, HF_BENCH_V6=1: 25 s with the labs, the program builds and the
emulator's core cached); the measured figures are docs/results.md's. Labs `w2c` (xdp), `w2d` (emu)."""

from __future__ import annotations

import gzip
import json
import os
import shutil
import subprocess
import sys

import pytest

from conftest import need_root, need_tool
from tests.system.test_deploy import POLICY_A
from tests.system.test_ipv6_deploy import HW6

pytestmark = [
    pytest.mark.system,
    pytest.mark.optin("HF_BENCH_V6"),  # make test-bench-v6
]

LAB = "w2c"
STATE = f"/run/hypafilter/test-{LAB}"
HF = [sys.executable, "-m", "hypafilter"]
SHORT = ("--seconds", "0.3", "--repeats", "1", "--json")


def hf(*args: str) -> dict:
    env = dict(os.environ, HF_LAB=LAB, HF_STATE_DIR=STATE)
    p = subprocess.run(HF + list(args), capture_output=True, text=True, env=env)
    assert p.returncode == 0, f"hypafilter {' '.join(args)}: {p.stderr[-3000:]}\n{p.stdout[-2000:]}"
    return json.loads(p.stdout.splitlines()[-1]) if "--json" in args else {}


@pytest.fixture(scope="module")
def lab():
    need_root()
    need_tool("ip", "iptables-restore", "ip6tables-restore", "clang", "cc", "ethtool", "nft")
    env = dict(os.environ, HF_LAB=LAB, HF_STATE_DIR=STATE)
    subprocess.run(HF + ["lab", "down", "--name", LAB], capture_output=True, env=env)
    shutil.rmtree(STATE, ignore_errors=True)
    hf("lab", "up", "--target", "xdp", "--name", LAB)
    yield LAB
    subprocess.run(HF + ["undeploy", "-q"], capture_output=True, env=env)
    subprocess.run(HF + ["lab", "down", "--name", LAB], capture_output=True, env=env)
    shutil.rmtree(STATE, ignore_errors=True)


@pytest.fixture
def acl60(shared_dir, tmp_path):
    """acl1_1100's first 60 filters and the rows of its trace those filters generated (FILTER < 60), taken as UDP (the
    import's rules are `-p udp`, as the paper takes every header; acl1's trace is TCP), so that they meet the rules."""
    src = shared_dir / "data" / "classbench"
    filters = tmp_path / "acl1_60.filters"
    filters.write_text("".join((src / "acl1_1100.filters").read_text().splitlines(keepends=True)[:60]))
    trace = tmp_path / "acl1_60_trace"
    with gzip.open(src / "acl1_1100_trace.gz", "rt") as f:
        rows = [ln.split() for ln in f if ln.split() and int(ln.split()[6]) < 60]
    trace.write_text("".join(" ".join([*r[:4], "17", *r[5:]]) + "\n" for r in rows))
    return filters, trace


def test_bench_rate_classbench_ipv6(lab, acl60):
    """Every frame IPv6 (the trace mapped beside the set), decided in XDP in exact mode, the kernel's verdicts."""
    filters, trace = acl60
    r = hf(
        "bench", "rate", "-6", "--classbench", str(filters), "--trace", str(trace), "--mode", "exact",
        "--actions", "alternate", "--target", "xdp", "--frames", "2000", *SHORT,
    )  # fmt: skip
    six = r["ipv6"]
    assert r["mismatches"] == 0 and r["mismatches_vs_iptables"] == 0, r["examples"]
    assert six["frames"] == r["frames"] == 2000 and six["trace"] and six["rules"] == 60 and six["hw_entries"] > 0
    d = r["delivered"]
    assert d["hybrid"] == d["iptables"] and 0 < d["iptables"] < 2000, d  # alternate actions: both verdicts
    assert r["hw_share"] > 0.9 and r["nic"].get("CNT_SHUNT_UNPARSED", 0) == 0, r["nic"]
    assert r["nft_error"] is None and r["mismatches_vs_nft"] == 0 and d["nft"] == d["iptables"]  # ip6 table in nft
    assert r["hybrid_pps"] > 0 and r["iptables_pps"] > 0 and r["nft_pps"] > 0 and r["fw_ns"]["hybrid"] is not None
    assert set(r["paths"]) == {"sink", "hybrid", "iptables", "nft"}


def test_bench_rate_dual_stack(lab, tmp_path):
    """Both families' frames (half IPv6), each compared with its own policy alone in the kernel."""
    (tmp_path / "a.rules").write_text(POLICY_A)
    (tmp_path / "hw6.rules").write_text(HW6)
    r = hf(
        "bench", "rate", str(tmp_path / "a.rules"), "--ipv6", str(tmp_path / "hw6.rules"), "--target", "xdp",
        "--frames", "1000", *SHORT,
    )  # fmt: skip
    assert r["mismatches"] == 0 and r["ipv6"]["frames"] == 500 and r["frames"] == 1000, r["examples"]
    assert 0 < r["delivered"]["hybrid"] == r["delivered"]["iptables"] < 1000
    assert r["hw_share"] > 0.3, r["nic"]
    assert r["nft_pps"] is None and "-m string" in r["nft_error"]  # POLICY_A's string match: no nft path, as for IPv4


EMU_LAB = "w2d"


def test_bench_rate_dual_stack_emu(tmp_path):
    """The emulated NIC's dual-stack core (`emu_ipv6`, docs/ipv6.md "## emu") under the bench: both families' frames
    through the core (the correctness pass, paced by the NIC), each compared with its own policy alone in the kernel;
    the IPv6 rows decide frames too. The core of POLICY_A beside HW6 is test_ipv6_deploy's and test_ipv6_alone's
    (cached by its matchers; a cold build is about a minute)."""
    need_root()
    env = dict(os.environ, HF_LAB=EMU_LAB, HF_STATE_DIR=f"/run/hypafilter/test-{EMU_LAB}")
    subprocess.run(HF + ["lab", "down", "--name", EMU_LAB], capture_output=True, env=env)
    shutil.rmtree(env["HF_STATE_DIR"], ignore_errors=True)
    (tmp_path / "a.rules").write_text(POLICY_A)
    (tmp_path / "hw6.rules").write_text(HW6)
    try:
        p = subprocess.run(HF + ["lab", "up", "--name", EMU_LAB], capture_output=True, text=True, env=env)
        assert p.returncode == 0, p.stderr[-2000:]
        p = subprocess.run(
            HF + ["bench", "rate", str(tmp_path / "a.rules"), "--ipv6", str(tmp_path / "hw6.rules")]
            + ["--target", "emu", "--frames", "1000", "--json"],
            capture_output=True, text=True, env=env,
        )  # fmt: skip
        assert p.returncode == 0, p.stderr[-3000:]
        r = json.loads(p.stdout.splitlines()[-1])
        assert r["mismatches"] == 0 and r["ipv6"]["frames"] == 500 and r["ipv6"]["hw_entries"] == 7, r["examples"]
        assert 0 < r["delivered"]["hybrid"] == r["delivered"]["iptables"] < 1000
        assert r["hw_share"] > 0.5 and r["nic"].get("CNT_SHUNT_UNPARSED", 0) < 50, r["nic"]
    finally:
        subprocess.run(HF + ["undeploy", "-q"], capture_output=True, env=env)
        subprocess.run(HF + ["lab", "down", "--name", EMU_LAB], capture_output=True, env=env)
        shutil.rmtree(env["HF_STATE_DIR"], ignore_errors=True)
