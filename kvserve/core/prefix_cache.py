"""Prefix caching: the `PrefixCache` contract and its hash-chain implementation.

Division of labour (see block_pool.py for the block states):
  * the KV manager owns reference counts (in the `BlockPool`) and tells the
    cache when a cached block becomes used (`acquire`) or unused (`release`);
  * the cache owns the set of cached blocks, finds prefixes in it, and decides
    which idle block to evict first.

Blocks are registered as soon as they are allocated for tokens that are already
known (as vLLM v1 does), before their K/V are written: a request that hits them
in the same step reads them in the same forward pass, after they are written.
"""

from __future__ import annotations

import hashlib
import struct
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvserve.core.block_pool import BlockPool
from kvserve.core.kv_connector import DEVICE_TIER, EvictedBlock
from kvserve.request import Request

if TYPE_CHECKING:  # the sink's module brings zmq; the bookkeeping only calls its methods
    from kvserve.core.kv_events import KVEventSink

_HASH_DOMAIN = b"kvserve.block.v1"


def hash_block_tokens(parent_hash: bytes, token_ids: Sequence[int], cache_salt: str | None) -> bytes:
    """Content hash of one full block, chained on its parent's hash.

    sha256 over a fixed byte encoding (length-prefixed fields, little-endian
    int64 tokens) so the value is identical across processes and machines:
    the KV tiers and other replicas key on it, so Python's salted hash() is out.
    """
    h = hashlib.sha256(_HASH_DOMAIN)
    h.update(struct.pack("<I", len(parent_hash)))
    h.update(parent_hash)
    if cache_salt is None:
        h.update(b"\x00")
    else:
        salt = cache_salt.encode("utf-8")
        h.update(b"\x01" + struct.pack("<I", len(salt)) + salt)
    h.update(struct.pack(f"<I{len(token_ids)}q", len(token_ids), *token_ids))
    return h.digest()


def block_tokens(request: Request, index: int, block_size: int) -> tuple[int, ...]:
    """Token ids of the request's `index`-th block (the caller ensures it is full)."""
    return tuple(request.all_token_ids[index * block_size:(index + 1) * block_size])


def max_cached_blocks(request: Request, block_size: int) -> int:
    """Full blocks of the request a cache may supply: never the whole sequence, since the
    last token must run to produce logits."""
    return max(0, (request.num_tokens - 1) // block_size)


def compute_block_hashes(request: Request, num_blocks: int, block_size: int) -> list[bytes]:
    """Extend request.block_hashes to cover its first `num_blocks` full blocks.

    Incremental because full blocks never change (tokens are append-only), so a
    decoding request hashes each block once.
    """
    hashes = request.block_hashes
    assert num_blocks * block_size <= request.num_tokens, "hashing a block that is not full"
    for i in range(len(hashes), num_blocks):
        parent = hashes[i - 1] if i > 0 else b""
        hashes.append(hash_block_tokens(parent, block_tokens(request, i, block_size), request.block_salt(i)))
    return hashes


class PrefixCache(ABC):
    """Maps block-aligned token prefixes (per cache_salt) to cached KV blocks.

    Contract shared by every implementation:
      * Only full blocks are cached. A hit is verified against the token ids
        (and salt) of every block on the path, never trusted from a key alone.
      * A cached block is either *used* (ref > 0 in the pool: never evicted) or
        *idle* (ref 0: stays matchable until `evict` takes it).
      * No method changes a reference count; the KV manager does that and calls
        `acquire` / `release` on the 0 <-> 1 transitions of cached blocks.
      * If a block's content is already cached under another block id (two
        requests computed the same tokens at once) the first copy wins; the
        duplicate stays uncached and goes back to the free pool when released.
    """

    def __init__(self, block_size: int, pool: BlockPool) -> None:
        self.block_size = block_size
        self.pool = pool
        # Told about every block `evict` drops (the KV tiers offload it), if the
        # implementation can name its content by chain hash (see supports_tiers).
        self.evict_listener: Callable[[EvictedBlock], None] | None = None
        # Told about every block registered or dropped (KV events for routers), likewise.
        self.events: KVEventSink | None = None

    supports_tiers = False  # names blocks by chain hash: KV tiers and KV events need it

    @abstractmethod
    def match(self, request: Request, max_blocks: int) -> list[int]:
        """Block ids of the longest cached prefix of request.all_token_ids under
        request.cache_salt, at most `max_blocks` blocks. Takes no references: the
        ids stay valid only until the next `evict` / `reset`."""

    @abstractmethod
    def insert(self, request: Request, num_full_blocks: int) -> None:
        """Register request.block_ids[:num_full_blocks] (all full, tokens known).
        The request holds a reference to each of them. Positions already cached
        (by this request, a fork sibling or a duplicate) are skipped. Cheap to call
        repeatedly with a growing count: progress is remembered per request."""

    @abstractmethod
    def acquire(self, block_ids: list[int]) -> None:
        """Cached blocks whose ref count just went 0 -> 1: take them out of the
        evictable set (for a tree: lock their path)."""

    @abstractmethod
    def release(self, block_ids: list[int]) -> list[int]:
        """Blocks whose ref count just dropped to 0, tail of each chain first.
        Cached ones become idle (still matchable; released earlier = evicted
        earlier). Returns the uncached ones, which the caller puts in the free pool."""

    @abstractmethod
    def evict(self, num_blocks: int) -> list[int]:
        """Uncache exactly `num_blocks` idle blocks, least recently used first and
        a chain's tail before its head; returns their ids (ref 0, now uncached)
        for the free pool. The caller checks `num_evictable` first."""

    @abstractmethod
    def forget(self, request: Request) -> None:
        """Drop per-request registration state (the request freed its blocks)."""

    @abstractmethod
    def reset(self) -> list[int]:
        """Uncache everything; only legal while no block is used. Returns the ids."""

    @property
    @abstractmethod
    def num_evictable(self) -> int:
        """Idle blocks that `evict` can free right now."""

    @abstractmethod
    def is_cached(self, block_id: int) -> bool: ...

    @abstractmethod
    def is_evictable(self, block_id: int) -> bool: ...

    @abstractmethod
    def cached_block_ids(self) -> set[int]: ...

    @abstractmethod
    def check_integrity(self) -> None:
        """Raise AssertionError on any internal inconsistency."""


@dataclass(slots=True)
class _Entry:
    block_id: int
    hash: bytes
    parent_hash: bytes
    # Identity of the parent *registration*, not just its hash: a chain is only
    # followed through entries that were registered on top of each other, so a
    # hash collision (or a re-registered parent) can never splice two chains.
    parent_uid: int
    uid: int
    tokens: tuple[int, ...]
    salt: str | None


_ROOT_UID = 0


class HashPrefixCache(PrefixCache):
    """vLLM-style hash chain: hash(parent hash, block tokens, salt) -> block.

    Idle blocks live in an OrderedDict used as an O(1) LRU queue: `release`
    appends (so a request freed tail-first puts its tail nearer the front) and
    `evict` pops from the front. Evicting a head whose tail is still cached
    leaves the tail unreachable until it is evicted too, which is harmless.
    """

    supports_tiers = True

    def __init__(self, block_size: int, pool: BlockPool) -> None:
        super().__init__(block_size, pool)
        self._by_hash: dict[bytes, _Entry] = {}
        self._by_block: dict[int, _Entry] = {}
        self._by_uid: dict[int, _Entry] = {}
        self._idle: OrderedDict[int, None] = OrderedDict()
        self._next_uid = _ROOT_UID + 1
        # request_id -> (blocks already walked, uid of the last one; None = chain broken)
        self._cursor: dict[str, tuple[int, int | None]] = {}

    def _lookup(self, h: bytes, parent_uid: int, tokens: tuple[int, ...],
                salt: str | None) -> _Entry | None:
        """The entry for this exact content after `parent_uid`, or None."""
        e = self._by_hash.get(h)
        if e is None or e.parent_uid != parent_uid or e.tokens != tokens or e.salt != salt:
            return None
        return e

    def match(self, request: Request, max_blocks: int) -> list[int]:
        bs = self.block_size
        hashes = compute_block_hashes(request, max_blocks, bs)
        out: list[int] = []
        parent_uid = _ROOT_UID
        for i in range(max_blocks):
            e = self._lookup(hashes[i], parent_uid, block_tokens(request, i, bs), request.block_salt(i))
            if e is None:
                break
            out.append(e.block_id)
            parent_uid = e.uid
        return out

    def insert(self, request: Request, num_full_blocks: int) -> None:
        done, parent_uid = self._cursor.get(request.request_id, (0, _ROOT_UID))
        if parent_uid is None or num_full_blocks <= done:
            return
        if parent_uid != _ROOT_UID and parent_uid not in self._by_uid:
            # We stopped at a duplicate's original and it has been evicted since:
            # walk again from the start; our own blocks fill the gap it left.
            done, parent_uid = 0, _ROOT_UID
        bs = self.block_size
        hashes = compute_block_hashes(request, num_full_blocks, bs)
        for i in range(done, num_full_blocks):
            h, tokens, salt = hashes[i], block_tokens(request, i, bs), request.block_salt(i)
            existing = self._by_hash.get(h)
            if existing is not None:
                if self._lookup(h, parent_uid, tokens, salt) is None:
                    # Same hash, other content or parent: a collision, or our parent
                    # was evicted and re-registered. Stop rather than splice chains.
                    self._cursor[request.request_id] = (num_full_blocks, None)
                    return
                parent_uid = existing.uid  # ours already, or a duplicate: first copy wins
                continue
            block_id = request.block_ids[i]
            assert block_id not in self._by_block, f"block {block_id} cached at two positions"
            assert self.pool.ref_cnt[block_id] > 0, f"registering unreferenced block {block_id}"
            parent_hash = hashes[i - 1] if i else b""
            e = _Entry(block_id, h, parent_hash, parent_uid, self._next_uid, tokens, salt)
            self._next_uid += 1
            self._by_hash[h] = e
            self._by_block[block_id] = e
            self._by_uid[e.uid] = e
            parent_uid = e.uid
            if self.events is not None:
                self.events.stored(h, parent_hash, DEVICE_TIER)
        self._cursor[request.request_id] = (num_full_blocks, parent_uid)

    def acquire(self, block_ids: list[int]) -> None:
        for b in block_ids:
            self._idle.pop(b, None)

    def release(self, block_ids: list[int]) -> list[int]:
        uncached = []
        for b in block_ids:
            if b in self._by_block:
                self._idle[b] = None
            else:
                uncached.append(b)
        return uncached

    def evict(self, num_blocks: int) -> list[int]:
        assert num_blocks <= len(self._idle), f"evicting {num_blocks} of {len(self._idle)} idle blocks"
        out = []
        for _ in range(num_blocks):
            b, _ = self._idle.popitem(last=False)
            e = self._by_block.pop(b)
            del self._by_hash[e.hash]
            del self._by_uid[e.uid]
            out.append(b)
            if self.events is not None:
                self.events.removed(e.hash, DEVICE_TIER)
            if self.evict_listener is not None:
                self.evict_listener(EvictedBlock(b, e.hash, e.parent_hash, e.tokens))
        return out

    def forget(self, request: Request) -> None:
        self._cursor.pop(request.request_id, None)

    def reset(self) -> list[int]:
        assert len(self._idle) == len(self._by_block), "reset while cached blocks are in use"
        out = list(self._by_block)
        self._by_hash.clear()
        self._by_block.clear()
        self._by_uid.clear()
        self._idle.clear()
        self._cursor.clear()
        if self.events is not None:
            self.events.cleared(DEVICE_TIER)
        return out

    @property
    def num_evictable(self) -> int:
        return len(self._idle)

    def is_cached(self, block_id: int) -> bool:
        return block_id in self._by_block

    def is_evictable(self, block_id: int) -> bool:
        return block_id in self._idle

    def cached_block_ids(self) -> set[int]:
        return set(self._by_block)

    def cached_blocks(self) -> list[EvictedBlock]:
        """Every cached block with its content identity (for saving them to a KV tier)."""
        return [EvictedBlock(b, e.hash, e.parent_hash, e.tokens) for b, e in self._by_block.items()]

    def check_integrity(self) -> None:
        assert len(self._by_hash) == len(self._by_block) == len(self._by_uid), \
            "hash, block and uid maps differ in size"
        uids = set()
        for b, e in self._by_block.items():
            assert e.block_id == b, f"entry of block {b} names block {e.block_id}"
            assert self._by_hash.get(e.hash) is e, f"block {b} not reachable by its hash"
            assert len(e.tokens) == self.block_size, f"block {b} caches {len(e.tokens)} tokens"
            assert e.hash == hash_block_tokens(e.parent_hash, e.tokens, e.salt), \
                f"block {b}: stored hash does not match its content"
            assert e.parent_uid < e.uid, f"block {b}: parent registered after child"
            assert e.uid not in uids, f"uid {e.uid} used twice"
            assert self._by_uid.get(e.uid) is e, f"block {b} not reachable by its uid"
            uids.add(e.uid)
            idle = self.pool.ref_cnt[b] == 0
            assert idle == (b in self._idle), \
                f"block {b}: ref {self.pool.ref_cnt[b]} but idle={not idle}"
            assert not self.pool.is_free(b), f"cached block {b} is in the free queue"
        assert set(self._idle) <= set(self._by_block), "an idle block is not cached"
