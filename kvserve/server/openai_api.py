"""OpenAI-compatible HTTP server: FastAPI over AsyncEngine (engine core in its own process).

    kvserve serve [MODEL] --port 8000 [--api-key KEY]     (start-up: server/launch.py)

Routes and error handling live here; what the endpoints do with the engine is in
serving.py, serving_completion.py and serving_chat.py. Every error, including
FastAPI's own validation errors, leaves in the OpenAI shape
{"error": {"message", "type", "param", "code"}}.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

import kvserve
from kvserve.engine.async_engine import AsyncEngine, EngineBusyError, EngineDeadError
from kvserve.server import protocol as P
from kvserve.server.dashboard import add_dashboard
from kvserve.server.limits import DEFAULT_MAX_REQUEST_BYTES, APIKeyCheck, BodyLimit
from kvserve.server.metrics import ServerMetrics
from kvserve.server.serving import DEFAULT_MAX_N, RETRY_AFTER_S, APIError, ChatSettings, ClientGone, engine_dead
from kvserve.server.serving_chat import ChatServing
from kvserve.server.serving_completion import CompletionServing
from kvserve.server.serving_embedding import EmbeddingServing, add_embedding_routes
from kvserve.server.serving_tokenize import TokenizeServing, add_tokenize_routes
from kvserve.server.tokenizer_pool import TokenizerBusy, TokenizerPool

logger = logging.getLogger(__name__)


# What the API routes may answer besides 200, all in the OpenAI error shape (documented in /openapi.json).
ERRORS: dict[int | str, dict[str, Any]] = {code: {"model": P.ErrorResponse, "description": what} for code, what in (
    (400, "Invalid request; the error's param names the field"),
    (401, "Missing or wrong API key (--api-key)"),
    (404, "Unknown model"),
    (413, "Body over --max-request-bytes"),
    (500, "Internal error"),
    (502, "K/V could not be fetched from a prefill engine"),
    (503, "Overloaded (--max-waiting), tokenizer busy, or the engine is not running; see Retry-After"))}


def _with_stream(model: type) -> dict[int | str, dict[str, Any]]:
    """ERRORS, and a 200 that is `model` as JSON, or with "stream": true, server-sent events."""
    return {**ERRORS, 200: {"model": model, "content": {"text/event-stream": {"schema": {"type": "string"}}}}}


def _error_response(err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


def _validation_error(exc: RequestValidationError) -> APIError:
    parts, param = [], None
    for err in exc.errors():
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        name = ".".join(loc) or None
        param = param or name
        if err.get("type") == "extra_forbidden":
            parts.append(f"unknown field {name!r}: not supported by this server")
        elif err.get("type") == "json_invalid":
            parts.append(f"malformed JSON body: {err.get('ctx', {}).get('error', err.get('msg'))}")
        else:
            parts.append(f"{name or 'body'}: {err.get('msg')}")
    return APIError(400, "; ".join(parts) or "invalid request", param=param)


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return _error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return _error_response(_validation_error(exc))

    @app.exception_handler(TokenizerBusy)
    async def _busy(_: Request, exc: TokenizerBusy) -> JSONResponse:
        return _error_response(APIError(503, str(exc), "service_unavailable",
                                        headers={"Retry-After": str(RETRY_AFTER_S)}))

    @app.exception_handler(ClientGone)
    async def _gone(_: Request, exc: ClientGone) -> Response:
        return Response(status_code=499)  # nginx's "client closed request": nobody reads it

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return _error_response(APIError(exc.status_code, str(exc.detail)))

    @app.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error")
        return _error_response(APIError(500, f"internal error: {type(exc).__name__}: {exc}",
                                        "internal_server_error"))


async def _ask_engine(query: Any) -> Any:
    """Await a query to the engine process; a dead or busy engine is a 503, never a traceback."""
    try:
        return await query
    except EngineDeadError as e:
        raise engine_dead(str(e)) from None
    except EngineBusyError as e:
        raise APIError(503, f"{e}; try again", "service_unavailable", headers={"Retry-After": "1"}) from None


# What answers without the API key: probes, the metrics a scraper reads, the page that shows
# them, where KV events are published (addresses, not data), and the API's own description.
OPEN_PATHS = ("/health", "/version", "/metrics", "/kv_events", "/dashboard", "/openapi.json", "/docs",
              "/docs/oauth2-redirect", "/redoc")


def build_app(engine: AsyncEngine, tokenizer: Any, served_model_name: str, api_key: str | None = None,
              max_waiting: int = 1024, max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
              max_n: int = DEFAULT_MAX_N, chat_settings: ChatSettings | None = None) -> FastAPI:
    app = FastAPI(title="kvserve", version=kvserve.__version__)
    _install_error_handlers(app)
    app.add_middleware(BodyLimit, max_bytes=max_request_bytes)
    add_dashboard(app)
    metrics = ServerMetrics()
    pool = TokenizerPool(max_waiting)  # one tokenizer thread for every route
    shared = (engine, tokenizer, served_model_name, metrics, max_waiting, max_n, pool, chat_settings)
    completion, chat = CompletionServing(*shared), ChatServing(*shared)
    info = engine.model_info

    if api_key is not None:  # added last, so outermost: a request without the key is answered from its headers
        app.add_middleware(APIKeyCheck, key=api_key, open_paths=OPEN_PATHS)
    add_tokenize_routes(app, TokenizeServing(*shared), ERRORS)
    add_embedding_routes(app, EmbeddingServing(*shared), ERRORS)

    @app.get("/health", responses={503: ERRORS[503]})
    async def health() -> JSONResponse:
        if not engine.is_alive():
            return _error_response(engine_dead("the engine process is gone"))
        return JSONResponse({"status": "ok"})

    @app.get("/version")
    async def version() -> dict:
        return {"version": kvserve.__version__}

    @app.get("/metrics", response_class=PlainTextResponse)
    async def prometheus() -> Response:
        return Response(await metrics.render(engine), media_type=CONTENT_TYPE_LATEST)

    @app.get("/kv_cache/stats", responses=ERRORS)
    async def kv_cache_stats() -> dict:
        """KV cache and KV tier usage and counters (kvserve extension). A busy engine's latest
        snapshot when it cannot answer at once; `stats_age_s` then says how old it is."""
        s = await _ask_engine(engine.stats())
        return {k: v for k, v in s.items() if k.startswith(("kv_", "prefix_cache_", "stats_age_s"))}

    @app.post("/kv_cache/clear", responses=ERRORS)
    async def kv_cache_clear() -> dict:
        """Empty the prefix cache and every KV tier (kvserve extension)."""
        return {"cleared": await _ask_engine(engine.clear_kv_cache())}

    @app.get("/kv_events")
    async def kv_events() -> dict:
        """Where this replica publishes its KV events, for `kvserve router --replica URL` (kvserve
        extension; no key needed, like /health: it names addresses, not data)."""
        ev = info.kv_events or {}
        return {"enabled": bool(ev), **ev, "block_size": info.block_size, "model": served_model_name,
                "model_path": info.model_path, "max_model_len": info.max_model_len}

    card = P.ModelCard(id=served_model_name, root=info.model_path, max_model_len=info.max_model_len)

    @app.get("/v1/models", responses=ERRORS, response_model=P.ModelList)
    async def models() -> dict:
        return P.ModelList(data=[card]).model_dump()

    @app.get("/v1/models/{model_id:path}", responses=ERRORS, response_model=P.ModelCard)
    async def model(model_id: str) -> dict:
        """The served model's card, as in /v1/models; 404 for any other id."""
        completion.check_model(model_id)
        return card.model_dump()

    @app.post("/v1/completions", responses=_with_stream(P.CompletionResponse))
    async def completions(req: P.CompletionRequest, request: Request):
        return await completion.create(req, request.receive)

    @app.post("/v1/chat/completions", responses=_with_stream(P.ChatCompletionResponse))
    async def chat_completions(req: P.ChatCompletionRequest, request: Request):
        return await chat.create(req, request.receive)

    return app
