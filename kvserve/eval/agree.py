"""How closely a quantized model follows its reference: greedy-token agreement and KL divergence.

The reference model generates greedily from each prompt; then both models are
teacher-forced on prompt + that continuation (one prefill each, `score`) and compared
at every continuation position: the position predicting continuation token j is row
len(prompt) - 1 + j. Agreement is the fraction of positions where both argmaxes match;
KL(ref || quant) = sum_v p_ref(v) (log p_ref(v) - log p_quant(v)) over the full vocabulary,
from log-softmax in float32, averaged over positions.

The models are loaded one after the other: the reference generates, its log-probabilities
at the continuation positions are kept ([positions, vocab] float32, e.g. 16 prompts x 64
tokens x 49152 = 200 MB for SmolLM2), it is freed, and then the quantized model loads.
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from kvserve.eval.ppl import score

from kvserve.eval import AGREE_MAX_PROMPT_LEN as DEFAULT_MAX_PROMPT_LEN
from kvserve.eval import AGREE_MAX_TOKENS as DEFAULT_MAX_TOKENS
from kvserve.eval import AGREE_NUM_PROMPTS as DEFAULT_NUM_PROMPTS


@dataclass
class AgreeResult:
    model: str
    quantization: str | None
    reference_model: str
    reference_quantization: str | None
    dtype: str
    num_prompts: int
    positions: int  # continuation tokens compared, over all prompts
    agreement: float  # fraction of positions with the same argmax
    mean_kl: float  # KL(ref || quant) in nats, averaged over positions
    max_kl: float
    reference_nll: float  # mean NLL of the reference continuation under each model
    quantized_nll: float
    reference_self_agreement: float  # teacher-forced reference argmax == the token it generated
    elapsed_s: float


@dataclass
class _Reference:
    model_path: str
    continuations: list[list[int]]  # greedy, per prompt; ends with EOS where the model stopped there
    logprobs: list[torch.Tensor]  # per prompt: [len(continuation), vocab] float32 log-softmax


def continuation_rows(logits: torch.Tensor, prompt_len: int, cont_len: int) -> torch.Tensor:
    """Log-softmax (float32) of the rows predicting the continuation tokens of prompt + continuation."""
    return torch.log_softmax(logits[prompt_len - 1:prompt_len - 1 + cont_len].float(), dim=-1)


def compare(ref_logprobs: torch.Tensor, quant_logprobs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per position: (argmaxes equal [N] bool, KL(ref || quant) [N] float32) from two [N, V] log-softmaxes."""
    if ref_logprobs.shape != quant_logprobs.shape:
        raise ValueError(f"reference log-probs have shape {tuple(ref_logprobs.shape)} but quantized ones "
                         f"{tuple(quant_logprobs.shape)}: the two models must share a vocabulary")
    same = ref_logprobs.argmax(-1) == quant_logprobs.argmax(-1)
    kl = (ref_logprobs.exp() * (ref_logprobs - quant_logprobs)).sum(-1)
    return same, kl


def load_prompts(model: str | None, num_prompts: int, max_prompt_len: int, seed: int,
                 dataset: str = "sharegpt") -> list[list[int]]:
    """Token ids of `num_prompts` ShareGPT first-turn prompts of 4..max_prompt_len tokens.

    dataset: 'sharegpt' (the shipped file) or a JSON file in the same format. Selection as
    in kvserve.bench.datasets.load_sharegpt with this seed (the completion length is not filtered).
    """
    from kvserve.bench.datasets import load_sharegpt
    from kvserve.models.loader import load_tokenizer

    if dataset != "sharegpt" and not Path(dataset).is_file():
        raise ValueError(f"--dataset {dataset!r} is neither 'sharegpt' nor a file")
    reqs = load_sharegpt(load_tokenizer(model), num_prompts, max_prompt_len, max_output_len=1 << 30, seed=seed,
                         path=None if dataset == "sharegpt" else dataset)
    return [list(r.prompt_token_ids) for r in reqs]


def _kv_blocks(prompts: list[list[int]], max_tokens: int, block_size: int) -> int:
    return sum(-(-(len(p) + max_tokens) // block_size) for p in prompts)


def _reference(model: str | None, quantization: str | None, dtype: str, device: str, prompts: list[list[int]],
               max_tokens: int, block_size: int) -> _Reference:
    from kvserve import LLM, SamplingParams

    llm = LLM(model, dtype=dtype, quantization=quantization, device=device, block_size=block_size,
              num_kv_blocks=_kv_blocks(prompts, max_tokens, block_size))
    try:
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens), use_tqdm=False)
        conts = [list(o.outputs[0].token_ids) for o in outs]
        lps = [continuation_rows(score(llm, p + c), len(p), len(c)) for p, c in zip(prompts, conts)]
        path = llm.engine.model_path
    finally:
        llm.close()
    return _Reference(path, conts, lps)


def run_agree(model: str | None = None, quantization: str | None = None, reference_quantization: str | None = "none",
              reference_model: str | None = None, num_prompts: int = DEFAULT_NUM_PROMPTS,
              max_tokens: int = DEFAULT_MAX_TOKENS, max_prompt_len: int = DEFAULT_MAX_PROMPT_LEN,
              dtype: str = "auto", device: str = "cpu", seed: int = 0, dataset: str = "sharegpt",
              block_size: int = 16) -> AgreeResult:
    """Compare `model` loaded with `quantization` against `reference_model` (default: the same
    checkpoint) loaded with `reference_quantization`, on ShareGPT prompts; see the module doc."""
    from kvserve import LLM

    if num_prompts < 1:
        raise ValueError(f"--num-prompts must be at least 1, got {num_prompts}")
    if max_tokens < 1:
        raise ValueError(f"--max-tokens must be at least 1, got {max_tokens}")
    if max_prompt_len < 4:
        raise ValueError(f"--max-prompt-len must be at least 4, got {max_prompt_len}")
    ref_model = model if reference_model is None else reference_model
    prompts = load_prompts(ref_model, num_prompts, max_prompt_len, seed, dataset)
    start = time.perf_counter()
    ref = _reference(ref_model, reference_quantization, dtype, device, prompts, max_tokens, block_size)
    gc.collect()  # the reference model's weights go before the quantized model's arrive
    llm = LLM(model, dtype=dtype, quantization=quantization, device=device, block_size=block_size,
              num_kv_blocks=1, enable_prefix_caching=False)
    same: list[torch.Tensor] = []
    kls: list[torch.Tensor] = []
    self_same, ref_nll, q_nll = 0, 0.0, 0.0
    try:
        for p, c, ref_lp in zip(prompts, ref.continuations, ref.logprobs):
            q_lp = continuation_rows(score(llm, p + c), len(p), len(c))
            s, kl = compare(ref_lp, q_lp)
            same.append(s)
            kls.append(kl)
            cont = torch.tensor(c, dtype=torch.int64, device=ref_lp.device)
            self_same += int((ref_lp.argmax(-1) == cont).sum())
            ref_nll -= float(ref_lp.gather(1, cont[:, None]).sum())
            q_nll -= float(q_lp.gather(1, cont[:, None].to(q_lp.device)).sum())
        path, model_dtype = llm.engine.model_path, str(llm.engine.dtype).removeprefix("torch.")
    finally:
        llm.close()
    all_same, all_kl = torch.cat(same), torch.cat(kls)
    n = int(all_same.numel())
    return AgreeResult(
        model=path, quantization=quantization, reference_model=ref.model_path,
        reference_quantization=reference_quantization, dtype=model_dtype, num_prompts=len(prompts), positions=n,
        agreement=float(all_same.float().mean()), mean_kl=float(all_kl.mean()), max_kl=float(all_kl.max()),
        reference_nll=ref_nll / n, quantized_nll=q_nll / n, reference_self_agreement=self_same / n,
        elapsed_s=time.perf_counter() - start)
