"""Reference-file tests: each rulesets/<name>.rules has rulesets/<name>.expected/ with the expected partition,
shunt vectors and generated iptables-restore text per strategy (and what its interface checks became, when a site
configuration rulesets/<name>.toml describes the interfaces); the compiler must reproduce them exactly.

Regenerate after an intended change (and review the diff):
    HYPAFILTER_REGEN=1 .venv/bin/pytest tests/unit/test_compile_reference.py
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from hypafilter.analysis.plan import build_plan
from hypafilter.analysis.program import STRATEGIES
from hypafilter.cli.common import resolved_lines
from hypafilter.config import Config
from hypafilter.iptables.document import parse_policy
from hypafilter.netfilter.restore import to_iptables_restore

ROOT = Path(__file__).resolve().parents[2]
RULESETS = sorted((ROOT / "rulesets").glob("*.rules"))
REGEN = os.environ.get("HYPAFILTER_REGEN") == "1"


def expected_files(rules: Path) -> dict[str, str]:
    rel = str(rules.relative_to(ROOT))
    site = rules.with_suffix(".toml")
    pol = parse_policy(rules.read_text(), rel, "FORWARD", Config.load(site) if site.exists() else Config())
    plans = {m: build_plan(pol, mode=m) for m in ("index", "selective", "exact")}
    files = {
        "partition.json": json.dumps(plans["selective"].report(), indent=1) + "\n",
        "shunt.json": json.dumps({m: p.shunt_string() for m, p in plans.items()}, indent=1) + "\n",
    }
    for s in STRATEGIES:  # a plan per strategy: log mirroring applies to interval, interval_geo and tree only
        files[f"selective.{s}.iptables"] = to_iptables_restore(build_plan(pol, mode="selective", strategy=s), s)
    files["index.interval.iptables"] = to_iptables_restore(plans["index"], "interval")
    files["exact.interval.iptables"] = to_iptables_restore(plans["exact"], "interval")
    if pol.resolved:
        files["interfaces.txt"] = "".join(f"{line}\n" for line in resolved_lines(pol))
    return files


@pytest.mark.parametrize("rules", RULESETS, ids=[p.stem for p in RULESETS])
def test_reference_files(rules):
    want_dir = rules.with_suffix(".expected")
    got = expected_files(rules)
    if REGEN:
        want_dir.mkdir(exist_ok=True)
        for name, text in got.items():
            (want_dir / name).write_text(text)
    if not want_dir.is_dir():
        pytest.fail(f"{want_dir} missing: run HYPAFILTER_REGEN=1 .venv/bin/pytest {Path(__file__).relative_to(ROOT)}")
    assert sorted(p.name for p in want_dir.iterdir()) == sorted(got)
    for name, text in got.items():
        assert (want_dir / name).read_text() == text, f"{want_dir.name}/{name} differs"


def test_listing1_reference_matches_the_paper():
    f = ROOT / "rulesets" / "listing1.rules"
    shunt = json.loads(expected_files(f)["shunt.json"])
    assert shunt["selective"] == "00011" and shunt["index"] == "00111"
