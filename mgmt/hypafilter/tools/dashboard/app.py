"""The dashboard's FastAPI application: the page, /api JSON and /metrics, all read-only views of the sampler's snapshots."""

from __future__ import annotations

import hmac
from pathlib import Path

from fastapi import FastAPI, Query, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response
from fastapi.staticfiles import StaticFiles
from fastapi.templating import Jinja2Templates

from hypafilter import __version__
from hypafilter.tools.dashboard import metrics, views
from hypafilter.tools.dashboard.collector import Sampler

HERE = Path(__file__).resolve().parent
API_ENDPOINTS = {
    "/api/summary": "latest totals and rates (forwarded, dropped, shunted by reason, shunt ratio)",
    "/api/series?last=N": "rates between consecutive snapshots, oldest first",
    "/api/rules": "per-rule view, one page (?offset=&limit=&sort=index|hits|hw_hits|nf_packets|hits_rate"
    "&order=asc|desc&q=filter): kind, shunting, hardware hits, netfilter counters",
    "/api/deployment": "generation, policy, partition, update history with durations",
    "/api/snapshot?seq=N": "raw counters of the newest (or a given) snapshot",
    "/metrics": "Prometheus exposition",
}


def _authorized(request: Request, token: str) -> bool:
    given = ""
    auth = request.headers.get("authorization", "")
    if auth.lower().startswith("bearer "):
        given = auth[7:].strip()
    elif "token" in request.query_params:
        given = request.query_params["token"]
    return bool(given) and hmac.compare_digest(given.encode(), token.encode())


LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})


def _host_name(header: str) -> str:
    """The host part of a Host header ("[::1]:8080" -> "::1", "localhost:80" -> "localhost")."""
    if header.startswith("["):
        return header[1 : header.find("]")] if "]" in header else header
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


def create_app(
    sampler: Sampler,
    token: str | None = None,
    allowed_hosts: frozenset[str] | None = None,
    rule_series_limit: int = metrics.RULE_SERIES_LIMIT,
) -> FastAPI:
    """The web app over `sampler`. With a token, every request except static assets needs it. With
    `allowed_hosts`, a request whose Host header names another host is refused: a page on another site whose
    name resolves to this loopback address (DNS rebinding) cannot read the dashboard."""
    app = FastAPI(title="hypafilter dashboard", version=__version__, docs_url=None, redoc_url=None, openapi_url=None)
    templates = Jinja2Templates(directory=str(HERE / "templates"))
    app.mount("/static", StaticFiles(directory=str(HERE / "static")), name="static")

    @app.middleware("http")
    async def guard(request: Request, call_next):
        # Read-only by construction: nothing but GET/HEAD reaches a handler.
        if request.method not in ("GET", "HEAD"):
            return JSONResponse({"detail": "read-only"}, status_code=405, headers={"Allow": "GET, HEAD"})
        if allowed_hosts is not None and _host_name(request.headers.get("host", "")).lower() not in allowed_hosts:
            return JSONResponse({"detail": "unknown Host header"}, status_code=421)
        # Static assets are the page's own code and carry no data; everything else is guarded.
        public = request.url.path.startswith("/static/") or request.url.path == "/favicon.ico"
        if token and not public and not _authorized(request, token):
            return JSONResponse(
                {"detail": "token required"}, status_code=401, headers={"WWW-Authenticate": 'Bearer realm="hypafilter"'}
            )
        response = await call_next(request)
        if not request.url.path.startswith("/static/"):
            response.headers["Cache-Control"] = "no-store"
        return response

    @app.get("/", response_class=HTMLResponse)
    def index(request: Request):
        return templates.TemplateResponse(
            request,
            "index.html",
            {"version": __version__, "interval": sampler.interval, "reasons": views.SHUNT_REASONS},
        )

    @app.get("/favicon.ico")
    def favicon():
        return Response(status_code=204)  # none; answering keeps the browser console free of 404s

    @app.get("/healthz")
    def healthz():
        latest = sampler.latest()
        return {"ok": latest is not None, "seq": latest.seq if latest else 0, "sampler_error": sampler.last_error}

    @app.get("/api/")
    @app.get("/api")
    def api_index():
        return {"endpoints": API_ENDPOINTS, "interval": sampler.interval}

    @app.get("/api/summary")
    def api_summary():
        return views.summary(sampler.snapshots()[-2:])

    @app.get("/api/series")
    def api_series(last: int | None = Query(default=None, ge=0)):
        return views.series(sampler.snapshots(), last)

    @app.get("/api/rules")
    def api_rules(
        offset: int = Query(default=0, ge=0),
        limit: int = Query(default=100, ge=0, le=views.MAX_PAGE),
        sort: str = Query(default="index", pattern="^(" + "|".join(views.RULE_SORTS) + ")$"),
        order: str | None = Query(default=None, pattern="^(asc|desc)$"),
        q: str | None = Query(default=None, max_length=200),
    ):
        return views.rules_view(sampler.snapshots()[-2:], offset, limit, sort, order, q)

    @app.get("/api/deployment")
    def api_deployment():
        latest = sampler.latest()
        return views.deployment_view(latest.deployment if latest else None)

    @app.get("/api/snapshot")
    def api_snapshot(seq: int | None = Query(default=None, ge=0)):
        snap = sampler.get(seq) if seq is not None else sampler.latest()
        if snap is None:
            return JSONResponse({"detail": "no such snapshot (not taken yet, or no longer kept)"}, status_code=404)
        return views.snapshot_view(snap)

    @app.get("/metrics")
    def prometheus():
        return Response(
            metrics.render(lambda: sampler.snapshots()[-2:], rule_series_limit), media_type="text/plain; version=0.0.4"
        )

    return app
