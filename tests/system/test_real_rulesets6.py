"""System tests: the dual-stack rule sets of real firewall tools (rulesets/real/, made by scripts/real-rulesets.sh:
ufw, firewalld and Docker, each configuration's IPv4 side `X-v4.rules4` (ufw's `routed`: `X.rules`) and its IPv6
side `X-v6.rules6`) go through `lint` and `compile` with `--ipv6`, the compiled ip6tables strategies load beside the
IPv6 dump, and both sides are deployed together and verified against the kernel running the two dumps alone, IPv4
and IPv6 frames: 0 mismatches. On xdp, `make test` verifies three cases (FORWARD_IN_MAKE_TEST, HOST_IN_MAKE_TEST);
the other pairs, the dumps as they are and the emulated NIC (a dual-stack core build per policy, ~30 s each) are
`make test-full`'s (docs/real-rulesets.md, docs/ipv6.md)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from hypafilter.cli import main

from conftest import ROOT, TEST_FULL, deployed_lab, ns_sh
from tests.hfcli import HfCli
from tests.scratchns import scratch_netns
from tests.system.test_real_rulesets import chains_with_rules

pytestmark = pytest.mark.system

LAB, LAB_EMU = "q2r", "q2re"
hf = {"xdp": HfCli(LAB, f"/run/hypafilter/test-{LAB}"), "emu": HfCli(LAB_EMU, f"/run/hypafilter/test-{LAB_EMU}")}
REAL = ROOT / "rulesets" / "real"
PACKETS = 300  # IPv4 frames, and as many IPv6 frames
LAB_BRIDGE = "br0"  # the lab's bridge: netfilter's input and output device of every bridged frame


def v4_side(v6: Path) -> Path:
    """The IPv4 side of an IPv6 dump X-v6.rules6: X-v4.rules4 (a dual-stack configuration), else X.rules."""
    stem = v6.name.removesuffix("-v6.rules6")
    four = REAL / f"{stem}-v4.rules4"
    return four if four.exists() else REAL / f"{stem}.rules"


PAIRS = {p.name.removesuffix("-v6.rules6"): (v4_side(p), p) for p in sorted(REAL.glob("*-v6.rules6"))}


def filled(path: Path) -> set[str]:
    """The built-in chains of the filter table that have rules of their own."""
    return set(chains_with_rules(path))


CHAINS = [(name, c) for name, (v4, v6) in PAIRS.items() for c in ("FORWARD", "INPUT") if c in filled(v4) & filled(v6)]
# The path through the tool's host each pair is verified on in bridge mode: its rules name the host's interfaces,
# which no frame in the lab has, so `-i IN` and `-o OUT` are rewritten to the lab's bridge (as test_real_rulesets.py's
# interface variants): ufw's `route allow in on eth0 out on eth1`, firewalld's policy int2pub (internal eth1 to
# public eth0), Docker's published ports on docker0. (None, None): the dumps as they are (make test-full).
BRIDGED = {
    "ufw-dual-stack": ("eth0", "eth1"),
    "ufw-routed": ("eth0", "eth1"),
    "firewalld-dual-stack": ("eth1", "eth0"),
    "docker-dual-stack": (None, "docker0"),
}
# What `make test` verifies (~13 s each; the rest in make test-full): FORWARD of Docker's and ufw's dual stacks,
# INPUT (host mode) of firewalld's, where its IPv6 rich rules with a source are (firewalld's FORWARD reaches its
# policy int2pub's IPv6 rich rule; ufw-routed's IPv6 side is ufw's as in ufw-dual-stack)
FORWARD_IN_MAKE_TEST = ("docker-dual-stack", "ufw-dual-stack")
HOST_IN_MAKE_TEST = ("firewalld-dual-stack",)


def test_corpus():
    """The dual-stack configurations of the three tools are here, each side headed by the same tool and configuration,
    and the brief's IPv6 content is in them: a rich rule with an IPv6 source (firewalld), IPv6 published ports
    (Docker)."""
    assert {n.split("-")[0] for n in PAIRS} == {"ufw", "firewalld", "docker"}
    assert set(BRIDGED) == set(PAIRS)
    for name, (v4, v6) in PAIRS.items():
        h4, h6 = v4.read_text().splitlines()[0], v6.read_text().splitlines()[0]
        assert h4.startswith(f"# {name.split('-')[0]} ") and "configuration '" in h4, v4
        assert h6.split(": ")[0] == h4.split(": ")[0] and "ip6tables-save" in h6, v6
    assert (
        "-A IN_public_allow -s 2001:db8:1::/48 -p tcp -m tcp --dport 22 -j ACCEPT"
        in PAIRS["firewalld-dual-stack"][1].read_text().splitlines()
    )
    assert re.search(r"^-A DOCKER -d 2001:db8:d0c:1::2/128 .* --dport 80 -j ACCEPT$", PAIRS["docker-dual-stack"][1]
                     .read_text(), re.M)  # fmt: skip


@pytest.mark.parametrize(("name", "chain"), CHAINS, ids=[f"{n}-{c}" for n, c in CHAINS])
def test_lint(name, chain, capsys):
    """`hypafilter lint --chain CHAIN V4 --ipv6 V6` accepts both sides, and as root every rule of each loads."""
    v4, v6 = PAIRS[name]
    status = main(["lint", "--chain", chain, str(v4), "--ipv6", str(v6)])
    out, err = capsys.readouterr()
    print(out, err)
    assert status == 0, err
    assert out.count("kernel check: every rule loads") == 2, out


@pytest.mark.parametrize("name", list(PAIRS))
def test_compile_and_load(name, tmp_path):
    """`hypafilter compile V4 --ipv6 V6` writes both sides; the IPv6 dump loads as it is (every table) and lists
    back its own filter rules, and each compiled ip6tables strategy loads beside it, rule for rule."""
    v4, v6 = PAIRS[name]
    assert main(["compile", str(v4), "--ipv6", str(v6), "-o", str(tmp_path)]) == 0
    strategies = sorted((tmp_path / "ipv6" / "netfilter").glob("*.ip6tables"))
    assert len(strategies) >= 5 and (tmp_path / "netfilter" / "interval.iptables").exists()
    with scratch_netns("q2rc", "ip6tables-restore", "ip6tables-save") as ns:
        dump = v6.read_text()
        ns_sh(ns, "ip6tables-restore", stdin=dump)
        want = [ln for ln in dump.split("*filter\n", 1)[1].split("COMMIT\n", 1)[0].splitlines() if ln[:3] == "-A "]
        assert sorted(
            ln for ln in ns_sh(ns, "ip6tables-save", "-t", "filter").splitlines() if ln[:3] == "-A "
        ) == sorted(want)
        for f in strategies:  # each replaces the chains it declares (--noflush), the dump's stay
            text = f.read_text()
            declared = set(re.findall(r"^:(\S+) - ", text, re.M))
            prefix = re.search(r"^:(\S+?)MAIN ", text, re.M).group(1)  # every chain the tool writes (HF1_)
            ns_sh(ns, "ip6tables-restore", "--noflush", stdin=text)
            listed = [ln for ln in ns_sh(ns, "ip6tables-save", "-t", "filter").splitlines() if ln[:3] == "-A "]
            generated = [ln for ln in text.splitlines() if ln.startswith("-A ")]
            assert len([ln for ln in listed if ln.split()[1] in declared]) == len(generated), f.name
            assert sorted(ln for ln in listed if not ln.split()[1].startswith(prefix)) == sorted(want), f.name


def as_lab_bridge(text: str, bridged: tuple[str | None, str | None]) -> str:
    """The dump with `-i IN` and `-o OUT` testing the lab's bridge instead (every other check as it is)."""
    for opts, name in zip(("-i|--in-interface", "-o|--out-interface"), bridged, strict=True):
        if name:
            text = re.sub(rf"(?<= )({opts}) {re.escape(name)}(?= )", rf"\1 {LAB_BRIDGE}", text)
    return text


def check(target: str, name: str, bridged, tmp: Path, chain: str = "FORWARD") -> dict:
    """verify of the pair (its interfaces `bridged` to the lab's bridge) on `target`: PACKETS IPv4 and as many IPv6
    frames through the hybrid and through the kernel with the two dumps alone, 0 mismatches in each family."""
    files = []
    for side in PAIRS[name]:
        f = tmp / side.name
        f.write_text(as_lab_bridge(side.read_text(), bridged))
        files.append(str(f))
    cli = hf[target]
    if chain == "INPUT":
        cli("undeploy", "-q")  # deploy does not move a running deployment between bridge and host mode
    args = ["verify", files[0], "--ipv6", files[1], "--chain", chain, "--target", target, "--packets", str(PACKETS)]
    p = cli(*args, "--json", check=False)
    assert p.stdout, p.stderr[-3000:]
    r = json.loads(p.stdout)
    six = r["ipv6"]
    print(
        f"{name} {chain} {bridged} on {target}: IPv4 {r['packets'] - six['packets']} frames, "
        f"{r['delivered_oracle'] - six['delivered_oracle']} delivered by the kernel, {r['shunted']} shunted (both "
        f"families), hardware forwarded {r['hw_forwarded']} dropped {r['hw_dropped']}; IPv6 {six['packets']} frames, "
        f"{six['delivered_oracle']} delivered by the kernel; {r['mismatches']} mismatches"
    )
    assert r["mismatches"] == 0 and six["mismatches"] == 0, r["examples"][:3]
    assert p.returncode == 0 and six["packets"] == PACKETS, p.stderr[-2000:]
    return r


def _cases():
    for name in PAIRS:
        marks = [] if name in FORWARD_IN_MAKE_TEST else [TEST_FULL]
        label = f"{BRIDGED[name][0] or '-'}>{BRIDGED[name][1] or '-'}"
        yield pytest.param(name, BRIDGED[name], id=f"{name}-{label}", marks=marks)
        yield pytest.param(name, (None, None), id=f"{name}-as-dumped", marks=TEST_FULL)


@pytest.fixture(scope="module")
def xdp_lab():
    with hf["xdp"].xdp_lab():  # verify deploys
        yield


@pytest.mark.parametrize(("name", "bridged"), list(_cases()))
def test_verify_xdp(xdp_lab, name, bridged, tmp_path):
    """Both sides deployed on xdp (one deployment updated from pair to pair, as an operator changing tools would)
    and verified: 0 mismatches. Through the tool's interfaces (BRIDGED) the frames meet the rules behind them, so
    the kernel both delivers and refuses frames of each family."""
    r = check("xdp", name, bridged, tmp_path)
    six = r["ipv6"]
    if bridged != (None, None):
        assert 0 < six["delivered_oracle"] < six["packets"], six["by_kind"]


def _host_cases():
    for name, chain in CHAINS:
        if chain == "INPUT":
            marks = [] if name in HOST_IN_MAKE_TEST else [TEST_FULL]
            yield pytest.param(name, id=f"{name}-INPUT", marks=marks)


@pytest.mark.parametrize("name", list(_host_cases()))
def test_verify_input_xdp(xdp_lab, name, tmp_path):
    """INPUT of both sides in host mode on xdp (the firewall terminates the frames), the dumps as they are (their
    INPUT reaches the default zone and ufw's rules without an interface): 0 mismatches; the kernel both accepts and
    refuses IPv6 frames."""
    r = check("xdp", name, (None, None), tmp_path, "INPUT")
    assert 0 < r["ipv6"]["delivered_oracle"] < r["ipv6"]["packets"], r["ipv6"]["by_kind"]


@pytest.fixture(scope="module")
def emu_lab():
    with deployed_lab(LAB_EMU, "emu"):
        yield


@TEST_FULL
@pytest.mark.parametrize(("name", "bridged"), [(n, BRIDGED[n]) for n in PAIRS], ids=list(PAIRS))
def test_verify_emu(emu_lab, name, bridged, tmp_path):
    """The same on the emulated NIC (its dual-stack core built per pair, ~30 s each: make test-full)."""
    check("emu", name, bridged, tmp_path)
