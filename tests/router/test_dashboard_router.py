"""GET /dashboard on `kvserve router`, in a real headless browser: one panel per replica of
/replicas, each showing what that replica's own /metrics says (read through the router's
/dashboard/replica_metrics), and a panel of the router's own counters."""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import quote

import pytest

from tests.browser import (
    STABLE,
    check_engine_panel,
    headless_chromium,
    save_screenshot,
    settled,
    wait_idle,
    wait_polls,
)
from tests.router.router_procs import REPLICA, Router, spawn_router, stop_all, wait_router
from tests.serving import http_request, metric_values


@pytest.fixture(scope="module")
def router(cluster, tmp_path_factory) -> Iterator[Router]:
    urls = [a for r in cluster for a in ("--replica", r.url)]
    r = spawn_router([*urls, "--policy", "round_robin"], tmp_path_factory.mktemp("dashboard") / "router.log")
    try:
        yield wait_router(r)
    finally:
        stop_all([r.proc])


def _complete(base: str, i: int) -> str:
    status, body, headers = http_request("POST", f"{base}/v1/completions",
                                         {"prompt": f"Dashboard request {i}: hello", "max_tokens": 3,
                                          "temperature": 0}, timeout=120)
    assert status == 200, body
    assert json.loads(body)["usage"]["completion_tokens"] == 3
    return headers[REPLICA]


def test_replica_metrics_route_only_reaches_the_replicas(router, cluster):
    status, body, _ = http_request("GET", f"{router.base}/dashboard/replica_metrics?replica={quote(cluster[0].url)}")
    assert status == 200 and b"kvserve:num_requests_running" in body
    status, body, _ = http_request("GET", f"{router.base}/dashboard/replica_metrics?replica="
                                   + quote("http://127.0.0.1:1"))
    assert status == 404 and "not one of the router's replicas" in json.loads(body)["error"]["message"]
    status, body, headers = http_request("GET", f"{router.base}/dashboard")
    assert status == 200 and b'data-mode="router"' in body and headers["content-type"].startswith("text/html")


def test_router_dashboard_has_a_panel_per_replica(router, cluster, tmp_path):
    urls = [r.url for r in cluster]
    with headless_chromium(tmp_path / "profile") as driver:
        driver.get(f"{router.base}/dashboard?interval=0.25")
        for source in ["router", *urls]:
            wait_polls(driver, source, 2)
        with ThreadPoolExecutor(3) as ex:  # round robin: two on each replica
            served = list(ex.map(lambda i: _complete(router.base, i), range(6)))
        assert sorted(served) == sorted(urls * 2)
        for url in urls:
            wait_idle(url)

        panels = driver.execute_script("return [...document.querySelectorAll('[data-source]')]"
                                       ".map(p => [p.dataset.source, p.dataset.healthy ?? null])")
        assert panels == [["router", None], *[[u, "true"] for u in urls]]
        for url in urls:  # each panel against that replica's own /metrics, not the router's copy
            m, shown = settled(driver, url, url, STABLE)
            check_engine_panel(shown, m, tiers=[])

        # The router's own counters: every sample of its /metrics, with its labels.
        m, shown = settled(driver, router.base, "router", list(metric_values(router.base)))
        samples = {k: v for k, v in m.items() if not k.split("{")[0].endswith("_created")}  # the page drops those
        as_metrics = {k.replace("|", "{", 1) + "}" if "|" in k else k: v for k, v in shown.items()}
        assert {k: v for k, v in as_metrics.items() if k.startswith("kvserve_router:")} == samples
        for url in urls:
            assert shown[f'kvserve_router:requests_total|replica="{url}",status="200"'] >= 2
        assert shown["router:requests"] == sum(v for k, v in m.items()
                                               if k.startswith("kvserve_router:requests_total{"))

        save_screenshot(driver, tmp_path, "dashboard-router.png")
