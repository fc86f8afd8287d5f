"""Unit tests for the nft writer with an ip6tables policy (netfilter.nft, family 6) and bench rate's IPv6 nft text
(tools.bench.rate.nft_text6): the expressions, ip6tables' hotdrop guards, the refusals (text only; the kernel's
verdicts on them are tests/system/test_bench_rate_nft6.py's)."""

from __future__ import annotations

import dataclasses

import pytest
from hypafilter.analysis.plan import build_plan
from hypafilter.config import Config
from hypafilter.errors import HypafilterError
from hypafilter.iptables.document import parse_policy
from hypafilter.netfilter import ip6
from hypafilter.netfilter.nft import HOTDROP6, to_nft
from hypafilter.tools.bench.rate import nft_text6

HEAD = "*filter\n:INPUT ACCEPT [0:0]\n:FORWARD ACCEPT [0:0]\n:OUTPUT ACCEPT [0:0]\n"


def _pol6(rules: str):
    return parse_policy(HEAD + rules + "COMMIT\n", filename="p6", config=Config(), allow_empty=True, family=6)


def _full(pol, **kw) -> list[str]:
    text = to_nft(build_plan(pol, strategy="full"), "full", **kw)
    return [ln.strip() for ln in text.split("chain HF1_FULL {\n")[1].split("\n\t}")[0].splitlines()]


@pytest.mark.parametrize(
    "rule, nft",
    [
        ("-s 2001:db8::/32 -d fd48::1/128 -j DROP", "ip6 saddr 2001:db8::/32 ip6 daddr fd48::1/128 drop"),
        # the protocol first, as ip6tables-nft writes it
        (
            "-s 2001:db8::/32 -p udp -m udp --dport 53 -j DROP",
            "meta l4proto udp ip6 saddr 2001:db8::/32 udp dport 53 drop",
        ),
        ("! -s 2001:db8::/32 -j DROP", "ip6 saddr != 2001:db8::/32 drop"),
        ("-m iprange --src-range 2001:db8::5-2001:db8::ff -j DROP", "ip6 saddr 2001:db8::5-2001:db8::ff drop"),
        ("-m iprange ! --dst-range 2001:db8::5-2001:db8::ff -j DROP", "ip6 daddr != 2001:db8::5-2001:db8::ff drop"),
        ("-p ipv6-icmp -m icmp6 --icmpv6-type 1/3 -j DROP", "meta l4proto ipv6-icmp icmpv6 type 1 icmpv6 code 3 drop"),
        (
            "-p ipv6-icmp -m icmp6 ! --icmpv6-type 1/3 -j DROP",
            "meta l4proto ipv6-icmp icmpv6 type . icmpv6 code != { 1 . 3 } drop",
        ),
        # ip6tables' icmp6 has no "any" type: 255 is a type like the others (IPv4's 255 matches every ICMP packet)
        ("-p ipv6-icmp -m icmp6 --icmpv6-type 255 -j DROP", "meta l4proto ipv6-icmp icmpv6 type 255 drop"),
    ],
)
def test_ipv6_expressions(rule, nft):
    """An ip6tables rule in nft's ip6 words (no IPv4 expression), hotdrop guards off."""
    assert _full(_pol6(f"-A FORWARD {rule}\n"), hotdrop=()) == [nft]


def test_table_family_follows_the_policy():
    text = to_nft(build_plan(_pol6("-A FORWARD -s 2001:db8::/32 -j DROP\n"), strategy="full"), "full")
    assert "table ip6 hf1 {" in text and "table ip " not in text and "ip saddr" not in text


def test_hotdrop_guards():
    """Each rule with a tcp/udp/icmp6/multiport match gets a guard first: its checks before that match, then a jump
    to the chain that drops a frame whose transport header is shorter than what the match reads (not a later
    fragment); a rule without such a match gets none; `hotdrop` names the matches that get one."""
    pol = _pol6(
        "-A FORWARD -s 2001:db8::/32 -p udp -m udp --dport 53 -j DROP\n"
        "-A FORWARD -p ipv6-icmp -m icmp6 --icmpv6-type 128 -j ACCEPT\n"
        "-A FORWARD -p tcp -m multiport --dports 22,443 -j DROP\n"
        "-A FORWARD -p tcp -m tcp --tcp-flags SYN,ACK SYN -j DROP\n"
        "-A FORWARD -p tcp -j DROP\n"
    )
    assert _full(pol) == [
        "meta l4proto udp ip6 saddr 2001:db8::/32 jump HF1_SHORT8",
        "meta l4proto udp ip6 saddr 2001:db8::/32 udp dport 53 drop",
        "meta l4proto ipv6-icmp jump HF1_SHORT8",
        "meta l4proto ipv6-icmp icmpv6 type 128 accept",
        "meta l4proto tcp jump HF1_SHORT4",
        "meta l4proto tcp tcp dport { 22, 443 } drop",
        "meta l4proto tcp jump HF1_SHORT20",
        "meta l4proto tcp tcp flags & (syn | ack) == syn drop",
        "meta l4proto tcp drop",
    ]
    text = to_nft(build_plan(pol, strategy="full"), "full")
    for need in set(HOTDROP6.values()):
        short = text.split(f"chain HF1_SHORT{need} {{\n")[1].split("\n\t}")[0]
        lines = [ln.strip() for ln in short.splitlines()]
        assert lines == ["frag frag-off != 0 return", f"@th,{8 * need - 32},32 & 0x0 == 0x0 return", "drop"]
    only_icmp = _full(pol, hotdrop={"icmp6"})
    assert [ln for ln in only_icmp if "jump" in ln] == ["meta l4proto ipv6-icmp jump HF1_SHORT8"]
    assert "SHORT" not in to_nft(build_plan(pol, strategy="full"), "full", hotdrop=())


def test_fast_copy_and_entry():
    """`fast_prefix`: the program without guards beside the guarded one; ENTRY sends a frame no match can hotdrop
    there (a later fragment, another protocol, 20 bytes of transport header) and any other to the guarded one."""
    pol = _pol6("-A FORWARD -p udp -m udp --dport 53 -j DROP\n")
    text = to_nft(build_plan(pol, strategy="full"), "full", "HF1_", fast_prefix="HF2_")
    fast = text.split("chain HF2_FULL {\n")[1].split("\n\t}")[0]
    assert [ln.strip() for ln in fast.splitlines()] == ["meta l4proto udp udp dport 53 drop"]
    entry = [ln.strip() for ln in text.split("chain HF1_ENTRY {\n")[1].split("\n\t}")[0].splitlines()]
    assert entry == [
        "frag frag-off != 0 goto HF2_MAIN",
        "meta l4proto != { dccp, ipv6-icmp, sctp, tcp, udp, udplite } goto HF2_MAIN",
        "@th,128,32 & 0x0 == 0x0 goto HF2_MAIN",
        "goto HF1_MAIN",
    ]
    v4 = parse_policy(HEAD + "-A FORWARD -p udp -m udp --dport 53 -j DROP\nCOMMIT\n", filename="p4")
    with pytest.raises(HypafilterError, match="family 6"):
        to_nft(build_plan(v4, strategy="full"), "full", "HF1_", fast_prefix="HF2_")
    assert "SHORT" not in to_nft(build_plan(v4, strategy="full"), "full")  # IPv4 text as before: no guards


@pytest.mark.parametrize(
    "rule",
    ["-m frag --fragid 5 -j DROP", "-m hl --hl-eq 1 -j DROP", "-p ipv6-icmp -m icmp6 --icmpv6-type 1/3:4 -j DROP"],
)
def test_ipv6_refusals(rule):
    """What the writer cannot say in nft is an error naming the rule, never a rule that means something else."""
    with pytest.raises(HypafilterError, match="p6"):
        to_nft(build_plan(_pol6(f"-A FORWARD {rule}\n"), strategy="full"), "full")


def _v6(text: str) -> ip6.V6Policy:
    v6 = ip6.parse(text, "v6", validate=False)
    ir = parse_policy(text, filename="v6", config=Config(), allow_empty=True, family=6)
    return dataclasses.replace(v6, ir=ir)


def test_nft_text6():
    """bench rate's IPv6 side: table ip6 hfrate, its forward hook jumping to ENTRY; refused for a file with more than
    its filter table (the nft path would not hold the rest) and for --ipv6-default drop (no ip6tables policy)."""
    text = nft_text6(_v6(HEAD + "-A FORWARD -p udp -m udp --dport 53 -j DROP\nCOMMIT\n"), Config())
    hook = text[text.rindex("table ip6 hfrate {") :]
    assert "type filter hook forward priority filter; policy accept;" in hook and "jump HFRATE_ENTRY" in hook
    assert "chain HFRATEF_FULL {" in text and "jump HFRATE_SHORT8" in text
    assert "SHORT" not in nft_text6(_v6(HEAD + "-A FORWARD -p udp -m udp --dport 53 -j DROP\nCOMMIT\n"), Config(), ())
    raw = "*raw\n:PREROUTING ACCEPT [0:0]\n:OUTPUT ACCEPT [0:0]\n-A PREROUTING -j NOTRACK\nCOMMIT\n"
    with pytest.raises(HypafilterError, match="tables raw"):
        nft_text6(_v6(HEAD + "COMMIT\n" + raw), Config())
    with pytest.raises(HypafilterError, match="not an ip6tables policy"):
        nft_text6(ip6.drop_policy(), Config())
