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


def _paired_table(bench, paired: dict, capsys) -> str:
    """What print_table prints of a results file holding only --paired's summary."""
    bench.print_table({"cpu": "a CPU", "isa_level": "avx2", "flags": ["avx2"], "threads": 2, "bandwidth": None,
                       "geometry": {"file_bytes": 6e8}, "model": "m.gguf", "command": "bench", "prefill_lengths": [],
                       "runs": {}, "paired": paired})
    return capsys.readouterr().out


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
    text = _paired_table(bench, out, capsys)
    assert "paired replies (median of 3 passes)" in text and "x llama.cpp: kvserve default" in text


def test_paired_shares_of_the_pure_read_are_taken_within_each_pass(bench, capsys):
    """--paired's third process reads the weight bytes once per pass; each engine's reply is given
    as a share of that read's rate in the same pass."""
    def r(rate):
        return {"decode_tok_s": rate, "decode_only_tok_s": rate}
    passes = [{"default": r(40.0), "llama.cpp": r(36.0), bench.READ: r(50.0)},   # 0.80, 0.72
              {bench.READ: r(40.0), "llama.cpp": r(30.0), "default": r(34.0)},   # 0.85, 0.75
              {"default": r(45.0), "llama.cpp": r(40.0), bench.READ: r(50.0)}]   # 0.90, 0.80
    out = bench.paired_summary(passes, ["default"])
    assert out["vs_read"]["default"] == pytest.approx(0.85) and out["vs_read"]["llama.cpp"] == pytest.approx(0.75)
    assert bench.READ not in out["vs_llama_cpp"] and bench.READ not in out["vs_read"]
    text = _paired_table(bench, out, capsys)
    assert "x pure read of the weights: kvserve default" in text and "x pure read of the weights: llama.cpp" in text
    # without the read (older results), no shares
    bare = bench.paired_summary([{"default": r(1.0), "llama.cpp": r(1.0)}], ["default"])
    assert bare["vs_read"] == {} and bare["by_read"] == {}


def test_paired_ratios_split_by_the_memory_speed_of_each_pass(bench, capsys):
    """The ratios to llama.cpp are also given for the passes whose pure read was at least the run's
    median read and for the others: a machine whose memory switches speed moves the ratio with it."""
    def r(rate):
        return {"decode_tok_s": rate, "decode_only_tok_s": rate}
    passes = [{"default": r(60.0), "llama.cpp": r(48.0), bench.READ: r(90.0)},   # fast: 1.25
              {"default": r(46.0), "llama.cpp": r(44.0), bench.READ: r(53.0)},   # slow: ~1.045
              {"default": r(58.0), "llama.cpp": r(50.0), bench.READ: r(85.0)},   # fast: 1.16
              {"default": r(45.0), "llama.cpp": r(45.0), bench.READ: r(52.0)}]   # slow: 1.0
    out = bench.paired_summary(passes, ["default"])["by_read"]
    fast, slow = out["read at or above its median"], out["read below its median"]
    assert fast["passes"] == 2 and slow["passes"] == 2
    assert fast["read_tok_s"] == pytest.approx(87.5) and slow["read_tok_s"] == pytest.approx(52.5)
    assert fast["vs_llama_cpp"]["default"] == pytest.approx((1.25 + 1.16) / 2)
    assert slow["vs_llama_cpp"]["default"] == pytest.approx((46 / 44 + 1.0) / 2)
    text = _paired_table(bench, bench.paired_summary(passes, ["default"]), capsys)
    assert "passes with the read at or above its median (2, read 87.5 tok/s):" in text
    assert "passes with the read below its median (2, read 52.5 tok/s):" in text


@pytest.mark.parametrize("tied", [False, True])
def test_decode_bytes_leave_out_an_untied_token_table(bench, tmp_path, tied):
    """A decode token reads one row of the token table, so the pure read leaves the table out,
    unless the LM head is the table itself (tied: no output.weight)."""
    import gguf
    import numpy as np

    w = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "llama")
    for add, value in ((w.add_block_count, 1), (w.add_context_length, 64), (w.add_embedding_length, 32),
                       (w.add_feed_forward_length, 64), (w.add_head_count, 2), (w.add_head_count_kv, 1),
                       (w.add_layer_norm_rms_eps, 1e-5), (w.add_vocab_size, 16)):
        add(value)
    tensors = {"token_embd.weight": (16, 32), "blk.0.ffn_down.weight": (32, 64), "output_norm.weight": (32,)}
    if not tied:
        tensors["output.weight"] = (16, 32)
    for name, shape in tensors.items():
        w.add_tensor(name, np.zeros(shape, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    geo = bench.model_geometry(str(tmp_path / "m.gguf"))
    total = 4 * sum(int(np.prod(s)) for s in tensors.values())
    assert geo["tensor_bytes"] == total
    assert geo["decode_bytes"] == (total if tied else total - 4 * 16 * 32)


def test_context_decodes_after_the_context_ids_kept_in_the_prefix_cache(bench):
    """--context N: the decode's prompt is the first N ids of the text, for both engines, and
    kvserve's replies run on it."""
    spec = {"model": None, "kwargs": {}, "decode_tokens": 4, "prefill": [], "ids": list(range(100, 160)),
            "context": 48}
    assert bench._kvserve_prompt(spec) == {"prompt_token_ids": list(range(100, 148))}
    assert bench._kvserve_prompt({**spec, "context": 0}) == bench.PROMPT

    class Tok:
        def tokenize(self, text):
            return [1, 2, 3]
    assert bench._llama_prompt(Tok(), spec) == list(range(100, 148))
    assert bench._llama_prompt(Tok(), {**spec, "context": 0}) == [1, 2, 3]

    r = bench.run_kvserve(spec)
    assert r["prompt_tokens"] == 48 and r["decode_only_tok_s"] > 0
