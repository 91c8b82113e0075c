"""The `kv_aware` policy: route a prompt to the replica whose KV cache saves it the most work.

The router hashes the prompt's full blocks exactly as every replica's prefix cache does
(prefix_cache.hash_block_tokens: content-only, identical on every machine) and asks each
replica's block mirror, kept current from its KV events, how many leading blocks it holds
and in which tier. The cost of a replica, in the spirit of NVIDIA Dynamo's KV router, is
the prefill work it would still do for this prompt plus the work already queued on it:

    cost = prompt tokens - sum(tier weight of each cached block) * block_size + load

in tokens, divided by the block size to read in blocks (for replicas sharing a block size
this orders them exactly as Dynamo's "blocks to prefill + load in blocks"; counting the
prompt's partial tail too keeps replicas of other block sizes comparable). The cheapest
wins, ties at random. SGLang's balance thresholds keep a popular prefix from piling every
request on one replica: when loads drift too far apart, route by load alone.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from kvserve.core.prefix_cache import hash_block_tokens
from kvserve.router.policy import Decision, Policy, ReplicaView, RouteRequest, register

# What a cached block is worth, as the share of its prefill it saves. A device hit is free;
# a lower tier costs a copy that grows with the tier's distance (host RAM over PCIe / a
# memcpy, a local disk read, a network fetch), and a copy overlaps less with compute the
# slower it is. Rough ratios of a block's load time to its prefill time on the CPUs and
# GPUs we run on; what matters is the order (device > cpu > disk > remote > nothing).
TIER_WEIGHTS: dict[str, float] = {"device": 1.0, "cpu": 0.8, "disk": 0.5, "remote": 0.3}

DEFAULT_BLOCK_SIZE = 16  # CacheConfig's default, for a replica that has not said its own
# Balance thresholds (SGLang's balance_abs_threshold / balance_rel_threshold), on ReplicaView.load
# in tokens left to prefill: two engine steps of the default token budget (2048), a gap a busy
# replica needs several steps to close, so routing a hit there would stall it; smaller gaps are
# what the cost already weighs, request by request (a threshold under one prompt's length turned
# kv_aware into least_load in the router benchmark). 1.5x keeps a busy fleet with a large
# absolute spread from tripping it.
BALANCE_ABS_THRESHOLD = 2 * 2048
BALANCE_REL_THRESHOLD = 1.5
_TIE = 1e-9  # costs are sums of float weights: equal sums may differ in the last bits


def prompt_block_hashes(token_ids: Sequence[int], block_size: int, cache_salt: str | None) -> list[bytes]:
    """Chain hashes of the prompt's blocks that a replica's cache could supply: the full
    blocks but never the last token (prefix_cache.max_cached_blocks: it must run to give
    logits), so the same hashes the replica's HashPrefixCache looks up for this prompt."""
    out: list[bytes] = []
    parent = b""
    for i in range(max(0, (len(token_ids) - 1) // block_size)):
        parent = hash_block_tokens(parent, token_ids[i * block_size:(i + 1) * block_size], cache_salt)
        out.append(parent)
    return out


def is_imbalanced(replicas: Sequence[ReplicaView], abs_threshold: float, rel_threshold: float) -> bool:
    """SGLang's rule: both the gap and the ratio between the busiest and idlest replica are
    past their thresholds (the ratio alone trips on tiny loads, the gap alone on huge ones)."""
    loads = [r.load for r in replicas]
    hi, lo = max(loads), min(loads)
    return hi - lo > abs_threshold and hi > rel_threshold * lo


def pick_min(replicas: Sequence[ReplicaView], key: Sequence[float], rng: random.Random) -> int:
    """Index of the replica with the smallest key, a random one among ties, so equal replicas
    share the work instead of the first in the list taking it all."""
    best = min(key)
    return rng.choice([i for i, k in enumerate(key) if k <= best + _TIE])


@register
class KVAwarePolicy(Policy):
    """Cache- and load-aware routing from the replicas' KV events (see the module docstring).

    Reasons: "cache_hit" (the chosen replica holds some of the prompt's blocks), "load"
    (others hold some, but their load outweighs it), "no_hit" (no replica holds any), "balance" (loads too far apart: least load), "no_tokens" (the
    router could not tokenize the prompt: least load)."""

    name = "kv_aware"
    needs_tokens = True

    def __init__(self, seed: int | None = None, balance_abs_threshold: float = BALANCE_ABS_THRESHOLD,
                 balance_rel_threshold: float = BALANCE_REL_THRESHOLD,
                 tier_weights: dict[str, float] | None = None) -> None:
        if balance_abs_threshold < 0 or balance_rel_threshold < 1:
            raise ValueError("kv_aware: balance_abs_threshold must be >= 0 and balance_rel_threshold >= 1")
        self.rng = random.Random(seed)
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.tier_weights = {**TIER_WEIGHTS, **(tier_weights or {})}

    def choose(self, req: RouteRequest, replicas: list[ReplicaView]) -> Decision:
        if req.token_ids is None:
            i = pick_min(replicas, [r.load for r in replicas], self.rng)
            return Decision(replicas[i], "no_tokens")
        matches = self._matches(req, replicas)
        sizes = [_block_size(r) for r in replicas]
        if is_imbalanced(replicas, self.balance_abs_threshold, self.balance_rel_threshold):
            i = pick_min(replicas, [r.load for r in replicas], self.rng)
            return Decision(replicas[i], "balance", len(matches[i]) * sizes[i])
        n = len(req.token_ids)
        costs = [(n - sum(self.tier_weights.get(m, 0.0) for m in match) * bs + r.load) / bs
                 for r, match, bs in zip(replicas, matches, sizes)]
        i = pick_min(replicas, costs, self.rng)
        reason = "cache_hit" if matches[i] else "load" if any(matches) else "no_hit"
        return Decision(replicas[i], reason, len(matches[i]) * sizes[i],
                        extra={"cost_blocks": costs[i], "cached_tiers": _tier_counts(matches[i])})

    def _matches(self, req: RouteRequest, replicas: list[ReplicaView]) -> list[list[str]]:
        """Each replica's cached leading blocks of the prompt (a tier per block); the prompt is
        hashed once per block size in the fleet."""
        assert req.token_ids is not None
        hashes: dict[int, list[bytes]] = {}
        out = []
        for r in replicas:
            if r.kv_events is None:  # publishes nothing: as far as we know it holds nothing
                out.append([])
                continue
            bs = _block_size(r)
            if bs not in hashes:
                hashes[bs] = prompt_block_hashes(req.token_ids, bs, req.cache_salt)
            out.append(r.kv_events.match(hashes[bs]) if hashes[bs] else [])
        return out


def _block_size(r: ReplicaView) -> int:
    return r.block_size or DEFAULT_BLOCK_SIZE


def _tier_counts(match: list[str]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for m in match:
        counts[m] = counts.get(m, 0) + 1
    return counts
