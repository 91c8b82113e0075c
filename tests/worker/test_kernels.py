"""The C kernels of kvserve/kernels against torch references, on every ISA level this CPU
runs (AVX2 imitated on bigger CPUs, as CI does). The tuning rules: test_tuning.py."""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
import threading

import pytest
import torch
import torch.nn.functional as F

from kvserve.layers.rotary import apply_rotary
from kvserve.quant.base import quantize_rtn
from kvserve.kernels import build, cpu, decode_stack, kquant, layout, ops, paged_attention, qmatmul

# torch's own kernels held to AVX2 as well (ATen, oneDNN, MKL): the imitation the issue asks CI to run
AVX2_ENV = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}


def _blocks(bits: int, n: int, k: int, group: int | None, seed: int = 0, symmetric: bool = False,
            half: bool = False):
    """Random codes; symmetric: no offsets; half: scales float16 holds exactly (as a GGUF Q4_0's)."""
    g = torch.Generator().manual_seed(seed)
    qw = quantize_rtn(torch.randn(n, k, generator=g) * 0.05, bits, group, symmetric=symmetric)
    if half:
        qw.scale = qw.scale.half().float()
        qw.offset = -(2 ** (bits - 1)) * qw.scale
    return qw, qmatmul.Blocks.from_codes(qw.q, qw.scale, qw.offset, bits)


def _k_blocks(n: int, k: int, top: int, seed: int = 0):
    """Codes with a GGUF Q4_K's scales: 6-bit codes times a float16 per 256 weights (the largest code
    of 8 is `top` in the first 256s and random after them, as llama.cpp's importance-weighted
    quantizer leaves it), for scale and offset alike."""
    g = torch.Generator().manual_seed(seed)
    sd, sm = ((torch.rand(n, k // 256, 1, generator=g) * 1e-4 + 1e-5).half().float() for _ in range(2))
    sc, m = (torch.randint(0, 64, (n, k // 256, 8), generator=g).float() for _ in range(2))
    sc[:, 0, 0] = m[:, 0, 0] = top
    q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    scale, offset = (sd * sc).view(n, -1), (-sm * m).view(n, -1)
    dense = (q.float() - 8).view(n, -1, 32) * scale[..., None] + (offset + 8 * scale)[..., None]  # centred, as stored
    return dense.view(n, k), qmatmul.Blocks.from_codes(q, scale, offset, 4), (q, scale, offset)


def _same_int8(a: torch.Tensor, b: torch.Tensor, bits: int) -> bool:
    """int8 activations on interleaved and row-major weights: 8-bit codes without VNNI take
    row-major copies (the same bits); 4-bit ones, and 8-bit ones with VNNI, are read in place, the
    same integer sums per block but their floats summed in another order."""
    if bits == 8 and cpu.isa_level() not in qmatmul.VNNI_LEVELS:
        return torch.equal(a, b)
    return torch.allclose(a, b, rtol=1e-5, atol=1e-6 * float(b.abs().max()))


def check_qmatmul() -> list[str]:
    """Every shape, bit width and activation mode against F.linear on the dequantized weight;
    returns what failed (run in-process, and in a subprocess per ISA level)."""
    bad = []
    for bits in (4, 8):
        # symmetric codes store no offsets (Blocks.c is None), and scales exact in float16 are kept
        # so (Blocks.kind has HALF_SCALES): the kernels' other branches; 300 and 296 rows span two
        # SCALE_ROWS chunks of widened scales per thread (296: interleaved too)
        for n, k, group, sym, half in ((1, 32, 32, False, False), (37, 96, 32, False, False),
                                       (64, 800, 160, False, False), (130, 256, None, False, False),
                                       (40, 160, 32, True, False), (300, 96, 32, True, True),
                                       (296, 96, 32, True, True)):
            qw, w = _blocks(bits, n, k, group, symmetric=sym, half=half)
            if sym and w.c is not None or half != (w.kind != bits):
                bad.append(f"layout: offsets {w.c is not None}, kind {w.kind} for {bits}-bit {n}x{k}")
            dense = qw.dequantize()
            bad += check_blocks(w, dense, bits, n, k)
            if qmatmul.can_interleave(w):  # rows interleaved by 8, as weights run int16 activations
                wi = qmatmul.relayout(w, True)
                bad += [f"interleaved: {b}" for b in check_blocks(wi, dense, bits, n, k)]
                ids = torch.tensor([n - 1, 0, 5, n // 2])
                x = torch.randn(3, k, generator=torch.Generator().manual_seed(7))
                # dequantize reads an interleaved 4-bit weight 8 rows at a time, a row-major one by rows
                if not (torch.equal(qmatmul.rows(wi, ids), qmatmul.rows(w, ids))
                        and all(torch.equal(qmatmul.dequantize(wi, dt), qmatmul.dequantize(w, dt))
                                for dt in (torch.float32, torch.bfloat16))
                        and torch.equal(qmatmul.relayout(wi, False).codes, w.codes)
                        and _same_int8(qmatmul.matmul(x, wi, "int8"), qmatmul.matmul(x, w, "int8"), bits)
                        and torch.equal(qmatmul.matmul(x, wi, "float32"), qmatmul.matmul(x, w, "float32"))):
                    bad.append(f"interleaved rows / layout / other modes {n}x{k}")
    # Q4_K's scales, kept factored (KSCALES): 296 rows span two SCALE_ROWS chunks and interleave
    for n, k, top in ((64, 512, 63), (296, 768, 63), (40, 256, 57)):
        dense, w, (q, scale, offset) = _k_blocks(n, k, top)
        if w.kind != 4 | qmatmul.KSCALES or w.nbytes() * 32 != n * k * 18.5:
            bad.append(f"factored layout: kind {w.kind}, {w.nbytes()} bytes for {n}x{k}")
            continue
        bad += [f"factored: {b}" for b in check_blocks(w, dense, 4, n, k)]
        wi = qmatmul.relayout(w, True)
        bad += [f"factored, interleaved: {b}" for b in check_blocks(wi, dense, 4, n, k)]
        # every kernel but the interleaved int16 one reads the scales multiplied out: the float32
        # form's very bits
        wf = qmatmul.Blocks(w.codes, scale.contiguous(), (offset + 8 * scale).contiguous(), 4)
        x = torch.randn(3, k, generator=torch.Generator().manual_seed(5))
        ids = torch.tensor([n - 1, 0, 9])
        if not (torch.equal(qmatmul.dequantize(wi), qmatmul.dequantize(wf))
                and torch.equal(qmatmul.rows(wi, ids), qmatmul.rows(wf, ids))
                and all(torch.equal(qmatmul.matmul(x, a, mode), qmatmul.matmul(x, wf, mode))
                        for mode in qmatmul.MODES for a in (w, wi) if not (a is wi and mode != "float32"))
                and _same_int8(qmatmul.matmul(x, wi, "int8"), qmatmul.matmul(x, wf, "int8"), 4)):
            bad.append(f"factored scales against float32 ones {n}x{k}")
    return bad


def check_blocks(w, dense, bits: int, n: int, k: int) -> list[str]:
    """One weight's dequantization, products in every mode and batch invariance."""
    bad = []
    if not (torch.allclose(qmatmul.dequantize(w), dense, rtol=1e-6, atol=1e-7)
            and torch.allclose(qmatmul.reference(w), dense, rtol=1e-6, atol=1e-7)):
        bad.append(f"dequantize {bits}-bit {n}x{k}")
    # bfloat16 written directly is float32's value rounded as torch rounds it
    f32 = qmatmul.dequantize(w)
    if not (torch.equal(qmatmul.dequantize(w, torch.bfloat16).view(torch.int16), f32.bfloat16().view(torch.int16))
            and torch.equal(qmatmul.dequantize(w, torch.float16), f32.half())):
        bad.append(f"dequantize {bits}-bit {n}x{k} to bfloat16 / float16")
    # embedding rows: dequantize's values, a few rows on the calling thread, many split (TAKE_ROWS_THREADED)
    for ids in (torch.tensor([n - 1, 0, n // 2, 0]), torch.arange(n).flip(0).repeat(64 // n + 1)):
        if not torch.equal(qmatmul.rows(w, ids), f32[ids]):
            bad.append(f"rows {bits}-bit {n}x{k} ({len(ids)} ids)")
    try:
        qmatmul.rows(w, torch.tensor([0, n]))
        bad.append(f"rows {bits}-bit {n}x{k}: id {n} taken")
    except IndexError:
        pass
    for m in (1, 2, 3, 4, 5, 9, 12, 17, 130):  # 12+: row-major weights take the panel path; 130 spans two token chunks
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
        ref = F.linear(x, dense)
        for mode, tol in (("float32", 2e-6), ("int8", 2e-2), ("int16", 1e-4)):
            y = qmatmul.matmul(x, w, mode)
            rel = float((y - ref).norm() / ref.norm())
            if not rel < tol:
                bad.append(f"{mode} {bits}-bit {n}x{k} m={m}: {rel:.2e}")
    # Batch invariance below the panel path: each token's output is the same bits as when it
    # runs alone (speculative decoding's verify rows equal one-token steps; greedy outputs
    # do not depend on what shares the batch).
    x = torch.randn(9, k, generator=torch.Generator().manual_seed(99))
    for mode in ("float32", "int8", "int16"):
        alone = torch.cat([qmatmul.matmul(x[i:i + 1], w, mode) for i in range(9)])
        for m in (2, 4, 5, 9):
            if not torch.equal(qmatmul.matmul(x[:m], w, mode), alone[:m]):
                bad.append(f"batch invariance {mode} {bits}-bit {n}x{k} m={m}")
    # strided rows: a column slice of a wider tensor (seeded, and judged as the products above: by
    # norm; an element-wise 1e-4 failed now and then on int16's rounding, ~1.3e-4 on outputs of ~4)
    xs = torch.randn(5, 2 * k, generator=torch.Generator().manual_seed(11))[:, ::2]
    ref = F.linear(xs, dense)
    for mode, tol in (("float32", 2e-6), ("int16", 1e-4)):
        rel = float((qmatmul.matmul(xs, w, mode) - ref).norm() / ref.norm())
        if not rel < tol:
            bad.append(f"strided x {mode} {bits}-bit {n}x{k}: {rel:.2e}")
    return bad


def test_qmatmul_matches_dequantized_weight():
    assert qmatmul.load() is not None, "the C kernel must build here (gcc is part of the setup)"
    assert check_qmatmul() == []


def test_dequantize_into_a_reused_buffer():
    """reuse=True writes into the calling thread's scratch (no fresh pages per prefill matmul):
    the same bits as a fresh buffer, the same memory call after call, another per thread."""
    if qmatmul.load() is None:
        pytest.skip("no C compiler")
    _, w = _blocks(4, 48, 256, 32, half=True)
    _, small = _blocks(4, 16, 256, 32, seed=1, half=True)
    a = qmatmul.dequantize(w, torch.bfloat16, reuse=True)
    assert torch.equal(a, qmatmul.dequantize(w, torch.bfloat16))
    ptr = a.data_ptr()
    b = qmatmul.dequantize(small, torch.bfloat16, reuse=True)  # smaller: the same buffer, the new weight
    assert b.data_ptr() == ptr and torch.equal(b, qmatmul.dequantize(small, torch.bfloat16))
    assert torch.equal(qmatmul.dequantize(w, reuse=True), qmatmul.dequantize(w))  # float32 has its own
    other = []
    t = threading.Thread(target=lambda: other.append(qmatmul.dequantize(w, torch.bfloat16, reuse=True).data_ptr()))
    t.start()
    t.join()
    assert other[0] != ptr


def test_amx_linear_matches_the_dequantized_matmul():
    """The AMX tile matmul (Xeons with AMX-BF16 only) against torch's float32 matmul of the same
    bfloat16 operands (x rounded, W dequantized to bfloat16): equal up to summation order, on every
    layout it takes (interleaved 4-bit through its own dequantization, the rest row by row), token
    counts off its 32-token blocks, and a panel of rows shorter than the rest."""
    if qmatmul.load() is None or not qmatmul.amx_ready():
        pytest.skip("no AMX tiles here")
    weights = {"q4_0": _blocks(4, 96, 256, 32, half=True, symmetric=True)[1], "int4": _blocks(4, 224, 512, 64)[1],
               "q4_k": _k_blocks(64, 512, 63)[1], "int8": _blocks(8, 64, 256, 32)[1]}
    g = torch.Generator().manual_seed(5)
    for name, w in weights.items():
        for il in (False, True):
            wl = qmatmul.relayout(w, il)
            ref_w = qmatmul.dequantize(wl, torch.bfloat16).float()
            assert torch.equal(ref_w, qmatmul.dequantize(w, torch.bfloat16).float())
            for m in (1, 17, 40, 64):
                x = torch.randn(m, w.shape[1], generator=g)
                ref = F.linear(x.bfloat16().float(), ref_w)
                y = qmatmul.amx_linear(x, wl)
                assert float((y - ref).abs().max() / ref.abs().max()) < 1e-5, (name, il, m)
                assert torch.equal(qmatmul.dense_matmul(x, wl, torch.bfloat16), y)  # the dense path takes it
    with pytest.raises(RuntimeError, match="amx_linear"):
        qmatmul.amx_linear(torch.randn(2, 256), _blocks(4, 40, 256, 32)[1])  # 40 rows: not whole panels


@pytest.mark.parametrize("level", cpu.runnable_levels())
def test_every_isa_level_this_cpu_runs(level, tmp_path):
    """Each level builds and passes (avx2 with torch's kernels held to AVX2 too)."""
    env = {**os.environ, "KVSERVE_CPU_ISA": level, "KVSERVE_CACHE_DIR": str(tmp_path)}
    if level == "avx2":
        env.update(AVX2_ENV)
    code = ("import json, sys; from tests.worker.test_kernels import check_qmatmul, check_ops, "
            "check_paged_prefill; from kvserve.kernels import cpu, decode_stack, qmatmul, ops; "
            "assert qmatmul.load() is not None and ops.load() is not None and decode_stack.load() is not None; "
            "print(json.dumps({'level': cpu.isa_level(), 'bad': check_qmatmul() + check_ops() + "
            "check_paged_prefill()}))")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result == {"level": level, "bad": []}


def test_isa_override_refuses_what_the_cpu_lacks(monkeypatch):
    monkeypatch.setenv("KVSERVE_CPU_ISA", "sse9")
    with pytest.raises(ValueError, match="KVSERVE_CPU_ISA='sse9' is not one of"):
        cpu.isa_level()
    monkeypatch.setattr(cpu, "cpu_flags", lambda: frozenset({"avx2", "fma", "f16c"}))
    monkeypatch.setattr(cpu, "native_level", lambda: "avx2")
    monkeypatch.setenv("KVSERVE_CPU_ISA", "avx512_vnni")
    with pytest.raises(ValueError, match="this CPU cannot run it"):
        cpu.isa_level()
    monkeypatch.setattr(cpu, "cpu_flags", lambda: frozenset({"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl"}))
    monkeypatch.setattr(cpu, "native_level", lambda: "avx512")
    assert cpu.runnable_levels() == ["avx512", "avx2", "generic"]  # no AVX-VNNI on this one
    monkeypatch.setenv("KVSERVE_CPU_ISA", "avx_vnni")
    with pytest.raises(ValueError, match="this CPU cannot run it"):
        cpu.isa_level()
    monkeypatch.setenv("KVSERVE_CPU_ISA", "generic")
    assert cpu.isa_level() == "generic"


def check_ops() -> list[str]:
    bad = []
    g = torch.Generator().manual_seed(0)
    for t, n in ((1, 576), (5, 100), (40, 64)):
        x, r, w = (torch.randn(t, n, generator=g) for _ in range(3))
        w = w[0]
        ref_r = x + r
        ref = w * (ref_r * torch.rsqrt(ref_r.pow(2).mean(-1, keepdim=True) + 1e-5))
        out, new_r = ops.rms_norm(x, w, 1e-5, r)
        plain = ops.rms_norm(x, w, 1e-5)
        ref_plain = w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))
        if not (torch.allclose(out, ref, atol=1e-5) and torch.equal(new_r, ref_r)
                and torch.allclose(plain, ref_plain, atol=1e-5)):
            bad.append(f"rms_norm {t}x{n}")
        for spread in (1, 40):  # 40: exp's clamped ends (e^-87, e^88) too
            gu = torch.randn(t, 2 * n, generator=g) * spread
            if not torch.allclose(ops.silu_mul(gu), F.silu(gu[:, :n]) * gu[:, n:], atol=1e-5, rtol=1e-5):
                bad.append(f"silu_mul {t}x{n} spread {spread}")
    for t, h, d in ((1, 3, 64), (7, 2, 10)):
        qkv = torch.randn(t, 3 * h * d, generator=g)
        cos, sin = torch.randn(t, 1, d // 2, generator=g), torch.randn(t, 1, d // 2, generator=g)
        want = apply_rotary(qkv[:, h * d:2 * h * d].reshape(t, h, d), cos, sin).reshape(t, h * d)
        before = qkv.clone()
        ops.rotary_(qkv[:, h * d:2 * h * d], h, d, cos.reshape(t, -1), sin.reshape(t, -1))
        if not torch.allclose(qkv[:, h * d:2 * h * d], want, atol=1e-6) or not (
                torch.equal(qkv[:, :h * d], before[:, :h * d]) and torch.equal(qkv[:, 2 * h * d:], before[:, 2 * h * d:])):
            bad.append(f"rotary {t}x{h}x{d}")
    return bad


def _causal_reference(q, kc, vc, table, seq_len, scale, positions):
    """Attention of q [Q, Hq, D] at these positions over a request's paged K/V, in float64."""
    hkv, d = kc.shape[2], kc.shape[3]
    k = kc[table].reshape(-1, hkv, d)[:seq_len].double().repeat_interleave(q.shape[1] // hkv, 1)
    v = vc[table].reshape(-1, hkv, d)[:seq_len].double().repeat_interleave(q.shape[1] // hkv, 1)
    s = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    s = s.masked_fill(torch.arange(seq_len)[None, None, :] > positions[None, :, None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", s.softmax(-1), v).float()


def check_paged_prefill() -> list[str]:
    """paged_prefill against float64 attention: heads per kv head 1 to 24 (one tile of query rows
    holding one token up to many), head sizes that are 1 to 8 vectors, block sizes that do not
    divide the key chunks, a request without cached context, one long enough for many chunks
    and tiles, one token alone, query positions given (a blend's) and not, strided queries (a view
    of a fused qkv output); and bfloat16 queries and pages (against the same attention of their
    values, to bfloat16's rounding of the output); where the CPU has them, bfloat16 products
    (against the attention of the bfloat16-rounded values, to twice that), as dot products and, where
    the CPU has AMX, on its tiles."""
    bad = []
    width = paged_attention.load_kernel().prefill_vector_width()
    g = torch.Generator().manual_seed(0)
    for hq, hkv, d, bs in ((32, 4, 64, 16), (9, 3, 64, 16), (24, 1, 128, 16), (8, 8, 2 * width, 5),
                           (6, 2, width, 7)):
        shapes = [(0, 37), (50, 20), (130, 1), (3, 200)]  # (cached context, query tokens)
        tokens = sum(n for _, n in shapes)
        nb = sum(-(-(c + n) // bs) for c, n in shapes) + 3
        kc, vc = torch.randn(nb, bs, hkv, d, generator=g), torch.randn(nb, bs, hkv, d, generator=g)
        ids = torch.randperm(nb, generator=g)
        tables, used = torch.zeros(len(shapes), 60, dtype=torch.int64), 0
        for i, (c, n) in enumerate(shapes):
            k = -(-(c + n) // bs)
            tables[i, :k] = ids[used:used + k]
            used += k
        qkv = torch.randn(tokens, hq + 2 * hkv, d, generator=g) * 2
        q = qkv[:, :hq]
        starts = torch.tensor([0] + [sum(n for _, n in shapes[:i + 1]) for i in range(len(shapes))])
        lens = torch.tensor([c + n for c, n in shapes])
        bf = paged_attention.bf16_products()
        for given, dtype, prod, amx in ((False, torch.float32, False, False), (True, torch.float32, False, False),
                                        (True, torch.bfloat16, False, False),
                                        *([(True, torch.float32, True, False), (False, torch.bfloat16, True, False),
                                           (True, torch.float32, True, True), (False, torch.bfloat16, True, True)]
                                          if bf else [])):
            pos = torch.cat([torch.randint(0, c + n, (n,), generator=g) if given else torch.arange(c, c + n)
                             for c, n in shapes])
            qx, kx, vx = (x.to(dtype) for x in (q, kc, vc))
            out = torch.full((tokens, hq, d), float("nan"), dtype=dtype)
            paged_attention.paged_prefill(qx, kx, vx, tables, starts, lens, 1, len(shapes), d ** -0.5,
                                          pos if given else None, out, prod, amx)
            if not torch.isnan(out[:starts[1]]).all():
                bad.append(f"prefill {hq}/{hkv}x{d}: wrote rows of a request it was not given")
            tol = 2e-2 if prod else 1e-5 if dtype == torch.float32 else 8e-3
            rounded = (lambda x: x.bfloat16()) if prod else (lambda x: x)
            for i, (c, n) in enumerate(shapes[1:], 1):
                rows = slice(int(starts[i]), int(starts[i + 1]))
                ref = _causal_reference(rounded(qx[rows]), rounded(kx), rounded(vx), tables[i], c + n, d ** -0.5,
                                        pos[rows])
                if not torch.allclose(out[rows].float(), ref, atol=tol, rtol=tol):
                    bad.append(f"prefill {hq}/{hkv}x{d} bs {bs} request {i} positions given {given} {dtype} "
                               f"bf16 products {prod}: {float((out[rows].float() - ref).abs().max()):.2e}")
    return bad


def test_paged_prefill_matches_float64_attention():
    assert paged_attention.load_kernel() is not None
    assert check_paged_prefill() == []


def test_fused_ops_match_torch():
    assert ops.load() is not None
    assert check_ops() == []


def test_ctypes_structs_match_the_c_layout():
    """Each library's ctypes Structures against its C layout table (checked on load too)."""
    lib = decode_stack.load()
    if lib is None:
        pytest.skip("no C compiler")
    table = layout.c_layout(lib, "ds_layout")
    assert set(table) == {"Lin", "Layer", "Dims"}
    for structure in (decode_stack.Lin, decode_stack.Layer, decode_stack.Dims):
        layout.check(structure, table)
    kquant.check_layout(kquant.load())


def test_a_reordered_ctypes_struct_fails_loudly():
    """A Structure whose fields are out of C's order (n and k swapped), one missing a field, or
    one with a field of the wrong size is refused with a RuntimeError naming the field."""
    lib = decode_stack.load()
    if lib is None:
        pytest.skip("no C compiler")
    table = layout.c_layout(lib, "ds_layout")
    i64, vp = ctypes.c_int64, ctypes.c_void_p

    class Lin(ctypes.Structure):
        _fields_ = [("kind", i64), ("act", i64), ("k", i64), ("n", i64), ("w", vp), ("d", vp), ("c", vp),
                    ("bias", vp)]

    with pytest.raises(RuntimeError, match=r"ctypes struct Lin does not match the C struct Lin.*field k is 8 bytes "
                                           r"at offset 16 in ctypes, 8 bytes at offset 24 in C"):
        layout.check(Lin, table)

    class Short(ctypes.Structure):
        _fields_ = [(n, i64) for n in ("hidden", "hq", "hkv", "d", "inter", "block_size", "kv_kind", "max_k")] \
            + [("eps", ctypes.c_float)]

    with pytest.raises(RuntimeError, match="field scale of the C struct is missing"):
        layout.check(Short, table, "Dims")

    class KqPart(ctypes.Structure):
        _fields_ = [("qtype", ctypes.c_int32), ("rows", i64), ("data", vp)]

    with pytest.raises(RuntimeError, match="field qtype is 4 bytes"):
        layout.check(KqPart, layout.c_layout(lib, "kq_layout"))
    with pytest.raises(RuntimeError, match="describes no struct Nope"):
        layout.check(Lin, table, "Nope")


def test_the_build_key_covers_every_file_compiled_in(tmp_path, monkeypatch):
    """A library's cache key is the text of its .c file and of everything it includes: an edit to
    a shared header rebuilds every library that includes it (and only those)."""
    c = tmp_path / "c"
    c.mkdir()
    for name in ("common.h", "ops.c", "bandwidth.c"):
        (c / name).write_text((build.C_DIR / name).read_text())
    monkeypatch.setattr(build, "C_DIR", c)
    assert [p.name for p in build.sources("ops.c")] == ["ops.c", "common.h"]
    ops_key, bw_key = build.source_digest("ops.c"), build.source_digest("bandwidth.c")
    (c / "common.h").write_text((c / "common.h").read_text() + "\n/* edited */\n")
    assert build.source_digest("ops.c") != ops_key
    assert build.source_digest("bandwidth.c") == bw_key


def test_no_c_source_in_python_strings():
    """The kernels' C lives in c/*.c and c/*.h only (shipped as package data)."""
    from pathlib import Path

    root = Path(build.__file__).parent
    for py in root.glob("*.py"):
        text = py.read_text()
        assert "#include <" not in text and "#pragma omp" not in text, py.name
    names = {p.name for p in (root / "c").iterdir()}
    assert {"common.h", "layout.h", "ops.c", "qmatmul.c", "paged_attention.c", "decode_stack.c", "kquant.c",
            "bandwidth.c"} <= names


def test_the_kernels_import_nothing_above_them():
    """kvserve.kernels is the bottom layer: importing all of it loads no layers, models, quant,
    attention, worker, engine or server module."""
    code = ("import sys, kvserve.kernels as k, pkgutil, importlib; "
            "[importlib.import_module('kvserve.kernels.' + m.name) for m in pkgutil.iter_modules(k.__path__)]; "
            "above = ('layers', 'models', 'quant', 'attention', 'worker', 'engine', 'server'); "
            "print(sorted(m for m in sys.modules if m.split('.')[:2][-1] in above and m.startswith('kvserve.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    assert out.stdout.strip() == "[]", out.stdout
