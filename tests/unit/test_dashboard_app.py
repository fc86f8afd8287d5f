"""Dashboard web app on recorded snapshots: /api JSON, /metrics, the page, the token and the read-only rule."""

import dataclasses
import math

import pytest
from fastapi.testclient import TestClient
from hypafilter.cli import main
from hypafilter.cli.dashboard import check_exposure, is_loopback, parse_listen
from hypafilter.errors import HypafilterError
from hypafilter.tools.dashboard.app import create_app
from hypafilter.tools.dashboard.collector import Collector, Deployment, RuleInfo, Sampler, Snapshot, Update
from prometheus_client.parser import text_string_to_metric_families

from tests.hwcounters import hw_counters

DEP = Deployment(
    generation=7,
    policy_hash="ab" * 32,
    policy="rulesets/example.rules",
    target="emu",
    mode="selective",
    strategy="interval",
    default="DROP",
    prefix="HF7_",
    n_entries=2,
    policy_shunt=True,
    rules=(
        RuleInfo(
            0, "-A FORWARD -s 10.0.0.0/8 -p udp -j ACCEPT", "example.rules:3", "ACCEPT", True, 0, False, id="aaa0"
        ),
        RuleInfo(
            1,
            "-A FORWARD -p tcp -m string --string BAD --algo bm -j DROP",
            "example.rules:4",
            "DROP",
            False,
            None,
            None,
            id="bbb1",
        ),
        RuleInfo(2, "-A FORWARD -p tcp --dport 22 -j ACCEPT", "example.rules:5", "ACCEPT", True, 1, True, id="ccc2"),
    ),
    history=(
        Update(6, "deploy", 1000.0, 42.5, True, "cd" * 32),
        Update(0, "update", 1100.0, 0.3, False, "ef" * 32, error="deploy step 'netfilter' failed"),
        Update(7, "update", 1200.0, 1.25, True, "ab" * 32, steps=(("compile", 0.2), ("registers", 0.05))),
    ),
)


# The deploy journal DEP.history was read from (time = end of the step).
JOURNAL = [
    {"time": 1042.5, "generation": 6, "kind": "deploy", "result": "ok", "duration_s": 42.5, "policy_hash": "cd" * 32},
    {"time": 1100.3, "result": "failed", "duration_s": 0.3, "error": "deploy step 'netfilter' failed"},
    {"time": 1201.25, "generation": 7, "kind": "update", "result": "ok", "duration_s": 1.25},
]


def save(rule1: tuple[int, int], main: tuple[int, int]) -> str:
    """iptables-save -c of generation 7: the complex rule 1 (tagged) and the base chain's jump into MAIN."""
    return (
        "*filter\n"
        f"[{main[0]}:{main[1]}] -A FORWARD -j HF7_MAIN\n"
        f'[{rule1[0]}:{rule1[1]}] -A HF7_C1 -p tcp -m comment --comment "hf:rule=1" -j DROP\n'
        "COMMIT\n"
    )


def record(readings, dep=DEP, journal=JOURNAL, drift=()):
    """Replay NIC and netfilter readings (mono, CNT_*, HITS, netfilter text) through the real Collector, so the
    snapshots carry the totals it accumulates; times are set to the readings' own."""
    now: dict = {}

    class Nic:
        def counters(self):
            return now["hw"]

        def hits(self, count):
            return list(now["hits"][:count])

    c = Collector(
        state_reader=lambda: {"generation": dep.generation, "history": journal},
        nic_opener=lambda d: Nic(),
        nf_reader=lambda ns, table: now["nf"],
        deployment_builder=lambda state: dep,
        drift_checker=lambda state: list(drift),
        drift_async=False,
    )
    out = []
    for mono, hw, hits, nf in readings:
        now.update(hw=hw, hits=hits, nf=nf)
        out.append(dataclasses.replace(c.snapshot(), time=4900.0 + mono, mono=mono))
    return out


# Two seconds of recorded traffic: 1000 fwd/s, 250 drop/s, shunts by reason.
HW = (hw_counters(1000, 500, 100, 40, 2, host=3, mirror=10), hw_counters(3000, 1000, 300, 80, 2, host=3, mirror=50))
SNAPS = record(
    [
        (100.0, HW[0], (1000, 100, 40), save((30, 3000), (142, 9000))),
        (102.0, HW[1], (3000, 300, 80), save((70, 7000), (382, 20000))),
    ]
)


@pytest.fixture
def sampler():
    s = Sampler(interval=1.0, keep=10)
    for snap in SNAPS:
        s.add(snap)
    return s


@pytest.fixture
def client(sampler):
    return TestClient(create_app(sampler))


def test_summary_totals_and_rates(client):
    s = client.get("/api/summary").json()
    assert s["seq"] == 2 and s["generation"] == 7 and s["deployed"]
    t = s["totals"]
    assert (t["forwarded"], t["dropped"], t["shunted"]) == (3000, 1000, 382)
    assert t["shunted_by_reason"] == {"overrule": 300, "policy": 80, "unparsed": 2, "state": 0, "forced": 0}
    assert t["shunt_ratio"] == pytest.approx(382 / 4382)
    r = s["rates"]
    assert (r["forwarded"], r["dropped"], r["shunted"]) == (1000.0, 250.0, 120.0)
    assert r["shunted_by_reason"]["overrule"] == 100.0 and r["shunted_by_reason"]["policy"] == 20.0
    assert r["shunt_ratio"] == pytest.approx(120 / 1370)
    assert r["netfilter_main"] == 120.0
    assert (t["mirrored"], r["mirrored"]) == (50, 20.0)  # CNT_MIRROR: a subset of forwarded + dropped


def test_series_rules_deployment_and_snapshot(client):
    pts = client.get("/api/series").json()["points"]
    assert len(pts) == 1 and pts[0]["seq"] == 2 and pts[0]["forwarded"] == 1000.0
    assert client.get("/api/series?last=0").json()["points"] == []

    rules = client.get("/api/rules").json()
    rows = {r["index"]: r for r in rules["rules"]}
    assert rows[0]["kind"] == "simple" and rows[0]["shunting"] is False and rows[0]["hits"] == 3000
    assert rows[1]["kind"] == "complex" and rows[1]["entry"] is None and rows[1]["hits"] == 70
    assert rows[1]["hits_rate"] == 20.0 and rows[0]["hits_rate"] == 1000.0
    assert rows[2]["shunting"] is True and rows[2]["hw_hits"] == 300
    assert rules["policy_entry"] == {"entry": 2, "default": "DROP", "shunting": True, "hw_hits": 80}

    d = client.get("/api/deployment").json()
    assert d["generation"] == 7 and d["chains"] == "HF7_*" and d["partition"]["complex"] == 1
    assert d["partition"]["shunting_entries"] == 2
    assert [h["duration"] for h in d["history"]] == [42.5, 0.3, 1.25]
    assert d["history"][1]["ok"] is False and d["history"][2]["steps"] == {"compile": 0.2, "registers": 0.05}

    assert client.get("/api/snapshot?seq=1").json()["hw"]["CNT_FORWARDED"] == 1000
    assert client.get("/api/snapshot").json()["hits"] == [3000, 300, 80]
    assert client.get("/api/snapshot?seq=99").status_code == 404
    assert "/api/rules" in client.get("/api/").json()["endpoints"]


def families(client) -> dict:
    res = client.get("/metrics")
    assert res.status_code == 200 and res.headers["content-type"].startswith("text/plain")
    return {f.name: f for f in text_string_to_metric_families(res.text)}


def test_metrics_use_prometheus_names_and_labels(client):
    fams = families(client)
    wire = {(s.labels["decision"], s.labels["reason"]): s.value for s in fams["hypafilter_wire_frames"].samples}
    assert wire[("forwarded", "rule")] == 3000 and wire[("shunted", "overrule")] == 300
    assert wire[("shunted", "unparsed")] == 2 and wire[("dropped", "rule")] == 1000
    assert fams["hypafilter_wire_frames"].type == "counter"
    assert fams["hypafilter_from_host_frames"].samples[0].value == 3
    assert fams["hypafilter_mirrored_frames"].samples[0].value == 50 and "mirror" not in {
        s.labels["reason"] for s in fams["hypafilter_wire_frames"].samples
    }  # mirrored frames are counted under their decision, never twice
    assert fams["hypafilter_generation"].samples[0].value == 7
    assert fams["hypafilter_shunt_ratio"].samples[0].value == pytest.approx(120 / 1370)
    info = {s.labels["rule"]: s.labels for s in fams["hypafilter_rule_info"].samples}
    assert info["aaa0"]["where"] == "example.rules:3" and info["bbb1"]["kind"] == "complex"
    hw = {s.labels["rule"]: s.value for s in fams["hypafilter_rule_hardware_hits"].samples}
    nf = {s.labels["rule"]: s.value for s in fams["hypafilter_rule_netfilter_packets"].samples}
    assert hw == {"aaa0": 3000, "ccc2": 300} and nf["bbb1"] == 70 and nf["aaa0"] == 0
    assert fams["hypafilter_policy_entry_hits"].samples[0].value == 80
    assert fams["hypafilter_netfilter_main_packets"].samples[0].value == 382
    assert fams["hypafilter_drift"].samples and all(s.value == 0 for s in fams["hypafilter_drift"].samples)
    hist = fams["hypafilter_update_duration_seconds"]
    assert hist.type == "histogram"
    buckets = {s.labels["le"]: s.value for s in hist.samples if s.name.endswith("_bucket")}
    assert buckets["1.0"] == 0 and buckets["2.5"] == 1 and buckets["60.0"] == 2 and buckets["+Inf"] == 2
    count = next(s.value for s in hist.samples if s.name.endswith("_count"))
    assert count == 2  # the failed update is not a duration of a deployment
    updates = {(s.labels["kind"], s.labels["result"]): s.value for s in fams["hypafilter_updates"].samples}
    assert updates == {("deploy", "ok"): 1, ("update", "failed"): 1, ("update", "ok"): 1}


def test_metric_label_sums_partition_their_totals(client):
    """Summing a family over any of its labels gives a total: nothing counted twice."""
    fams = families(client)
    hw = HW[1]
    wire = fams["hypafilter_wire_frames"].samples
    every_wire_frame = sum(hw[c] for c in ("CNT_FORWARDED", "CNT_DROPPED", "CNT_SHUNT_OVERRULE"))
    every_wire_frame += sum(hw.get(c, 0) for c in ("CNT_SHUNT_POLICY", "CNT_SHUNT_UNPARSED", "CNT_DROP_UNFILTERABLE"))
    assert sum(s.value for s in wire) == every_wire_frame
    by_decision: dict[str, float] = {}
    for s in wire:
        by_decision[s.labels["decision"]] = by_decision.get(s.labels["decision"], 0) + s.value
    assert by_decision == {"forwarded": 3000, "dropped": 1000, "shunted": 382}
    # The shunted reasons add up to the shunted total the API shows; forced is a family of its own.
    assert by_decision["shunted"] == client.get("/api/summary").json()["totals"]["shunted"]
    assert "forced" not in {s.labels["reason"] for s in wire}
    # Every classified IP frame hit one hardware entry or the policy entry: the per-rule sum and the policy entry
    # account for the HITS table once.
    rule_hw = sum(s.value for s in fams["hypafilter_rule_hardware_hits"].samples)
    assert rule_hw + fams["hypafilter_policy_entry_hits"].samples[0].value == 3000 + 300 + 80
    # Every family that carries a label has each label set once per series.
    for fam in fams.values():
        keys = [(s.name, *sorted(s.labels.items())) for s in fam.samples]
        assert len(keys) == len(set(keys)), fam.name


def test_shunt_ratio_is_always_there():
    """No traffic in the last interval: the ratio is NaN (0/0), not a missing series."""
    idle = record(
        [
            (10.0, hw_counters(5, 5), (5, 0, 0), save((0, 0), (0, 0))),
            (11.0, hw_counters(5, 5), (5, 0, 0), save((0, 0), (0, 0))),
        ]
    )
    s = Sampler(interval=1.0, keep=5)
    for snap in idle:
        s.add(snap)
    ratio = families(TestClient(create_app(s)))["hypafilter_shunt_ratio"].samples
    assert len(ratio) == 1 and math.isnan(ratio[0].value)


def test_counters_only_go_up_across_nic_restart_undeploy_and_journal_truncation():
    """The exporter's *_total survive a new NIC (counters from 0 again), an undeploy and a 50-entry journal."""
    dep2 = dataclasses.replace(DEP, nic_id="other-nic#2")
    now: dict = {}
    journal = [
        {"time": float(t), "kind": "update", "result": "ok", "duration_s": 0.2, "generation": 7} for t in range(50)
    ]

    class Nic:
        def counters(self):
            return now["hw"]

        def hits(self, count):
            return list(now["hits"][:count])

    state = {"generation": 7, "history": journal}
    deps = {"dep": DEP}
    c = Collector(
        state_reader=lambda: state,
        nic_opener=lambda d: Nic(),
        nf_reader=lambda ns, table: now["nf"],
        deployment_builder=lambda st: deps["dep"],
        drift_checker=None,
    )
    seen = []

    def scrape(hw, hits, rule1, main):
        now.update(hw=hw, hits=hits, nf=save(rule1, main))
        s = Sampler(interval=1.0, keep=5)
        s.add(c.snapshot())
        f = families(TestClient(create_app(s)))

        def value(fam, **labels):
            if fam not in f:
                return None
            return next((x.value for x in f[fam].samples if labels.items() <= x.labels.items()), None)

        seen.append(
            {
                "fwd": value("hypafilter_wire_frames", decision="forwarded"),
                "rule0": value("hypafilter_rule_hardware_hits", rule="aaa0"),
                "rule1": value("hypafilter_rule_netfilter_packets", rule="bbb1"),
                "main": f["hypafilter_netfilter_main_packets"].samples[0].value,
                "updates": sum(x.value for x in f["hypafilter_updates"].samples),
            }
        )

    scrape(hw_counters(100), (100, 0, 0), (10, 1), (10, 1))
    scrape(hw_counters(150), (150, 0, 0), (12, 1), (12, 1))
    # The NIC restarted under the same identity (counters back near 0): the drop is a reset, absorbed.
    scrape(hw_counters(20), (20, 0, 0), (12, 1), (12, 1))
    # The journal is truncated to its last 50 entries with one more update: one more, not fewer.
    journal[:] = journal[1:] + [{"time": 60.0, "kind": "update", "result": "ok", "duration_s": 0.3}]
    scrape(hw_counters(30), (30, 0, 0), (12, 1), (12, 1))
    # Undeployed: nothing to read, the totals stay.
    saved, state = state, None
    scrape(hw_counters(0), (0,), (0, 0), (0, 0))
    # Deployed again on a new NIC and new chains: its counters count from 0 on top.
    state = saved
    state["generation"] = 8
    deps["dep"] = dataclasses.replace(dep2, generation=8, prefix="HF7_")
    scrape(hw_counters(5), (5, 0, 0), (3, 1), (3, 1))
    fwd = [x["fwd"] for x in seen]
    assert fwd == [100, 150, 170, 180, 180, 185]
    # Per-rule series exist while the rule is deployed, and continue where they were when it is again.
    assert [x["rule0"] for x in seen] == [100, 150, 170, 180, None, 185]
    assert [x["rule1"] for x in seen] == [10, 12, 12, 12, None, 15]
    assert [x["main"] for x in seen] == [10, 12, 12, 12, 12, 15]
    assert [x["updates"] for x in seen] == [50, 50, 50, 51, 51, 51]


def test_rule_metrics_are_left_out_above_the_limit(sampler):
    f = families(TestClient(create_app(sampler, rule_series_limit=2)))
    assert "hypafilter_rule_info" not in f and f["hypafilter_rule_series"].samples[0].value == 0
    assert f["hypafilter_wire_frames"].samples  # the totals stay


def test_drift_in_summary_and_metrics():
    snaps = record(
        [(1.0, hw_counters(1), (1, 0, 0), save((0, 0), (0, 0)))],
        drift=["netfilter: the jump FORWARD -> HF7_MAIN is missing", "nic: GENERATION register 6, deployed 7"],
    )
    s = Sampler(interval=1.0, keep=5)
    s.add(snaps[0])
    c = TestClient(create_app(s))
    assert c.get("/api/summary").json()["drift"] == [
        "netfilter: the jump FORWARD -> HF7_MAIN is missing",
        "nic: GENERATION register 6, deployed 7",
    ]
    drift = {x.labels["what"]: x.value for x in families(c)["hypafilter_drift"].samples}
    assert drift == {"netfilter": 1, "shim": 0, "nic": 1, "flowsync": 0, "policysync": 0}


def test_rules_are_paged_sorted_and_filtered(client):
    page = client.get("/api/rules?limit=2").json()
    assert [r["index"] for r in page["rules"]] == [0, 1] and page["total"] == page["matched"] == 3
    assert page["max_hits"] == 3000
    page = client.get("/api/rules?offset=2&limit=2").json()
    assert [r["index"] for r in page["rules"]] == [2]
    by_hits = client.get("/api/rules?sort=hits").json()["rules"]
    assert [r["index"] for r in by_hits] == [0, 2, 1] and by_hits[0]["id"] == "aaa0"
    assert [r["index"] for r in client.get("/api/rules?sort=hits&order=asc").json()["rules"]] == [1, 2, 0]
    found = client.get("/api/rules?q=dport%2022").json()
    assert [r["index"] for r in found["rules"]] == [2] and found["matched"] == 1 and found["total"] == 3
    assert [r["index"] for r in client.get("/api/rules?q=complex").json()["rules"]] == [1]
    assert client.get("/api/rules?sort=bogus").status_code == 422
    assert client.get("/api/rules?limit=100000").status_code == 422


def test_page_and_assets_come_from_the_package(client):
    page = client.get("/")
    assert page.status_code == 200 and 'id="total-forwarded"' in page.text and "dashboard.js" in page.text
    assert "http" not in page.text.split("<body")[0].replace("http://testserver", "")  # no CDN
    js = client.get("/static/dashboard.js")
    assert js.status_code == 200 and "api/summary" in js.text
    assert client.get("/static/dashboard.css").status_code == 200


def test_empty_sampler_and_nothing_deployed():
    s = Sampler(interval=1.0, keep=5)
    c = TestClient(create_app(s))
    assert c.get("/api/summary").json()["deployed"] is False
    assert c.get("/api/rules").json()["rules"] == []
    assert c.get("/api/deployment").json() == {"deployed": False, "history": []}
    assert c.get("/metrics").status_code == 200
    s.add(Snapshot(1, 1.0, 1.0, None))
    assert "hypafilter_deployed 0.0" in c.get("/metrics").text


@pytest.mark.parametrize("method", ["POST", "PUT", "PATCH", "DELETE"])
@pytest.mark.parametrize("path", ["/", "/api/summary", "/metrics", "/api/rules"])
def test_read_only(client, method, path):
    assert client.request(method, path).status_code == 405


def test_token_guards_everything_but_static_assets(sampler):
    c = TestClient(create_app(sampler, token="s3cret"))
    for path in ("/", "/api/summary", "/metrics", "/api/snapshot"):
        assert c.get(path).status_code == 401
        assert c.get(path, headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert c.get(path, headers={"Authorization": "Bearer s3cret"}).status_code == 200
        assert c.get(path + "?token=s3cret").status_code == 200
    assert c.get("/static/dashboard.js").status_code == 200


def test_listen_parsing_and_exposure_rule(monkeypatch, capsys):
    assert parse_listen("127.0.0.1:8080") == ("127.0.0.1", 8080)
    assert parse_listen("[::1]:9") == ("::1", 9)
    for bad in ("8080", "::1:80", "host:x", "h:70000"):
        with pytest.raises(HypafilterError):
            parse_listen(bad)
    assert is_loopback("127.0.0.5") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("example.org")
    check_exposure("127.0.0.1", None)
    check_exposure("0.0.0.0", "t")
    with pytest.raises(HypafilterError, match="needs a token"):
        check_exposure("0.0.0.0", None)
    monkeypatch.delenv("HYPAFILTER_DASHBOARD_TOKEN", raising=False)
    assert main(["dashboard", "--listen", "0.0.0.0:8080"]) == 2
    assert "needs a token" in capsys.readouterr().err


def test_dns_rebinding_is_refused_on_loopback(sampler):
    """Served on loopback without a token, the dashboard answers only requests for the machine's own names: a
    page of another site whose name resolves to 127.0.0.1 gets nothing."""
    from hypafilter.tools.dashboard.app import LOOPBACK_NAMES

    c = TestClient(create_app(sampler, allowed_hosts=LOOPBACK_NAMES | {"127.0.0.1"}))
    for host in ("127.0.0.1:8080", "localhost:8080", "[::1]:8080", "LOCALHOST"):
        assert c.get("/api/summary", headers={"host": host}).status_code == 200, host
    for host in ("evil.example:8080", "evil.example", "127.0.0.1.evil.example:8080"):
        r = c.get("/api/summary", headers={"host": host})
        assert r.status_code == 421 and "seq" not in r.text, host


def test_flowsync_in_summary_and_metrics():
    """The flow sync service's state file as `status` reads it: its gauges in /api/summary and /metrics, its
    counters accumulated across a restart of the service (a new pid counts from 0, the totals never go down)."""
    readings = iter(
        [
            {
                "wanted": True,
                "running": True,
                "pid": 10,
                "inserts": 5,
                "deletes": 1,
                "evictions": 0,
                "insert_failures": 2,
                "refreshes": 7,
                "events": 30,
                "errors": 0,
                "offloaded": 4,
                "occupancy": 4,
                "lag_p50_ms": 0.5,
                "lag_max_ms": 3.0,
                "lag_samples": 6,
                "last_error": "",
            },
            {
                "wanted": True,
                "running": True,
                "pid": 11,
                "inserts": 3,
                "deletes": 0,
                "evictions": 1,
                "insert_failures": 0,
                "refreshes": 1,
                "events": 9,
                "errors": 0,
                "offloaded": 2,
                "occupancy": 3,
                "lag_p50_ms": 0.25,
                "lag_max_ms": 1.0,
                "lag_samples": 3,
                "last_error": "",
            },
            {"wanted": True, "running": False, "reason": ""},
        ]
    )

    class Nic:
        def counters(self):
            return hw_counters(1)

        def hits(self, count):
            return [0] * count

    c = Collector(
        state_reader=lambda: {"generation": DEP.generation, "history": JOURNAL, "flowsync": {"wanted": True}},
        nic_opener=lambda d: Nic(),
        nf_reader=lambda ns, table: save((0, 0), (0, 0)),
        deployment_builder=lambda state: DEP,
        drift_checker=None,
        flowsync_reader=lambda state: next(readings),
    )
    s = Sampler(interval=1.0, keep=5)
    s.add(c.snapshot())
    s.add(c.snapshot())
    client = TestClient(create_app(s))
    fs = client.get("/api/summary").json()["flowsync"]
    assert fs["running"] and fs["offloaded"] == 2 and fs["occupancy"] == 3 and fs["lag_max_ms"] == 1.0
    assert fs["counters"]["inserts"] == 8 and fs["counters"]["insert_failures"] == 2
    fam = families(client)
    ops = {x.labels["op"]: x.value for x in fam["hypafilter_flowsync_operations"].samples}
    assert ops["inserts"] == 8 and ops["evictions"] == 1 and ops["refreshes"] == 8
    assert fam["hypafilter_flowsync_up"].samples[0].value == 1
    assert fam["hypafilter_flows_offloaded"].samples[0].value == 2
    lag = {x.labels["quantile"]: x.value for x in fam["hypafilter_flowsync_lag_seconds"].samples}
    assert lag == {"0.5": 0.00025, "1": 0.001}
    s.add(c.snapshot())  # the service went down: up 0, the counters stay
    fam = families(client)
    assert fam["hypafilter_flowsync_up"].samples[0].value == 0
    assert fam["hypafilter_flowsync_wanted"].samples[0].value == 1
    assert "hypafilter_flows_offloaded" not in fam
    assert {x.labels["op"]: x.value for x in fam["hypafilter_flowsync_operations"].samples}["inserts"] == 8
    assert 'id="flowsync"' in client.get("/").text


def test_policysync_in_summary_and_metrics():
    """The policy sync service's status as `status` reads it: following or not, its counters and lags in
    /api/summary and /metrics, the update buffer's slots; a change it cannot follow shows as not following."""
    readings = iter(
        [
            {
                "wanted": True,
                "running": True,
                "pid": 20,
                "following": True,
                "error": "",
                "safe": False,
                "events": 12,
                "changes": 3,
                "applied": 3,
                "unchanged": 1,
                "failed": 0,
                "resyncs": 0,
                "own": 4,
                "lag_safe_ms": {"n": 3, "p50": 0.5, "p99": 2.0, "max": 2.0, "last": 0.5},
                "lag_apply_ms": {"n": 3, "p50": 40.0, "p99": 90.0, "max": 90.0, "last": 40.0},
                "last_kind": "buffer",
                "buffer": {"used": 2, "depth": 16},
                "lease": {"armed": True, "expired": False, "left_ms": 880, "want_ms": 1000},
            },
            {
                "wanted": True,
                "running": True,
                "pid": 20,
                "following": False,
                "error": "change: bad",
                "safe": True,
                "lease": {"armed": True, "expired": True, "left_ms": 0, "want_ms": 1000},
            },
        ]
    )

    class Nic:
        def counters(self):
            return hw_counters(1)

        def hits(self, count):
            return [0] * count

    c = Collector(
        state_reader=lambda: {"generation": DEP.generation, "history": JOURNAL, "policysync": {"wanted": True}},
        nic_opener=lambda d: Nic(),
        nf_reader=lambda ns, table: save((0, 0), (0, 0)),
        deployment_builder=lambda state: DEP,
        drift_checker=None,
        flowsync_reader=lambda state: {},
        policysync_reader=lambda state: next(readings),
    )
    s = Sampler(interval=1.0, keep=5)
    s.add(c.snapshot())
    client = TestClient(create_app(s))
    ps = client.get("/api/summary").json()["policysync"]
    assert ps["following"] and ps["applied"] == 3 and ps["buffer"] == {"used": 2, "depth": 16}
    fam = families(client)
    ops = {x.labels["what"]: x.value for x in fam["hypafilter_policysync_operations"].samples}
    assert ops["applied"] == 3 and ops["own"] == 4 and ops["failed"] == 0
    lag = {(x.labels["stage"], x.labels["quantile"]): x.value for x in fam["hypafilter_policysync_lag_seconds"].samples}
    assert lag[("safe", "0.99")] == 0.002 and lag[("apply", "0.5")] == 0.04
    slots = {x.labels["what"]: x.value for x in fam["hypafilter_update_buffer_slots"].samples}
    assert slots == {"used": 2.0, "depth": 16.0}
    assert fam["hypafilter_policysync_following"].samples[0].value == 1
    assert fam["hypafilter_policysync_lease_armed"].samples[0].value == 1
    assert fam["hypafilter_policysync_lease_expired"].samples[0].value == 0
    s.add(c.snapshot())
    fam = families(client)
    assert fam["hypafilter_policysync_following"].samples[0].value == 0
    assert fam["hypafilter_policysync_shunting_all"].samples[0].value == 1
    assert fam["hypafilter_policysync_lease_expired"].samples[0].value == 1
    assert client.get("/api/summary").json()["policysync"]["lease"]["expired"] is True
    assert client.get("/api/summary").json()["policysync"]["error"] == "change: bad"
    assert 'id="policysync"' in client.get("/").text
