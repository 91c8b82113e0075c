"""How many tokens to draft for a request this step (adaptive k).

A verify step with k drafts scores k + 1 query tokens. While decode is memory-bound that costs
little more than one token: the weights are read once either way. The cost model is linear,
cost(k) = 1 + c * k single-token steps, with c the measured price of one more query token (a
property of the model and machine; BENCHMARKS.md has the measurement). With each draft accepted
with probability a (independently), a step emits E(k) = (1 - a^(k+1)) / (1 - a) tokens. The rule
picks the k in [0, k_max] that maximises E(k) / cost(k): k = 0 (no drafts) when drafts are
rejected often enough that the wider step does not pay for itself.

Each request's acceptance rate is an exponential moving average of its verified drafts, started
at a prior. A request whose rate drove k to 0 is retried after `retry_after` steps with the
prior again (a text may start repeating later). When the batch holds `max_batch` or more decoding
requests, decode is no longer memory-bound and nobody drafts.
"""

from __future__ import annotations

from dataclasses import dataclass, field


def expected_tokens(a: float, k: int) -> float:
    """Tokens a step emits with k drafts, each accepted with probability a."""
    if a >= 1.0:
        return k + 1.0
    return (1.0 - a ** (k + 1)) / (1.0 - a)


def best_k(a: float, k_max: int, cost_per_token: float) -> int:
    """argmax over k in [0, k_max] of expected_tokens(a, k) / (1 + cost_per_token * k)."""
    best, best_rate = 0, 1.0
    for k in range(1, k_max + 1):
        rate = expected_tokens(a, k) / (1.0 + cost_per_token * k)
        if rate > best_rate + 1e-9:
            best, best_rate = k, rate
    return best


@dataclass
class _State:
    rate: float
    idle_steps: int = 0  # steps since k went to 0


@dataclass
class AdaptiveK:
    k_max: int
    cost_per_token: float = 0.1
    prior: float = 0.6
    smoothing: float = 0.3  # weight of the newest step in the moving average
    retry_after: int = 16
    max_batch: int = 16
    _states: dict[str, _State] = field(default_factory=dict)

    def num_drafts(self, request_id: str, batch_decodes: int) -> int:
        """k for this request this step (0: no drafts), with `batch_decodes` decoding requests."""
        if batch_decodes >= self.max_batch:
            return 0
        st = self._states.setdefault(request_id, _State(self.prior))
        k = best_k(st.rate, self.k_max, self.cost_per_token)
        if k == 0:
            st.idle_steps += 1
            if st.idle_steps >= self.retry_after:
                st.rate, st.idle_steps = self.prior, 0
                k = best_k(st.rate, self.k_max, self.cost_per_token)
        return k

    def observe(self, request_id: str, drafted: int, accepted: int) -> None:
        """A verify step's result: `accepted` of the `drafted` tokens kept."""
        if drafted <= 0:
            return
        st = self._states.setdefault(request_id, _State(self.prior))
        # The per-draft rate that explains `accepted` leading drafts kept: a run that stopped at a
        # rejection saw accepted successes and one failure; a run kept whole saw drafted successes.
        trials = accepted + (accepted < drafted)
        step_rate = accepted / trials if trials else 0.0
        st.rate = (1 - self.smoothing) * st.rate + self.smoothing * step_rate
        st.idle_steps = 0

    def rate(self, request_id: str) -> float:
        st = self._states.get(request_id)
        return self.prior if st is None else st.rate

    def forget(self, request_id: str) -> None:
        self._states.pop(request_id, None)
