"""The prompt forms `LLM.generate` takes, with vLLM's names (vllm.inputs).

A prompt is a string, a list of token ids, or a dict: TextPrompt {"prompt": str} or
TokensPrompt {"prompt_token_ids": [...]} (with "prompt" too, the ids are what runs and the
text is what the output reports), either with an optional "cache_salt". vLLM's multimodal
and embedding keys are refused: kvserve serves text-only models.
"""

from __future__ import annotations

from typing import NotRequired, TypedDict


class TextPrompt(TypedDict):
    prompt: str
    cache_salt: NotRequired[str]


class TokensPrompt(TypedDict):
    prompt_token_ids: list[int]
    prompt: NotRequired[str]
    cache_salt: NotRequired[str]


PromptType = str | list[int] | TextPrompt | TokensPrompt

PROMPT_KEYS = ("prompt", "prompt_token_ids", "cache_salt")
# vLLM's keys for what kvserve does not run: named in the error instead of "unknown key".
UNSUPPORTED_PROMPT_KEYS = ("multi_modal_data", "mm_processor_kwargs", "multi_modal_uuids", "token_type_ids",
                           "prompt_embeds", "encoder_prompt", "decoder_prompt")
