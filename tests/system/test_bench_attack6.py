"""`hypafilter bench rate -6 --attack` on the xdp lab (docs/ipv6.md "bench rate with IPv6", the attack mix): a
conntrack-first ClassBench set mapped into IPv6 (acl1_1100's first 60 filters, `--ct-first --policy DROP`, its trace
rows mapped beside it), a UDP flood from spoofed IPv6 sources and from an inet6 blocklist (`-m set` over a `hash:net
family inet6` set ahead of the policy, an ip6 interval set on the nft path), and legitimate IPv6 connections under
the flood: every frame's verdict compared with the kernel alone (ip6tables and nft of the plain namespace), the
connections completed on both paths counted with real sockets. Speed is measured, not asserted (docs/results.md
"IPv6 attack mix"). Lab `a6a`."""

from __future__ import annotations

import json

import pytest
from hypafilter import netns

from conftest import need_tool
from tests.hfcli import HfCli
from tests.system.test_bench_rate_v6 import acl60  # noqa: F401  (the fixture: acl1_1100's first 60 filters, UDP rows)

pytestmark = pytest.mark.system

LAB = "a6a"
STATE = f"/run/hypafilter/test-{LAB}"
HF = HfCli(LAB, STATE)
SET6 = "hfrate-block6"


@pytest.fixture(scope="module")
def lab():
    need_tool("ipset", "ip6tables-restore")
    with HF.xdp_lab() as name:
        yield name


def test_ipv6_attack_mix(lab, request):
    filters, trace = request.getfixturevalue("acl60")
    p = HF(
        "bench", "rate", "-6", "--classbench", str(filters), "--ct-first", "--policy", "DROP", "--trace", str(trace),
        "--target", "xdp", "--attack", "udp", "--attackers", "50", "--blocklist", "100", "--blocklist-as", "ipset",
        "--frames", "300", "--repeats", "0", "--prog-repeat", "0", "--legit-connections", "4", "--json",
    )  # fmt: skip
    r = json.loads(p.stdout.splitlines()[-1])
    assert r["mismatches"] == 0 and r["mismatches_vs_iptables"] == 0, r["examples"]
    assert r["mismatches_vs_nft"] == 0 and r["nft_error"] is None, (r["nft_error"], r["examples_vs_nft"])
    assert r["ipv6"]["frames"] == r["frames"] == 300 and r["ipv6"]["rules"] == 62  # the ct rule, the set's, 60
    assert r["delivered"] == {"hybrid": 0, "iptables": 0, "nft": 0}  # every attack frame dropped on every path
    parts = r["attack"]["hw_share"]
    assert (parts["spoofed"]["frames"], parts["blocklist"]["frames"]) == (150, 150), parts
    # new flows the policy drops and the blocklist's set slot: decided in XDP, none left to the kernel
    assert parts["spoofed"]["hw_share"] == parts["blocklist"]["hw_share"] == 1.0, parts
    assert (r["attack"]["blocklist"], r["attack"]["blocklist_as"]) == (100, "ipset")
    legit = r["legit"]
    assert legit["proto"] == "udp" and ":" in legit["client"] and ":" in legit["server"], legit
    assert legit["completed"] == {"hybrid": 4, "iptables": 4} and r["legit_connections_ok"] is True, legit
    for role in ("fw", "plain"):
        save = netns.run(["ipset", "save", SET6], f"{LAB}-{role}").splitlines()
        assert "family inet6" in save[0] and len(save) == 101, role
