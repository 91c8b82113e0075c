"""A live dashboard at GET /dashboard, on `kvserve serve` and on `kvserve router`.

The page (dashboard.html beside this file) is one self-contained HTML file: no CDN, no
library. Its script polls the same Prometheus text as /metrics and draws the charts itself,
so the dashboard can never disagree with what a scraper sees. On the router it polls the
router's /metrics for its own counters, lists the replicas from /replicas, and reads each
replica's /metrics through GET /dashboard/replica_metrics?replica=URL (router/app.py).

Every number on the page sits in an element with `data-metric` (plus `data-tier` for a KV
tier, `data-labels` for a labelled router sample) and `data-value`, the raw number, inside a
panel with `data-source` ("server", "router" or a replica's URL) and `data-polls`, the count
of polls so far; tests read them from a real browser (tests/server/test_dashboard.py).
"""

from __future__ import annotations

from functools import cache
from importlib.resources import files

from fastapi import FastAPI
from fastapi.responses import HTMLResponse

_MODE_MARK = 'data-mode="server"'


@cache
def dashboard_html(router: bool = False) -> str:
    html = files("kvserve.server").joinpath("dashboard.html").read_text(encoding="utf-8")
    assert _MODE_MARK in html, "dashboard.html lost its mode attribute"
    return html.replace(_MODE_MARK, 'data-mode="router"') if router else html


def add_dashboard(app: FastAPI, *, router: bool = False) -> None:
    """GET /dashboard; no API key, like /metrics (it shows only what /metrics shows)."""

    @app.get("/dashboard", response_class=HTMLResponse)
    async def dashboard() -> HTMLResponse:
        """Live charts of the /metrics counters (kvserve extension)."""
        return HTMLResponse(dashboard_html(router), headers={"cache-control": "no-store"})
