"""Parity on the embedded default model: kvserve and HF transformers load the same GGUF."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.models.loader import default_model_path
from tests.conftest import assert_greedy_parity, hf_greedy

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Paged attention splits the KV cache into",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
]


@pytest.mark.slow
def test_default_model_greedy_matches_hf():
    from transformers import AutoModelForCausalLM

    llm = LLM(dtype="float32", kv_cache_memory="256MiB", check_integrity=True)
    tok = llm.get_tokenizer()
    prompts = [tok(p)["input_ids"] for p in PROMPTS]
    ours = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=20, logprobs=5, ignore_eos=True),
                        use_tqdm=False)
    path = Path(default_model_path())
    hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    assert_greedy_parity(ours, hf_greedy(hf, prompts, 20))
    assert "Paris" in ours[0].outputs[0].text
