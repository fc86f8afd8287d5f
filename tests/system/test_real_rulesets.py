"""System tests: rule sets written by real firewall tools (rulesets/real/, made by scripts/real-rulesets.sh with
ufw, shorewall, fail2ban, firewalld and Docker) go through lint, compile in every mode and strategy, load beside the
original dump in a scratch namespace, and deploy on the emulated NIC and verify against the kernel: FORWARD in bridge
mode, INPUT in host mode."""

from __future__ import annotations

import itertools
import os
import re
import warnings
from pathlib import Path

import pytest
from hypafilter.analysis.plan import MODES, build_plan
from hypafilter.analysis.program import STRATEGIES
from hypafilter.cli import main
from hypafilter.config import Config
from hypafilter.errors import HypafilterError
from hypafilter.iptables.document import parse_policy
from hypafilter.iptables.tokens import tokenize
from hypafilter.ir.semantics import OBSERVING_TARGETS
from hypafilter.netfilter.restore import to_iptables_restore
from hypafilter.ops import deploy
from hypafilter.ops.verify import NONDETERMINISTIC, refuse_nondeterministic, verify

from conftest import FULL_RUN, ROOT, ns_sh
from tests.scratchns import scratch_netns

pytestmark = pytest.mark.system

LAB = "hfr"
REAL = ROOT / "rulesets" / "real"
DUMPS = sorted(REAL.glob("*.rules"))
TOOLS = ("ufw", "shorewall", "fail2ban", "firewalld", "docker")
CHAINS = ("FORWARD", "INPUT")
MARK_MASK, MARK_SHIFT = 0x0FFFFFF0, 4
IN_OUT = ("-i|--in-interface", "-o|--out-interface")
LAB_BRIDGE = "br0"  # the bridge of the lab's firewall and plain namespaces (ops/lab.py BRIDGES)
PACKETS = 2000
PACKETS_BRIDGED = 1000  # per (IN, OUT) variant: there are about 70
# Known gaps of the parser, compiler or deploy met by a dump: {(dump stem, chain or interface, stage): the gap}
# (stages: lint, load, verify, deploy; "bridged" with "IN>OUT" for test_verify_interfaces_as_lab_bridge). Each
# is xfail(strict=True), so the suite stays green while the gap is open and turns red the day it is fixed.
GAPS: dict[tuple[str, str, str], str] = {}
# FORWARD dumps that are not verified frame by frame because a rule verify refuses decides verdicts and so cannot
# be left out honestly: {dump stem: why}. Rate-limited logging rules are left out instead (see frame_policy_text);
# docs/real-rulesets.md lists both. Empty since verify compares rate limits and timed recent lists (ufw's `limit`
# rules: docs/verify.md).
NOT_FRAME_VERIFIED: dict[str, str] = {}
# The same for INPUT (deployed in host mode).
NOT_FRAME_VERIFIED_INPUT: dict[str, str] = {}
PACKETS_INPUT = 1000


def chains_with_rules(path: Path) -> list[str]:
    """Which of CHAINS have rules of their own in the dump's filter table (a chain without any is only its policy,
    which lint refuses without --allow-empty, and there is nothing of the tool's to test)."""
    table, found = None, set()
    for line in path.read_text().splitlines():
        if line.startswith("*"):
            table = line[1:].strip()
        elif table == "filter" and line.startswith("-A "):
            found.add(line.split()[1])
    return [c for c in CHAINS if c in found]


CASES = [(p, c) for p in DUMPS for c in chains_with_rules(p)]
FORWARD_DUMPS = [p for p, c in CASES if c == "FORWARD"]
INPUT_DUMPS = [p for p, c in CASES if c == "INPUT"]


def case(path: Path, chain: str, stage: str):
    """pytest parameter for a dump and chain, marked xfail when GAPS names a known gap at `stage`."""
    gap = GAPS.get((path.stem, chain, stage))
    marks = [pytest.mark.xfail(strict=True, reason=gap)] if gap else []
    return pytest.param(path, chain, id=f"{path.stem}-{chain}", marks=marks)


def parse(path: Path, chain: str, text: str | None = None):
    return parse_policy(path.read_text() if text is None else text, str(path), chain, Config())


def reached_rules(path: Path, chain: str):
    """(line number, line, tokens) of every filter-table rule of `chain` and of the user chains it reaches."""
    reached = {chain, *parse(path, chain).user_chains}
    table = None
    for n, line in enumerate(path.read_text().splitlines(keepends=True), 1):
        if line.startswith("*"):
            table = line[1:].strip()
        elif table == "filter" and line.startswith("-A ") and line.split()[1] in reached:
            yield n, line, [t.text for t in tokenize(line.rstrip("\n"), n, str(path))]


def interfaces(path: Path, chain: str) -> list[str]:
    """Interface names the rules reached from `chain` test with -i/-o (loopback aside: never a bridged frame's)."""
    names: list[str] = []
    for _, _, toks in reached_rules(path, chain):
        for i, t in enumerate(toks[:-1]):
            if t in ("-i", "-o", "--in-interface", "--out-interface") and toks[i + 1] not in (*names, "lo"):
                names.append(toks[i + 1])
    return names


def frame_policy_text(
    path: Path, chain: str, bridged: tuple[str | None, str | None] = (None, None)
) -> tuple[str, list[str]]:
    """The dump as it is verified frame by frame, and the rules left out of it: rules of `chain` and of the user
    chains it reaches whose only effect is to log at a limited rate (a match verify refuses and an observing target
    such as LOG). They never decide a verdict, so leaving them out changes no frame's fate; every other rule stays.
    Each left-out line becomes a comment, so line numbers in messages stay those of the dump.

    `bridged` = (IN, OUT): the -i checks of interface IN and the -o checks of OUT test the lab's bridge instead
    (LAB_BRIDGE, netfilter's input and output device of every bridged frame on both paths): the frames then take
    the path a packet from IN to OUT takes on the tool's host. Checks of other names stay, and never match."""
    drop = logging_only(path, chain)
    subs = [(opts, name) for opts, name in zip(IN_OUT, bridged, strict=True) if name]
    out, left_out = [], []
    for n, line in enumerate(path.read_text().splitlines(keepends=True), 1):
        if n in drop:
            left_out.append(f"{path.name}:{n}: {line.strip()}")
            out.append(f"# left out for verify: {line}")
            continue
        for opts, name in subs:
            line = re.sub(rf"(?<= )({opts}) {re.escape(name)}(?= )", rf"\1 {LAB_BRIDGE}", line)
        out.append(line)
    return "".join(out), left_out


def logging_only(path: Path, chain: str) -> set[int]:
    """Line numbers of the rate-limited rules reached from `chain` that only change what is logged: an observing
    target (LOG), a jump to a user chain whose rules all only log, or a RETURN after which the chain only logs
    (ufw-logging-deny: `-m limit ... -j RETURN`, then `-m limit ... -j LOG`)."""
    rules: dict[str, list[tuple[int, list[str]]]] = {}
    for n, _, toks in reached_rules(path, chain):
        rules.setdefault(toks[1], []).append((n, toks))
    drop: set[int] = set()
    logs_only: set[str] = set()
    changed = True
    while changed:
        changed = False
        for name, lst in rules.items():
            for i, (n, toks) in enumerate(lst):
                t = _target(toks)
                harmless = (
                    t in OBSERVING_TARGETS
                    or t in logs_only
                    or (t == "RETURN" and all(m in drop or _target(x) in OBSERVING_TARGETS for m, x in lst[i + 1 :]))
                )
                if n not in drop and harmless and _matches(toks) & NONDETERMINISTIC.keys():
                    drop.add(n)
                    changed = True
            if name not in logs_only and all(n in drop or _target(x) in OBSERVING_TARGETS for n, x in lst):
                logs_only.add(name)
                changed = True
    return drop


def _target(toks: list[str]) -> str | None:
    return toks[toks.index("-j") + 1] if "-j" in toks[:-1] else None


def _matches(toks: list[str]) -> set[str]:
    return {toks[i + 1] for i, t in enumerate(toks[:-1]) if t in ("-m", "--match")}


def limited_logging(toks: list[str]) -> bool:
    """A rule that only logs, at a limited rate: a match verify refuses and an observing target."""
    matches = {toks[i + 1] for i, t in enumerate(toks[:-1]) if t in ("-m", "--match")}
    target = toks[toks.index("-j") + 1] if "-j" in toks[:-1] else None
    return bool(matches & NONDETERMINISTIC.keys()) and target in OBSERVING_TARGETS


def test_corpus():
    """Every tool made at least one dump; each opens with the comment naming tool, version and configuration, and
    is an iptables-save file with a filter table; both chains are covered."""
    assert {p.stem.split("-")[0] for p in DUMPS} == set(TOOLS)
    for p in DUMPS:
        first, *rest = p.read_text().splitlines()
        tool = p.stem.split("-")[0]
        assert first.startswith(f"# {tool} ") and "configuration '" in first, p
        assert "*filter" in rest, p
    assert FORWARD_DUMPS and INPUT_DUMPS


@pytest.mark.parametrize(("path", "chain"), [case(p, c, "lint") for p, c in CASES])
def test_lint(path, chain, capsys):
    """`hypafilter lint` accepts the dump, and as root every rule of it loads in its scratch namespace."""
    status = main(["lint", "--chain", chain, str(path)])
    out, err = capsys.readouterr()
    print(out, err)
    assert status == 0, err
    assert "kernel check: every rule loads" in out, out


@pytest.mark.parametrize(("path", "chain"), [case(p, c, "load") for p, c in CASES])
def test_compile_and_load(path, chain):
    """The dump loads as it is (every table) and lists back its own rules; then every mode and strategy compiles,
    and each generated restore text loads beside it with --noflush (the generated chains jump to the copies of the
    tool's user chains they declare), rule for rule."""
    pol = parse(path, chain)
    with scratch_netns("hfr", "iptables-restore", "iptables-save") as ns:
        dump = path.read_text()
        ns_sh(ns, "iptables-restore", stdin=dump)
        saved = ns_sh(ns, "iptables-save", "-t", "filter")
        want = [ln for ln in dump.split("*filter\n", 1)[1].split("COMMIT\n", 1)[0].splitlines() if ln[:3] == "-A "]
        assert sorted(ln for ln in saved.splitlines() if ln[:3] == "-A ") == sorted(want)
        loaded = 0
        for n, (mode, strategy) in enumerate(itertools.product(MODES, STRATEGIES)):
            if strategy == "hsa_cut" and mode == "index":
                continue  # refused by design (docs/deploy.md)
            plan = build_plan(pol, Config(), mode, strategy)  # log mirroring depends on the strategy
            prefix = f"T{n}_"
            try:
                text = to_iptables_restore(plan, strategy, prefix, MARK_MASK, MARK_SHIFT)
            except HypafilterError as e:
                raise AssertionError(f"{mode}/{strategy}: {e}") from e
            ns_sh(ns, "iptables-restore", "--noflush", stdin=text)
            generated = sorted(ln for ln in text.splitlines() if ln.startswith("-A "))
            listed = ns_sh(ns, "iptables-save", "-t", "filter").splitlines()
            assert len([ln for ln in listed if ln.startswith(f"-A {prefix}")]) == len(generated), (mode, strategy)
            loaded += 1
        assert loaded == len(MODES) * len(STRATEGIES) - 1


def test_frame_verification_coverage():
    """Which dumps are verified frame by frame (FORWARD in bridge mode, INPUT in host mode), and what is left out
    of them: printed (pytest -s) and warned, so that the output says what was not checked on frames."""
    for chain, dumps, known in (
        ("FORWARD", FORWARD_DUMPS, NOT_FRAME_VERIFIED),
        ("INPUT", INPUT_DUMPS, NOT_FRAME_VERIFIED_INPUT),
    ):
        refused = {}
        for p in dumps:
            text, left_out = frame_policy_text(p, chain)
            try:
                refuse_nondeterministic(parse(p, chain, text))
            except HypafilterError as e:
                refused[p.stem] = str(e)
            for line in left_out:
                print(f"frame verification of {p.stem} ({chain}) leaves out the rate-limited logging rule {line}")
        assert set(refused) == set(known), refused
        for stem, why in known.items():
            warnings.warn(
                f"{stem} ({chain}) is compiled and loaded but not verified frame by frame: {why}", stacklevel=1
            )


VERIFIED = [p for p in FORWARD_DUMPS if p.stem not in NOT_FRAME_VERIFIED]


def check_frames(
    path: Path, text: str, left_out: list[str], what: str, packets: int = PACKETS, chain: str = "FORWARD"
) -> None:
    for line in left_out:
        print(f"left out (rate-limited logging, never a verdict): {line}")
    r = verify(parse(path, chain, text), Config(shunt_mode="selective"), packets=packets, seed=12)
    print(
        f"{what}: {r['packets']} frames, {r['delivered_oracle']} delivered by the kernel, {r['shunted']} shunted, "
        f"hardware forwarded {r['hw_forwarded']} and dropped {r['hw_dropped']}, {r['mismatches']} mismatches"
    )
    assert r["packets"] == packets
    assert r["mismatches"] == 0, f"{r['mismatches']} mismatches, e.g. {r['examples'][:3]}"


@pytest.mark.parametrize(("path", "chain"), [case(p, "FORWARD", "verify") for p in VERIFIED])
def test_deploy_and_verify(lab, path, chain):
    """FORWARD deployed on the emulated NIC (selective shunting: whatever conntrack must see reaches software) and
    compared with the kernel running the dump alone: zero mismatches."""
    check_frames(path, *frame_policy_text(path, chain), path.stem)


# `make test` verifies a quarter of each policy's (IN, OUT) pairs, `make test-full` half (every interface name met),
# alternating from one policy to the next; HF_REAL_ALL=1 (`make test-real-all`) every pair (docs/testing.md).
ALL_PAIRS = os.environ.get("HF_REAL_ALL") == "1"
PAIR_STRIDE = 2 if FULL_RUN else 4


def _bridged_cases():
    for n, p in enumerate(VERIFIED):
        try:
            names = [None, *interfaces(p, "FORWARD")]
        except HypafilterError:  # test_lint reports it; no variant to draw
            names = [None]
        for i, pair in enumerate(itertools.product(names, names)):
            if pair == (None, None):
                continue  # test_deploy_and_verify
            if not ALL_PAIRS and (i + n) % PAIR_STRIDE:
                continue
            label = f"{pair[0] or '-'}>{pair[1] or '-'}"
            gap = GAPS.get((p.stem, label, "bridged"))
            marks = [pytest.mark.xfail(strict=True, reason=gap)] if gap else []
            yield pytest.param(p, pair, id=f"{p.stem}-{label}", marks=marks)


@pytest.mark.parametrize(("path", "bridged"), list(_bridged_cases()))
def test_verify_interfaces_as_lab_bridge(lab, path, bridged):
    """The tools' rules name their hosts' interfaces (eth0, docker0, ...), which never match a frame in the lab, so
    the verify above mostly sees what happens to a packet between interfaces no rule names. Here every ordered pair
    (IN, OUT) of the names FORWARD tests (or none) is tried: frames take the path of a packet from IN to OUT on the
    tool's host, through the rules behind those checks, on both paths: zero mismatches."""
    text, left_out = frame_policy_text(path, "FORWARD", bridged)
    what = f"{path.stem}, frames from {bridged[0] or 'elsewhere'} to {bridged[1] or 'elsewhere'}"
    check_frames(path, text, left_out, what, PACKETS_BRIDGED)


@pytest.mark.parametrize(
    ("path", "chain"), [case(p, "INPUT", "verify") for p in INPUT_DUMPS if p.stem not in NOT_FRAME_VERIFIED_INPUT]
)
def test_deploy_and_verify_input(lab, path, chain):
    """INPUT deployed on the emulated NIC in host mode (the firewall terminates the frames; a hardware ACCEPT is
    delivered marked "decided") and compared with the kernel running the dump alone: zero mismatches. An update
    between modes is refused, so FORWARD deployments of the module are removed first."""
    st = deploy.read_state()
    if st and st.get("nic_mode", "bridge") != "host":
        deploy.undeploy()
    check_frames(path, *frame_policy_text(path, chain), f"{path.stem} INPUT", PACKETS_INPUT, chain)


@pytest.mark.parametrize(("path", "chain"), [case(p, "INPUT", "deploy") for p in INPUT_DUMPS[:1]])
def test_output_refused_by_deploy(path, chain):
    """OUTPUT is refused by deploy before anything changes, with an error that says why."""
    text = path.read_text().replace("-A INPUT ", "-A OUTPUT ")
    with pytest.raises(HypafilterError, match=r"chain OUTPUT cannot be deployed on a NIC: the NIC never sees"):
        deploy.deploy(parse(path, "OUTPUT", text), Config())
