"""The `approx` policy: cache-aware routing for replicas that publish no KV events.

Any OpenAI server can sit behind it. As SGLang's router does, the router remembers the text
it sent to each replica in a character-level radix tree per replica, and assumes a replica
still caches what it was sent recently: each tree is capped in characters and forgets its
least recently used leaves first, roughly as the replica's own cache would. A prompt goes to
the replica whose tree shares the longest prefix with it when that prefix is a large enough
share of the prompt; a new prefix goes to the replica with the smallest tree, which spreads
distinct prefixes (and so the fleet's cache capacity) over the replicas. Loads too far apart
override both (the same balance rule as kv_aware).
"""

from __future__ import annotations

import heapq
import itertools
import random

from kvserve.router.kv_aware import BALANCE_REL_THRESHOLD, is_imbalanced, pick_min
from kvserve.router.policy import Decision, Policy, ReplicaView, RouteRequest, register

# ~250k tokens of text at ~4 characters a token: about what a replica's KV pool of a few GiB
# holds for a small model. A tree much larger than the replica's cache routes prompts to
# prefixes the replica evicted long ago.
MAX_TREE_CHARS = 1 << 20
CACHE_THRESHOLD = 0.5  # SGLang's default cache_threshold
# approx sends a hit to its replica whatever that replica's load, until the loads are this far
# apart (in tokens left to prefill), so it must balance sooner than kv_aware, whose cost weighs
# load on every request: at kv_aware's 4096 the router benchmark piled tenants on one replica
# (43% cached, 18 s median TTFT); at 512, a third of a typical prompt there, 63%.
BALANCE_ABS_THRESHOLD = 512


class _Node:
    __slots__ = ("children", "label", "last_access", "parent")

    def __init__(self, label: str, parent: _Node | None, last_access: int) -> None:
        self.label = label  # the edge from the parent (empty only at the root)
        self.children: dict[str, _Node] = {}  # first character of the child's label -> child
        self.parent = parent  # None: the root, or a node that left the tree
        self.last_access = last_access


def _common_len(label: str, text: str, pos: int) -> int:
    """Length of the common prefix of label and text[pos:] (C-speed when the edge matches whole)."""
    if text.startswith(label, pos):
        return len(label)
    n, k = min(len(label), len(text) - pos), 0
    while k < n and label[k] == text[pos + k]:
        k += 1
    return k


class TextRadixTree:
    """A compressed trie of texts, capped at `max_chars` characters of edge labels.

    Contract: `match` is read-only and returns how many leading characters of a text the
    tree holds; `insert` adds a text (its first `max_chars` characters), marks its whole
    path used now, then evicts least recently used leaves until the cap holds again.
    Both walk the text once: O(len(text)), plus O(log n) per evicted leaf. Every non-root
    node has no child or at least two (a chain is merged back into one edge), and a node
    is never used less recently than its children, so evicting leaves evicts LRU first.
    """

    def __init__(self, max_chars: int = MAX_TREE_CHARS) -> None:
        if max_chars <= 0:
            raise ValueError(f"max_chars must be positive, got {max_chars}")
        self.max_chars = max_chars
        self.root = _Node("", None, 0)
        self.size = 0  # characters held (sum of edge labels)
        self.num_nodes = 0  # besides the root
        self._clock = itertools.count(1)  # logical time: one tick per insert
        self._seq = itertools.count()  # heap tie-break, so nodes are never compared
        # (last_access, seq, leaf); entries go stale when a leaf is touched again, gets a child
        # or leaves the tree, and are skipped when popped.
        self._heap: list[tuple[int, int, _Node]] = []

    def match(self, text: str) -> int:
        node, pos = self.root, 0
        while pos < len(text):
            child = node.children.get(text[pos])
            if child is None:
                break
            k = _common_len(child.label, text, pos)
            pos += k
            if k < len(child.label):
                break
            node = child
        return pos

    def insert(self, text: str) -> None:
        text = text[:self.max_chars]  # a longer text would evict itself
        if not text:
            return
        now = next(self._clock)
        node, pos = self.root, 0
        node.last_access = now
        while pos < len(text):
            child = node.children.get(text[pos])
            if child is None:
                if node is not self.root and not node.children:
                    # The text runs on past a leaf: lengthen its edge (a leaf with one child
                    # would be a chain, and texts need no end marks to be matched).
                    node.label += text[pos:]
                    self.size += len(text) - pos
                else:
                    node = self._add_leaf(node, text[pos:], now)
                break
            k = _common_len(child.label, text, pos)
            if k < len(child.label) and pos + k < len(text):
                node = self._add_leaf(self._split(child, k, now), text[pos + k:], now)
                break
            child.last_access = now  # whole edge, or the text ends inside it: held either way
            node, pos = child, pos + k
        if not node.children:
            self._push(node)
        self._evict()

    def _add_leaf(self, parent: _Node, label: str, now: int) -> _Node:
        leaf = _Node(label, parent, now)
        parent.children[label[0]] = leaf
        self.size += len(label)
        self.num_nodes += 1
        return leaf

    def _split(self, child: _Node, k: int, now: int) -> _Node:
        """Cut child's edge after k characters; the new middle node is returned, used now."""
        parent = child.parent
        assert parent is not None
        mid = _Node(child.label[:k], parent, now)
        parent.children[mid.label[0]] = mid
        child.label, child.parent = child.label[k:], mid
        mid.children[child.label[0]] = child
        self.num_nodes += 1
        return mid

    def _push(self, leaf: _Node) -> None:
        heapq.heappush(self._heap, (leaf.last_access, next(self._seq), leaf))
        if len(self._heap) > 2 * self.num_nodes + 64:  # mostly stale: rebuild from the live leaves
            self._heap = [(n.last_access, next(self._seq), n) for n in self._nodes() if not n.children]
            heapq.heapify(self._heap)

    def _evict(self) -> None:
        while self.size > self.max_chars and self._heap:
            ts, _, leaf = heapq.heappop(self._heap)
            parent = leaf.parent
            if parent is None or leaf.children or leaf.last_access != ts:
                continue  # stale entry
            del parent.children[leaf.label[0]]
            leaf.parent = None
            self.size -= len(leaf.label)
            self.num_nodes -= 1
            if parent is not self.root and len(parent.children) == 1:
                self._merge(parent)

    def _merge(self, node: _Node) -> None:
        """node lost all children but one: absorb it, so every inner node still branches."""
        (child,) = node.children.values()
        node.label += child.label
        node.children = child.children
        for gc in node.children.values():
            gc.parent = node
        node.last_access = child.last_access  # the text below is only as recent as its child's
        child.parent = None
        self.num_nodes -= 1
        if not node.children:
            self._push(node)

    def _nodes(self) -> list[_Node]:
        out, stack = [], list(self.root.children.values())
        while stack:
            n = stack.pop()
            out.append(n)
            stack.extend(n.children.values())
        return out

    def check_integrity(self) -> None:
        """Raise AssertionError on any internal inconsistency."""
        assert self.root.parent is None and self.root.label == "", "the root changed"
        nodes = self._nodes()
        assert len(nodes) == self.num_nodes, f"{len(nodes)} nodes, counted {self.num_nodes}"
        assert sum(len(n.label) for n in nodes) == self.size, "size is not the sum of the labels"
        assert self.size <= self.max_chars, f"{self.size} characters over the cap of {self.max_chars}"
        for n in [self.root, *nodes]:
            for key, c in n.children.items():
                assert c.label and c.label[0] == key, f"child {c.label!r} filed under {key!r}"
                assert c.parent is n, f"node {c.label!r} does not point at its parent"
                assert c.last_access <= n.last_access, f"node {c.label!r} used after its parent"
            if n is not self.root:
                assert len(n.children) != 1, f"node {n.label!r} has a single child (not merged)"
        live = {id(leaf) for ts, _, leaf in self._heap if leaf.parent is not None and leaf.last_access == ts}
        for n in nodes:
            if not n.children:
                assert id(n) in live, f"leaf {n.label!r} cannot be evicted (no heap entry)"


@register
class ApproxPolicy(Policy):
    """Prefix-aware routing from the text sent to each replica (see the module docstring).

    Reasons: "balance" (loads too far apart: least load), "cache_hit" (the longest match
    covers at least cache_threshold of the prompt), "no_hit" (smallest tree)."""

    name = "approx"

    def __init__(self, seed: int | None = None, cache_threshold: float = CACHE_THRESHOLD,
                 balance_abs_threshold: float = BALANCE_ABS_THRESHOLD,
                 balance_rel_threshold: float = BALANCE_REL_THRESHOLD, max_tree_chars: int = MAX_TREE_CHARS) -> None:
        if not 0.0 <= cache_threshold <= 1.0:
            raise ValueError(f"approx: cache_threshold must be within [0, 1], got {cache_threshold}")
        if balance_abs_threshold < 0 or balance_rel_threshold < 1:
            raise ValueError("approx: balance_abs_threshold must be >= 0 and balance_rel_threshold >= 1")
        if max_tree_chars <= 0:
            raise ValueError(f"approx: max_tree_chars must be positive, got {max_tree_chars}")
        self.rng = random.Random(seed)
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.max_tree_chars = max_tree_chars
        self.trees: dict[str, TextRadixTree] = {}  # replica url -> the text routed there

    def choose(self, req: RouteRequest, replicas: list[ReplicaView]) -> Decision:
        if is_imbalanced(replicas, self.balance_abs_threshold, self.balance_rel_threshold):
            return Decision(replicas[pick_min(replicas, [r.load for r in replicas], self.rng)], "balance")
        text = req.text
        matched = [self.trees[r.url].match(text) if r.url in self.trees else 0 for r in replicas]
        best = max(matched)
        if best > 0 and best >= self.cache_threshold * len(text):
            i = pick_min(replicas, [-m for m in matched], self.rng)
            # The decision reports tokens; the tree counts characters: scale by the prompt's ratio.
            cached = req.num_prompt_tokens * best // len(text)
            return Decision(replicas[i], "cache_hit", cached, extra={"matched_chars": best})
        sizes = [self.trees[r.url].size if r.url in self.trees else 0 for r in replicas]
        return Decision(replicas[pick_min(replicas, sizes, self.rng)], "no_hit")

    def on_routed(self, req: RouteRequest, decision: Decision) -> None:
        url = decision.replica.url
        if url not in self.trees:
            self.trees[url] = TextRadixTree(self.max_tree_chars)
        self.trees[url].insert(req.text)

    def on_replica_removed(self, url: str) -> None:
        self.trees.pop(url, None)
