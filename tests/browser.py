"""Headless chromium for the /dashboard tests: Debian's chromium and chromedriver (`make test` and
.ci/run install them), driven by selenium on loopback; nothing is downloaded. Missing browser:
skipped locally, a failure under CI (like redis-server in tests/kv_tiers/conftest.py)."""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.serving import metric_values

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"

# Counters and gauges that stay put once no request runs: shown exactly as /metrics has them.
STABLE = ["kvserve:num_requests_running", "kvserve:num_requests_waiting", "kvserve:kv_cache_usage_perc",
          "kvserve:generation_tokens_total", "kvserve:prompt_tokens_total", "kvserve:prefix_cache_queries_total",
          "kvserve:prefix_cache_hits_total", "kvserve:num_preemptions_total"]
TIER = ["kvserve:kv_tier_usage_bytes", "kvserve:kv_tier_capacity_bytes", "kvserve:kv_tier_queries_total",
        "kvserve:kv_tier_hits_total"]
HISTS = {"ttft": "kvserve:time_to_first_token_seconds", "itl": "kvserve:inter_token_latency_seconds"}


def _missing(message: str) -> None:
    if os.environ.get("CI"):
        pytest.fail(message)
    pytest.skip(message)


@contextlib.contextmanager
def headless_chromium(profile: Path) -> Iterator[Any]:
    """A selenium WebDriver on the system browser, closed on exit."""
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        _missing("selenium not installed; `make setup` installs the test extra")
    if not (Path(CHROMIUM).is_file() and Path(CHROMEDRIVER).is_file()) and not (
            shutil.which("chromium") and shutil.which("chromedriver")):
        _missing("chromium / chromedriver not found; install them to run the dashboard tests "
                 "(Debian/Ubuntu: apt-get install -y chromium chromium-driver, or `make browser`)")
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM if Path(CHROMIUM).is_file() else shutil.which("chromium")
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--no-first-run", "--no-proxy-server", "--disable-background-networking",
                "--disable-component-update", "--disable-sync", "--window-size=1400,2200",
                f"--user-data-dir={profile}"):
        opts.add_argument(arg)
    service = Service(executable_path=CHROMEDRIVER if Path(CHROMEDRIVER).is_file() else shutil.which("chromedriver"))
    driver = webdriver.Chrome(options=opts, service=service)
    try:
        yield driver
    finally:
        driver.quit()


def save_screenshot(driver: Any, tmp_path: Path, name: str) -> Path:
    """The whole page as PNG in $KVSERVE_TEST_ARTIFACTS, else in the test's tmp_path; prints where."""
    d = Path(os.environ.get("KVSERVE_TEST_ARTIFACTS") or tmp_path)
    d.mkdir(parents=True, exist_ok=True)
    height = driver.execute_script("return document.documentElement.scrollHeight")
    driver.set_window_size(1400, min(max(height, 600), 8000))
    path = d / name
    driver.save_screenshot(str(path))
    print(f"dashboard screenshot: {path}")
    return path


def wait_polls(driver: Any, source: str, n: int, timeout: float = 20.0) -> None:
    """Until the panel of `source` has polled /metrics at least n times in all."""
    from selenium.webdriver.support.ui import WebDriverWait

    def polled(d: Any) -> bool:
        return d.execute_script("const p = document.querySelector(`[data-source=\"${arguments[0]}\"]`);"
                                "return p ? Number(p.dataset.polls) : 0;", source) >= n
    WebDriverWait(driver, timeout, poll_frequency=0.1).until(polled, f"panel {source!r} to poll {n} times")


def panel_polls(driver: Any, source: str) -> int:
    return driver.execute_script("return Number(document.querySelector(`[data-source=\"${arguments[0]}\"]`)"
                                 ".dataset.polls);", source)


def panel_values(driver: Any, source: str) -> dict[str, float]:
    """The numbers a panel shows, as {metric: value}, {'metric|tier': value} or {'metric|labels': value}
    (NaN where the page shows none)."""
    raw = driver.execute_script("""
        const out = {};
        const panel = document.querySelector(`[data-source="${arguments[0]}"]`);
        for (const el of panel.querySelectorAll('.body [data-metric]')) {
            const extra = el.dataset.tier ?? el.dataset.labels;
            out[extra === undefined ? el.dataset.metric : el.dataset.metric + '|' + extra] = el.dataset.value;
        }
        return out;""", source)
    return {k: float(v) if v else math.nan for k, v in raw.items()}


def chart_series(driver: Any, source: str, chart: str) -> dict[str, dict[str, float]]:
    """{series name: {'points': finite points drawn, 'max': largest value}} of one chart of a panel."""
    return driver.execute_script("""
        const out = {};
        const fig = document.querySelector(`[data-source="${arguments[0]}"] [data-chart="${arguments[1]}"]`);
        for (const p of fig ? fig.querySelectorAll('path[data-series]') : [])
            out[p.dataset.series] = {points: Number(p.dataset.points), max: Number(p.dataset.max)};
        return out;""", source, chart)


def histogram_quantile(q: float, buckets: list[tuple[float, float]]) -> float:
    """Prometheus' histogram_quantile on cumulative (le, count) pairs: what the page must compute."""
    b = sorted(buckets)
    if len(b) < 2 or b[-1][0] != math.inf:
        return math.nan
    top, mono = 0.0, []
    for le, c in b:
        top = max(top, c)
        mono.append((le, top))
    total = mono[-1][1]
    if total == 0:
        return math.nan
    rank = q * total
    i = next((i for i in range(len(mono) - 1) if mono[i][1] >= rank), len(mono) - 1)
    if i == len(mono) - 1:
        return mono[-2][0]
    start, count = 0.0, mono[i][1]
    if i > 0:
        start, count, rank = mono[i - 1][0], count - mono[i - 1][1], rank - mono[i - 1][1]
    return start + (mono[i][0] - start) * (rank / count)


def buckets_of(metrics: dict[str, float], name: str) -> list[tuple[float, float]]:
    """The (le, cumulative count) pairs of histogram `name` in tests.serving.metric_values' output."""
    prefix = f'{name}_bucket{{le="'
    return [(float(k[len(prefix):-2]), v) for k, v in metrics.items() if k.startswith(prefix)]


def wait_idle(base: str, timeout: float = 30.0) -> None:
    """Until the server at `base` runs and queues no request."""
    deadline = time.monotonic() + timeout
    while (m := metric_values(base))["kvserve:num_requests_running"] or m["kvserve:num_requests_waiting"]:
        assert time.monotonic() < deadline, "requests still running"
        time.sleep(0.1)


def settled(driver, base: str, source: str, keys: list[str], tries: int = 5) -> tuple[dict, dict]:
    """(/metrics, the panel's numbers) from a poll the page made between two equal reads of `keys`."""
    for _ in range(tries):
        before = metric_values(base)
        wait_polls(driver, source, panel_polls(driver, source) + 2)
        shown = panel_values(driver, source)
        after = metric_values(base)
        if all(before.get(k) == after.get(k) for k in keys):
            return before, shown
    pytest.fail(f"/metrics of {base} kept changing: {before} vs {after}")


def check_engine_panel(shown: dict[str, float], m: dict[str, float], tiers: list[str]) -> None:
    """Every number of an engine panel against /metrics (shared with the router's test)."""
    for k in STABLE:
        assert shown[k] == m[k], (k, shown[k], m[k])
    assert shown["kvserve:num_requests_running"] == 0 and shown["kvserve:num_requests_waiting"] == 0
    hits, queries = m["kvserve:prefix_cache_hits_total"], m["kvserve:prefix_cache_queries_total"]
    assert shown["prefix_cache:hit_rate"] == pytest.approx(hits / queries, rel=1e-12)
    for t in tiers:
        for k in TIER:
            assert shown[f"{k}|{t}"] == m[f'{k}{{tier="{t}"}}'], (k, t)
        assert shown[f"kv_tier:hit_rate|{t}"] == pytest.approx(
            m[f'kvserve:kv_tier_hits_total{{tier="{t}"}}'] / m[f'kvserve:kv_tier_queries_total{{tier="{t}"}}'])
    assert not any(k.startswith("kvserve:kv_tier_") for k in shown if k.split("|")[-1] not in tiers)
    for short, name in HISTS.items():
        b = buckets_of(m, name)
        assert shown[f"{short}:count"] == m[f"{name}_count"] > 0
        ps = [shown[f"{short}:p{p}"] for p in (50, 90, 99)]
        for p, got in zip((0.5, 0.9, 0.99), ps):
            assert got == pytest.approx(histogram_quantile(p, b), rel=1e-9), (short, p)
        top = max(le for le, _ in b if le != math.inf)
        assert 0 < ps[0] <= ps[1] <= ps[2] <= top, (short, ps)
