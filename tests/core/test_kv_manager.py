"""KVCacheManager: allocation, freeing, forking, and a randomized scheduler-like workout."""

import random

import pytest

from kvserve.core.kv_manager import PREFIX_CACHES, KVCacheManager
from kvserve.request import Request
from kvserve.sampling_params import SamplingParams

IMPLS = ["hash", "radix"]


def req(rid: str, tokens: list[int], salt: str | None = None) -> Request:
    return Request(rid, tokens, SamplingParams(), cache_salt=salt)


def snapshot(m: KVCacheManager, *reqs: Request) -> tuple:
    cache = m.cache
    return (list(m.pool.ref_cnt), m.pool.num_free, m.num_free_blocks,
            cache.cached_block_ids() if cache else set(), cache.num_evictable if cache else 0,
            [list(r.block_ids) for r in reqs], m.prefix_cache_hits)


@pytest.fixture(params=IMPLS)
def impl(request) -> str:
    return request.param


def test_registry_and_bad_name():
    assert set(PREFIX_CACHES) == {"hash", "radix"}
    with pytest.raises(ValueError, match="prefix_cache 'lru'"):
        KVCacheManager(8, 16, prefix_cache="lru")


def test_allocate_grow_and_free(impl):
    m = KVCacheManager(10, 4, prefix_cache=impl)
    r = req("r", list(range(6)))
    new = m.allocate_slots(r, 6)
    assert len(new) == 2 and r.block_ids == new
    r.num_computed_tokens = 6
    assert m.num_used_blocks == 2 and m.usage == pytest.approx(0.2)
    grown = []
    for tok in [6, 7, 8]:  # decode: tokens 7 and 8 fit in block 2, token 9 needs block 3
        r.append_output_token(tok)
        grown.append(len(m.allocate_slots(r, 1)))
        r.num_computed_tokens += 1
        m.check_integrity([r])
    assert grown == [0, 0, 1]
    assert len(r.block_ids) == 3
    # Generated tokens that fill a block are cached too.
    assert m.get_computed_blocks(req("q", list(range(9)) + [0]))[1] == 8
    m.free(r)
    m.check_integrity([])
    assert r.block_ids == [] and m.num_used_blocks == 0 and m.num_free_blocks == 10
    m.free(r)  # idempotent
    m.check_integrity([])
    assert m.num_free_blocks == 10


def test_chunked_prefill_registers_blocks_as_they_fill(impl):
    m = KVCacheManager(16, 16, prefix_cache=impl)
    r = req("r", list(range(40)))
    assert len(m.allocate_slots(r, 20)) == 2
    r.num_computed_tokens = 20
    assert m.get_computed_blocks(req("q", list(range(41))))[1] == 16
    assert len(m.allocate_slots(r, 20)) == 1
    r.num_computed_tokens = 40
    assert m.get_computed_blocks(req("q", list(range(41))))[1] == 32
    m.check_integrity([r])


def test_pressure_evicts_instead_of_failing(impl):
    m = KVCacheManager(4, 4, prefix_cache=impl)
    a, b = req("a", list(range(8))), req("b", list(range(10, 18)))
    m.allocate_slots(a, 8)
    m.allocate_slots(b, 8)
    m.free(b)  # b's two blocks are idle in the cache; nothing is in the free queue
    assert m.pool.num_free == 0 and m.num_free_blocks == 2
    c = req("c", list(range(20, 28)))
    assert sorted(m.allocate_slots(c, 8)) == sorted([2, 3])
    m.check_integrity([a, c])
    assert m.get_computed_blocks(req("q", list(range(10, 19))))[1] == 0


def test_refusal_changes_nothing(impl):
    m = KVCacheManager(4, 4, prefix_cache=impl)
    a, b = req("a", list(range(8))), req("b", list(range(10, 18)))
    m.allocate_slots(a, 8)
    m.allocate_slots(b, 8)
    m.free(b)
    d = req("d", list(range(30, 42)))  # needs 3 blocks, only 2 can be had
    before = snapshot(m, a, d)
    assert m.allocate_slots(d, 12) is None
    assert snapshot(m, a, d) == before
    m.check_integrity([a])
    assert m.get_computed_blocks(req("q", list(range(10, 19))))[1] == 8  # b's blocks survived


def test_refusal_with_idle_hits_changes_nothing(impl):
    m = KVCacheManager(4, 4, prefix_cache=impl)
    x = req("x", list(range(12)))
    m.allocate_slots(x, 12)
    m.free(x)  # 3 idle cached blocks + 1 free block
    y = req("y", list(range(12)) + list(range(50, 58)))
    hit, n = m.get_computed_blocks(y)
    assert n == 12
    before = snapshot(m, y)
    # The hits stop being evictable once y holds them: 1 block left, 2 needed.
    assert m.allocate_slots(y, 8, hit) is None
    assert snapshot(m, y) == before
    m.check_integrity([])
    # The LRU order is untouched too: the free block, then the tail of x.
    z = req("z", list(range(60, 68)))
    assert m.allocate_slots(z, 8) == [3, 2]
    y2 = req("y2", list(range(12)) + [50])
    hit, n = m.get_computed_blocks(y2)
    assert (hit, n) == ([0, 1], 8)
    before = snapshot(m, y2)
    assert m.allocate_slots(y2, 5, hit) is None  # nothing free, z holds 2, the hits pin 2
    assert snapshot(m, y2) == before
    m.check_integrity([z])


def test_idle_hits_are_taken_before_evicting(impl):
    m = KVCacheManager(4, 4, prefix_cache=impl)
    x = req("x", list(range(12)))
    m.allocate_slots(x, 12)
    m.free(x)
    y = req("y", list(range(12)) + [99])
    hit, n = m.get_computed_blocks(y)
    new = m.allocate_slots(y, 1, hit)
    assert new == [3] and y.block_ids == [0, 1, 2, 3]
    assert [m.pool.ref_cnt[b] for b in range(4)] == [1, 1, 1, 1]
    m.check_integrity([y])


def test_fork_shares_full_blocks(impl):
    for caching in (True, False):
        m = KVCacheManager(16, 4, enable_prefix_caching=caching, prefix_cache=impl)
        src = req("s", list(range(10)))
        m.allocate_slots(src, 10)
        src.num_computed_tokens = 10
        dsts = [req(f"d{i}", list(range(10))) for i in range(2)]
        for d in dsts:
            m.fork(src, d, 10)
            assert d.block_ids == src.block_ids[:2]
        assert [m.pool.ref_cnt[b] for b in src.block_ids] == [3, 3, 1]
        m.check_integrity([src, *dsts])
        for d in dsts:  # each sample computes its own partial last block
            d.num_computed_tokens = 8
            assert len(m.allocate_slots(d, 2)) == 1
            d.num_computed_tokens = 10
        m.check_integrity([src, *dsts])
        assert m.num_used_blocks == 5
        m.free(src)
        assert [m.pool.ref_cnt[b] for b in dsts[0].block_ids[:2]] == [2, 2]
        for d in dsts:
            m.free(d)
        m.check_integrity([])
        assert m.num_used_blocks == 0 and m.num_free_blocks == 16


def test_fork_errors():
    m = KVCacheManager(8, 4)
    src, dst = req("s", list(range(8))), req("d", list(range(8)))
    m.allocate_slots(src, 8)
    with pytest.raises(ValueError, match="holds only 2 blocks"):
        m.fork(src, dst, 12)
    m.fork(src, dst, 8)
    with pytest.raises(ValueError, match="already holds blocks"):
        m.fork(src, dst, 8)


def test_stats_count_tokens(impl):
    m = KVCacheManager(16, 4, prefix_cache=impl)
    a = req("a", list(range(10)))
    m.allocate_slots(a, 10, m.get_computed_blocks(a)[0])
    m.count_lookup(a, 0)
    b = req("b", list(range(9)))
    for _ in range(3):  # a request that waits for room looks up again each step: counted once
        hit, n = m.get_computed_blocks(b)
    m.count_lookup(b, n)
    assert (m.prefix_cache_queries, m.prefix_cache_hits) == (19, 8)


# ---- randomized workout ---------------------------------------------------------

class Workout:
    """A small scheduler: arrivals, chunked prefill, decode, preemption, fork, finish."""

    def __init__(self, impl: str, num_blocks: int, seed: int, block_size: int = 4,
                 check_every_op: bool = True) -> None:
        self.m = KVCacheManager(num_blocks, block_size, prefix_cache=impl)
        self.check_every_op = check_every_op
        self.min_free = num_blocks
        self.bs = block_size
        self.rng = random.Random(seed)
        self.stems = [[self.rng.randrange(50) for _ in range(self.rng.randrange(0, 40))]
                      for _ in range(4)]
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.owner: dict[int, tuple[Request, int]] = {}  # block -> (request, position) it was made for
        self.trace: list[tuple] = []
        self.total_hits = 0
        self.next_id = 0

    def check_hits(self, r: Request, hit: list[int]) -> None:
        """Every hit block must hold exactly this request's tokens (and salt) up to its end."""
        for j, b in enumerate(hit):
            src, pos = self.owner[b]
            end = (j + 1) * self.bs
            assert pos == j and src.cache_salt == r.cache_salt, f"block {b} hit at wrong place"
            assert src.all_token_ids[:end] == r.all_token_ids[:end], f"block {b} holds other tokens"

    def allocate(self, r: Request, n: int, hit: list[int] | None = None) -> bool:
        before = snapshot(self.m, r)
        start = len(r.block_ids) + len(hit or [])
        new = self.m.allocate_slots(r, n, hit)
        self.trace.append(("alloc", r.request_id, n, None if new is None else tuple(new)))
        if new is None:
            assert snapshot(self.m, r) == before, "refused allocation changed state"
            return False
        for i, b in enumerate(new):
            self.owner[b] = (r, start + i)
        return True

    def arrive(self) -> None:
        stem = self.rng.choice(self.stems)
        tail = [self.rng.randrange(6) for _ in range(self.rng.randrange(1, 30))]
        salt = self.rng.choice([None, None, "s"])
        self.next_id += 1
        self.waiting.append(req(f"r{self.next_id}", stem + tail, salt))

    def admit(self) -> None:
        r = self.rng.choice(self.waiting)
        hit, n = self.m.get_computed_blocks(r)
        self.trace.append(("hit", r.request_id, tuple(hit)))
        self.check_hits(r, hit)
        self.total_hits += n
        chunk = self.rng.randint(1, r.num_tokens - n)
        if self.allocate(r, chunk, hit):
            r.num_computed_tokens = n + chunk
            self.waiting.remove(r)
            self.running.append(r)

    def step(self) -> None:
        r = self.rng.choice(self.running)
        if r.num_computed_tokens < r.num_tokens:
            n = self.rng.randint(1, r.num_tokens - r.num_computed_tokens)
        else:
            r.append_output_token(self.rng.randrange(6))
            n = 1
        if self.allocate(r, n):
            r.num_computed_tokens += n
        else:  # preempt by recompute
            self.finish(r)
            r.num_computed_tokens = 0
            self.waiting.append(r)

    def fork(self) -> None:
        srcs = [r for r in self.running if r.num_computed_tokens >= r.num_prompt_tokens]
        if not srcs:
            return
        src = self.rng.choice(srcs)
        self.next_id += 1
        dst = req(f"r{self.next_id}", src.prompt_token_ids, src.cache_salt)
        self.m.fork(src, dst, dst.num_prompt_tokens)
        dst.num_computed_tokens = len(dst.block_ids) * self.bs
        self.running.append(dst)

    def finish(self, r: Request) -> None:
        self.m.free(r)
        self.running.remove(r)

    def run(self, num_ops: int) -> None:
        for _ in range(num_ops):
            op = self.rng.random()
            if op < 0.2 or not (self.waiting or self.running):
                self.arrive()
            elif op < 0.45 and self.waiting:
                self.admit()
            elif op < 0.8 and self.running:
                self.step()
            elif op < 0.87 and self.running:
                self.fork()
            elif op < 0.995 and self.running:
                self.finish(self.rng.choice(self.running))
            elif self.m.reset_prefix_cache():
                assert self.m.num_used_blocks == 0
            self.min_free = min(self.min_free, self.m.pool.num_free)
            if self.check_every_op:
                self.m.check_integrity(self.running)
        for r in list(self.running):
            self.finish(r)
        self.m.check_integrity([])
        assert self.m.num_used_blocks == 0
        assert self.m.num_free_blocks == self.m.num_blocks


@pytest.mark.parametrize("seed", range(6))
def test_randomized_integrity_under_pressure(impl, seed):
    w = Workout(impl, num_blocks=24, seed=seed)
    w.run(600)
    refused = sum(1 for t in w.trace if t[0] == "alloc" and t[3] is None)
    assert w.total_hits > 0 and refused > 0  # the workout really hit the cache and ran out of room


@pytest.mark.parametrize("seed", range(4))
def test_hash_and_radix_agree_without_eviction(seed):
    traces = {}
    for impl in IMPLS:
        w = Workout(impl, num_blocks=1024, seed=seed, check_every_op=False)
        w.run(400)
        assert w.total_hits > 0
        assert w.min_free > 0  # the free queue never ran dry, so nothing was evicted
        traces[impl] = w.trace
    assert traces["hash"] == traces["radix"]


def test_check_integrity_catches_inconsistencies(impl):
    m = KVCacheManager(8, 4, prefix_cache=impl)
    a, b = req("a", list(range(9))), req("b", list(range(9)))
    m.allocate_slots(a, 9)
    m.fork(a, b, 8)
    m.check_integrity([a, b])
    with pytest.raises(AssertionError, match="block 0: ref 2 but held by 1 requests"):
        m.check_integrity([a])
    m.free(b)
    m.free(a)
    m.check_integrity([])
    m.pool.incref(0)  # a reference nobody holds
    with pytest.raises(AssertionError, match="block 0: ref 1 but held by 0"):
        m.check_integrity([])
    m.pool.decref(0)
    m.check_integrity([])
    cache = m.cache
    if impl == "hash":
        cache._idle.pop(0)  # an idle cached block missing from the LRU queue
        with pytest.raises(AssertionError, match="block 0: ref 0 but idle=False"):
            m.check_integrity([])
    else:
        cache._evictable += 1
        with pytest.raises(AssertionError, match="evictable counter"):
            m.check_integrity([])
