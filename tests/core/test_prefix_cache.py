"""Prefix-cache behaviour through KVCacheManager; every test runs on both caches."""

import pytest

import kvserve.core.prefix_cache as prefix_cache_mod
from kvserve.core.kv_manager import KVCacheManager
from kvserve.core.prefix_cache import hash_block_tokens
from kvserve.request import Request
from kvserve.sampling_params import SamplingParams

IMPLS = ["hash", "radix"]


def req(rid: str, tokens: list[int], salt: str | None = None) -> Request:
    return Request(rid, tokens, SamplingParams(), cache_salt=salt)


def admit(m: KVCacheManager, r: Request, live: list[Request]) -> tuple[list[int], int, list[int]]:
    """What the scheduler does for a waiting request: look up, allocate the rest, compute."""
    hit, n = m.get_computed_blocks(r)
    new = m.allocate_slots(r, r.num_tokens - n, hit)
    assert new is not None
    m.count_lookup(r, n)
    r.num_computed_tokens = r.num_tokens
    live.append(r)
    m.check_integrity(live)
    return hit, n, new


def release(m: KVCacheManager, r: Request, live: list[Request]) -> None:
    m.free(r)
    live.remove(r)
    m.check_integrity(live)


def hit_tokens(m: KVCacheManager, tokens: list[int], salt: str | None = None) -> int:
    return m.get_computed_blocks(req("probe", tokens, salt))[1]


@pytest.fixture(params=IMPLS)
def impl(request) -> str:
    return request.param


def test_second_request_reuses_three_block_prefix(impl):
    m, live = KVCacheManager(32, 16, prefix_cache=impl), []
    prefix = list(range(1000, 1048))
    a = req("a", prefix + list(range(20)))
    _, n, new_a = admit(m, a, live)
    assert n == 0 and len(new_a) == 5  # 68 tokens
    b = req("b", prefix + list(range(500, 530)))
    hit, n, new_b = admit(m, b, live)
    assert n == 48
    assert hit == a.block_ids[:3] and b.block_ids[:3] == a.block_ids[:3]
    assert len(new_b) == 2 and not set(new_b) & set(a.block_ids)  # 78 tokens = 5 blocks, 3 shared
    assert [m.pool.ref_cnt[x] for x in b.block_ids] == [2, 2, 2, 1, 1]
    assert m.num_used_blocks == 7
    assert (m.prefix_cache_queries, m.prefix_cache_hits) == (68 + 78, 48)


@pytest.mark.parametrize("prompt_len,expected", [(48, 32), (49, 48), (47, 32), (16, 0), (17, 16)])
def test_fully_cached_prompt_still_computes_a_token(impl, prompt_len, expected):
    m, live = KVCacheManager(32, 16, prefix_cache=impl), []
    admit(m, req("a", list(range(64))), live)
    hit, n = m.get_computed_blocks(req("b", list(range(prompt_len))))
    assert n == expected and len(hit) == expected // 16


def test_freed_blocks_stay_hittable(impl):
    m, live = KVCacheManager(8, 4, prefix_cache=impl), []
    a = req("a", list(range(12)) + [99])
    admit(m, a, live)
    blocks = list(a.block_ids)
    release(m, a, live)
    assert m.num_used_blocks == 0 and m.num_free_blocks == 8
    hit, n = m.get_computed_blocks(req("b", list(range(12)) + [7]))
    assert (hit, n) == (blocks[:3], 12)


def test_cache_salt_isolation(impl):
    m, live = KVCacheManager(32, 16, prefix_cache=impl), []
    tokens = list(range(64))
    admit(m, req("a", tokens, salt="alice"), live)
    assert hit_tokens(m, tokens, "bob") == 0
    assert hit_tokens(m, tokens, None) == 0
    assert hit_tokens(m, tokens, "alice") == 48
    admit(m, req("b", tokens, salt=None), live)
    assert hit_tokens(m, tokens, None) == 48
    assert hit_tokens(m, tokens, "") == 0  # empty salt is a salt, not "no salt"


def test_hit_needs_every_block_to_match(impl):
    m, live = KVCacheManager(32, 4, prefix_cache=impl), []
    admit(m, req("a", list(range(16)) + [99]), live)
    assert hit_tokens(m, list(range(16)) + [5]) == 16
    assert hit_tokens(m, list(range(8)) + [0, 9, 10, 11] + list(range(12, 17))) == 8
    assert hit_tokens(m, [1] + list(range(1, 17))) == 0


def test_partial_match_splits_and_branches(impl):
    m, live = KVCacheManager(32, 4, prefix_cache=impl), []
    a = req("a", list(range(12)) + [99])
    admit(m, a, live)
    b = req("b", list(range(4)) + [50, 51, 52, 53, 54])
    hit, n, new = admit(m, b, live)
    assert n == 4 and hit == a.block_ids[:1] and len(new) == 2
    assert hit_tokens(m, list(range(12)) + [0]) == 12       # a's branch intact after the split
    assert hit_tokens(m, b.all_token_ids[:8] + [0]) == 8     # b's branch registered
    assert hit_tokens(m, list(range(4)) + [50, 51, 52, 0, 1]) == 4


def test_eviction_lru_across_requests_and_tail_first(impl):
    m, live = KVCacheManager(6, 4, prefix_cache=impl), []
    a, b = req("a", list(range(12))), req("b", list(range(100, 112)))
    admit(m, a, live)  # 12 tokens: 3 full blocks, all cached
    admit(m, b, live)
    blocks_a, blocks_b = list(a.block_ids), list(b.block_ids)
    release(m, a, live)  # a is the least recently used
    release(m, b, live)
    assert m.pool.num_free == 0 and m.num_free_blocks == 6
    c = req("c", list(range(200, 208)))
    _, _, new = admit(m, c, live)
    assert new == [blocks_a[2], blocks_a[1]]  # a's tail, then the block before it
    assert hit_tokens(m, list(range(12)) + [0]) == 4
    assert hit_tokens(m, list(range(100, 112)) + [0]) == 12
    d = req("d", list(range(300, 306)))
    _, _, new = admit(m, d, live)
    assert new == [blocks_a[0], blocks_b[2]]
    assert hit_tokens(m, list(range(12)) + [0]) == 0
    assert hit_tokens(m, list(range(100, 112)) + [0]) == 8


def test_hit_refreshes_lru(impl):
    m, live = KVCacheManager(6, 4, prefix_cache=impl), []
    a, b = req("a", list(range(12))), req("b", list(range(100, 112)))
    admit(m, a, live)
    admit(m, b, live)
    blocks_b = list(b.block_ids)
    release(m, a, live)
    release(m, b, live)
    a2 = req("a2", list(range(12)) + [1])  # reuses all of a's blocks: they become the newest
    hit, n, new = admit(m, a2, live)
    assert n == 12 and new == [blocks_b[2]]  # a's idle blocks were hits, so b's tail went
    release(m, a2, live)
    assert m.pool.num_free == 1  # a2's last block was partial, hence never cached
    c = req("c", list(range(200, 208)))
    _, _, new = admit(m, c, live)
    assert new == [blocks_b[2], blocks_b[1]]
    assert hit_tokens(m, list(range(12)) + [0]) == 12
    assert hit_tokens(m, list(range(100, 112)) + [0]) == 4


def test_shared_prefix_evicts_branch_tails_before_common_head(impl):
    m, live = KVCacheManager(4, 4, prefix_cache=impl), []
    a = req("a", list(range(12)))
    admit(m, a, live)
    b = req("b", list(range(4)) + [40, 41, 42, 43])
    hit, _, _ = admit(m, b, live)
    assert hit == a.block_ids[:1]
    p, a1, a2, b1 = a.block_ids[0], a.block_ids[1], a.block_ids[2], b.block_ids[1]
    release(m, a, live)
    release(m, b, live)
    c = req("c", list(range(500, 512)))
    _, _, new = admit(m, c, live)
    assert new == [a2, a1, b1]
    assert hit_tokens(m, list(range(4)) + [0]) == 4
    assert m.pool.ref_cnt[p] == 0 and m.cache.is_cached(p)


def test_duplicate_block_keeps_first_copy(impl):
    m, live = KVCacheManager(16, 4, prefix_cache=impl), []
    t = list(range(8))
    a, b = req("a", t + [100]), req("b", t + [200, 201, 202, 203, 204])
    assert m.get_computed_blocks(b) == ([], 0)  # looked up before a registered anything
    admit(m, a, live)
    new_b = m.allocate_slots(b, b.num_tokens, [])
    b.num_computed_tokens = b.num_tokens
    live.append(b)
    m.check_integrity(live)
    assert len(new_b) == 4 and not m.cache.is_cached(new_b[0]) and not m.cache.is_cached(new_b[1])
    assert m.cache.is_cached(new_b[2])  # b's own continuation is cached after a's blocks
    hit, n = m.get_computed_blocks(req("q", t + [200, 201, 202, 203, 0]))
    assert (hit, n) == (a.block_ids[:2] + [new_b[2]], 12)
    release(m, a, live)
    # A tree cannot evict a's blocks while b's child below them is in use; a hash chain can.
    assert m.cache.num_evictable == (2 if impl == "hash" else 0)
    free_before = m.pool.num_free
    release(m, b, live)
    assert m.pool.num_free == free_before + 3  # b's two duplicates and its partial block
    assert m.cache.num_evictable == 3 and m.num_free_blocks == 16


def test_evicted_original_lets_duplicates_fill_in(impl):
    m, live = KVCacheManager(6, 4, prefix_cache=impl), []
    t = list(range(8))
    a, b = req("a", t + [1]), req("b", t + [2])
    assert m.get_computed_blocks(b) == ([], 0)
    admit(m, a, live)  # blocks 0, 1 cached, 2 partial
    assert m.allocate_slots(b, 9, []) == [3, 4, 5]  # 3 and 4 duplicate a's 0 and 1
    b.num_computed_tokens = 9
    live.append(b)
    release(m, a, live)
    _, _, new = admit(m, req("c", list(range(100, 108))), live)
    assert new == [2, 1]  # a's tail (b's last walked original) is evicted
    for tok in (5, 6, 7):  # b fills its third block
        b.append_output_token(tok)
        assert m.allocate_slots(b, 1) == []
        b.num_computed_tokens += 1
        m.check_integrity(live)
    # b's own block 4 took the evicted block's place; 3 stays a duplicate of 0.
    assert m.cache.is_cached(4) and m.cache.is_cached(5) and not m.cache.is_cached(3)
    hit, n = m.get_computed_blocks(req("q", b.all_token_ids + [0]))
    assert (hit, n) == ([0, 4, 5], 12)


def test_repeated_reuse_keeps_structures_bounded(impl):
    m, live = KVCacheManager(8, 4, prefix_cache=impl), []
    for i in range(300):
        r = req(f"r{i}", list(range(12)) + [i])
        hit, n, new = admit(m, r, live)
        assert n == (12 if i else 0)
        release(m, r, live)
    if impl == "radix":  # stale heap entries are compacted away
        assert len(m.cache._heap) <= 4 * 3 + 64 + 1
    assert m.num_free_blocks == 8


def test_reset_prefix_cache(impl):
    m, live = KVCacheManager(8, 4, prefix_cache=impl), []
    a = req("a", list(range(12)) + [1])
    admit(m, a, live)
    assert m.reset_prefix_cache() is False
    assert hit_tokens(m, list(range(12)) + [2]) == 12
    release(m, a, live)
    assert m.reset_prefix_cache() is True
    m.check_integrity()
    assert hit_tokens(m, list(range(12)) + [2]) == 0
    assert m.pool.num_free == 8 and m.cache.num_evictable == 0
    admit(m, req("b", list(range(12)) + [3]), live)  # caching works again afterwards
    assert hit_tokens(m, list(range(12)) + [2]) == 12


def test_prefix_caching_disabled_never_hits(impl):
    m, live = KVCacheManager(8, 4, enable_prefix_caching=False, prefix_cache=impl), []
    a = req("a", list(range(12)) + [1])
    admit(m, a, live)
    hit, n, new = admit(m, req("b", list(range(12)) + [1]), live)
    assert (hit, n, len(new)) == ([], 0, 4)
    assert (m.prefix_cache_queries, m.prefix_cache_hits) == (0, 0)
    for r in list(live):
        release(m, r, live)
    assert m.pool.num_free == 8 and m.reset_prefix_cache() is True


def test_skip_prefix_cache_reads_nothing(impl):
    m, live = KVCacheManager(8, 4, prefix_cache=impl), []
    admit(m, req("a", list(range(12)) + [1]), live)
    r = Request("b", list(range(12)) + [1], SamplingParams(prompt_logprobs=1))
    assert r.skip_prefix_cache
    assert m.get_computed_blocks(r) == ([], 0)


# ---- hash-chain specifics -------------------------------------------------------

def test_block_hash_is_stable_across_processes():
    # Golden digests: sha256 over a fixed encoding, so every process, machine and
    # PYTHONHASHSEED must produce exactly these (KV tiers and replicas key on them).
    h = hash_block_tokens
    assert h(h(b"", [1, 2, 3], "s"), [4, 5, 6], "s").hex() == \
        "d1b106650816fb5a91e76bf6ca05315787486349d5c77c5b0457e7f38716176c"
    assert h(b"", [0, 2**40, 7], None).hex() == \
        "f7370684846fcf02deb7d4bf37e5eaa6c8bc34959eb537059d328bed43eb1041"
    assert h(b"", [1, 2, 3], None) != h(b"", [1, 2, 3], "")
    assert h(b"", [1, 2], None) != h(b"", [1, 2, 0], None)
    assert h(b"", [1, 2], None) != h(h(b"", [], None), [1, 2], None)


def test_request_block_hashes_form_a_chain():
    m, live = KVCacheManager(8, 4, prefix_cache="hash"), []
    a = req("a", list(range(10)), salt="s")
    admit(m, a, live)
    assert len(a.block_hashes) == 2
    assert a.block_hashes[0] == hash_block_tokens(b"", [0, 1, 2, 3], "s")
    assert a.block_hashes[1] == hash_block_tokens(a.block_hashes[0], [4, 5, 6, 7], "s")


def test_hash_collision_never_gives_a_wrong_hit(monkeypatch):
    # Every block at the same depth collides: the hash ignores the tokens.
    monkeypatch.setattr(prefix_cache_mod, "hash_block_tokens",
                        lambda parent, tokens, salt: hash_block_tokens(parent, [], salt))
    m, live = KVCacheManager(16, 4, prefix_cache="hash"), []
    a, b = req("a", list(range(12)) + [1]), req("b", list(range(100, 112)) + [1])
    admit(m, a, live)
    hit, n, _ = admit(m, b, live)
    assert b.block_hashes == a.block_hashes  # the patch really made them collide
    assert (hit, n) == ([], 0)
    assert hit_tokens(m, list(range(100, 112)) + [2]) == 0  # b could not register over a
    assert hit_tokens(m, list(range(12)) + [2]) == 12
    assert hit_tokens(m, list(range(4)) + list(range(104, 112)) + [2]) == 4


def test_hash_collision_cannot_splice_chains(monkeypatch):
    # The hash ignores the parent: a block's hash depends on its own tokens only.
    monkeypatch.setattr(prefix_cache_mod, "hash_block_tokens",
                        lambda parent, tokens, salt: hash_block_tokens(b"", tokens, salt))
    m, live = KVCacheManager(16, 4, prefix_cache="hash"), []
    x, y = [1, 2, 3, 4], [5, 6, 7, 8]
    a = req("a", x + y + [0])
    admit(m, a, live)
    b = req("b", [9, 9, 9, 9] + y + [0])  # same second block, other context
    hit, n, new_b = admit(m, b, live)
    assert n == 0
    hit, n = m.get_computed_blocks(req("q", [9, 9, 9, 9] + y + [1]))
    # y's cached block was computed after x, so it must not follow b's first block.
    assert (hit, n) == ([b.block_ids[0]], 4)
