"""Dashboard web app on recorded snapshots: /api JSON, /metrics, the page, the token and the read-only rule."""

import pytest
from fastapi.testclient import TestClient
from hypafilter.cli import main
from hypafilter.cli.dashboard import check_exposure, is_loopback, parse_listen
from hypafilter.errors import HypafilterError
from hypafilter.tools.dashboard.app import create_app
from hypafilter.tools.dashboard.collector import Deployment, RuleInfo, Sampler, Snapshot, Update
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
        RuleInfo(0, "-A FORWARD -s 10.0.0.0/8 -p udp -j ACCEPT", "example.rules:3", "ACCEPT", True, 0, False),
        RuleInfo(
            1,
            "-A FORWARD -p tcp -m string --string BAD --algo bm -j DROP",
            "example.rules:4",
            "DROP",
            False,
            None,
            None,
        ),
        RuleInfo(2, "-A FORWARD -p tcp --dport 22 -j ACCEPT", "example.rules:5", "ACCEPT", True, 1, True),
    ),
    history=(
        Update(6, "deploy", 1000.0, 42.5, True, "cd" * 32),
        Update(0, "update", 1100.0, 0.3, False, "ef" * 32, error="deploy step 'netfilter' failed"),
        Update(7, "update", 1200.0, 1.25, True, "ab" * 32, steps=(("compile", 0.2), ("registers", 0.05))),
    ),
)


# Two seconds of recorded traffic: 1000 fwd/s, 250 drop/s, shunts by reason.
HW = (hw_counters(1000, 500, 100, 40, 2, host=3), hw_counters(3000, 1000, 300, 80, 2, host=3))
SNAPS = [
    Snapshot(1, 5000.0, 100.0, DEP, HW[0], (1000, 100, 40), {1: (30, 3000)}, (142, 9000)),
    Snapshot(2, 5002.0, 102.0, DEP, HW[1], (3000, 300, 80), {1: (70, 7000)}, (382, 20000)),
]


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
    assert t["shunted_by_reason"] == {"overrule": 300, "policy": 80, "unparsed": 2, "forced": 0}
    assert t["shunt_ratio"] == pytest.approx(382 / 4382)
    r = s["rates"]
    assert (r["forwarded"], r["dropped"], r["shunted"]) == (1000.0, 250.0, 120.0)
    assert r["shunted_by_reason"]["overrule"] == 100.0 and r["shunted_by_reason"]["policy"] == 20.0
    assert r["shunt_ratio"] == pytest.approx(120 / 1370)
    assert r["netfilter_main"] == 120.0


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


def test_metrics_use_prometheus_names_and_labels(client):
    res = client.get("/metrics")
    assert res.status_code == 200 and res.headers["content-type"].startswith("text/plain")
    fams = {f.name: f for f in text_string_to_metric_families(res.text)}
    frames = {(s.labels["path"], s.labels["reason"]): s.value for s in fams["hypafilter_hardware_frames"].samples}
    assert frames[("forwarded", "")] == 3000 and frames[("shunted", "overrule")] == 300
    assert frames[("shunted", "unparsed")] == 2 and frames[("dropped", "")] == 1000
    assert fams["hypafilter_hardware_frames"].type == "counter"
    assert fams["hypafilter_generation"].samples[0].value == 7
    assert fams["hypafilter_shunt_ratio"].samples[0].value == pytest.approx(120 / 1370)
    hits = {(s.labels["rule"], s.labels["source"]): s.value for s in fams["hypafilter_rule_hits"].samples}
    assert hits[("0", "hardware")] == 3000 and hits[("1", "netfilter")] == 70 and ("1", "hardware") not in hits
    hist = fams["hypafilter_update_duration_seconds"]
    assert hist.type == "histogram"
    buckets = {s.labels["le"]: s.value for s in hist.samples if s.name.endswith("_bucket")}
    assert buckets["1.0"] == 0 and buckets["2.5"] == 1 and buckets["60.0"] == 2 and buckets["+Inf"] == 2
    count = next(s.value for s in hist.samples if s.name.endswith("_count"))
    assert count == 2  # the failed update is not a duration of a deployment
    updates = {(s.labels["kind"], s.labels["result"]): s.value for s in fams["hypafilter_updates"].samples}
    assert updates == {("deploy", "ok"): 1, ("update", "failed"): 1, ("update", "ok"): 1}


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
