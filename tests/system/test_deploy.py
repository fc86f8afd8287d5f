"""System tests of deploy/update/undeploy on the emulated NIC in a lab of its own: rollback, updates under traffic."""

from __future__ import annotations

import threading
import time

import pytest
from hypafilter.ops.connections import TcpServers, tcp_talk

pytestmark = pytest.mark.system

LAB = "hfd"

POLICY_A = """*filter
:FORWARD DROP [0:0]
-A FORWARD -p udp --dport 1000 -j ACCEPT
-A FORWARD -p udp --dport 2000 -j DROP
-A FORWARD -p udp --dport 3000 -m string --string BAD --algo bm -j DROP
-A FORWARD -p udp --dport 3000 -j ACCEPT
-A FORWARD -p tcp --dport 22 -j ACCEPT
COMMIT
"""
# B: port 2000 flips to ACCEPT, a new complex rule on 4000; everything else keeps its verdict. The hardware entries
# (the simple rules' boxes) stay the same, so the running core is updated by register writes alone.
POLICY_B = POLICY_A.replace("--dport 2000 -j DROP", "--dport 2000 -j ACCEPT").replace(
    "COMMIT", "-A FORWARD -p udp --dport 4000 -m string --string BAD --algo bm -j ACCEPT\nCOMMIT"
)
# C: a new simple rule (port 5000 ACCEPT): a new hardware entry, so a new core replaces the running one.
POLICY_C = POLICY_A.replace("COMMIT", "-A FORWARD -p udp --dport 5000 -j ACCEPT\nCOMMIT")
POLICIES = {"A": POLICY_A, "B": POLICY_B, "C": POLICY_C}


def parse(text: str, name: str):
    from hypafilter.config import Config
    from hypafilter.iptables.document import parse_policy

    return parse_policy(text, filename=name, base_chain="FORWARD", config=Config())


def verify(policy, packets=400):
    from hypafilter.config import Config
    from hypafilter.ops.verify import verify

    return verify(policy, Config(), packets=packets, seed=7)


def nic_processes(sock_name: str) -> list[int]:
    from pathlib import Path

    pids = []
    for p in Path("/proc").glob("[0-9]*"):
        try:
            if sock_name.encode() in (p / "cmdline").read_bytes():
                pids.append(int(p.name))
        except OSError:
            pass
    return pids


def fw(lab, *argv):
    return lab.exec_in("fw", list(argv))


def test_deploy_status_undeploy(lab):
    from hypafilter.config import Config
    from hypafilter.ops import deploy

    pa = parse(POLICY_A, "a.rules")
    st = deploy.deploy(pa, Config())
    assert st["policy_hash"] == pa.policy_hash() and st["generation"] >= 1
    forward = fw(lab, "iptables", "-S", "FORWARD").splitlines()
    # the policy is live under its own names, after the tool's single jump
    assert forward[1] == f"-A FORWARD -j {st['main_chain']}", forward
    assert len(forward) == 2 + len(pa.original_rules) and not any("HF" in ln for ln in forward[2:]), forward
    s = deploy.status()
    assert s["deployed"] and s["shim_stats"]["config"]["generation"] == st["generation"]
    assert "CNT_FORWARDED" in s["nic_counters"] and st["main_chain"] in s["netfilter"]
    r = verify(pa)
    assert r["mismatches"] == 0, r["examples"]
    # Redeploying the same policy changes nothing.
    assert deploy.deploy(pa, Config())["generation"] == st["generation"]
    assert deploy.undeploy()
    assert "HF" not in fw(lab, "iptables-save")
    assert not deploy.status()["deployed"]


@pytest.mark.parametrize(
    ("to", "step"),
    [
        ("B", "netfilter"),
        ("B", "shim-tables"),
        ("B", "registers"),
        ("B", "release"),
        ("C", "registers"),
        ("C", "activate"),
    ],
)
def test_failed_update_keeps_previous(lab, monkeypatch, to, step):
    from hypafilter.config import Config
    from hypafilter.errors import DeployError
    from hypafilter.ops import deploy

    pa, pb = parse(POLICY_A, "a.rules"), parse(POLICIES[to], f"{to.lower()}.rules")
    before = deploy.deploy(pa, Config())
    chains_before = fw(lab, "iptables-save", "-t", "filter")
    monkeypatch.setenv(deploy.FAIL_ENV, step)
    with pytest.raises(DeployError) as ei:
        # C replaces the core: without an update buffer (the running core's would take the new rule in place)
        deploy.deploy(pb, Config(update_buffer=0) if to == "C" else Config())
    assert ei.value.step == step
    monkeypatch.delenv(deploy.FAIL_ENV)
    after = deploy.read_state()
    assert after["policy_hash"] == pa.policy_hash() and after["generation"] == before["generation"]
    assert after["history"][-1]["result"] == "failed" and after["history"][-1]["step"] == step
    # The journal names the attempt (not "generation 0 / update"): the generation it would have had, the policy.
    failed = after["history"][-1]
    assert failed["generation"] == before["generation"] + 1 and failed["kind"] == "update"
    assert failed["policy_hash"] == pb.policy_hash() and failed["policy_source"] == pb.source
    # Nothing half-applied: the same chains, the old NIC alone, the shim back on the old generation.
    assert fw(lab, "iptables-save", "-t", "filter").count(":HF") == chains_before.count(":HF")
    assert f"HF{before['generation'] + 1}_" not in fw(lab, "iptables-save", "-t", "filter")
    assert deploy.status()["shim_stats"]["config"]["generation"] == before["generation"]
    tgt = deploy.target_of(after, Config())
    assert tgt.alive(after["nic"])
    assert not nic_processes(f"{LAB}-g{before['generation'] + 1}.sock"), "the new NIC was left running"
    with tgt.client(after["nic"]) as c:
        assert c.read("CONTROL") & 2 == 0, "shunt-all left on"
        # The old tables are back word for word (a register-only update that failed after writing undoes them).
        assert c.read("GENERATION") == before["generation"]
        assert [c.read_table("SHUNT", i) for i in range(len(before["tables"]["shunt"]))] == before["tables"]["shunt"]
        assert [c.read_table("ACTION", i) for i in range(len(before["tables"]["actions"]))] == before["tables"][
            "actions"
        ]
    r = verify(pa)
    assert r["mismatches"] == 0, r["examples"]


def _traffic(lab, stop: threading.Event, sent: list, rate: float = 1000.0):
    """Frames on the hybrid path until `stop`: (time sent, uid, dport, payload has BAD)."""
    from hypafilter.ops.verify import build_frame, raw_socket

    tx = raw_socket(lab.ns_send, "hyb0")
    ports = (1000, 2000, 3000, 3000, 4000, 5000)
    uid = 100000
    try:
        while not stop.is_set():
            uid += 1
            port = ports[uid % len(ports)]
            bad = uid % 3 == 0
            frame = build_frame(
                uid,
                {"src": 0x0A000101, "dst": 0x0A000201, "proto": 17, "sport": 999, "dport": port},
                b"xxBADxx" if bad else b"xxgoodxx",
            )
            sent.append((time.monotonic(), uid, port, bad))
            tx.send(frame)
            time.sleep(1 / rate)
    finally:
        tx.close()


def _expect(policy: str, port: int, bad: bool) -> bool:
    if port == 1000:
        return True
    if port == 2000:
        return policy == "B"
    if port == 3000:
        return not bad
    if port == 4000:
        return policy == "B" and bad
    if port == 5000:
        return policy == "C"
    return False


@pytest.mark.slow
@pytest.mark.parametrize(
    ("to", "buffer", "replaces_nic"),
    [("B", 16, False), ("C", 16, False), ("C", 0, True)],
    ids=["B", "C-buffer", "C-core"],
)
def test_update_under_traffic(lab, to, buffer, replaces_nic):
    """Every frame sent during an update gets the old or the new policy's verdict: B by register writes on the
    running core, C (a new hardware entry) through the running core's update buffer, or, with none, by a new core
    that takes over."""
    from hypafilter.config import Config
    from hypafilter.ops import deploy
    from hypafilter.ops.verify import collect, drain, raw_socket

    cfg = Config(update_buffer=buffer)
    pa, pb = parse(POLICY_A, "a.rules"), parse(POLICIES[to], f"{to.lower()}.rules")
    deploy.deploy(pa, cfg)
    from hypafilter.analysis.plan import build_plan
    from hypafilter.targets import emu

    emu.build(build_plan(pb, cfg), cfg, build_root=deploy.BUILD_ROOT)  # the update measures the switch
    rx = raw_socket(lab.ns_recv, "hyb0")
    drain(rx)
    got: dict = {"hybrid": {}}
    sent: list = []
    stop = threading.Event()
    th = threading.Thread(target=_traffic, args=(lab, stop, sent))
    th.start()
    try:
        # 1,000 frames/s: a register-only update takes ~50 ms, and it must still see dozens of frames; the quiet
        # spells around it are short so that the receiver's socket buffer holds everything until `collect`.
        time.sleep(0.4)
        t_start = time.monotonic()
        st = deploy.deploy(pb, cfg)
        t_done = time.monotonic()
        time.sleep(0.4)
    finally:
        stop.set()
        th.join()
    collect({"hybrid": rx}, got, 0.5, 10.0)
    rx.close()
    assert st["policy_hash"] == pb.policy_hash()
    assert st["history"][-1]["replaced_nic"] is replaces_nic
    if to == "B":  # only the changed words: one SHUNT word at most and its SHUNT_NONE twin (the emulated NIC's core
        # has the conntrack membership structure: frames with ct 3 read that table), one ACTION entry, GENERATION
        assert st["history"][-1]["register_writes"] <= 4, st["history"][-1]
    if not replaces_nic and to == "C":  # the new rule in one buffer slot: its rows, its words, the shunt bracket
        assert st["history"][-1]["overlay_slots"] == 1 and st["history"][-1]["register_writes"] <= 30, st["history"]
    wrong = []
    for t, uid, port, bad in sent:
        delivered = uid in got["hybrid"]
        if t < t_start:
            ok = delivered == _expect("A", port, bad)
        elif t > t_done:
            ok = delivered == _expect(to, port, bad)
        else:  # during the update either policy's verdict is right
            ok = delivered in (_expect("A", port, bad), _expect(to, port, bad))
        if not ok:
            wrong.append((round(t - t_start, 3), uid, port, bad, delivered))
    during = sum(1 for t, *_ in sent if t_start <= t <= t_done)
    print(f"update to {to}: {t_done - t_start:.3f} s, {during} of {len(sent)} frames sent during it")
    assert during > 20, "too little traffic during the update to mean anything"
    assert not wrong, f"{len(wrong)} wrong verdicts of {len(sent)} (t rel. to update start): {wrong[:10]}"


def test_conntrack_tcp_both_paths(lab):
    """First rule ESTABLISHED,RELATED: real TCP connections through the hybrid path and the plain path."""
    from hypafilter.config import Config
    from hypafilter.ops import deploy
    from hypafilter.ops.verify import load_oracle

    text = """*filter
:FORWARD DROP [0:0]
-A FORWARD -m conntrack --ctstate ESTABLISHED,RELATED -j ACCEPT
-A FORWARD -p tcp --dport 8080 -j ACCEPT
-A FORWARD -p tcp --dport 8081 -j DROP
-A FORWARD -p icmp -j ACCEPT
COMMIT
"""
    pol = parse(text, "ct.rules")
    deploy.deploy(pol, Config())
    load_oracle(lab.ns_plain, pol)
    results = {}
    with TcpServers(lab.ns_recv, [8080, 8081]):
        for path in ("hyb", "plain"):
            dst = lab.ip("recv", path)
            for _ in range(3):
                results[(path, 8080)] = tcp_talk(lab.ns_send, dst, 8080)
            results[(path, 8081)] = tcp_talk(lab.ns_send, dst, 8081)
    want = b"retlifapyh olleh" * 50
    assert results[("plain", 8080)] == want and results[("hyb", 8080)] == want, results
    assert results[("plain", 8081)] is None and results[("hyb", 8081)] is None
    counters = deploy.chain_counters(deploy.NS_FW, Config())
    assert sum(r["packets"] for rules in counters.values() for r in rules) > 0
