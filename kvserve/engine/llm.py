"""The offline API: `LLM(model=None).generate(prompts, params)`, vLLM-compatible."""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence

from tqdm.auto import tqdm

from kvserve.config import CacheConfig, ModelConfig, TierConfig, parse_size
from kvserve.engine.core import EngineCore
from kvserve.outputs import RequestOutput
from kvserve.sampling_params import SamplingParams

PromptType = str | list[int]
Message = dict[str, str]


class LLM:
    def __init__(self, model: str | None = None, dtype: str = "auto", max_model_len: int | None = None,
                 kv_cache_memory: int | str | None = None, num_kv_blocks: int | None = None,
                 block_size: int = 16, enable_prefix_caching: bool = True, prefix_cache: str = "hash",
                 max_num_seqs: int = 256, max_num_batched_tokens: int | None = None, seed: int = 0,
                 device: str = "cpu", check_integrity: bool = False, kv_offload_cpu: int | str | None = None,
                 kv_offload_disk: str | None = None, kv_offload_disk_size: int | str = "50GiB",
                 kv_remote: str | None = None, kv_offload_disk_min_hits: int = 0, kv_remote_min_hits: int = 0,
                 kv_remote_write_through: bool = False, quantization: str | None = None,
                 kv_cache_dtype: str = "auto") -> None:
        """kv_offload_cpu / kv_offload_disk / kv_remote: KV tiers below the device pool (sizes like '8GiB').

        quantization: awq | gptq | int8 | fp8 | gguf | none; None takes it from the checkpoint.
        kv_cache_dtype: auto (the model dtype) or fp8.
        """
        memory = parse_size(kv_cache_memory, "kv_cache_memory") if kv_cache_memory is not None else None
        tiers = TierConfig(
            cpu_bytes=parse_size(kv_offload_cpu, "kv_offload_cpu") if kv_offload_cpu is not None else 0,
            disk_path=kv_offload_disk, disk_bytes=parse_size(kv_offload_disk_size, "kv_offload_disk_size"),
            remote_url=kv_remote, disk_min_hits=kv_offload_disk_min_hits, remote_min_hits=kv_remote_min_hits,
            remote_write_through=kv_remote_write_through)
        self.engine = EngineCore(
            ModelConfig(model=model, dtype=dtype, max_model_len=max_model_len, seed=seed, quantization=quantization),
            CacheConfig(block_size=block_size, kv_cache_memory=memory, num_kv_blocks=num_kv_blocks,
                        enable_prefix_caching=enable_prefix_caching, prefix_cache=prefix_cache,
                        kv_cache_dtype=kv_cache_dtype),
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens, device=device,
            check_integrity=check_integrity, tier_config=tiers)

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
