"""The C kernels of kvserve/worker/kernels against torch references, on every ISA level this CPU
runs (AVX2 imitated on bigger CPUs, as CI does), and the tuning rule with injected timings."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from kvserve.layers.rotary import apply_rotary
from kvserve.quant.base import quantize_rtn
from kvserve.worker.kernels import cpu, ops, qmatmul, tuning

# torch's own kernels held to AVX2 as well (ATen, oneDNN, MKL): the imitation the issue asks CI to run
AVX2_ENV = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}


def _blocks(bits: int, n: int, k: int, group: int | None, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    qw = quantize_rtn(torch.randn(n, k, generator=g) * 0.05, bits, group, symmetric=False)
    return qw, qmatmul.Blocks.from_codes(qw.q, qw.scale, qw.offset, bits)


def check_qmatmul() -> list[str]:
    """Every shape, bit width and activation mode against F.linear on the dequantized weight;
    returns what failed (run in-process, and in a subprocess per ISA level)."""
    bad = []
    for bits in (4, 8):
        for n, k, group in ((1, 32, 32), (37, 96, 32), (64, 800, 160), (130, 256, None)):
            qw, w = _blocks(bits, n, k, group)
            dense = qw.dequantize()
            if not (torch.allclose(qmatmul.dequantize(w), dense, rtol=1e-6, atol=1e-7)
                    and torch.allclose(qmatmul.reference(w), dense, rtol=1e-6, atol=1e-7)):
                bad.append(f"dequantize {bits}-bit {n}x{k}")
            for m in (1, 3, 4, 5, 12, 17, 130):  # 12+: the panel path; 130 spans two token chunks
                x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
                ref = F.linear(x, dense)
                for mode, tol in (("float32", 2e-6), ("int8", 2e-2)):
                    y = qmatmul.matmul(x, w, mode)
                    rel = float((y - ref).norm() / ref.norm())
                    if not rel < tol:
                        bad.append(f"{mode} {bits}-bit {n}x{k} m={m}: {rel:.2e}")
            xs = torch.randn(5, 2 * k)[:, ::2]  # strided rows: a column slice of a wider tensor
            if not torch.allclose(qmatmul.matmul(xs, w, "float32"), F.linear(xs, dense), rtol=1e-5, atol=1e-5):
                bad.append(f"strided x {bits}-bit {n}x{k}")
    return bad


def test_qmatmul_matches_dequantized_weight():
    assert qmatmul.load() is not None, "the C kernel must build here (gcc is part of the setup)"
    assert check_qmatmul() == []


@pytest.mark.parametrize("level", cpu.runnable_levels())
def test_every_isa_level_this_cpu_runs(level, tmp_path):
    """Each level builds and passes (avx2 with torch's kernels held to AVX2 too)."""
    env = {**os.environ, "KVSERVE_CPU_ISA": level, "KVSERVE_CACHE_DIR": str(tmp_path)}
    if level == "avx2":
        env.update(AVX2_ENV)
    code = ("import json, sys; from tests.worker.test_kernels import check_qmatmul, check_ops; "
            "from kvserve.worker.kernels import cpu, decode_stack, qmatmul, ops; "
            "assert qmatmul.load() is not None and ops.load() is not None and decode_stack.load() is not None; "
            "print(json.dumps({'level': cpu.isa_level(), 'bad': check_qmatmul() + check_ops()}))")
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


def test_fused_ops_match_torch():
    assert ops.load() is not None
    assert check_ops() == []


def _times(dense: dict[int, float], kernel: dict[int, float], int8_1: float, f32_1: float) -> dict:
    return {"int8": {"1": int8_1, **{str(r): v for r, v in kernel.items()}},
            "float32": {"1": f32_1, **{str(r): v * 1.5 for r, v in kernel.items()}},
            "dense": {str(r): v for r, v in dense.items()}}


def test_choose_takes_the_faster_path_per_shape():
    times = {
        # dense wins from 32 rows on (and stays ahead)
        "a": _times({8: 5.0, 32: 3.0, 128: 4.0}, {8: 1.0, 32: 3.5, 128: 9.0}, 1.0, 2.0),
        # dense ahead at 8 but behind at 32: not "from 8", from 128
        "b": _times({8: 1.0, 32: 9.0, 128: 1.0}, {8: 2.0, 32: 3.0, 128: 5.0}, 1.0, 2.0),
        # the kernel wins everywhere measured
        "c": _times({8: 9.0, 32: 9.0, 128: 9.0}, {8: 1.0, 32: 1.0, 128: 1.0}, 1.0, 2.0),
    }
    chosen = tuning.choose(times, {"a": 1, "b": 1, "c": 1})
    assert chosen == {"activations": "int8", "dense_from": {"a": 32, "b": 128, "c": tuning.NEVER}}
    assert tuning.choose(times, {"a": 1, "b": 1, "c": 1}, allow_int8=False)["activations"] == "float32"
    slow_int8 = {k: {**v, "int8": {**v["int8"], "1": 5.0}} for k, v in times.items()}
    assert tuning.choose(slow_int8, {"a": 1, "b": 1, "c": 1})["activations"] == "float32"


def test_dtype_rule_takes_lower_precision_only_when_clearly_faster():
    f32 = {"1": 2.2e-4, "256": 3.4e-3}  # per token: 235 us
    # measured on an AVX2 Zen 3 (a noisy float32 decode time): bfloat16 222 us per token, a near tie
    assert tuning.pick_dtype({"float32": f32, "bfloat16": {"1": 1.17e-4, "256": 2.7e-2}}) == "float32"
    # an AVX512-BF16 CPU: bfloat16 about twice as fast
    assert tuning.pick_dtype({"float32": f32, "bfloat16": {"1": 1.1e-4, "256": 1.7e-3}}) == "bfloat16"
    assert tuning.pick_dtype({"float32": f32, "bfloat16": {"1": 3e-4, "256": 2e-2}}) == "float32"


def test_dtype_choice_is_measured_cached_and_logged(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path))
    fake = {"float32": {"1": 5e-5, "256": 1e-3}, "bfloat16": {"1": 6e-5, "256": 5e-3}}
    calls = []

    def fake_time(fn, reps=3):
        calls.append(fn)
        return 0.0

    monkeypatch.setattr(tuning, "_time", fake_time)
    monkeypatch.setattr(tuning, "dtype_candidates", lambda: [torch.float32, torch.bfloat16])
    path = tuning._cache_path("dtype", [64, 256, ["float32", "bfloat16"]])
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"times": fake}))  # as if measured: float32 wins on the sum per token
    with caplog.at_level("INFO", logger="kvserve.worker.kernels.tuning"):
        assert tuning.choose_dtype(64, 256) == torch.float32
    assert calls == [] and "dtype auto -> float32 (cached" in caplog.text
    path.write_text(json.dumps({"times": {**fake, "bfloat16": {"1": 4e-5, "256": 5e-4}}}))
    assert tuning.choose_dtype(64, 256) == torch.bfloat16
    path.unlink()
    tuning.choose_dtype(64, 256)  # nothing cached: measured (here with the fake clock), then written
    assert calls and path.exists()


def test_tune_linears_sets_every_blocks_linear(tmp_path, monkeypatch):
    from kvserve.quant.linear import quantized_linear

    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path))
    qw, _ = _blocks(4, 64, 128, 32)
    model = torch.nn.Sequential(quantized_linear(qw, None, torch.float32), quantized_linear(qw, None, torch.float32))
    chosen = tuning.tune_linears(model, torch.float32)
    assert chosen is not None and chosen["activations"] == "float32"  # int8 only when allowed
    monkeypatch.setenv(tuning.INT8_ENV, "1")
    chosen = tuning.tune_linears(model, torch.float32)
    assert chosen["activations"] in qmatmul.MODES
    for m in model:
        assert m.activations == chosen["activations"] and m.dense_from == chosen["dense_from"]["64x128:4bit"]
    monkeypatch.setenv(tuning.TUNING_ENV, "off")
    assert tuning.tune_linears(model, torch.float32) is None
