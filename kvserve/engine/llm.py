"""The offline API: `LLM(model=None).generate(prompts, params)`, vLLM-compatible."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator, Sequence
from typing import Any

from tqdm.auto import tqdm

from kvserve.blend.chunks import make_spec
from kvserve.chat_tools import conversation, template_takes_tools
from kvserve.config import EngineConfig
from kvserve.engine.core import EngineCore
from kvserve.inputs import PROMPT_KEYS, UNSUPPORTED_PROMPT_KEYS, PromptType, TextPrompt, TokensPrompt
from kvserve.outputs import EmbeddingRequestOutput, RequestOutput
from kvserve.pooling_params import PoolingParams
from kvserve.sampling_params import SamplingParams

__all__ = ["LLM", "PromptType", "TextPrompt", "TokensPrompt"]

Message = dict[str, Any]
# One prompt ready for the engine: its text (when known), token ids and cache salt.
_Encoded = tuple[str | None, list[int], str | None]


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

    def get_default_sampling_params(self) -> SamplingParams:
        """What a call without sampling_params uses: SamplingParams with the model's own defaults
        (generation_config.json, or a GGUF file's general.sampling.* keys) unless
        generation_config="none"."""
        return SamplingParams(**self.engine.generation_defaults)

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, priority: Sequence[int] | None = None) -> list[RequestOutput]:
        """Generate for each prompt; outputs in prompt order. A prompt is a string, a list of token
        ids, or vLLM's {"prompt": text} / {"prompt_token_ids": ids} dict (kvserve.inputs).
        Without sampling_params, get_default_sampling_params() (the model's defaults).

        Every request is validated before any is queued: a bad one raises ValueError
        naming its index and field, and nothing runs.
        """
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts
                                                and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not isinstance(prompts, Sequence) or isinstance(prompts, str):
            raise ValueError("prompts must be a string, a list of token ids, a prompt dict, or a list of those")
        params = self._params_list(sampling_params, len(prompts))
        prios = list(priority) if priority is not None else [0] * len(prompts)
        if len(prios) != len(prompts):
            raise ValueError(f"priority has {len(prios)} entries for {len(prompts)} prompts")
        encoded = [self._encode(p, i) for i, p in enumerate(prompts)]
        if sampling_params is None:
            params = [self._fit_default(p, toks) for p, (_, toks, _) in zip(params, encoded)]
        if self.engine.config.blend.enabled:
            params = [self._blend_params(p, text, toks, i) for i, (p, (text, toks, _)) in enumerate(zip(params, encoded))]
        self._validate_all(encoded, params, prios)
        ids = []
        for (text, toks, salt), p, prio in zip(encoded, params, prios):
            ids.append(self.engine.add_request(None, toks, p, prompt=text, priority=prio, cache_salt=salt))
        return self._run(ids, use_tqdm)

    def embed(self, prompts: PromptType | Sequence[PromptType], pooling_params: PoolingParams | None = None,
              use_tqdm: bool = True) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt (`.outputs.embedding`), in order, as vLLM's LLM.embed: the final
        hidden states pooled as pooling_params say (default: the engine's --pooling, L2-normalized).
        Prompts as generate() takes them; each runs its prefill through the same scheduler and
        finishes without sampling. A bad prompt raises ValueError naming its index; nothing runs."""
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts
                                                and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not isinstance(pooling_params, (PoolingParams, type(None))):
            raise ValueError(f"pooling_params must be a PoolingParams, got {type(pooling_params).__name__}")
        params = (pooling_params or PoolingParams()).to_sampling_params()
        encoded = [self._encode(p, i) for i, p in enumerate(prompts)]
        self._validate_all(encoded, [params] * len(encoded), [0] * len(encoded))
        ids = [self.engine.add_request(None, toks, params, prompt=text, cache_salt=salt)
               for text, toks, salt in encoded]
        return [EmbeddingRequestOutput.from_output(o) for o in self._run(ids, use_tqdm)]

    def chat(self, messages: list[Message] | Sequence[list[Message]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True,
             chat_template: str | None = None, tools: list[dict[str, Any]] | None = None) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or a list of them and generate;
        one output per conversation, in order. `tools` (OpenAI function tools) are rendered as the
        server renders them: by the template if it takes them, else in kvserve's default format
        (kvserve/chat_tools.py); the calls the model writes are in the output's text."""
        convs = _conversations(messages)
        single = isinstance(messages[0], dict)
        prompts: list[Any] = []
        for i, conv in enumerate(convs):
            try:
                ids = self.apply_chat_template(conv, add_generation_prompt, chat_template, tools)
                if self.engine.config.blend.enabled:  # chunks are found in the rendered text
                    text = self.apply_chat_template(conv, add_generation_prompt, chat_template, tools, tokenize=False)
                    prompts.append(TokensPrompt(prompt=text, prompt_token_ids=ids))
                else:
                    prompts.append(ids)
            except ValueError as e:
                raise ValueError(str(e) if single else f"messages[{i}]: {e}") from None
        return self.generate(prompts, sampling_params, use_tqdm)

    def apply_chat_template(self, messages: list[Message], add_generation_prompt: bool = True,
                            chat_template: str | None = None, tools: list[dict[str, Any]] | None = None,
                            tokenize: bool = True) -> Any:
        """The conversation's token ids (or, with tokenize=False, its text) through the chat template."""
        tok = self.engine.tokenizer
        if not isinstance(messages, list) or not all(
                isinstance(m, dict) and "role" in m and ("content" in m or m.get("tool_calls")) for m in messages):
            raise ValueError("messages must be a list of {'role': ..., 'content': ...} dicts")
        if tools is not None and (not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools)):
            raise ValueError("tools must be a list of {'type': 'function', 'function': {...}} dicts")
        template = chat_template or getattr(tok, "chat_template", None)
        if not template:
            raise ValueError(f"the model at {self.engine.model_path} has no chat template")
        native = template_takes_tools(template)
        conv = conversation([{**m, "content": m.get("content") or ""} for m in messages], tools, native)
        extra = {"tools": tools} if tools and native else {}
        out = tok.apply_chat_template(conv, add_generation_prompt=add_generation_prompt,
                                      chat_template=chat_template, tokenize=tokenize, **extra)
        if not tokenize:
            return out
        # transformers 5 returns a BatchEncoding; 4.x a plain list.
        return list(out["input_ids"] if hasattr(out, "keys") else out)

    def stream(self, prompt: PromptType, sampling_params: SamplingParams | None = None) -> Iterator[str]:
        """Generate for one prompt (n must be 1), yielding text as it is produced."""
        text, toks, salt = self._encode(prompt, 0)
        params = sampling_params or self._fit_default(self.get_default_sampling_params(), toks)
        if params.n != 1:
            raise ValueError("n must be 1 when streaming")
        rid = self.engine.add_request(None, toks, params, prompt=text, cache_salt=salt)
        hold = params.stop_holdback
        sent = 0
        try:
            done = False
            while not done:
                outs = self.engine.step()
                self._raise_errors({rid})
                for out in outs:
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

    def _params_list(self, sp, n: int) -> list[SamplingParams]:
        if sp is None:
            return [self.get_default_sampling_params()] * n
        if isinstance(sp, SamplingParams):
            return [sp] * n
        sp = list(sp)
        if len(sp) != n:
            raise ValueError(f"sampling_params has {len(sp)} entries for {n} prompts")
        return sp

    def _fit_default(self, params: SamplingParams, toks: list[int]) -> SamplingParams:
        """A max_tokens that came from the model's defaults is cut to the room the prompt leaves
        (vLLM does the same); one the caller gives is checked as it is."""
        room = self.engine.max_model_len - len(toks)
        if "max_tokens" in self.engine.generation_defaults and params.max_tokens is not None \
                and params.max_tokens > room >= max(1, params.min_tokens):
            return dataclasses.replace(params, max_tokens=room)
        return params

    def _encode(self, prompt: PromptType, index: int) -> _Encoded:
        if isinstance(prompt, dict):
            return self._encode_dict(prompt, index)
        if isinstance(prompt, str):
            return prompt, self._tokenize(prompt, index), None
        if isinstance(prompt, (list, tuple)):
            return None, list(prompt), None
        raise ValueError(f"prompts[{index}] must be a string, a list of token ids, or a dict with 'prompt' or "
                         f"'prompt_token_ids', got {type(prompt).__name__}")

    def _tokenize(self, text: str, index: int) -> list[int]:
        if not text:
            raise ValueError(f"prompts[{index}]: prompt must not be empty")
        return list(self.engine.tokenizer(text)["input_ids"])

    def _encode_dict(self, prompt: dict, index: int) -> _Encoded:
        """vLLM's TextPrompt / TokensPrompt (kvserve.inputs)."""
        for key in prompt:
            if key in UNSUPPORTED_PROMPT_KEYS:
                raise ValueError(f"prompts[{index}]: {key!r} is not supported: kvserve runs text-only models "
                                 "(give 'prompt' or 'prompt_token_ids')")
            if key not in PROMPT_KEYS:
                raise ValueError(f"prompts[{index}]: unknown key {key!r} in a prompt dict; the keys are "
                                 f"{', '.join(map(repr, PROMPT_KEYS))}")
        text, salt = prompt.get("prompt"), prompt.get("cache_salt")
        if text is not None and not isinstance(text, str):
            raise ValueError(f"prompts[{index}]: 'prompt' must be a string, got {type(text).__name__}")
        if salt is not None and not isinstance(salt, str):
            raise ValueError(f"prompts[{index}]: 'cache_salt' must be a string, got {type(salt).__name__}")
        if "prompt_token_ids" in prompt:
            ids = prompt["prompt_token_ids"]
            if not isinstance(ids, (list, tuple)):
                raise ValueError(f"prompts[{index}]: 'prompt_token_ids' must be a list of token ids, "
                                 f"got {type(ids).__name__}")
            return text, list(ids), salt
        if text is None:
            raise ValueError(f"prompts[{index}]: a prompt dict needs 'prompt' or 'prompt_token_ids'")
        return text, self._tokenize(text, index), salt

    def _blend_params(self, params: SamplingParams, text: str | None, toks: list[int], index: int) -> SamplingParams:
        """With blending on: the chunks of a text prompt (its separators, or the texts listed in
        extra_args["blend"]["chunks"]) as the token spans the engine takes."""
        extra = dict(params.extra_args or {})
        try:
            spec = make_spec(self.engine.tokenizer, text, toks, self.engine.config.blend.separator, extra.get("blend"))
        except ValueError as e:
            raise ValueError(f"prompts[{index}]: {e}") from None
        if spec is None:
            extra.pop("blend", None)
        else:
            extra["blend"] = spec
        return dataclasses.replace(params, extra_args=extra or None)

    def _validate_all(self, encoded: list[_Encoded], params, prios) -> None:
        for i, ((_, toks, salt), p, prio) in enumerate(zip(encoded, params, prios)):
            try:
                self.engine.validate(toks, p, prio, salt)
            except ValueError as e:
                raise ValueError(f"prompts[{i}]: {e}") from None

    def _raise_errors(self, ids: set[str]) -> None:
        """A request that failed in the engine (its remote K/V could not be loaded) ends the call."""
        errors = self.engine.take_errors()
        failed = next((rid for rid in errors if rid in ids), None)
        if failed is not None:
            raise RuntimeError(f"request {failed}: {errors[failed]}")

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        results: dict[str, RequestOutput] = {}
        pending = set(ids)
        bar = tqdm(total=len(ids), desc="Processed prompts", unit="req", disable=not use_tqdm)
        start, out_tokens = time.perf_counter(), 0
        try:
            while pending:
                outs = self.engine.step()
                self._raise_errors(pending)
                for out in outs:
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


def _conversations(messages: Any) -> list:
    """One conversation (a list of message dicts) or a list of them, as a list of conversations."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts, "
                         "or a list of such conversations")
    is_message = [isinstance(m, dict) for m in messages]
    if all(is_message):
        return [list(messages)]
    if any(is_message):
        i = is_message.index(not is_message[0])
        raise ValueError(f"messages mixes messages and conversations (messages[0] is a "
                         f"{type(messages[0]).__name__}, messages[{i}] a {type(messages[i]).__name__}): pass one "
                         "conversation (a list of message dicts) or a list of conversations")
    return list(messages)
