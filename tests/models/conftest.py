"""Fixtures for model tests: a tiny byte-level BPE tokenizer, tiny random HF checkpoints,
and a hand-built paged KV cache + AttentionMetadata to drive our models."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

from kvserve.attention import AttentionMetadata
from tests.conftest import CHAT_TEMPLATE, SPECIALS, make_tokenizer

@pytest.fixture(scope="session")
def tiny_tokenizer():
    return make_tokenizer()


def randomize_(model: torch.nn.Module, seed: int = 0) -> None:
    """Weights large enough that a wrong rope / permutation / bias changes the logits a lot."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * noise)
            elif name.endswith("bias"):
                p.copy_(0.1 * noise)
            else:
                p.copy_(0.08 * noise)


@pytest.fixture
def make_hf_checkpoint(tmp_path: Path, tiny_tokenizer) -> Callable:
    """make_hf_checkpoint(config) -> (dir, HF model in float32 eval mode) saved as safetensors."""

    def make(config, name: str = "ckpt", seed: int = 0):
        from transformers import AutoModelForCausalLM

        config.vocab_size = len(tiny_tokenizer)
        hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager")
        randomize_(hf, seed)
        hf.eval()
        out = tmp_path / name
        hf.save_pretrained(out)
        tiny_tokenizer.save_pretrained(out)
        return out, hf

    return make


def make_kv_caches(config, num_blocks: int, block_size: int, dtype=torch.float32) -> list:
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    shape = (num_blocks, block_size, config.num_key_value_heads, head_dim)
    return [(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype))
            for _ in range(config.num_hidden_layers)]


def single_request_meta(blocks: list[int], block_size: int, num_computed: int, num_new: int,
                        decode: bool = False) -> AttentionMetadata:
    """Metadata for one request whose tokens [num_computed, num_computed+num_new) are scheduled."""
    seq_len = num_computed + num_new
    slots = [blocks[p // block_size] * block_size + p % block_size for p in range(num_computed, seq_len)]
    return AttentionMetadata(
        num_decodes=1 if decode else 0,
        query_start_loc=[0, num_new],
        seq_lens=[seq_len],
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        block_tables=torch.tensor([blocks], dtype=torch.int64),
        seq_lens_tensor=torch.tensor([seq_len], dtype=torch.int64),
        block_size=block_size,
    )


class PagedRunner:
    """Feeds one sequence through our model step by step with a real paged KV cache.

    Blocks are deliberately non-contiguous and out of order so block-table
    indexing is exercised.
    """

    def __init__(self, model, config, block_size: int = 4, num_blocks: int = 16, dtype=torch.float32):
        self.model, self.block_size = model, block_size
        self.kv = make_kv_caches(config, num_blocks, block_size, dtype)
        self.blocks = list(range(num_blocks - 1, 0, -2)) + list(range(num_blocks - 2, 0, -2))
        self.num_computed = 0

    @torch.no_grad()
    def step(self, token_ids: list[int], decode: bool = False) -> torch.Tensor:
        """Schedules token_ids as the next tokens; returns their logits [len, vocab]."""
        n = len(token_ids)
        meta = single_request_meta(self.blocks, self.block_size, self.num_computed, n, decode)
        positions = torch.arange(self.num_computed, self.num_computed + n, dtype=torch.int64)
        hidden = self.model(torch.tensor(token_ids, dtype=torch.int64), positions, self.kv, meta)
        self.num_computed += n
        return self.model.compute_logits(hidden)


@pytest.fixture
def paged_runner() -> type[PagedRunner]:
    return PagedRunner


def _permute(w, n_head: int):
    """llama.cpp convert_hf_to_gguf `permute` (HF rotate_half rows -> interleaved)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_GGUF_LAYER = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
               "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
               "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
               "mlp.down_proj": "ffn_down"}


def add_gguf_tokenizer(w, tokenizer) -> None:
    """The tokenizer (gpt2 BPE), its special ids and the chat template, as llama.cpp's converter writes them."""
    import json

    vocab = tokenizer.backend_tokenizer.get_vocab()
    tokens = sorted(vocab, key=vocab.get)
    merges = json.loads(tokenizer.backend_tokenizer.to_str())["model"]["merges"]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in SPECIALS else 1 for t in tokens])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    w.add_bos_token_id(vocab["<|im_start|>"])
    w.add_eos_token_id(vocab["<|im_end|>"])
    w.add_pad_token_id(vocab["<|endoftext|>"])
    w.add_chat_template(CHAT_TEMPLATE)


def add_gguf_llama_header(w, cfg, feed_forward_length: int) -> None:
    """The llama-architecture hyperparameters llama.cpp's converter writes, from an HF config."""
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(feed_forward_length)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    w.add_vocab_size(cfg.vocab_size)


@pytest.fixture
def write_llama_gguf(tiny_tokenizer) -> Callable:
    """write_llama_gguf(hf_llama_model, path, qtypes: {gguf suffix: GGMLQuantizationType}) -> path.

    Mirrors llama.cpp's converter: q/k rows permuted, tensors renamed, tokenizer
    (gpt2 BPE) and chat template in the metadata, no `output` tensor when tied.
    """

    import gguf
    import numpy as np

    def write(hf, path: Path, qtypes: dict[str, "gguf.GGMLQuantizationType"],
              raw: dict[str, tuple[np.ndarray, "gguf.GGMLQuantizationType"]] | None = None) -> Path:
        """raw: GGUF tensor name -> already-quantized bytes, written instead of the HF weight."""
        cfg = hf.config
        w = gguf.GGUFWriter(str(path), "llama")
        add_gguf_llama_header(w, cfg, cfg.intermediate_size)
        add_gguf_tokenizer(w, tiny_tokenizer)
        for name, t in hf.state_dict().items():
            arr = t.float().numpy()
            if name == "lm_head.weight" and cfg.tie_word_embeddings:
                continue
            if name == "model.embed_tokens.weight":
                gname = "token_embd.weight"
            elif name == "model.norm.weight":
                gname = "output_norm.weight"
            elif name == "lm_head.weight":
                gname = "output.weight"
            else:
                parts = name.split(".")  # model.layers.N.<module...>.weight
                gname = f"blk.{parts[2]}.{_GGUF_LAYER['.'.join(parts[3:-1])]}.{parts[-1]}"
            if ".attn_q." in gname:
                arr = _permute(arr, cfg.num_attention_heads)
            elif ".attn_k." in gname:
                arr = _permute(arr, cfg.num_key_value_heads)
            qtype = gguf.GGMLQuantizationType.F32 if arr.ndim == 1 else qtypes[gname.split(".")[-2]]
            if raw and gname in raw:
                data, qtype = raw[gname]
            else:
                data = gguf.quants.quantize(np.ascontiguousarray(arr), qtype)
            w.add_tensor(gname, data, raw_dtype=qtype)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        return path

    return write


def kernel_type(linear: nn.Module) -> type:
    """What runs a ParallelLinear's matmul: its quantized kernel's type, or nn.Linear for a float weight."""
    return type(linear.kernel) if linear.kernel is not None else nn.Linear
