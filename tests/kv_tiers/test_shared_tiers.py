"""KV tiers across processes: two servers sharing one Redis, a Redis outage mid-run, the
cached-token split and tier metrics over HTTP, and `kvserve cache stats|clear`."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import time

import pytest

from tests.serving import MODEL, TINY_SERVER_ARGS, http_request, metric_values, running_server

openai = pytest.importorskip("openai")

BS = 16


def _prompt(seed: int, length: int = 90) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 300) for _ in range(length)]


def _complete(client, prompt: list[int], **extra):
    return client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0,
                                     extra_body={"ignore_eos": True, **extra})


def _wait_for(pred, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _run(cmd: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False)


def _client(srv):
    return openai.OpenAI(base_url=srv.v1, api_key="x", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory):
    return str(tiny_model_factory("llama"))


def test_server_reports_host_tier_hits(model_dir, tmp_path):
    """Through `kvserve serve` (engine in its own process): evicted blocks come back from RAM,
    and usage splits the cached tokens by tier."""
    args = [model_dir, "--dtype", "float32", "--num-kv-blocks", "16", "--served-model-name", MODEL,
            "--kv-offload-cpu", "1MiB"]
    with running_server(args, tmp_path / "log") as srv:
        client = _client(srv)
        first = _complete(client, _prompt(30))
        for i in range(3):  # fill the 16-block pool with other prompts: the first one's blocks go to RAM
            _complete(client, _prompt(31 + i))
        again = _complete(client, _prompt(30))
        details = again.usage.prompt_tokens_details
        assert details.cached_tokens == 5 * BS and details.cached_tokens_by_tier.get("cpu", 0) > 0, details
        assert again.choices[0].text == first.choices[0].text
        assert metric_values(srv.base)['kvserve:kv_tier_hits_total{tier="cpu"}'] > 0


def test_second_server_reuses_kv_the_first_computed(model_dir, redis_server, tmp_path):
    """Write-through is the default: B reuses what A computed without A evicting anything."""
    args = [model_dir, *TINY_SERVER_ARGS, "--kv-remote", redis_server.url]
    prompt = _prompt(1)
    with running_server(args, tmp_path / "a.log") as a, running_server(args, tmp_path / "b.log") as b:
        first = _complete(_client(a), prompt)
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        # the write-through runs in the background: wait until A's 5 blocks are in Redis
        key = 'kvserve:kv_tier_bytes_offloaded_total{tier="remote"}'
        assert _wait_for(lambda: metric_values(a.base).get(key, 0) >= 5 * 8192), "A never wrote its blocks"
        second = _complete(_client(b), prompt)
        details = second.usage.prompt_tokens_details
        assert details.cached_tokens == 5 * BS and details.cached_tokens_by_tier == {"device": 0, "remote": 5 * BS}
        assert second.choices[0].text == first.choices[0].text
        m = metric_values(b.base)
        assert m['kvserve:kv_tier_hits_total{tier="remote"}'] == 5 * BS
        # another tenant's salt never sees A's entries
        salted = _complete(_client(b), prompt, cache_salt="other-tenant")
        assert salted.usage.prompt_tokens_details.cached_tokens == 0


def test_redis_outage_mid_run_every_request_completes(model_dir, redis_server, tmp_path):
    args = [model_dir, "--dtype", "float32", "--num-kv-blocks", "16", "--served-model-name", MODEL,
            "--kv-offload-cpu", "40KiB", "--kv-remote", redis_server.url]
    prompts = [_prompt(10 + i) for i in range(6)]
    with running_server(args, tmp_path / "log") as srv:
        client = _client(srv)
        ref = [_complete(client, p).choices[0].text for p in prompts]
        redis_server.stop()
        during = [_complete(client, p).choices[0].text for p in prompts]
        redis_server.start()
        after = [_complete(client, p).choices[0].text for p in prompts]
        assert during == ref and after == ref
        assert http_request("GET", f"{srv.base}/health")[0] == 200
        assert srv.log_text().count("remote KV tier unavailable") == 1


def test_cache_stats_and_clear(model_dir, tmp_path):
    disk = tmp_path / "kv"
    args = [model_dir, *TINY_SERVER_ARGS, "--kv-offload-cpu", "1MiB", "--kv-offload-disk", str(disk)]
    cli = [sys.executable, "-m", "kvserve.cli", "cache"]
    with running_server(args, tmp_path / "log") as srv:
        _complete(_client(srv), _prompt(20))
        out = _run([*cli, "stats", "--url", srv.base])
        stats = json.loads(out.stdout)
        assert stats["kv_tier_cpu_capacity_bytes"] == 1 << 20 and "kv_tier_disk_entries" in stats
        out = _run([*cli, "clear", "--url", srv.base])
        assert json.loads(out.stdout)["cleared"]["device"] == 5  # the prompt's 5 idle cached blocks
        again = _complete(_client(srv), _prompt(20))
        assert again.usage.prompt_tokens_details.cached_tokens == 0
    # after the server stopped, its device blocks were saved to disk: inspect and clear offline
    stats = json.loads(_run([*cli, "stats", "--disk", str(disk)]).stdout)
    assert stats["disk"]["entries"] == 5
    cleared = json.loads(_run([*cli, "clear", "--disk", str(disk)]).stdout)
    assert cleared == {"cleared": {"disk": 5}} and not list(disk.rglob("*.kv"))
    bad = _run([*cli, "stats", "--disk", str(tmp_path / "missing")])
    assert bad.returncode == 2 and "--disk" in bad.stderr
