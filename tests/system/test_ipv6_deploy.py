"""IPv6 stage 1 (docs/ipv6.md, "Deploy and verify"), on the command line as an operator runs it: a dual-stack deploy
(`deploy POLICY --ipv6 V6POLICY`) and verify with the kernel as oracle — IPv6 frames of every kind (extension-header
chains, fragments, truncations, neighbour discovery, ICMPv6 errors, jumbo) and real IPv6 connections through the
hybrid and through the IPv6 policy alone in the oracle's ip6tables — on the emulated NIC and on xdp, 0 mismatches;
the IPv6 side rolled back with the IPv4 side (both families or neither); `--ipv6-default drop` against the kernel
with ip6tables' FORWARD policy DROP; status' IPv6 line; undeploy gives ip6tables back as the operator had it.

The IPv4 side is test_deploy's POLICY_A: its core is built once per run (the emulator build is cached by matcher).
The emulated NIC's tests here run stage 1 (`emu_ipv6 = false`: every IPv6 frame to ip6tables unparsed, an IPv4-only
core, no build of its own); the default, the NIC's dual-stack core deciding IPv6 (docs/ipv6.md "## emu"), is
test_fuzz.py::test_fuzz_ipv6_emu's and, in CI (elsewhere opt-in: HF_EMU_V6_FULL=1, `make test-emu-v6`), test_dual_stack_emu_hardware's
here."""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

import pytest
from hypafilter import netns

from conftest import TEST_FULL
from tests.hfcli import HfCli
from tests.system.test_deploy import POLICY_A

pytestmark = pytest.mark.system

EMU, XDP = "v6oe", "v6ox"
hf = {EMU: HfCli(EMU, f"/run/hypafilter/test-{EMU}"), XDP: HfCli(XDP, f"/run/hypafilter/test-{XDP}")}
PACKETS = 150
# The first rule: an IPv6 frame meets ip6tables with the mark it has in the kernel alone (0), whatever the shim did
# with the IPv4 mark bits; a mark left by the fast path would drop it on the hybrid path only (a mismatch).
V6 = """*filter
:INPUT ACCEPT [0:0]
:FORWARD DROP [0:0]
:OUTPUT ACCEPT [0:0]
-A FORWARD -m mark ! --mark 0x0 -j DROP
-A FORWARD -m conntrack --ctstate ESTABLISHED,RELATED -j ACCEPT
-A FORWARD -p ipv6-icmp --icmpv6-type neighbour-solicitation -j ACCEPT
-A FORWARD -p ipv6-icmp --icmpv6-type neighbour-advertisement -j ACCEPT
-A FORWARD -p ipv6-icmp --icmpv6-type echo-request -j ACCEPT
-A FORWARD -s fd48:4600::/64 -p tcp --dport 80 -j ACCEPT
-A FORWARD -s fd48:4601::/64 -p tcp --dport 80 -j ACCEPT
-A FORWARD -s 2001:db8:1::/48 -d 2001:db8:2::/48 -p udp --dport 53 -j ACCEPT
-A FORWARD -p udp -m multiport --dports 5000,5001 -j ACCEPT
-A FORWARD -m ipv6header --header frag --soft -j DROP
-A FORWARD -p tcp --dport 8080 -j REJECT --reject-with icmp6-port-unreachable
COMMIT
"""
OPERATOR6 = "-A FORWARD -p tcp -m tcp --dport 25 -j DROP"  # the operator's own ip6tables rule before any deploy
# An IPv6 policy an operator could write, mostly simple rules (the NIC's core decides most of its frames), stateless
# (a conntrack-reading IPv6 side forces every IPv6 frame the core would decide to conntrack: ct 0 for IPv6 there)
HW6 = """*filter
:INPUT ACCEPT [0:0]
:FORWARD ACCEPT [0:0]
:OUTPUT ACCEPT [0:0]
-A FORWARD -p ipv6-icmp --icmpv6-type echo-request -j ACCEPT
-A FORWARD -s fd48:4600::/64 -p tcp --dport 80 -j ACCEPT
-A FORWARD -s 2001:db8:1::/48 -d 2001:db8:2::/48 -p udp --dport 53 -j DROP
-A FORWARD -d 2001:db8:2::10 -p tcp -m multiport --dports 22,443 -j DROP
-A FORWARD -p udp --dport 5000:5100 -j DROP
-A FORWARD -m iprange --src-range 2001:db8:1::5-2001:db8:1::ff -j DROP
-A FORWARD -p tcp --dport 8080 -j REJECT --reject-with icmp6-port-unreachable
-A FORWARD -p tcp -j DROP
COMMIT
"""
# A table besides filter, as firewalld's IPv6 side has (its mangle PREROUTING drops what fails the reverse-path
# check): here it drops IPv6 frames V6's filter accepts (ICMPv6 echo requests, UDP to 5000)
MANGLE6 = """*mangle
:PREROUTING ACCEPT [0:0]
:INPUT ACCEPT [0:0]
:FORWARD ACCEPT [0:0]
:OUTPUT ACCEPT [0:0]
:POSTROUTING ACCEPT [0:0]
-A PREROUTING -p ipv6-icmp -m icmp6 --icmpv6-type 128 -j DROP
-A PREROUTING -p udp -m udp --dport 5000 -j DROP
COMMIT
"""
# opt-in on a developer machine (a dual-stack core build); CI runs it always
FULL = os.environ.get("HF_EMU_V6_FULL", "") not in ("", "0") or os.environ.get("CI") == "true"


def _save6(ns: str) -> str:
    text = netns.run(["ip6tables-save"], ns)
    return "\n".join(re.sub(r"\[\d+:\d+\]", "", ln) for ln in text.splitlines() if not ln.startswith("#"))


def _save4(ns: str) -> str:
    text = netns.run(["iptables-save", "-t", "filter"], ns)
    return "\n".join(re.sub(r"\[\d+:\d+\]", "", ln) for ln in text.splitlines() if not ln.startswith("#"))


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("v6o")
    (d / "a.rules").write_text(POLICY_A)
    (d / "v6.rules").write_text(V6)
    (d / "v6b.rules").write_text(V6.replace("--dport 80", "--dport 81"))
    (d / "stage1.toml").write_text("emu_ipv6 = false\n")
    (d / "hw6.rules").write_text(HW6)
    (d / "v6m.rules").write_text(MANGLE6 + V6)
    (d / "hw6b.rules").write_text(HW6.replace("--dport 8080", "--dport 8081"))  # a complex rule: same hardware
    (d / "hw6c.rules").write_text(HW6.replace("5000:5100", "5000:5200"))  # a simple rule: the IPv6 update buffer
    # more new simple rules than half the IPv6 update buffer's 16 slots: another core (the lazy rebuild)
    bans = "".join(f"-A FORWARD -s 2001:db8:9::{i}/128 -j DROP\n" for i in range(1, 10))
    (d / "hw6d.rules").write_text(HW6.replace(":OUTPUT ACCEPT [0:0]\n", ":OUTPUT ACCEPT [0:0]\n" + bans))
    return d


@pytest.fixture(scope="module")
def emu(files):
    """The emu lab with the operator's own ip6tables rule; undeployed at the end, which must give it back."""
    with hf[EMU].deployed_lab("emu", files / "a.rules"):
        netns.run(["ip6tables", "-A", *OPERATOR6.split()[1:]], f"{EMU}-fw")
        yield _save6(f"{EMU}-fw")


def _verify(lab: str, *args: str) -> dict:
    p = hf[lab]("verify", *args, "--packets", str(PACKETS), "--json", check=False)
    assert p.stdout, p.stderr[-3000:]
    r = json.loads(p.stdout)
    assert p.returncode == 0 and r["mismatches"] == 0, (r["examples"][:3], (r.get("ipv6") or {}).get("connections"))
    return r


def _every_v6_frame_unparsed(r: dict) -> None:
    """Every IPv6 frame went to the stack with k = 0: the fast path counted each as unparsed."""
    assert r["nic"]["CNT_SHUNT_UNPARSED"] >= r["ipv6"]["packets"], r["nic"]


def test_dual_stack_emu(emu, files):
    # deployed without an IPv6 side: status says IPv6 is left to ip6tables as the operator has it
    line = next(ln for ln in hf[EMU]("status").stdout.splitlines() if ln.startswith("ipv6"))
    assert "NOT filtered by hypafilter" in line and "--ipv6-default kernel" in line and "1 in FORWARD" in line, line
    stage1 = ("--config", str(files / "stage1.toml"))
    r = _verify(EMU, str(files / "a.rules"), "--ipv6", str(files / "v6.rules"), "--connections", "4", *stage1)
    six = r["ipv6"]
    print({k: six[k] for k in ("packets", "mismatches", "delivered_oracle")}, six["connections"]["by_kind"])
    assert six["packets"] == PACKETS and six["mismatches"] == 0 and six["mode"] == "policy"
    assert 0 < six["delivered_oracle"] < PACKETS  # the policy both accepts and drops IPv6 frames
    kinds = set(six["by_kind"])
    assert {"v6_chain", "v6_frag_first", "v6_frag_later", "v6_nd_ns", "v6_icmp_error_real", "v6_jumbo"} <= kinds
    c6 = six["connections"]
    assert c6["mismatches"] == 0 and 0 < c6["completed_oracle"] < c6["connections"], c6
    _every_v6_frame_unparsed(r)
    # the firewall's ip6tables holds the IPv6 policy as loaded (the operator's rule replaced with its table)
    assert OPERATOR6 not in _save6(f"{EMU}-fw")
    st = hf[EMU]("status").stdout
    line = next(ln for ln in st.splitlines() if ln.startswith("ipv6"))
    assert "IPv6 policy" in line and "11 rules, IPv6" in line and "FORWARD policy DROP" in line, line
    assert "rules    IPv4 (iptables)" in st and "(IPv4, iptables)" in st, st


def _state(lab: str) -> dict:
    return json.loads((Path(hf[lab].state) / "state.json").read_text())


def test_ipv6_side_fails_nothing_half_applied(emu, files):
    """An update whose IPv6 side fails to load (a real ip6tables-restore error) leaves both families, the NIC and
    the state as they were; so does one whose IPv4 load fails after the IPv6 side went in."""
    fw = f"{EMU}-fw"
    before = (_save4(fw), _save6(fw), _state(EMU))
    for step in ("netfilter6", "netfilter"):
        p = hf[EMU](
            "deploy", str(files / "a.rules"), "--ipv6", str(files / "v6b.rules"), "--config", str(files / "stage1.toml"),
            "-q", check=False, fail=step,
        )  # fmt: skip
        assert p.returncode != 0 and step in p.stderr, p.stderr[-2000:]
        assert _save4(fw) == before[0]
        assert _save6(fw) == before[1]
        st = _state(EMU)
        assert (st["generation"], st["nic"], st["ipv6"]) == (
            before[2]["generation"],
            before[2]["nic"],
            before[2]["ipv6"],
        )
        assert st["history"][-1]["result"] == "failed" and st["history"][-1]["step"] == step


def test_ipv6_default_drop_and_undeploy(emu, files):
    r = _verify(EMU, str(files / "a.rules"), "--ipv6-default", "drop", "--config", str(files / "stage1.toml"))
    six = r["ipv6"]
    assert six["mode"] == "drop" and six["packets"] == PACKETS and six["mismatches"] == 0
    assert six["delivered_oracle"] == 0, six["by_kind"]
    oracle = _save6(f"{EMU}-plain")  # the kernel the hybrid was compared with: FORWARD policy DROP, no rule
    assert ":FORWARD DROP" in oracle and "-A " not in oracle, oracle
    _every_v6_frame_unparsed(r)
    line = next(ln for ln in hf[EMU]("status").stdout.splitlines() if ln.startswith("ipv6"))
    assert "every IPv6 frame DROPPED" in line and "0 in FORWARD, FORWARD policy DROP" in line, line
    # undeploy gives ip6tables back as the operator had them before the first deploy of an IPv6 side
    hf[EMU]("undeploy", "-q")
    assert _save6(f"{EMU}-fw") == emu


@TEST_FULL  # make test-full
@pytest.mark.skipif(not FULL, reason="opt-in outside CI (a dual-stack core build): HF_EMU_V6_FULL=1, make test-emu-v6")
def test_dual_stack_emu_hardware(emu, files):
    """The default on the emulated NIC (`emu_ipv6` on, docs/ipv6.md "## emu"): `deploy POLICY --ipv6 V6POLICY` builds
    a dual-stack core, which decides most of the IPv6 frames of an operator's kind of policy itself; verify's frames
    of every kind and IPv6 connections: 0 mismatches. An update whose IPv6 change keeps the hardware entries (a
    complex rule) is register writes on the running core, so is one that changes them when it fits the core's IPv6
    update buffer (docs/ipv6.md "## emu"); one that fills more than half of it starts a new core."""
    a = str(files / "a.rules")
    hf[EMU]("deploy", a, "--ipv6", str(files / "hw6.rules"), "-q")
    st = _state(EMU)
    assert st["tables"]["v6"]["index_base"] == 4 + 1 + 16 and st["ipv6"]["chains"]["k_base"] > 0, st["tables"]["v6"]
    line = next(ln for ln in hf[EMU]("status").stdout.splitlines() if ln.startswith("ipv6"))
    assert "decided in the NIC's core by its" in line and "interval chains in ip6tables" in line, line
    r = _verify(EMU, a, "--ipv6", str(files / "hw6.rules"), "--connections", "4")
    six, hw = r["ipv6"], r["ipv6"]["hw"]
    print("hw6:", hw, {k: six[k] for k in ("packets", "delivered_oracle")}, six["connections"]["by_kind"])
    assert r["generation"] == st["generation"]  # verify found it deployed
    assert six["mismatches"] == 0 and six["connections"]["mismatches"] == 0
    assert hw["matched"] >= PACKETS / 2 and hw["decided"] >= hw["matched"] / 2, hw
    assert r["nic"]["CNT_SHUNT_UNPARSED"] < PACKETS / 2, r["nic"]
    # a complex IPv6 rule changed: the same core takes the new IPv6 rows by register writes
    hf[EMU]("update", a, "--ipv6", str(files / "hw6b.rules"), "-q")
    st2 = _state(EMU)
    assert st2["nic"] == st["nic"] and not st2["history"][-1]["replaced_nic"], st2["history"][-1]
    assert st2["generation"] == st["generation"] + 1
    r = _verify(EMU, a, "--ipv6", str(files / "hw6b.rules"))
    assert r["ipv6"]["mismatches"] == 0 and r["ipv6"]["hw"]["decided"] > 0, r["ipv6"]
    # a simple IPv6 rule changed: the running core's IPv6 update buffer (the entry masked off, its new form in
    # slots), register writes on the same NIC
    hf[EMU]("update", a, "--ipv6", str(files / "hw6c.rules"), "-q")
    st3 = _state(EMU)
    assert st3["nic"] == st["nic"] and not st3["history"][-1]["replaced_nic"], st3["history"][-1]
    img = st3["tables"]["v6"]["overlay"]
    assert any(w >> 31 for w in img["buf"][21::23]) and img["valid"] != [2 ** st3["tables"]["v6"]["entries"] - 1]
    r = _verify(EMU, a, "--ipv6", str(files / "hw6c.rules"))
    assert r["ipv6"]["mismatches"] == 0 and r["ipv6"]["hw"]["decided"] > 0, r["ipv6"]
    # nine new simple rules: more than half the slots, a new core (another IPv6 matcher, its buffer empty)
    hf[EMU]("update", a, "--ipv6", str(files / "hw6d.rules"), "-q")
    st3 = _state(EMU)
    assert st3["nic"]["binary"] != st["nic"]["binary"] and st3["history"][-1]["replaced_nic"]
    r = _verify(EMU, a, "--ipv6", str(files / "hw6d.rules"))
    assert r["ipv6"]["mismatches"] == 0 and r["ipv6"]["hw"]["decided"] > 0, r["ipv6"]
    # the operator REJECTs what the core accepted itself (TCP 80 from the sender's network): the policy sync service
    # holds the whole fast path at once and brings the core's IPv6 rows to ip6tables' new policy (register writes: a
    # complex rule keeps the core); verify --live, both families' live rulesets alone as oracle: 0 mismatches (the
    # core went on accepting them before, 101 of 300 IPv6 frames differed in a run by hand)
    applied = (hf[EMU].service().get("ipv6") or {}).get("applied", 0)
    ban = ["FORWARD", "-s", "fd48:4600::/64", "-p", "tcp", "--dport", "80", "-j", "REJECT"]
    netns.run(["ip6tables", "-w", "-I", ban[0], "1", *ban[1:]], f"{EMU}-fw")
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        six = hf[EMU].service().get("ipv6") or {}
        if six.get("applied", 0) > applied and not six.get("safe") and not hf[EMU].service().get("safe"):
            break
        time.sleep(0.1)
    assert six.get("last_how") == "update" and not six.get("error"), six
    assert not _state(EMU)["history"][-1]["replaced_nic"], _state(EMU)["history"][-1]
    r = hf[EMU].verify_live(packets=PACKETS)
    assert r["ipv6"]["mismatches"] == 0 and r["ipv6"]["hw"]["decided"] > 0, r["ipv6"]


@pytest.fixture(scope="module")
def xdp(files):
    with hf[XDP].xdp_lab() as lab:  # verify deploys
        yield lab


def test_dual_stack_xdp(xdp, files):
    """On xdp the IPv6 side is decided in the XDP program by default (`xdp_ipv6`, docs/ipv6.md "## xdp"): most of
    verify's IPv6 frames are classified there, not passed unparsed, and still none differs from the kernel alone
    (`xdp_ipv6 = false`, stage 1's every IPv6 frame unparsed: tests/unit/test_xdp_tables6.py's plan6_for)."""
    r = _verify(XDP, str(files / "a.rules"), "--ipv6", str(files / "v6.rules"), "--target", "xdp")
    six = r["ipv6"]
    assert six["packets"] == PACKETS and six["mismatches"] == 0 and 0 < six["delivered_oracle"] < PACKETS
    assert r["nic"]["CNT_SHUNT_UNPARSED"] < six["packets"] // 2, r["nic"]
    assert _state(XDP)["xdp_ipv6"] is True and _state(XDP)["tables"]["v6"]["entries"] > 0


def test_update_drops_tables_the_ipv6_side_no_longer_has(xdp, files):
    """An update from an IPv6 policy with a table besides filter (mangle here; firewalld's IPv6 side has mangle,
    raw, security and nat) to one without it gives that table back as it was before the deployment (here: none),
    as undeploy would: the tables the deployment put there are not left in the firewall's ip6tables, where they
    went on dropping frames the new policy alone accepts (found with rulesets/real/firewalld-dual-stack then
    ufw-dual-stack: 193 of 1000 IPv6 frames differed)."""
    a, fw = str(files / "a.rules"), f"{XDP}-fw"
    hf[XDP]("deploy", a, "--ipv6", str(files / "v6m.rules"), "--target", "xdp", "-q")
    assert "-A PREROUTING -p udp -m udp --dport 5000 -j DROP" in _save6(fw)
    r = _verify(XDP, a, "--ipv6", str(files / "v6.rules"), "--target", "xdp")
    assert r["ipv6"]["mismatches"] == 0 and 0 < r["ipv6"]["delivered_oracle"], r["ipv6"]
    assert "*mangle" not in _save6(fw)
