"""scripts/bench_cpu.py's arithmetic: bytes read per decoded token and the share of bandwidth."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_cpu.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_cpu", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_bandwidth_share(bench):
    # TinyLlama's K/V: 22 layers x 4 heads x 64 dims, K and V
    geo = {"kv_elements_per_token": 2 * 22 * 4 * 64}
    r = {"prompt_tokens": 9, "decode_only_tok_s": 20.0}
    bench.bandwidth_share(r, weight_bytes=600_000_000, kv_element_bytes=4, geo=geo, decode_tokens=127, gb_s=30.0)
    kv = (9 + 64) * 11264 * 4  # the context at the middle of the decode
    assert r["kv_bytes_per_token"] == kv and r["bytes_per_token"] == 600_000_000 + kv
    assert r["read_gb_s"] == pytest.approx((600_000_000 + kv) * 20 / 1e9)
    assert r["bandwidth_pct"] == pytest.approx(100 * r["read_gb_s"] / 30.0)


def test_no_rate_or_no_bandwidth_gives_no_share(bench):
    geo = {"kv_elements_per_token": 8}
    r = {"prompt_tokens": 1, "decode_only_tok_s": None}
    bench.bandwidth_share(r, 100, 2, geo, 8, 10.0)
    assert r["read_gb_s"] is None and r["bandwidth_pct"] is None
    r = {"prompt_tokens": 1, "decode_only_tok_s": 5.0}
    bench.bandwidth_share(r, 100, 2, geo, 8, None)
    assert r["read_gb_s"] > 0 and r["bandwidth_pct"] is None


def test_table_names_the_bandwidth_read_before_each_round(bench, capsys):
    run = {"dtype": "float32", "quantization": "gguf", "decode_tok_s": 30.0, "decode_only_tok_s": 31.0,
           "bytes_per_token": 6e8, "read_gb_s": 18.6, "bandwidth_pct": 50.0, "prefill": {"512": {"tok_s": 100.0}}}
    bw = {"gb_s": 37.2, "bytes": 256 << 20, "seconds": [0.01] * 10}
    results = {"cpu": "a CPU", "isa_level": "avx2", "flags": ["avx2"], "threads": 2, "bandwidth": bw,
               "bandwidth_rounds_gb_s": [30.1, 37.2], "geometry": {"file_bytes": 6e8}, "model": "m.gguf",
               "command": "bench", "prefill_lengths": [512], "runs": {"default": run}, "rounds": [{}, {}]}
    bench.print_table(results)
    out = capsys.readouterr().out
    assert "read bandwidth 37.2 GB/s (256 MiB, best of 10 reads) before each round: 30.1, 37.2" in out
    assert "kvserve default (float32, gguf)" in out and "(median of 2 rounds)" in out


def test_paired_ratios_are_taken_within_each_pass(bench, capsys):
    """--paired: a configuration's ratio is the median of its reply over llama.cpp's in the same
    pass, not the ratio of the medians (a pass at a slow moment slows both)."""
    def r(rate):
        return {"decode_tok_s": rate, "decode_only_tok_s": rate + 1}
    passes = [{"default": r(40.0), "llama.cpp": r(40.0)},   # 1.0
              {"llama.cpp": r(20.0), "default": r(22.0)},   # 1.1 (a slow moment for both)
              {"default": r(44.0), "llama.cpp": r(40.0)}]   # 1.1
    out = bench.paired_summary(passes, ["default"])
    assert out["vs_llama_cpp"]["default"]["decode_tok_s"] == pytest.approx(1.1)
    assert out["medians"]["default"]["decode_tok_s"] == 40.0 and out["medians"]["llama.cpp"]["decode_tok_s"] == 40.0
    assert out["vs_llama_cpp"]["default"]["decode_only_tok_s"] == pytest.approx(23 / 21)
    results = {"cpu": "a CPU", "isa_level": "avx2", "flags": ["avx2"], "threads": 2, "bandwidth": None,
               "geometry": {"file_bytes": 6e8}, "model": "m.gguf", "command": "bench", "prefill_lengths": [],
               "runs": {}, "paired": out}
    bench.print_table(results)
    text = capsys.readouterr().out
    assert "paired replies (median of 3 passes)" in text and "x llama.cpp: kvserve default" in text
