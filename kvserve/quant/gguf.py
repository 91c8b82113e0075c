"""GGUF linears kept compressed: raw llama.cpp blocks -> QuantizedWeight, exactly.

Block layouts (per row, blocks along the input dim; fp16 scalars, little endian):
  Q4_0: d, 16 bytes of nibbles            w = (q - 8) d
  Q4_1: d, m, 16 bytes of nibbles         w = q d + m
  Q8_0: d, 32 int8                        w = q d
  Q4_K: 256 weights: d, dmin, 12 bytes of 6-bit (sc, m) for 8 sub-blocks of 32, 128 bytes
        of nibbles                         w = q (d sc) - dmin m
In a 32-weight Q4_0/Q4_1 block the low nibbles are weights 0..15 and the high nibbles
16..31; a Q4_K chunk of 32 bytes holds sub-block 2c in its low and 2c+1 in its high nibbles.
All map onto group size 32 (scale = d or d sc, offset = -8 d, m, -128 d or -dmin m).
Other types are dequantized by the loader (gguf_loader).
"""

from __future__ import annotations

import torch

from kvserve.quant.base import QuantizedWeight, QuantMethod

# GGMLQuantizationType values (gguf.constants) and (weights, bytes) per block.
Q4_0, Q4_1, Q8_0, Q4_K = 2, 3, 8, 12
_BLOCKS = {Q4_0: (32, 18), Q4_1: (32, 20), Q8_0: (32, 34), Q4_K: (256, 144)}
REPACKABLE = frozenset(_BLOCKS)


def _half(b: torch.Tensor) -> torch.Tensor:
    """[..., 2] bytes -> [...] float32 from a little-endian fp16."""
    return b.contiguous().view(torch.float16).squeeze(-1).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[..., n] bytes -> [..., 2n]: the n low nibbles, then the n high nibbles."""
    return torch.cat([qs & 15, qs >> 4], -1)


def _q4_k_scales(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """12 bytes [..., 12] -> 6-bit scales and mins [..., 8] (llama.cpp get_scale_min_k4)."""
    d, m, md = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = torch.cat([d & 63, (md & 15) | ((d >> 6) << 4)], -1)
    mn = torch.cat([m & 63, (md >> 4) | ((m >> 6) << 4)], -1)
    return sc.float(), mn.float()


def repack(blocks: torch.Tensor, qtype: int, name: str) -> QuantizedWeight:
    """Raw GGUF rows uint8 [out, bytes per row] of type `qtype` -> QuantizedWeight (group 32)."""
    if qtype not in _BLOCKS:
        raise ValueError(f"GGUF tensor {name!r}: type {qtype} cannot be kept compressed")
    per_block, nbytes = _BLOCKS[qtype]
    if blocks.dtype != torch.uint8 or blocks.dim() != 2 or blocks.shape[1] % nbytes:
        raise ValueError(f"GGUF tensor {name!r}: raw blocks have shape {tuple(blocks.shape)} / {blocks.dtype}, "
                         f"expected uint8 [rows, k * {nbytes}]")
    rows, nb = blocks.shape[0], blocks.shape[1] // nbytes
    b = blocks.view(rows, nb, nbytes)
    d = _half(b[..., 0:2])
    if qtype == Q4_0:
        q, scale, offset = _nibbles(b[..., 2:]), d, -8 * d
    elif qtype == Q4_1:
        q, scale, offset = _nibbles(b[..., 4:]), d, _half(b[..., 2:4])
    elif qtype == Q8_0:
        q, scale, offset = b[..., 2:] ^ 128, d, -128 * d  # flipping the sign bit: int8 code + 128
    else:
        sc, mn = _q4_k_scales(b[..., 4:16])
        q = _nibbles(b[..., 16:].reshape(rows, nb, 4, 32))
        scale, offset = d[..., None] * sc, -_half(b[..., 2:4])[..., None] * mn
    bits = 8 if qtype == Q8_0 else 4
    n_in = nb * per_block
    return QuantizedWeight(q.reshape(rows, n_in).contiguous(), scale.reshape(rows, -1).contiguous(),
                           offset.reshape(rows, -1).contiguous(), bits, 32)


class GGUFMethod(QuantMethod):
    """A GGUF linear arrives as `<prefix>.ggml_blocks` (uint8 rows, llama's q/k rows already
    un-permuted by the loader) and `<prefix>.ggml_type` (0-d int64: GGMLQuantizationType)."""

    name = "gguf"

    def tensor_suffixes(self) -> tuple[str, ...]:
        return ("ggml_blocks", "ggml_type")

    def convert(self, prefix: str, tensors: dict[str, torch.Tensor]) -> QuantizedWeight:
        return repack(tensors["ggml_blocks"], int(tensors["ggml_type"]), prefix)


def keep_vocab_compressed(net: torch.nn.Module, reader, dtype: torch.dtype, device: torch.device | str) -> list[str]:
    """Keep a GGUF's token_embd (and output, if untied) in their quantized blocks instead of a dense
    table: the LM head, read in full every decode step, runs the blocks kernel (a Q8_0 table is a
    quarter of float32's bytes), and embedding lookups dequantize their rows. Only where the blocks
    kernel runs and the table is whole on this rank. Returns the GGUF tensors kept."""
    import numpy as np

    from kvserve.quant.linear import quantized_linear
    from kvserve.worker.kernels import qmatmul

    embed = getattr(getattr(net, "model", None), "embed_tokens", None)
    head = getattr(net, "lm_head", None)
    found = {t.name: t for t in reader.tensors if t.name in ("token_embd.weight", "output.weight")}
    head_src = "output.weight" if "output.weight" in found else "token_embd.weight"
    if head_src == "token_embd.weight" and not getattr(net, "tie_word_embeddings", True):
        head = None
    kept: dict[str, torch.nn.Module] = {}
    for module, name in ((embed, "token_embd.weight"), (head, head_src)):
        t = found.get(name)
        if module is None or t is None or module.tp.size != 1 or int(t.tensor_type) not in REPACKABLE:
            continue
        if name not in kept:
            qw = repack(torch.from_numpy(np.array(np.asarray(t.data))), int(t.tensor_type), name)
            if qw.shape[0] != module.vocab_size or not qmatmul.supports(qw.shape[1], qw.group_size,
                                                                       torch.device(device)):
                continue
            kept[name] = quantized_linear(qw, None, dtype, device)
        module.set_kernel(kept[name])
    return sorted(kept)
