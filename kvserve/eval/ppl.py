"""Perplexity with a sliding window (the HF "perplexity of fixed-length models" recipe), and `score`:
full-vocabulary logits of one token sequence from the engine's own model.

The text is tokenized once and cut to `max_tokens`. Windows of `window` tokens start every
`stride` tokens; each window scores only the tokens the previous window did not score,
and never its own first token (nothing precedes it). So the first window scores all but
its first token, overlapping windows give every later token `window - stride` tokens of
context or more, and `stride == window` (no overlap) leaves each window's first token
unscored, exactly as HF's recipe does with labels set to -100.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from kvserve.eval import PPL_MAX_TOKENS as DEFAULT_MAX_TOKENS
from kvserve.eval import PPL_STRIDE as DEFAULT_STRIDE
from kvserve.eval import PPL_WINDOW as DEFAULT_WINDOW
# ShareGPT texts are read until the joined text holds about this many characters per wanted
# token; if it tokenizes to fewer tokens, twice as many characters are read, and so on.
_CHARS_PER_TOKEN = 6
_JOIN = "\n\n"


@torch.inference_mode()
def score(llm: Any, token_ids: Sequence[int]) -> torch.Tensor:
    """Logits [T, vocab] in float32 of `token_ids` as one prefill from position 0 on `llm`'s model.

    Row t holds the distribution of token t + 1 given tokens 0..t. The prefill writes its K/V
    into scratch caches of ceil(T / block_size) blocks, allocated like the runner's (same
    dtype, block shape and device) and dropped afterwards: the engine's KV cache, prefix
    cache and running requests are untouched. Raises ValueError if token_ids is empty, longer
    than the engine's max_model_len, or holds an id outside the vocabulary.
    """
    engine = llm.engine
    ids = list(token_ids)
    n = len(ids)
    if n == 0:
        raise ValueError("token_ids must not be empty")
    if n > engine.max_model_len:
        raise ValueError(f"token_ids has {n} tokens, more than max_model_len={engine.max_model_len}")
    bad = next((t for t in ids if not (isinstance(t, int) and 0 <= t < engine.vocab_size)), None)
    if bad is not None:
        raise ValueError(f"token_ids contains {bad!r}, outside the vocabulary [0, {engine.vocab_size})")
    executor = engine.executor
    return executor.collective_rpc("prompt_logits", ids)[executor.output_rank]


@dataclass(frozen=True)
class Window:
    """Tokens [begin, end) go through the model; targets [first_target, end) are scored."""

    begin: int
    end: int
    first_target: int


def windows(num_tokens: int, window: int, stride: int) -> list[Window]:
    """The sliding windows over num_tokens tokens; together they score tokens 1..num_tokens-1
    once each, except that `stride == window` leaves every window's first token unscored."""
    if num_tokens < 2:
        raise ValueError(f"the text has {num_tokens} token(s); perplexity needs at least 2")
    if window < 2:
        raise ValueError(f"--window must be at least 2, got {window}")
    if not 1 <= stride <= window:
        raise ValueError(f"--stride must be between 1 and --window ({window}), got {stride}: "
                         f"a stride above the window would skip tokens")
    out: list[Window] = []
    prev_end = 0
    for begin in range(0, num_tokens, stride):
        end = min(begin + window, num_tokens)
        out.append(Window(begin, end, max(prev_end, begin + 1)))
        prev_end = end
        if end == num_tokens:
            break
    return out


@dataclass
class PplResult:
    model: str
    dataset: str
    quantization: str  # as loaded: none or the method
    weight_bytes: int  # resident parameters and buffers
    dtype: str
    kv_cache_dtype: str
    num_tokens: int  # the text after the cut to max_tokens
    window: int
    stride: int
    num_windows: int
    tokens_scored: int
    mean_nll: float  # nats per scored token
    ppl: float
    elapsed_s: float  # scoring only (model loading and tokenization excluded)


def perplexity(llm: Any, token_ids: Sequence[int], window: int = DEFAULT_WINDOW,
               stride: int = DEFAULT_STRIDE) -> tuple[int, int, float]:
    """(windows, tokens scored, summed NLL in nats) of token_ids under llm's model, sliding windows."""
    ids = list(token_ids)
    spans = windows(len(ids), window, stride)
    longest = spans[0].end - spans[0].begin
    if longest > llm.engine.max_model_len:
        raise ValueError(f"--window {window} is longer than the model's max_model_len={llm.engine.max_model_len}")
    total, count = 0.0, 0
    for w in spans:
        logits = score(llm, ids[w.begin:w.end])
        rows = logits[w.first_target - 1 - w.begin:w.end - 1 - w.begin]
        targets = torch.tensor(ids[w.first_target:w.end], dtype=torch.int64, device=rows.device)
        total += float(F.cross_entropy(rows, targets, reduction="sum"))
        count += len(targets)
    return len(spans), count, total


def _sharegpt_tokens(tokenizer: Any, max_tokens: int) -> list[int]:
    """Token ids of the joined ShareGPT turns of the eval split, reading only as many records as
    max_tokens needs."""
    from kvserve.bench.datasets import sharegpt_conversations

    texts: list[str] = []
    chars, want = 0, max_tokens * _CHARS_PER_TOKEN
    for text in (t for turns in sharegpt_conversations("eval") for t in turns):
        texts.append(text)
        chars += len(text) + len(_JOIN)
        if chars >= want:
            ids = list(tokenizer(_JOIN.join(texts))["input_ids"])
            if len(ids) >= max_tokens:
                return ids
            want *= 2
    return list(tokenizer(_JOIN.join(texts))["input_ids"]) if texts else []


def load_text_tokens(tokenizer: Any, dataset: str, max_tokens: int) -> list[int]:
    """The evaluation text's token ids, cut to max_tokens.

    dataset 'sharegpt': every turn of the ShareGPT conversations in file order, joined with
    blank lines, read only as far as max_tokens needs, from the eval split (the first
    EVAL_CONVERSATIONS conversations, about 1.4M tokens; calibration never reads them).
    Otherwise a path to a UTF-8 text file, read whole. The text is tokenized once, with the
    tokenizer's default special tokens.
    """
    if max_tokens < 2:
        raise ValueError(f"--max-tokens must be at least 2, got {max_tokens}")
    if dataset == "sharegpt":
        ids = _sharegpt_tokens(tokenizer, max_tokens)
    else:
        path = Path(dataset)
        if not path.is_file():
            raise ValueError(f"--dataset {dataset!r} is neither 'sharegpt' nor a file")
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"--dataset {dataset!r} is not UTF-8 text: {e}") from None
        ids = list(tokenizer(text)["input_ids"])
    if len(ids) < 2:
        raise ValueError(f"--dataset {dataset!r} gives {len(ids)} token(s); perplexity needs at least 2")
    return ids[:max_tokens]


def run_ppl(model: str | None = None, dataset: str = "sharegpt", max_tokens: int = DEFAULT_MAX_TOKENS,
            window: int = DEFAULT_WINDOW, stride: int = DEFAULT_STRIDE, quantization: str | None = None,
            dtype: str = "auto", kv_cache_dtype: str = "auto", device: str = "cpu") -> PplResult:
    """Load the model, tokenize the dataset once and compute its sliding-window perplexity.

    Flags are checked before the model loads; errors are ValueErrors naming the flag.
    """
    from kvserve import LLM

    if max_tokens < 2:
        raise ValueError(f"--max-tokens must be at least 2, got {max_tokens}")
    windows(max_tokens, window, stride)  # checks --window / --stride
    # The engine's own KV cache is never used here (score() brings its own): keep it at one block.
    llm = LLM(model, dtype=dtype, quantization=quantization, kv_cache_dtype=kv_cache_dtype, device=device,
              num_kv_blocks=1, enable_prefix_caching=False)
    try:
        ids = load_text_tokens(llm.get_tokenizer(), dataset, max_tokens)
        start = time.perf_counter()
        num_windows, count, total = perplexity(llm, ids, window, stride)
        elapsed = time.perf_counter() - start
    finally:
        llm.close()
    nll = total / count
    return PplResult(model=llm.engine.model_path, dataset=dataset, quantization=llm.engine.quantization,
                     weight_bytes=llm.engine.weight_bytes,
                     dtype=str(llm.engine.dtype).removeprefix("torch."),
                     kv_cache_dtype=llm.engine.cache_config.kv_cache_dtype,  # 'auto' as the engine decided it
                     num_tokens=len(ids), window=window, stride=stride, num_windows=num_windows,
                     tokens_scored=count, mean_nll=nll, ppl=math.exp(nll), elapsed_s=elapsed)
