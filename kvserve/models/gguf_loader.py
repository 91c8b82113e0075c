"""GGUF checkpoints: HF config from metadata, dequantized HF-named tensors, tokenizer.

llama.cpp's converter permutes the rows of attn_q / attn_k of Llama models
(interleaved rope layout); we undo it so the tensors match HF's rotate_half layout.

A Mixtral is a "llama" file with `llama.expert_count` > 0: the router `ffn_gate_inp`
and the experts either stacked (`ffn_{gate,up,down}_exps`, [E, out, in]) or, in older
files, one tensor each (`ffn_gate.E`). It loads as MixtralForCausalLM, each expert under
its HF name (gate w1, up w3, down w2) and dequantized: quantized kernels cover only
attention and dense MLP linears.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvserve.models.gguf_file import GGUFFile

logger = logging.getLogger(__name__)

# GGUF architecture -> (HF config class name, HF architecture)
_ARCHS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
}

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate_inp": "block_sparse_moe.gate",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
# An expert linear: stacked over experts (`_exps`) or one expert's (`.E`, older files).
_EXPERT_RE = re.compile(r"blk\.(\d+)\.ffn_(gate|up|down)(?:_exps|\.(\d+))\.weight")
_EXPERT_LINEARS = {"gate": "w1", "up": "w3", "down": "w2"}  # Mixtral's HF names
# Tensors that carry no HF weight: llama3 rope factors are taken from the config instead.
_SKIP = {"rope_freqs.weight"}


def open_gguf(path: str | Path) -> Any:
    """The file's GGUFFile (read-only: it is shared); a corrupt or truncated file raises ValueError naming it.

    A process asks for the config, the tokenizer, the sampling defaults and the weights: the
    opened file is kept per file version."""
    try:
        st = os.stat(path)
        return _read_gguf(str(Path(path).resolve()), st.st_mtime_ns, st.st_size)
    except Exception as e:  # the reader raises ValueError, IndexError, struct/numpy errors on bad input
        raise ValueError(f"corrupt or truncated GGUF file {str(path)!r}: {type(e).__name__}: {e}") from e


@functools.lru_cache(maxsize=4)  # a failed read is not kept
def _read_gguf(path: str, mtime_ns: int, size: int) -> GGUFFile:
    return GGUFFile(path)


def _require(reader: GGUFFile, key: str, path: str) -> Any:
    value = reader.get(key)
    if value is None:
        raise ValueError(f"GGUF file {path!r} lacks metadata field {key!r}")
    return value


def gguf_architecture(reader: GGUFFile, path: str) -> str:
    arch = _require(reader, "general.architecture", path)
    if arch not in _ARCHS:
        raise ValueError(f"unsupported GGUF architecture {arch!r} in {path!r}; supported: {', '.join(sorted(_ARCHS))}")
    return arch


def gguf_config(reader: GGUFFile, path: str) -> Any:
    """Build the transformers config of a GGUF file from its `<arch>.*` metadata."""
    import transformers

    arch = gguf_architecture(reader, path)
    cfg_name, hf_arch = _ARCHS[arch]
    hidden = int(_require(reader, f"{arch}.embedding_length", path))
    heads = int(_require(reader, f"{arch}.attention.head_count", path))
    head_dim = int(reader.get(f"{arch}.attention.key_length", hidden // heads))
    rope_dim = int(reader.get(f"{arch}.rope.dimension_count", head_dim))
    if rope_dim != head_dim:
        raise ValueError(f"GGUF file {path!r}: partial rotary (rope.dimension_count={rope_dim}, "
                         f"head_dim={head_dim}) is not supported")
    names = {t.name for t in reader.tensors}
    vocab = reader.get(f"{arch}.vocab_size")
    if vocab is None:
        vocab = reader.array_len("tokenizer.ggml.tokens") or int(_token_embd(reader, path).shape[-1])
    kwargs: dict[str, Any] = dict(
        architectures=[hf_arch],
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(_require(reader, f"{arch}.feed_forward_length", path)),
        num_hidden_layers=int(_require(reader, f"{arch}.block_count", path)),
        num_attention_heads=heads,
        num_key_value_heads=int(reader.get(f"{arch}.attention.head_count_kv", heads)),
        head_dim=head_dim,
        max_position_embeddings=int(reader.get(f"{arch}.context_length", 2048)),
        rms_norm_eps=float(reader.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        rope_parameters=_rope_parameters(reader, arch, path),
        tie_word_embeddings="output.weight" not in names,
        bos_token_id=reader.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=reader.get("tokenizer.ggml.eos_token_id"),
        pad_token_id=reader.get("tokenizer.ggml.padding_token_id"),
    )
    if arch == "qwen2":
        kwargs.pop("head_dim")
    moe = _moe_kwargs(reader, arch, path)
    if moe:
        cfg_name = "MixtralConfig"
        kwargs.update(moe)
    return getattr(transformers, cfg_name)(**kwargs)


def _moe_kwargs(reader: GGUFFile, arch: str, path: str) -> dict[str, Any]:
    """MixtralConfig's extra fields for a file with experts ({} for a dense one)."""
    experts = int(reader.get(f"{arch}.expert_count", 0) or 0)
    if not experts:
        return {}
    if arch != "llama":
        raise ValueError(f"GGUF file {path!r}: experts (expert_count={experts}) in a {arch!r} file are not "
                         "supported; only llama files with experts (Mixtral) are")
    # llama.cpp's feed_forward_length is the dense width; an expert's comes from its tensors.
    gate = next((t for t in reader.tensors if (m := _EXPERT_RE.fullmatch(t.name)) and m.group(2) == "gate"), None)
    if gate is None:
        raise ValueError(f"GGUF file {path!r} has expert_count={experts} but no ffn_gate_exps tensor")
    return {"architectures": ["MixtralForCausalLM"], "num_local_experts": experts,
            "num_experts_per_tok": int(_require(reader, f"{arch}.expert_used_count", path)),
            "intermediate_size": int(gate.shape[1]),  # GGUF order: [hidden, intermediate(, experts)]
            "sliding_window": None}


def _token_embd(reader: GGUFFile, path: str) -> Any:
    for t in reader.tensors:
        if t.name == "token_embd.weight":
            return t.shape
    raise ValueError(f"GGUF file {path!r} has no vocab size and no token_embd.weight tensor")


def _rope_parameters(reader: GGUFFile, arch: str, path: str) -> dict[str, Any]:
    params: dict[str, Any] = {"rope_type": "default",
                              "rope_theta": float(reader.get(f"{arch}.rope.freq_base", 10000.0))}
    scaling = reader.get(f"{arch}.rope.scaling.type")
    if scaling in (None, "none"):
        return params
    if scaling == "linear":
        params.update(rope_type="linear", factor=float(_require(reader, f"{arch}.rope.scaling.factor", path)))
        return params
    raise ValueError(f"GGUF file {path!r}: unsupported rope scaling type {scaling!r}")


def hf_name(gguf_name: str) -> str | None:
    """GGUF tensor name -> HF parameter name (None: not an HF weight)."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _LAYER_RE.fullmatch(gguf_name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{m.group(3)}"
    return None


def dequantize_tensor(t: Any, path: str, index: int | None = None) -> np.ndarray:
    """A reader tensor as float32 in numpy (rows first) order; with `index`, only its
    index-th slice along the outermost dim (one expert of a stacked tensor)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    shape = tuple(int(d) for d in reversed(t.shape.tolist()))
    data = t.data
    if index is not None:
        shape, data = shape[1:], data[index]
    try:
        if t.tensor_type == GGMLQuantizationType.F32:
            arr = np.asarray(data, dtype=np.float32)
        elif t.tensor_type == GGMLQuantizationType.F16:
            arr = np.asarray(data).astype(np.float32)
        else:
            arr = dequantize(data, t.tensor_type)
        arr = arr.reshape(shape)
    except NotImplementedError as e:
        raise ValueError(f"GGUF file {path!r}: tensor {t.name!r} has unsupported type {t.tensor_type.name}") from e
    except Exception as e:
        raise ValueError(f"corrupt or truncated GGUF file {path!r}: tensor {t.name!r}: {e}") from e
    return arr if arr.flags.writeable else arr.copy()


def unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp's `permute` (HF rotate_half rows -> interleaved rows)."""
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _expert_names(t: Any, num_experts: int, path: str) -> list[str] | None:
    """The HF names of the experts an expert tensor holds, in order (None: not an expert tensor)."""
    m = _EXPERT_RE.fullmatch(t.name)
    if m is None or not num_experts:
        return None
    layer, kind, expert = m.groups()
    if expert is None and (len(t.shape) != 3 or int(t.shape[2]) != num_experts):
        raise ValueError(f"GGUF file {path!r}: tensor {t.name!r} has shape {t.shape.tolist()}, "
                         f"expected [in, out, {num_experts}] (expert_count)")
    experts = range(num_experts) if expert is None else [int(expert)]
    return [f"model.layers.{layer}.block_sparse_moe.experts.{e}.{_EXPERT_LINEARS[kind]}.weight" for e in experts]


def _decoder_linear(name: str) -> bool:
    """Whether a GGUF tensor is a decoder linear's weight."""
    from kvserve.quant.base import linear_prefix

    hf = hf_name(name)
    return name.endswith(".weight") and hf is not None and linear_prefix(hf) is not None


def kernel_linears(reader: Any) -> bool:
    """Whether any decoder linear of this GGUF file has a type the CPU kernels run compressed
    (gguf_weights(compressed=True) hands it over as raw blocks); False for an all-float file."""
    from kvserve.quant.gguf import REPACKABLE

    return any(int(t.tensor_type) in REPACKABLE and _decoder_linear(t.name) for t in reader.tensors)


def gguf_weights(reader: GGUFFile, config: Any, path: str,
                 compressed: bool = False) -> tuple[int, Iterator[tuple[str, torch.Tensor]]]:
    """(number of items, iterator of (HF name, float32 tensor)).

    compressed: each decoder linear whose type kvserve.quant.gguf can repack comes instead
    as its raw rows `<prefix>.ggml_blocks` (uint8 [out, bytes per row]; llama's q/k rows
    un-permuted, which moves whole rows of blocks) and `<prefix>.ggml_type` (0-d int64).
    """
    from kvserve.quant.gguf import REPACKABLE

    arch = gguf_architecture(reader, path)
    tensors = [t for t in reader.tensors if t.name not in _SKIP]
    num_experts = int(getattr(config, "num_local_experts", 0) or 0)
    experts = {t.name: names for t in tensors if (names := _expert_names(t, num_experts, path))}
    for t in tensors:
        if t.name not in experts and hf_name(t.name) is None:
            raise ValueError(f"GGUF file {path!r}: unexpected tensor {t.name!r}")
    linears = [t for t in tensors if compressed and t.name not in experts and _decoder_linear(t.name)]
    raw = {t.name for t in linears if int(t.tensor_type) in REPACKABLE and len(t.data.shape) == 2}
    others = sorted({t.tensor_type.name for t in linears if t.name not in raw})
    if others:
        logger.info("GGUF linears of type %s have no compressed kernel and are dequantized", ", ".join(others))

    def rows(arr: np.ndarray, name: str) -> np.ndarray:
        if arch == "llama" and ".attn_q." in name:
            return unpermute(arr, config.num_attention_heads)
        if arch == "llama" and ".attn_k." in name:
            return unpermute(arr, config.num_key_value_heads)
        return arr

    def gen() -> Iterator[tuple[str, torch.Tensor]]:
        for t in tensors:
            if t.name in experts:
                # A stacked tensor one expert at a time: all of it in float32 can take gigabytes.
                stacked = len(t.shape) == 3
                for e, name in enumerate(experts[t.name]):
                    yield name, torch.from_numpy(dequantize_tensor(t, path, index=e if stacked else None))
                continue
            name = hf_name(t.name)
            if t.name in raw:
                prefix = name.removesuffix(".weight")
                yield f"{prefix}.ggml_blocks", torch.from_numpy(np.array(rows(np.asarray(t.data), t.name)))
                yield f"{prefix}.ggml_type", torch.tensor(int(t.tensor_type))
            else:
                yield name, torch.from_numpy(rows(dequantize_tensor(t, path), t.name))

    return len(tensors) + len(raw) + sum(len(names) - 1 for names in experts.values()), gen()


def _tokenizer_cache_dir(path: Path) -> Path:
    """Where the converted tokenizer of this exact file is kept (conversion takes seconds)."""
    import transformers

    st = path.stat()
    key = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{transformers.__version__}"
    from kvserve.kernels.build import cache_dir

    return cache_dir() / "gguf_tokenizers" / hashlib.sha256(key.encode()).hexdigest()[:24]


def gguf_tokenizer(path: Path, reader: GGUFFile | None = None) -> Any:
    """transformers' tokenizer built from the GGUF vocab, with the file's chat template.

    The converted tokenizer is cached on disk (see `_tokenizer_cache_dir`); a
    cache that cannot be written or read is skipped silently. On a cache hit the file's
    metadata is not parsed at all (`reader`, if not given, is opened only on a miss).
    """
    from transformers import AutoTokenizer

    cache = _tokenizer_cache_dir(path)
    if (cache / "tokenizer.json").exists():
        try:
            return AutoTokenizer.from_pretrained(str(cache))
        except Exception:
            pass
    try:
        tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as e:
        raise ValueError(f"cannot build a tokenizer from GGUF file {str(path)!r}: {type(e).__name__}: {e}") from e
    template = (reader if reader is not None else open_gguf(path)).get("tokenizer.chat_template")
    if template and not getattr(tok, "chat_template", None):
        tok.chat_template = template
    _save_tokenizer(tok, cache)
    return tok


def _save_tokenizer(tok: Any, cache: Path) -> None:
    tmp = cache.with_name(f"{cache.name}.tmp{os.getpid()}")
    try:
        tok.save_pretrained(str(tmp))
        os.replace(tmp, cache)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
