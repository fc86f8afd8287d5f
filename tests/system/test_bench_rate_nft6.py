"""`hypafilter bench rate -6` against nft (docs/ipv6.md "bench rate with IPv6") and with inet6 ipsets, on xdp: every
frame of the correctness pass through the hybrid, through the IPv6 policy alone in ip6tables (the oracle) and through
it alone in nft (netfilter.nft's ip6 text, with ip6tables' hotdrop guards), compared frame by frame; a short rate
pass whose delivered counts the bench checks against each path's own verdicts. Those two are opt-in (`make
test-bench-v6`, HF_BENCH_V6=1; lab `w4a`); the nft text's load into the kernel beside the policy in ip6tables is
not (a scratch namespace, about a second)."""

from __future__ import annotations

import dataclasses
import json

import pytest
from hypafilter.config import Config
from hypafilter.iptables.document import parse_policy
from hypafilter.netfilter import ip6
from hypafilter.netfilter.nft import xt_matches6
from hypafilter.tools.bench.rate import NFT_TABLE, nft_text6

from conftest import ns_sh
from tests.hfcli import HfCli
from tests.scratchns import scratch_netns
from tests.system.test_deploy import POLICY_A
from tests.system.test_ipset6_xdp import SETS, V6
from tests.system.test_ipv6_deploy import HW6

pytestmark = pytest.mark.system

LAB = "w4a"
STATE = f"/run/hypafilter/test-{LAB}"
hf = HfCli(LAB, STATE)
SHORT = ("--target", "xdp", "--seconds", "0.2", "--repeats", "1", "--prog-repeat", "0", "--json")


def test_nft_text6_loads():
    """HW6 in ip6tables (as the bench's oracle loads it) and its nft text beside it: nft takes the text, the guards are
    those of the matches this ip6tables runs as xtables matches (icmp6 with either back end here), and the text
    replaces itself when loaded again."""
    with scratch_netns("w4n", "ip6tables-restore", "nft") as ns:
        ns_sh(ns, "ip6tables-restore", stdin=HW6)
        hot = xt_matches6(ns)
        assert "icmp6" in hot
        v6 = dataclasses.replace(
            ip6.parse(HW6, "hw6", validate=False),
            ir=parse_policy(HW6, filename="hw6", config=Config(), allow_empty=True, family=6),
        )
        text = nft_text6(v6, Config(), hot)
        for _ in range(2):
            ns_sh(ns, "nft", "-f", "-", stdin=text)
        listing = ns_sh(ns, "nft", "list", "table", "ip6", NFT_TABLE)
        assert "jump HFRATE_ENTRY" in listing and "goto HFRATEF_MAIN" in listing
        assert "jump HFRATE_SHORT8" in listing and "icmpv6 type echo-request accept" in listing


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    d = tmp_path_factory.mktemp(LAB)
    (d / "hw6.rules").write_text(HW6)
    (d / "a.rules").write_text("".join(ln + "\n" for ln in POLICY_A.splitlines() if "--string" not in ln))
    (d / "v6set.rules").write_text(V6)
    (d / "sets6.save").write_text(SETS)
    with hf.xdp_lab():
        yield d


def bench(*args: str) -> dict:
    return json.loads(hf("bench", "rate", *args, *SHORT).stdout.splitlines()[-1])


@pytest.mark.optin("HF_BENCH_V6")
def test_bench_rate6_nft(lab):
    """HW6 with half of verify6's malformed kinds (extension-header chains, fragments, truncated transport headers,
    4-byte ICMPv6 messages among the normal ones): nft alone gives every frame ip6tables' verdict (its hotdrops of
    short headers included), and its rate pass runs."""
    r = bench("-6", str(lab / "hw6.rules"), "--frames", "800", "--malformed", "0.5")
    assert r["nft_error"] is None and r["mismatches"] == 0, (r["examples"], r["examples_vs_nft"])
    assert r["mismatches_vs_iptables"] == 0 and r["mismatches_vs_nft"] == 0 and r["ipv6"]["frames"] == 800
    d = r["delivered"]
    assert 0 < d["hybrid"] == d["iptables"] == d["nft"] < 800, d
    assert set(r["paths"]) == {"sink", "hybrid", "iptables", "nft"} and r["nft_pps"] > 0 and r["speedup_vs_nft"] > 0


@pytest.mark.optin("HF_BENCH_V6")
def test_bench_rate6_ipsets(lab):
    """An IPv6 policy reading inet6 sets (`--ipsets`: a hash:net with nomatch holes, a hash:ip,port, a hash:ip with
    timeouts): the sets in the lab's firewall and the oracle's namespace, their rules decided in XDP (set slots), each
    frame compared with ip6tables alone; nft has no ipset match (its path is absent and says why)."""
    r = bench("-6", str(lab / "v6set.rules"), "--ipsets", str(lab / "sets6.save"), "--frames", "800")
    assert r["mismatches"] == 0 and r["mismatches_vs_iptables"] == 0, r["examples"]
    d = r["delivered"]
    assert 0 < d["hybrid"] == d["iptables"] < 800 and r["hw_share"] > 0.9, (d, r["nic"])
    assert r["nft_pps"] is None and "-m set" in r["nft_error"]


@pytest.mark.optin("HF_BENCH_V6")
def test_bench_rate_dual_stack_nft(lab):
    """A dual stack (test_deploy's POLICY_A without its string rule, nft having no string match, beside HW6): the nft
    path holds both families' tables, and each frame meets its own family's."""
    r = bench(str(lab / "a.rules"), "--ipv6", str(lab / "hw6.rules"), "--frames", "800")
    assert r["nft_error"] is None and r["mismatches"] == 0 and r["ipv6"]["frames"] == 400, r["examples_vs_nft"]
    d = r["delivered"]
    assert 0 < d["hybrid"] == d["iptables"] == d["nft"] < 800 and r["mismatches_vs_nft"] == 0, d
