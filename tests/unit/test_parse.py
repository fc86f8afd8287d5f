"""Parser: file formats, modelled matches and their boxes, negations, complex rules, error positions, rulesets/."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
from hypafilter.analysis.hybrid import first_rule_match
from hypafilter.config import Config
from hypafilter.errors import PolicyError
from hypafilter.iptables.canonical import rule_tokens
from hypafilter.iptables.document import parse_policy
from hypafilter.iptables.parser import parse_rule
from hypafilter.iptables.tokens import SHELL, tokenize
from hypafilter.iptables.writer import tokens_text
from hypafilter.ir import Header

ROOT = Path(__file__).resolve().parents[2]


def ip(s: str) -> int:
    a, b, c, d = (int(x) for x in s.split("."))
    return (a << 24) | (b << 16) | (c << 8) | d


def one(text: str, **kw):
    (r,) = parse_rule(text, **kw)
    return r


def hit(r, **h) -> bool:
    return any(b.contains(Header(**h)) for b in r.boxes)


def canon(text: str) -> str:
    return tokens_text(rule_tokens(one(text)))


def test_tokenize_quotes_and_columns():
    line = '-m comment --comment "a \\"b\\" c" -j ACCEPT # tail'
    toks = tokenize(line, mode=SHELL)
    assert [t.text for t in toks] == ["-m", "comment", "--comment", 'a "b" c', "-j", "ACCEPT"]
    assert [t.col for t in toks] == [1, 4, 12, 22, 34, 37]
    # iptables-restore has no trailing comments: `#` and `tail` are arguments (and then refused).
    assert [t.text for t in tokenize(line)][-2:] == ["#", "tail"]


# Each line as iptables-restore 1.8.9 splits it (checked with iptables-restore + iptables-save in a namespace)
# and as a POSIX shell splits it (the plain rule file's reader); None where the shell reader refuses the line.
TOKEN_CASES = [
    ("'q'", ["'q'"], ["q"]),
    ("it's", ["it's"], None),
    ("'it'\\''s'", ["'it'\\''s'"], ["it's"]),
    ('"it\'s"', ["it's"], ["it's"]),
    ("a\\b", ["a\\b"], ["ab"]),
    ('"a\\\'b\\\\c\\"d\\xe"', ["a'b\\c\"dxe"], ["a\\'b\\c\"d\\xe"]),
    ('"\\$"', ["$"], ["$"]),
    ('""', [""], [""]),
    ("''", ["''"], [""]),
    ("x#y", ["x#y"], ["x#y"]),
    ("-j ACCEPT # tail", ["-j", "ACCEPT", "#", "tail"], ["-j", "ACCEPT"]),
    ("-j ACCEPT #tail", ["-j", "ACCEPT", "#tail"], ["-j", "ACCEPT"]),
    ("\\#", ["\\#"], ["#"]),
    ('"ab"cd', ["ab", "cd"], ["abcd"]),  # iptables-restore: the closing quote ends the token
    ('a"b c"d', ["ab c", "d"], ["ab cd"]),
    ("a\\ b", ["a\\", "b"], ["a b"]),
    ('"a\tb"', ["a\tb"], ["a\tb"]),
    ("a\tb\x0bc", ["a", "b\x0bc"], ["a", "b\x0bc"]),  # only space and tab separate
    ("ACCEPT\r", ["ACCEPT\r"], ["ACCEPT\r"]),
    ("'a;b|c$d*'", ["'a;b|c$d*'"], ["a;b|c$d*"]),
]


@pytest.mark.parametrize("line, restore, shell", TOKEN_CASES)
def test_tokenize_modes(line, restore, shell):
    assert [t.text for t in tokenize(line)] == restore
    if shell is None:
        with pytest.raises(PolicyError):
            tokenize(line, mode=SHELL)
    else:
        assert [t.text for t in tokenize(line, mode=SHELL)] == shell


@pytest.mark.parametrize(
    "line, col, msg",
    [
        ("-j ACCEPT; echo", 10, "shell syntax ';'"),
        ("--comment $HOME", 11, "shell syntax '$'"),
        ('--comment "$HOME"', 12, "shell expansion '$'"),
        ("--comment `id`", 11, "shell syntax '`'"),
        ("--comment a*", 12, "glob"),
        ("--comment 'abc", 11, "unterminated single quote"),
        ('--comment "abc', 11, "unterminated double quote"),
        ("-j ACCEPT \\", 11, "trailing backslash"),
    ],
)
def test_tokenize_shell_refusals(line, col, msg):
    with pytest.raises(PolicyError, match=re.escape(msg)) as e:
        tokenize(line, 3, "x.rules", SHELL)
    assert (e.value.file, e.value.line, e.value.column) == ("x.rules", 3, col)


def test_tokenize_restore_refuses_an_unterminated_quote():
    # iptables-restore would take the line break and the rest of the line into the token.
    with pytest.raises(PolicyError, match="unterminated double quote") as e:
        tokenize('-m comment --comment "abc -j ACCEPT', 2, "s.save")
    assert (e.value.line, e.value.column) == (2, 22)


def test_tokenize_columns_after_quotes():
    assert [t.col for t in tokenize('"ab"cd  x')] == [1, 5, 9]
    assert [(t.text, t.quoted) for t in tokenize('a "b" c')] == [("a", False), ("b", True), ("c", False)]


def test_unterminated_quote():
    with pytest.raises(PolicyError) as e:
        parse_policy('-m string --string "abc -j DROP\n', filename="q.rules")
    assert (e.value.line, e.value.column) == (1, 20)


@pytest.mark.parametrize(
    "text, want",
    [
        ("-s 10.11.12.13/8", "-s 10.0.0.0/8"),
        ("-p 6 --dport 22", "-p tcp -m tcp --dport 22"),
        ("--protocol=udp --sport=53:", "-p udp -m udp --sport 53:65535"),
        ("-ptcp -s1.2.3.4 -jACCEPT", "-s 1.2.3.4/32 -p tcp -j ACCEPT"),
        ("-p tcp --syn", "-p tcp -m tcp --tcp-flags FIN,SYN,RST,ACK SYN"),
        ("-p tcp ! --dport 80", "-p tcp -m tcp ! --dport 80"),
        ("-m comment --comment !", "-m comment --comment !"),  # no intrapositioned ! in 1.8.9: a value
        ('"-p" tcp "!" "--dport" 80 "-j" ACCEPT', "-p tcp -m tcp ! --dport 80 -j ACCEPT"),  # argv ignores quotes
        (
            "-p tcp -m multiport --dports 80 -m multiport --sports 22",
            "-p tcp -m multiport --dports 80 -m multiport --sports 22",
        ),
        ("-p tcp -m tcp --dport 80 -m tcp --dport 22", "-p tcp -m tcp --dport 80 -m tcp --dport 22"),
        ("-p tcp --dport 80 -m tcp --sport 22", "-p tcp -m tcp --dport 80 -m tcp --sport 22"),
        ("-p tcp -m tcp -m tcp --sport 22", "-p tcp -m tcp -m tcp --sport 22"),
        ("-m comment --comment a -m comment --comment b", "-m comment --comment a -m comment --comment b"),
        ("-p tcp -m comment --comment 'a b' --dport 80", '-p tcp -m comment --comment "a b" -m tcp --dport 80'),
        ("-p icmp --icmp-type echo-request", "-p icmp -m icmp --icmp-type 8"),
        ("-p icmp --icmp-type port-unreachable", "-p icmp -m icmp --icmp-type 3/3"),
        ("-m iprange --src-range 1.1.1.1", "-m iprange --src-range 1.1.1.1-1.1.1.1"),
        ("-p udp -m multiport --dports 53,1024:65535", "-p udp -m multiport --dports 53,1024:65535"),
        (
            "-s 1.2.3.4 -p tcp -m string --string x --algo bm --dport 80",
            "-s 1.2.3.4/32 -p tcp -m string --string x --algo bm -m tcp --dport 80",
        ),
        ("-i + -o eth1 -j LOG --log-prefix 'x y'", '-o eth1 -j LOG --log-prefix "x y"'),
    ],
)
def test_canonical_forms(text, want):
    assert canon(text) == want


def test_addresses_and_negation():
    r = one("! -s 10.0.0.0/8 -d 192.168.1.0/255.255.255.0")
    assert not r.complex and len(r.boxes) == 2
    assert hit(r, src=ip("11.0.0.1"), dst=ip("192.168.1.7"))
    assert not hit(r, src=ip("10.9.0.1"), dst=ip("192.168.1.7"))
    assert not hit(r, src=ip("11.0.0.1"), dst=ip("192.168.2.7"))


def test_noncontiguous_mask_is_complex():
    r = one("-s 10.0.12.0/255.0.255.0 -j ACCEPT")
    assert r.complex == (("-s", "10.0.12.0/255.0.255.0"),) or r.complex == [("-s", "10.0.12.0/255.0.255.0")]


def test_multiple_addresses_expand():
    rs = parse_rule("-s 10.0.0.1,10.0.0.2 -d 1.1.1.1 -j DROP")
    assert [tokens_text(rule_tokens(r)) for r in rs] == [
        "-s 10.0.0.1/32 -d 1.1.1.1/32 -j DROP",
        "-s 10.0.0.2/32 -d 1.1.1.1/32 -j DROP",
    ]


def test_ports_and_negated_ports():
    r = one("-p tcp ! --dport 1000:2000 --sport 5")
    assert hit(r, proto=6, sport=5, dport=999) and hit(r, proto=6, sport=5, dport=2001)
    assert not hit(r, proto=6, sport=5, dport=1500)
    assert not hit(r, proto=17, sport=5, dport=999)
    assert not hit(r, proto=6, sport=6, dport=999)


def test_multiport_ports_is_src_or_dst():
    r = one("-p udp -m multiport --ports 53,100:110")
    assert hit(r, proto=17, sport=53, dport=9) and hit(r, proto=17, sport=9, dport=105)
    assert not hit(r, proto=17, sport=9, dport=9)
    n = one("-p udp -m multiport ! --ports 53,100:110")
    assert n.boxes and hit(n, proto=17, sport=9, dport=9)
    assert not hit(n, proto=17, sport=53, dport=9) and not hit(n, proto=17, sport=9, dport=100)


def test_multiport_on_sctp_is_complex():
    r = one("-p sctp -m multiport --dports 1,2 -j ACCEPT")
    assert r.complex and hit(r, proto=132) and not hit(r, proto=6)


def test_tcp_flags_and_negation():
    r = one("-p tcp --tcp-flags SYN,ACK SYN")
    assert hit(r, proto=6, tcp_flags=0x02) and hit(r, proto=6, tcp_flags=0x03)
    assert not hit(r, proto=6, tcp_flags=0x12)
    n = one("-p tcp ! --syn")
    for f in range(64):
        assert hit(n, proto=6, tcp_flags=f) == ((f & 0x17) != 0x02)
    impossible = one("-p tcp --tcp-flags SYN SYN,ACK")
    assert impossible.boxes == []


def test_icmp_types():
    r = one("-p icmp --icmp-type destination-unreachable")
    assert hit(r, proto=1, icmp_type=3, icmp_code=9) and not hit(r, proto=1, icmp_type=8)
    r = one("-p icmp ! --icmp-type 3/1")
    assert hit(r, proto=1, icmp_type=3, icmp_code=0) and hit(r, proto=1, icmp_type=8)
    assert not hit(r, proto=1, icmp_type=3, icmp_code=1)
    assert hit(one("-p icmp --icmp-type any"), proto=1, icmp_type=42)
    assert one("-p icmp ! --icmp-type any").boxes == []


def test_iprange_negated():
    r = one("-m iprange ! --dst-range 10.0.0.5-10.0.0.9")
    assert hit(r, dst=ip("10.0.0.4")) and hit(r, dst=ip("10.0.0.10")) and not hit(r, dst=ip("10.0.0.7"))


def test_interfaces_mapped_and_unmapped():
    """Without a bridge in the configuration only `--physdev-in` of a mapped port is resolved (docs/configuration.md);
    every -i/-o stays a check for software, a port's name included (tests/unit/test_interfaces.py: bridge mode)."""
    cfg = Config(hw_ports={"nf0": 0, "nf1": 2})
    assert one("-i nf1 -p udp -j ACCEPT", config=cfg).complex == [("-i", "nf1")]
    assert one("-p udp ! -i nf1 -j ACCEPT", config=cfg).complex == [("!", "-i", "nf1")]
    assert one("-i eth0 -j ACCEPT", config=cfg).complex == [("-i", "eth0")]
    assert one("-i br0 -p udp -j ACCEPT", config=cfg).complex == [("-i", "br0")]
    assert one("-i nf+ -j ACCEPT", config=cfg).complex == [("-i", "nf+")]
    assert one("-o nf0 -j ACCEPT", config=cfg).complex == [("-o", "nf0")]
    r = one("-m physdev --physdev-in nf0 -j ACCEPT", config=cfg)
    assert not r.complex and hit(r, iport=0) and not hit(r, iport=1)
    r = one("-m physdev ! --physdev-in nf1 -j ACCEPT", config=cfg)
    assert not r.complex and len(r.boxes) == 2 and not hit(r, iport=2) and all(hit(r, iport=p) for p in (0, 1, 3))
    for text in ("--physdev-out nf1", "--physdev-in nf+", "--physdev-is-bridged", "--physdev-in eth0"):
        assert one(f"-m physdev {text} -j ACCEPT", config=cfg).complex == [("-m", "physdev", *text.split())], text


def test_complex_matches_and_fragments_kept():
    r = one('-p udp -m string --string "SELECT" --algo bm -f -j DROP')
    assert ("-m", "string", "--string", "SELECT", "--algo", "bm") in r.complex
    assert ("-f",) in r.complex
    assert hit(r, proto=17) and not hit(r, proto=6)


def test_comment_is_not_a_check():
    r = one("-p tcp --dport 22 -m comment --comment ssh -j ACCEPT")
    assert not r.complex


@pytest.mark.parametrize(
    "text, col, token, msg",
    [
        ("-p tcp --dport 4:3", 16, "4:3", "min > max"),
        ("-p tcp --dport 65536", 16, "65536", "out of range"),
        ("-s www.example.com", 4, "www.example.com", "host names"),
        ("-s 10.0.0.0/33", 4, "10.0.0.0/33", "prefix"),
        ("-p foo", 4, "foo", "unknown protocol"),
        ("--dport 80", 1, "--dport", "unknown option"),
        ("-m tcp --dport 80", 4, "tcp", "needs -p tcp"),
        ("-p udp -m tcp --dport 80", 11, "tcp", "needs -p tcp"),
        ("-p tcp -s 1.1.1.1 -s 2.2.2.2", 19, "-s", "multiple -s"),
        ("-p tcp --dport 1 --dport 2", 18, "--dport", "only one"),
        ("-j", 1, "-j", "needs an argument"),
        ("-j FOO", 4, "FOO", "unknown target"),
        ("! -p all", 6, "all", "never match"),
        ("! ! -s 1.1.1.1", 3, "!", "multiple !"),
        ("! -j ACCEPT", 1, "!", "cannot have !"),
        ("-m multiport", 4, "multiport", "needs --sports"),
        ("-p tcp -m multiport --dports 1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16", 30, None, "too many"),
        ("-m comment", 4, "comment", "needs --comment"),
        ("-p icmp --icmp-type bogus", 21, "bogus", "ICMP type"),
        ("-p tcp --tcp-flags SYN,BOGUS SYN", 20, "SYN,BOGUS", "TCP flag"),
        ("-i thisinterfaceistoolong0", 4, "thisinterfaceistoolong0", "longer"),
        ("-g ACCEPT", 4, "ACCEPT", "user-defined chain"),
        # Repeated options that iptables-nft 1.8.9 refuses (each checked with iptables-restore).
        ("-p tcp -m multiport --dports 80 --dports 22", 33, "--dports", "only one --dports"),
        ("-p tcp -m multiport --dports 80 --sports 22", 33, "--sports", "only one of"),
        ("-p tcp -m tcp --sport 1 --sport 2", 25, "--sport", "only one --sport"),
        ("-p udp --dport 1 --dport 2", 18, "--dport", "only one --dport"),
        ("-p tcp --syn --tcp-flags SYN SYN", 14, "--tcp-flags", "only one --tcp-flags"),
        ("-p icmp --icmp-type 8 --icmp-type 0", 23, "--icmp-type", "only one"),
        ("-m comment --comment a --comment b", 24, "--comment", "only one"),
        ("-m iprange --src-range 1.1.1.1 --src-range 1.1.1.2", 32, "--src-range", "only one"),
        ("-j ACCEPT -j DROP", 11, "-j", "multiple -j"),
        ("-p tcp -p udp", 8, "-p", "multiple -p"),
        # iptables 1.8.9 has no intrapositioned `!`: it is the option's value.
        ("-p tcp --dport ! 80", 16, "!", "bad port"),
        ("-s ! 1.2.3.4", 4, "!", "bad IPv4"),
        ("-p icmp --icmp-type ! 8", 21, "!", "ICMP type"),
        ("-f ! -j ACCEPT", 4, "!", "cannot have !"),
    ],
)
def test_errors_name_position_and_token(text, col, token, msg):
    with pytest.raises(PolicyError) as e:
        parse_policy(text + "\n", filename="bad.rules")
    err = e.value
    assert msg in err.message
    assert (err.file, err.line, err.column) == ("bad.rules", 1, col)
    if token is not None:
        assert err.token == token
    assert str(err).startswith(f"bad.rules:1:{col}: ")


def test_plain_file_features():
    text = """
# a comment
iptables -P FORWARD DROP
-N WEB
-A WEB -p tcp --dport 80 -j ACCEPT
-p tcp -j WEB
iptables -A FORWARD -p udp -j ACCEPT
iptables -t nat -A POSTROUTING -j MASQUERADE
-I FORWARD -s 10.9.9.9 -j DROP
"""
    p = parse_policy(text, filename="p.rules")
    assert p.default == "DROP"
    assert p.original_rules == [
        ("-s", "10.9.9.9/32", "-j", "DROP"),
        ("-p", "tcp", "-j", "WEB"),
        ("-p", "udp", "-j", "ACCEPT"),
    ]
    assert [r.target for r in p.rules] == ["DROP", "ACCEPT", "ACCEPT"]
    assert p.rules[1].origin.line == 5 and p.rules[1].origin.chain == "WEB"


def test_plain_file_errors():
    with pytest.raises(PolicyError, match="no such chain"):
        parse_policy("-A NOPE -j ACCEPT\n")
    with pytest.raises(PolicyError, match="user-defined chain cannot have a policy"):
        parse_policy("-N X\n-P X DROP\n")
    with pytest.raises(PolicyError, match="not supported"):
        parse_policy("-F FORWARD\n")


def test_save_file_errors():
    with pytest.raises(PolicyError, match="COMMIT"):
        parse_policy("*filter\n:FORWARD DROP [0:0]\n-A FORWARD -j ACCEPT\n")
    with pytest.raises(PolicyError, match="cannot have a policy") as e:
        parse_policy("*filter\n:X DROP [0:0]\nCOMMIT\n")
    assert e.value.line == 2 and e.value.token == "DROP"
    with pytest.raises(PolicyError, match="outside a table"):
        parse_policy("*filter\nCOMMIT\n-A FORWARD -j ACCEPT\n")


def test_other_tables_ignored():
    text = "*nat\n:POSTROUTING ACCEPT [0:0]\n-A POSTROUTING -o eth0 -j MASQUERADE\nCOMMIT\n*filter\n:FORWARD DROP [0:0]\n-A FORWARD -p tcp -j ACCEPT\nCOMMIT\n"
    p = parse_policy(text)
    assert p.default == "DROP" and len(p.rules) == 1


def test_counters_prefix_and_set_counters():
    p = parse_policy("*filter\n:FORWARD ACCEPT [5:100]\n[3:4] -A FORWARD -c 1,2 -p udp -j DROP\nCOMMIT\n")
    assert p.original_rules == [("-p", "udp", "-j", "DROP")]


def test_rule_without_target_stays_in_flat_list_as_observer():
    """A counting rule decides nothing but counts what it matches: it stays, complex (netfilter must see its
    packets), with no target."""
    p = parse_policy("-p tcp\n-p udp -j DROP\n")
    assert p.original_rules[0] == ("-p", "tcp") and [r.target for r in p.rules] == ["", "DROP"]
    assert not p.rules[0].is_simple and p.rules[1].is_simple


@pytest.mark.parametrize("name", ["example", "listing1", "userchains", "conntrack"])
def test_rulesets_parse(name):
    path = ROOT / "rulesets" / f"{name}.rules"
    p = parse_policy(path.read_text(), filename=str(path))
    assert p.rules and p.complex_indices and p.simple_indices


def test_listing1_partition():
    p = parse_policy((ROOT / "rulesets/listing1.rules").read_text())
    assert [r.is_simple for r in p.rules] == [True, True, False, True, False, True]
    assert p.default == "ACCEPT"


def test_example_has_both_verdicts_for_demo_hosts():
    p = parse_policy((ROOT / "rulesets/example.rules").read_text())
    hosts = [
        Header(src=ip("10.0.1.1"), dst=ip("10.0.2.1"), proto=proto, dport=dport, icmp_type=8 if proto == 1 else 0)
        for proto, dport in ((17, 53), (17, 9999), (6, 80), (6, 23), (6, 8080), (17, 123), (17, 40000), (1, 0))
    ]
    first = first_rule_match(p, p.simple_indices, np.array([h.values() for h in hosts]))
    assert {p.rules[i].target for i in first if i < len(p.rules)} == {"ACCEPT", "DROP"}


def test_repeated_matches_are_all_checked():
    """Every -m loads a new instance and the kernel checks each (nft: `tcp dport 80 tcp dport 22`)."""
    never = one("-p tcp -m tcp --dport 80 -m tcp --dport 22")
    assert not any(hit(never, proto=6, dport=p) for p in (22, 80))
    r = one("-p tcp -m tcp --dport 80 -m tcp ! --dport 22")
    assert hit(r, proto=6, dport=80) and not hit(r, proto=6, dport=22) and not hit(r, proto=6, dport=23)
    r = one("-p tcp -m multiport --dports 80,443 -m multiport --sports 22")
    assert hit(r, proto=6, sport=22, dport=443) and not hit(r, proto=6, sport=23, dport=443)
    assert not one("-p icmp -m icmp --icmp-type 8 -m icmp --icmp-type 0").boxes
    r = one("-m iprange --src-range 1.0.0.0-1.0.0.9 -m iprange --src-range 1.0.0.5-1.0.0.20")
    assert hit(r, src=ip("1.0.0.7")) and not hit(r, src=ip("1.0.0.2")) and not hit(r, src=ip("1.0.0.12"))


def test_save_file_is_read_as_iptables_restore_reads_it():
    def comment(line: str) -> str:
        p = parse_policy(f"*filter\n:FORWARD ACCEPT [0:0]\n-A FORWARD {line}\nCOMMIT\n")
        (toks,) = p.original_rules
        return toks[toks.index("--comment") + 1]

    assert comment("-m comment --comment 'q' -j ACCEPT") == "'q'"
    assert comment('-m comment --comment "it\\\'s" -j ACCEPT') == "it's"
    assert comment("-m comment --comment a\\b -j ACCEPT") == "a\\b"
    assert comment("-m comment --comment x#y -j ACCEPT") == "x#y"
    assert comment('-m comment --comment "" -j ACCEPT') == ""
    # `*TABLE` ignores the rest of its line; a line starting with `#` is a comment.
    assert parse_policy("# c\n*filter # x\n#-A FORWARD -j DROP\n\nCOMMIT\n", allow_empty=True).original_rules == []


@pytest.mark.parametrize(
    "body, line, col, token, msg",
    [
        ("-A FORWARD -j ACCEPT # tail", 2, 22, "#", "unknown option"),
        ("  # indented", 2, 3, "#", "expected a command"),
        ("   ", 2, 1, "   ", "a line of blanks"),
        (" COMMIT", 2, 2, "COMMIT", "expected a command"),
        ("COMMIT ", 2, 1, "COMMIT", "expected a command"),
        (" :X - [0:0]", 2, 2, ":X", "expected a command"),
        ("-A FORWARD -j ACCEPT\r", 2, 15, "ACCEPT\r", "unknown target"),
    ],
)
def test_save_file_refusals(body, line, col, token, msg):
    """Lines iptables-restore 1.8.9 refuses (Bad argument, no command specified, invalid target)."""
    with pytest.raises(PolicyError, match=msg) as e:
        parse_policy(f"*filter\n{body}\nCOMMIT\n", filename="s.save")
    assert (e.value.line, e.value.column, e.value.token) == (line, col, token)


def test_plain_file_is_read_as_a_shell_reads_it():
    text = "iptables -A FORWARD -m comment --comment 'it'\\''s' -j ACCEPT # trailing comment\n"
    text += 'iptables -A FORWARD -m comment --comment "a\\\\b#c" -j DROP\n'
    p = parse_policy(text)
    assert p.original_rules == [
        ("-m", "comment", "--comment", "it's", "-j", "ACCEPT"),
        ("-m", "comment", "--comment", "a\\b#c", "-j", "DROP"),
    ]
    with pytest.raises(PolicyError, match="shell syntax") as e:
        parse_policy("iptables -A FORWARD -j ACCEPT && echo ok\n", filename="p.sh")
    assert (e.value.file, e.value.line, e.value.column) == ("p.sh", 1, 31)


@pytest.mark.parametrize(
    "text, chain, msg",
    [
        ("", "FORWARD", "no rules of table filter in the file"),
        ("*nat\n:PREROUTING ACCEPT [0:0]\n-A PREROUTING -j ACCEPT\nCOMMIT\n", "FORWARD", "only nat, which the tool"),
        ("*filter\n:INPUT DROP [0:0]\n-A INPUT -p tcp -j ACCEPT\nCOMMIT\n", "FORWARD", "never names chain FORWARD"),
        ("*filter\n:FORWARD DROP [0:0]\nCOMMIT\n", "FORWARD", "chain FORWARD has no rules"),
        ("*filter\n:FORWARD DROP [0:0]\n-A FORWARD -j ACCEPT\nCOMMIT\n", "forward", "forward is not a built-in chain"),
        ("-A FORWARD -p tcp -j ACCEPT\n", "INPUT", "never names chain INPUT"),
    ],
)
def test_a_policy_that_says_nothing_about_its_chain_is_refused(text, chain, msg):
    """An empty file, only other tables, a typo in --chain or a base chain without rules used to give an
    accept-everything firewall without a word."""
    with pytest.raises(PolicyError, match=msg):
        parse_policy(text, filename="e.rules", base_chain=chain)
    if "built-in" not in msg:  # --allow-empty accepts the chain policy alone; a chain that does not exist never
        pol = parse_policy(text, filename="e.rules", base_chain=chain, allow_empty=True)
        assert pol.rules == [] or pol.base_chain == chain


def test_other_tables_are_listed_as_ignored():
    pol = parse_policy(
        "*nat\n:POSTROUTING ACCEPT [0:0]\nCOMMIT\n*filter\n:FORWARD DROP [0:0]\n-A FORWARD -j ACCEPT\nCOMMIT\n"
    )
    assert pol.ignored_tables == ("nat",)


def _nested(n: int) -> str:
    lines = ["*filter", ":FORWARD ACCEPT [0:0]", *(f":C{i} - [0:0]" for i in range(n))]
    lines += ["-A FORWARD -j C0", *(f"-A C{i} -p tcp --dport {i + 1} -j C{i + 1}" for i in range(n - 1))]
    return "\n".join([*lines, f"-A C{n - 1} -j DROP", "COMMIT"]) + "\n"


def test_nesting_is_bounded_as_in_the_kernel():
    """nf_tables follows 15 jumps below a base chain (checked with iptables-restore: the 16th fails with "Too many
    links"); 2,000 nested jumps used to end in a RecursionError."""
    parse_policy(_nested(15))
    for n in (16, 2000):
        with pytest.raises(PolicyError, match="nest more than 15 jumps below FORWARD") as e:
            parse_policy(_nested(n), filename="deep.rules")
        assert (e.value.line, e.value.token) == (n + 18, "C15"), (n, e.value.line, e.value.token)


def test_an_ipv6_address_is_named_as_such():
    with pytest.raises(PolicyError, match="an IPv6 address in an IPv4 policy") as e:
        parse_rule("-s 2001:db8::1 -j DROP")
    assert e.value.column == 4 and e.value.token == "2001:db8::1"
