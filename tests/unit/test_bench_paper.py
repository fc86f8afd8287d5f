"""`hypafilter bench paper` on a tiny ClassBench set: CSV/PNG/results outputs, and agreement with `analyze --json`."""

from __future__ import annotations

import csv
import gzip
import json

import pytest
from hypafilter.analysis.plan import build_plan
from hypafilter.cli import main
from hypafilter.config import Config
from hypafilter.hw.vhdl import matcher_hash
from hypafilter.tools.bench import paper

pytestmark = pytest.mark.shared

KS = (1, 5, 20)


@pytest.fixture
def tiny_shared(shared_dir, tmp_path):
    """A shared-like folder with one small set: the first 120 rules of acl1_1100 and 3,000 of its trace headers."""
    src = shared_dir / "data" / "classbench"
    dst = tmp_path / "shared" / "data" / "classbench"
    dst.mkdir(parents=True)
    rules = (src / "acl1_1100.filters").read_text().splitlines()[:120]
    (dst / "tiny_1100.filters").write_text("\n".join(rules) + "\n")
    with gzip.open(src / "acl1_1100_trace.gz", "rt") as f:
        lines = [next(f) for _ in range(3000)]
    with gzip.open(dst / "tiny_1100_trace.gz", "wt") as f:
        f.writelines(lines)
    return tmp_path / "shared"


def _rows(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def bench_paper(shared, out, *options: str) -> int:
    """`hypafilter bench paper` on the `shared` folder, writing to `out`."""
    return main(["bench", "paper", "--shared", str(shared), "--out", str(out), *options])


def test_analytic_outputs_agree_with_analyze(tiny_shared, tmp_path, capsys):
    out, md = tmp_path / "out", tmp_path / "results.md"
    ks = ",".join(map(str, KS))
    rc = bench_paper(tiny_shared, out, "--sets", "tiny", "--ks", ks, "--figures", "11,12,13", "--results-md", str(md))
    assert rc == 0
    capsys.readouterr()
    f11, f12, f13 = (
        _rows(out / f"{n}.csv") for n in ("fig11_shunting_rules", "fig12_shunted_packets", "fig13_traversed_rules")
    )
    for png in ("fig11.png", "fig12.png", "fig13.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = md.read_text()
    for head in ("## Fig. 11", "## Fig. 12", "## Fig. 13", "Command: `", "Machine:"):
        assert head in text

    cb = tiny_shared / "data" / "classbench"
    for k in KS:
        rc = main(
            [
                "analyze",
                "--classbench",
                str(cb / "tiny_1100.filters"),
                "--complex",
                str(k),
                "--trace",
                str(cb / "tiny_1100_trace.gz"),
                "--json",
            ]
        )
        assert rc == 0
        a = json.loads(capsys.readouterr().out)
        r11 = {r["mode"]: int(r["shunting_rules"]) for r in f11 if int(r["K"]) == k}
        r12 = {r["mode"]: int(r["shunted_packets"]) for r in f12 if int(r["K"]) == k}
        r13 = {r["strategy"]: int(r["traversed_rules"]) for r in f13 if int(r["K"]) == k}
        assert r11["index"] == a["shunting_rules_index_based"]
        assert r11["selective"] == a["shunting_rules_selective"]
        assert r12["index"] == a["shunted_packets_index_based"]
        assert r12["selective"] == a["shunted_packets_selective"]
        for strat, v in a["traversed_rules"].items():
            assert r13[strat] == v, strat
        # The exact mode shunts exactly the complex entries, and exactly the packets the lower bound counts.
        assert r11["exact"] == a["complex"] == k
        assert r12["exact"] == r12["lower_bound"]
        assert r12["lower_bound"] <= r12["selective"] <= r12["index"] <= a["packets"]
        assert r11["selective"] <= r11["index"]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (("--figures", "11,99"), "unknown figure(s) 99"),
        (("--sets", "nosuch", "--figures", "11"), "nosuch_1100.filters"),
    ],
    ids=["unknown-figure", "missing-set"],
)
def test_bad_request_is_a_clear_error_before_any_output(tiny_shared, tmp_path, capsys, options, message):
    rc = bench_paper(tiny_shared, tmp_path / "o", *options, "--no-results-md")
    assert rc == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_insertions_keep_the_matcher_except_in_exact_mode(tiny_shared):
    """Fig. 15's premise: inserting a complex rule leaves the hardware entries alone with index/selective
    shunting (an update by registers) and adds an entry in exact mode (a new core)."""
    filters = tiny_shared / "data" / "classbench" / "tiny_1100.filters"
    texts = paper.insertion_texts(filters, 3, rules=50)
    cfg = Config()
    policies = [paper.load_policy(filters, 0, cfg, text=t) for t in texts]
    assert [len(p.rules) for p in policies] == [50, 51, 52, 53]
    assert [len(p.complex_indices) for p in policies] == [0, 1, 2, 3]
    for mode, same in (("index", True), ("selective", True), ("exact", False)):
        plans = [build_plan(p, cfg, mode) for p in policies]
        hashes = {matcher_hash(p) for p in plans}
        assert (len(hashes) == 1) is same, mode
        if mode != "exact":
            assert any(list(a.shunt) != list(b.shunt) for a, b in zip(plans, plans[1:], strict=False)), mode
