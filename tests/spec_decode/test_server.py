"""`kvserve serve --speculative-config`: completions equal a plain server's, streamed or not, and the
spec_decode metrics count the drafts."""

from __future__ import annotations

import json

from tests.serving import MODEL, TINY_SERVER_ARGS, http_request, metric_values, open_stream, running_server, sse_events

# k fixed: adaptive k prices a draft from step times, so on a loaded machine (the full suite) it
# could stop drafting after a few rejections and the counts asserted below would depend on timing
SPEC = json.dumps({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "adaptive": False})
PROMPTS = [[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7], [40, 41, 42, 43, 40, 41, 42], [100, 3, 17, 100, 3]]


def _texts(base: str, stream: bool) -> list[str]:
    out = []
    for p in PROMPTS:
        body = {"model": MODEL, "prompt": p, "max_tokens": 24, "temperature": 0, "ignore_eos": True}
        if not stream:
            status, raw, _ = http_request("POST", f"{base}/v1/completions", body, timeout=60)
            assert status == 200, raw
            out.append(json.loads(raw)["choices"][0]["text"])
            continue
        conn, resp = open_stream(base, "/v1/completions", {**body, "stream": True})
        try:
            assert resp.status == 200
            out.append("".join(e["choices"][0]["text"] for e in sse_events(resp) if e != "[DONE]" and e["choices"]))
        finally:
            conn.close()
    return out


def test_speculating_server_answers_as_a_plain_one(tiny_model_factory, tmp_path):
    model = str(tiny_model_factory("llama"))
    with running_server([model, *TINY_SERVER_ARGS], tmp_path / "plain.log") as srv:
        want = _texts(srv.base, stream=False)
    with running_server([model, *TINY_SERVER_ARGS, "--speculative-config", SPEC], tmp_path / "spec.log") as srv:
        assert _texts(srv.base, stream=False) == want
        assert _texts(srv.base, stream=True) == want
        m = metric_values(srv.base)
        assert m["kvserve:spec_decode_num_drafts_total"] > 0
        assert 0 < m["kvserve:spec_decode_num_accepted_tokens_total"] <= m["kvserve:spec_decode_num_draft_tokens_total"]
        assert m['kvserve:spec_decode_num_accepted_tokens_per_pos_total{position="0"}'] > 0


def test_a_chat_prediction_drafts_over_the_api(tiny_model_factory, tmp_path):
    """OpenAI's `prediction` on /v1/chat/completions: with ngram drafts the predicted text is drafted
    (usage counts accepted / rejected prediction tokens) and the answer is the one without it; a
    malformed one is a 400 naming the field."""
    model = str(tiny_model_factory("llama"))
    with running_server([model, *TINY_SERVER_ARGS, "--speculative-config", SPEC], tmp_path / "spec.log") as srv:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Say something."}], "max_tokens": 24,
                "temperature": 0, "ignore_eos": True}
        status, raw, _ = http_request("POST", f"{srv.base}/v1/chat/completions", body, timeout=60)
        assert status == 200, raw
        first = json.loads(raw)
        text = first["choices"][0]["message"]["content"]
        for prediction in ({"type": "content", "content": text},
                           {"type": "content", "content": [{"type": "text", "text": text[:20]},
                                                           {"type": "text", "text": text[20:]}]}):
            status, raw, _ = http_request("POST", f"{srv.base}/v1/chat/completions",
                                          {**body, "prediction": prediction}, timeout=60)
            assert status == 200, raw
            out = json.loads(raw)
            assert out["choices"][0]["message"]["content"] == text
            details, before = out["usage"]["completion_tokens_details"], first["usage"]["completion_tokens_details"]
            assert details["accepted_prediction_tokens"] > max(8, before["accepted_prediction_tokens"]), (details, before)
        for bad in ({"type": "text", "content": "x"}, {"type": "content", "content": 5},
                    {"type": "content", "content": "x", "extra": 1}):
            status, raw, _ = http_request("POST", f"{srv.base}/v1/chat/completions", {**body, "prediction": bad})
            assert status == 400 and json.loads(raw)["error"]["param"] == "prediction", raw
