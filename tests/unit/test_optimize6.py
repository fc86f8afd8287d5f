"""`hypafilter optimize -6` without the kernel: trees over an ip6tables policy cut the ranks of its 128-bit addresses
(analysis.dtree.RankSpace) and write them back as 128-bit prefixes or ranges. The output, read back by the IPv6 front
end and walked by test_optimize's chain interpreter, gives every header (the corners of every rule on 128-bit
addresses, just outside them, random ones) the original's verdict and passes the same rules in the same order. The
kernel-differential test is tests/system/test_optimize6.py."""

from __future__ import annotations

import random

import pytest
from hypafilter.analysis.dtree import TOP, WHOLE_L4_6, RankSpace, range_test, rank_regions
from hypafilter.iptables.canonical import ip6_str
from hypafilter.iptables.document import read_table
from hypafilter.ir import PROTO_TCP, PROTO_UDP, Header
from hypafilter.optimize.emit import optimize
from hypafilter.optimize.tree import SRC, Params, movable, regions

from tests.unit.test_optimize import _orig_pos, walk

TOP6 = (1 << 128) - 1
ICMP6 = 58
PORTS: set[int] = set()
BASES = (0x20010DB8 << 96, 0xFD48_4600 << 96, 0x2A02_1234_5600 << 80)


def _net(rng: random.Random) -> tuple[str, int, int]:
    plen = rng.choice((32, 40, 48, 48, 56, 64, 64, 96, 127, 128))
    base = rng.choice(BASES) | rng.getrandbits(64) << rng.choice((0, 32, 56))
    base &= (TOP6 << (128 - plen)) & TOP6
    return f"{ip6_str(base)}/{plen}", base, base | ((1 << (128 - plen)) - 1)


def random_policy6(rng: random.Random, n: int) -> tuple[str, list[tuple[int, int]]]:
    """An ip6tables-save text with n FORWARD rules of header checks over 128-bit prefixes and ranges (negations,
    ports, multiport, icmpv6 types, LOG, a user chain with RETURN, one RETURN in FORWARD: two runs)."""
    lines = ["*filter", ":INPUT ACCEPT [0:0]", ":FORWARD DROP [0:0]", ":OUTPUT ACCEPT [0:0]", ":SUB - [0:0]"]
    nets = []
    for i in range(n):
        opts = []
        narrow = True
        if rng.random() < 0.9:
            text, lo, hi = _net(rng)
            nets.append((lo, hi))
            negate = rng.random() < 0.03
            opts += (["!"] if negate else []) + ["-s", text]
            narrow = negate
        if narrow or rng.random() < 0.7:
            if rng.random() < 0.15:  # a range no prefix states
                _, lo, _ = _net(rng)
                hi = lo + rng.getrandbits(70)
                nets.append((lo, hi))
                opts += ["-m", "iprange", "--dst-range", f"{ip6_str(lo)}-{ip6_str(hi)}"]
            else:
                text, lo, hi = _net(rng)
                nets.append((lo, hi))
                opts += ["-d", text]
        p = rng.choice(("tcp", "udp", "udp", "icmpv6", None))
        if p in ("tcp", "udp"):
            opts += ["-p", p]
            r = rng.random()
            if r < 0.5:
                a = rng.randrange(0, 2000)
                b = a + rng.randrange(0, 50)
                PORTS.update((a - 1, a, b, b + 1))
                opts += ["-m", p, "--dport", f"{a}:{b}"]
            elif r < 0.6:
                opts += ["-m", "multiport", "--dports", ",".join(str(rng.randrange(0, 2000)) for _ in range(3))]
        elif p == "icmpv6":
            opts += ["-p", "ipv6-icmp"] + (["-m", "icmp6", "--icmpv6-type", "128"] if rng.random() < 0.5 else [])
        r = rng.random()
        target = ["-j", "ACCEPT"] if r < 0.4 else ["-j", "DROP"] if r < 0.75 else ["-j", "LOG"] if r < 0.85 else []
        if r >= 0.97:
            target = ["-j", "SUB"]
        lines.append(" ".join(["-A", "FORWARD", *opts, *target]))
        if i == n // 2:
            lines.append("-A FORWARD -p udp -j RETURN")
    lines += ["-A SUB -p tcp -j RETURN", "-A SUB -j ACCEPT", "COMMIT"]
    return "\n".join(lines) + "\n", nets


def random_header6(rng: random.Random, nets) -> Header:
    def addr():
        if nets and rng.random() < 0.9:
            lo, hi = nets[rng.randrange(len(nets))]
            return rng.choice((lo, hi, rng.randint(lo, hi), max(lo - 1, 0), min(hi + 1, TOP6)))
        return rng.getrandbits(128)

    def port():
        return rng.choice(sorted(PORTS)) if PORTS and rng.random() < 0.7 else rng.randrange(0, 2100)

    proto = rng.choice((PROTO_TCP, PROTO_UDP, PROTO_UDP, ICMP6, 47))
    ports = proto in (PROTO_TCP, PROTO_UDP)
    return Header(
        src=addr(),
        dst=addr(),
        proto=proto,
        sport=port() if ports else 0,
        dport=port() if ports else 0,
        icmp_type=rng.choice((128, 129, 1)) if proto == ICMP6 else 0,
    )


def corner_headers6(rules, rng: random.Random) -> list[Header]:
    """Both corners of every box of every rule (128-bit addresses and ports at the ends of their ranges), one past."""
    out = []
    for r in rules:
        for b in r.boxes:
            for end, step in ((b.lo, -1), (b.hi, 1)):
                proto = end[2] if b.lo[2] == b.hi[2] else rng.choice((PROTO_TCP, PROTO_UDP, 47))
                ports = proto in (PROTO_TCP, PROTO_UDP)
                for off in (0, step):
                    out.append(
                        Header(
                            src=min(max(end[0] + off, 0), TOP6),
                            dst=min(max(end[1] + off, 0), TOP6),
                            proto=proto,
                            sport=min(max(end[3] + off, 0), 0xFFFF) if ports else 0,
                            dport=min(max(end[4] + off, 0), 0xFFFF) if ports else 0,
                            icmp_type=128 if proto == ICMP6 else 0,
                        )
                    )
    return out


def _compare(text: str, out_text: str, rng: random.Random, nets, n_random: int = 500) -> int:
    """Headers whose verdict or passed rules differ between the policy and its rewrite (both walked)."""
    orig = read_table(text, "<in>", family=6)
    opt = read_table(out_text, "<out>", family=6)
    kept_in = [f"FORWARD:{i}" for i, r in enumerate(orig.chains["FORWARD"].rules, 1) if movable(r)]
    kept_out = [f"FORWARD:{i}" for i, r in enumerate(opt.chains["FORWARD"].rules, 1) if not r.target.startswith("ht-")]
    names = dict(zip(kept_out, kept_in, strict=True))
    names.update({f"SUB:{i}": f"SUB:{i}" for i in (1, 2)})
    bad = 0
    hs = corner_headers6(orig.chains["FORWARD"].rules, rng) + [random_header6(rng, nets) for _ in range(n_random)]
    for h in hs:
        s_in: list = []
        v_in = walk(orig.chains, "FORWARD", h, s_in) or "DROP"
        s_out: list = []
        v_out = walk(opt.chains, "FORWARD", h, s_out) or "DROP"
        bad += v_out != v_in or [_orig_pos(x, names) for x in s_out] != s_in
    return bad


@pytest.mark.parametrize("seed", range(2))
def test_every_ipv6_header_gets_the_original_verdict_and_passes_the_same_rules(seed):
    rng = random.Random(seed)
    text, nets = random_policy6(rng, 240)
    res = optimize(text, "random.rules6", Params(binth=4), min_segment=8, family=6)
    assert res.family == 6 and len(res.segments) == 2 and all(s.tree is not None for s in res.segments)
    assert all(isinstance(s.space, RankSpace) for s in res.segments)
    assert res.expansion <= 4.0 + 1e-9
    out = read_table(res.text, "<out>", family=6)  # the IPv6 front end reads it back: 128-bit addresses only
    tree_rules = [r for n, c in out.chains.items() if n.startswith("ht-") for r in c.rules]
    assert any(r.src is not None or r.dst is not None for r in tree_rules)  # address cuts were written
    assert _compare(text, res.text, rng, nets) == 0


def test_a_leaf_missing_a_rule_is_caught():
    rng = random.Random(7)
    text, nets = random_policy6(rng, 120)
    res = optimize(text, "random.rules6", Params(binth=4), min_segment=8, family=6)
    lines = res.text.splitlines()
    # the copies of one ACCEPT/DROP rule left out of the leaves (each of 8 rules in turn): a rule whose every header
    # an earlier rule takes changes nothing, the others must show on their corners
    labels = sorted({ln.split('--comment "', 1)[1].split('"')[0] for ln in lines if ln.startswith("-A ht-") and
                     " rule " in ln and ("-j DROP" in ln or "-j ACCEPT" in ln)})  # fmt: skip
    caught = 0
    for lab in labels[:: max(1, len(labels) // 8)][:8]:
        broken = "\n".join(ln for ln in lines if not (ln.startswith("-A ht-") and f'"{lab}"' in ln)) + "\n"
        caught += _compare(text, broken, random.Random(8), nets, n_random=100) > 0
    assert caught >= 4, caught


def test_ranked_regions_and_the_tests_written_back():
    # two rules: a /48 and an arbitrary range; the full interval stays TOP, every bound is a rank bound
    a = (0x20010DB8 << 96) | (0x1 << 80)
    rules = [
        ([((a, 0, 17, 0, 0), (a + (1 << 80) - 1, TOP6, 17, 0xFFFF, 0xFFFF))],) * 2,
        ([((a + 5, 0, 0, 0, 0), (a + (1 << 90), TOP6, 255, 0xFFFF, 0xFFFF))],) * 2,
    ]
    ranked, sp = rank_regions(rules)
    assert sp.starts[SRC] == (0, a, a + 5, a + (1 << 80), a + (1 << 90) + 1)
    (lo, hi), (lo2, hi2) = ranked[0][0][0], ranked[1][0][0]
    assert (lo[SRC], hi[SRC]) == (1, 2) and (lo2[SRC], hi2[SRC]) == (2, 3)
    assert hi[1] == int(TOP[1])  # an unrestricted destination stays the full interval
    assert sp.span(SRC, 1, 2) == (a, a + (1 << 80) - 1)
    assert sp.span(SRC, 4, int(TOP[SRC])) == (a + (1 << 90) + 1, TOP6)
    # a cut at rank 3 (address a + 2**80 = 2001:db8:2::) in the region of ranks 1..4 (from a = 2001:db8:1::): the
    # aligned /47 ending at the cut holds the left part within the region
    left, toks = range_test(SRC, 1, 4, 3, None, sp)
    assert toks == ("-s", "2001:db8::/47") and left
    # a cut at rank 2 (a + 5) in ranks 0..4 is no prefix: an iprange of 128-bit addresses
    left, toks = range_test(SRC, 0, 4, 2, None, sp)
    assert toks == ("-m", "iprange", "--src-range", f"::-{ip6_str(a + 4)}") and left
    assert sp.is_prefix_cut(SRC, 1, 4, 3) and not sp.is_prefix_cut(SRC, 0, 4, 2)
    assert 3 in sp.prefix_cuts(SRC, 1, 4)


def test_the_ipv6_rewrite_guards_port_cuts_and_names_icmpv6():
    lines = ["*filter", ":INPUT ACCEPT [0:0]", ":FORWARD DROP [0:0]", ":OUTPUT ACCEPT [0:0]"]
    for i in range(24):
        lines.append(f"-A FORWARD -d 2001:db8::/64 -p tcp -m tcp --dport {1000 + 10 * i} -j ACCEPT")
    for i in range(8):
        lines.append(f"-A FORWARD -s 2001:db8:{i}::/48 -p ipv6-icmp -m icmp6 --icmpv6-type 128 -j ACCEPT")
    lines.append("-A FORWARD -m hl --hl-eq 1 -j DROP")  # complex, moves
    lines.append("-A FORWARD -m limit --limit 1/s -j LOG")  # per-rule state: stays in place
    lines.append("COMMIT")
    text = "\n".join(lines) + "\n"
    res = optimize(text, "p.rules6", Params(binth=2), min_segment=4, family=6)
    assert res.kept == {"per-rule state": 1}
    assert f'-m u32 ! --u32 "{WHOLE_L4_6[PROTO_TCP]}" -g ht-' in res.text  # the IPv6 guard before a port cut
    assert "--dport" in res.text.split("-A ht-", 1)[1]
    assert "-p ipv6-icmp -g ht-" in res.text or "-p ipv6-icmp -j RETURN" in res.text
    assert "0.0.0.0" not in res.text and "-s 0." not in res.text
    assert "-A FORWARD -m limit --limit 1/s" in res.text
    out = read_table(res.text, "<out>", family=6)
    assert out.chains["FORWARD"].rules[0].target.startswith("ht-")
    regs = [regions(r, 6) for r in read_table(text, "<in>", family=6).chains["FORWARD"].rules[:2]]
    assert regs[0][1][0][0][1] == 0x20010DB8 << 96  # 128-bit before ranking
