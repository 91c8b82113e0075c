"""Prefill/decode disaggregation in the router: where a request's prompt is computed.

With prefill and decode replicas (`kvserve router --prefill URL --decode URL`) every request
is decoded on a decode replica the routing policy chooses; its prompt is computed either
there ("local", as a plain replica would) or on a prefill replica whose K/V the decode
replica then pulls ("remote"). A prompt prefilled locally takes the decode replica's step
budget for as long as its prefill lasts, stalling every stream decoding there: that is what
disaggregation exists to avoid. But a remote prefill costs a round trip, a wait in the
prefill replica's queue and the K/V transfer, and the decode replica may already hold most
of the prompt. `decide` weighs these from numbers alone; `CostEstimator` learns the numbers
from the router's own calls. The modes (--pd-decision), with the reasons they give:

- always: remote ("forced_always").
- never: local ("forced_never"); the decode replicas serve as plain replicas.
- threshold, NVIDIA Dynamo's rule: local when the prompt tokens the decode replica does not
  hold are at most --max-local-prefill-length, else remote ("threshold").
- conditional, the cost model (the default). In seconds, with the prefill rate in tokens/s:

      local  = uncached tokens on the decode replica / rate
      remote = uncached tokens on the prefill replica / rate + prompt tokens x transfer per token
      queue  = requests in flight on the prefill replica x mean prefill latency

      allowed = REMOTE_FACTOR x local time to first token (the decode replica's queued
                prefill + `local`) + decode streams on the decode replica x `local`

  local when `local` is within --pd-local-budget-ms: the stall it causes the decode streams
  is negligible ("short_prompt"); local when the remote path's time to first token would be
  over `allowed`, because of the transfer or a prefill replica holding less of the prompt
  ("remote_slower") or because of the prefill queue ("prefill_queue"); remote otherwise,
  sparing the decode streams at a bounded cost ("remote_cheaper"). The streams' term is what
  disaggregation buys: a long prompt prefilled locally stalls every one of them for its
  whole prefill, so with many streams a long prompt waits in the prefill queue rather than
  stall them, while a short one, whose stall is small, is not sent to wait behind it.

Every mode is local when no prefill replica is up ("no_prefill_replica"); the proxy also
keeps a completion of several prompts local ("batch") and falls back to local when the
prefill call fails ("prefill_failed"): pd_proxy.py.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

PD_DECISIONS = ("conditional", "always", "never", "threshold")
LOCAL, REMOTE = "local", "remote"

DEFAULT_MAX_LOCAL_PREFILL_LENGTH = 512  # Dynamo's max_local_prefill_length
DEFAULT_LOCAL_BUDGET_MS = 50.0  # a stall of a few decode steps: users of the streams do not see it
DEFAULT_PREFILL_TIMEOUT = 120.0  # seconds; past it the request is prefilled on its decode replica
# The remote path may take this many times the local time to first token: paying some TTFT for
# the request to keep the decode replica's streams smooth is the point of disaggregation, but
# not without bound (a long prefill queue, a decode replica that holds most of the prompt).
REMOTE_FACTOR = 2.0

# Priors, until the router has measured its own calls. 10240 prefill tokens/s (a 7-8B model
# on one datacenter GPU) makes conditional's short_prompt limit 512 tokens at the default
# 50 ms budget: the same cut as threshold's default, until measurements say otherwise.
PRIOR_PREFILL_TOKENS_PER_S = 10240.0
# 20 us per prompt token: ~128 KiB of K/V per token (a Llama-3-8B in bf16) at ~6 GB/s, plus the
# decode replica's first step.
PRIOR_TRANSFER_S_PER_TOKEN = 2e-5
PRIOR_PREFILL_LATENCY_S = DEFAULT_MAX_LOCAL_PREFILL_LENGTH / PRIOR_PREFILL_TOKENS_PER_S  # a 512-token prompt's
EWMA_ALPHA = 0.2  # the weight of each new measurement: about the last ten calls count


@dataclass(frozen=True)
class PDConfig:
    decision: str = "conditional"  # --pd-decision
    max_local_prefill_length: int = DEFAULT_MAX_LOCAL_PREFILL_LENGTH
    local_budget_s: float = DEFAULT_LOCAL_BUDGET_MS / 1000
    prefill_timeout_s: float = DEFAULT_PREFILL_TIMEOUT

    def __post_init__(self) -> None:
        if self.decision not in PD_DECISIONS:
            raise ValueError(f"--pd-decision must be one of {', '.join(PD_DECISIONS)}, got {self.decision!r}")
        if self.max_local_prefill_length < 0:
            raise ValueError(f"--max-local-prefill-length must be >= 0, got {self.max_local_prefill_length}")
        if self.local_budget_s < 0:
            raise ValueError(f"--pd-local-budget-ms must be >= 0, got {self.local_budget_s * 1000:g}")
        if self.prefill_timeout_s <= 0:
            raise ValueError(f"--pd-prefill-timeout must be > 0 seconds, got {self.prefill_timeout_s:g}")


@dataclass(frozen=True)
class Costs:
    """What the cost model believes about the fleet (CostEstimator's current values)."""

    prefill_tokens_per_s: float = PRIOR_PREFILL_TOKENS_PER_S
    transfer_s_per_token: float = PRIOR_TRANSFER_S_PER_TOKEN
    prefill_latency_s: float = PRIOR_PREFILL_LATENCY_S  # mean time of one prefill call


@dataclass(frozen=True)
class PDInputs:
    """One request's numbers: the prompt and what each side would still compute of it."""

    prompt_tokens: int
    uncached_decode: int  # prompt tokens the chosen decode replica does not hold
    decode_queued_tokens: int = 0  # prompt tokens already waiting for their prefill there
    # the chosen prefill replica, None when none is up
    uncached_prefill: int | None = None  # prompt tokens it does not hold
    prefill_in_flight: int = 0  # requests the router has sent it and not seen answered
    decode_streams: int = 0  # requests generating on the chosen decode replica: a local prefill stalls them


def decide(config: PDConfig, req: PDInputs, costs: Costs) -> tuple[str, str]:
    """(LOCAL or REMOTE, the reason): see the module docstring."""
    if config.decision == "never":
        return LOCAL, "forced_never"
    if req.uncached_prefill is None:
        return LOCAL, "no_prefill_replica"
    if config.decision == "always":
        return REMOTE, "forced_always"
    if config.decision == "threshold":
        return (LOCAL if req.uncached_decode <= config.max_local_prefill_length else REMOTE), "threshold"
    rate = costs.prefill_tokens_per_s
    local_s = req.uncached_decode / rate
    if local_s <= config.local_budget_s:
        return LOCAL, "short_prompt"
    local_ttft = req.decode_queued_tokens / rate + local_s
    # What the remote path may cost this request: REMOTE_FACTOR x its local time to first
    # token, plus the stall a local prefill would cause every stream decoding there.
    allowed = REMOTE_FACTOR * local_ttft + req.decode_streams * local_s
    remote_s = req.uncached_prefill / rate + req.prompt_tokens * costs.transfer_s_per_token
    if remote_s > allowed:
        return LOCAL, "remote_slower"
    if req.prefill_in_flight * costs.prefill_latency_s + remote_s > allowed:
        return LOCAL, "prefill_queue"
    return REMOTE, "remote_cheaper"


class CostEstimator:
    """The cost model's numbers, as exponentially weighted moving averages of the router's own
    calls; the priors stand until the first measurement of each, which then replaces them.

    - prefill rate: prompt tokens a prefill replica computed (its reply's usage: the prompt
      less what it held) / the call's latency, from calls the replica had to itself (as far as
      the router knows): under load a call's latency is mostly the wait, which `queue` counts.
    - mean prefill latency: of every call, waits included.
    - transfer time per token: a remote-prefill stream's time to first byte on its decode
      replica / prompt tokens (the decode replica pulls the prompt's blocks, then computes its
      first token). Only streams measure it: a whole reply's first byte comes after the last token.
    """

    def __init__(self, prior: Costs | None = None, alpha: float = EWMA_ALPHA) -> None:
        self.costs = prior or Costs()
        self.alpha = alpha
        self.measured: set[str] = set()

    def _update(self, name: str, value: float) -> None:
        old = getattr(self.costs, name)
        new = value if name not in self.measured else (1 - self.alpha) * old + self.alpha * value
        self.measured.add(name)
        self.costs = replace(self.costs, **{name: new})

    def prefill_done(self, computed_tokens: int, seconds: float, alone: bool = True) -> None:
        """A prefill call took `seconds`; `alone`: no other request of the router was on its replica."""
        if seconds <= 0:
            return
        self._update("prefill_latency_s", seconds)
        if alone and computed_tokens > 0:
            self._update("prefill_tokens_per_s", computed_tokens / seconds)

    def transfer_done(self, prompt_tokens: int, seconds: float) -> None:
        if prompt_tokens > 0 and seconds > 0:
            self._update("transfer_s_per_token", seconds / prompt_tokens)
