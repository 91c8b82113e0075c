"""KVCacheManager: per-request block tables on top of a BlockPool and a PrefixCache.

The scheduler asks three questions: how much of this prompt is cached
(`get_computed_blocks`), can this request get room for N more tokens
(`allocate_slots`), and it is done (`free`). Everything else (ref counts,
eviction, prefix lookup) stays behind this class.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import TYPE_CHECKING

from kvserve.core.block_pool import BlockPool
from kvserve.core.kv_connector import KVConnector
from kvserve.core.prefix_cache import HashPrefixCache, PrefixCache, max_cached_blocks
from kvserve.core.radix_cache import RadixPrefixCache
from kvserve.request import Request

if TYPE_CHECKING:  # the sink's module brings zmq; the bookkeeping only calls its methods
    from kvserve.core.kv_events import KVEventSink

PREFIX_CACHES: dict[str, type[PrefixCache]] = {
    "hash": HashPrefixCache,
    "radix": RadixPrefixCache,
}


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 prefix_cache: str = "hash") -> None:
        if prefix_cache not in PREFIX_CACHES:
            raise ValueError(f"unknown prefix_cache {prefix_cache!r}; choose one of "
                             f"{sorted(PREFIX_CACHES)}")
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)
        # With caching off there is no cache object at all, so no code path can hit.
        self.cache: PrefixCache | None = (PREFIX_CACHES[prefix_cache](block_size, self.pool)
                                          if enable_prefix_caching else None)
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    # ---- capacity -----------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks that could be allocated now: free ones plus evictable cached ones."""
        return self.pool.num_free + (self.cache.num_evictable if self.cache else 0)

    @property
    def num_used_blocks(self) -> int:
        return self.pool.num_used

    @property
    def usage(self) -> float:
        return self.pool.num_used / self.num_blocks

    # ---- scheduler API ------------------------------------------------------

    def attach_connector(self, connector: KVConnector) -> None:
        """Send every block the prefix cache evicts to the KV tiers."""
        if self.cache is None:
            raise ValueError("KV offload tiers need prefix caching; drop --no-enable-prefix-caching")
        if not self.cache.supports_tiers:
            raise ValueError("KV offload tiers key blocks by chain hash: use --prefix-cache hash")
        self.cache.evict_listener = connector.on_evict

    def attach_events(self, sink: KVEventSink) -> None:
        """Report every block the prefix cache registers or drops (KV events for routers)."""
        if self.cache is None:
            raise ValueError("KV events report prefix-cache blocks; drop --no-enable-prefix-caching")
        if not self.cache.supports_tiers:
            raise ValueError("KV events name blocks by chain hash: use --prefix-cache hash")
        self.cache.events = sink

    def _match(self, request: Request) -> list[int]:
        if self.cache is None or request.skip_prefix_cache:
            return []
        max_blocks = max_cached_blocks(request, self.block_size)
        return self.cache.match(request, max_blocks) if max_blocks > 0 else []

    def num_cached_blocks(self, request: Request) -> int:
        """Full prompt blocks cached on the device now (a lookup only: no stats, no references)."""
        return len(self._match(request))

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """The request's cached prompt blocks on the device and the tokens they hold. Counted in
        the hit rate by `count_lookup` once the request is scheduled, so a request that waits
        for room and looks up again every step is counted once."""
        if self.cache is None or request.skip_prefix_cache:
            return [], 0
        blocks = self._match(request)
        return blocks, len(blocks) * self.block_size

    def count_lookup(self, request: Request, num_cached: int) -> None:
        if self.cache is not None and not request.skip_prefix_cache:
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += num_cached

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: list[int] | None = None) -> list[int] | None:
        computed = list(new_computed_blocks or [])
        num_tokens = request.num_computed_tokens + len(computed) * self.block_size + num_new_tokens
        num_held = len(request.block_ids) + len(computed)
        num_new_blocks = max(0, _cdiv(num_tokens, self.block_size) - num_held)
        if not self._can_allocate(num_new_blocks, computed):
            return None

        # Take the hits first so the evictions below cannot pick them.
        self._acquire(computed)
        request.block_ids.extend(computed)
        shortage = num_new_blocks - self.pool.num_free
        if shortage > 0:
            assert self.cache is not None
            self.pool.push_free(self.cache.evict(shortage))
        new_blocks = [self.pool.pop_free() for _ in range(num_new_blocks)]
        request.block_ids.extend(new_blocks)

        if self.cache is not None:
            # Every block these tokens fill is registered now (vLLM v1): its tokens
            # are known, and its K/V are written before anyone can read them.
            num_full = min(num_tokens, request.num_tokens) // self.block_size
            self.cache.insert(request, num_full)
        return new_blocks

    def _can_allocate(self, num_new_blocks: int, computed: list[int]) -> bool:
        """Decide before touching anything, so a refusal changes no state."""
        available = self.pool.num_free
        if self.cache is not None:
            for b in computed:
                assert self.cache.is_cached(b), f"computed block {b} is no longer cached"
            # Hits that are idle now stop being evictable once we reference them.
            taken = sum(1 for b in computed if self.cache.is_evictable(b))
            available += self.cache.num_evictable - taken
        return num_new_blocks <= available

    def _acquire(self, block_ids: list[int]) -> None:
        became_used = [b for b in block_ids if self.pool.incref(b) == 1]
        if became_used and self.cache is not None:
            self.cache.acquire(became_used)

    def free(self, request: Request) -> None:
        blocks, request.block_ids = request.block_ids, []
        if self.cache is not None:
            self.cache.forget(request)
        self._release(blocks)

    def _release(self, block_ids: list[int]) -> None:
        """Drop a reference to each block. Tail first: the cache queues released blocks in this
        order, so the LRU evicts a chain's tail before its head."""
        released = [b for b in reversed(block_ids) if self.pool.decref(b) == 0]
        if self.cache is not None:
            released = self.cache.release(released)
        self.pool.push_free(released)

    def cache_computed(self, request: Request) -> None:
        """Register the request's blocks full of computed tokens now, not at its next allocation:
        tokens accepted from a draft were computed in the step that verified them, and a request
        that ends there allocates no more (speculative decoding)."""
        if self.cache is not None:
            self.cache.insert(request, min(request.num_computed_tokens, request.num_tokens) // self.block_size)

    def free_tail(self, request: Request, num_tokens: int) -> None:
        """Give back the request's blocks past its first num_tokens tokens: slots allocated for
        drafted tokens that verification rejected (speculative decoding). They hold no token of the
        request, so the prefix cache never registered them."""
        keep = _cdiv(num_tokens, self.block_size)
        tail = request.block_ids[keep:]
        del request.block_ids[keep:]
        self._release(tail)

    def fork(self, src: Request, dst: Request, num_tokens: int) -> None:
        """dst shares src's first num_tokens // block_size blocks (all full ones).

        dst's num_computed_tokens is left to the caller (followers wait until the
        leader has computed the shared blocks)."""
        if dst.block_ids:
            raise ValueError(f"fork target {dst.request_id!r} already holds blocks")
        num_shared = num_tokens // self.block_size
        if num_shared > len(src.block_ids):
            raise ValueError(f"fork of {num_tokens} tokens but {src.request_id!r} holds only "
                             f"{len(src.block_ids)} blocks")
        shared = src.block_ids[:num_shared]
        for b in shared:
            self.pool.incref(b)  # already used by src, so never a 0 -> 1 transition
        dst.block_ids = list(shared)

    def reset_prefix_cache(self) -> bool:
        if self.pool.num_used > 0:
            return False
        if self.cache is not None:
            self.pool.push_free(self.cache.reset())
        return True

    # ---- checking -----------------------------------------------------------

    def check_integrity(self, requests: Iterable[Request] = ()) -> None:
        self.pool.check_integrity()
        expected: Counter[int] = Counter()
        for r in requests:
            assert len(set(r.block_ids)) == len(r.block_ids), f"{r.request_id} holds a block twice"
            expected.update(r.block_ids)
        for b in range(self.num_blocks):
            assert self.pool.ref_cnt[b] == expected[b], \
                f"block {b}: ref {self.pool.ref_cnt[b]} but held by {expected[b]} requests"
        cached: set[int] = set()
        if self.cache is not None:
            self.cache.check_integrity()
            cached = self.cache.cached_block_ids()
        idle_cached = sum(1 for b in cached if self.pool.ref_cnt[b] == 0)
        for b in range(self.num_blocks):
            in_free = self.pool.is_free(b)
            assert not (in_free and b in cached), f"block {b} is both free and cached"
            if self.pool.ref_cnt[b] == 0:
                assert in_free or b in cached, f"block {b} is unreferenced but neither free nor cached"
        evictable = self.cache.num_evictable if self.cache else 0
        assert evictable <= idle_cached, f"{evictable} evictable but only {idle_cached} idle cached"
        total = self.pool.num_free + idle_cached + self.pool.num_used
        assert total == self.num_blocks, (f"free {self.pool.num_free} + idle cached {idle_cached}"
                                          f" + used {self.pool.num_used} != {self.num_blocks}")
