"""System test: the parser's canonical rule text equals what the real iptables prints back (`iptables -S`).

Each rulesets/*.rules file and the conformance corpus's fully understood single rules are loaded with
iptables-restore into a fresh network namespace; every listed rule is compared token for token with the
parser's `rule_tokens`. Both sides go through `iptables.tokens.tokenize`, so quoting is not compared.

The tokenising and repeated-option cases (`SAVE_CASES`, `REFUSED`, `SHELL_LINES`) are loaded as the user wrote
them, never through our writer: save-file lines by iptables-restore (and iptables-legacy-restore), plain rule-file
lines by `sh` running `iptables`; each must list back as the parser reads it, and what the tools refuse the parser
refuses.

Documented exceptions (applied by `_normalise` / `_nft_listing_quirk`, each one narrow):
- string quoting: iptables prints `--string "BAD"` and `--log-prefix "blocked: "` in double quotes, the parser keeps
  the bare token; comparing tokenized text removes only the quoting.
- conntrack state order: the conntrack/state extensions print their state list in the kernel's bit order
  (`RELATED,ESTABLISHED`), the parser keeps such unmodelled matches verbatim (`ESTABLISHED,RELATED`); the lists
  are compared as sets.
- hex-string spacing: `--hex-string "|11 02 00|"` is printed without the spaces between bytes (`|110200|`);
  the parser keeps it verbatim, so spaces inside `|...|` are dropped on both sides.
- iptables-nft 1.8.9 listing quirks, where the conformance corpus (and the parser, and iptables-legacy) say one
  thing and the nft front end prints another; `_NFT_QUIRKS` lists each with the form iptables-nft prints.
- spellings the nft front end's command line refuses (`--protocol=tcp`, `-ptcp`) are not loaded; the conformance
  unit test covers their parsing.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from hypafilter.config import Config
from hypafilter.errors import PolicyError
from hypafilter.iptables.canonical import rule_tokens
from hypafilter.iptables.document import parse_policy
from hypafilter.iptables.parser import parse_rule
from hypafilter.iptables.tokens import SHELL, tokenize
from hypafilter.iptables.writer import Restore, policy_restore

from conftest import need_tool, ns_sh
from tests.peercorpus import cases, modelled
from tests.scratchns import scratch_netns

pytestmark = pytest.mark.system
RULESETS = sorted((Path(__file__).resolve().parents[2] / "rulesets").glob("*.rules"))
# The conformance files whose lines are loaded (the modelled matches plus the standard options).
CORPUS = ("iptables.t", "libipt_standard.t", "libxt_tcp.t", "libxt_udp.t", "libipt_icmp.t", "libxt_multiport.t")
CORPUS += ("libxt_iprange.t", "libxt_comment.t")
# Rule (as the corpus writes it) -> what iptables-nft 1.8.9 prints instead of the corpus's expected form.
_NFT_QUIRKS = {
    # An inverted full port range matches no packet; the nft front end lists the rule as if it had no port check.
    "-p tcp -m tcp ! --sport :": ("-p", "tcp"),
    "-p tcp -m tcp ! --dport :": ("-p", "tcp"),
    "-p udp -m udp ! --sport :": ("-p", "udp"),
    "-p udp -m udp ! --dport :": ("-p", "udp"),
    # Type 255 with the single code 255 is listed with the name of "type 255, any code".
    "-p icmp -m icmp --icmp-type 255/255": ("-p", "icmp", "-m", "icmp", "--icmp-type", "any"),
}


@pytest.fixture
def netns():
    with scratch_netns("hfrt", "iptables", "iptables-restore", "nft", "sh") as name:
        yield name


_HEX = re.compile(r"\|[^|]*\|")


def _normalise(tokens) -> tuple[str, ...]:
    """Applies the documented exceptions for extensions the parser keeps verbatim."""
    out = list(tokens)
    for i, t in enumerate(out):
        prev = out[i - 1] if i else ""
        if prev in ("--ctstate", "--state", "--ctstatus"):
            out[i] = ",".join(sorted(t.split(",")))
        elif prev == "--hex-string":
            out[i] = _HEX.sub(lambda m: m.group().replace(" ", ""), t)
    return tuple(out)


def _listing(ns: str) -> tuple[dict[str, str], dict[str, list[tuple[str, ...]]]]:
    """`iptables -S` of the filter table: chain policies, and each chain's rules as tokens after `-A CHAIN`."""
    policies: dict[str, str] = {}
    rules: dict[str, list[tuple[str, ...]]] = {}
    for line in ns_sh(ns, "iptables", "-S").splitlines():
        toks = [t.text for t in tokenize(line)]
        if toks[0] == "-P":
            policies[toks[1]] = toks[2]
        elif toks[0] == "-N":
            rules.setdefault(toks[1], [])
        elif toks[0] == "-A":
            rules.setdefault(toks[1], []).append(tuple(toks[2:]))
    return policies, rules


def _restore_text(path: Path) -> str:
    """The file as iptables-restore input: save files as they are, plain rule files as `-A FORWARD` lines."""
    text = path.read_text()
    if any(line.strip() == "*filter" for line in text.splitlines()):
        return text
    # Plain rule files are shell command lines (trailing `# comments`, '...'): tokenised as a shell does.
    doc = Restore()
    for tokens in ([t.text for t in tokenize(line, mode=SHELL)] for line in text.splitlines()):
        if tokens:
            doc.rule("FORWARD", tokens)
    return doc.text()


@pytest.mark.parametrize("path", RULESETS, ids=[p.name for p in RULESETS])
def test_ruleset_roundtrip(netns, path):
    pol = parse_policy(path.read_text(), str(path), "FORWARD", Config())
    ns_sh(netns, "iptables-restore", stdin=_restore_text(path))
    policies, kernel = _listing(netns)
    assert policies["FORWARD"] == pol.default
    want = {"FORWARD": pol.original_rules} | {n: list(c.rules) for n, c in pol.user_chains.items()}
    assert set(want) <= set(kernel), f"chains missing in the kernel: {set(want) - set(kernel)}"
    for chain, rules in want.items():
        got = [_normalise(r) for r in kernel[chain]]
        exp = [_normalise(r) for r in rules]
        assert len(got) == len(exp), f"{chain}: kernel has {len(got)} rules, parser {len(exp)}"
        for i, (g, e) in enumerate(zip(got, exp, strict=True)):
            assert g == e, f"{path.name} {chain} rule {i + 1}: kernel {' '.join(g)!r}, parser {' '.join(e)!r}"


def _understood(rule: str) -> bool:
    toks = [t.text for t in tokenize(rule, mode=SHELL)]
    if any(t.startswith("--") and "=" in t for t in toks) or any(
        len(t) > 2 and t[0] == "-" and t[1] in "sdpiojgmc" for t in toks
    ):
        return False  # `--opt=value` and glued `-ptcp`: iptables-nft 1.8.9's command line refuses them
    return modelled(toks)


def corpus_rules(shared: Path) -> list[tuple[str, str, tuple[str, ...]]]:
    """(where, rule, parser tokens) of every OK line of CORPUS the parser models fully and accepts as one rule."""
    out = []
    for name in CORPUS:
        path = shared / "peer-tests" / "iptables-extensions" / name
        if not path.exists():
            continue
        for no, rule, _, ok in cases(path):
            if not ok or not _understood(rule):
                continue
            try:
                parsed = parse_rule(rule, chains=set(), filename=name, line=no)
            except PolicyError as e:
                raise AssertionError(f"{name}:{no}: the parser refuses an OK line: {e}") from e
            if len(parsed) == 1:
                out.append((f"{name}:{no}", rule.strip(), rule_tokens(parsed[0])))
    return out


@pytest.mark.shared
def test_conformance_rules_roundtrip(netns, shared_dir):
    rules = corpus_rules(shared_dir)
    assert len(rules) >= 60, f"only {len(rules)} conformance rules found"
    # One restore for all of them: the listing keeps their order, so rule i of FORWARD is corpus rule i.
    doc = Restore()
    for _, rule, _ in rules:
        doc.rule("FORWARD", [t.text for t in tokenize(rule, mode=SHELL)])  # the .t tests go through a shell
    ns_sh(netns, "iptables-restore", stdin=doc.text())
    _, kernel = _listing(netns)
    assert len(kernel["FORWARD"]) == len(rules)
    bad = []
    for (where, rule, toks), got in zip(rules, kernel["FORWARD"], strict=True):
        if got != toks and got != _NFT_QUIRKS.get(rule):
            bad.append(f"{where} {rule!r}: kernel {' '.join(got)!r}, parser {' '.join(toks)!r}")
    assert not bad, "\n".join(bad)


@pytest.mark.shared
def test_quirks_are_real(shared_dir):
    """Each listed nft quirk must still be what the parser disagrees on (keeps the exception list honest)."""
    rules = {r: toks for _, r, toks in corpus_rules(shared_dir)}
    for rule, printed in _NFT_QUIRKS.items():
        assert rule in rules, f"quirk {rule!r} is no longer in the corpus"
        assert rules[rule] != printed


# Rules (after `-A FORWARD`) as an iptables-save file holds them: quoting, backslashes, `#`, single quotes, quoted
# options, repeated options and matches. Each would have failed before iptables.tokens read lines as
# iptables-restore does (`'q'`, `a\b`, `x#y`, `"it\'s"`) or before every -m loaded a new match instance.
SAVE_CASES = [
    "-m comment --comment 'q' -j ACCEPT",
    r'-m comment --comment "it\'s" -j ACCEPT',
    r"-m comment --comment a\b -j ACCEPT",
    r'-m comment --comment "a\\b \"c\" \x" -j ACCEPT',
    "-m comment --comment x#y -j ACCEPT",
    "-m comment --comment # -j ACCEPT",
    '-m comment --comment "" -j ACCEPT',
    "-m comment --comment ! -j ACCEPT",
    "-m string --string 'it''s' --algo bm -j DROP",
    "-m string --string x#'y' --algo bm -j DROP",
    '"-p" tcp "!" "--dport" 80 "-j" ACCEPT',
    "-p tcp -m multiport --dports 80 -m multiport --sports 22 -j ACCEPT",
    "-p tcp -m multiport --dports 80 -m multiport --dports 22 -j ACCEPT",
    "-p tcp -m tcp --dport 80 -m tcp --dport 22 -j ACCEPT",
    "-p tcp -m tcp --dport 80 -m tcp ! --dport 22 -j ACCEPT",
    "-p tcp --dport 80 -m tcp --sport 22 -j ACCEPT",
    "-p tcp -m tcp -m tcp --sport 22 -j ACCEPT",
    "-p icmp -m icmp --icmp-type 8 -m icmp --icmp-type 0 -j ACCEPT",
    "-m comment --comment a -m comment --comment b -j ACCEPT",
    "-m iprange --src-range 1.1.1.1-1.1.1.2 -m iprange --src-range 1.1.1.3 -j ACCEPT",
]
# iptables-nft 1.8.9 lists the tcp matches of one rule merged, a later option replacing an earlier one; the kernel
# checks every instance (`nft list` shows `tcp dport 80 tcp dport 22`), and iptables-legacy lists them all.
_NFT_MERGED = {
    "-p tcp -m tcp --dport 80 -m tcp --dport 22 -j ACCEPT": "-p tcp -m tcp --dport 22 -j ACCEPT",
    "-p tcp -m tcp --dport 80 -m tcp ! --dport 22 -j ACCEPT": "-p tcp -m tcp ! --dport 22 -j ACCEPT",
    "-p tcp --dport 80 -m tcp --sport 22 -j ACCEPT": "-p tcp -m tcp --sport 22 --dport 80 -j ACCEPT",
}
# Whole lines of a save file that iptables-restore 1.8.9 refuses; the parser must refuse each on its line.
REFUSED = [
    "-A FORWARD -j ACCEPT # tail",
    "  # indented",
    "   ",
    " COMMIT",
    ' -A FORWARD -m comment --comment "ab"cd -j ACCEPT',
    "-A FORWARD -j ACCEPT\r",
    "-A FORWARD -p tcp -m multiport --dports 80 --dports 22 -j ACCEPT",
    "-A FORWARD -p tcp -m multiport --dports 80 --sports 22 -j ACCEPT",
    "-A FORWARD -p tcp --dport 80 --dport 22 -j ACCEPT",
    "-A FORWARD -p tcp -m tcp --sport 1 --sport 2 -j ACCEPT",
    "-A FORWARD -p tcp --syn --syn -j ACCEPT",
    "-A FORWARD -p icmp --icmp-type 8 --icmp-type 0 -j ACCEPT",
    "-A FORWARD -m comment --comment a --comment b -j ACCEPT",
    "-A FORWARD -p tcp --dport ! 80 -j ACCEPT",
    "-A FORWARD -s ! 1.2.3.4 -j ACCEPT",
    "-A FORWARD -j ACCEPT -j DROP",
]
# Plain rule-file lines: shell command lines, run by `sh` as written.
SHELL_LINES = [
    "iptables -A FORWARD -m comment --comment 'it'\\''s' -j ACCEPT # a shell comment",
    'iptables -A FORWARD -m comment --comment "a\\\\b \\"c\\" \\x" -j ACCEPT',
    "iptables -A FORWARD -m comment --comment a\\#b#c -j ACCEPT",
    "iptables -A FORWARD -m string --string 'q' --algo bm -j DROP",
    "iptables -A FORWARD -p tcp -m multiport --dports 80 -m multiport --sports 22 -j ACCEPT",
]


def _save_text(rules) -> str:
    return "*filter\n:FORWARD ACCEPT [0:0]\n" + "".join(f"-A FORWARD {r}\n" for r in rules) + "COMMIT\n"


def _forward(listing: str) -> list[tuple[str, ...]]:
    return [tuple(t.text for t in tokenize(ln))[2:] for ln in listing.splitlines() if ln.startswith("-A FORWARD ")]


def _nft_forward(ns: str) -> list[str]:
    """The FORWARD rules as nft holds them (what the kernel checks), without counter values; every rule that
    iptables-nft adds carries a counter, which tells rule lines from the chain's header lines."""
    out = ns_sh(ns, "nft", "list", "chain", "ip", "filter", "FORWARD")
    return [
        re.sub(r"counter packets \d+ bytes \d+", "counter", ln.strip()) for ln in out.splitlines() if "counter" in ln
    ]


def test_save_cases_roundtrip(netns):
    pol = parse_policy(_save_text(SAVE_CASES), "cases.save")
    ns_sh(netns, "iptables-restore", stdin=_save_text(SAVE_CASES))
    got = _forward(ns_sh(netns, "iptables", "-S", "FORWARD"))
    assert len(got) == len(SAVE_CASES) == len(pol.original_rules)
    bad = []
    for rule, g, e in zip(SAVE_CASES, got, pol.original_rules, strict=True):
        merged = _NFT_MERGED.get(rule)
        if g != e and (merged is None or g != tuple(t.text for t in tokenize(merged))):
            bad.append(f"{rule!r}: kernel {g}, parser {e}")
    assert not bad, "\n".join(bad)
    # Same meaning: the parser's canonical text, written by our writer, gives the kernel the same nft rules.
    want = _nft_forward(netns)
    assert len(want) == len(SAVE_CASES)
    ns_sh(netns, "iptables-restore", stdin=policy_restore(pol))
    assert _nft_forward(netns) == want


def test_save_cases_roundtrip_legacy(netns):
    """iptables-legacy lists every match instance as loaded: the canonical text must equal it exactly."""
    need_tool("iptables-legacy-restore", "iptables-legacy")
    pol = parse_policy(_save_text(SAVE_CASES), "cases.save")
    ns_sh(netns, "iptables-legacy-restore", stdin=_save_text(SAVE_CASES))
    got = _forward(ns_sh(netns, "iptables-legacy", "-S", "FORWARD"))
    for rule, g, e in zip(SAVE_CASES, got, pol.original_rules, strict=True):
        assert g == e, f"{rule!r}: kernel {g}, parser {e}"


@pytest.mark.parametrize("line", REFUSED, ids=[repr(x) for x in REFUSED])
def test_refused_by_both(netns, line):
    text = f"*filter\n:FORWARD ACCEPT [0:0]\n{line}\nCOMMIT\n"
    with pytest.raises(Exception) as kernel:
        ns_sh(netns, "iptables-restore", stdin=text)
    assert "line: 3" in str(kernel.value) or "line 3" in str(kernel.value), str(kernel.value)
    with pytest.raises(PolicyError) as ours:
        parse_policy(text, "refused.save")
    assert (ours.value.file, ours.value.line) == ("refused.save", 3)
    assert ours.value.column >= 1 and ours.value.token


def test_plain_lines_as_a_shell_runs_them(netns):
    script = "set -e\n" + "\n".join(SHELL_LINES) + "\n"
    ns_sh(netns, "sh", "-c", script)
    got = _forward(ns_sh(netns, "iptables", "-S", "FORWARD"))
    assert got == parse_policy(script.replace("set -e\n", ""), "plain.rules").original_rules
