"""Calibration for the AWQ / GPTQ quantizers: token sequences, the float model, a layer-by-layer driver.

The model being quantized is a transformers CausalLM in float32 built from what kvserve's
loader reads (an HF directory or a GGUF file, dequantized, with HF names). The driver runs the
calibration sequences one decoder layer at a time: the inputs of layer i+1 are the outputs of
layer i *after* it was quantized, so each layer's quantizer sees the error of the ones before.
Every sequence runs alone (batch 1, no padding), which keeps attention exact and lets the
sequences differ in length.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from kvserve.bench.datasets import sharegpt_conversations, sharegpt_path

_TOKENIZE_BATCH = 64
_MIN_SHAREGPT_TOKENS = 16
_CHARS_PER_TOKEN_BOUND = 16  # a calibration file is read only this far: num_samples * seq_len * 16 characters
# Decoder-layer call arguments that concern the KV cache; calibration runs without one.
_CACHE_KWARGS = ("cache", "past_key_values", "past_key_value", "use_cache", "cache_position")


# --- calibration sequences ---------------------------------------------------------------------------------------

def calibration_sequences(tokenizer: Any, calib: str, num_samples: int, seq_len: int = 512) -> list[list[int]]:
    """`num_samples` token sequences of at most `seq_len` tokens (fewer if the source runs out).

    calib 'sharegpt': one sequence per ShareGPT conversation (its turns joined by blank lines,
    cut to seq_len; conversations under 16 tokens skipped), in file order, from the calib split
    (after the conversations `kvserve eval ppl` scores). Otherwise a UTF-8
    text file: its text tokenized as one stream and cut into consecutive seq_len windows.
    """
    check_calibration(calib, num_samples, seq_len)
    seqs = (_sharegpt_sequences(tokenizer, num_samples, seq_len) if calib == "sharegpt"
            else _file_sequences(tokenizer, calib, num_samples, seq_len))
    if not seqs:
        raise ValueError(f"--calib {calib!r} gave no calibration sequence")
    return seqs


def check_calibration(calib: str, num_samples: int, seq_len: int) -> None:
    """ValueError naming the flag (--calib, --calib-samples, --calib-seq-len) before any model is loaded."""
    if num_samples < 1:
        raise ValueError(f"--calib-samples must be at least 1, got {num_samples}")
    if seq_len < 2:
        raise ValueError(f"--calib-seq-len must be at least 2, got {seq_len}")
    if calib == "sharegpt":
        try:
            sharegpt_path()
        except ValueError as e:
            raise ValueError(f"--calib sharegpt: {e}") from e
    elif not Path(calib).is_file():
        raise ValueError(f"--calib: cannot read {calib!r}: no such file; pass 'sharegpt' or a text file")


def _sharegpt_sequences(tokenizer: Any, num_samples: int, seq_len: int) -> list[list[int]]:
    out: list[list[int]] = []
    texts = ("\n\n".join(turns) for turns in sharegpt_conversations("calib"))
    while len(out) < num_samples:
        batch = [t for _, t in zip(range(_TOKENIZE_BATCH), texts)]
        if not batch:
            break
        for ids in tokenizer(batch, truncation=True, max_length=seq_len)["input_ids"]:
            if len(ids) >= min(_MIN_SHAREGPT_TOKENS, seq_len):
                out.append(list(ids))
                if len(out) == num_samples:
                    break
    return out


def _file_sequences(tokenizer: Any, path: str, num_samples: int, seq_len: int) -> list[list[int]]:
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read(num_samples * seq_len * _CHARS_PER_TOKEN_BOUND)
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"--calib: cannot read {path!r} as a UTF-8 text file ({type(e).__name__}: {e}); "
                         "pass 'sharegpt' or a text file") from e
    if not text.strip():
        raise ValueError(f"--calib: {path!r} holds no text")
    ids = list(tokenizer(text)["input_ids"])
    seqs = [ids[i:i + seq_len] for i in range(0, len(ids), seq_len)][:num_samples]
    return [s for s in seqs if len(s) >= 2]


# --- the float model ---------------------------------------------------------------------------------------------

@dataclass
class SourceModel:
    """A float checkpoint as a transformers CausalLM (float32, eval) plus what its output directory needs."""

    model: nn.Module
    tokenizer: Any
    dtype: torch.dtype  # the dtype the checkpoint stores its float tensors in (GGUF: float32)
    generation_config: Path | None  # generation_config.json of an HF directory, if it has one


def load_source(model: str | None, device: str = "cpu") -> SourceModel:
    """Read an HF directory or a GGUF file (None: the embedded default) through kvserve's loader.

    ValueError if the checkpoint is already quantized or its tensors do not match its config.
    """
    from transformers import AutoModelForCausalLM

    from kvserve.models.loader import open_checkpoint  # here: the loader imports the quant methods

    ckpt = open_checkpoint(model)
    path, config = ckpt.path, ckpt.config
    existing = getattr(config, "quantization_config", None)
    if existing:
        method = existing.get("quant_method") if isinstance(existing, dict) else existing
        raise ValueError(f"model {str(path)!r} is already quantized (quantization_config: {method}); "
                         "quantize a float checkpoint")
    _, weights = ckpt.weights()
    tokenizer = ckpt.tokenizer()
    gen_config = path / "generation_config.json" if (path / "generation_config.json").exists() else None
    state: dict[str, torch.Tensor] = {}
    dtype = None
    for name, tensor in weights:
        if dtype is None and tensor.is_floating_point():
            dtype = tensor.dtype
        state[name] = tensor
    net = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = net.load_state_dict(state, strict=False)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    missing = [m for m in missing if not (tied and m == "lm_head.weight")]
    unexpected = [u for u in unexpected if not u.endswith("rotary_emb.inv_freq")]
    if missing or unexpected:
        raise ValueError(f"model {str(path)!r} does not match its config: missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]}")
    if tied:
        net.tie_weights()
    net.requires_grad_(False)
    return SourceModel(net.to(device).eval(), tokenizer, dtype or torch.float32, gen_config)


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    return model.model.layers


# --- layer-by-layer driver ---------------------------------------------------------------------------------------

@dataclass
class LayerInputs:
    """Per calibration sequence: the hidden states entering the current decoder layer, and its call kwargs
    (attention mask, rotary position embeddings, position ids)."""

    hidden: list[torch.Tensor]  # [1, T_i, hidden]
    kwargs: list[dict[str, Any]]

    def attention_kwargs(self) -> list[dict[str, Any]]:
        """The kwargs a layer passes on to its self_attn."""
        keep = ("attention_mask", "position_embeddings", "position_ids")
        return [{k: kw[k] for k in keep if k in kw} for kw in self.kwargs]


class _Stop(Exception):
    """Raised from a hook to end a forward pass once what it captures has been seen."""


@torch.no_grad()
def first_layer_inputs(model: nn.Module, sequences: Sequence[list[int]]) -> LayerInputs:
    """Embed each sequence and capture what the first decoder layer is called with."""
    device = next(model.parameters()).device
    hidden: list[torch.Tensor] = []
    kwargs: list[dict[str, Any]] = []

    def hook(module: nn.Module, args: tuple, kw: dict[str, Any]) -> None:
        kw = dict(kw)
        hidden.append(args[0] if args else kw.pop("hidden_states"))
        kwargs.append({k: v for k, v in kw.items() if k not in _CACHE_KWARGS})
        raise _Stop

    handle = decoder_layers(model)[0].register_forward_pre_hook(hook, with_kwargs=True)
    try:
        for ids in sequences:
            try:
                model(input_ids=torch.tensor([ids], device=device), use_cache=False)
            except _Stop:
                pass
    finally:
        handle.remove()
    return LayerInputs(hidden, kwargs)


@torch.no_grad()
def layer_forward(layer: nn.Module, inputs: LayerInputs) -> list[torch.Tensor]:
    """The layer's output hidden states for every sequence."""
    outs = []
    for h, kw in zip(inputs.hidden, inputs.kwargs):
        out = layer(h, **kw)
        outs.append(out[0] if isinstance(out, tuple) else out)
    return outs


@torch.no_grad()
def capture_linear_inputs(layer: nn.Module, inputs: LayerInputs, names: Sequence[str],
                          on_input: Callable[[str, torch.Tensor], None]) -> None:
    """Run the layer over every sequence, calling on_input(name, x) with the input of each named
    submodule; each forward stops as soon as all of them have run (later modules are skipped)."""
    seen: set[str] = set()

    def make_hook(name: str) -> Callable[[nn.Module, tuple], None]:
        def hook(module: nn.Module, args: tuple) -> None:
            on_input(name, args[0].detach())
            seen.add(name)
            if len(seen) == len(names):
                raise _Stop
        return hook

    handles = [layer.get_submodule(n).register_forward_pre_hook(make_hook(n)) for n in names]
    try:
        for h, kw in zip(inputs.hidden, inputs.kwargs):
            seen.clear()
            try:
                layer(h, **kw)
            except _Stop:
                pass
    finally:
        for handle in handles:
            handle.remove()


def quantize_layers(model: nn.Module, sequences: Sequence[list[int]],
                    quantize_layer: Callable[[int, nn.Module, LayerInputs], None], desc: str) -> None:
    """Call quantize_layer(i, layer, inputs) for each decoder layer in order; it must leave the layer's
    linears holding their quantized (dequantized) weights, whose outputs then feed layer i + 1."""
    inputs = first_layer_inputs(model, sequences)
    for i, layer in enumerate(tqdm(decoder_layers(model), desc=desc, unit="layer")):
        quantize_layer(i, layer, inputs)
        inputs.hidden = layer_forward(layer, inputs)

