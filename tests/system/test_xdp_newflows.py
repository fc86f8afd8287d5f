"""New flows on the xdp target (docs/xdp.md "New flows"): a TCP or UDP frame that conntrack holds no entry for is NEW
or INVALID to the kernel, and the program decides it (ct 3) where the policy drops it as both; a frame the policy
would accept still goes to the stack, which creates its entry.

Two parts. The program against `hw.model.decide` (BPF_PROG_TEST_RUN in a namespace whose conntrack holds some of the
frames' flows, created with `conntrack`): frames of every attack shape with and without entries, XDP action,
match_index and M's reason as the model gives them for ct 3 (no entry), 1/2 (an established entry) or 0. Then the
kernel as oracle on a lab of its own (`xnf`): conntrack-first policies under SYN floods, ACK segments without
entries, RST/FIN scans, UDP floods from spoofed sources, fragments of new flows and ICMP errors quoting real and
invented flows (`verify --attack`), mixed with real connections that must complete: 0 mismatches, and every attack
frame the policy drops dropped in XDP.
"""

from __future__ import annotations

import collections
import json
import random
import time
import zlib
from pathlib import Path

import pytest
from hypafilter import netns

from tests.hfcli import HfCli
from tests.system.test_xdp import veth_namespace

pytestmark = pytest.mark.system

LAB = "xnf"
STATE = f"/run/hypafilter/test-{LAB}"
hf = HfCli(LAB, STATE)

# Conntrack first, then stateless port rules, chain policy DROP: the ClassBench imports' --ct-first shape.
CT_FIRST = """*filter
:FORWARD DROP [0:0]
-A FORWARD -m conntrack --ctstate ESTABLISHED,RELATED -j ACCEPT
-A FORWARD -p tcp -m tcp --dport 8080 -j ACCEPT
-A FORWARD -p udp -m udp --dport 5353 -j ACCEPT
-A FORWARD -p icmp -j ACCEPT
-A FORWARD -p tcp -m tcp --dport 22 -j DROP
COMMIT
"""
# The distributions' shape: INVALID dropped early (its miss part reaches ct 3: NEW and INVALID read it apart), a
# SYN-only NEW accept, a default DROP.
CT_INVALID = """*filter
:FORWARD DROP [0:0]
-A FORWARD -m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT
-A FORWARD -m conntrack --ctstate INVALID -j DROP
-A FORWARD -p tcp -m tcp --dport 8080 --tcp-flags FIN,SYN,RST,ACK SYN -j ACCEPT
-A FORWARD -p udp -m udp --dport 5353 -j ACCEPT
-A FORWARD -p icmp -m icmp --icmp-type echo-request -j ACCEPT
COMMIT
"""
ATTACK = "syn,ack,rst,fin,udp,frag,icmp_error"
DECIDABLE = ("attack_syn", "attack_ack", "attack_rst", "attack_fin", "attack_udp")  # TCP/UDP, no entry

NS = "xnf-run"
PORTS = ("n0", "n1")
WIRE = (0x01, 0x04)


# ---- the program against the model ---------------------------------------------------------------------------------


@pytest.fixture
def run_ns():
    with veth_namespace(NS, PORTS, ("conntrack", "sysctl")) as name:
        yield name


def _frames(policy, seed: int, count: int):
    """(iport, frame, ct the program must see) for attack frames of every shape, a third of the TCP/UDP ones with an
    established entry (half of those in the reply direction), and the flows to create."""
    from hypafilter.ops.verify import ATTACK_SHAPES, FrameGen, attack_frame, build_frame

    rng = random.Random(seed)
    gen = FrameGen(policy, rng)
    out, flows, sent = [], set(), []
    while len(out) < count:
        h = gen.header()
        shape = rng.choice(ATTACK_SHAPES)
        uid = len(out) + 1
        if shape in ("syn", "ack", "rst", "fin", "udp") and rng.random() < 0.33:
            h = dict(h, proto=6 if shape != "udp" else 17, flags=rng.choice((0x10, 0x18, 0x02, 0x11, 0x04)))
            key = (h["proto"], h["src"], h["dst"], h["sport"], h["dport"])
            rev = (key[0], key[2], key[1], key[4], key[3])
            if h["src"] == h["dst"] or key in flows or rev in flows:
                continue
            reply = rng.random() < 0.5
            flows.add(rev if reply else key)
            hit = h["proto"] == 17 or (h["flags"] & 0x17) == 0x10
            out.append((rng.randint(0, 1), build_frame(uid, h, b""), (2 if reply else 1) if hit else 0))
            continue
        f = attack_frame(uid, shape, h, rng, sent, b"\x0e\x48\xff\xff\xff\xfe")
        sent.append(dict(h, proto=6))
        ct = 3 if shape in ("syn", "ack", "rst", "fin", "udp") else 0  # ICMP: not looked up; fragments: unparsed
        out.append((rng.randint(0, 1), f, ct))
    return out, sorted(flows)


@pytest.mark.parametrize("name", ("ct-first", "ct-invalid", "fuzz-3", "fuzz-6"))
def test_program_decides_new_flows_as_the_model(run_ns, name):
    """Every frame's XDP action, match_index and M reason as hw.model.decide gives them with the ct the program must
    find (3 for a TCP/UDP frame without an entry), in index and selective mode, bridge and host mode; frames without
    an entry that the policy drops are dropped (CNT_DROPPED), and with HFX_CT_NONE off the same frames are not."""
    import dataclasses

    from hypafilter.analysis.plan import build_plan
    from hypafilter.config import Config
    from hypafilter.hw import model
    from hypafilter.iptables.document import parse_policy
    from hypafilter.targets.xdp.run import XDP_DROP, XDP_PASS, XDP_REDIRECT, run_frames
    from hypafilter.targets.xdp.target import read_ct_config
    from hypafilter.tools.bench.ctflows import open_flows
    from hypafilter.tools.fuzz import random_policy

    text = {"ct-first": CT_FIRST, "ct-invalid": CT_INVALID}.get(name) or random_policy(int(name[5:]), conntrack=True)
    policy = parse_policy(text, name, base_chain="FORWARD")
    frames, flows = _frames(policy, zlib.crc32(name.encode()), 500)
    open_flows(run_ns, flows)
    ct = read_ct_config(run_ns)
    assert ct.lookup
    ct = dataclasses.replace(ct, none=True)
    pairs = [(i, f) for i, f, _ in frames]
    tally = collections.Counter()
    for nic_mode in ("bridge", "host"):
        for mode in ("index", "selective"):
            plan = build_plan(policy, Config(shunt_mode=mode, nic_mode=nic_mode))
            regs = model.Regs.from_plan(plan, unfilterable="drop", nic_mode=nic_mode)
            res = run_frames(plan, pairs, PORTS, ns=run_ns, control=regs.control, ct=ct)
            bad = []
            for (iport, f, c), v in zip(frames, res.verdicts, strict=True):
                d = model.decide(plan, f, WIRE[iport], regs, ct=c)
                want = {model.Kind.DROP: XDP_DROP}.get(d.kind, XDP_PASS)
                if d.kind == model.Kind.FORWARD and nic_mode == "bridge":
                    want = XDP_REDIRECT
                got = (v.retval, v.meta & 0xFFFFFF, (v.meta >> 28) & 0xF)
                reason = d.reason if d.reason is not None else 15
                if got != (want, d.match_index, reason):
                    bad.append((f.hex(), c, d, got))
                tally[(nic_mode, d.kind.name, c)] += 1
            assert not bad, f"{name}/{nic_mode}/{mode}: {len(bad)} of {len(frames)} differ, first: {bad[:3]}"
            if name.startswith("ct-"):
                # the attack frames the policy drops (TCP to 22, every port the policy names not, UDP but 5353)
                assert res.counters.get("CNT_DROPPED", 0) > len(frames) // 4, res.counters
            if mode == "selective" and nic_mode == "bridge":
                off = run_frames(
                    plan, pairs, PORTS, ns=run_ns, control=regs.control, ct=dataclasses.replace(ct, none=False)
                )
                dropped_new = sum(
                    1
                    for (iport, f, c) in frames
                    if c == 3 and model.decide(plan, f, WIRE[iport], regs, ct=3).kind == model.Kind.DROP
                )
                assert dropped_new > 0 or not name.startswith("ct-")
                assert off.counters.get("CNT_DROPPED", 0) == res.counters.get("CNT_DROPPED", 0) - dropped_new
    print(name, dict(tally))


# ---- the kernel as oracle --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def lab():
    with hf.xdp_lab():
        yield LAB


def _verify(tmp_path, text: str, *args: str) -> dict:
    f = tmp_path / "policy.rules"
    f.write_text(text)
    p = hf("verify", str(f), "--target", "xdp", "--json", *args, check=False)
    assert p.returncode in (0, 1), p.stderr[-2000:]
    return json.loads(p.stdout)


def _attack_share(r: dict) -> tuple[int, int]:
    """(attack frames the oracle dropped of the decidable shapes, all of them)."""
    bk = r["by_kind"]
    dropped = sum(bk[k]["packets"] - bk[k]["delivered"] for k in DECIDABLE if k in bk)
    return dropped, sum(bk[k]["packets"] for k in DECIDABLE if k in bk)


@pytest.mark.parametrize("policy", ("ct-first", "ct-invalid"))
def test_attack_frames_dropped_in_xdp(lab, tmp_path, policy):
    """Attack frames only (every shape), against the kernel alone: 0 mismatches; every TCP/UDP attack frame the
    oracle drops was dropped by the program (CNT_DROPPED counts exactly those: ICMP errors go to conntrack by miss
    forcing, fragments unparsed), and the fast path's share of all frames is at least that share."""
    text = CT_FIRST if policy == "ct-first" else CT_INVALID
    r = _verify(tmp_path, text, "--packets", "1500", "--attack", ATTACK, "--attack-share", "1", "--malformed", "0")
    assert r["mismatches"] == 0, r["examples"][:3]
    dropped, decidable = _attack_share(r)
    assert decidable > 800 and dropped > 0.75 * decidable, r["by_kind"]
    assert r["nic"].get("CNT_DROPPED", 0) == dropped, (r["nic"], r["by_kind"])
    assert r["hw_share"] >= dropped / r["packets"] - 1e-6, r
    st = json.loads(hf("status", "--json").stdout)
    assert st["drift"] == [], st["drift"]


def test_attack_mixed_with_real_connections(lab, tmp_path):
    """Half attack frames, half the policy's own frames (malformed kinds included), then 8 real TCP and UDP
    connections: 0 mismatches on frames and connections, every connection the oracle completes completes, and the
    attack frames the policy drops dropped in XDP."""
    args = ["--packets", "1500", "--attack", ATTACK, "--attack-share", "0.5", "--connections", "8"]
    r = _verify(tmp_path, CT_FIRST, *args)
    c = r["connections"]
    assert r["mismatches"] == 0 and c["mismatches"] == 0, (r["examples"][:3], c["examples"][:3])
    assert c["completed_oracle"] == c["completed_hybrid"] > 0, c
    dropped, decidable = _attack_share(r)
    assert decidable > 300 and r["nic"].get("CNT_DROPPED", 0) >= dropped, (r["nic"], r["by_kind"])


def test_helper_keeps_forcing(lab, tmp_path):
    """A conntrack helper configured in the firewall (an nft ct helper object: a rule may assign it to connections,
    whose expectations make new flows RELATED; the same check covers notrack and zones, targets/xdp/newflows; the
    raw table's CT rules are refused by deploy already, as foreign base chains): deploy leaves misses unknown (ct 0),
    so the same attack is shunted to conntrack and still exact; the deploy state says why."""
    fw = f"{LAB}-fw"
    netns.run(["nft", "add", "table", "ip", "hfxnf"], fw)
    netns.run(["nft", 'add ct helper ip hfxnf ftph { type "ftp" protocol tcp; }'], fw)
    try:
        hf("undeploy", "-q", check=False)
        args = ["--packets", "600", "--attack", ATTACK, "--attack-share", "1", "--malformed", "0"]
        r = _verify(tmp_path, CT_FIRST, *args)
        state = (Path(STATE) / "state.json").read_text()
    finally:
        netns.run(["nft", "delete", "table", "ip", "hfxnf"], fw)
        hf("undeploy", "-q", check=False)
    assert r["mismatches"] == 0, r["examples"][:3]
    assert r["nic"].get("CNT_DROPPED", 0) == 0 and r["shunted"] >= _attack_share(r)[0] > 0, r["nic"]
    why = json.loads(state)["tables"]["new_flows"]
    assert "ct helper" in why, why


def test_helper_added_after_deploy_is_followed(lab, tmp_path):
    """New flows decided since deploy, then a helper configured in the firewall (an nft ct helper object: the
    transaction's NEWOBJ): the policy sync service withdraws HFX_CT_NONE without `status` or a redeploy, so `status`
    has no drift; the table deleted, it comes back (tests/system/test_newflows_follow.py: CT rules, expectations)."""
    from hypafilter.targets.xdp.target import _ct_flags

    fw = f"{LAB}-fw"
    f = tmp_path / "policy.rules"
    f.write_text(CT_FIRST)
    hf("undeploy", "-q", check=False)
    hf("deploy", str(f), "--target", "xdp", "--json")
    st = json.loads((Path(STATE) / "state.json").read_text())
    assert st["tables"]["new_flows"] == "decided"
    assert json.loads(hf("status", "--json").stdout)["drift"] == []

    def decided() -> bool:
        return bool(_ct_flags(st["nic"]) & 2)

    def wait(cond, timeout: float = 3.0) -> bool:
        deadline = time.monotonic() + timeout
        while not cond():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.005)
        return True

    assert wait(decided)
    netns.run(["nft", "add", "table", "ip", "hfxnf"], fw)
    netns.run(["nft", 'add ct helper ip hfxnf ftph { type "ftp" protocol tcp; }'], fw)
    try:
        assert wait(lambda: not decided(), 1.0)
        p = hf("status", "--json", check=False)
        assert p.returncode == 0 and not json.loads(p.stdout)["drift"], p.stdout[-2000:]
    finally:
        netns.run(["nft", "delete", "table", "ip", "hfxnf"], fw)
    try:
        assert wait(decided)
    finally:
        hf("undeploy", "-q", check=False)


@pytest.mark.parametrize("policy", ("ct-first", "ct-invalid"))
def test_attack_host_mode(lab, tmp_path, policy):
    """The same policies on INPUT (host mode: a decided ACCEPT passes the host's conntrack, so only DROP was forced
    before): 0 mismatches with the firewall itself as the destination, and the attack frames the policy drops
    dropped in XDP (CNT_DROPPED counts them and the policy's own frames it drops)."""
    text = (CT_FIRST if policy == "ct-first" else CT_INVALID).replace("FORWARD", "INPUT")
    args = ["--chain", "INPUT", "--packets", "1000", "--attack", ATTACK, "--attack-share", "0.7"]
    r = _verify(tmp_path, text, *args)
    assert r["mismatches"] == 0 and r["nic_mode"] == "host", r["examples"][:3]
    dropped, decidable = _attack_share(r)
    assert decidable > 300 and r["nic"].get("CNT_DROPPED", 0) >= dropped > 0, (r["nic"], r["by_kind"])
    hf("undeploy", "-q", check=False)  # the module's other tests deploy FORWARD policies (bridge mode)
