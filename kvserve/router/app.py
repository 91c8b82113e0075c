"""The router's HTTP front: the OpenAI routes of a replica, served by whichever replica the
policy picks (/v1/models, /tokenize and /detokenize by any healthy one), plus /health, /replicas
and /metrics about the router itself, and the live /dashboard of the router and each replica
(server/dashboard.py).

    kvserve router --replica http://127.0.0.1:8001 --replica http://127.0.0.1:8002 --policy session

(start-up and --launch: router/launch.py; prefill/decode replicas: pd.py, pd_proxy.py).
Errors the router makes itself leave in the OpenAI shape a replica uses; errors a replica
makes pass through unchanged.

In front of every route, as a replica has them (server/limits.py): the router's --api-key,
checked from the headers before anything else (/health and /metrics open with
--allow-unauthenticated-metrics), then the body limit (--max-request-bytes).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from dataclasses import dataclass
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

import kvserve
from kvserve.router.pd import PDConfig
from kvserve.router.pd_proxy import PDProxy
from kvserve.router.policies import make_policy
from kvserve.router.policy import Policy
from kvserve.router.proxy import REPLICA_HEADER, Proxy, RouterMetrics, describe, error_body, forward_headers
from kvserve.router.replicas import DEFAULT_HEALTH_INTERVAL, HEALTH_TIMEOUT, ReplicaSet
from kvserve.server.dashboard import add_dashboard
from kvserve.server.limits import DEFAULT_MAX_REQUEST_BYTES, APIKeyCheck, BodyLimit

logger = logging.getLogger(__name__)

# No read timeout: a long generation is silent between tokens; a dead replica resets the connection.
CLIENT_TIMEOUT = httpx.Timeout(connect=5.0, read=None, write=60.0, pool=None)


@dataclass
class Router:
    replicas: ReplicaSet
    policy: Policy
    proxy: Proxy
    metrics: RouterMetrics
    client: httpx.AsyncClient
    pd: PDConfig | None = None  # prefill/decode disaggregation (replicas with roles), or None

    async def close(self) -> None:
        await self.replicas.close()
        await self.client.aclose()


async def start_router(urls: list[str], policy: str = "kv_aware", health_interval: float = DEFAULT_HEALTH_INTERVAL,
                       tokenizer: str | None = None, upstream_api_key: str | None = None,
                       pids: dict[str, int] | None = None, policy_options: dict[str, Any] | None = None,
                       roles: dict[str, str] | None = None, pd: PDConfig | None = None) -> Router:
    """Probe the replicas (ValueError if they cannot be routed over together), load the
    tokenizer the policy needs, start the health checks. With `pd`, `roles` says which URLs
    are prefill and which decode replicas (pd_roles). `upstream_api_key`: the key the router
    sends the replicas, on its probes and in place of the clients' on their requests."""
    pol = make_policy(policy, **(policy_options or {}))
    client = httpx.AsyncClient(timeout=CLIENT_TIMEOUT, limits=httpx.Limits(max_connections=None,
                                                                          max_keepalive_connections=64))
    headers = {"authorization": f"Bearer {upstream_api_key}"} if upstream_api_key else {}
    replicas = ReplicaSet(urls, pol, client, health_interval, headers, pids, roles)
    metrics = RouterMetrics()
    proxy = PDProxy(replicas, pol, client, metrics, pd) if pd is not None else Proxy(replicas, pol, client, metrics)
    router = Router(replicas, pol, proxy, metrics, client, pd)
    try:
        await replicas.start()
        router.proxy.tokenizer = await _load_tokenizer(tokenizer, replicas, pol)
    except BaseException:
        await router.close()
        raise
    return router


async def _load_tokenizer(path: str | None, replicas: ReplicaSet, policy: Policy) -> Any:
    """The replicas' tokenizer when the policy needs token ids or --tokenizer asks for exact
    counts; otherwise None (prompt sizes are estimated from their text)."""
    if path is None and not policy.needs_tokens:
        return None
    flag = "--tokenizer" if path is not None else f"--policy {policy.name}"
    path = path or replicas.model_path()
    if path is None:
        raise ValueError(f"--policy {policy.name} needs the replicas' tokenizer but no replica reported its "
                         "model path (none answered /kv_events or /v1/models); pass --tokenizer PATH")
    from kvserve.models.loader import load_tokenizer  # imports torch-side modules: only when needed

    try:
        return await asyncio.to_thread(load_tokenizer, path)
    except (ValueError, OSError) as e:
        raise ValueError(f"{flag}: cannot load the replicas' tokenizer from {path!r}: {e}; "
                         "pass --tokenizer PATH with a local copy of the model or its tokenizer") from None


def _error(status: int, message: str, type_: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, type_), status_code=status, headers=headers)


OPEN_METRICS_PATHS = ("/health", "/metrics")  # --allow-unauthenticated-metrics: for probes and scrapers
# The dashboard's page holds no data: it asks for the key and sends it on the fetches that read any.
OPEN_PATHS = ("/dashboard",)


def build_app(router: Router, api_key: str | None = None, open_metrics: bool = False,
              max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES) -> FastAPI:
    """The router's routes behind its front door: with `api_key` every route needs it but, with
    `open_metrics`, /health and /metrics; bodies over `max_request_bytes` get 413."""
    app = FastAPI(title="kvserve router", version=kvserve.__version__)
    replicas, proxy = router.replicas, router.proxy
    app.add_middleware(BodyLimit, max_bytes=max_request_bytes)
    if api_key is not None:  # added last, so outermost: no body is read before the key is checked
        open_paths = OPEN_PATHS + (OPEN_METRICS_PATHS if open_metrics else ())
        app.add_middleware(APIKeyCheck, key=api_key, open_paths=open_paths)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return _error(exc.status_code, str(exc.detail), "invalid_request_error")

    @app.exception_handler(ClientDisconnect)
    async def _gone(_: Request, exc: ClientDisconnect) -> Response:
        # The client left, or --body-timeout cut its body off (and answered 408): no one to answer.
        return Response(status_code=499)

    @app.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("router: unhandled error")
        return _error(500, f"router internal error: {type(exc).__name__}: {exc}", "internal_server_error")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await proxy.handle("completion", "/v1/completions", await request.body(), request.headers)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await proxy.handle("chat", "/v1/chat/completions", await request.body(), request.headers)

    turns = itertools.count()

    async def any_replica(request: Request, what: str) -> Response:
        """The request (body and headers as sent) answered by a healthy replica, the next one
        when it cannot be reached, its status and body unchanged: for routes any replica
        answers alike."""
        fwd = forward_headers(request.headers, replicas.headers)
        body = await request.body()
        failures = []
        healthy = replicas.healthy()
        turn = next(turns) % len(healthy) if healthy else 0  # spread the load: each call starts one further
        for r in healthy[turn:] + healthy[:turn]:
            try:
                resp = await router.client.request(request.method, f"{r.url}{request.url.path}", content=body,
                                                   headers=fwd)
            except httpx.TransportError as e:
                logger.warning("router: %s failed on %s (%s); trying another replica", r.url, request.url.path,
                               describe(e))
                failures.append(f"{r.url}: {describe(e)}")
                replicas.check_soon(r)
                continue
            return Response(resp.content, status_code=resp.status_code, media_type=resp.headers.get("content-type"),
                            headers={REPLICA_HEADER: r.url})
        why = f"no replica could {what}: {'; '.join(failures)}" if failures else f"no healthy replica to {what}"
        return _error(503, why, "service_unavailable", {"Retry-After": "1"})

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        return await any_replica(request, "list the models")

    # vLLM's /tokenize and /detokenize: the replicas share the model and its tokenizer.
    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        return await any_replica(request, "tokenize")

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        return await any_replica(request, "detokenize")

    @app.get("/health")
    async def health() -> JSONResponse:
        n = len(replicas.healthy())
        if not proxy.candidates():  # P/D: prefill replicas alone cannot answer
            what = "decode replica" if router.pd else "replica"
            return _error(503, f"no healthy {what} (of {len(replicas.replicas)})", "service_unavailable")
        return JSONResponse({"status": "ok", "healthy_replicas": n, "replicas": len(replicas.replicas)})

    @app.get("/replicas")
    async def replica_list() -> dict:
        """Each replica's role, health, load and KV-event state (kvserve extension)."""
        return {"policy": router.policy.name, "pd_decision": router.pd.decision if router.pd else None,
                "replicas": replicas.describe()}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(router.metrics.render(replicas), media_type=CONTENT_TYPE_LATEST)

    @app.get("/version")
    async def version() -> dict:
        return {"version": kvserve.__version__}

    add_dashboard(app, router=True)

    @app.get("/dashboard/replica_metrics")
    async def replica_metrics(replica: str) -> Response:
        """One replica's /metrics, for the dashboard's panel of it (only URLs of the replica set)."""
        r = next((r for r in replicas.replicas if r.url == replica.rstrip("/")), None)
        if r is None:
            return _error(404, f"{replica!r} is not one of the router's replicas", "not_found_error")
        try:
            resp = await router.client.get(f"{r.url}/metrics", headers=replicas.headers, timeout=HEALTH_TIMEOUT)
        except httpx.HTTPError as e:
            return _error(502, f"replica {r.url} did not answer /metrics: {type(e).__name__}: {e}", "bad_gateway")
        return Response(resp.content, status_code=resp.status_code, media_type=resp.headers.get("content-type"))

    return app
