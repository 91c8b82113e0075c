"""Decode steps through CUDA graphs' static buffers (worker/cuda_graphs.py). On a CPU the kernels
run in Triton's interpreter and the buffers are used without capturing (capture=False): the
buckets, the padding rows (slot -1, context 0) and the copies are what is checked; on CUDA the
same test captures and replays, and the engine's greedy tokens on CUDA are checked against HF
(scripts/gpu_check.sh)."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.worker.cuda_graphs import MAX_CAPTURE_BATCH, capture_sizes
from tests.conftest import assert_greedy_parity, hf_greedy

TRITON = importlib.util.find_spec("triton") is not None and (
    os.environ.get("TRITON_INTERPRET") == "1" or torch.cuda.is_available())
DEVICE = "cuda" if os.environ.get("TRITON_INTERPRET") == "0" and torch.cuda.is_available() else "cpu"


def test_capture_sizes():
    assert capture_sizes(1) == [1]
    assert capture_sizes(6) == [1, 2, 4, 6]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert capture_sizes(10_000)[-1] == MAX_CAPTURE_BATCH
    assert all(b - a <= 8 for a, b in zip(capture_sizes(256), capture_sizes(256)[1:]))


def _llm(model: str, backend: str = "triton") -> LLM:
    return LLM(model=model, dtype="float32", attention_backend=backend, block_size=8, device=DEVICE,
               check_integrity=True, enforce_eager=True, max_model_len=128)


@pytest.mark.skipif(not TRITON, reason="needs triton (its interpreter on a CPU, or CUDA)")
def test_graph_path_gives_eager_tokens_and_kv(tiny_model_factory):
    """Five requests of different lengths: decode batches of 5, 4, 3, 2, 1 take buckets 8, 4, 4,
    2, 1, so rows are padded and the buffers hold the last step's rows past the batch."""
    model = str(tiny_model_factory("llama"))
    prompts = [[(5 * i + 3 * j) % 250 + 3 for j in range(6 + 4 * i)] for i in range(5)]
    params = [SamplingParams(max_tokens=4 + 3 * i, temperature=0.0, ignore_eos=True) for i in range(5)]
    results = {}
    for graphs in (False, True):
        llm = _llm(model)
        try:
            runner = llm.engine.executor.runner
            if graphs:
                assert runner.enable_cuda_graphs(8, 128, capture=DEVICE == "cuda")
                seen = []
                run = runner.graphs.run
                runner.graphs.run = lambda ids, pos, meta: seen.append(meta.num_reqs) or run(ids, pos, meta)
            outs = llm.generate(prompts, params, use_tqdm=False)
            results[graphs] = ([o.outputs[0].token_ids for o in outs],
                               [torch.stack(kv).cpu() for kv in runner.kv_caches])
        finally:
            llm.close()
    assert sorted(set(seen)) == [1, 2, 3, 4, 5]  # every decode step took the static buffers
    assert results[True][0] == results[False][0]
    for eager, graphed in zip(results[False][1], results[True][1]):
        torch.testing.assert_close(graphed, eager, atol=1e-5, rtol=1e-5)  # padding rows wrote no K/V


def test_graphs_need_the_triton_backend(tiny_model_factory):
    llm = _llm(str(tiny_model_factory("llama")), backend="torch")
    try:
        with pytest.raises(ValueError, match="triton attention backend"):
            llm.engine.executor.runner.enable_cuda_graphs(8, 128)
    finally:
        llm.close()


@pytest.mark.skipif(DEVICE != "cuda", reason="needs CUDA (scripts/gpu_check.sh)")
@pytest.mark.parametrize("enforce_eager", [False, True])
def test_cuda_greedy_matches_hf(enforce_eager, tiny_model_factory):
    """The GPU path end to end, with and without graphs: triton attention on CUDA, float32."""
    model = str(tiny_model_factory("llama"))
    prompts = [[(7 * i + 3 * j) % 250 + 3 for j in range(5 + 9 * i)] for i in range(4)]
    llm = LLM(model=model, dtype="float32", attention_backend="triton", device="cuda", block_size=8,
              enforce_eager=enforce_eager, check_integrity=True)
    try:
        assert (llm.engine.executor.runner.graphs is None) == enforce_eager
        ours = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0, logprobs=5, ignore_eos=True),
                            use_tqdm=False)
    finally:
        llm.close()
    assert_greedy_parity(ours, hf_greedy(model, prompts, 12))
