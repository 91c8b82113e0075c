"""The offline API: `LLM(model=None).generate(prompts, params)`, vLLM-compatible."""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from typing import Any

from tqdm.auto import tqdm

from kvserve.config import EngineConfig
from kvserve.engine.core import EngineCore
from kvserve.outputs import RequestOutput
from kvserve.sampling_params import SamplingParams

PromptType = str | list[int]
Message = dict[str, str]


class LLM:
    def __init__(self, model: str | None = None, *, config: EngineConfig | None = None, **kwargs: Any) -> None:
        """Load `model` (None: the embedded default) with the engine options in `kwargs`, or
        take a ready `config`. The keywords are the flags of kvserve/engine_args.py with
        underscores (`LLM(dtype="float32", kv_offload_cpu="8GiB", tensor_parallel_size=2)`);
        an unknown one raises ValueError naming it.
        """
        if config is None:
            config = EngineConfig.from_kwargs(model=model, **kwargs)
        elif model is not None or kwargs:
            given = ["model"] * (model is not None) + sorted(kwargs)
            raise ValueError(f"pass either config or engine keyword arguments, not both (got {', '.join(given)})")
        elif not isinstance(config, EngineConfig):
            raise ValueError(f"config must be an EngineConfig, got {type(config).__name__}")
        self.config = config
        self.engine = EngineCore(config)

    def close(self) -> None:
        """Finish the KV tiers' queued writes and stop their threads (also at interpreter exit)."""
        self.engine.close()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def stats(self) -> dict[str, float | int | str]:
        """Running / waiting requests, KV blocks used / total, prefix-cache counters, preemptions."""
        return self.engine.stats()

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, priority: Sequence[int] | None = None) -> list[RequestOutput]:
        """Generate for each prompt (a string or a list of token ids); outputs in prompt order.

        Every request is validated before any is queued: a bad one raises ValueError
        naming its index and field, and nothing runs.
        """
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not isinstance(prompts, Sequence) or isinstance(prompts, str):
            raise ValueError("prompts must be a string, a list of token ids, or a list of those")
        params = self._params_list(sampling_params, len(prompts))
        prios = list(priority) if priority is not None else [0] * len(prompts)
        if len(prios) != len(prompts):
            raise ValueError(f"priority has {len(prios)} entries for {len(prompts)} prompts")
        encoded = [self._encode(p, i) for i, p in enumerate(prompts)]
        self._validate_all(encoded, params, prios)
        ids = []
        for (text, toks), p, prio in zip(encoded, params, prios):
            ids.append(self.engine.add_request(None, toks, p, prompt=text, priority=prio))
        return self._run(ids, use_tqdm)

    def chat(self, messages: list[Message] | Sequence[list[Message]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True,
             chat_template: str | None = None) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or a list of them and generate."""
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        token_lists = [self.apply_chat_template(c, add_generation_prompt, chat_template) for c in convs]
        return self.generate(token_lists, sampling_params, use_tqdm)

    def apply_chat_template(self, messages: list[Message], add_generation_prompt: bool = True,
                            chat_template: str | None = None) -> list[int]:
        tok = self.engine.tokenizer
        if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m and "content" in m
                                                     for m in messages):
            raise ValueError("messages must be a list of {'role': ..., 'content': ...} dicts")
        if chat_template is None and not getattr(tok, "chat_template", None):
            raise ValueError(f"the model at {self.engine.model_path} has no chat template")
        out = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                      chat_template=chat_template, tokenize=True)
        # transformers 5 returns a BatchEncoding; 4.x a plain list.
        return list(out["input_ids"] if hasattr(out, "keys") else out)

    def stream(self, prompt: PromptType, sampling_params: SamplingParams | None = None) -> Iterator[str]:
        """Generate for one prompt (n must be 1), yielding text as it is produced."""
        params = sampling_params or SamplingParams()
        if params.n != 1:
            raise ValueError("n must be 1 when streaming")
        text, toks = self._encode(prompt, 0)
        rid = self.engine.add_request(None, toks, params, prompt=text)
        hold = params.stop_holdback
        sent = 0
        try:
            done = False
            while not done:
                for out in self.engine.step():
                    if out.request_id != rid:
                        continue
                    done = out.finished
                    text = out.outputs[0].text
                    ready = len(text) if done else len(text) - hold
                    if ready > sent:
                        yield text[sent:ready]
                        sent = ready
        finally:
            if not done:
                self.engine.abort_request(rid)

    # ---- helpers ----------------------------------------------------------

    @staticmethod
    def _params_list(sp, n: int) -> list[SamplingParams]:
        if sp is None:
            return [SamplingParams()] * n
        if isinstance(sp, SamplingParams):
            return [sp] * n
        sp = list(sp)
        if len(sp) != n:
            raise ValueError(f"sampling_params has {len(sp)} entries for {n} prompts")
        return sp

    def _encode(self, prompt: PromptType, index: int) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError(f"prompts[{index}]: prompt must not be empty")
            return prompt, list(self.engine.tokenizer(prompt)["input_ids"])
        if isinstance(prompt, (list, tuple)):
            return None, list(prompt)
        raise ValueError(f"prompts[{index}] must be a string or a list of token ids, got {type(prompt).__name__}")

    def _validate_all(self, encoded, params, prios) -> None:
        for i, ((_, toks), p, prio) in enumerate(zip(encoded, params, prios)):
            try:
                self.engine.validate(toks, p, prio)
            except ValueError as e:
                raise ValueError(f"prompts[{i}]: {e}") from None

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        results: dict[str, RequestOutput] = {}
        pending = set(ids)
        bar = tqdm(total=len(ids), desc="Processed prompts", unit="req", disable=not use_tqdm)
        start, out_tokens = time.perf_counter(), 0
        try:
            while pending:
                for out in self.engine.step():
                    if out.finished and out.request_id in pending:
                        pending.discard(out.request_id)
                        results[out.request_id] = out
                        out_tokens += sum(len(c.token_ids) for c in out.outputs)
                        bar.update(1)
                        bar.set_postfix_str(f"output {out_tokens / (time.perf_counter() - start):.1f} tok/s, "
                                            f"KV {self.engine.kv_usage:.0%}")
        except BaseException:
            for rid in pending:
                self.engine.abort_request(rid)
            raise
        finally:
            bar.close()
        return [results[i] for i in ids]
