"""`hypafilter bench rate --attack` on the xdp lab: the attack mix's JSON keys are measured behaviour.

- `legit_connections_ok`: real connections through each path under the flood, counted. True where the policy accepts
  the connections' port (the bench picks one: TCP 8080 here), false where it drops the port named with `--legit`
  (on the policy alone in iptables too).
- `attack_hw_share`: 1.0 where the policy drops the flood's new flows by rules the fast path holds (a frame without a
  conntrack entry decided in XDP), 0.0 where a complex rule (a string match) could accept the same frames, so that
  the kernel must read each one.
- the blocklist (`--blocklist N`, as an ipset): the hash:net set with its N networks in the firewall's and the
  oracle's namespaces, every frame from it dropped on every path.

Speed is measured, not asserted (docs/results.md "Attack mix")."""

from __future__ import annotations

import json
import subprocess

import pytest
from hypafilter import netns

from conftest import need_root, need_tool
from tests.hfcli import HfCli

pytestmark = pytest.mark.system

LAB = "atkt"
STATE = f"/run/hypafilter/test-{LAB}"
HF = HfCli(LAB, STATE)
SHORT = ("--target", "xdp", "--attack", "udp", "--attackers", "50", "--frames", "400", "--repeats", "0",
         "--prog-repeat", "0", "--legit-connections", "4", "--json")  # fmt: skip
CT_FIRST = """*filter
:FORWARD DROP [0:0]
-A FORWARD -m conntrack --ctstate ESTABLISHED,RELATED -j ACCEPT
-A FORWARD -p tcp -m tcp --dport 8080 -j ACCEPT
-A FORWARD -p udp -m udp --dport 5353 -j ACCEPT
-A FORWARD -p tcp -m tcp --dport 22 -j DROP
COMMIT
"""
# The same with a complex rule that may accept any UDP frame (its payload decides): no UDP frame can be decided
# without the kernel.
COMPLEX = CT_FIRST.replace(
    "-A FORWARD -p tcp -m tcp --dport 8080", '-A FORWARD -p udp -m string --string "BAD" --algo bm -j ACCEPT\n'
    "-A FORWARD -p tcp -m tcp --dport 8080",
)  # fmt: skip


def hf(*args: str) -> dict:
    p = HF(*args)
    return json.loads(p.stdout.splitlines()[-1]) if "--json" in args else {}


@pytest.fixture(scope="module")
def lab():
    need_tool("ipset")
    with HF.xdp_lab() as name:
        yield name


def test_attack_mix_measured(lab, tmp_path):
    ct_first, cx = tmp_path / "ct_first.rules", tmp_path / "complex.rules"
    ct_first.write_text(CT_FIRST)
    cx.write_text(COMPLEX)

    # The blocklist as plain rules ahead of the policy: simple rules, in the fast path like the policy's own drops.
    r = hf("bench", "rate", str(ct_first), *SHORT, "--blocklist", "200", "--blocklist-as", "rules")
    assert r["mismatches"] == 0 and r["mismatches_vs_iptables"] == 0 and r["mismatches_vs_nft"] == 0, r["examples"]
    assert r["delivered"] == {"hybrid": 0, "iptables": 0, "nft": 0}  # every attack frame dropped on every path
    legit = r["legit"]
    assert (legit["proto"], legit["port"], legit["connections"]) == ("tcp", 8080, 4), legit
    assert legit["completed"] == {"hybrid": 4, "iptables": 4} and r["legit_connections_ok"] is True, legit
    assert legit["flood_pps"]["hybrid"] > 0 and legit["flood_pps"]["iptables"] > 0
    assert (r["attack"]["blocklist"], r["attack"]["blocklist_as"]) == (200, "rules")
    parts = r["attack"]["hw_share"]
    assert parts == {"spoofed": {"frames": 200, "hw_share": 1.0}, "blocklist": {"frames": 200, "hw_share": 1.0}}
    assert r["attack_hw_share"] == 1.0

    # A complex rule that may accept any UDP frame: the spoofed sources' frames all go to the kernel. The blocklist
    # as an ipset (its rule ahead of the complex one): measured, not asserted (a set match is complex on main).
    r = hf("bench", "rate", str(cx), *SHORT, "--blocklist", "200", "--legit", "udp:9090", "--legit-timeout", "1")
    assert r["mismatches"] == 0 and r["mismatches_vs_iptables"] == 0, r["examples"]
    parts = r["attack"]["hw_share"]
    assert parts["spoofed"] == {"frames": 200, "hw_share": 0.0}, parts
    assert parts["blocklist"]["frames"] == 200 and 0.0 <= parts["blocklist"]["hw_share"] <= 1.0
    assert r["attack_hw_share"] == pytest.approx(parts["blocklist"]["hw_share"] / 2, abs=0.01)
    assert r["attack"]["blocklist_as"] == "ipset"
    for role in ("fw", "plain"):
        members = netns.run(["ipset", "list", "hfrate-block"], f"{LAB}-{role}").split("Members:")[1].split()
        assert len(members) == 200, role
    # The deploy's kernel check needed the set on the host: made for it, gone again.
    assert subprocess.run(["ipset", "list", "-n", "hfrate-block"], capture_output=True).returncode != 0
    legit = r["legit"]
    assert (legit["proto"], legit["port"]) == ("udp", 9090)
    assert legit["completed"] == {"hybrid": 0, "iptables": 0} and r["legit_connections_ok"] is False, legit


def test_blocklist_set_refilled_in_place():
    """The blocklist set made again for another run: the same set refilled in place (a fast path that follows the
    kernel's sets sees element changes, not a set replaced), a set of that name made otherwise swapped for one made
    as the bench makes it, while a rule references it."""
    need_root()
    need_tool("ip", "ipset", "iptables")
    from hypafilter.tools.bench import attack

    ns = f"{LAB}-scr"
    netns.run(["ip", "netns", "del", ns], check=False)
    netns.run(["ip", "netns", "add", ns])

    def members() -> set[str]:
        return set(netns.run(["ipset", "list", attack.BLOCKLIST_SET], ns).split("Members:")[1].split())

    def header() -> str:
        return netns.run(["ipset", "save", attack.BLOCKLIST_SET], ns).splitlines()[0]

    try:
        nets = attack.blocklist_networks(300, 1)
        netns.run(["ipset", "create", attack.BLOCKLIST_SET, "hash:net", "maxelem", "1000"], ns)
        netns.run(
            ["iptables", "-A", "FORWARD", "-m", "set", "--match-set", attack.BLOCKLIST_SET, "src", "-j", "DROP"], ns
        )
        attack.create_ipset([ns], nets)
        assert "maxelem 65536" in header() and len(members()) == 300
        assert netns.run(["ipset", "list", "-n"], ns).split() == [attack.BLOCKLIST_SET]  # no scratch set left
        initval = header().split("initval")[1]  # the set's own hash seed: the same set while it stays
        attack.create_ipset([ns], nets[:100])
        assert len(members()) == 100 and header().split("initval")[1] == initval
    finally:
        netns.run(["ip", "netns", "del", ns], check=False)
