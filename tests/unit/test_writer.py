"""The one iptables-restore writer: quoting that our tokenizer (and iptables-restore) reads back to the same tokens,
rule lines, restore documents, and the original policy alone as a restore text."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from hypafilter.errors import HypafilterError
from hypafilter.iptables.document import parse_policy
from hypafilter.iptables.tokens import tokenize
from hypafilter.iptables.writer import Restore, body_of, policy_restore, quote, rule_line, tokens_text
from hypothesis import given
from hypothesis import strategies as st

AWKWARD = [
    "plain",
    "10.0.0.0/8",
    "1024:65535",
    "!",
    "",
    "two words",
    "tab\tinside",
    " lead and trail ",
    'say "hi"',
    '"',
    "\\",
    "a\\b",
    "a\\\\b",
    "ends in \\",
    '\\"',
    "'q'",
    "it's",
    "#",
    "# not a comment",
    "a#b",
    "carriage\rreturn",
    "v\x0btab and f\x0ceed",
    "ACCEPT\r",
    '"ab"cd',
    "héllo wörld ✓",
    "日本語",
    "x" * 300,
    ("a\\b \"c\" 'd' #e " * 20).strip(),
]


def read_back(line: str) -> list[str]:
    return [t.text for t in tokenize(line)]


@pytest.mark.parametrize("tok", AWKWARD, ids=[repr(t)[:30] for t in AWKWARD])
def test_token_reads_back_unchanged(tok):
    assert read_back(quote(tok)) == [tok]
    rule = ["-m", "string", "--string", tok, "--algo", "bm", "-j", "DROP"]
    assert read_back(tokens_text(rule)) == rule


def test_all_awkward_tokens_on_one_line():
    assert read_back(tokens_text(AWKWARD)) == AWKWARD


def test_safe_tokens_stay_bare_and_the_rest_is_double_quoted():
    for tok in ("ACCEPT", "10.0.0.0/8", "!", "--dport", "22,80", "a=b", "1/sec", "x@y%z+"):
        assert quote(tok) == tok
    assert quote("") == '""'
    assert quote("a b") == '"a b"'
    assert quote("a\\b") == '"a\\\\b"'  # the form iptables-save writes: the backslash escaped
    assert quote('a"b') == '"a\\"b"'
    assert quote("'q'") == "\"'q'\""


# Any text without a line feed (iptables-restore reads lines up to "\n" only; every other character, "\r" and
# the other white space included, can be part of a token).
ONE_LINE = st.text(st.characters(exclude_categories=("Cs",), exclude_characters="\n"))


@given(st.lists(ONE_LINE, max_size=8))
def test_any_tokens_read_back_unchanged(tokens):
    assert read_back(tokens_text(tokens)) == tokens


def test_rule_line_drops_a_leading_append():
    toks = ("-p", "tcp", "-j", "ACCEPT")
    assert rule_line("MINE", toks) == "-A MINE -p tcp -j ACCEPT"
    assert rule_line("MINE", ("-A", "FORWARD", *toks)) == "-A MINE -p tcp -j ACCEPT"
    assert rule_line("MINE", ("--append", "FORWARD", *toks)) == "-A MINE -p tcp -j ACCEPT"
    assert rule_line("MINE", ("-m", "comment", "--comment", "-A x", "-j", "DROP"), command="-D") == (
        '-D MINE -m comment --comment "-A x" -j DROP'
    )
    assert rule_line("MINE", ("-A",)) == "-A MINE -A"  # not an `-A CHAIN` pair: kept


def test_restore_document():
    doc = Restore("filter", comment="made by a test")
    doc.chain("FORWARD", "DROP").chain("HF1_MAIN")
    doc.rule("HF1_MAIN", ["-m", "string", "--string", "a\\b", "--algo", "bm", "-j", "DROP"])
    doc.insert("FORWARD", 1, ["-j", "HF1_MAIN"])
    doc.delete("FORWARD", ["-j", "HF0_MAIN"])
    doc.remove(["HF0_MAIN", "HF0_B0"])
    doc.extend(["-A HF1_MAIN -j RETURN"])
    assert doc.text() == (
        "# made by a test\n"
        "*filter\n"
        ":FORWARD DROP [0:0]\n"
        ":HF1_MAIN - [0:0]\n"
        '-A HF1_MAIN -m string --string "a\\\\b" --algo bm -j DROP\n'
        "-I FORWARD 1 -j HF1_MAIN\n"
        "-D FORWARD -j HF0_MAIN\n"
        "-F HF0_MAIN\n"
        "-F HF0_B0\n"
        "-X HF0_MAIN\n"
        "-X HF0_B0\n"
        "-A HF1_MAIN -j RETURN\n"
        "COMMIT\n"
    )
    assert doc.body() == body_of(doc.text()) == doc.text().splitlines()[2:-1]
    assert Restore("raw").flush(["PREROUTING"]).text() == "*raw\n-F PREROUTING\nCOMMIT\n"


SAVE = """*filter
:INPUT DROP [0:0]
:FORWARD DROP [0:0]
:OUTPUT ACCEPT [0:0]
:WEB - [0:0]
:BAD - [0:0]
-A FORWARD -p tcp -m tcp --dport 80 -j WEB
-A FORWARD -m string --string "a\\\\b" --algo bm -j BAD
-A FORWARD -s 10.0.0.0/8 -j ACCEPT
-A WEB -m comment --comment "it's \\"web\\" #1" -j ACCEPT
-A BAD -j DROP
COMMIT
"""


def test_policy_restore_of_a_policy_with_user_chains():
    pol = parse_policy(SAVE, base_chain="FORWARD")
    assert pol.original_rules[1][3] == "a\\b"
    text = policy_restore(pol)
    assert text == (
        "*filter\n"
        ":INPUT ACCEPT [0:0]\n"  # only the base chain's policy is the policy's; the others accept
        ":FORWARD DROP [0:0]\n"
        ":OUTPUT ACCEPT [0:0]\n"
        ":BAD - [0:0]\n"
        ":WEB - [0:0]\n"
        "-A FORWARD -p tcp -m tcp --dport 80 -j WEB\n"
        '-A FORWARD -m string --string "a\\\\b" --algo bm -j BAD\n'
        "-A FORWARD -s 10.0.0.0/8 -j ACCEPT\n"
        "-A BAD -j DROP\n"
        '-A WEB -m comment --comment "it\'s \\"web\\" #1" -j ACCEPT\n'
        "COMMIT\n"
    )
    again = parse_policy(text, base_chain="FORWARD")
    assert again.original_rules == pol.original_rules
    assert again.default == pol.default
    assert {n: c.rules for n, c in again.user_chains.items()} == {n: c.rules for n, c in pol.user_chains.items()}


def test_policy_restore_needs_a_builtin_base_chain():
    with pytest.raises(HypafilterError, match="not a built-in chain"):
        policy_restore(SimpleNamespace(base_chain="MINE"))


def test_written_text_is_what_iptables_save_writes_back():
    """iptables-save writes `'` as `\\'` inside double quotes (xtables_save_string); both spellings read back
    to the same token, and a single quote outside double quotes is literal."""
    assert read_back('"it\\\'s"') == read_back(quote("it's")) == ["it's"]
    assert read_back("'q'") == ["'q'"]
    assert read_back(quote("# x")) == ["# x"] and quote("#").startswith('"')
