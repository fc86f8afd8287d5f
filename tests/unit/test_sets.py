"""Unit tests of sets in the fast path's front end: `ipset save` read (netfilter.ipset), set matches turned into
set-slot ternaries or left complex with the reason (iptables.sets), and the xdp maps' keys and expiry windows
(targets.xdp.sets). The kernel itself is the oracle of tests/system/test_ipset_xdp.py."""

from __future__ import annotations

import struct

import pytest
from hypafilter.errors import PolicyError
from hypafilter.iptables.document import parse_policy
from hypafilter.iptables.sets import SetEnv, set_match
from hypafilter.ir.sets import frame_ports, member
from hypafilter.netfilter.ipset import parse_save
from hypafilter.targets import set_capability
from hypafilter.targets.xdp import sets as xs

SAVE = """create bl hash:net family inet hashsize 1024 maxelem 65536 bucketsize 12 initval 0x1
add bl 10.9.0.0/16
add bl 10.9.1.0/24 nomatch
add bl 1.2.3.4
create svc hash:ip,port family inet hashsize 1024 maxelem 65536 timeout 300 counters bucketsize 12 initval 0x2
add svc 10.0.0.1,tcp:80 timeout 0 packets 0 bytes 0
add svc 10.0.0.1,udp:53 timeout 99 packets 0 bytes 0
add svc 10.0.0.1,icmp:echo-request timeout 0 packets 0 bytes 0
add svc 10.0.0.2,gre:0 timeout 0 packets 0 bytes 0
create bp bitmap:port range 0-1024
add bp 22
create hi hash:ip family inet hashsize 1024 maxelem 65536 netmask 24 bucketsize 12 initval 0x3
add hi 10.9.8.0
create six hash:ip family inet6 hashsize 1024 maxelem 65536
add six 2001:db8::1
create ls list:set size 8
"""


def ip(t: str) -> int:
    a, b, c, d = (int(x) for x in t.split("."))
    return a << 24 | b << 16 | c << 8 | d


def test_ipset_save_read():
    sets = parse_save(SAVE)
    bl, svc, bp, hi = sets["bl"], sets["svc"], sets["bp"], sets["hi"]
    assert [(e.prefix, e.nomatch) for e in bl.entries] == [(16, False), (24, True), (32, False)]
    assert [(e.proto, e.port, e.timeout_s) for e in svc.entries] == [
        (6, 80, None),
        (17, 53, 99),
        (1, 8 << 8, None),
        (47, 0, None),
    ]
    assert svc.timeout_default == 300 and "counters" in svc.options
    assert bp.port_range == (0, 1024) and bp.maxelem == 1025 and bp.entries[0].port == 22
    assert hi.netmask == 24 and (hi.entries[0].addr_lo, hi.entries[0].addr_hi) == (ip("10.9.8.0"), ip("10.9.8.255"))
    assert "family" in sets["six"].supported() and "type" in sets["ls"].supported()


@pytest.mark.parametrize(
    "text, token",
    [
        ("add x 1.2.3.4\n", "x"),  # before its create
        ("create x hash:ip bogus 1\n", "bogus"),
        ("create x hash:ip\nadd x 1.2.3.0/24\n", "1.2.3.0/24"),
        ("create x hash:ip,port\nadd x 1.2.3.4,tcp:99999\n", "1.2.3.4,tcp:99999"),
        ("create x hash:ip\nadd x 1.2.3.4 nomatch\n", "nomatch"),
        ("flush x\n", "flush"),
    ],
)
def test_ipset_save_errors_name_line_and_token(text, token):
    with pytest.raises(PolicyError) as e:
        parse_save(text, "f.save")
    assert e.value.file == "f.save" and e.value.line == text.count("\n") and e.value.token == token


POLICY = """*filter
:FORWARD ACCEPT [0:0]
-A FORWARD -m set --match-set bl src -j DROP
-A FORWARD -m set ! --match-set svc dst,dst -p tcp -j DROP
-A FORWARD -m set --match-set bl src,dst -j ACCEPT
-A FORWARD -m set --match-set bl src --return-nomatch -j DROP
-A FORWARD -m set --match-set svc dst -j DROP
-A FORWARD -m set --match-set nosuch src -j DROP
-A FORWARD -m set --match-set six src -j DROP
-A FORWARD -m set --match-set z src -j DROP
-A FORWARD -m set --match-set bp dst -j SET --add-set z src
-A FORWARD -m set --match-set hi src -m limit --limit 1/s -j DROP
COMMIT
"""


def test_set_matches_become_slots_or_say_why():
    p = parse_policy(POLICY, "p.rules", sets=SetEnv(parse_save(SAVE + "create z hash:ip\n"), 8, 1 << 20, "xdp"))
    assert [str(s) for s in p.set_slots] == ["bl src", "svc dst,dst", "bp dst"]
    notes = {n.origin.line: (n.slot, n.why) for n in p.set_notes}
    assert notes[3] == (0, "") and notes[4] == (1, "") and notes[5] == (0, "")  # src,dst on a 1-dim set: bl src
    assert "--return-nomatch" in notes[6][1]
    assert "the kernel matches no frame" in notes[7][1]
    assert "unknown" in notes[8][1] and "family inet6" in notes[9][1]
    assert "-j SET" in notes[10][1]
    assert notes[11][0] == 2  # the rule stays complex for its target; its set test is a slot of its reduction
    assert "per-rule state" in notes[12][1] or notes[12][0] == -1
    r0, r1 = p.rules[0], p.rules[1]
    assert r0.is_simple and {(b.sets_mask, b.sets_value) for b in r0.boxes} == {(1, 1)}
    assert r1.is_simple and {(b.sets_mask, b.sets_value) for b in r1.boxes} == {(2, 0)}
    assert "set slot 0 bl hash:net src" in p.canonical_text()


def test_capacity_slots_and_targets():
    sets = parse_save(SAVE)
    many = "".join(f"-A FORWARD -m set --match-set bl {d} -j DROP\n" for d in ("src", "dst"))
    p = parse_policy(f"*filter\n:FORWARD ACCEPT\n{many}COMMIT\n", sets=SetEnv(sets, 1, 1 << 20, "xdp"))
    assert [n.slot for n in p.set_notes] == [0, -1] and "beyond the target's 1" in p.set_notes[1].why
    p = parse_policy(f"*filter\n:FORWARD ACCEPT\n{many}COMMIT\n", sets=SetEnv(sets, 8, 1000, "xdp"))
    assert all("maxelem" in n.why for n in p.set_notes)
    # the emulated NIC's core has set tables (hw/hf_set_table.vhd); sume's build does not use them
    assert set_capability("emu") == (8, 65536) and set_capability("sume") == (0, 0) and set_capability("xdp")[0] == 8
    p = parse_policy(f"*filter\n:FORWARD ACCEPT\n{many}COMMIT\n", sets=SetEnv(sets, *set_capability("sume"), "sume"))
    assert not p.set_slots and all("target sume has no set slots" in n.why for n in p.set_notes)
    assert not parse_policy(f"*filter\n:FORWARD ACCEPT\n{many}COMMIT\n").rules[0].is_simple  # no sets known
    assert set_match(("-m", "set", "!", "--match-set", "a", "src,dst")) == (True, "a", "src,dst", ())


def test_reference_membership():
    sets = parse_save(SAVE)
    bl, svc, bp = sets["bl"], sets["svc"], sets["bp"]
    pt = frame_ports(6, 1000, 80, 0, 0)
    assert member(bl, ("src",), ip("10.9.2.1"), 0, 6, pt)
    assert not member(bl, ("src",), ip("10.9.1.1"), 0, 6, pt)  # the nomatch /24 is the longest prefix
    assert member(svc, ("dst", "dst"), 0, ip("10.0.0.1"), 6, pt)
    assert not member(svc, ("dst", "src"), 0, ip("10.0.0.1"), 6, pt)
    assert member(svc, ("dst", "dst"), 0, ip("10.0.0.1"), 1, frame_ports(1, 0, 0, 8, 0))
    assert member(svc, ("dst", "dst"), 0, ip("10.0.0.2"), 47, frame_ports(47, 0, 0, 0, 0))
    assert not member(svc, ("dst",), 0, ip("10.0.0.1"), 6, pt)
    assert not member(svc, ("dst", "dst"), 0, ip("10.0.0.1"), 17, frame_ports(17, 1, 53, 0, 0), now_s=100)
    assert member(bp, ("dst",), 0, 0, 17, frame_ports(17, 1, 22, 0, 0))
    assert not member(bp, ("dst",), 0, 0, 132, frame_ports(132, 1, 22, 0, 0))  # bitmap:port: TCP and UDP only


def test_xdp_keys_and_expiry_windows():
    sets = parse_save(SAVE)
    e = sets["bl"].entries[1]
    assert xs.key_of("hash:net", e) == struct.pack("<I", 24) + bytes([10, 9, 1, 0])
    assert xs.describe_key("hash:net", xs.key_of("hash:net", e)) == "10.9.1.0/24"
    k = xs.key_of("hash:ip,port", sets["svc"].entries[0])
    assert xs.describe_key("hash:ip,port", k) == "10.0.0.1,6:80"
    np_ = parse_save("create n hash:net,port\nadd n 10.0.0.0/8,udp:53\n")["n"].entries[0]
    assert xs.key_of("hash:net,port", np_) == struct.pack("<I", 40) + bytes([17, 0, 0, 53, 10, 0, 0, 0])
    assert xs.expiry(sets["bl"].entries[0], 0, 10) is None
    w = xs.expiry(sets["svc"].entries[1], 1_000_000_000, 1_000_000_500)  # 99 s left when read
    assert w.lo == 1_000_000_000 + 98_000_000_000 - xs.MARGIN_NS
    assert w.hi == 1_000_000_500 + 100_000_000_000 + xs.MARGIN_NS
    flags = struct.unpack("<QII", xs.value_of(sets["bl"].entries[1], None))[1]
    assert flags == xs.PRESENT | xs.NOMATCH


def test_split_save_and_watcher_release(tmp_path, monkeypatch):
    parts = xs.split_save(SAVE)
    assert list(parts)[:3] == ["bl", "svc", "bp"] and parts["bl"].count("\n") == 4
    assert parse_save(parts["svc"])["svc"].entries == parse_save(SAVE)["svc"].entries
    root = tmp_path / "setwatch"
    watcher, old = root / "setwatch-new", root / "setwatch-old"
    for d in (watcher, old):
        d.mkdir(parents=True)
        (d / "hfx_setseq").write_text("")
    monkeypatch.setattr(xs, "SETWATCH_PIN", root)
    prog = tmp_path / "root" / "lab" / "g1-abc"
    prog.mkdir(parents=True)
    (prog / "hfx_setseq").symlink_to(watcher / "hfx_setseq")
    assert xs.watcher_users(tmp_path / "root") == [prog]
    assert xs.release_watcher(tmp_path / "root") and watcher.exists() and not old.exists()  # the unused build goes
    assert not xs.release_watcher(tmp_path / "root") and watcher.exists()  # a program still uses this one
    (prog / "hfx_setseq").unlink()
    assert xs.release_watcher(tmp_path / "root") and not root.exists()


def test_an_update_keeps_a_matcher_only_with_the_plans_set_tables(tmp_path):
    """The update buffer's record of the running matcher (ops.buffer) keeps its set tables: a plan whose set slots
    differ is not aligned onto it (a set rule in a buffer slot of a core without that table would match without its
    set: the emulated NIC forwarded blocklisted frames); a plan with the same slots is, and the view hashes as the
    matcher (the core's MATCHER_HASH: a lazy rebuild's core with a set table refused the next update's registers)."""
    from hypafilter.analysis.overlay import align
    from hypafilter.analysis.plan import build_plan
    from hypafilter.config import Config
    from hypafilter.hw import vhdl
    from hypafilter.ops.buffer import read_static, write_static

    cfg = Config()
    env = SetEnv(parse_save(SAVE), 8, 1 << 20, "emu")
    plain = "*filter\n:FORWARD ACCEPT [0:0]\n-A FORWARD -p tcp --dport 22 -j DROP\nCOMMIT\n"
    with_set = plain.replace("-A FORWARD -p tcp", "-A FORWARD -m set --match-set bl src -j DROP\n-A FORWARD -p tcp")
    p0 = build_plan(parse_policy(plain, "a.rules", sets=env), cfg)
    p1 = build_plan(parse_policy(with_set, "b.rules", sets=env), cfg)
    assert not vhdl.set_slots(p0) and vhdl.set_slots(p1)
    write_static(tmp_path, p0, 16, "core-a")
    assert read_static(tmp_path, "core-a") is not None  # (no plan: the record alone)
    assert read_static(tmp_path, "core-a", p1) is None  # the core has no table for bl: a new core
    assert read_static(tmp_path, "core-a", p0) is not None
    write_static(tmp_path, p1, 16, "core-b")
    static = read_static(tmp_path, "core-b", p1)
    assert static is not None
    view = align(static[0], p1, static[1])
    assert vhdl.set_slots(view) == vhdl.set_slots(p1)
    assert vhdl.matcher_hash(view) == vhdl.matcher_hash(p1)
