"""ir.family.compress (issue #25): an IPv6 policy's 128-bit addresses as ranks of elementary intervals, exact for
matching, for the plan (every mode) and for the hybrid's verdicts on real 128-bit headers; the CLI's -6 / --ipv6."""

from __future__ import annotations

import json
import random

import pytest
from hypafilter.analysis.decision import decision, match_index
from hypafilter.analysis.plan import build_plan
from hypafilter.cli import main
from hypafilter.config import Config
from hypafilter.iptables.document import parse_policy
from hypafilter.ir import ACTION_CODES, MAXV, Header
from hypafilter.ir.family import ADDR_BITS, ADDR_MAX, compress
from hypafilter.ir.semantics import reference_verdict
from hypafilter.tools.classbench6 import v6_policy_text

TOP = ADDR_MAX[6]
NETS = [
    "2001:db8::/32",
    "2001:db8:1::/48",
    "2001:db8:1:2::/64",
    "2001:db8:1:2::7",
    "2001:db8:1:3::/64",
    "2001:db8:ffff::/48",
    "fe80::/10",
    "::ffff:0:0/96",
    "ff02::1",
    "::/0",
    "2001:db8::/ffff:ffff:0:0:ffff::",  # non-contiguous: a complex check
]


def random_policy(rnd: random.Random, n: int):
    rules = []
    for _ in range(n):
        opts = []
        for opt in ("-s", "-d"):
            if rnd.random() < 0.6:
                opts += (["!"] if rnd.random() < 0.15 and "::/0" else []) + [opt, rnd.choice(NETS[:-2])]
            elif rnd.random() < 0.05:
                opts += [opt, NETS[-1]]
        if rnd.random() < 0.1:
            opts += ["-m", "iprange", "--dst-range", "2001:db8:1:2::5-2001:db8:1:3::9"]
        p = rnd.choice(["", "tcp", "udp", "icmpv6", "59", "44"])
        if p:
            opts += ["-p", p]
        if p in ("tcp", "udp") and rnd.random() < 0.6:
            lo = rnd.randrange(0, 2000)
            opts += ["--dport", f"{lo}:{lo + rnd.randrange(0, 500)}"]
        if p == "icmpv6" and rnd.random() < 0.7:
            opts += ["--icmpv6-type", rnd.choice(["echo-request", "1/4", "135", "destination-unreachable"])]
        if rnd.random() < 0.05:
            opts += ["-m", "hl", "--hl-eq", "5"]
        target = rnd.choice(["ACCEPT", "DROP"] * 6 + ["REJECT", "LOG"])
        if target == "REJECT" and p == "tcp":
            target = "REJECT --reject-with tcp-reset"
        rules.append(" ".join(opts + ["-j", target]).replace("! -s ::/0", "-s ::/0").replace("! -d ::/0", "-d ::/0"))
    text = "*filter\n:FORWARD DROP [0:0]\n" + "".join(f"-A FORWARD {r}\n" for r in rules) + "COMMIT\n"
    return parse_policy(text, filename="rand6.rules", family=6)


def headers(rnd: random.Random, policy, count: int) -> list[Header]:
    """Frames on and beside every box edge (lo - 1, lo, hi, hi + 1 of the addresses), and random ones."""
    edges = {0, TOP}
    for r in policy.rules:
        for b in r.boxes:
            for d in (0, 1):
                for v in (b.lo[d] - 1, b.lo[d], b.hi[d], b.hi[d] + 1):
                    if 0 <= v <= TOP:
                        edges.add(v)
    edges = sorted(edges)
    out = []
    for _ in range(count):
        proto = rnd.choice([6, 17, 58, 59, 50, 0])
        out.append(
            Header(
                src=rnd.choice(edges) if rnd.random() < 0.8 else rnd.getrandbits(128),
                dst=rnd.choice(edges) if rnd.random() < 0.8 else rnd.getrandbits(128),
                proto=proto,
                dport=rnd.randrange(0, 2600) if proto in (6, 17) else 0,
                icmp_type=rnd.choice([1, 128, 135, 2]) if proto == 58 else 0,
                icmp_code=rnd.choice([0, 4, 3]) if proto == 58 else 0,
            )
        )
    return out


def complex_says(seed: int):
    """A stand-in for the complex checks' outcome that does not read the addresses (so both spaces agree)."""
    return lambda i, r, h: (i * 7 + h.dport + h.icmp_type + seed) % 3 == 0


@pytest.mark.parametrize("seed", range(6))
def test_ranks_are_exact_for_every_rule_and_every_frame(seed):
    rnd = random.Random(seed)
    raw = random_policy(rnd, 40)
    ranked, amap = compress(raw)
    assert ranked.family == 6 and ranked.addr_map is amap and ranked.original_rules == raw.original_rules
    for d in ("src", "dst"):
        s = amap.starts[d]
        assert s[0] == 0 and list(s) == sorted(set(s)) and amap.rank(d, 0) == 0 and amap.rank(d, TOP) == len(s) - 1
        assert len(s) < MAXV[0]
    for h in headers(rnd, raw, 400):
        rh = amap.header(h)
        for r, q in zip(raw.rules, ranked.rules, strict=True):
            assert any(b.contains(h) for b in r.boxes) == any(b.contains(rh) for b in q.boxes), (r.origin, h)
        ev = complex_says(seed)
        assert reference_verdict(raw, h, ev) == reference_verdict(ranked, rh, ev)


def test_an_unrestricted_address_stays_the_full_interval():
    raw = parse_policy("*filter\n:FORWARD DROP [0:0]\n-A FORWARD -s 2001:db8::/32 -j ACCEPT\nCOMMIT\n", family=6)
    ranked, amap = compress(raw)
    (b,) = ranked.rules[0].boxes
    assert (b.lo[0], b.hi[0]) == (1, 1) and (b.lo[1], b.hi[1]) == (0, MAXV[1])
    assert amap.interval("src", 1) == (0x20010DB8 << 96, (0x20010DB9 << 96) - 1)
    assert amap.interval("src", 2) == (0x20010DB9 << 96, TOP) and amap.ranks("dst") == 1


@pytest.mark.parametrize("mode", ["index", "selective", "exact"])
@pytest.mark.parametrize("seed", range(4))
def test_the_ranked_plan_decides_128_bit_frames_as_the_policy(mode, seed):
    """The plan of an IPv6 policy (built on ranks) on real 128-bit headers, addresses mapped by plan.addr_map: the
    entry it hits is the first rule whose 128-bit boxes hold the frame, and every frame it does not shunt gets the
    policy's verdict whatever the complex checks say."""
    rnd = random.Random(100 + seed)
    raw = random_policy(rnd, 30)
    plan = build_plan(raw, mode=mode)
    assert plan.family == 6 and plan.addr_map is not None and plan.policy.family == 6
    decided = 0
    for h in headers(rnd, raw, 300):
        rh = plan.addr_map.header(h)
        mi = match_index(plan, rh)
        first = next(
            (j for j, e in enumerate(plan.entries) if any(b.contains(h) for b in raw.rules[e.rule_index].boxes)),
            plan.n,
        )
        assert mi == first
        _, shunted, action = decision(plan, rh)
        if shunted:
            continue
        decided += 1
        for ev in (lambda i, r, h: True, lambda i, r, h: False, complex_says(seed)):
            assert action == ACTION_CODES[reference_verdict(raw, h, ev)], (h, mi)
    assert decided


def test_address_widths():
    assert ADDR_BITS == {4: 32, 6: 128} and ADDR_MAX[4] == MAXV[0]


def test_classbench_mapped_into_ipv6():
    text = "*filter\n:FORWARD ACCEPT [0:0]\n-A FORWARD -s 10.1.0.0/16 -d 192.168.1.7/32 -p udp -j ACCEPT\nCOMMIT\n"
    out = v6_policy_text(text)
    assert out == v6_policy_text(text)  # deterministic
    p = parse_policy(out, family=6)
    (b,) = p.rules[0].boxes
    lo, hi = b.interval("src")
    assert lo >> 96 == 0x20010DB8 and (lo >> 64) & 0xFFFFFFFF == 0x0A010000
    assert 48 <= 128 - (hi - lo).bit_length() <= 128


def _write(tmp_path, name: str, rules: str, chain: str = "FORWARD") -> str:
    f = tmp_path / name
    f.write_text(f"*filter\n:INPUT ACCEPT [0:0]\n:{chain} DROP [0:0]\n:OUTPUT ACCEPT [0:0]\n{rules}COMMIT\n")
    return str(f)


def test_lint_names_each_rules_family(tmp_path, capsys):
    v4 = _write(tmp_path, "v4.rules", "-A FORWARD -p tcp -j REJECT\n-A FORWARD -p udp -j ACCEPT\n")
    v6 = _write(
        tmp_path,
        "v6.rules",
        "-A FORWARD -p 44 -j DROP\n-A FORWARD -m frag --fragmore -j DROP\n-A FORWARD -p ipv6-icmp -j ACCEPT\n",
    )
    assert main(["lint", v4, "--ipv6", v6, "--no-kernel"]) == 0
    out = capsys.readouterr().out
    assert "v4.rules: chain FORWARD, policy DROP, family IPv4 (iptables)" in out
    assert "v6.rules: chain FORWARD, policy DROP, family IPv6 (ip6tables)" in out
    assert "v4.rules:5 [IPv4]: complex: target REJECT" in out
    assert "v6.rules:5 [IPv6]: -p ipv6-frag never matches" in out
    assert "v6.rules:6 [IPv6]: complex: match -m frag --fragmore (an extension-header match" in out
    assert main(["lint", "-6", v6, "--no-kernel", "-v"]) == 0
    out = capsys.readouterr().out
    assert "#2 [IPv6] simple  1 box(es) -> ACCEPT" in out and "[IPv4]" not in out
    assert main(["lint", v4, "--no-kernel"]) == 0
    assert "IPv" not in capsys.readouterr().out  # an IPv4 policy alone: lint's output as before


def test_lint_errors_on_ipv6_input_name_file_line_and_token(tmp_path, capsys):
    v6 = _write(tmp_path, "v6.rules", "-A FORWARD -s 2001:db8::/255.255.0.0 -j DROP\n")
    assert main(["lint", "-6", v6, "--no-kernel"]) != 0
    err = capsys.readouterr().err
    assert f"{v6}:5" in err and "2001:db8::/255.255.0.0" in err
    assert main(["lint", v6, "--no-kernel"]) != 0
    assert "an IPv6 address in an IPv4 policy" in capsys.readouterr().err


def test_compile_and_analyze_a_dual_stack(tmp_path, capsys):
    v4 = _write(
        tmp_path, "v4.rules", "-A FORWARD -p tcp -m string --string x --algo bm -j DROP\n-A FORWARD -j ACCEPT\n"
    )
    v6 = _write(tmp_path, "v6.rules", "-A FORWARD -s 2001:db8::/32 -m hl --hl-lt 2 -j DROP\n-A FORWARD -j ACCEPT\n")
    out = tmp_path / "out"
    assert main(["compile", v4, "--ipv6", v6, "-o", str(out)]) == 0
    m6 = json.loads((out / "ipv6" / "manifest.json").read_text())
    delta = Config().update_buffer  # the IPv4 entry, its policy entry, the update buffer, then the IPv6 entries
    assert m6["family"] == 6 and m6["dual_stack"] == {"index_base": 2 + delta, "k_base": 2}
    assert "netfilter/interval.ip6tables" in m6["files"] and (out / "netfilter" / "interval.iptables").exists()
    starts = json.loads((out / "ipv6" / "addr_map.json").read_text())
    assert starts["src"] == ["0x0", hex(0x20010DB8 << 96), hex(0x20010DB9 << 96)]
    assert "family" not in json.loads((out / "manifest.json").read_text())
    assert json.loads((out / "ipv6" / "partition.json").read_text())["address_ranks"] == {"src": 3, "dst": 1}
    assert "family" not in json.loads((out / "partition.json").read_text())
    capsys.readouterr()
    assert main(["analyze", "-6", v6, "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["family"] == 6 and res["address_ranks"] == {"src": 3, "dst": 1} and res["shunting_rules_selective"] == 1
    assert main(["analyze", v4, "--ipv6", v6, "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert "family" not in res and res["ipv6"]["family"] == 6


def test_lint_says_an_ipv6_sides_other_tables_are_loaded(tmp_path, capsys):
    """An IPv6 side's tables besides filter are deployed as they are (docs/ipv6.md), unlike an IPv4 policy's: lint
    says so for the IPv6 policy, and that the fast path then leaves every IPv6 frame to ip6tables."""
    nat = "*nat\n:PREROUTING ACCEPT [0:0]\n-A PREROUTING -p tcp --dport 8080 -j DNAT --to-destination {}\nCOMMIT\n"
    filt = "*filter\n:FORWARD DROP [0:0]\n-A FORWARD -p tcp --dport 80 -j ACCEPT\nCOMMIT\n"
    v4, v6 = tmp_path / "v4.rules", tmp_path / "v6.rules"
    v4.write_text(nat.format("10.0.0.2:80") + filt)
    v6.write_text(nat.format("[2001:db8::2]:80") + filt)
    assert main(["lint", str(v4), "--ipv6", str(v6), "--no-kernel"]) == 0
    out = capsys.readouterr().out
    assert "tables ignored (only filter is deployed): nat" in out.split("v6.rules")[0]
    six = out.split("v6.rules: chain FORWARD")[1]
    assert "tables besides filter (nat): loaded into ip6tables as they are" in six and "ignored" not in six
