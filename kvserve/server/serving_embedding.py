"""POST /v1/embeddings, as the OpenAI API defines it.

`input` is a string, a list of strings, token ids, or a list of token-id lists; each is one
embedding request to the engine (pooling_params.py): its prompt runs through the same scheduler
as any other, chunked when long, and finishes after its prefill with the final hidden states
pooled as the server's --pooling says (last or mean), L2-normalized. `encoding_format` float gives
lists of numbers, base64 the little-endian float32 bytes in base64, as OpenAI does. `dimensions`
is refused: the vector is the model's hidden size, and cutting it is only meaningful for models
trained for it (Matryoshka).

With a chat model such as the default SmolLM2 this is a demonstration of the pooling path, not a
retrieval model: the vectors are not trained to rank passages.
"""

from __future__ import annotations

import base64
import struct
from typing import Any, Literal

from fastapi import FastAPI, Request
from pydantic import BaseModel

from kvserve.engine.wire import RequestDelta
from kvserve.pooling_params import PoolingParams
from kvserve.server import protocol as P
from kvserve.server.serving import APIError, Receive, Serving


class EmbeddingRequest(P._Strict):
    model: str | None = None
    input: P.PromptInput
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None


class EmbeddingData(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str  # a string with encoding_format base64


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[EmbeddingData]
    model: str
    usage: EmbeddingUsage


class _Vectors:
    """Collects each input's vector from the engine deltas (Serving.collect's accumulator)."""

    def __init__(self) -> None:
        self.by_index: dict[int, list[float]] = {}

    def add(self, i: int, d: RequestDelta) -> None:
        if d.embedding is not None:
            self.by_index[i] = d.embedding


def _as_input(name: str) -> str:
    """The prompt checks shared with /v1/completions name `prompt`; here the field is `input`."""
    return "input" + name[len("prompt"):] if name.startswith("prompt") else name


class EmbeddingServing(Serving):
    async def create(self, req: EmbeddingRequest, receive: Receive | None = None) -> dict[str, Any]:
        self.check_model(req.model)
        if req.dimensions is not None:
            raise APIError(400, "dimensions is not supported: the embedding has the model's hidden size",
                           param="dimensions")
        try:
            items = self.completion_prompts(req.input)
        except APIError as e:
            raise APIError(400, _as_input(e.message), param=_as_input(e.param or "prompt")) from None
        self.check_sequences(len(items), 1, "input")
        prompts, _ = await self.encode(items)
        for i, toks in enumerate(prompts):
            self._check_input(toks, "input" if len(prompts) == 1 else f"input[{i}]")
        deltas = await self.start(prompts, PoolingParams().to_sampling_params(), None)
        vectors = _Vectors()
        await self.collect(deltas, vectors, receive)
        missing = next((i for i in range(len(prompts)) if i not in vectors.by_index), None)
        if missing is not None:  # aborted in the engine (it was shut down meanwhile)
            raise APIError(503, f"input {missing} was not embedded: the engine stopped it", "service_unavailable")
        data = [EmbeddingData(index=i, embedding=_encode(vectors.by_index[i], req.encoding_format))
                for i in range(len(prompts))]
        n = sum(map(len, prompts))
        return EmbeddingResponse(data=data, model=self.model_name,
                                 usage=EmbeddingUsage(prompt_tokens=n, total_tokens=n)).model_dump()

    def _check_input(self, toks: list[int], name: str) -> None:
        """EngineCore's checks of an embedding request, made before anything is sent to it."""
        info = self.info
        if not toks:
            raise APIError(400, f"{name} must not be empty", param=name)
        bad = next((t for t in toks if not 0 <= t < info.vocab_size), None)
        if bad is not None:
            raise APIError(400, f"{name}: token id {bad} is outside the vocabulary [0, {info.vocab_size})", param=name)
        if len(toks) > info.max_model_len:
            raise APIError(400, f"{name} is {len(toks)} tokens, more than the model's context length "
                           f"max_model_len={info.max_model_len}", param=name)
        need = -(-len(toks) // info.block_size)
        if need > info.num_kv_blocks:
            raise APIError(400, f"{name} needs {need} KV blocks but the KV cache has only {info.num_kv_blocks}",
                           param=name)


def _encode(vector: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
    return vector


def add_embedding_routes(app: FastAPI, serving: EmbeddingServing,
                         errors: dict[int | str, dict[str, Any]] | None = None) -> None:
    """POST /v1/embeddings (behind the app's API key check); `errors` documents the error answers
    (openai_api.ERRORS)."""

    @app.post("/v1/embeddings", responses={**(errors or {}), 200: {"model": EmbeddingResponse}})
    async def embeddings(req: EmbeddingRequest, request: Request) -> dict[str, Any]:
        """Embeddings of the inputs: the final hidden states pooled as --pooling says (last or mean),
        L2-normalized. With a chat model such as the default SmolLM2 this demonstrates the pooling
        path; it is not a retrieval model."""
        return await serving.create(req, request.receive)
