"""System test: the parser's canonical rule text equals what the real iptables prints back (`iptables -S`).

Each rulesets/*.rules file and the conformance corpus's fully understood single rules are loaded with
iptables-restore into a fresh network namespace; every listed rule is compared token for token with the
parser's `rule_tokens`. Both sides go through `parse.tokenize`, so shell quoting is not compared.

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
from hypafilter.iptables.tokens import tokenize
from hypafilter.iptables.writer import Restore

from conftest import ns_sh
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
    with scratch_netns("hfrt", "iptables", "iptables-restore") as name:
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
    # Plain rule files allow trailing `# comments`, which iptables-restore would pass on as arguments.
    doc = Restore()
    for tokens in ([t.text for t in tokenize(line)] for line in text.splitlines()):
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
    toks = [t.text for t in tokenize(rule)]
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
        doc.rule("FORWARD", [t.text for t in tokenize(rule)])
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
