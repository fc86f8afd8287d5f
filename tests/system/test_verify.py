"""Tests of `hypafilter verify`: its frames (checked against scapy and the hardware model), refusals, and the CLI."""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys

import pytest
from hypafilter import netns

from conftest import ROOT, need_root, need_tool

LAB = "hfv"
STATE = f"/run/hypafilter/test-{LAB}"


def policy(text: str, name: str = "t.rules"):
    from hypafilter.config import Config
    from hypafilter.iptables.document import parse_policy

    return parse_policy(text, filename=name, base_chain="FORWARD", config=Config())


@pytest.mark.parametrize("proto", [6, 17, 1, 99])
def test_frames_match_scapy(proto):
    from hypafilter.ops.verify import build_frame, frame_id
    from scapy.layers.inet import IP
    from scapy.layers.l2 import Ether

    h = {"src": 0x0A000001, "dst": 0xC0A80101, "proto": proto, "sport": 1234, "dport": 80, "flags": 0x12}
    f = build_frame(77, h, b"payload BAD payload")
    p = Ether(f)
    del p[IP].chksum
    if hasattr(p[IP].payload, "chksum"):
        del p[IP].payload.chksum
    assert bytes(Ether(bytes(p))) == f  # scapy recomputes the very same checksums
    assert frame_id(f) == 77 and p[IP].proto == proto


def test_malformed_frames_as_the_hardware_sees_them():
    from hypafilter.hw.model import parse_frame
    from hypafilter.ops.verify import build_frame, frame_id, malform

    rng = random.Random(3)
    base = build_frame(5, {"src": 1, "dst": 2, "proto": 6, "sport": 1, "dport": 80, "flags": 2}, b"x" * 30)
    assert parse_frame(base, 0x01) is not None
    for kind, parsed in (
        ("fragment_later", False),
        ("truncated_ip", False),
        ("runt", False),
        ("bad_ethertype", False),
        ("smuggled_tag", False),
        ("ip_options", True),
        ("vlan", True),
        ("fragment_first", False),
    ):
        for _ in range(5):
            f = malform(kind, base, rng)
            assert frame_id(f) == 5
            assert (parse_frame(f, 0x01) is not None) == parsed, kind


def test_adversarial_frames_are_what_their_names_say():
    from hypafilter.ops.verify import ADVERSARIAL_KINDS, build_frame, frame_id, malform
    from scapy.layers.inet import IP

    def ip_at(f: bytes, at: int = 14) -> IP:
        return IP(f[at:])

    def checksum_ok(f: bytes) -> bool:
        ip = ip_at(f)
        sent = ip.chksum
        del ip.chksum
        return IP(bytes(ip)).chksum == sent

    rng = random.Random(4)
    base = build_frame(9, {"src": 1, "dst": 2, "proto": 17, "sport": 5, "dport": 53}, b"y" * 20)
    assert checksum_ok(base)
    checks = {
        "vlan_vid0": lambda f: f[12:14] == b"\x81\x00" and int.from_bytes(f[14:16], "big") & 0xFFF == 0,
        "vlan_8021ad": lambda f: f[12:14] == b"\x88\xa8" and f[16:18] == b"\x08\x00",
        "qinq": lambda f: f[12:14] in (b"\x88\xa8", b"\x81\x00")
        and f[16:18] == b"\x81\x00"
        and ip_at(f, 22).version == 4,
        "fragment_middle": lambda f: ip_at(f).flags.MF and ip_at(f).frag > 0 and checksum_ok(f),
        "fragment_last": lambda f: not ip_at(f).flags.MF and ip_at(f).frag > 0 and checksum_ok(f),
        "bad_ip_checksum": lambda f: not checksum_ok(f) and f[14:24] == base[14:24] and f[26:] == base[26:],
        "trailing_bytes": lambda f: len(f) > 14 + ip_at(f).len and f[: len(base)] == base,
        "link_local_dst": lambda f: f[:5] == bytes.fromhex("0180c20000") and f[5] <= 0x0F and f[6:] == base[6:],
        "unknown_ethertype": lambda f: int.from_bytes(f[12:14], "big")
        not in (0x0800, 0x0806, 0x86DD, 0x8100, 0x88A8, 0x88B5),
    }
    assert set(checks) == set(ADVERSARIAL_KINDS)
    for kind, ok in checks.items():
        for _ in range(10):
            f = malform(kind, base, rng)
            assert frame_id(f) == 9, kind
            assert ok(f), (kind, f.hex())


def test_policy_strings_reach_payloads():
    from hypafilter.ops.verify import FrameGen, policy_strings

    p = policy(
        "*filter\n:FORWARD ACCEPT [0:0]\n:C - [0:0]\n"
        '-A FORWARD -m string --algo bm --string "say \\"hi\\"" -j DROP\n'
        '-A FORWARD -p udp -j C\n-A C -m string --algo kmp --string "a\\\\b#c" -j RETURN\nCOMMIT\n'
    )
    assert policy_strings(p) == [b"a\\b#c", b'say "hi"']
    gen = FrameGen(p, random.Random(1), bad_share=1.0)
    bodies = [gen.payload() for _ in range(200)]
    for needle in (b"BAD", b'say "hi"', b"a\\b#c"):
        assert any(needle in b for b in bodies), needle


def test_refuses_random_matches():
    from hypafilter.errors import HypafilterError
    from hypafilter.ops.verify import refuse_nondeterministic

    p = policy(
        "*filter\n:FORWARD ACCEPT [0:0]\n-A FORWARD -p tcp --dport 80 -j ACCEPT\n"
        "-A FORWARD -m statistic --mode random --probability 0.5 -j DROP\nCOMMIT\n",
        "rand.rules",
    )
    with pytest.raises(HypafilterError, match=r"rand.rules:4: verify refuses match 'statistic'"):
        refuse_nondeterministic(p)
    refuse_nondeterministic(policy("*filter\n:FORWARD ACCEPT [0:0]\n-A FORWARD -p tcp -j DROP\nCOMMIT\n"))


def test_cli_refusal_changes_nothing(tmp_path):
    f = tmp_path / "rand.rules"  # (a rate limit is compared now: docs/verify.md; chance never is)
    f.write_text(
        "*filter\n:FORWARD ACCEPT [0:0]\n-A FORWARD -m statistic --mode random --probability 0.5 -j DROP\nCOMMIT\n"
    )
    env = dict(os.environ, HF_LAB="hfnone", HF_STATE_DIR=str(tmp_path / "state"))
    p = subprocess.run([sys.executable, "-m", "hypafilter", "verify", str(f)], capture_output=True, text=True, env=env)
    assert p.returncode == 2 and "refuses match 'statistic'" in p.stderr, p.stderr
    assert not (tmp_path / "state").exists()


@pytest.mark.system
def test_cli_verify_json(shared_dir):
    need_root()
    need_tool("ip", "iptables-restore", "clang", "ghdl", "verilator", "ethtool")
    env = dict(os.environ, HF_LAB=LAB, HF_STATE_DIR=STATE)
    hf = [sys.executable, "-m", "hypafilter"]
    shutil.rmtree(STATE, ignore_errors=True)
    try:
        p = subprocess.run(
            hf + ["verify", str(ROOT / "rulesets" / "example.rules"), "--packets", "1500", "--json"],
            capture_output=True,
            text=True,
            env=env,
        )
        assert p.returncode == 0, p.stderr[-3000:]
        r = json.loads(p.stdout)
        assert r["packets"] == 1500 and r["mismatches"] == 0
        assert r["delivered_oracle"] > 0 and r["delivered_oracle"] < 1500
        assert sum(v["packets"] for v in r["by_kind"].values()) == 1500 and len(r["by_kind"]) > 5
        assert r["shim"]["tagged"] >= r["shunted"] > 0
        # A trace drives the headers; the policy is deployed already, so it is not redeployed.
        trace = shared_dir / "data" / "classbench" / "acl1_1100_trace.gz"
        p = subprocess.run(
            hf + ["verify", str(ROOT / "rulesets" / "example.rules"), "--trace", str(trace), "--packets", "300"],
            capture_output=True,
            text=True,
            env=env,
        )
        assert p.returncode == 0, p.stderr[-3000:]
        assert json.loads(p.stdout.splitlines()[-1])["mismatches"] == 0
        assert "deploying" not in p.stderr
        st = json.loads(subprocess.run(hf + ["status", "--json"], capture_output=True, text=True, env=env).stdout)
        assert st["deployed"] and st["generation"] == 1
    finally:
        subprocess.run(hf + ["undeploy", "-q"], env=env, capture_output=True)
        subprocess.run(hf + ["lab", "down", "--name", LAB], env=env, capture_output=True)
        shutil.rmtree(STATE, ignore_errors=True)
    assert not netns.exists(f"{LAB}-fw")
