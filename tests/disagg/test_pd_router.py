"""`kvserve router --launch-pd 1 1`: real prefill and decode engines behind the router; what the
client gets equals one engine alone (offline LLM on the same weights), and a prefill engine that
dies costs nothing but the transfer."""

from __future__ import annotations

import json
import os
import signal

import pytest

from kvserve import LLM, SamplingParams
from tests.router.router_procs import START_TIMEOUT, spawn_router, wait_router, wait_until
from tests.serving import LONG_PROMPT, MODEL, TINY_SERVER_ARGS, http_request, metric_values, open_stream, sse_events

ARGS = [*TINY_SERVER_ARGS, "--block-size", "4"]
PROMPTS = [LONG_PROMPT, "Prefix caching reuses the KV cache of a shared prompt. " * 3, "Hi"]


@pytest.mark.slow
def test_launch_pd_equals_one_engine(tiny_model_factory, tmp_path):
    model = str(tiny_model_factory("llama"))
    llm = LLM(model=model, dtype="float32", block_size=4, num_kv_blocks=256)
    want = [o.outputs[0].text for o in llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=10),
                                                     use_tqdm=False)]
    llm.engine.close()
    r = spawn_router(["--launch-pd", "1", "1", "--pd-decision", "always", "--", model, *ARGS], tmp_path / "router.log")
    try:
        wait_router(r, START_TIMEOUT)
        reps = r.replicas()
        assert sorted(x["role"] for x in reps.values()) == ["decode", "prefill"]
        assert all(x["healthy"] and x["pid"] for x in reps.values())
        for prompt, text in zip(PROMPTS, want):
            status, body, _ = http_request("POST", f"{r.base}/v1/completions", {
                "model": MODEL, "prompt": prompt, "max_tokens": 10, "temperature": 0}, timeout=60)
            assert status == 200, body
            out = json.loads(body)
            assert out["choices"][0]["text"] == text
        # streamed, n = 2 (the prefill call is one sample; the decode engine draws both)
        conn, resp = open_stream(r.base, "/v1/completions", {"model": MODEL, "prompt": PROMPTS[1] + " again",
                                                             "max_tokens": 6, "temperature": 0, "n": 2,
                                                             "stream": True})
        texts = {0: "", 1: ""}
        for ev in sse_events(resp):
            if ev != "[DONE]":
                for c in ev["choices"]:
                    texts[c["index"]] += c["text"]
        conn.close()
        assert texts[0] == texts[1] and texts[0]
        m = metric_values(r.base)
        assert m['kvserve_router:pd_decisions_total{decision="remote",reason="forced_always"}'] == 4
        decode = next(x for x in reps.values() if x["role"] == "decode")
        prefill = next(x for x in reps.values() if x["role"] == "prefill")
        wait_until("the decode engine's transfers in /metrics", lambda: metric_values(decode["url"]).get(
            'kvserve:kv_transfer_requests_total{outcome="received"}', 0) >= 3)

        # The prefill engine dies: requests are prefilled on the decode engine instead.
        os.kill(prefill["pid"], signal.SIGKILL)
        status, body, _ = http_request("POST", f"{r.base}/v1/completions", {
            "model": MODEL, "prompt": PROMPTS[0], "max_tokens": 10, "temperature": 0}, timeout=60)
        assert status == 200, body
        assert json.loads(body)["choices"][0]["text"] == want[0]
        local = metric_values(r.base)
        assert sum(v for k, v in local.items() if k.startswith("kvserve_router:pd_decisions_total")
                   and 'decision="local"' in k) >= 1
        for x in (decode,):  # block accounting back to zero (the prefill engine is gone)
            wait_until("the decode engine's KV blocks to be free", lambda: metric_values(x["url"]).get(
                "kvserve:kv_cache_usage_perc") == 0)
    finally:
        r.stop()
