"""Request / response schemas of the OpenAI API subset we serve (pydantic v2).

Requests forbid unknown fields: an OpenAI field we do not implement is refused
with a 400 naming it rather than silently ignored. Types are strict, as the
OpenAI API defines them: no string -> number or string -> bool coercion, and a
bool is not a number (`max_tokens: "10"`, `stream: "yes"`, `prompt: [true]`
are refused); a number where a float is expected may be an integer. Text must
be valid Unicode (an unpaired surrogate such as "\\ud800" is refused, naming
the field). Sampling values are only type-checked here; their ranges are
checked by SamplingParams, whose errors name the field.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, WrapValidator,
                      field_validator, model_validator)
from pydantic.json_schema import SkipJsonSchema
from pydantic_core import PydanticCustomError

from kvserve.server import openai_fields as F
from kvserve.server.prompts import unpaired_surrogate


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    # The model's OpenAI fields and what is done with each (openai_fields.py)
    openai_fields: ClassVar[dict[str, F.Policy]] = {}
    field_prefix: ClassVar[str] = ""  # how a log line names a field of a nested object

    @field_validator("*", mode="after")
    @classmethod
    def _valid_unicode(cls, value: Any) -> Any:
        """Text the tokenizer, msgpack or a JSON answer would choke on is refused here, by field."""
        where = unpaired_surrogate(value)
        if where is not None:
            at = f" (at {where.strip()})" if where else ""
            raise PydanticCustomError("invalid_text", "contains an unpaired surrogate{at}; text must be valid Unicode",
                                      {"at": at})
        return value

    @field_validator("*", mode="after")
    @classmethod
    def _policy(cls, value: Any, info: ValidationInfo) -> Any:
        """An ignored field is logged once per process; a refused one set to non-null is a 400 saying why."""
        policy, why = cls.openai_fields.get(info.field_name or "", (F.HONOURED, ""))
        if policy == F.REFUSED and value is not None:
            raise PydanticCustomError("not_supported", why)
        if policy == F.IGNORED and value is not None:
            F.note_ignored(cls.field_prefix + (info.field_name or ""), why)
        return value


Refused = SkipJsonSchema[Any]  # a REFUSED field: any non-null value is a 400 (openai_fields.py)


def _one_of(what: str) -> WrapValidator:
    """A union's type error as one message ("must be a string or ..."), not one per member."""

    def check(value: Any, handler: Any) -> Any:
        try:
            return handler(value)
        except ValidationError:
            raise PydanticCustomError("invalid_type", "must be {what}", {"what": what}) from None

    return WrapValidator(check)


PromptInput = Annotated[str | list[str] | list[int] | list[list[int]],
                        _one_of("a string, a list of strings, a list of token ids or a list of lists of token ids")]
StopInput = Annotated[str | list[str] | None, _one_of("a string or a list of strings")]
ContentInput = Annotated[str | list[dict[str, Any]] | None, _one_of("a string or a list of content parts")]


class StreamOptions(_Strict):
    openai_fields = F.STREAM_OPTIONS_FIELDS
    field_prefix = "stream_options."
    include_usage: bool = False
    include_obfuscation: bool | None = None
    # vLLM's: with include_usage, every chunk carries the request's usage so far
    continuous_usage_stats: bool = False


class BlendOptions(_Strict):
    """A request's `blend`: chunks (texts that occur in the prompt, in order) whose K/V are reused
    wherever they appear; without them, the server's --blend-separator marks the chunks."""

    chunks: list[str] | None = None
    recompute_ratio: float | None = None
    check_layer: int | None = None


class _SamplingFields(_Strict):
    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: StopInput = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: Refused = None
    # kvserve / vLLM extensions
    cache_salt: str | None = None
    ignore_eos: bool | None = None
    min_tokens: int | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    truncate_prompt_tokens: int | None = None  # keep each prompt's last N tokens (vLLM's)
    priority: int = 0  # the scheduler's order: lower first (vLLM's)
    # Prefill/decode disaggregation (vLLM's field): {"do_remote_decode": true} to a prefill engine;
    # to a decode engine, the object the prefill engine's response returned
    kv_transfer_params: dict[str, Any] | None = None
    # Non-prefix chunk reuse (a server started with --enable-blending): the chunks, and the knobs
    blend: BlendOptions | None = None
    # Constrained decoding (vLLM's): StructuredOutputsParams' fields (json, regex, choice, grammar,
    # json_object, whitespace_pattern); structured_fields.py maps it and the deprecated guided_* fields
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


class CompletionRequest(_SamplingFields):
    openai_fields = F.COMPLETION_FIELDS
    prompt: PromptInput
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: Refused = None


class FunctionCall(_Strict):
    name: str
    arguments: str  # a JSON object as text, as the OpenAI API sends it


class ToolCallParam(_Strict):
    """A tool call of an assistant message in the history (as a response's message.tool_calls)."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    # Required except for an assistant message (the OpenAI API lets one that made tool calls omit it).
    content: ContentInput = Field(default=None, validate_default=True)
    name: str | None = None
    tool_calls: list[ToolCallParam] | None = None  # an assistant message's calls
    tool_call_id: str | None = None  # a tool message's: the call it answers
    # What a response's message carries, so a client can append that message to the history as it is
    # (not rendered: templates drop past reasoning)
    reasoning_content: str | None = None
    refusal: str | None = None

    @field_validator("content")
    @classmethod
    def _content_required(cls, value: Any, info: ValidationInfo) -> Any:
        role = info.data.get("role")
        if value is None and role is not None and role != "assistant":
            raise PydanticCustomError("missing", "a {role} message needs content", {"role": role})
        return value

    @field_validator("tool_calls", "tool_call_id")
    @classmethod
    def _of_its_role(cls, value: Any, info: ValidationInfo) -> Any:
        """tool_calls belong to an assistant message, tool_call_id to a tool message."""
        role = {"tool_calls": "assistant", "tool_call_id": "tool"}[info.field_name]
        if value is not None and info.data.get("role") != role:
            article = "an" if role[0] in "aeiou" else "a"
            raise PydanticCustomError("not_allowed", "only {article} {role} message has {field}",
                                      {"article": article, "role": role, "field": info.field_name})
        return value

    @model_validator(mode="after")
    def _tool_needs_id(self) -> ChatMessage:
        if self.role == "tool" and self.tool_call_id is None:
            raise PydanticCustomError("missing", "a tool message needs a tool_call_id")
        return self


class FunctionDefinition(_Strict):
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.:\-]{1,64}$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None


class ChatTool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class ToolChoiceFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: ToolChoiceFunction


ToolChoiceInput = Annotated[Literal["none", "auto", "required"] | NamedToolChoice | None,
                            _one_of('"none", "auto", "required" or {"type": "function", "function": {"name": ...}}')]


class JsonSchemaFormat(_Strict):
    field_prefix = "response_format.json_schema."
    name: str
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class ChatCompletionRequest(_SamplingFields):
    openai_fields = F.CHAT_FIELDS
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    response_format: ResponseFormat | None = None
    modalities: list[str] | None = None
    prediction: dict[str, Any] | None = None  # predicted output: drafts for --speculative-config ngram
    # accepted and ignored (openai_fields.py says why)
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    prompt_cache_options: dict[str, Any] | None = None
    safety_identifier: str | None = None
    tools: list[ChatTool] | None = None
    tool_choice: ToolChoiceInput = None
    parallel_tool_calls: bool | None = None
    # refused (openai_fields.py says why)
    functions: Refused = None
    function_call: Refused = None
    audio: Refused = None
    reasoning_effort: Refused = None
    verbosity: Refused = None
    web_search_options: Refused = None
    moderation: Refused = None
    # vLLM's chat extensions, as /tokenize takes them
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None


class TokenizeCompletionRequest(_Strict):
    """POST /tokenize with a prompt (vLLM's schema): the ids /v1/completions computes."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool | None = False


class TokenizeChatRequest(_Strict):
    """POST /tokenize with messages (vLLM's schema): with the defaults, the ids /v1/chat/completions
    computes; the options change them as apply_chat_template does (prompts.chat_prompt_ids). A
    chat_template of the request's own is refused (serving_tokenize.py says why in a 400)."""

    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ChatTool] | None = None  # rendered as /v1/chat/completions renders them
    return_token_strs: bool | None = False


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int]


# ---- responses (plain models; extra fields are ours to add) -----------------


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0
    # kvserve extension: cached_tokens split by the tier the K/V came from (device, cpu, disk, remote)
    cached_tokens_by_tier: dict[str, int] = Field(default_factory=dict)
    # kvserve extension (--enable-blending): prompt tokens that kept K/V reused from a chunk cached
    # elsewhere in another prompt, and those of the blended spans recomputed; not in cached_tokens
    blended_tokens: int = 0
    recomputed_tokens: int = 0


class CompletionTokensDetails(BaseModel):
    """OpenAI's names for what speculative decoding drafted (--speculative-config): drafted tokens
    that verification kept, and those it rejected (they cost compute; they are not in the output)."""

    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)
    # null unless the engine drafts (speculative decoding)
    completion_tokens_details: CompletionTokensDetails | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    kv_transfer_params: dict[str, Any] | None = None  # a prefill engine's: where its K/V wait


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class ResponseFunctionCall(BaseModel):
    name: str
    arguments: str


class ResponseToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: ResponseFunctionCall


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    # --reasoning-parser: the reasoning, apart from the answer (vLLM's field)
    reasoning_content: str | None = None
    tool_calls: list[ResponseToolCall] | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage
    kv_transfer_params: dict[str, Any] | None = None  # a prefill engine's: where its K/V wait


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    """A streamed tool call's part: the first has its id, type and name, the next ones argument text."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatStreamChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatStreamChoice]
    usage: Usage | None = None


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(BaseModel):
    prompt: str


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "kvserve"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int | str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
