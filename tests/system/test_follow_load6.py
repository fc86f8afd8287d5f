"""What a follow of ip6tables loads (docs/optimize.md "What a follow loads"): on a dual-stack deployment whose IPv6
side the xdp program decides (strategy tree: the IPv6 interval chain written as trees, HFv6_K0T), the real
`ip6tables -I` of a ban is followed by loading only the tool's IPv6 chains whose content ip6tables does not hold yet
(the trees the deploy built kept, the ban diverted ahead of them);
a rule added by hand to a kept chain is not kept by the next follow, which loads every chain anew; and `verify
--live` (both families' live rulesets alone in the oracle's namespace) finds 0 mismatches."""

from __future__ import annotations

import re
import time

import pytest
from hypafilter import netns

from conftest import ROOT
from tests.hfcli import HfCli
from tests.system.test_tree_mirror_v6 import _v6_text

pytestmark = pytest.mark.system

LAB = "q5f"
FW = f"{LAB}-fw"
hf = HfCli(LAB, f"/run/hypafilter/test-{LAB}")
BAN = ["-s", "fd48:4600:0:5::/64", "-p", "tcp", "-m", "hl", "--hl-eq", "3", "-j", "DROP"]


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    d = tmp_path_factory.mktemp(LAB)
    (d / "v6.rules").write_text(_v6_text())
    (d / "cfg.toml").write_text('xdp_ipv6 = true\nstrategy = "tree"\ntree_min_segment = 4\n')
    with hf.xdp_lab():
        hf("deploy", str(ROOT / "rulesets" / "example.rules"), "--ipv6", str(d / "v6.rules"), "--target", "xdp",
           "--config", str(d / "cfg.toml"), "-q")  # fmt: skip
        yield d


def tool6() -> dict[str, list[str]]:
    """The tool's chains in ip6tables' filter table, as the kernel lists them."""
    out: dict[str, list[str]] = {}
    for ln in netns.run(["ip6tables-save", "-t", "filter"], FW).splitlines():
        if ln.startswith(":HFv6_"):
            out.setdefault(ln[1:].split()[0], [])
        elif ln.startswith("-A HFv6_"):
            name, _, rest = ln[3:].partition(" ")
            out.setdefault(name, []).append(rest)
    return out


def follow6(applied: int, timeout: float = 15.0) -> dict:
    """The deployment's history entry of the IPv6 follow once the service has applied `applied` ip6tables changes."""
    from hypafilter.ops import deploy

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        six = hf.service().get("ipv6") or {}
        if six.get("applied", 0) >= applied and not six.get("safe"):
            return [h for h in deploy.read_state(f"{hf.state}/state.json")["history"] if h["kind"] == "follow6"][-1]
        time.sleep(0.05)
    raise AssertionError(f"the service did not follow ip6tables within {timeout} s: {hf.service().get('ipv6')}")


def test_a_follow_of_ip6tables_loads_the_changed_chains_and_repairs_a_hand_edit(lab):
    hf.followed(timeout=20)
    base6 = (hf.service().get("ipv6") or {}).get("applied", 0)
    before = tool6()
    whole = sum(map(len, before.values()))
    assert "HFv6_K0T" in before and any(re.fullmatch(r"HFv6_T\d+", c) for c in before), sorted(before)

    netns.run(["ip6tables", "-w", "-I", "FORWARD", "1", *BAN], FW)
    h = follow6(base6 + 1)
    after = tool6()
    new = {c: rules for c, rules in after.items() if c not in before}
    loaded = sum(map(len, new.values()))
    print(f"IPv6 ban: {loaded} of {sum(map(len, after.values()))} tool rules loaded (deploy: {whole}), {h}")
    assert h["rules_loaded"] == loaded + len(after["HFv6_MAIN"]) and 0 < h["rules_loaded"] < whole / 2, (h, loaded)
    kept = [c for c in after if c in before and c != "HFv6_MAIN"]
    assert kept and h["chains_kept"] == len(kept) and all(re.fullmatch(r"HFv6_\d+_\S+", c) for c in new), kept
    assert after[kept[0]] == before[kept[0]]
    # the trees are the deploy's (in the service's new process: from the deployment's IPv6 tree cache), the ban's
    # source diverted ahead of them to the live rules that can act there
    assert h["k0_tree"] == "lazy" and h["lazy_trees"] >= 1 and h["trees_built"] == 0, h
    div = [r for c, rules in new.items() for r in rules if re.search(r"-j HFv6_\d+_TD\d+$", r)]
    assert div and all("--src-range fd48:4600:0:5::-fd48:4600:0:5:ffff:ffff:ffff:ffff" in r for r in div), div

    # a rule added by hand to a kept chain is no operator's change (nothing is followed), but the next follow, of a
    # change of the operator's (the ban deleted), does not keep that chain: every chain loaded anew, the rule gone
    victim = max(kept, key=lambda c: len(after[c]))
    netns.run(["ip6tables", "-w", "-I", victim, "1", "-p", "udp", "--dport", "9", "-j", "ACCEPT"], FW)
    netns.run(["ip6tables", "-w", "-D", "FORWARD", *BAN], FW)
    h2 = follow6(base6 + 2)
    repaired = tool6()
    print(f"after the hand edit: {h2}")
    assert victim not in repaired and h2["chains_kept"] == 0
    assert h2["rules_loaded"] == sum(map(len, repaired.values())), h2
    assert not any("--dport 9 " in r for rules in repaired.values() for r in rules)

    assert hf("status", check=False).returncode == 0  # no drift: the tool's chains are the recorded ones again
    r = hf.verify_live(packets=120)
    print(f"verify --live: IPv6 {r['ipv6']}")
    assert r["ipv6"]["mismatches"] == 0 and r["ipv6"]["packets"] == 120, r["ipv6"]
