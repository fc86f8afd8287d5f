"""Interface checks resolved against the deployment's interfaces (bridge mode, FORWARD): -i/-o on the bridge,
physdev on the NIC's ports with wildcards and negations, rules no NIC frame matches, and what reports say."""

from __future__ import annotations

import pytest
from hypafilter.analysis.plan import build_plan
from hypafilter.cli import main
from hypafilter.config import Config
from hypafilter.errors import HypafilterError
from hypafilter.iptables.document import parse_policy
from hypafilter.iptables.parser import parse_rule
from hypafilter.iptables.rule import if_match, physdev_options
from hypafilter.ir.box import FIELDS
from hypafilter.netfilter.restore import to_iptables_restore

LAB = Config(bridge="br0", hw_ports={"nf0": 0, "nf1": 1})
IPORT = FIELDS.index("iport")
FOUR = Config(bridge="sw0", hw_ports={"p0": 0, "p1": 1, "p2": 2, "p3": 3})


def one(text: str, config: Config = LAB):
    (r,) = parse_rule(text, config=config)
    return r


def iports(r) -> set[int]:
    """The ingress ports whose frames the rule's boxes admit (everything else at its full range)."""
    return {p for p in range(4) if any(b.lo[IPORT] <= p <= b.hi[IPORT] for b in r.boxes)}


def test_if_match_is_the_kernels_comparison():
    assert if_match("br0", "br0") and not if_match("br0", "br01") and not if_match("br", "br0")
    assert if_match("br+", "br0") and if_match("br0+", "br0") and if_match("+", "x") and not if_match("eth+", "br0")


@pytest.mark.parametrize(
    "check",
    ["-i br0", "-o br0", "-i br+", "-o b+", "-i br0+", "! -i lo", "! -o eth+", "! -i nf0", "! -o nf1", "-i br0 -o br0"],
)
def test_in_out_true_for_every_nic_frame(check):
    """The bridge (or a wildcard matching it) is every bridged frame's input and output device in FORWARD: the
    check disappears and the rule is simple."""
    r = one(f"{check} -p udp -j ACCEPT")
    assert not r.complex and not r.never and r.boxes and iports(r) == {0, 1, 2, 3}
    assert r.resolved and all(out.startswith("true for every NIC frame") for _, out in r.resolved)


@pytest.mark.parametrize(
    "check",
    [
        "-i lo",
        "-o lo",
        "-i nf0",
        "-o nf1",
        "-i eth+",
        "-i br1",
        "-i br",
        "! -i br0",
        "! -o br+",
        "! -i +",
        "-i br0 -o x",
    ],
)
def test_in_out_false_for_every_nic_frame(check):
    """Names no NIC frame carries (loopback, other devices, the bridge's own ports, wildcards matching none) and the
    bridge negated: the rule matches no NIC frame, whatever its other checks."""
    r = one(f"{check} -p tcp -m conntrack --ctstate NEW -j REJECT")
    assert r.never and r.boxes == [] and r.complex == []
    assert any(out.startswith("false for every NIC frame") for _, out in r.resolved)


@pytest.mark.parametrize(
    ("check", "ports"),
    [
        ("--physdev-in nf0", {0}),
        ("--physdev-in nf1", {1}),
        ("! --physdev-in nf0", {1}),
        ("--physdev-out nf1", {0}),  # out = the paired port: frames in on MAC0 leave by MAC1's interface
        ("--physdev-out nf0", {1}),
        ("! --physdev-out nf1", {1}),
        ("--physdev-in nf0 --physdev-out nf1", {0}),
        ("--physdev-in nf+ ! --physdev-out nf0", {0}),
        ("--physdev-is-bridged --physdev-in nf1", {1}),
    ],
)
def test_physdev_maps_to_ports(check, ports):
    r = one(f"-m physdev {check} -p udp -j DROP")
    assert not r.complex and not r.never and iports(r) == ports
    assert r.resolved[0][1].startswith("hardware field iport")


@pytest.mark.parametrize(
    "check", ["--physdev-in nf+", "--physdev-out +", "--physdev-is-bridged", "--physdev-is-in --physdev-is-out"]
)
def test_physdev_true_for_every_nic_frame(check):
    r = one(f"-m physdev {check} -j ACCEPT")
    assert not r.complex and iports(r) == {0, 1, 2, 3} and r.resolved[0][1].startswith("true")


@pytest.mark.parametrize(
    "check",
    [
        "--physdev-in eth0",
        "--physdev-in x+",
        "--physdev-out lo",
        "--physdev-in nf0 --physdev-out nf0",
        "! --physdev-is-bridged",
        "! --physdev-is-in",
        "! --physdev-is-out",
        "! --physdev-in nf+",
    ],
)
def test_physdev_false_for_every_nic_frame(check):
    r = one(f"-m physdev {check} -j ACCEPT")
    assert r.never and r.boxes == [] and r.resolved[0][1].startswith("false")


def test_four_ports_two_pairs():
    assert iports(one("-m physdev --physdev-out p1 -j ACCEPT", FOUR)) == {0}
    assert iports(one("-m physdev --physdev-out p2 -j ACCEPT", FOUR)) == {3}
    r = one("-m physdev ! --physdev-in p0 -j ACCEPT", FOUR)
    assert iports(r) == {1, 2, 3} and len(r.boxes) == 1  # consecutive ports make one interval
    assert iports(one("-m physdev --physdev-in p+ -j ACCEPT", FOUR)) == {0, 1, 2, 3}
    assert iports(one("-i sw0 -m physdev --physdev-in p1 -j ACCEPT", FOUR)) == {1}


def test_physdev_not_understood_stays_complex():
    assert physdev_options(["--physdev-in"]) is None and physdev_options(["--physdev-in", "!"]) is None
    assert physdev_options(["--physdev-in", "a", "--physdev-in", "b"]) is None
    assert physdev_options(["!", "--physdev-is-in", "--physdev-out", "x+"]) == [
        ("--physdev-is-in", "", True),
        ("--physdev-out", "x+", False),
    ]
    r = one("-m physdev --physdev-in nf0 --physdev-in nf1 -j ACCEPT")
    assert r.complex and not r.resolved


def test_nothing_known_keeps_every_check():
    """The default configuration resolves nothing: every interface check stays a check for software."""
    for text in ("-i br0 -j ACCEPT", "-i lo -j ACCEPT", "-o nf1 -j ACCEPT", "-m physdev --physdev-out nf1 -j ACCEPT"):
        r = one(text, Config())
        assert r.complex and not r.resolved and not r.never, text


def test_other_base_chains_keep_in_out():
    """Only FORWARD holds bridged NIC frames with the bridge as input and output device."""
    pol = parse_policy("-A INPUT -i br0 -j ACCEPT\n", base_chain="INPUT", config=LAB)
    assert pol.rules[0].complex == (("-i", "br0"),) and pol.interfaces == ("", (("nf0", 0), ("nf1", 1)))


POLICY = """*filter
:FORWARD DROP [0:0]
:LOCAL - [0:0]
-A FORWARD -i lo -j LOCAL
-A FORWARD -i br0 -p udp --dport 53 -j ACCEPT
-A FORWARD -m physdev --physdev-in nf1 -p tcp -j DROP
-A FORWARD -o eth+ -p tcp -j REJECT
-A FORWARD -i br+ -p tcp --dport 22 -j ACCEPT
-A LOCAL -p tcp -j ACCEPT
COMMIT
"""


def test_rules_for_no_nic_frame_leave_the_hardware_but_stay_in_software():
    """`-i lo -j LOCAL` and `-o eth+ ...` match no NIC frame: they are not in the flattened list (no hardware
    entry, no interval chain), and the FULL chain (k = 0: frames without hardware metadata, from anywhere) still
    holds them verbatim."""
    pol = parse_policy(POLICY, "p.rules", config=LAB)
    assert [(r.origin.line, r.is_simple) for r in pol.rules] == [(5, True), (6, True), (8, True)]
    assert pol.interfaces == ("br0", (("nf0", 0), ("nf1", 1)))
    assert [(o.line, toks) for o, toks, _ in pol.resolved] == [
        (4, ("-i", "lo")),
        (5, ("-i", "br0")),
        (6, ("-m", "physdev", "--physdev-in", "nf1")),
        (7, ("-o", "eth+")),
        (8, ("-i", "br+")),
    ]
    for mode in ("index", "selective", "exact"):
        plan = build_plan(pol, LAB, mode)
        assert plan.n == 3 and not any(plan.shunt[:-1]), mode
        text = to_iptables_restore(plan, "interval", "HF1_")
        full = [ln for ln in text.splitlines() if ln.startswith("-A HF1_FULL ")]
        assert "-A HF1_FULL -i lo -j HF1_U0_LOCAL" in full and any("-o eth+" in ln for ln in full), full
        others = [ln for ln in text.splitlines() if ln.startswith("-A ") and not ln.startswith("-A HF1_FULL ")]
        assert not any("-i lo" in ln or "-o eth+" in ln for ln in others), others
    plain = parse_policy(POLICY, "p.rules", config=Config())
    assert len(plain.complex_indices) == 5 and plain.resolved == [] and plain.interfaces == ("", ())


def test_return_no_nic_frame_takes_guards_nothing():
    text = "-N C\n-A C -i lo -j RETURN\n-A C -p tcp -j DROP\n-A FORWARD -j C\n"
    (r,) = parse_policy(text, config=LAB).rules
    assert r.is_simple and not r.approximate and r.levels[-1].unless == ()
    (r,) = parse_policy(text, config=Config()).rules
    assert r.approximate  # without the deployment the RETURN is a complex guard


@pytest.mark.parametrize(
    ("cfg", "msg"),
    [
        ({"bridge": "br0"}, "bridge needs hw_ports"),
        ({"bridge": "br0", "hw_ports": {"nf0": 0}}, "not its pair MAC1"),
        ({"bridge": "br0", "hw_ports": {"br0": 0, "x": 1}}, "also listed"),
        ({"hw_ports": {"a": 0, "b": 0}}, "two interfaces"),
        ({"hw_ports": {"a/b": 0}}, "not an interface name"),
        ({"bridge": "a-very-long-bridge", "hw_ports": {"a": 0, "b": 1}}, "not an interface name"),
        ({"hw_ports": {"a": 4}}, "0..3"),
    ],
)
def test_config_checks(cfg, msg):
    with pytest.raises(HypafilterError, match=msg):
        Config(**cfg).validate()


def test_config_from_toml(tmp_path):
    p = tmp_path / "site.toml"
    p.write_text('bridge = "br0"\nhw_ports = { "nf0" = 0, "nf1" = 1 }\n')
    assert Config.load(p).interfaces == LAB.interfaces
    p.write_text('bridge = "br0"\n')
    with pytest.raises(HypafilterError, match="bridge needs hw_ports"):
        Config.load(p)


def test_lint_and_analyze_report_resolutions(tmp_path, capsys):
    pol, cfg = tmp_path / "p.rules", tmp_path / "site.toml"
    pol.write_text(POLICY)
    cfg.write_text('bridge = "br0"\nhw_ports = { "nf0" = 0, "nf1" = 1 }\n')
    assert main(["lint", "--no-kernel", "--config", str(cfg), str(pol)]) == 0
    out = capsys.readouterr().out
    assert "interface checks resolved for NIC frames (bridge br0, NIC ports nf0=MAC0, nf1=MAC1)" in out
    assert f"{pol}:4: -i lo: false for every NIC frame" in out and "leaves the hardware analysis" in out
    assert f"{pol}:5: -i br0: true for every NIC frame (its input device is the bridge br0)" in out
    assert f"{pol}:6: -m physdev --physdev-in nf1: hardware field iport: frames in on MAC1 (nf1)" in out
    assert "3 simple, 0 complex" in out
    assert main(["analyze", "--config", str(cfg), str(pol)]) == 0
    out = capsys.readouterr().out
    assert "interface_checks_resolved" in out and f"{pol}:7: -o eth+: false for every NIC frame" in out


def test_deploy_fills_the_lab_interfaces_and_refuses_others():
    """A lab deploy knows its bridge and ports; a configuration naming other interfaces is refused, not mixed."""
    from hypafilter.ops import deploy

    cfg = deploy.site_config(Config(strategy="cut"))
    assert (cfg.bridge, cfg.hw_ports, cfg.strategy) == ("br0", {"nf0": 0, "nf1": 1}, "cut")
    assert deploy.site_config(Config(hw_ports={"nf0": 0, "nf1": 1})).interfaces == LAB.interfaces
    for other in (Config(bridge="br9", hw_ports={"nf0": 0, "nf1": 1}), Config(hw_ports={"nf1": 0, "nf0": 1})):
        with pytest.raises(HypafilterError, match="not this deployment's"):
            deploy.site_config(other)
    # The state keeps the interfaces only when a check depended on them (else the plan does not).
    assert deploy._interfaces_state(parse_policy(POLICY, config=cfg))["bridge"] == "br0"
    assert deploy._interfaces_state(parse_policy("-A FORWARD -j DROP\n", config=cfg)) == {"bridge": "", "ports": {}}
