"""The deployment never fails open: the firewall host's base chain takes the policy's own chain policy, `status`
reports drift between what runs and what was deployed (exit 1), and deploying the same policy repairs it."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypafilter.ops.connections import udp_delivered

pytestmark = pytest.mark.system

LAB = "hfc"

POLICY = """*filter
:FORWARD DROP [0:0]
-A FORWARD -p udp -m udp --dport 5000 -m string --string BAD --algo bm -j DROP
-A FORWARD -p udp -m udp --dport 5000 -j ACCEPT
-A FORWARD -p tcp -j DROP
COMMIT
"""


def test_jump_removed_fails_closed_and_is_repaired(lab, capsys):
    from hypafilter import netns
    from hypafilter.cli import main
    from hypafilter.config import Config
    from hypafilter.iptables.document import parse_policy
    from hypafilter.ops import deploy

    before = deploy.base_policy(lab.ns_fw, Config(), "FORWARD")
    assert before == "ACCEPT"  # the lab's bridge starts as the kernel leaves it
    pol = parse_policy(POLICY, "closed.rules")
    st = deploy.deploy(pol, Config())
    assert deploy.base_policy(lab.ns_fw, Config(), "FORWARD") == "DROP"
    assert deploy.status()["drift"] == []
    dst = lab.ip("recv", "hyb")
    sends = [(5000, b"fine"), (5000, b"BAD one")]
    assert udp_delivered(lab.ns_send, lab.ns_recv, dst, sends) == [(5000, b"fine")]

    # Someone removes the tool's jump: the shunted datagrams meet the base chain's policy, DROP, not ACCEPT.
    netns.run(["iptables", "-D", "FORWARD", "-j", st["main_chain"]], lab.ns_fw)
    assert udp_delivered(lab.ns_send, lab.ns_recv, dst, [(5000, b"BAD two")]) == []
    drift = deploy.status()["drift"]
    assert any("jump FORWARD" in d for d in drift), drift
    assert main(["status"]) == 1 and "DRIFT" in capsys.readouterr().out

    # Deploying the same policy repairs it (before: "nothing to do").
    deploy.deploy(pol, Config())
    assert deploy.status()["drift"] == []
    assert udp_delivered(lab.ns_send, lab.ns_recv, dst, sends) == [(5000, b"fine")]
    assert main(["status"]) == 0

    # A rule changed by hand in the tool's chains is drift too.
    chain = deploy.read_state()["main_chain"]
    netns.run(["iptables", "-I", chain, "1", "-j", "ACCEPT"], lab.ns_fw)
    assert any("changed since the deploy" in d for d in deploy.status()["drift"])
    deploy.deploy(pol, Config())
    assert deploy.status()["drift"] == []

    # What the NIC and the shim hold is compared too, not only their generation: a SHUNT word, the CONTROL bits
    # and an interval of the shim's map written by hand are each drift, and a deploy of the policy repairs them.
    from hypafilter.targets.nic import CONTROL_SHUNT_ALL

    st = deploy.read_state()
    with deploy.target_of(st, Config()).client(st["nic"]) as c:
        c.write_table("SHUNT", 0, st["tables"]["shunt"][0] ^ 1)
        c.write("CONTROL", c.read("CONTROL") | CONTROL_SHUNT_ALL)
    fwshim = deploy._fw_shim()
    tampered = list(st["intervals"])
    tampered[0] += 1
    fwshim.update(tampered)
    drift = deploy.status()["drift"]
    assert any("SHUNT words differ" in d for d in drift), drift
    assert any("shunt everything is on" in d for d in drift), drift
    assert any("interval entries differ" in d for d in drift), drift
    assert main(["status"]) == 1
    capsys.readouterr()
    deploy.deploy(pol, Config())
    assert deploy.status()["drift"] == []
    assert udp_delivered(lab.ns_send, lab.ns_recv, dst, sends) == [(5000, b"fine")]

    # The NIC's socket, pid file and log live under the state directory (HF_STATE_DIR), and go with the NIC.
    assert Path(deploy.read_state()["nic"]["socket"]).parent == deploy.STATE_DIR / "nic"
    deploy.undeploy()
    # the policy stays the firewall's live ruleset, its chain policy included (docs/deploy.md, Live policy)
    assert deploy.base_policy(lab.ns_fw, Config(), "FORWARD") == "DROP"
    assert "-A FORWARD -p udp -m udp --dport 5000 -j ACCEPT" in netns.run(["iptables", "-S", "FORWARD"], lab.ns_fw)
    netns.run(["iptables", "-F", "FORWARD"], lab.ns_fw)
    netns.run(["iptables", "-P", "FORWARD", before], lab.ns_fw)
    assert not list((deploy.STATE_DIR / "nic").glob(f"{LAB}-g*")), "the NIC left files behind"


def test_a_recreated_firewall_namespace_gets_the_shim_again(lab):
    """The shim's pinned maps outlive a firewall namespace deleted without an undeploy (a crash, `ip netns del`).
    A deploy used to take the pins for a loaded shim and attach nothing to the new namespace's interfaces, whose
    tagged frames then crossed the bridge without iptables: every frame the policy drops was delivered."""
    from hypafilter import netns
    from hypafilter.config import Config
    from hypafilter.iptables.document import parse_policy
    from hypafilter.ops import deploy
    from hypafilter.ops.verify import verify

    pol = parse_policy(POLICY, "closed.rules")
    deploy.deploy(pol, Config())
    sh = deploy._fw_shim()
    assert sh.attached() == sh.ifaces
    netns.run(["ip", "netns", "del", lab.ns_fw])  # no undeploy, no unload
    lab.up()
    assert sh.pinned and sh.attached() == [], "the pins outlived their namespace, the programs did not"
    assert any(d.startswith("shim: not loaded") for d in deploy.status()["drift"])
    deploy.deploy(pol, Config())  # drift: redeploys
    assert sh.attached() == sh.ifaces
    assert deploy.status()["drift"] == []
    r = verify(pol, Config(), packets=400, seed=5)
    assert r["mismatches"] == 0, r["examples"][:3]
    # `lab down` with the deployment still in it takes the pins with the namespace.
    lab.down()
    assert not sh.pinned
    lab.up()
    deploy.deploy(pol, Config())  # a fresh lab under the recorded deployment: drift, redeployed
    assert sh.attached() == sh.ifaces and deploy.status()["drift"] == []
    deploy.undeploy()
    assert not sh.pinned


BAD = """*filter
:FORWARD DROP [0:0]
-A FORWARD -p udp -m udp --dport 5000 -j ACCEPT
-A FORWARD -p udp -m string --algo bm --from 50 --to 10 --string x -j DROP
-A FORWARD -p tcp -m set --match-set hf-no-such-set src -j DROP
-A FORWARD -m string --algo nonsense --string y -j DROP
COMMIT
"""


def test_lint_checks_every_rule_with_the_kernel(tmp_path, capsys):
    """What only the kernel refuses (lint used to accept it, and deploy failed after a cold build naming a line of
    a generated file) is reported at the user's file and line; a missing ipset is named."""
    from hypafilter.cli import main

    pol = tmp_path / "bad.rules"
    pol.write_text(BAD)
    assert main(["lint", str(pol)]) == 2
    err = capsys.readouterr().err
    assert f"{pol}:4:54: the kernel refuses this rule: RULE_APPEND failed (Invalid argument)" in err
    assert f"{pol}:5:" in err and "ipset hf-no-such-set does not exist on this host" in err  # ipset is installed
    assert f"{pol}:6:29: the kernel refuses this rule" in err
    assert f"{pol}:3" not in err
    assert main(["lint", "--no-kernel", str(pol)]) == 0


@pytest.mark.parametrize(
    "options, token",
    [
        ("-m nosuchmatch", "nosuchmatch"),
        ("-m string --algo nonsense --string x", "nonsense"),
        ("-m string --algo bm --string " + "s" * 200, "s" * 200),
        ("-m string --algo bm --string x --from 50 --to 10", "10"),
        ("-m mac --mac-source 00:11:22:33:zz", "00:11:22:33:zz"),
    ],
)
def test_a_kernel_refusal_points_at_the_token_it_names(tmp_path, capsys, options, token):
    """The kernel's (or iptables' own) refusal points at the token it is about, not at column 1."""
    from hypafilter.cli import main
    from hypafilter.errors import shown

    pol = tmp_path / "one.rules"
    line = f"-A FORWARD -p tcp {options} -j DROP"
    pol.write_text(f"*filter\n:FORWARD ACCEPT [0:0]\n{line}\nCOMMIT\n")
    assert main(["lint", str(pol)]) == 2
    err = capsys.readouterr().err
    col = line.rindex(f" {token} ") + 2
    assert f"{pol}:3:{col}: the kernel refuses this rule" in err and f"(at {shown(token)!r})" in err, err
    assert len(err) < 600  # a long token is shown cut


def test_deploy_refuses_what_the_kernel_refuses_before_building(lab):
    import time

    from hypafilter.config import Config
    from hypafilter.errors import HypafilterError
    from hypafilter.iptables.document import parse_policy
    from hypafilter.ops import deploy

    before = deploy.read_state()
    t0 = time.monotonic()
    with pytest.raises(HypafilterError, match=r"kernel-check.*bad\.rules:4:54: the kernel refuses this rule"):
        deploy.deploy(parse_policy(BAD, "bad.rules"), Config())
    assert time.monotonic() - t0 < 30  # refused before the emulator build (minutes for a new matcher)
    assert deploy.read_state() == before


def test_an_update_the_kernel_refuses_changes_nothing(lab):
    """An update of a running deployment that needs no build (a complex rule added: the same matcher, registers
    only) does not wait for the kernel check; the load of the ruleset refuses the rule, the transaction rolls back
    (the fast path decides again, by the old tables), and the error is the kernel check's, at the user's line."""
    from hypafilter.config import Config
    from hypafilter.errors import HypafilterError
    from hypafilter.iptables.document import parse_policy
    from hypafilter.ops import deploy

    deploy.deploy(parse_policy(POLICY, "good.rules"), Config())
    before = deploy.read_state()
    refused = POLICY.replace(
        "-A FORWARD -p tcp -j DROP",
        "-A FORWARD -p udp -m string --algo bm --from 50 --to 10 --string x -j DROP\n-A FORWARD -p tcp -j DROP",
    )
    with pytest.raises(HypafilterError, match=r"kernel-check.*refused\.rules:5:54: the kernel refuses this rule"):
        deploy.deploy(parse_policy(refused, "refused.rules"), Config())
    after = deploy.read_state()
    failed = after.pop("history")[-1]  # the failed update is journalled, nothing else changed
    assert failed["result"] == "failed" and failed["step"] == "kernel-check", failed
    assert after == {k: v for k, v in before.items() if k != "history"}
    assert deploy.drift(before) == []  # shunt-all cleared, the shim's generation and the chains as before
