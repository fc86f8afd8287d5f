"""The IPv6 plan's interval chains in ip6tables on the xdp target (docs/ipv6.md "### Interval chains in ip6tables"),
the kernel as oracle through the project's own verify: a dual-stack deployment (`--ipv6`, `xdp_ipv6 = true`) whose
IPv6 frames the program shunts carry their interval's k (after the IPv4 plan's largest k), so ip6tables runs that
interval's rules, the mark given back first; k = 0 still runs the whole policy. 0 mismatches, and ip6tables' own
counters show the shunted IPv6 frames taking the leaves of k > k_base; undeploy gives the operator's ip6tables back.
Opt-in (`make test-xdp-v6`): all or nothing, a failure after ip6tables took new chains (a real iptables-restore
error) leaves ip6tables as the deployment before had it (lab `q2c`)."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from tests.hfcli import HfCli
from tests.system.test_deploy import POLICY_A

pytestmark = pytest.mark.system

LAB = "q2c"
FW = f"{LAB}-fw"
hf = HfCli(LAB, f"/run/hypafilter/test-{LAB}")
# an IPv4 policy with more intervals than POLICY_A: the IPv6 side's k move (k_base), so ip6tables is reloaded
POLICY_B = POLICY_A.replace(
    "COMMIT",
    "-A FORWARD -p udp --dport 4000 -m string --string X --algo bm -j DROP\n-A FORWARD -p udp -j ACCEPT\nCOMMIT",
)
PACKETS = 100
# Complex rules (hop limit, extension headers, REJECT) above simple ones: the simple rules' entries shunt with k > 0.
V6 = """*filter
:INPUT ACCEPT [0:0]
:FORWARD DROP [0:0]
:OUTPUT ACCEPT [0:0]
-A FORWARD -m conntrack --ctstate ESTABLISHED,RELATED -j ACCEPT
-A FORWARD -p ipv6-icmp --icmpv6-type neighbour-solicitation -j ACCEPT
-A FORWARD -p ipv6-icmp --icmpv6-type neighbour-advertisement -j ACCEPT
-A FORWARD -p ipv6-icmp --icmpv6-type echo-request -m hl --hl-lt 10 -j DROP
-A FORWARD -p ipv6-icmp --icmpv6-type echo-request -j ACCEPT
-A FORWARD -s fd48:4600::/64 -p tcp --dport 80 -j ACCEPT
-A FORWARD -s fd48:4601::/64 -p tcp --dport 80 -j ACCEPT
-A FORWARD -s fd48:4600::/64 -p udp --dport 53 -m hl --hl-eq 255 -j DROP
-A FORWARD -p udp --dport 53 -j ACCEPT
-A FORWARD -m ipv6header --header frag --soft -j DROP
-A FORWARD -p tcp --dport 8080 -j REJECT --reject-with icmp6-port-unreachable
-A FORWARD -p udp --dport 5000:5100 -j ACCEPT
-A FORWARD -d fd48:4600::2:1 -p tcp --dport 443 -j ACCEPT
-A FORWARD -d fd48:4601::2:1 -p tcp --dport 443 -j ACCEPT
COMMIT
"""


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    d = tmp_path_factory.mktemp(LAB)
    (d / "a.rules").write_text(POLICY_A)
    (d / "b.rules").write_text(POLICY_B)
    (d / "v6.rules").write_text(V6)
    (d / "cfg.toml").write_text("xdp_ipv6 = true\n")
    with hf.xdp_lab():  # verify deploys
        yield d


def _ip6(*args: str) -> str:
    from hypafilter import netns

    return netns.run(["ip6tables-save", *args], FW)


def _rules(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if not ln.startswith("#")]


def _args(lab, v4: str) -> list[str]:
    return [str(lab / v4), "--ipv6", str(lab / "v6.rules"), "--target", "xdp", "--config", str(lab / "cfg.toml")]


def test_shunted_ipv6_frames_run_their_interval_chain(lab):
    from hypafilter import netns

    netns.run(["ip6tables", "-w", "-A", "FORWARD", "-s", "2001:db8:99::/48", "-j", "DROP"], FW)  # the operator's
    before = _rules(_ip6("-t", "filter"))
    p = hf("verify", *_args(lab, "a.rules"), "--packets", str(PACKETS), "--json", check=False)
    assert p.stdout, p.stderr[-3000:]
    r = json.loads(p.stdout)
    six = r["ipv6"]
    assert p.returncode == 0 and r["mismatches"] == 0 and six["mismatches"] == 0, (r["examples"][:3], six)
    assert six["packets"] == PACKETS and 0 < six["delivered_oracle"] < PACKETS

    st = json.loads((Path(hf.state) / "state.json").read_text())
    chains = st["ipv6"]["chains"]
    kb = chains["k_base"]
    assert kb == max(st["intervals"]) > 0 and chains["main"] == "HFv6_MAIN"  # after the IPv4 plan's largest k
    saved = _ip6("-c", "-t", "filter")
    first = re.search(r"^\[\d+:\d+\] (-A FORWARD .*)$", saved, re.M)
    assert first and first.group(1) == "-A FORWARD -j HFv6_MAIN", saved  # the jump first, the policy after it
    # the complex rules in the chains as the file wrote them (128-bit addresses)
    assert re.search(r"-A HFv6_C\d+ -s fd48:4600::/64 -p udp .*--hl-eq 255 -j DROP", saved), saved
    # ip6tables' counters: the shunted IPv6 frames reached the leaves of their k, every one above k_base
    leaves = re.findall(r"^\[(\d+):\d+\] -A HFv6_\w+ -m mark --mark (0x[0-9a-f]+) -j HFv6_L(\d+)A(\d+)$", saved, re.M)
    assert leaves and all(int(k) > kb and int(v, 16) >> 4 == int(k) for _, v, k, _ in leaves), leaves
    shunted = sum(int(n) for n, _, _, _ in leaves)
    k0 = re.search(r"^\[(\d+):\d+\] -A HFv6_MAIN -m mark --mark 0x0/0xfffffff0 -g HFv6_K0$", saved, re.M)
    assert shunted >= PACKETS // 4 and k0 and int(k0.group(1)) > 0, (shunted, k0)  # both paths taken

    hf("undeploy")
    assert _rules(_ip6("-t", "filter")) == before  # the operator's ip6tables back, the tool's chains gone


if os.environ.get("HF_XDP_V6_FULL") == "1":  # `make test-xdp-v6`

    def test_rollback_keeps_the_deployed_chains(lab):
        """A deploy that fails after ip6tables took the new IPv6 chains (the IPv4 side's new k_base; a real
        iptables-restore error after it) leaves ip6tables exactly as the deployment before had it, chains included;
        undeploy then gives the operator's ip6tables back."""
        from hypafilter import netns

        netns.run(["ip6tables", "-w", "-A", "FORWARD", "-s", "2001:db8:98::/48", "-j", "DROP"], FW)
        operator = _rules(_ip6("-t", "filter"))
        hf("deploy", *_args(lab, "a.rules"))
        deployed = _rules(_ip6("-t", "filter"))
        st = json.loads((Path(hf.state) / "state.json").read_text())
        assert "-A FORWARD -j HFv6_MAIN" in deployed and st["ipv6"]["chains"]["k_base"] == max(st["intervals"])
        p = hf("deploy", *_args(lab, "b.rules"), fail="netfilter", check=False)
        assert p.returncode != 0 and "netfilter6" in p.stderr, p.stderr[-2000:]  # ip6tables was reloaded, then undone
        assert _rules(_ip6("-t", "filter")) == deployed
        assert json.loads((Path(hf.state) / "state.json").read_text())["ipv6"]["chains"] == st["ipv6"]["chains"]
        hf("undeploy")
        assert _rules(_ip6("-t", "filter")) == operator
