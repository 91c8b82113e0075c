"""RadixPrefixCache: SGLang-style radix tree over block-aligned token sequences.

Each node's edge is a run of whole blocks: `keys[i]` is the token tuple of
`blocks[i]`; children are keyed by the tokens of their first block. One root
per cache_salt, so different salts never share anything.

Locking. A request holds a *prefix* of every node it touches (inserts create
nodes from one request's blocks, matches and forks hand out path prefixes,
splits and tail evictions keep prefixes), so within a node the used blocks
come first and the idle ones form a tail. A node is *active* when it has a used
block or an active child; only idle tails of nodes with no active child are
evictable, and `_evictable` tracks their total incrementally. A ref 0 -> 1
change walks up only until it reaches an already active ancestor.

Eviction takes idle blocks from the tail of the least recently accessed leaf
(heap keyed by last access, stale entries skipped), so a chain loses its tail
before its head; an emptied leaf is removed and its parent may become a leaf.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator

from kvserve.core.block_pool import BlockPool
from kvserve.core.prefix_cache import PrefixCache, block_tokens
from kvserve.request import Request


class _Node:
    __slots__ = ("parent", "keys", "blocks", "children", "num_used", "num_active_children",
                 "last_access", "alive")

    def __init__(self, parent: _Node | None, keys: list[tuple[int, ...]], blocks: list[int]) -> None:
        self.parent = parent
        self.keys = keys
        self.blocks = blocks
        self.children: dict[tuple[int, ...], _Node] = {}
        self.num_used = 0  # leading blocks with ref > 0
        self.num_active_children = 0
        self.last_access = 0
        self.alive = True

    @property
    def active(self) -> bool:
        return self.num_used > 0 or self.num_active_children > 0

    @property
    def evictable(self) -> int:
        """Idle tail blocks that repeated leaf evictions could free."""
        return 0 if self.num_active_children else len(self.blocks) - self.num_used


class RadixPrefixCache(PrefixCache):
    def __init__(self, block_size: int, pool: BlockPool) -> None:
        super().__init__(block_size, pool)
        self._roots: dict[str | None, _Node] = {}
        self._node_of: dict[int, _Node] = {}
        self._evictable = 0
        self._clock = 0
        self._heap: list[tuple[int, int, _Node]] = []
        self._seq = 0  # heap tie-breaker: nodes are not comparable
        # Registration serial of each cached block: block ids are reused after
        # eviction, so a cursor names (block, serial) to notice a stale block.
        self._serial: dict[int, int] = {}
        self._next_serial = 1
        # request_id -> (blocks walked, last walked cached block, its serial)
        self._cursor: dict[str, tuple[int, int, int]] = {}

    # ---- bookkeeping helpers ------------------------------------------------

    def _adjust(self, node: _Node, d_used: int) -> None:
        """Change node.num_used and propagate active/inactive flips upwards."""
        d_active = 0
        while node is not None:
            was_active = node.active
            self._evictable -= node.evictable
            node.num_used += d_used
            node.num_active_children += d_active
            self._evictable += node.evictable
            if node.active == was_active:
                return
            d_used, d_active = 0, (1 if node.active else -1)
            node = node.parent

    def _touch(self, node: _Node) -> None:
        node.last_access = self._clock
        self._maybe_push(node)

    def _maybe_push(self, node: _Node) -> None:
        """Offer a leaf with an idle tail to the eviction heap."""
        if node.parent is not None and not node.children and node.num_used < len(node.blocks):
            self._seq += 1
            heapq.heappush(self._heap, (node.last_access, self._seq, node))
            if len(self._heap) > 4 * len(self._node_of) + 64:
                self._rebuild_heap()

    def _rebuild_heap(self) -> None:
        """Drop stale entries, which pile up as leaves are touched repeatedly."""
        self._heap = []
        for node in self._nodes():
            if not node.children and node.num_used < len(node.blocks):
                self._seq += 1
                self._heap.append((node.last_access, self._seq, node))
        heapq.heapify(self._heap)

    def _split(self, node: _Node, k: int) -> _Node:
        """Cut `node` after its k-th block; returns the new upper node (k blocks)."""
        assert 0 < k < len(node.blocks)
        parent = node.parent
        assert parent is not None
        self._evictable -= node.evictable
        top = _Node(parent, node.keys[:k], node.blocks[:k])
        top.last_access = node.last_access
        parent.children[top.keys[0]] = top
        top.num_used = min(node.num_used, k)
        node.keys, node.blocks = node.keys[k:], node.blocks[k:]
        node.num_used = max(0, node.num_used - k)
        node.parent = top
        top.children[node.keys[0]] = node
        top.num_active_children = int(node.active)
        for b in top.blocks:
            self._node_of[b] = top
        self._evictable += node.evictable + top.evictable
        return top

    def _locate(self, block_id: int) -> tuple[_Node, int]:
        node = self._node_of[block_id]
        return node, node.blocks.index(block_id) + 1

    def _nodes(self) -> Iterator[_Node]:
        stack = [c for r in self._roots.values() for c in r.children.values()]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    # ---- PrefixCache ----------------------------------------------------------

    def match(self, request: Request, max_blocks: int) -> list[int]:
        node = self._roots.get(request.cache_salt)
        out: list[int] = []
        while node is not None and len(out) < max_blocks:
            child = node.children.get(block_tokens(request, len(out), self.block_size))
            if child is None:
                break
            k = 0
            while (k < len(child.blocks) and len(out) < max_blocks
                   and child.keys[k] == block_tokens(request, len(out), self.block_size)):
                out.append(child.blocks[k])
                k += 1
            if k < len(child.blocks):
                # Partial match: split so the matched path ends on a node boundary.
                self._split(child, k)
                break
            node = child
        return out

    def _resume(self, request: Request) -> tuple[int, _Node, int]:
        """Where this request's registration walk stopped: (position, node, offset)."""
        cursor = self._cursor.get(request.request_id)
        if cursor is not None and self._serial.get(cursor[1]) == cursor[2]:
            node, off = self._locate(cursor[1])
            return cursor[0], node, off
        # First walk, or the block we stopped at was evicted (it can only be a
        # duplicate's original, ours are referenced): walk again from the root;
        # our own blocks fill whatever is missing.
        root = self._roots.setdefault(request.cache_salt, _Node(None, [], []))
        return 0, root, 0

    def insert(self, request: Request, num_full_blocks: int) -> None:
        done = self._cursor.get(request.request_id, (0, None))[0]
        if num_full_blocks <= done:
            return
        bs = self.block_size
        self._clock += 1
        pos, node, off = self._resume(request)
        while pos < num_full_blocks:
            key = block_tokens(request, pos, bs)
            if off < len(node.blocks):
                if node.keys[off] == key:  # ours already, or a duplicate: first copy wins
                    pos, off = pos + 1, off + 1
                    continue
                node = self._split(node, off)
            child = node.children.get(key)
            if child is not None:
                self._touch(node)
                node, off, pos = child, 1, pos + 1
                continue
            self._touch(node)
            node, off = self._add_blocks(node, request, pos, num_full_blocks)
            pos = num_full_blocks
        self._touch(node)
        last = node.blocks[off - 1]
        self._cursor[request.request_id] = (pos, last, self._serial[last])

    def _add_blocks(self, node: _Node, request: Request, start: int, end: int) -> tuple[_Node, int]:
        """Cache request.block_ids[start:end] below `node`, whose last block is position start-1."""
        blocks = request.block_ids[start:end]
        keys = [block_tokens(request, i, self.block_size) for i in range(start, end)]
        for b in blocks:
            assert b not in self._node_of, f"block {b} cached at two positions"
            assert self.pool.ref_cnt[b] > 0, f"registering unreferenced block {b}"
        if (node.parent is not None and not node.children
                and request.block_ids[start - 1] == node.blocks[-1]):
            # Extend our own leaf in place (decode grows one block at a time). We
            # hold its last block, hence all of it, so used blocks stay a prefix.
            node.keys.extend(keys)
            node.blocks.extend(blocks)
            target = node
        else:
            target = _Node(node, keys, blocks)
            node.children[keys[0]] = target
        for b in blocks:
            self._node_of[b] = target
            self._serial[b] = self._next_serial
            self._next_serial += 1
        # Counted idle first, then marked used, so _adjust sees a consistent tree.
        self._evictable += len(blocks)
        self._adjust(target, len(blocks))
        target.last_access = self._clock
        return target, len(target.blocks)

    def acquire(self, block_ids: list[int]) -> None:
        self._clock += 1
        for b in block_ids:
            node = self._node_of[b]
            self._adjust(node, +1)
            node.last_access = self._clock

    def release(self, block_ids: list[int]) -> list[int]:
        self._clock += 1
        uncached = []
        touched: dict[int, _Node] = {}
        for b in block_ids:
            node = self._node_of.get(b)
            if node is None:
                uncached.append(b)
                continue
            self._adjust(node, -1)
            touched[id(node)] = node
        for node in touched.values():
            self._touch(node)
        return uncached

    def evict(self, num_blocks: int) -> list[int]:
        assert num_blocks <= self._evictable, f"evicting {num_blocks} of {self._evictable} evictable"
        out: list[int] = []
        while len(out) < num_blocks:
            last_access, _, node = heapq.heappop(self._heap)
            if (not node.alive or node.children or node.last_access != last_access
                    or node.num_used == len(node.blocks)):
                continue  # stale entry
            key = node.keys[0]
            while len(out) < num_blocks and node.num_used < len(node.blocks):
                b = node.blocks.pop()
                node.keys.pop()
                del self._node_of[b]
                del self._serial[b]
                self._evictable -= 1
                out.append(b)
            if node.blocks:
                self._maybe_push(node)
            else:
                self._remove_leaf(node, key)
        return out

    def _remove_leaf(self, node: _Node, key: tuple[int, ...]) -> None:
        parent = node.parent
        assert parent is not None and not node.active and parent.children[key] is node
        node.alive = False
        del parent.children[key]
        if parent.parent is None and not parent.children:
            self._roots = {s: r for s, r in self._roots.items() if r is not parent}
        else:
            self._maybe_push(parent)

    def forget(self, request: Request) -> None:
        self._cursor.pop(request.request_id, None)

    def reset(self) -> list[int]:
        assert self._evictable == len(self._node_of), "reset while cached blocks are in use"
        out = list(self._node_of)
        for node in self._nodes():
            node.alive = False
        self._roots.clear()
        self._node_of.clear()
        self._serial.clear()
        self._heap.clear()
        self._cursor.clear()
        self._evictable = 0
        return out

    @property
    def num_evictable(self) -> int:
        return self._evictable

    def is_cached(self, block_id: int) -> bool:
        return block_id in self._node_of

    def is_evictable(self, block_id: int) -> bool:
        node = self._node_of.get(block_id)
        return node is not None and self.pool.ref_cnt[block_id] == 0 and not node.num_active_children

    def cached_block_ids(self) -> set[int]:
        return set(self._node_of)

    def check_integrity(self) -> None:
        seen: set[int] = set()
        evictable = 0
        for salt, root in self._roots.items():
            assert root.parent is None and not root.blocks, f"root of salt {salt!r} holds blocks"
            for node in self._subtree(root):
                evictable += self._check_node(node, seen)
        assert seen == set(self._node_of) == set(self._serial), \
            "block -> node map disagrees with the tree"
        assert evictable == self._evictable, f"evictable counter {self._evictable} != {evictable}"
        live = {id(n) for n in self._nodes()}
        for _, _, node in self._heap:
            assert node.alive == (id(node) in live), "heap holds a dead node marked alive"
        for node in self._nodes():
            if not node.children and node.num_used < len(node.blocks):
                assert any(n is node and la == node.last_access for la, _, n in self._heap), \
                    "evictable leaf missing from the eviction heap"

    def _subtree(self, root: _Node) -> Iterator[_Node]:
        stack = list(root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def _check_node(self, node: _Node, seen: set[int]) -> int:
        bs = self.block_size
        assert node.alive and node.blocks, "dead or empty node in the tree"
        assert len(node.keys) == len(node.blocks), "keys and blocks differ in length"
        assert node.parent.children.get(node.keys[0]) is node, "node not under its first block's key"
        refs = [self.pool.ref_cnt[b] for b in node.blocks]
        used = sum(1 for r in refs if r > 0)
        assert used == node.num_used, f"node counts {node.num_used} used blocks, pool says {used}"
        assert all(r > 0 for r in refs[:used]), f"used blocks are not a prefix of the node: {refs}"
        active = sum(1 for c in node.children.values() if c.active)
        assert active == node.num_active_children, "active-children counter is stale"
        for key, b in zip(node.keys, node.blocks):
            assert len(key) == bs, f"block {b} caches {len(key)} tokens"
            assert b not in seen, f"block {b} appears twice in the tree"
            assert self._node_of.get(b) is node, f"block {b} maps to the wrong node"
            assert not self.pool.is_free(b), f"cached block {b} is in the free queue"
            seen.add(b)
        for child in node.children.values():
            assert child.parent is node, "child's parent pointer is wrong"
        return node.evictable
