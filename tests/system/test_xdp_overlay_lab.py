"""The SFL update buffer against the kernel: on the lab's xdp topology, the changed policy deployed (its chains, its
shim), then its program given the matcher of the policy before the change (`program` with the old policy's plan) and
the change as an overlay (`write_overlay` of `analysis.overlay.align`'s View: slots, valid mask, rows of every
hardware index), as the update service leaves a running program; `verify` sends the frames through that hybrid and
through the kernel alone with the changed policy: the same verdict for every frame, and frames decided by the slots.
verify draws its frames from the changed policy's rules; a second run takes them from a trace of headers drawn from
both policies' rules, so that the deleted rules' frames (the valid mask's) come too."""

from __future__ import annotations

import random

import pytest

from conftest import ROOT
from tests.hfcli import HfCli
from tests.system.test_xdp_overlay import changed

pytestmark = pytest.mark.system

LAB = "xol"
STATE = f"/run/hypafilter/test-{LAB}"

hf = HfCli(LAB, STATE)


@pytest.fixture(scope="module")
def lab():
    with hf.xdp_lab():
        yield LAB


def both_trace(before, after, path, count: int = 3000) -> str:
    """A ClassBench-format trace (SRC DST SPORT DPORT PROTO FLAGS) of headers drawn from both policies' rules."""
    from hypafilter.ops.verify import FrameGen

    rng = random.Random(11)
    gens = (FrameGen(before, rng), FrameGen(after, rng))
    rows = []
    for k in range(count):
        h = gens[k % 2].header()
        rows.append(f"{h['src']} {h['dst']} {h['sport']} {h['dport']} {h['proto']} {h['flags']}\n")
    path.write_text("".join(rows))
    return str(path)


@pytest.mark.parametrize("mode", ["selective", "exact"])
def test_verify_through_the_buffer(lab, mode, tmp_path):
    from hypafilter.analysis.overlay import align
    from hypafilter.analysis.plan import build_plan
    from hypafilter.config import Config
    from hypafilter.iptables.document import parse_policy
    from hypafilter.ops import deploy
    from hypafilter.ops.verify import verify
    from hypafilter.targets.xdp.tables import build_tables
    from hypafilter.targets.xdp.target import _shape_of, overlay_state

    text = (ROOT / "rulesets" / "example.rules").read_text()
    before = parse_policy(text, "example.rules")
    after = parse_policy(changed(text, random.Random(7), inserts=1, before_self=6), "example-changed.rules")
    cfg = Config(target="xdp", shunt_mode=mode, update_buffer=32)
    was = (deploy.LAB_NAME, deploy.STATE_DIR)
    deploy.configure(LAB, STATE)
    try:
        st = deploy.deploy(after, cfg, target="xdp", force=True)
        tgt = deploy.target_of(st, cfg)
        info = st["nic"]
        static = build_plan(before, cfg)
        view = align(static.entries, build_plan(after, cfg), 32)
        assert view.overlay.used >= 4 and not view.overlay.valid.all(), view.overlay
        assert build_tables(static).fits(_shape_of(info)), "the old matcher must fit the changed policy's program"
        written = tgt.program(info, static, st["generation"])  # the matcher before the change
        out = tgt.write_overlay(info, view)  # the change, into the running program
        st["tables"] = {**written, "overlay": out["overlay"]}  # as the update service records it
        deploy.write_state(st)
        assert deploy.drift(st, tgt) == []
        trace = both_trace(before, after, tmp_path / "both.trace")
        n = view.n
        for probes in ({"seed": 3}, {"seed": 4, "trace": trace}):
            hits0 = tgt.counters(info)["HITS"]
            report = verify(after, cfg, packets=1500, **probes)
            hits = tgt.counters(info)["HITS"]
            assert report["mismatches"] == 0, (probes, report["examples"][:3])
            assert report["generation"] == st["generation"]  # verified the running deployment, not a redeploy
            assert overlay_state(tgt.read_overlay(info)) == out["overlay"]
            by_slots = sum(hits.get(i, 0) - hits0.get(i, 0) for i in range(n + 1, n + 1 + 32))
            assert by_slots > 0, "no frame reached a slot"
            assert report["hw_forwarded"] + report["hw_dropped"] > 0
            print(mode, probes, view.overlay.used, "slots", int((~view.overlay.valid).sum()), "masked", by_slots)
    finally:
        deploy.configure(*was)


def test_an_in_place_rewrite_keeps_the_program_shunting(lab):
    """The update's register path on xdp: shunt-all (CONTROL 0), the tables rewritten in place (`known`), then the
    release. Until the release the program must still shunt everything, as the NIC keeps CONTROL bit 1 through its
    register writes: a change of the live ruleset that comes meanwhile (FollowWatch.hold) holds the update, and the
    program must not decide by the tables being applied meanwhile (on main the rewrite re-armed it)."""
    import json

    from hypafilter.analysis.plan import build_plan
    from hypafilter.config import Config
    from hypafilter.iptables.document import parse_policy
    from hypafilter.ops import deploy

    pol = parse_policy((ROOT / "rulesets" / "example.rules").read_text(), "example.rules")
    cfg = Config(target="xdp")
    was = (deploy.LAB_NAME, deploy.STATE_DIR)
    deploy.configure(LAB, STATE)
    try:
        st = deploy.deploy(pol, cfg, target="xdp", force=True)
        tgt = deploy.target_of(st, cfg)
        info = st["nic"]

        def config() -> dict:
            return json.loads(tgt._tool("stats", ["stats", "--pin", info["pin"]]))["config"]

        armed = config()["control"]
        assert armed != 0, "the deployed program decides"
        tgt.shunt_all(info, True)
        tgt.program(info, build_plan(pol, cfg), st["generation"] + 1, known=st["tables"])
        assert config()["control"] == 0 and config()["armed"] == armed, config()  # still shunting everything
        tgt.shunt_all(info, False)
        assert config()["control"] == armed  # the release arms it
        tgt.program(info, build_plan(pol, cfg), st["generation"] + 2)  # a fresh program's tables arm it at once
        assert config()["control"] == armed
    finally:
        deploy.configure(*was)
