"""GGUF Q4_K / Q5_K / Q6_K linears read in place (kvserve/kernels/kquant.py, quant/kquant_linear.py):
the kernels against gguf's own dequantizer at every ISA level this CPU runs, the plumbing from a
GGUF file to KQuantLinear (fused parts of mixed types, tensor-parallel slices, the token table),
and the decode stack on such a model against the layer path."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig

from kvserve.models import load_model
from kvserve.quant import gguf as qgguf
from kvserve.quant.base import QuantizedWeight
from kvserve.quant.kquant_linear import KQuantLinear
from kvserve.quant.linear import Int4Linear, StackedLinear
from kvserve.kernels import cpu, kquant, qmatmul
from tests.models.conftest import PagedRunner, kernel_type, make_hf_checkpoint, tiny_tokenizer, write_llama_gguf  # noqa: F401
from tests.worker.test_decode_stack import _compare, _generate, _stack
from tests.worker.test_kernels import AVX2_ENV

Q = gguf.GGMLQuantizationType
KQ = (Q.Q4_K, Q.Q5_K, Q.Q6_K)


def kquant_rows(qtype, rows: int, cols: int, seed: int, d_max: float = 0.02) -> np.ndarray:
    """Random K-quant rows: any byte pattern is a valid block once the fp16 scales are sane (gguf-py
    cannot quantize K types). Q4_K / Q5_K get dmin ~ 16 d, which roughly centres their weights."""
    _, size = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows * cols // 256, size), dtype=np.uint8)
    d = rng.uniform(d_max / 4, d_max, size=(raw.shape[0], 1)).astype(np.float16)
    if qtype == Q.Q6_K:  # ql[128] qh[64] scales[16] d
        raw[:, size - 2:] = d.view(np.uint8)
    else:  # d, dmin, scales[12], (qh[32],) qs[128]
        raw[:, 0:2] = d.view(np.uint8)
        raw[:, 2:4] = (d * 16).astype(np.float16).view(np.uint8)
    return raw.reshape(rows, -1)


def _ref(qtype, raw: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(gguf.quants.dequantize(raw, qtype).reshape(raw.shape[0], -1).astype(np.float32))


def _rel(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.double() - ref).norm() / ref.norm())


def check_kquant() -> list[str]:
    """Each type (and a fused weight of all three) against x @ W.T in float64 on gguf's dequantized W;
    returns what failed (run in-process, and in a subprocess per ISA level)."""
    bad = []
    parts = []
    for i, qtype in enumerate(KQ):
        raw = kquant_rows(qtype, 37, 512, seed=i)  # 37 rows: the threads' row ranges differ in size
        ref = _ref(qtype, raw)
        parts.append((int(qtype), torch.from_numpy(raw), ref))
        m = kquant.make_matrix([(int(qtype), torch.from_numpy(raw))], 512)
        # one fused multiply-add at most apart from gguf's (d sc) q - dmin m
        if not torch.allclose(kquant.dequantize(m), ref, rtol=1e-6, atol=1e-6 * float(ref.abs().max())):
            bad.append(f"dequantize {qtype.name}")
        if not torch.equal(kquant.dequantize(m, torch.bfloat16), kquant.dequantize(m).bfloat16()):
            bad.append(f"dequantize {qtype.name} to bfloat16")
        for rows in (1, 2, 3, 5, 9, 40):
            x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows))
            rel = _rel(kquant.matmul(x, m), x.double() @ ref.double().T)
            if not rel < 1e-4:
                bad.append(f"matmul {qtype.name} m={rows}: {rel:.2e}")
        # batch invariance: each token's output the bits it has alone (verify rows, decode batches)
        x = torch.randn(9, 512, generator=torch.Generator().manual_seed(99))
        alone = torch.cat([kquant.matmul(x[i:i + 1], m) for i in range(9)])
        for rows in (2, 3, 4, 5, 9):
            if not torch.equal(kquant.matmul(x[:rows], m), alone[:rows]):
                bad.append(f"batch invariance {qtype.name} m={rows}")
        xs = torch.randn(3, 1024)[:, ::2]  # strided rows: a column slice of a wider tensor
        if not _rel(kquant.matmul(xs, m), xs.double() @ ref.double().T) < 1e-4:
            bad.append(f"strided x {qtype.name}")
    fused = kquant.make_matrix([(q, r) for q, r, _ in parts], 512)
    ref = torch.cat([w for _, _, w in parts])
    x = torch.randn(3, 512)
    if not _rel(kquant.matmul(x, fused), x.double() @ ref.double().T) < 1e-4:
        bad.append("fused Q4_K + Q5_K + Q6_K")
    return bad + check_interleaved()


def check_interleaved() -> list[str]:
    """Q6_K rows interleaved by 8 (kquant.interleave, on every vector level): the file's weights
    back bit for bit, x @ W.T within the int16 codes' error at any batch, each token's bits the same
    in any batch and under any split of the rows between threads (40 rows over 3 threads cut
    groups of 8), and beside a part of another type."""
    bad = []
    raw = torch.from_numpy(kquant_rows(Q.Q6_K, 40, 768, seed=5))
    qtype, il = kquant.interleave(int(Q.Q6_K), raw)
    if qtype != kquant.Q6_KI:
        return [] if cpu.isa_level() == "generic" else ["Q6_K rows in 8s not interleaved"]
    if kquant.interleave(int(Q.Q6_K), raw[:36].contiguous())[0] != int(Q.Q6_K):
        bad.append("36 rows interleaved")
    ref = _ref(Q.Q6_K, raw.numpy())
    plain, m = kquant.make_matrix([(int(Q.Q6_K), raw)], 768), kquant.make_matrix([(qtype, il)], 768)
    for dtype in (torch.float32, torch.bfloat16):
        if not torch.equal(kquant.dequantize(m, dtype), kquant.dequantize(plain, dtype)):
            bad.append(f"interleaved Q6_K dequantized to {dtype}")
    x = torch.randn(19, 768, generator=torch.Generator().manual_seed(4))
    for rows in (1, 2, 3, 5, 8, 9, 13, 19):
        rel = _rel(kquant.matmul(x[:rows], m), x[:rows].double() @ ref.double().T)
        if not rel < 1e-4:
            bad.append(f"interleaved Q6_K m={rows}: {rel:.2e}")
    alone = torch.cat([kquant.matmul(x[i:i + 1], m) for i in range(19)])
    for rows in (2, 3, 8, 9, 16, 19):
        if not torch.equal(kquant.matmul(x[:rows], m), alone[:rows]):
            bad.append(f"interleaved Q6_K batch invariance m={rows}")
    threads = torch.get_num_threads()
    try:
        for n in (1, 3):
            torch.set_num_threads(n)
            if not torch.equal(kquant.matmul(x[:2], m), alone[:2]):
                bad.append(f"interleaved Q6_K on {n} threads")
    finally:
        torch.set_num_threads(threads)
    q4 = kquant_rows(Q.Q4_K, 8, 768, seed=6)
    fused = kquant.make_matrix([(int(Q.Q4_K), torch.from_numpy(q4)), (qtype, il)], 768)
    want = x[:3].double() @ torch.cat([_ref(Q.Q4_K, q4), ref]).double().T
    if not _rel(kquant.matmul(x[:3], fused), want) < 1e-4:
        bad.append("Q4_K + interleaved Q6_K")
    return bad


def _int8_exact_x(rows: int, cols: int, seed: int) -> torch.Tensor:
    """Activations that int8 codes per 32 values hold exactly: integers in [-127, 127] with one at
    127 in each block, times a power of two (so amax / 127 and every code are exact)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-127, 128, (rows, cols // 32, 32), generator=g).float()
    q[:, :, 5] = 127
    return (q * 2.0 ** torch.randint(-8, 2, (rows, cols // 32, 1), generator=g).float()).reshape(rows, cols)


def check_kquant_int8() -> list[str]:
    """kquant.matmul_int8 (prefill-sized batches on int8 activations): where it applies (an AVX2
    build, parts in groups of 8 rows), against x @ W.T in float64 with x that int8 codes hold
    exactly, within the int8 rounding for any x, and batch-invariant; returns what failed."""
    bad = []
    odd = kquant.make_matrix([(int(Q.Q6_K), torch.from_numpy(kquant_rows(Q.Q6_K, 37, 512, seed=0)))], 512)
    if kquant.int8_applies(odd):
        bad.append("int8 applies to 37 rows")
    # one type in 24 rows (a pair of groups and a lone one), and three parts of 8, 16 and 24 rows
    # whose pairs of groups straddle the parts (the 512-bit tile takes two groups at once)
    for qtypes in ([Q.Q6_K], [Q.Q4_K], [Q.Q5_K], [Q.Q4_K, Q.Q6_K, Q.Q5_K]):
        raws = [kquant_rows(q, 24 if len(qtypes) == 1 else 8 * (i + 1), 512, seed=10 + i) for i, q in enumerate(qtypes)]
        m = kquant.make_matrix([(int(q), torch.from_numpy(r)) for q, r in zip(qtypes, raws)], 512)
        name = "+".join(q.name for q in qtypes)
        if not kquant.int8_applies(m):
            if cpu.isa_level() != "generic":
                bad.append(f"int8 does not apply to {name}")
            continue
        ref = torch.cat([_ref(q, r) for q, r in zip(qtypes, raws)]).double()
        for rows in (1, 3, 8, 13, 16, 37):
            x = _int8_exact_x(rows, 512, seed=rows)
            rel = _rel(kquant.matmul_int8(x, m), x.double() @ ref.T)
            if not rel < 1e-5:
                bad.append(f"int8 {name} m={rows}: {rel:.2e}")
        x = torch.randn(40, 512, generator=torch.Generator().manual_seed(1))
        rel = _rel(kquant.matmul_int8(x, m), x.double() @ ref.T)
        if not rel < 2e-2:
            bad.append(f"int8 {name} rounding: {rel:.2e}")
        x = torch.randn(19, 512, generator=torch.Generator().manual_seed(2))
        alone = torch.cat([kquant.matmul_int8(x[i:i + 1], m) for i in range(19)])
        for rows in (2, 5, 8, 9, 16, 19):
            if not torch.equal(kquant.matmul_int8(x[:rows], m), alone[:rows]):
                bad.append(f"int8 batch invariance {name} m={rows}")
        # Q6_K parts interleaved by 8 make the same per-call copy, so the same bits
        kept = [kquant.interleave(int(q), torch.from_numpy(r)) for q, r in zip(qtypes, raws)]  # alive while m is used
        if not torch.equal(kquant.matmul_int8(x, kquant.make_matrix(kept, 512)), kquant.matmul_int8(x, m)):
            bad.append(f"int8 {name} interleaved")
    return bad


def test_kernels_match_gguf_dequantize():
    assert kquant.load() is not None, "the C kernel must build here (gcc is part of the setup)"
    assert check_kquant() == []


def test_int8_prefill_path_matches_and_is_batch_invariant():
    assert check_kquant_int8() == []


def test_a_decode_rows_sum_does_not_depend_on_the_thread_split():
    """At one token Q6_K rows go through the kernel in pairs (an odd last one paired with itself):
    a row's output has the same bits whichever place of a pair it takes, so whatever rows the
    threads were given (the layer path splits by thread count, the decode stack in pieces)."""
    raw = torch.from_numpy(kquant_rows(Q.Q6_K, 37, 1024, seed=7))
    x = torch.randn(1, 1024, generator=torch.Generator().manual_seed(0))
    whole = kquant.matmul(x, kquant.make_matrix([(int(Q.Q6_K), raw)], 1024))
    shifted = kquant.matmul(x, kquant.make_matrix([(int(Q.Q6_K), raw[1:].contiguous())], 1024))
    assert torch.equal(whole[:, 1:], shifted)
    threads = torch.get_num_threads()
    try:
        for n in (1, 3):
            torch.set_num_threads(n)
            assert torch.equal(kquant.matmul(x, kquant.make_matrix([(int(Q.Q6_K), raw)], 1024)), whole)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("level", cpu.runnable_levels())
def test_every_isa_level_this_cpu_runs(level, tmp_path):
    """The generic body and each vector level build and pass (avx2 with torch held to AVX2 too)."""
    env = {**os.environ, "KVSERVE_CPU_ISA": level, "KVSERVE_CACHE_DIR": str(tmp_path)}
    if level == "avx2":
        env.update(AVX2_ENV)
    code = ("import json; from tests.quant.test_kquant import check_kquant; "
            "from kvserve.kernels import cpu, kquant; assert kquant.load() is not None; "
            "from tests.quant.test_kquant import check_kquant_int8; "
            "print(json.dumps({'level': cpu.isa_level(), 'bad': check_kquant() + check_kquant_int8()}))")
    root = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300,
                         check=False, cwd=root)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {"level": level, "bad": []}


@pytest.mark.parametrize("qtype", [Q.Q5_K, Q.Q6_K])
def test_linear_kernel_dense_path_and_rows(qtype):
    raw = kquant_rows(qtype, 48, 768, seed=3)
    ref = _ref(qtype, raw)
    bias = torch.randn(48)
    lin = KQuantLinear(qgguf.kquant_weight(torch.from_numpy(raw), int(qtype), "w"), bias, torch.float32)
    assert (lin.path, lin.dense_from, lin.out_features, lin.in_features) == ("kquant", 16, 48, 768)
    for rows in (1, 2, 3, 5, 9, 40):  # 40: dequantize + F.linear
        x = torch.randn(rows, 768)
        assert _rel(lin(x), x.double() @ ref.double().T + bias) < (1e-4 if rows < 16 else 1e-6), rows
    torch.testing.assert_close(lin.dequantize(), ref, rtol=1e-6, atol=1e-6)
    ids = torch.tensor([47, 0, 5, 5, 31])
    torch.testing.assert_close(lin.rows(ids), ref[ids], rtol=1e-6, atol=1e-6)
    # the rows are dequantize's values, a few on the calling thread or many split between threads
    full = lin.dequantize()
    for many in (ids, torch.arange(48).flip(0).repeat(2)):
        assert torch.equal(lin.rows(many), full[many])
    with pytest.raises(IndexError, match="48"):
        lin.rows(torch.tensor([3, 48]))
    assert lin.raw.numel() == raw.size  # the file's bytes, nothing more
    # the dense path dequantizes into the thread's reused buffer: the same bits as a fresh one
    m = lin.matrix()
    again = kquant.dequantize(m, reuse=True)
    assert torch.equal(again, kquant.dequantize(m)) and again.data_ptr() == kquant.dequantize(m, reuse=True).data_ptr()


def test_convert_settle_and_shard():
    """Q4_K goes to the blocks kernel, alone or beside a Q5_K / Q6_K part (which stays raw); a
    tensor-parallel column slice keeps whole 256-weight blocks raw and dequantizes otherwise."""
    method = qgguf.GGUFMethod()

    def convert(qtype, rows, seed):
        raw = torch.from_numpy(kquant_rows(qtype, rows, 512, seed))
        return method.convert("model.layers.0.self_attn.q_proj",
                              {"ggml_blocks": raw, "ggml_type": torch.tensor(int(qtype))})

    q4, q6 = convert(Q.Q4_K, 64, 0), convert(Q.Q6_K, 32, 1)
    assert isinstance(q4, qgguf.KQuantWeight) and q4.shape == (64, 512)
    alone = qgguf.settle_parts([q4, convert(Q.Q4_K, 32, 2)])
    assert all(isinstance(p, QuantizedWeight) for p in alone)
    torch.testing.assert_close(alone[0].dequantize(), q4.dequantize(), rtol=0, atol=0)
    mixed = qgguf.settle_parts([q4, q6])
    assert isinstance(mixed[0], QuantizedWeight) and mixed[1] is q6
    assert torch.equal(mixed[0].dequantize(), alone[0].dequantize())
    q40 = qgguf.repack(torch.from_numpy(gguf.quants.quantize(np.ones((8, 512), np.float32), Q.Q4_0)), 2, "x")
    assert [type(p) for p in qgguf.settle_parts([q40, q6])] == [QuantizedWeight, qgguf.KQuantWeight]
    full = q6.dequantize()
    part = q6.cols(slice(256, 512))
    assert isinstance(part, qgguf.KQuantWeight) and torch.equal(part.dequantize(), full[:, 256:])
    assert torch.equal(q6.cols(slice(128, 384)), full[:, 128:384])
    assert isinstance(q4.cols(slice(128, 384)), QuantizedWeight)
    assert torch.equal(q6.rows(slice(4, 9)).dequantize(), full[4:9])
    assert qgguf.REPACKABLE == {Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K}


def test_stacked_linear_runs_each_part_and_links_the_decode_stack():
    """A StackedLinear (Q4_K rows as blocks, then Q6_K rows raw) multiplies like the dense weight plus
    its bias, and the decode stack gets one C Lin per part, each pointing at the next, the bias split."""
    import ctypes
    from types import SimpleNamespace

    from kvserve.kernels import decode_stack as c_stack
    from kvserve.quant.linear import quantized_linear
    from kvserve.worker.decode_stack import _lin

    q4 = qgguf.kquant_weight(torch.from_numpy(kquant_rows(Q.Q4_K, 64, 512, 3)), int(Q.Q4_K), "q")
    q6 = qgguf.kquant_weight(torch.from_numpy(kquant_rows(Q.Q6_K, 32, 512, 4, 4e-4)), int(Q.Q6_K), "v")
    blocks, raw = (quantized_linear(p, None, torch.float32) for p in qgguf.settle_parts([q4, q6]))
    assert type(blocks) is Int4Linear and type(raw) is KQuantLinear
    bias = torch.randn(96)
    st = StackedLinear([blocks, raw], bias, torch.float32)
    w = torch.cat([q4.dequantize(), q6.dequantize()])
    assert torch.equal(st.dequantize(), w)
    x = torch.randn(3, 512)
    assert _rel(st(x), F.linear(x.double(), w.double(), bias.double())) < 1e-4  # int16 activations in the Q6_K part
    lin, rows, keep = _lin(SimpleNamespace(tp=SimpleNamespace(size=1), kernel=st, bias=None))
    rest = c_stack.Lin.from_address(lin.rest)
    assert (lin.n, lin.kind, lin.bias) == (64, blocks.blocks().kind, bias.data_ptr())
    assert (rest.n, rest.kind, rest.bias, rest.rest) == (32, c_stack.LIN_KQUANT, bias.data_ptr() + 4 * 64, None)
    assert rows == min(blocks.dense_from, raw.dense_from)
    assert any(isinstance(k, c_stack.Lin) and ctypes.addressof(k) == lin.rest for k in keep)  # kept alive


SMALL = {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "max_position_embeddings": 128, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
         "tie_word_embeddings": True}
LINEARS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
# every linear Q6_K; or llama.cpp's Q4_K_M mix: Q4_K, with Q6_K attn_v (fused with Q4_K q/k) and a
# Q5_K ffn_down here for the third type
MIXES = {"q6_k": dict.fromkeys(LINEARS, Q.Q6_K),
         "q4_k_m": {**dict.fromkeys(LINEARS, Q.Q4_K), "attn_v": Q.Q6_K, "ffn_down": Q.Q5_K}}


@pytest.fixture
def kquant_gguf(make_hf_checkpoint, write_llama_gguf, tmp_path):  # noqa: F811
    """kquant_gguf(mix) -> a tiny llama GGUF whose linears and token table are random K-quant rows."""

    def make(mix: str):
        _, hf = make_hf_checkpoint(LlamaConfig(**SMALL))
        cfg = hf.config
        shapes = {"attn_q": (256, 256), "attn_k": (128, 256), "attn_v": (128, 256), "attn_output": (256, 256),
                  "ffn_gate": (512, 256), "ffn_up": (512, 256), "ffn_down": (256, 512)}
        raw = {"token_embd.weight": (kquant_rows(Q.Q6_K, cfg.vocab_size, 256, 99, 4e-4), Q.Q6_K)}
        for i in range(cfg.num_hidden_layers):
            for j, (name, qtype) in enumerate(MIXES[mix].items()):
                d_max = 4e-4 if qtype == Q.Q6_K else 2e-3  # weights of std ~0.1
                raw[f"blk.{i}.{name}.weight"] = (kquant_rows(qtype, *shapes[name], 10 * i + j, d_max), qtype)
        qtypes = {"token_embd": Q.F32, **dict.fromkeys(LINEARS, Q.F32)}
        return write_llama_gguf(hf, tmp_path / f"{mix}.gguf", qtypes, raw=raw)

    return make


@pytest.mark.parametrize("mix", list(MIXES))
def test_tiny_gguf_loads_kquant_linears(kquant_gguf, mix):
    path = kquant_gguf(mix)
    packed = load_model(str(path), dtype="float32")
    plain = load_model(str(path), dtype="float32", quantization="none")
    layer = packed.model.model.layers[1]
    for lin in (layer.mlp.down_proj, packed.model.model.embed_tokens):
        assert kernel_type(lin) is KQuantLinear and lin.kernel.path == "kquant"
    assert packed.model.lm_head.kernel is packed.model.model.embed_tokens.kernel  # tied: one table
    qkv = layer.self_attn.qkv_proj.kernel
    if mix == "q4_k_m":  # Q4_K q and k as blocks, the Q6_K v raw: one kernel each, stacked
        assert type(qkv) is StackedLinear and [type(k) for k in qkv.kernels] == [Int4Linear, KQuantLinear]
        assert [k.out_features for k in qkv.kernels] == [384, 128] and qkv.kernels[1].qtypes == [Q.Q6_K]
        assert qkv.kernels[0].path == "blocks" and qkv.kernels[0].blocks().kind & qmatmul.KSCALES
        assert kernel_type(layer.mlp.gate_up_proj) is Int4Linear  # Q4_K alone: the blocks kernel
        plain_qkv = plain.model.model.layers[1].self_attn.qkv_proj.weight
        torch.testing.assert_close(qkv.dequantize(), plain_qkv, rtol=1e-6, atol=1e-6)
    else:
        assert type(qkv) is KQuantLinear and qkv.qtypes == [Q.Q6_K] * 3
    tokens = [5, 17, 42, 99, 7, 250, 3, 64, 128, 11]
    logits = []
    for lm in (packed, plain):
        runner = PagedRunner(lm.model, lm.hf_config, block_size=4, num_blocks=8)
        logits.append(torch.cat([runner.step(tokens[:7]), runner.step(tokens[7:8], decode=True),
                                 runner.step(tokens[8:], decode=False)]))
    assert torch.isfinite(logits[1]).all() and logits[1].std() > 0.1
    rel = _rel(logits[0], logits[1].double())
    print(f"{mix}: logits relative to the dequantized model {rel:.1e}")
    assert rel < 1e-3  # int16 activations at the decode-sized steps
    assert logits[0].argmax(-1).tolist() == logits[1].argmax(-1).tolist()
    w = plain.model.model.layers[1].mlp.down_proj.weight
    torch.testing.assert_close(layer.mlp.down_proj.kernel.dequantize(), w, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("mix", list(MIXES))
def test_decode_stack_runs_kquant_linears(kquant_gguf, monkeypatch, mix):
    """Greedy tokens with the stack equal the layer path's, logprobs within int16 activations' bound
    (the K-quant kernel's; test_decode_stack.py's ACT_RTOL)."""
    from kvserve import LLM
    from kvserve.kernels import tuning

    # the K-quant linears keep their untuned crossover (16 rows): on these tiny shapes tuning may
    # find the dense path faster from 2 rows (the generic kernel does), and then only one-token
    # steps would reach the stack, which the batched prompts here never are
    monkeypatch.setattr(tuning, "tune_kquant_linears", lambda model, dtype: None)
    llm = LLM(model=str(kquant_gguf(mix)), dtype="float32", block_size=4, num_kv_blocks=256,
              check_integrity=True, enable_prefix_caching=False)
    assert _stack(llm).decode_stack is not None
    on, calls = _generate(llm, True, monkeypatch)
    off, _ = _generate(llm, False, monkeypatch)
    assert calls > 0
    _compare(on, off, act="int16")


def test_dense_fallback_without_the_kernel(monkeypatch):
    """No C kernel (or not a CPU): the weight is dequantized once, as before K-quants were kept."""
    raw = kquant_rows(Q.Q6_K, 16, 256, seed=5)
    monkeypatch.setattr(kquant, "load", lambda: None)
    lin = KQuantLinear(qgguf.kquant_weight(torch.from_numpy(raw), int(Q.Q6_K), "w"), None, torch.float32)
    ref = _ref(Q.Q6_K, raw)
    assert lin.path == "dense" and torch.equal(lin.weight, ref)
    x = torch.randn(2, 256)
    torch.testing.assert_close(lin(x), F.linear(x, ref))
    assert torch.equal(lin.rows(torch.tensor([3, 1])), ref[[3, 1]])
