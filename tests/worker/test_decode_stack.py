"""The decode stack (kvserve/worker/decode_stack.py): small decode batches' layers in one C call.

The same engine runs the same prompts with the stack and with it switched off (layer by layer in
Python). With blocks weights both paths call the same C sums, but each call site is inlined and
vectorized by the compiler on its own (-ffast-math lets it reassociate), and on AVX-512 hosts the
two orders differ in the last bits: logprobs differed by up to 9.5e-7 (8 ulps of float32 near 1),
and by 67 ulps relative on a Xeon with AMX whose kernels GCC tuned for it (`-mtune=native`: the
same code built with `-mtune=generic` gave equal bits there). So blocks weights are held to a
relative bound of BLOCKS_ULPS float32 ulps (256 * 2^-23 of the logprob's magnitude, at least 1),
with equal tokens; dense float32 weights go through torch's GEMM
on the layer path, so there the stated tolerance is 1e-5 in logprob. Where activations are
quantized (int16 or int8 codes per 32-value block; the K-quant kernel's are always int16), a last-bit
difference upstream can move a code by one step (1/32767 or 1/127 of the block's largest value),
and the layers carry that on: on a Xeon with AVX-512, int16 codes moved logprobs by up to 1.6e-4
(relative to max(1, |logprob|)); so those runs are held to ACT_RTOL, about 6x that, and int8's
(a step 258x larger) to 1e-2. Block size 4 puts many block boundaries in every
sequence; the prompts' lengths differ so the batch's requests sit at different positions.
"""

from __future__ import annotations

import logging
import random

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.kernels import qmatmul
from kvserve.worker import decode_stack

PARAMS = SamplingParams(max_tokens=12, temperature=0, logprobs=5, ignore_eos=True)
DENSE_ATOL = 1e-5
BF16_KV_ATOL = 1e-4  # dense weights over a bfloat16 KV cache (test_bfloat16_kv_of_a_float32_model)
BLOCKS_ULPS = 256  # float32 ulps (relative to max(1, |logprob|)) that reassociation may cost
ACT_RTOL = {"float32": BLOCKS_ULPS * 2.0 ** -23, "int16": 1e-3, "int8": 1e-2}  # relative, by activation mode


def _prompts(n: int = 6, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 300) for _ in range(rng.randrange(5, 40))] for _ in range(n)]


def _llm(model_dir, **kw) -> LLM:
    return LLM(model=str(model_dir), dtype="float32", block_size=4, num_kv_blocks=256, check_integrity=True,
               enable_prefix_caching=False, **kw)


def _stack(llm: LLM):
    """The model runner, whose `decode_stack` is the fast path (None where it does not run)."""
    return llm.engine.executor.runner


def _enable(runner, dtype: torch.dtype, backend: str) -> bool:
    """Build the runner's stack again, as its __init__ does; whether it runs."""
    runner.decode_stack = decode_stack.DecodeStack.build(runner.model, dtype, backend, runner.device)
    return runner.decode_stack is not None


def _generate(llm: LLM, on: bool, monkeypatch, prompts=None) -> tuple[list, int]:
    """Outputs with the stack on or off, and how many steps it ran."""
    model = _stack(llm)
    saved = model.decode_stack
    calls = []
    if on:
        assert saved is not None, "the stack should run this model"
        orig = type(saved).__call__
        monkeypatch.setattr(type(saved), "__call__", lambda self, *a: calls.append(1) or orig(self, *a))
    else:
        model.decode_stack = None
    try:
        outs = llm.generate(prompts or _prompts(), PARAMS, use_tqdm=False)
    finally:
        model.decode_stack = saved
        monkeypatch.undo()
    assert llm.engine.kv.num_used_blocks == 0
    return outs, len(calls)


def _compare(a, b, atol: float | None = None, act: str = "float32") -> None:
    """Equal tokens; logprobs within atol, or when atol is None within ACT_RTOL[act] of max(1, |logprob|)."""
    for x, y in zip(a, b):
        cx, cy = x.outputs[0], y.outputs[0]
        assert cx.token_ids == cy.token_ids
        for lx, ly in zip(cx.logprobs, cy.logprobs):
            assert list(lx) == list(ly)
            for t in lx:
                a, b = lx[t].logprob, ly[t].logprob
                bound = atol if atol is not None else ACT_RTOL[act] * max(1.0, abs(a))
                assert abs(a - b) <= bound, (t, a, b, bound)


@pytest.mark.parametrize("arch,quant", [("llama", "int8"), ("qwen2", "int8"), ("qwen3", "int8"), ("llama3", "none"),
                                        ("qwen3", "none")])
def test_stack_equals_the_layer_path(tiny_model_factory, monkeypatch, arch, quant):
    """qwen2: q/k/v bias; qwen3: per-head q/k norm and head_dim 32; llama3: scaled rope, tied head."""
    llm = _llm(tiny_model_factory(arch), quantization=quant)
    on, calls = _generate(llm, True, monkeypatch)
    off, _ = _generate(llm, False, monkeypatch)
    assert calls >= PARAMS.max_tokens - 1  # every step after the prompts' prefill is a decode step
    _compare(on, off, None if quant == "int8" else DENSE_ATOL)


def test_fp8_kv_and_integer_activations(tiny_model_factory, monkeypatch):
    """fp8 KV: codes written with the layer's scale, read back through the attention kernel's fp8
    path. Int8 and int16 activations: the blocks kernels' other modes, set on every linear."""
    from kvserve.quant.linear import GroupCodesLinear

    llm = _llm(tiny_model_factory("llama"), quantization="int8", kv_cache_dtype="fp8")
    runner = llm.engine.executor.runner
    for mode in qmatmul.MODES:
        for m in runner.model.modules():
            if isinstance(m, GroupCodesLinear):
                m.activations = mode
        assert _enable(runner, torch.float32, runner.attention_backend.name)
        on, calls = _generate(llm, True, monkeypatch)
        off, _ = _generate(llm, False, monkeypatch)
        assert calls > 0
        _compare(on, off, act=mode)


@pytest.mark.parametrize("quant", ["int8", "none"])
def test_bfloat16_kv_of_a_float32_model(tiny_model_factory, monkeypatch, quant):
    """kv_cache_dtype="bfloat16": K/V rounded to bfloat16 as they are written (the stack rounds as
    torch's cast does), read back as floats by the attention kernel; the stack equals the layer path.
    Dense weights: the two paths' K/V differ in the last float32 bits (torch's GEMM against the
    stack's sums), and an element that such a difference puts on the other side of a bfloat16
    rounding boundary moves by a bfloat16 step (2^-8 of it): 1.3e-5 in logprob measured at the avx2
    level, so BF16_KV_ATOL there."""
    llm = _llm(tiny_model_factory("llama"), quantization=quant, kv_cache_dtype="bfloat16")
    assert llm.engine.executor.runner.kv_caches[0][0].dtype == torch.bfloat16
    on, calls = _generate(llm, True, monkeypatch)
    off, _ = _generate(llm, False, monkeypatch)
    assert calls >= PARAMS.max_tokens - 1
    _compare(on, off, None if quant == "int8" else BF16_KV_ATOL)


def test_large_batches_and_prefills_take_the_layer_path(tiny_model_factory, monkeypatch):
    """A step with a prompt in it, or more decodes than max_rows, runs layer by layer."""
    llm = _llm(tiny_model_factory("llama"), quantization="none")
    stack = _stack(llm).decode_stack
    assert stack.max_rows == decode_stack.DENSE_MAX_ROWS
    prompts = _prompts(decode_stack.DENSE_MAX_ROWS + 2, seed=1)
    on, calls = _generate(llm, True, monkeypatch, prompts)
    off, _ = _generate(llm, False, monkeypatch, prompts)
    assert calls == 0  # all ten decode together in every step
    _compare(on, off, 0.0)  # both runs take the layer path


def test_what_it_does_not_run(tiny_model_factory, monkeypatch, caplog):
    llm = _llm(tiny_model_factory("llama"), quantization="none")
    runner = llm.engine.executor.runner
    caplog.set_level(logging.INFO, logger=decode_stack.__name__)
    assert not _enable(runner, torch.bfloat16, "cpu")
    assert "decode stack off: dtype torch.bfloat16" in caplog.text
    assert not _enable(runner, torch.float32, "triton")
    monkeypatch.setenv("KVSERVE_DECODE_STACK", "0")
    assert not _enable(runner, torch.float32, "cpu")
    monkeypatch.delenv("KVSERVE_DECODE_STACK")
    assert not decode_stack.DecodeStack.build(runner.model, torch.float32, "cpu", "cuda")  # a CPU path only
    assert not decode_stack.DecodeStack.build(runner.model.model, torch.float32, "cpu")  # not a whole model
    assert "decode stack off: a LlamaModel model" in caplog.text
    assert _enable(runner, torch.float32, "cpu")


def test_caches_it_cannot_use_leave_it_pointing_at_the_runners(tiny_model_factory):
    """Caches it cannot read (a strided one among them) are refused whole: the layers keep
    pointing at the caches they had."""
    from kvserve.attention import AttentionMetadata

    llm = _llm(tiny_model_factory("llama"), quantization="int8")
    runner = llm.engine.executor.runner
    stack = runner.decode_stack
    meta = AttentionMetadata(num_decodes=1, query_start_loc=[0, 1], seq_lens=[1], slot_mapping=torch.zeros(1),
                             block_tables=torch.zeros(1, 1), seq_lens_tensor=torch.ones(1), block_size=4)
    assert stack.runs(1, meta, runner.kv_caches)
    before = [(layer.k_cache, layer.v_cache) for layer in stack.layers]
    bad = [(torch.zeros_like(k), torch.zeros_like(v)) for k, v in runner.kv_caches]
    bad[-1] = (bad[-1][0].transpose(1, 2).contiguous().transpose(1, 2), bad[-1][1])
    assert not stack.runs(1, meta, bad)
    assert [(layer.k_cache, layer.v_cache) for layer in stack.layers] == before
    assert stack.runs(1, meta, runner.kv_caches)
    assert not stack.runs(stack.max_rows, meta, runner.kv_caches)  # too many rows for the kernels
    fresh = AttentionMetadata(num_decodes=0, query_start_loc=[0, 3], seq_lens=[3], slot_mapping=torch.zeros(3),
                              block_tables=torch.zeros(1, 1), seq_lens_tensor=torch.tensor([3]), block_size=4)
    assert not stack.runs(3, fresh, runner.kv_caches)  # a prompt's first chunk: its own fresh K/V
    fresh.seq_lens, fresh.seq_lens_tensor = [7], torch.tensor([7])
    assert stack.runs(3, fresh, runner.kv_caches)  # three query tokens after four cached ones


def test_verify_rows_equal_one_token_steps(tiny_model_factory, monkeypatch):
    """Speculative decoding's verify steps run here, each query token a decode row seeing the
    context up to itself: with drafts that are the plain run's own tokens (all kept), the layers'
    output (after the final norm) for every position is the plain run's one-token step's bit for
    bit, though most came from verify rows. (The LM head and log-softmax after the stack run over
    however many rows the step has: logprobs are held to the ulps bound, tokens exactly.)"""
    spec = {"method": "ngram", "num_speculative_tokens": 3, "adaptive": False}
    llm = _llm(tiny_model_factory("llama"), quantization="int8", speculative_config=spec)
    eng, stack = llm.engine, _stack(llm).decode_stack
    prompt = _prompts(1, seed=3)
    seen: dict[str, dict[int, torch.Tensor]] = {}
    run = ["plain"]
    orig = type(stack).__call__

    def call(self, h, positions, meta, rotary):
        out = orig(self, h, positions, meta, rotary)
        rows = seen.setdefault(run[0], {})
        for i, pos in enumerate(positions.tolist()):
            rows[pos] = out[i].clone()
        rows.setdefault("rows", []).append(h.shape[0])
        return out

    monkeypatch.setattr(type(stack), "__call__", call)
    eng.spec.propose = lambda req, n: []
    plain = llm.generate(prompt, PARAMS, use_tqdm=False)
    ref = plain[0].outputs[0].token_ids
    eng.spec.propose = lambda req, n: list(ref[req.num_output_tokens:min(req.num_output_tokens + 3,
                                                                          PARAMS.max_tokens - 1)])
    run[0] = "drafted"
    drafted = llm.generate(prompt, PARAMS, use_tqdm=False)
    assert max(seen["drafted"].pop("rows")) == 4 and max(seen["plain"].pop("rows")) == 1
    assert eng.stats()["spec_decode_num_accepted_tokens"] >= PARAMS.max_tokens // 2
    assert seen["drafted"].keys() == seen["plain"].keys()
    assert all(torch.equal(seen["drafted"][p], seen["plain"][p]) for p in seen["plain"])
    _compare(drafted, plain)
    assert eng.kv.num_used_blocks == 0
