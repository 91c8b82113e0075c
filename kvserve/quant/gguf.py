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

Q5_K and Q6_K stay as the file's raw rows, a `KQuantWeight`, read in place by
kvserve/kernels/kquant (layouts in its c/kquant.c). Other types are dequantized by the
loader (gguf_loader).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from kvserve.quant.base import QuantizedWeight, QuantMethod
from kvserve.kernels import kquant

logger = logging.getLogger(__name__)

# GGMLQuantizationType values (gguf.constants) and (weights, bytes) per block.
Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K = 2, 3, 8, 12, 13, 14
_BLOCKS = {Q4_0: (32, 18), Q4_1: (32, 20), Q8_0: (32, 34), Q4_K: (256, 144)}
KQUANT = kquant.FILE_TYPES  # kept as raw rows (KQuantWeight)
REPACKABLE = frozenset(_BLOCKS) | KQUANT  # the linear types the loader hands over as raw blocks


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


@dataclass
class KQuantWeight:
    """A linear weight [out, in] as raw GGUF K-quant rows (Q4_K, Q5_K or Q6_K), as the file has them."""

    blocks: torch.Tensor  # uint8 [out, in / 256 * bytes per super-block]
    qtype: int
    shape: tuple[int, int]

    def __post_init__(self) -> None:
        out, n_in = self.shape
        if self.qtype not in KQUANT or n_in % 256:
            raise ValueError(f"a K-quant weight needs type Q4_K/Q5_K/Q6_K and 256 | in, got type {self.qtype}, "
                             f"shape {self.shape}")
        if self.blocks.dtype != torch.uint8 or tuple(self.blocks.shape) != (out, kquant.row_bytes(self.qtype, n_in)):
            raise ValueError(f"K-quant blocks have shape {tuple(self.blocks.shape)} / {self.blocks.dtype}, expected "
                             f"uint8 ({out}, {kquant.row_bytes(self.qtype, n_in)})")

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """W [out, in], values as gguf's dequantizer gives them."""
        blocks = self.blocks.contiguous().cpu()
        if kquant.load() is None:
            return kquant.reference(self.qtype, blocks).to(dtype)
        return kquant.dequantize(kquant.make_matrix([(self.qtype, blocks)], self.shape[1])).to(dtype)

    def rows(self, sl: slice) -> KQuantWeight:
        b = self.blocks[sl]
        return KQuantWeight(b, self.qtype, (b.shape[0], self.shape[1]))

    def cols(self, sl: slice) -> KQuantWeight | QuantizedWeight | torch.Tensor:
        """Input channels sl (a row-parallel shard): whole super-blocks stay raw; otherwise Q4_K
        becomes group-32 codes (exact) and Q5_K / Q6_K are dequantized (logged)."""
        if sl.start % 256 == 0 and sl.stop % 256 == 0:
            per = kquant.BLOCK_BYTES[self.qtype]
            b = self.blocks[:, sl.start // 256 * per: sl.stop // 256 * per]
            return KQuantWeight(b, self.qtype, (self.shape[0], sl.stop - sl.start))
        if self.qtype == Q4_K:
            return self.to_quantized().cols(sl)
        logger.info("a tensor-parallel shard [%d, %d) splits 256-weight K-quant blocks: that linear is "
                    "dequantized to float", sl.start, sl.stop)
        return self.dequantize()[:, sl]

    def to_quantized(self, name: str = "linear") -> QuantizedWeight:
        """Q4_K as group-32 codes (exact), for the blocks kernel (kvserve.kernels.qmatmul)."""
        return repack(self.blocks, self.qtype, name)


def settle_parts(parts: list[Any]) -> list[Any]:
    """The parts of one fused linear, ready for a kernel: Q4_K parts become group-32 codes (qmatmul's
    blocks, tuned; exact), Q5_K / Q6_K parts stay raw for the K-quant kernel. Where both kinds are
    left (Q4_K_M's q/k/v: Q6_K v beside Q4_K q and k), the loader stacks one kernel per run of parts
    (kvserve.quant.linear.StackedLinear): the K-quant kernel reads Q4_K at about half the blocks
    kernel's weights per second."""
    return [p.to_quantized() if isinstance(p, KQuantWeight) and p.qtype == Q4_K else p for p in parts]


def kquant_weight(blocks: torch.Tensor, qtype: int, name: str) -> KQuantWeight:
    """Raw GGUF rows uint8 [out, bytes per row] of a K-quant type -> KQuantWeight."""
    per = kquant.BLOCK_BYTES.get(qtype)
    if per is None or blocks.dtype != torch.uint8 or blocks.dim() != 2 or blocks.shape[1] % per:
        raise ValueError(f"GGUF tensor {name!r}: raw blocks have shape {tuple(blocks.shape)} / {blocks.dtype}, "
                         f"expected uint8 [rows, k * {per}] of type {qtype}")
    return KQuantWeight(blocks, qtype, (blocks.shape[0], blocks.shape[1] // per * 256))


class GGUFMethod(QuantMethod):
    """A GGUF linear arrives as `<prefix>.ggml_blocks` (uint8 rows, llama's q/k rows already
    un-permuted by the loader) and `<prefix>.ggml_type` (0-d int64: GGMLQuantizationType)."""

    name = "gguf"

    def tensor_suffixes(self) -> tuple[str, ...]:
        return ("ggml_blocks", "ggml_type")

    def convert(self, prefix: str, tensors: dict[str, torch.Tensor]) -> QuantizedWeight | KQuantWeight:
        """K-quants stay raw (KQuantWeight; `settle_parts` decides once the fused linear is whole),
        the others become group-32 codes."""
        qtype = int(tensors["ggml_type"])
        if qtype in KQUANT:
            return kquant_weight(tensors["ggml_blocks"], qtype, prefix)
        return repack(tensors["ggml_blocks"], qtype, prefix)


def keep_vocab_compressed(net: torch.nn.Module, reader, dtype: torch.dtype, device: torch.device | str) -> list[str]:
    """Keep a GGUF's token_embd (and output, if untied) in their quantized blocks instead of a dense
    table: the LM head, read in full every decode step, runs the blocks kernel (a Q8_0 table is a
    quarter of float32's bytes) or, for Q5_K / Q6_K (Q4_K_M's table), the K-quant kernel on the raw
    rows, and embedding lookups dequantize their rows. Only where that kernel runs and the table is
    whole on this rank. Returns the GGUF tensors kept."""
    import numpy as np

    from kvserve.quant.linear import quantized_linear
    from kvserve.kernels import qmatmul

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
            raw, qtype = torch.from_numpy(np.array(np.asarray(t.data))), int(t.tensor_type)
            qw: QuantizedWeight | KQuantWeight
            if qtype in KQUANT and qtype != Q4_K:
                qw = kquant_weight(raw, qtype, name)
                runs = torch.device(device).type == "cpu" and kquant.load() is not None
            else:
                qw = repack(raw, qtype, name)
                runs = qmatmul.supports(qw.shape[1], qw.group_size, torch.device(device))
            if qw.shape[0] != module.vocab_size or not runs:
                continue
            kept[name] = quantized_linear(qw, None, dtype, device)
        module.set_kernel(kept[name])
    return sorted(kept)
