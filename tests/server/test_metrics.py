"""/metrics counts, client disconnects freeing KV, and many concurrent streams."""

from __future__ import annotations

import asyncio
import time

import pytest

from kvserve.engine.defaults import BUDGET_CAP, BUDGET_FLOOR

from tests.serving import LONG_PROMPT, MODEL, PROMPT, metric_values, open_stream, sse_events

openai = pytest.importorskip("openai")

K = "kvserve:"


def _wait_idle(base: str, timeout: float = 20) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = metric_values(base)
        if m[f"{K}num_requests_running"] == 0 and m[f"{K}num_requests_waiting"] == 0 and \
                m[f"{K}kv_cache_usage_perc"] == 0:
            return m
        assert time.monotonic() < deadline, f"server not idle: {m}"
        time.sleep(0.1)


def _delta(after: dict[str, float], before: dict[str, float], name: str) -> float:
    return after.get(name, 0.0) - before.get(name, 0.0)


def test_metrics_move_as_requests_say(server, client, tokenizer):
    before = _wait_idle(server)
    n_prompt = len(tokenizer(LONG_PROMPT)["input_ids"])
    r1 = client.completions.create(model=MODEL, prompt=LONG_PROMPT, max_tokens=5, temperature=0,
                                   extra_body={"ignore_eos": True, "cache_salt": "metrics-test"})
    r2 = client.completions.create(model=MODEL, prompt=LONG_PROMPT, max_tokens=5, temperature=0,
                                   extra_body={"ignore_eos": True, "cache_salt": "metrics-test"})
    after = _wait_idle(server)
    assert r1.usage.completion_tokens == r2.usage.completion_tokens == 5
    cached = r2.usage.prompt_tokens_details.cached_tokens
    assert r1.usage.prompt_tokens_details.cached_tokens == 0 and cached > 0
    assert _delta(after, before, f"{K}prompt_tokens_total") == 2 * n_prompt
    assert _delta(after, before, f"{K}generation_tokens_total") == 10
    assert _delta(after, before, f'{K}request_success_total{{finished_reason="length"}}') == 2
    assert _delta(after, before, f"{K}time_to_first_token_seconds_count") == 2
    assert _delta(after, before, f"{K}inter_token_latency_seconds_count") == 8
    assert _delta(after, before, f"{K}e2e_request_latency_seconds_count") == 2
    assert _delta(after, before, f"{K}request_queue_time_seconds_count") == 2
    assert _delta(after, before, f"{K}prefix_cache_queries_total") == 2 * n_prompt
    assert _delta(after, before, f"{K}prefix_cache_hits_total") == cached
    assert after[f"{K}num_preemptions_total"] == before.get(f"{K}num_preemptions_total", 0)
    assert _delta(after, before, f"{K}e2e_request_latency_seconds_sum") > 0
    # the step budget the server sized from a prefill timed at start: a power of two in the bounds
    budget = int(after[f"{K}max_num_batched_tokens"])
    assert BUDGET_FLOOR <= budget <= BUDGET_CAP and budget & (budget - 1) == 0, budget


def test_disconnect_mid_stream_frees_kv(server):
    idle = _wait_idle(server)
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 400, "temperature": 0, "ignore_eos": True,
            "stream": True}
    conn, resp = open_stream(server, "/v1/completions", body)
    events = sse_events(resp)
    for _ in range(3):
        assert next(events)["choices"]
    busy = metric_values(server)
    assert busy[f"{K}num_requests_running"] == 1 and busy[f"{K}kv_cache_usage_perc"] > 0
    conn.sock.close()  # the client goes away mid-stream
    conn.close()
    after = _wait_idle(server)  # usage back to its idle value, well before 400 tokens could finish
    assert after[f"{K}kv_cache_usage_perc"] == idle[f"{K}kv_cache_usage_perc"]
    assert _delta(after, idle, f'{K}request_success_total{{finished_reason="abort"}}') == 1
    assert _delta(after, idle, f"{K}generation_tokens_total") < 400


def test_32_concurrent_streams(server, tiny_server):
    async def one(client, i: int) -> tuple[int, int, str, int]:
        max_tokens = 4 + i % 7
        stream = await client.completions.create(
            model=MODEL, prompt=f"{PROMPT} Request {i}.", max_tokens=max_tokens, temperature=0.7, seed=i,
            stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        text, usage = "", None
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].text
            if chunk.usage is not None:
                usage = chunk.usage
        return max_tokens, usage.completion_tokens, text, usage.prompt_tokens

    async def run_all():
        async with openai.AsyncOpenAI(base_url=tiny_server.v1, api_key="x", max_retries=0, timeout=120) as c:
            return await asyncio.gather(*(one(c, i) for i in range(32)))

    before = _wait_idle(server)
    results = asyncio.run(run_all())
    after = _wait_idle(server)
    assert [want for want, *_ in results] == [got for _, got, *_ in results]
    assert all(text for _, _, text, _ in results)
    assert _delta(after, before, f"{K}generation_tokens_total") == sum(want for want, *_ in results)
    assert _delta(after, before, f"{K}prompt_tokens_total") == sum(p for *_, p in results)
    assert _delta(after, before, f'{K}request_success_total{{finished_reason="length"}}') == 32
