"""How many tokens to draft for a request this step (adaptive k).

A verify step with k drafts scores k + 1 query tokens. While decode is memory-bound that costs
little more than one token: the weights are read once either way. The cost model is linear,
cost(k) = 1 + c * k single-token steps, with c the measured price of one more query token (a
property of the model and machine, measured by the engine: proposer.py). A step emits
E(k) = 1 + S_1 + ... + S_k tokens, S_i being the chance that the first i drafts are all kept.
The rule picks the k in [0, k_max] that maximises E(k) / cost(k): k = 0 (no drafts) when drafts
are rejected often enough that the wider step does not pay for itself.

Each request keeps, per draft position i, the chance q_i that draft i is kept once the drafts
before it were (S_i = q_1 ... q_i): an exponential moving average over its verify steps, updated
only where position i was reached. No independence is assumed. N-gram drafts are right or wrong
in runs: inside a copied span all k are kept, outside none, so q_1 is the share of steps in a
span and q_2.. are near 1. Independent drafts (one per-draft rate a, the geometric fit) would
make those look like a = 0.6 and shrink k; measured on the copy-heavy set, fixed k = 4 beat such
a rule (BENCHMARKS.md). The priors say the same: a first draft is kept with `prior`, a later one,
once those before it were, with `prior_next` (higher); a position keeps its prior until a verify
step reaches it.

A request whose drafts drove k to 0 is retried after `retry_after` steps from the prior again (a
text may start repeating later). When the batch holds `max_batch` or more decoding requests,
decode is no longer memory-bound and nobody drafts.
"""

from __future__ import annotations

from dataclasses import dataclass, field


def expected_tokens(a: float, k: int) -> float:
    """Tokens a step emits with k drafts, each kept with probability a independently."""
    if a >= 1.0:
        return k + 1.0
    return (1.0 - a ** (k + 1)) / (1.0 - a)


def best_k_for(keep: list[float], k_max: int, cost_per_token: float) -> int:
    """argmax over k in [0, k_max] of E(k) / (1 + cost_per_token * k), where keep[i] is the
    chance that draft i + 1 is kept once the drafts before it were."""
    best, best_rate, e, survive = 0, 1.0, 1.0, 1.0
    for k in range(1, k_max + 1):
        survive *= keep[k - 1]
        e += survive
        rate = e / (1.0 + cost_per_token * k)
        if rate > best_rate + 1e-9:
            best, best_rate = k, rate
    return best


def best_k(a: float, k_max: int, cost_per_token: float) -> int:
    """best_k_for with every draft kept with probability a, independently."""
    return best_k_for([a] * k_max, k_max, cost_per_token)


@dataclass
class _State:
    keep: list[float]  # q_i, i = 1..k_max
    idle_steps: int = 0  # steps since k went to 0


@dataclass
class AdaptiveK:
    k_max: int
    cost_per_token: float = 0.1
    prior: float = 0.6
    prior_next: float = 0.9
    smoothing: float = 0.3  # weight of the newest step in the moving averages
    retry_after: int = 16
    max_batch: int = 16
    _states: dict[str, _State] = field(default_factory=dict)

    def num_drafts(self, request_id: str, batch_decodes: int) -> int:
        """k for this request this step (0: no drafts), with `batch_decodes` decoding requests."""
        if batch_decodes >= self.max_batch:
            return 0
        st = self._state(request_id)
        k = best_k_for(st.keep, self.k_max, self.cost_per_token)
        if k == 0:
            st.idle_steps += 1
            if st.idle_steps >= self.retry_after:
                self._states[request_id] = st = self._fresh()
                k = best_k_for(st.keep, self.k_max, self.cost_per_token)
        return k

    def _fresh(self) -> _State:
        return _State([self.prior] + [self.prior_next] * (self.k_max - 1))

    def _state(self, request_id: str) -> _State:
        st = self._states.get(request_id)
        if st is None:
            st = self._states[request_id] = self._fresh()
        return st

    def observe(self, request_id: str, drafted: int, accepted: int) -> None:
        """A verify step's result: the first `accepted` of the `drafted` tokens kept."""
        if drafted <= 0:
            return
        st = self._state(request_id)
        w = self.smoothing
        for i in range(min(drafted, accepted + 1, self.k_max)):  # the positions this step reached
            st.keep[i] = (1 - w) * st.keep[i] + w * (1.0 if accepted > i else 0.0)
        st.idle_steps = 0

    def rate(self, request_id: str) -> float:
        """The chance that a first draft is kept."""
        st = self._states.get(request_id)
        return self.prior if st is None else st.keep[0]

    def forget(self, request_id: str) -> None:
        self._states.pop(request_id, None)
