"""Tensor and pipeline parallel through the `mp` executor: greedy tokens equal one rank's, on the
default model (its 9 heads / 3 KV heads split 2 + 1 over two ranks) and on tiny random models;
quantized weights shard; bad sizes are refused naming the flag; a killed rank fails cleanly."""

from __future__ import annotations

import os
import signal
import time

import pytest

from kvserve import LLM, SamplingParams
from tests.conftest import VOCAB
from tests.models.conftest import make_hf_checkpoint, tiny_tokenizer  # noqa: F401  (fixtures)

pytestmark = pytest.mark.slow

PARAMS = SamplingParams(temperature=0, max_tokens=12, logprobs=5, ignore_eos=True)
TEXT = ["The capital of France is", "def fibonacci(n):", "Paged attention splits the KV cache into"]
IDS = [[5, 17, 42, 99, 7, 250, 3, 64], [11, 12, 13], [200, 100, 50, 25, 12, 6, 3, 1, 9, 8, 7, 6]]


def _run(prompts, **kwargs):
    llm = LLM(**kwargs)
    try:
        return llm.generate(prompts, PARAMS, use_tqdm=False)
    finally:
        llm.close()


def assert_same_greedy(ours, reference, atol: float = 1e-3) -> None:
    """Token ids equal; a flip is allowed only at a near-tie of the reference's top-5 (sums over
    ranks add in another order than one rank's matmul)."""
    for out, ref in zip(ours, reference):
        a, b = out.outputs[0], ref.outputs[0]
        for j, (mine, theirs) in enumerate(zip(a.token_ids, b.token_ids)):
            if mine != theirs:
                top = b.logprobs[j]
                assert mine in top, f"step {j}: token {mine} not in the reference's top-5 {list(top)}"
                assert abs(top[mine].logprob - top[theirs].logprob) < 10 * atol, f"step {j}: not a near-tie"
                break
            assert abs(a.logprobs[j][mine].logprob - b.logprobs[j][theirs].logprob) < atol


@pytest.fixture(scope="module")
def default_reference():
    return _run(TEXT, dtype="float32", quantization="none", kv_cache_memory="64MiB")


# TP alone and PP alone are checked on the tiny models of every architecture below; on the default
# model, the one layout that runs both at once (four ranks).
@pytest.mark.parametrize("tp,pp", [(2, 2)])
def test_default_model_tp_pp_match_one_rank(default_reference, tp, pp):
    outs = _run(TEXT, dtype="float32", quantization="none", kv_cache_memory="64MiB",
                tensor_parallel_size=tp, pipeline_parallel_size=pp)
    assert_same_greedy(outs, default_reference)
    assert "Paris" in outs[0].outputs[0].text


def test_gguf_blocks_shard_under_tp2(monkeypatch):
    """The GGUF's Q4_1 / Q8_0 blocks stay compressed and are cut per rank (rows for q/k/v and
    gate/up, whole 32-column groups for o and down). Exact float activations on both sides: each
    rank measures its own shard's shapes, and may pick other kernels than one rank does; float32
    K/V, since a last-bit difference of a sum can cross a bfloat16 rounding boundary."""
    from kvserve.kernels.tuning import TUNING_ENV

    monkeypatch.setenv(TUNING_ENV, "off")
    ref = _run(TEXT, dtype="float32", kv_cache_memory="64MiB", kv_cache_dtype="float32")
    outs = _run(TEXT, dtype="float32", kv_cache_memory="64MiB", kv_cache_dtype="float32", tensor_parallel_size=2,
                cpu_threads_bind="0|1" if os.cpu_count() >= 2 else None)
    assert_same_greedy(outs, ref)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen2", "llama3"])
def test_tiny_models_tp2_and_pp2(tiny_model_factory, arch):
    path = str(tiny_model_factory(arch))
    ref = _run(IDS, model=path, dtype="float32")
    for tp, pp in ((2, 1), (1, 2)):
        assert_same_greedy(_run(IDS, model=path, dtype="float32", tensor_parallel_size=tp,
                                pipeline_parallel_size=pp), ref)


@pytest.mark.parametrize("method", ["int8", "fp8"])
def test_quantized_weights_under_tp2(tiny_model_factory, method, monkeypatch):
    # Tuning off: it measures each rank's own shapes, and where a bfloat16 path (the AMX dense matmul
    # or attention products) wins for one shape and not the other, the two runs round differently
    # (a 1.2e-3 logprob difference on a Xeon with AMX); sharding is what this test is about.
    monkeypatch.setenv("KVSERVE_KERNEL_TUNING", "off")
    path = str(tiny_model_factory("llama"))
    ref = _run(IDS, model=path, dtype="float32", quantization=method)
    assert_same_greedy(_run(IDS, model=path, dtype="float32", quantization=method, tensor_parallel_size=2), ref)


def test_pipeline_keeps_one_batch_in_flight_per_stage(tiny_model_factory):
    """Many requests through PP=2: the engine schedules a new batch while the last stage still
    runs the previous one, and every request still gets one rank's tokens."""
    path = str(tiny_model_factory("llama"))
    prompts = [[(7 * i + j) % (VOCAB - 1) + 1 for j in range(3 + i % 5)] for i in range(12)]
    ref = _run(prompts, model=path, dtype="float32")
    llm = LLM(model=path, dtype="float32", pipeline_parallel_size=2, max_num_batched_tokens=16)
    try:
        outs = llm.generate(prompts, PARAMS, use_tqdm=False)
        assert llm.engine.executor.max_concurrent_batches == 2
        assert_same_greedy(outs, ref)
        assert llm.stats()["kv_blocks_used"] == 0 or llm.engine.kv.cache is not None
    finally:
        llm.close()


@pytest.mark.parametrize("kwargs,flag", [
    ({"tensor_parallel_size": 4}, "tensor_parallel_size"),  # 3 KV heads
    ({"pipeline_parallel_size": 7}, "pipeline_parallel_size"),  # 30 layers
    ({"tensor_parallel_size": 2, "enable_expert_parallel": True}, "enable_expert_parallel"),  # no experts
    ({"tensor_parallel_size": 2, "distributed_executor_backend": "uni"}, "distributed_executor_backend"),
])
def test_bad_sizes_are_refused_naming_the_flag(kwargs, flag):
    with pytest.raises(ValueError, match=flag):
        LLM(quantization="none", **kwargs)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split()[2] != "Z"


def test_killed_rank_fails_the_step_naming_it_and_leaves_no_process(tiny_model_factory):
    from kvserve.distributed.executor import WorkerError

    llm = LLM(model=str(tiny_model_factory("llama")), dtype="float32", tensor_parallel_size=2)
    pids = [p.pid for p in llm.engine.executor.procs]
    llm.generate([IDS[0]], PARAMS, use_tqdm=False)
    os.kill(pids[1], signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(WorkerError, match=r"rank 1 .*SIGKILL"):
        llm.generate([IDS[1]], PARAMS, use_tqdm=False)
    assert time.monotonic() - start < 30
    assert not any(_alive(p) for p in pids)
    with pytest.raises(WorkerError, match="rank 1"):  # and stays failed, without hanging
        llm.generate([IDS[2]], PARAMS, use_tqdm=False)
    llm.close()


def test_killed_rank_under_the_server_fails_streams_and_health(tiny_model_factory, tmp_path):
    """kvserve serve -tp 2: a rank killed mid-stream ends the stream with an error naming the rank,
    /health turns 503, the server stays up, and no rank process is left behind."""
    from tests.serving import MODEL, PROMPT, TINY_SERVER_ARGS, child_pids, http_request, open_stream, running_server
    from tests.serving import sse_events

    args = [str(tiny_model_factory("llama")), *TINY_SERVER_ARGS, "--tensor-parallel-size", "2"]
    with running_server(args, tmp_path / "log") as srv:
        engine = next(p for p in child_pids(srv.proc.pid) if b"spawn_main" in
                      open(f"/proc/{p}/cmdline", "rb").read())
        ranks = [p for p in child_pids(engine) if b"kvserve.distributed.multiproc" in
                 open(f"/proc/{p}/cmdline", "rb").read()]
        assert len(ranks) == 2
        conn, resp = open_stream(srv.base, "/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 480,
                                                               "temperature": 0, "ignore_eos": True, "stream": True})
        events = sse_events(resp)
        assert next(events)["choices"]
        os.kill(ranks[1], signal.SIGKILL)
        rest = list(events)  # must end, not hang
        errors = [e for e in rest if isinstance(e, dict) and "error" in e]
        assert errors and "rank 1" in errors[0]["error"]["message"], rest[-3:]
        conn.close()
        deadline = time.monotonic() + 30
        while http_request("GET", f"{srv.base}/health")[0] != 503:
            assert time.monotonic() < deadline
            time.sleep(0.2)
        assert srv.proc.poll() is None
        deadline = time.monotonic() + 30
        while any(_alive(p) for p in [engine, *ranks]):
            assert time.monotonic() < deadline, "a rank or the engine process outlived the failure"
            time.sleep(0.2)


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_moe_tp2_and_expert_parallel_match_one_rank(make_hf_checkpoint, arch):  # noqa: F811
    """Experts sliced over two ranks (TP=2) and experts split whole over them (TP=2 + EP, all-to-all
    dispatch and combine) give one rank's greedy tokens."""
    from tests.models.test_moe import _config

    path = str(make_hf_checkpoint(_config(arch), name=arch)[0])
    ref = _run(IDS, model=path, dtype="float32", num_kv_blocks=64)
    for ep in (False, True):
        outs = _run(IDS, model=path, dtype="float32", num_kv_blocks=64, tensor_parallel_size=2,
                    enable_expert_parallel=ep)
        assert_same_greedy(outs, ref)
