"""Prefill/decode disaggregation's request path (`kvserve router --prefill URL --decode URL`).

The policy chooses a decode replica and pd.decide where the prompt is computed (pd.py). Remote:
a prefill replica gets the request cut down to its prompt (`prefill_body`) with
`"kv_transfer_params": {"do_remote_decode": true}`, and the `kv_transfer_params` of its reply,
which the router passes on without reading, go with the client's request to the decode
replica; that replica pulls the prompt's K/V and answers (a stream or a whole reply), and its
answer comes back as it is. Local, and whenever the prefill call fails in any way (no answer
in time, an error status, a reply without kv_transfer_params): the client's request goes to
the decode replica without them and it prefills the prompt itself; so does a completion of
several prompts ("batch": kv_transfer_params are one prompt's). A decode replica never
gets kv_transfer_params but a prefill replica's whole object: a client's own are dropped.
That object carries its own proof, `remote_auth`, the MAC the prefill engine made with the
deployment's key (disagg/auth.py): the decode replica refuses params without it, so the router
needs no key and only ever passes them on untouched.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

import httpx
from prometheus_client import Counter, Gauge

from kvserve.router.kv_aware import KVAwarePolicy
from kvserve.router.pd import LOCAL, REMOTE, CostEstimator, PDConfig, PDInputs, decide
from kvserve.router.policy import Decision, Policy, RouteRequest
from kvserve.router.proxy import PREFIX, Proxy, RouterMetrics, describe
from kvserve.router.replicas import Lease, Replica, ReplicaSet

logger = logging.getLogger(__name__)

# Fields the prefill call leaves out: its one output token is thrown away, so nothing that
# shapes or adds to the output may slow it down or get it refused (min_tokens > max_tokens).
PREFILL_DROPPED = ("stream_options", "logprobs", "top_logprobs", "echo", "stop", "max_completion_tokens",
                   "min_tokens", "kv_transfer_params")


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The client's request as a prefill replica gets it: the same prompt and sampling settings
    (the same cache_salt, so the same block hashes), one token of one sample, not streamed."""
    out = {k: v for k, v in body.items() if k not in PREFILL_DROPPED}
    out.update(max_tokens=1, stream=False, n=1, kv_transfer_params={"do_remote_decode": True})
    return out


def is_batch(req: RouteRequest) -> bool:
    """A completion of several prompts (strings or token-id lists): no single prompt to transfer."""
    prompt = req.body.get("prompt") if req.kind == "completion" else None
    return isinstance(prompt, list) and len(prompt) > 1 and not all(isinstance(t, int) for t in prompt)


class _RemoteLease(Lease):
    """A remote-prefill request's lease on its decode replica: that replica pulls the prompt's
    K/V rather than computing it, so it adds no prefill tokens to its load; its first byte
    times the transfer."""

    def __init__(self, replica: Replica) -> None:
        super().__init__(replica, 0)
        self.prompt_tokens = 0
        self.sent_at = 0.0


class PDProxy(Proxy):
    def __init__(self, replicas: ReplicaSet, policy: Policy, client: httpx.AsyncClient, metrics: RouterMetrics,
                 config: PDConfig, tokenizer: Any = None) -> None:
        super().__init__(replicas, policy, client, metrics, tokenizer)
        self.config = config
        self.estimator = CostEstimator()
        # The prefill replica that would compute the least of the prompt, its queue counted
        # (kv_aware's cost; least load when the prompt's tokens or the replicas' blocks are unknown).
        self.prefill_policy = KVAwarePolicy()
        reg = metrics.registry
        self.decisions = Counter(f"{PREFIX}pd_decisions", "Where prompts were prefilled: 'local' on the decode "
                                 "replica or 'remote' on a prefill replica, by reason.", ["decision", "reason"],
                                 registry=reg)
        self.estimates = {
            "prefill_tokens_per_s": Gauge(f"{PREFIX}pd_prefill_tokens_per_second",
                                          "The P/D cost model's prefill rate (measured, or its prior).", registry=reg),
            "transfer_s_per_token": Gauge(f"{PREFIX}pd_transfer_seconds_per_token",
                                          "The P/D cost model's K/V transfer time per prompt token.", registry=reg),
            "prefill_latency_s": Gauge(f"{PREFIX}pd_prefill_latency_seconds",
                                       "The P/D cost model's mean prefill call latency.", registry=reg)}
        self._show_costs()

    @property
    def needs_tokens(self) -> bool:
        return True  # the prefill replica is chosen by its blocks, whatever the decode policy

    def candidates(self) -> list[Replica]:
        return self.replicas.healthy("decode")

    async def plan(self, req: RouteRequest, decision: Decision, replica: Replica, raw: bytes, path: str,
                   fwd: dict[str, str]) -> tuple[bytes, Lease]:
        """Decide local or remote; for remote, run the prefill call and put its kv_transfer_params
        into the decode replica's body."""
        uncached = max(0, req.num_prompt_tokens - decision.cached_tokens)
        if is_batch(req):  # the engines transfer the K/V of one prompt per request
            where, reason, prefill = LOCAL, "batch", None
        else:
            prefill = self._choose_prefill(req, replica) if self.config.decision != "never" else None
            inputs = PDInputs(req.num_prompt_tokens, uncached, replica.view.pending_prefill_tokens,
                              prefill[1] if prefill else None, prefill[0].view.in_flight if prefill else 0,
                              replica.view.decode_streams)
            where, reason = decide(self.config, inputs, self.estimator.costs)
        if where == REMOTE:
            assert prefill is not None
            lease = _RemoteLease(replica)  # taken now: the decode replica is spoken for during the prefill
            try:
                params, prompt_tokens = await self._prefill(prefill[0], prefill[1], req, path, fwd)
            except BaseException:
                lease.release()
                raise
            if params is not None:
                self.decisions.labels(REMOTE, reason).inc()
                lease.prompt_tokens, lease.sent_at = prompt_tokens or req.num_prompt_tokens, time.monotonic()
                return json.dumps({**req.body, "kv_transfer_params": params}).encode(), lease
            lease.release()
            reason = "prefill_failed"
        self.decisions.labels(LOCAL, reason).inc()
        if "kv_transfer_params" in req.body:
            raw = json.dumps({k: v for k, v in req.body.items() if k != "kv_transfer_params"}).encode()
        return raw, Lease(replica, uncached)

    def _choose_prefill(self, req: RouteRequest, decode: Replica) -> tuple[Replica, int] | None:
        """The prefill replica and the prompt tokens it would compute; None when none is up (a
        replica serving both roles is not its own prefill replica)."""
        candidates = [r for r in self.replicas.healthy("prefill") if r.url != decode.url]
        if not candidates:
            return None
        d = self.prefill_policy.choose(req, [r.view for r in candidates])
        return self.replicas.by_url(d.replica.url), max(0, req.num_prompt_tokens - d.cached_tokens)

    async def _prefill(self, replica: Replica, uncached: int, req: RouteRequest, path: str,
                       fwd: dict[str, str]) -> tuple[dict[str, Any] | None, int]:
        """The prefill replica's kv_transfer_params (None if it failed) and its prompt tokens."""
        alone = replica.view.in_flight == 0  # then its latency measures the replica's prefill rate
        lease = Lease(replica, uncached)
        start = time.monotonic()
        try:
            resp = await self.client.post(f"{replica.url}{path}", content=json.dumps(prefill_body(req.body)).encode(),
                                          headers=fwd, timeout=self.config.prefill_timeout_s)
        except httpx.HTTPError as e:  # no connection, or no answer within --pd-prefill-timeout
            self._count(replica, "error")
            self._prefill_failed(replica, describe(e), check=True)
            return None, 0
        finally:
            lease.release()
        elapsed = time.monotonic() - start
        self._count(replica, resp.status_code)
        try:
            reply = resp.json()
        except ValueError:
            reply = None
        params = reply.get("kv_transfer_params") if isinstance(reply, dict) else None
        if resp.status_code != 200 or not isinstance(params, dict) or not params:
            what = f"answered {resp.status_code}" + (" without kv_transfer_params" if resp.status_code == 200 else "")
            self._prefill_failed(replica, f"{what}: {resp.text[:300]}", check=resp.status_code >= 500)
            return None, 0
        replica.routed += 1
        prompt_tokens, cached = _usage(reply)
        computed = prompt_tokens - cached if prompt_tokens and cached is not None else uncached
        self.estimator.prefill_done(computed, elapsed, alone)
        self._show_costs()
        return params, prompt_tokens

    def _prefill_failed(self, replica: Replica, why: str, check: bool) -> None:
        logger.warning("router: prefill on %s failed (%s); the decode replica prefills the prompt", replica.url, why)
        if check:  # it may be down: the health check takes it out before the next request tries it
            self.replicas.check_soon(replica)

    def _started(self, replica: Replica, lease: Lease, streaming: bool, status: int, req: RouteRequest,
                 decision: Decision) -> None:
        super()._started(replica, lease, streaming, status, req, decision)
        if isinstance(lease, _RemoteLease) and streaming and 200 <= status < 300:
            self.estimator.transfer_done(lease.prompt_tokens, time.monotonic() - lease.sent_at)
            self._show_costs()

    def _show_costs(self) -> None:
        for name, gauge in self.estimates.items():
            gauge.set(getattr(self.estimator.costs, name))


def _usage(reply: dict[str, Any]) -> tuple[int, int | None]:
    """(prompt tokens, cached prompt tokens) from a reply's usage; 0 and None where it has none."""
    usage = reply.get("usage")
    usage = usage if isinstance(usage, dict) else {}
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    prompt = usage.get("prompt_tokens")
    return (prompt if isinstance(prompt, int) else 0), (cached if isinstance(cached, int) else None)
