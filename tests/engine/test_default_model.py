"""Parity on the embedded default model: kvserve and HF transformers load the same GGUF."""

from __future__ import annotations

import pytest
import torch

from kvserve import LLM, SamplingParams
from tests.conftest import assert_greedy_parity, hf_greedy

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Paged attention splits the KV cache into",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
]


# Logprob tolerance against HF where the quantized linears take int8 activations (what tuning
# picks on CPUs where they are faster): rounding each 32-value block of x to 8 bits moved the
# default model's logprobs by up to 0.14 over these 4 x 20 steps (perplexity +0.35%, BENCHMARKS.md);
# a token may flip where HF's top two are within 0.35 (a flip at a gap of 0.23 was seen). With the
# prompts' step on int8 codes too (int8_from, where it took the bfloat16 dense path before) one
# step moved by 0.214 (Zen 4). That largest move is the tail of the 8-bit rounding's noise, and any
# float-level change re-draws it (a value near a rounding boundary crosses it): with the embeddings
# perturbed by 1e-6 of their size, the largest move over these 80 steps ranged 0.11-0.27 over 7
# draws (mean move 0.040-0.046), and summing each block's activations in another order gave 0.29.
INT8_ACTIVATIONS_ATOL, INT8_ACTIVATIONS_TIE = 0.35, 0.35
# int16 activations (amax / 32767 per 32-value block; what tuning picks on AVX2 CPUs) moved them by
# up to 1.08e-3 over the same steps, mean 1.3e-4 (0.95e-3 / 1.3e-4 with the row-major int16 kernel
# before the interleaved one: the same error, the default 1e-3 sat at its edge); float32 by 2e-5.
INT16_ACTIVATIONS_ATOL = 2e-3
# A prefill whose flat batch reaches a linear's dense_from runs that linear as one dense matmul, in
# bfloat16 where tuning measured it faster (AVX512-BF16, AMX): weights and activations rounded to 8
# mantissa bits. With every linear of the prompts' step in bfloat16 the logprobs moved by up to
# 0.037 over these 4 x 20 steps, mean 4.8e-3 (Zen 4; the float32 dense path 8e-4); none flipped.
BF16_PREFILL_ATOL, BF16_PREFILL_TIE = 0.06, 0.12


# A prefill on int8 codes (int8_from, tuning.py) where they measure faster: the prompts' K/V
# carry the 8-bit rounding into every later step, so the logprobs moved by up to 0.144 over these
# steps (Zen 4; decode steps on int16 codes): int8 activations' tolerance.
INT8_PREFILL_ATOL, INT8_PREFILL_TIE = INT8_ACTIVATIONS_ATOL, INT8_ACTIVATIONS_TIE
# ... and with the prompts' attention on bfloat16 products too (the cpu backend's kernel_bf16, which
# tuning may take only beside int8 prefill codes): over these steps the largest moves per prompt went
# from 0.069 / 0.114 / 0.126 / 0.026 to 0.124 / 0.284 / 0.117 / 0.073 (Zen 4), as rounding any one
# of q, k or v to bfloat16 before the float32 kernel moved them (0.14-0.24); over 4,096 teacher-forced
# ShareGPT tokens the mean move against float prefill stayed 0.059 (BENCHMARKS.md).
INT8_PREFILL_BF16_ATTENTION_ATOL = 0.35
# K/V stored in bfloat16 (kv_cache_dtype 'auto' for a GGUF's float32 kernels on a CPU, as llama.cpp
# and vLLM keep 16-bit K/V): with the rest exact (tuning off) the logprobs moved by up to 0.0139 over
# these 4 x 20 steps, mean 0.0028 (Zen 4; float32 K/V: 2.1e-5 / 2.3e-6), none flipped.
BF16_KV_ATOL, BF16_KV_TIE = 0.03, 0.1


def low_precision_prefill(model: torch.nn.Module, tokens: int, path: str = "bfloat16") -> bool:
    """Whether a step of `tokens` prompt tokens runs some linear on path "bfloat16" (its dense
    matmul in bfloat16: dense_from and dense_dtype, kernels/tuning.py's per-phase choice) or "int8"
    (the kernel with int8 codes: from int8_from up to dense_from)."""
    for m in model.modules():
        dense_from = getattr(m, "dense_from", None)
        if dense_from is None:
            continue
        if path == "bfloat16" and getattr(m, "dense_dtype", None) == torch.bfloat16 and dense_from <= tokens:
            return True
        if path == "int8" and getattr(m, "int8_from", dense_from) <= tokens < dense_from:
            return True
    return False


@pytest.fixture(scope="module")
def hf_reference(default_hf_model) -> tuple[list[list[int]], list]:
    """The prompts' token ids and HF's greedy continuations, computed once for every variant."""
    from kvserve.models.loader import load_tokenizer

    tok = load_tokenizer(None)
    prompts = [tok(p)["input_ids"] for p in PROMPTS]
    return prompts, hf_greedy(default_hf_model, prompts, 20)


@pytest.mark.slow
@pytest.mark.parametrize("tuning,kv", [("auto", "auto"), ("off", "auto"), ("int8", "auto"), ("off", "float32")])
def test_default_model_greedy_matches_hf(tuning, kv, monkeypatch, hf_reference):
    """With the kernels chosen by measuring (auto; int8 activations a candidate where the kernels
    lack VNNI), with no measuring (off), and with int8 activations allowed everywhere (int8: chosen
    where they measure faster); with the default bfloat16 K/V
    and, with no measuring, float32 K/V (everything else to float rounding)."""
    from kvserve.kernels.tuning import INT8_ENV, TUNING_ENV, int8_allowed

    monkeypatch.setenv(TUNING_ENV, "off" if tuning == "off" else "auto")
    if tuning == "int8":
        monkeypatch.setenv(INT8_ENV, "1")
    llm = LLM(dtype="float32", kv_cache_memory="256MiB", kv_cache_dtype=kv, check_integrity=True)
    assert llm.engine.kv_dtype == (torch.float32 if kv == "float32" else torch.bfloat16)
    bf16_kv = llm.engine.kv_dtype == torch.bfloat16

    def assert_parity(atol: float = 1e-3, tie: float | None = None) -> None:
        tie = 10 * atol if tie is None else tie
        if bf16_kv:  # the K/V's rounding on top of the linears'
            atol, tie = max(atol, BF16_KV_ATOL), max(tie, BF16_KV_TIE)
        assert_greedy_parity(ours, reference, atol, tie)

    prompts, reference = hf_reference
    assert prompts == [llm.get_tokenizer()(p)["input_ids"] for p in PROMPTS]
    ours = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=20, logprobs=5, ignore_eos=True),
                        use_tqdm=False)
    model = llm.engine.executor.worker.runner.model
    int8 = any(getattr(m, "activations", None) == "int8" for m in model.modules())
    assert not int8 or tuning == "int8" or int8_allowed()  # a CPU whose kernels lack VNNI: a default candidate
    int16 = any(getattr(m, "activations", None) == "int16" for m in model.modules())
    if int8:
        assert_parity(INT8_ACTIVATIONS_ATOL, INT8_ACTIVATIONS_TIE)
    elif low_precision_prefill(model, sum(map(len, prompts)), "int8"):
        assert tuning != "off"
        bf16 = llm.engine.executor.worker.runner.attention_backend.prefill_bf16
        assert_parity(INT8_PREFILL_BF16_ATTENTION_ATOL if bf16 else INT8_PREFILL_ATOL, INT8_PREFILL_TIE)
    elif low_precision_prefill(model, sum(map(len, prompts))):  # the 4 prompts are prefilled in one step
        assert tuning != "off"
        assert_parity(BF16_PREFILL_ATOL, BF16_PREFILL_TIE)
    elif int16:
        assert_parity(INT16_ACTIVATIONS_ATOL)
    else:
        assert_parity()
    assert "Paris" in ours[0].outputs[0].text


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (scripts/gpu_check.sh)")
@pytest.mark.parametrize("enforce_eager", [False, True])
def test_default_model_greedy_matches_hf_on_cuda(enforce_eager, hf_reference):
    """The GPU path: triton attention, quantized weights through their CUDA kernels, decode steps
    replayed from CUDA graphs (or not), in float32 like the reference."""
    llm = LLM(dtype="float32", device="cuda", attention_backend="triton", enforce_eager=enforce_eager,
              kv_cache_memory="256MiB", check_integrity=True)
    try:
        assert (llm.engine.executor.runner.graphs is None) == enforce_eager
        prompts, reference = hf_reference
        ours = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=20, logprobs=5, ignore_eos=True),
                            use_tqdm=False)
        assert_greedy_parity(ours, reference)
    finally:
        llm.close()
