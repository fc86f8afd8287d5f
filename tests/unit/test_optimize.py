"""`hypafilter optimize` without the kernel: the written chains, read back by the project's own parser and walked
by a small chain interpreter (jumps, gotos, RETURN, fall-through), give every header the original's verdict and
pass the same rules in the same order; the rules that may not move stay in place. The kernel-differential test
is tests/system/test_optimize.py."""

from __future__ import annotations

import random

import pytest
from hypafilter.errors import HypafilterError
from hypafilter.iptables.document import read_table
from hypafilter.iptables.rule import Verbatim
from hypafilter.ir import PROTO_ICMP, PROTO_TCP, PROTO_UDP, Header
from hypafilter.optimize.emit import NFT_MAX_DEPTH, _nesting, optimize
from hypafilter.optimize.tree import Params, movable, prefix_cut, region, region_any

TERMINAL = {"ACCEPT", "DROP", "REJECT"}
PORTS: set[int] = set()  # port range ends (and their neighbours) of the random policies: headers test them


def _matches(rule, h: Header) -> bool:
    if not any(b.contains(h) for b in rule.boxes):
        return False
    # The only complex check the generated chains add is the WHOLE_L4 guard (`-m u32 ! --u32 ...`), false for
    # every header here (a whole first fragment). The policies below have no other complex check.
    for m in rule.matches:
        if isinstance(m, Verbatim) and m.name == "u32":
            return False
    return True


def walk(chains, name: str, h: Header, seen: list, depth: int = 0) -> str | None:
    """The verdict of chain `name` for h (None: fell through or RETURN), appending the comment label (or the
    rule's chain:position) of every rule that matched, in order."""
    assert depth < 64
    for pos, r in enumerate(chains[name].rules, 1):
        if not _matches(r, h):
            continue
        label = next((m.text for m in r.matches if type(m).__name__ == "Comment"), None)
        if r.target in TERMINAL or r.target in ("", "LOG") or r.target == "RETURN":
            seen.append(label or f"{name}:{pos}")
        if r.target in TERMINAL:
            return r.target
        if r.target == "RETURN":
            return None
        if r.target in ("", "LOG"):
            continue
        v = walk(chains, r.target, h, seen, depth + 1)
        if r.goto or v is not None:
            return v
    return None


def verdict(text: str, h: Header) -> tuple[str, list]:
    tc = read_table(text, "<t>")
    seen: list = []
    v = walk(tc.chains, "FORWARD", h, seen)
    return (v or tc.chains["FORWARD"].policy or "ACCEPT"), seen


def _net(rng: random.Random) -> tuple[str, int, int]:
    plen = rng.choice((16, 20, 24, 24, 24, 28, 32))
    base = rng.choice((0x0A000000, 0xC0A80000, 0xAC100000)) | rng.getrandbits(16) << rng.choice((0, 8))
    base &= (0xFFFFFFFF << (32 - plen)) & 0xFFFFFFFF
    ip = ".".join(str(base >> s & 0xFF) for s in (24, 16, 8, 0))
    return f"{ip}/{plen}", base, base | ((1 << (32 - plen)) - 1)


def random_policy(rng: random.Random, n: int) -> tuple[str, list[tuple[int, int]]]:
    """An iptables-save text with n FORWARD rules of header checks (some negated, multiport, icmp, LOG, counters,
    a user chain with RETURN), and the address ranges it uses (for drawing headers)."""
    lines = ["*filter", ":FORWARD DROP [0:0]", ":SUB - [0:0]"]
    nets = []
    for i in range(n):
        opts = []
        narrow = True  # a rule that holds for most headers (no -s, or ! -s) is narrowed by -d, so that walks go far
        if rng.random() < 0.95:
            text, lo, hi = _net(rng)
            nets.append((lo, hi))
            negate = rng.random() < 0.03
            opts += (["!"] if negate else []) + ["-s", text]
            narrow = negate
        if narrow or rng.random() < 0.7:
            text, lo, hi = _net(rng)
            nets.append((lo, hi))
            opts += ["-d", text]
        p = rng.choice(("tcp", "udp", "udp", "icmp", None, "!icmp"))
        if p == "!icmp":  # every protocol but one: its boxes hold protocol 0, which `-p 0` cannot test
            opts += ["!", "-p", "icmp"]
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
            elif r < 0.7:
                a = rng.randrange(0, 2000)
                PORTS.update((a - 1, a, a + 1))
                opts += ["-m", p, "--sport", str(a)]
        elif p == "icmp":
            opts += ["-p", "icmp"] + (["--icmp-type", "8"] if rng.random() < 0.5 else [])
        r = rng.random()
        target = ["-j", "ACCEPT"] if r < 0.4 else ["-j", "DROP"] if r < 0.75 else ["-j", "LOG"] if r < 0.85 else []
        if r >= 0.97:
            target = ["-j", "SUB"]
        lines.append(" ".join(["-A", "FORWARD", *opts, *target]))
        if i == n // 2:
            lines.append("-A FORWARD -p udp -j RETURN")  # a rule that may not move: two segments
    lines += ["-A SUB -p tcp -j RETURN", "-A SUB -j ACCEPT", "COMMIT"]
    return "\n".join(lines) + "\n", nets


def random_header(rng: random.Random, nets) -> Header:
    def addr():
        if nets and rng.random() < 0.9:
            lo, hi = nets[rng.randrange(len(nets))]
            return rng.choice((lo, hi, rng.randint(lo, hi), max(lo - 1, 0), min(hi + 1, 0xFFFFFFFF)))
        return rng.getrandbits(32)

    def port():
        return rng.choice(sorted(PORTS)) if PORTS and rng.random() < 0.7 else rng.randrange(0, 2100)

    proto = rng.choice((PROTO_TCP, PROTO_UDP, PROTO_UDP, PROTO_ICMP, 47))
    ports = proto in (PROTO_TCP, PROTO_UDP)
    return Header(
        src=addr(),
        dst=addr(),
        proto=proto,
        sport=port() if ports else 0,
        dport=port() if ports else 0,
        icmp_type=rng.choice((0, 8)) if proto == PROTO_ICMP else 0,
    )


def corner_headers(rules, rng: random.Random) -> list[Header]:
    """Both corners of every box of every rule (addresses and ports at the ends of their ranges), and one past."""
    out = []
    for r in rules:
        for b in r.boxes:
            for end, step in ((b.lo, -1), (b.hi, 1)):
                proto = end[2] if b.lo[2] == b.hi[2] else rng.choice((PROTO_TCP, PROTO_UDP, 47))
                ports = proto in (PROTO_TCP, PROTO_UDP)
                for off in (0, step):
                    out.append(
                        Header(
                            src=min(max(end[0] + off, 0), 0xFFFFFFFF),
                            dst=min(max(end[1] + off, 0), 0xFFFFFFFF),
                            proto=proto,
                            sport=min(max(end[3] + off, 0), 0xFFFF) if ports else 0,
                            dport=min(max(end[4] + off, 0), 0xFFFF) if ports else 0,
                        )
                    )
    return out


@pytest.mark.parametrize("seed", range(3))
def test_every_header_gets_the_original_verdict_and_passes_the_same_rules(seed):
    rng = random.Random(seed)
    text, nets = random_policy(rng, 300)
    res = optimize(text, "random.rules", Params(binth=4), min_segment=8)
    assert res.segments and all(s.tree is not None for s in res.segments)
    assert res.expansion <= 4.0 + 1e-9
    tc = read_table(res.text, "<out>")
    assert any(n.startswith("ht-") for n in tc.chains)  # trees were written
    assert _nesting(tc.chains) <= NFT_MAX_DEPTH  # nf_tables loads it (gotos count against the nesting limit)
    orig_tc = read_table(text, "<in>")
    # rules kept in place: the k-th rule of FORWARD that is not a tree jump is the k-th rule that may not move
    kept_in = [f"FORWARD:{i}" for i, r in enumerate(orig_tc.chains["FORWARD"].rules, 1) if movable(r)]
    kept_out = [f"FORWARD:{i}" for i, r in enumerate(tc.chains["FORWARD"].rules, 1) if not r.target.startswith("ht-")]
    names = dict(zip(kept_out, kept_in, strict=True))
    names.update({f"SUB:{i}": f"SUB:{i}" for i in (1, 2)})
    decided_late = 0
    for h in corner_headers(orig_tc.chains["FORWARD"].rules, rng) + [random_header(rng, nets) for _ in range(600)]:
        s_in: list = []
        v_in = walk(orig_tc.chains, "FORWARD", h, s_in) or "DROP"
        s_out: list = []
        v_out = walk(tc.chains, "FORWARD", h, s_out) or "DROP"
        assert v_out == v_in, h
        # every rule the original walk matched is matched once in the optimised walk, in the same order
        assert [_orig_pos(x, names) for x in s_out] == s_in, h
        decided_late += any(int(x.split(":")[1]) > 150 for x in s_in if x.startswith("FORWARD:"))
    assert decided_late > 50  # the walks reach the second segment and the RETURN between them


def _orig_pos(label: str, names: dict) -> str:
    # "FORWARD rule 12 random.rules:5" -> "FORWARD:12"; a rule kept in place by its position in the output
    if " rule " in label:
        chain, rest = label.split(" rule ", 1)
        return f"{chain}:{rest.split()[0]}"
    return names[label]


def test_rules_that_may_not_move_stay_in_place():
    text = "\n".join(
        [
            "*filter",
            ":FORWARD ACCEPT [0:0]",
            ":X - [0:0]",
            *[f"-A FORWARD -s 10.0.{i}.0/24 -j DROP" for i in range(20)],
            "-A FORWARD -m limit --limit 5/s -j ACCEPT",
            "-A FORWARD -s 10.1.0.0/16 -g X",
            "-A FORWARD -p tcp -j RETURN",
            *[f"-A FORWARD -s 10.2.{i}.0/24 -j DROP" for i in range(20)],
            "-A X -j ACCEPT",
            "COMMIT",
        ]
    )
    res = optimize(text + "\n", "keep.rules", min_segment=8)
    assert res.kept == {"per-rule state": 1, "-g returns to the caller of its chain": 1, "RETURN leaves its chain": 1}
    assert len(res.segments) == 2
    out = read_table(res.text, "<out>").chains["FORWARD"].rules
    targets = [r.target for r in out]
    assert targets[0].startswith("ht-") and targets[-1].startswith("ht-")
    assert targets[1:4] == ["ACCEPT", "X", "RETURN"] and out[2].goto


def test_a_rule_that_can_drop_a_packet_by_itself_is_placed_by_its_addresses_only():
    tc = read_table(
        "*filter\n:FORWARD ACCEPT [0:0]\n"
        "-A FORWARD -s 10.0.0.0/8 -p tcp -m tcpmss --mss 1:500 -m tcp --dport 80 -j DROP\n"
        "-A FORWARD -s 10.0.0.0/8 -p tcp -m tcp --dport 80 -m conntrack --ctstate NEW -j DROP\nCOMMIT\n",
        "<t>",
    )
    loud, quiet = tc.chains["FORWARD"].rules
    # tcpmss drops a packet whose options it cannot read, whatever its port: the rule is everywhere in 10/8 TCP
    assert region(loud) == [((0x0A000000, 0, 6, 0, 0), (0x0AFFFFFF, 0xFFFFFFFF, 6, 0xFFFF, 0xFFFF))]
    assert region(quiet) == [((0x0A000000, 0, 6, 0, 80), (0x0AFFFFFF, 0xFFFFFFFF, 6, 0xFFFF, 80))]
    assert movable(loud) is None and movable(quiet) is None


def test_a_range_after_a_match_that_drops_a_truncated_header_does_not_narrow_where_truncated_frames_go():
    tc = read_table(
        "*filter\n:FORWARD ACCEPT [0:0]\n"
        "-A FORWARD -p udp -m udp -m iprange --src-range 192.168.9.78-192.168.14.112 -j ACCEPT\n"
        "-A FORWARD -p udp -m iprange --src-range 192.168.9.78-192.168.14.112 -m udp --dport 53 -j ACCEPT\nCOMMIT\n",
        "<t>",
    )
    after, before = tc.chains["FORWARD"].rules
    # udp (x_tables) drops a truncated header before iprange is looked at: for any frame the rule is all of UDP
    assert region_any(after) == [((0, 0, 17, 0, 0), (0xFFFFFFFF, 0xFFFFFFFF, 17, 0xFFFF, 0xFFFF))]
    assert region_any(before) == [((0xC0A8094E, 0, 17, 0, 0), (0xC0A80E70, 0xFFFFFFFF, 17, 0xFFFF, 0xFFFF))]
    # a whole frame: both ranges and the port hold
    assert region(after) == [((0xC0A8094E, 0, 17, 0, 0), (0xC0A80E70, 0xFFFFFFFF, 17, 0xFFFF, 0xFFFF))]
    assert region(before) == [((0xC0A8094E, 0, 17, 0, 53), (0xC0A80E70, 0xFFFFFFFF, 17, 0xFFFF, 53))]


def test_prefix_cuts():
    # in 10.0.0.0/8: a cut at 10.128.0.0 is one prefix test, one at 10.0.0.3 a prefix of the right side's block? no
    lo, hi = 0x0A000000, 0x0AFFFFFF
    assert list(prefix_cut([0x0A800000, 0x0A000004, 0x0A000003, 0x0AFFFFFF], lo, hi)) == [True, True, False, True]


def test_bad_input_names_the_file_and_line():
    with pytest.raises(HypafilterError, match=r"bad\.rules:3"):
        optimize("*filter\n:FORWARD ACCEPT [0:0]\n-A FORWARD -s 10.0.0.300 -j DROP\nCOMMIT\n", "bad.rules")


def test_other_tables_are_copied_and_a_plain_file_with_them_refused():
    text = "*nat\n:PREROUTING ACCEPT [0:0]\n-A PREROUTING -p tcp -j REDIRECT --to-ports 8080\nCOMMIT\n"
    text += "*filter\n:FORWARD ACCEPT [0:0]\n" + "".join(f"-A FORWARD -s 10.0.{i}.0/24 -j DROP\n" for i in range(30))
    res = optimize(text + "COMMIT\n", "two.rules")
    assert "*nat\n:PREROUTING ACCEPT [0:0]\n-A PREROUTING -p tcp -j REDIRECT --to-ports 8080\nCOMMIT" in res.text
    with pytest.raises(HypafilterError, match="iptables-save file"):
        optimize("iptables -t nat -A PREROUTING -j ACCEPT\niptables -A FORWARD -j DROP\n", "plain.sh")


def test_trees_fit_under_the_nesting_limit_or_are_left_out():
    chains = [":FORWARD ACCEPT [0:0]"] + [f":U{i} - [0:0]" for i in range(8)]
    rules = [f"-A FORWARD -s 10.0.{i}.0/24 -j DROP" for i in range(40)] + ["-A FORWARD -j U0"]
    rules += [f"-A U{i} -j U{i + 1}" for i in range(7)]
    deep = optimize("\n".join(["*filter", *chains, *rules, "COMMIT"]) + "\n", "deep.rules")
    assert not deep.segments and deep.rules_out == deep.rules_in
    assert deep.notes == [
        "no trees: the chains already nest 8 jumps deep, and a tree would pass nf_tables' limit of 15 nested chains"
    ]
    shallow = "\n".join(["*filter", *chains[:3], *rules[:41], "-A U0 -j U1", "COMMIT"]) + "\n"
    res = optimize(shallow, "shallow.rules", Params(binth=1))
    assert res.segments and _nesting(read_table(res.text, "<out>").chains) <= NFT_MAX_DEPTH
