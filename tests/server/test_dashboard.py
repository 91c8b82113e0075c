"""GET /dashboard in a real headless browser: while requests run on a real `kvserve serve`, the
page polls /metrics, and once they are done every number it shows equals /metrics read at the
same moment (counters, gauges, the host-RAM tier, latency percentiles computed like Prometheus'
histogram_quantile)."""

from __future__ import annotations

import random
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.browser import (
    STABLE,
    TIER,
    chart_series,
    check_engine_panel,
    headless_chromium,
    save_screenshot,
    settled,
    wait_idle,
    wait_polls,
)
from tests.serving import MODEL, Server, http_request, open_stream, running_server, sse_events

KEY = "sk-dashboard"
AUTH = {"authorization": f"Bearer {KEY}"}
# A 16-block pool (block size 16) and a host-RAM tier: three 90-token prompts at once overflow
# the pool (evictions to RAM, perhaps preemptions), and the first prompt comes back from RAM.
# N-gram speculative decoding too (the panel's draft numbers).
ARGS = ["--dtype", "float32", "--num-kv-blocks", "16", "--served-model-name", MODEL, "--kv-offload-cpu", "1MiB",
        "--api-key", KEY, "--speculative-config",
        '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "adaptive": false}']


@pytest.fixture(scope="module")
def tiered_server(tiny_model_factory, tmp_path_factory) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("dashboard") / "server.log"
    with running_server([str(tiny_model_factory("llama")), *ARGS], log) as srv:
        yield srv


def _prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 300) for _ in range(90)]


def _stream(base: str, seed: int) -> dict:
    """One streamed completion; its final usage."""
    body = {"model": MODEL, "prompt": _prompt(seed), "max_tokens": 12, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    conn, resp = open_stream(base, "/v1/completions", body, AUTH)
    try:
        assert resp.status == 200, resp.read()
        usage = [e["usage"] for e in sse_events(resp) if isinstance(e, dict) and e.get("usage")]
        return usage[-1]
    finally:
        conn.close()


def test_dashboard_shows_what_metrics_counts(tiered_server, tmp_path):
    base = tiered_server.base
    assert http_request("GET", f"{base}/v1/models")[0] == 401  # the key guards the API ...
    status, page, headers = http_request("GET", f"{base}/dashboard")  # ... not the dashboard
    assert status == 200 and headers["content-type"].startswith("text/html"), page[:200]
    assert b"<script src" not in page and b"https://" not in page  # self-contained: nothing from elsewhere

    with headless_chromium(tmp_path / "profile") as driver:
        driver.get(f"{base}/dashboard?interval=0.25")
        wait_polls(driver, "server", 2)
        usages = [_stream(base, 30)]
        with ThreadPoolExecutor(3) as ex:  # three at once overflow the 16 blocks
            usages += ex.map(lambda s: _stream(base, s), [31, 32, 33])
        usages.append(_stream(base, 30))  # its blocks come back from RAM
        generated = sum(u["completion_tokens"] for u in usages)
        wait_idle(base)
        m, shown = settled(driver, base, "server", STABLE + [f'{k}{{tier="cpu"}}' for k in TIER])
        save_screenshot(driver, tmp_path, "dashboard-server.png")

        assert m["kvserve:generation_tokens_total"] == generated == 5 * 12
        assert m['kvserve:kv_tier_hits_total{tier="cpu"}'] > 0  # the tier had work to show
        check_engine_panel(shown, m, ["cpu"])
        spec = [f"kvserve:spec_decode_num_{k}_total" for k in ("drafts", "draft_tokens", "accepted_tokens")]
        assert m[spec[0]] > 0 and all(shown[k] == m[k] for k in spec), [(shown.get(k), m[k]) for k in spec]
        assert shown["spec:acceptance"] == pytest.approx(m[spec[2]] / m[spec[1]], rel=1e-12)
        # Each request's usage counts its drafts as OpenAI's predicted outputs do: kept and rejected.
        details = [u["completion_tokens_details"] for u in usages]
        assert sum(d["accepted_prediction_tokens"] for d in details) == m[spec[2]]
        assert sum(d["accepted_prediction_tokens"] + d["rejected_prediction_tokens"] for d in details) == m[spec[1]]
        assert set(chart_series(driver, "server", "spec")) == {"acceptance"}
        # The charts drew the requests as they ran: tokens/s and per-poll latencies between polls.
        tokens = chart_series(driver, "server", "tokens")
        assert tokens["generation"]["max"] > 0 and tokens["prompt"]["max"] > 0
        for chart in ("ttft", "itl"):
            series = chart_series(driver, "server", chart)
            assert set(series) == {"p50", "p90", "p99"} and series["p50"]["points"] >= 1, (chart, series)
        assert set(chart_series(driver, "server", "kv")) == {"device", "cpu"}
        # Nothing came from anywhere but this server.
        resources = driver.execute_script("return performance.getEntriesByType('resource').map(e => e.name)")
        assert resources and all(r.startswith(f"{base}/") for r in resources), resources
