"""Prefill/decode disaggregation in the engine (disagg/connector.py), offline: a prefill engine
computes prompts and keeps their K/V for a decode engine, which fetches them (over TCP or
shared memory) and generates exactly what one engine alone generates."""

from __future__ import annotations

import socket
import time

import pytest

from kvserve import LLM, SamplingParams
from kvserve.disagg.auth import sign_params
from tests.conftest import hf_greedy

BLOCK = 4
PROMPTS = [list(range(5, 40)), list(range(50, 53)), list(range(60, 76)), list(range(100, 190)),
           [7] * 33, list(range(200, 221))]
KEY = "pd-engine-test-deployment-key"


def with_key(kw: dict, key: str = KEY) -> dict:
    """Engine keywords with the deployment's shared key added to kv_transfer_config."""
    cfg = kw.get("kv_transfer_config") or {}
    extra = {"auth_key": key, **cfg.get("kv_connector_extra_config", {})}
    return {**kw, "kv_transfer_config": {**cfg, "kv_connector_extra_config": extra}}


def _llm(model_dir, **kw) -> LLM:
    if "kv_role" in kw:
        kw = with_key(kw)
    return LLM(model=str(model_dir), block_size=BLOCK, num_kv_blocks=256, dtype="float32", check_integrity=True,
               **kw)


def idle(llm: LLM) -> None:
    """Step until held blocks are copied out and freed (a server's loop does this by itself)."""
    while llm.engine.has_unfinished_requests():
        llm.engine.step()


def greedy(max_tokens: int = 8, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, **kw)


def prefill(llm: LLM, prompts, **kw):
    """The router's prefill call: one token, and where the K/V wait."""
    params = SamplingParams(temperature=0, max_tokens=1, extra_args={"kv_transfer_params": {"do_remote_decode": True}},
                            **kw)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    idle(llm)
    return [o.kv_transfer_params for o in outs]


def decode(llm: LLM, prompts, transfer, max_tokens: int = 8, **kw):
    outs = []
    for p, t in zip(prompts, transfer):
        params = greedy(max_tokens, extra_args={"kv_transfer_params": t}, **kw)
        outs.append(llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0])
    idle(llm)
    return outs


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory):
    return tiny_model_factory("llama")


@pytest.fixture(scope="module")
def pair(model_dir):
    p = _llm(model_dir, kv_role="prefill")
    d = _llm(model_dir, kv_role="decode")
    yield p, d
    p.engine.close()
    d.engine.close()


@pytest.fixture(scope="module")
def reference(model_dir):
    llm = _llm(model_dir)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], greedy(), use_tqdm=False)
    llm.engine.close()
    return [o.outputs[0].token_ids for o in outs]


def _blocks_used(llm: LLM) -> int:
    return llm.engine.stats()["kv_blocks_used"]


def test_disaggregated_equals_aggregated_and_hf(pair, reference, model_dir):
    p, d = pair
    for llm in pair:
        llm.engine.clear_kv_cache()
    transfer = prefill(p, PROMPTS)
    assert all(t["do_remote_prefill"] and t["remote_port"] == p.engine.transfer.sender_address[1] for t in transfer)
    assert [t["remote_num_blocks"] for t in transfer] == [(len(x) - 1) // BLOCK for x in PROMPTS]
    outs = decode(d, PROMPTS, transfer)
    assert [o.outputs[0].token_ids for o in outs] == reference
    hf = hf_greedy(model_dir, PROMPTS[:2], 8)
    assert [o.outputs[0].token_ids for o in outs[:2]] == [t for t, _ in hf]
    # Transferred tokens are reported as cached, by origin; only the rest was computed here.
    for o, x in zip(outs, PROMPTS):
        assert o.num_cached_tokens == (len(x) - 1) // BLOCK * BLOCK
        assert o.num_cached_tokens_by_tier.get("kv_transfer", 0) == o.num_cached_tokens
    assert _blocks_used(p) == 0 and _blocks_used(d) == 0
    assert p.engine.stats()["kv_transfer_pending"] == 0


def test_transferred_blocks_are_cached_on_the_decode_side(pair):
    p, d = pair
    for llm in pair:
        llm.engine.clear_kv_cache()
    prompt = PROMPTS[3]
    decode(d, [prompt], prefill(p, [prompt]))
    # The next turn of the conversation (the prompt extended) reuses them locally.
    again = d.generate([{"prompt_token_ids": prompt + [9, 9, 9]}], greedy(), use_tqdm=False)[0]
    assert again.num_cached_tokens_by_tier.get("device", 0) >= (len(prompt) - 1) // BLOCK * BLOCK


def test_decode_side_already_holds_a_prefix(pair, reference):
    """A system prompt the decode engine holds: the transfer fills in only the blocks after it."""
    p, d = pair
    for llm in pair:
        llm.engine.clear_kv_cache()
    prompt = PROMPTS[3]
    d.generate([{"prompt_token_ids": prompt[:20]}], greedy(1), use_tqdm=False)  # 5 full blocks cached
    idle(d)
    out = decode(d, [prompt], prefill(p, [prompt]))[0]
    assert out.outputs[0].token_ids == reference[3]
    full = (len(prompt) - 1) // BLOCK * BLOCK
    assert out.num_cached_tokens_by_tier == {"device": 20, "kv_transfer": full - 20}
    assert _blocks_used(d) == 0


def test_with_kv_tiers(model_dir, reference):
    """Transfer and a host-RAM tier on one decode engine (MultiConnector): a prompt evicted from
    the device comes back from RAM, a new one from the prefill engine."""
    p = _llm(model_dir, kv_role="prefill")
    d = LLM(model=str(model_dir), block_size=BLOCK, num_kv_blocks=28, dtype="float32", check_integrity=True,
            kv_offload_cpu="64MiB", **with_key({"kv_role": "decode"}))
    try:
        outs = decode(d, PROMPTS[:4], prefill(p, PROMPTS[:4]))
        assert [o.outputs[0].token_ids for o in outs] == reference[:4]
        assert all(o.num_cached_tokens_by_tier.get("kv_transfer", 0) == (len(x) - 1) // BLOCK * BLOCK
                   for o, x in zip(outs, PROMPTS[:4]))
        # PROMPTS[3] (22 blocks) pushed the first prompts' blocks out to RAM: they come back from there
        again = d.generate([{"prompt_token_ids": PROMPTS[0]}], greedy(), use_tqdm=False)[0]
        assert again.outputs[0].token_ids == reference[0]
        assert again.num_cached_tokens_by_tier.get("cpu", 0) > 0
        idle(d)
        assert _blocks_used(d) == 0 and _blocks_used(p) == 0
    finally:
        p.engine.close()
        d.engine.close()


@pytest.mark.parametrize("cache", [{"prefix_cache": "radix"}, {"enable_prefix_caching": False}])
def test_other_prefix_caches(model_dir, reference, cache):
    p = _llm(model_dir, kv_role="prefill", **cache)
    d = _llm(model_dir, kv_role="decode", **cache)
    try:
        outs = decode(d, PROMPTS[:4], prefill(p, PROMPTS[:4]))
        assert [o.outputs[0].token_ids for o in outs] == reference[:4]
        assert d.engine.stats()["kv_transfer_tokens_received"] == sum((len(x) - 1) // BLOCK * BLOCK
                                                                      for x in PROMPTS[:4])
        assert _blocks_used(d) == 0 and _blocks_used(p) == 0
    finally:
        p.engine.close()
        d.engine.close()


@pytest.mark.parametrize("transport", ["zmq", "shm"])
def test_transports(model_dir, reference, transport):
    cfg = {"kv_connector_extra_config": {"transport": transport}}
    p = _llm(model_dir, kv_role="prefill", kv_transfer_config=cfg)
    d = _llm(model_dir, kv_role="decode", kv_transfer_config=cfg)
    try:
        outs = decode(d, PROMPTS[:3], prefill(p, PROMPTS[:3]))
        assert [o.outputs[0].token_ids for o in outs] == reference[:3]
    finally:
        p.engine.close()
        d.engine.close()


def test_n_samples_and_stop_strings(pair):
    p, d = pair
    for llm in pair:
        llm.engine.clear_kv_cache()
    prompt = PROMPTS[3]
    ref_llm_params = SamplingParams(temperature=0.8, seed=3, n=3, max_tokens=8)
    d.engine.clear_kv_cache()
    want = d.generate([{"prompt_token_ids": prompt}], ref_llm_params, use_tqdm=False)[0]
    d.engine.clear_kv_cache()
    t = prefill(p, [prompt])[0]
    got = d.generate([{"prompt_token_ids": prompt}],
                     SamplingParams(temperature=0.8, seed=3, n=3, max_tokens=8,
                                    extra_args={"kv_transfer_params": t}), use_tqdm=False)[0]
    idle(d)
    assert [c.token_ids for c in got.outputs] == [c.token_ids for c in want.outputs]
    # a stop string cuts the text the same way: two characters from the middle of the greedy text
    d.engine.clear_kv_cache()
    text = d.generate([{"prompt_token_ids": prompt}], greedy(), use_tqdm=False)[0].outputs[0].text
    assert len(text) >= 4
    stop = text[len(text) // 2:len(text) // 2 + 2]
    d.engine.clear_kv_cache()
    want_s = d.generate([{"prompt_token_ids": prompt}], greedy(stop=[stop]), use_tqdm=False)[0].outputs[0]
    assert want_s.finish_reason == "stop" and len(want_s.text) < len(text)
    d.engine.clear_kv_cache()
    got_s = decode(d, [prompt], prefill(p, [prompt]), stop=[stop])[0].outputs[0]
    assert (got_s.text, got_s.finish_reason) == (want_s.text, "stop")
    assert _blocks_used(p) == 0 and _blocks_used(d) == 0


def test_fp8_kv(model_dir):
    """With an fp8 cache a fresh prompt attends over its own unrounded K/V, a cached prefix over
    fp8 codes (the random tiny model's near-ties show it); the decode engine reads the
    transferred prefix as one engine reads its own cached prefix, bit for bit."""
    p = _llm(model_dir, kv_role="prefill", kv_cache_dtype="fp8")
    d = _llm(model_dir, kv_role="decode", kv_cache_dtype="fp8")
    agg = _llm(model_dir, kv_cache_dtype="fp8")
    try:
        prompts = [{"prompt_token_ids": x} for x in PROMPTS[:3]]
        agg.generate(prompts, greedy(1), use_tqdm=False)  # caches the prefixes
        want = [o.outputs[0].token_ids for o in agg.generate(prompts, greedy(), use_tqdm=False)]
        outs = decode(d, PROMPTS[:3], prefill(p, PROMPTS[:3]))
        assert [o.outputs[0].token_ids for o in outs] == want
        assert d.engine.stats()["kv_transfer_tokens_received"] > 0
    finally:
        for llm in (p, d, agg):
            llm.engine.close()


def _dead_params(num_blocks: int = 8) -> dict:
    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        port = sk.getsockname()[1]
    return sign_params(KEY.encode(), {"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": port,
                                      "remote_request_id": "gone", "remote_num_blocks": num_blocks})


def test_prefill_engine_gone_recomputes_here(pair, reference):
    _, d = pair
    d.engine.clear_kv_cache()
    failed = d.engine.stats()["kv_transfer_failed"]
    out = decode(d, [PROMPTS[0]], [_dead_params()])[0]
    assert out.outputs[0].token_ids == reference[0]
    assert out.num_cached_tokens == 0
    assert d.engine.stats()["kv_transfer_failed"] == failed + 1
    assert _blocks_used(d) == 0


def test_prefill_engine_gone_fails_under_policy_fail(model_dir, reference):
    d = _llm(model_dir, kv_role="decode", kv_load_failure_policy="fail")
    try:
        with pytest.raises(RuntimeError, match="remote KV load failed.*not reachable"):
            decode(d, [PROMPTS[0]], [_dead_params()])
        idle(d)
        assert _blocks_used(d) == 0 and not d.engine.has_unfinished_requests()
        # the engine goes on serving
        out = d.generate([{"prompt_token_ids": PROMPTS[0]}], greedy(), use_tqdm=False)[0]
        assert out.outputs[0].token_ids == reference[0]
    finally:
        d.engine.close()


def test_mismatched_engines_are_refused_at_the_handshake(model_dir):
    p = _llm(model_dir, kv_role="prefill")
    d = LLM(model=str(model_dir), block_size=8, num_kv_blocks=128, dtype="float32", kv_load_failure_policy="fail",
            **with_key({"kv_role": "decode"}))
    try:
        t = prefill(p, [PROMPTS[3]])[0]
        with pytest.raises(RuntimeError, match="handshake refused: block_size 8 there, 4 here"):
            decode(d, [PROMPTS[3]], [t])
    finally:
        p.engine.close()
        d.engine.close()


def test_unfetched_kv_is_dropped_after_the_lease(model_dir):
    p = _llm(model_dir, kv_role="prefill", kv_transfer_config={"kv_connector_extra_config": {"lease_s": 0.3}})
    try:
        prefill(p, [PROMPTS[3]])
        assert _blocks_used(p) == 0  # device blocks are free once copied out
        assert p.engine.stats()["kv_transfer_pending"] == 1
        time.sleep(0.8)
        stats = p.engine.stats()
        assert stats["kv_transfer_pending"] == 0 and stats["kv_transfer_expired"] == 1
    finally:
        p.engine.close()


def test_bad_params_name_the_field(pair, model_dir):
    p, d = pair
    plain = _llm(model_dir)
    try:
        with pytest.raises(ValueError, match="kv_transfer_params needs an engine started with --kv-role"):
            plain.generate([{"prompt_token_ids": PROMPTS[0]}], greedy(extra_args={"kv_transfer_params": {}}))
    finally:
        plain.engine.close()
    with pytest.raises(ValueError, match="do_remote_decode needs n=1"):
        p.generate([{"prompt_token_ids": PROMPTS[0]}],
                   greedy(n=2, extra_args={"kv_transfer_params": {"do_remote_decode": True}}))
    with pytest.raises(ValueError, match="do_remote_decode needs --kv-role prefill or both"):
        d.generate([{"prompt_token_ids": PROMPTS[0]}], greedy(extra_args={"kv_transfer_params": {"do_remote_decode": True}}))
    bad = dict(_dead_params(), remote_port="x")
    with pytest.raises(ValueError, match="kv_transfer_params.remote_port must be an integer"):
        d.generate([{"prompt_token_ids": PROMPTS[0]}], greedy(extra_args={"kv_transfer_params": bad}))
    with pytest.raises(ValueError, match="kv_transfer_params must be an object"):
        d.generate([{"prompt_token_ids": PROMPTS[0]}], greedy(extra_args={"kv_transfer_params": [1]}))
    assert _blocks_used(d) == 0


def test_config_errors_name_the_key():
    from kvserve.config import EngineConfig

    with pytest.raises(ValueError, match="unknown key 'kv_parallel'"):
        EngineConfig.from_kwargs(kv_transfer_config={"kv_parallel": 2})
    with pytest.raises(ValueError, match="disagree"):
        EngineConfig.from_kwargs(kv_role="prefill", kv_transfer_config={"kv_role": "kv_consumer"})
    with pytest.raises(ValueError, match="must be a JSON object"):
        EngineConfig.from_kwargs(kv_transfer_config="{not json")
    with pytest.raises(ValueError, match="transport must be one of"):
        EngineConfig.from_kwargs(kv_role="decode", kv_transfer_config={"kv_connector_extra_config": {"transport": "rdma"}})
    cfg = EngineConfig.from_kwargs(kv_transfer_config='{"kv_role": "kv_producer", "kv_port": 5555}').kv_transfer
    assert cfg.kv_role == "prefill" and cfg.port == 5555 and cfg.policy == "recompute"
    assert cfg.auth_key() is None and cfg.peers is None
    for extra, match in [({"auth_key": "short"}, "auth_key must be a string of at least 16 bytes"),
                         ({"auth_key": KEY, "auth_key_file": "/k"}, "auth_key_file or auth_key, not both"),
                         ({"peers": "127.0.0.1"}, "peers must be a list"),
                         ({"auth_key_file": "/nonexistent/kv.key"}, "auth_key_file '/nonexistent/kv.key': No such")]:
        with pytest.raises(ValueError, match=match):
            EngineConfig.from_kwargs(kv_role="decode", kv_transfer_config={
                "kv_connector_extra_config": extra}).kv_transfer.auth_key()
