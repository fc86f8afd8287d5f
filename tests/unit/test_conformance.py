"""Conformance of the parser with the iptables project's own rule-syntax tests (../shared/peer-tests/*.t)."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypafilter.errors import PolicyError
from hypafilter.iptables.canonical import rule_tokens
from hypafilter.iptables.parser import parse_rule
from hypafilter.iptables.tokens import SHELL, tokenize

from tests.peercorpus import cases, modelled

FILES = sorted(
    p.name for p in (Path(__file__).resolve().parents[2].parent / "shared/peer-tests/iptables-extensions").glob("*.t")
)


def understood(rule: str) -> bool:
    """Whether every match and the target of a test line are ones the parser models fully."""
    toks = []
    for t in (t.text for t in tokenize(rule, mode=SHELL)):  # the .t tests run `iptables -A ...` through a shell
        if t.startswith("--") and "=" in t:
            toks += t.split("=", 1)
        elif len(t) > 2 and t[0] == "-" and t[1] in "mjg":
            toks += [t[:2], t[2:]]
        else:
            toks.append(t)
    return modelled(toks)


def check_file(path: Path) -> dict[str, int]:
    """Runs every line of one .t file; returns counts and raises AssertionError listing failures."""
    n = {
        "understood_ok": 0,
        "understood_fail": 0,
        "complex_ok": 0,
        "complex_fail_rejected": 0,
        "complex_fail_accepted": 0,
    }
    failures = []
    for no, rule, expected, ok in cases(path):
        if ";" in rule:
            # A line with a variant field (`rule;expected;result;LEGACY...`): its result holds for one variant
            # only, and `cases` leaves `rule;expected` in the rule, which a shell would split at the `;`.
            continue
        where = f"{path.name}:{no}: {rule!r}"
        try:
            rules = parse_rule(rule, chains=set(), filename=path.name, line=no)
            err = None
        except PolicyError as e:
            rules, err = None, e
        if understood(rule):
            if ok:
                if err is not None:
                    failures.append(f"{where} rejected: {err}")
                    continue
                want = rule if expected == "=" else expected
                if expected:
                    got = rule_tokens(rules[0])
                    exp = tuple(t.text for t in tokenize(want))
                    if got != exp:
                        failures.append(f"{where} printed {' '.join(got)!r}, expected {want!r}")
                        continue
                n["understood_ok"] += 1
            else:
                if err is None:
                    failures.append(f"{where} accepted, iptables rejects it")
                    continue
                n["understood_fail"] += 1
        elif ok:
            if err is not None:
                failures.append(f"{where} (complex) rejected: {err}")
                continue
            n["complex_ok"] += 1
        else:
            n["complex_fail_rejected" if err is not None else "complex_fail_accepted"] += 1
    assert not failures, "\n".join(failures)
    return n


@pytest.mark.shared
@pytest.mark.parametrize("name", FILES or ["(none)"])
def test_peer_file(shared_dir, name):
    path = shared_dir / "peer-tests" / "iptables-extensions" / name
    assert path.exists(), f"{path}: the iptables conformance corpus is missing from shared/"
    check_file(path)


@pytest.mark.shared
def test_core_files_present_and_understood(shared_dir):
    """The files the modelled matches come from must exist and have only understood lines checked strictly."""
    d = shared_dir / "peer-tests" / "iptables-extensions"
    for name in ("iptables.t", "libipt_standard.t", "libxt_tcp.t", "libxt_udp.t", "libipt_icmp.t", "libxt_multiport.t"):
        counts = check_file(d / name)
        assert counts["understood_ok"] + counts["understood_fail"] > 0, name
