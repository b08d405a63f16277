"""The prefix cache: KV pages of requests that have left the pool, kept for later requests that
begin with the same tokens (SGLang's RadixCache, at page granularity).

A request that finishes, is aborted or is retracted leaves the whole pages of its written tokens
here instead of freeing them. A later request whose tokens begin with a cached path reads those
pages and prefills only what follows: the next turn of an agent's conversation (the previous
turn's prompt and answer are its prefix), an answer resumed after a pause or a retraction, a
prompt sent again. The cache holds one reference on each of its pages (``PageAllocator``), so a
page a running request also reads is never freed under it.

The tree's edges are pages of tokens: the node at depth ``d`` holds the page of tokens
``(d - 1) * page_size .. d * page_size - 1`` of every sequence whose first ``d`` pages of tokens
spell its path. Keys and values depend only on the tokens up to them (and the weights), so two
requests that agree on a path agree on its pages. The cache never holds a partial page.

Pages are evicted least recently used first, leaves before their parents, and only pages nobody
else holds: ``evict`` runs when an allocation finds the pool short, so cached pages cost no
capacity. The weights the keys and values were computed with are not recorded: the scheduler
clears the cache whenever the engine's weights change.

Pure Python over ``inference.pages``, no JAX.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from areal_jax.inference.pages import PageAllocator


@dataclass(eq=False)
class _Node:
    key: tuple[int, ...]
    page: int
    parent: _Node | None
    children: dict[tuple[int, ...], _Node] = field(default_factory=dict)
    used: int = 0
    """When a request last matched or inserted this node (the cache's clock)."""


class PrefixCache:
    """Whole KV pages by the tokens they hold (see the module docstring)."""

    def __init__(self, allocator: PageAllocator) -> None:
        self.allocator = allocator
        self._root = _Node((), -1, None)
        self._leaves: set[_Node] = set()
        self._clock = itertools.count(1)
        self.pages = 0
        """Pages the cache holds."""
        self.stats = {"matched_tokens": 0, "inserted_pages": 0, "evicted_pages": 0, "cleared_pages": 0}

    @property
    def tokens(self) -> int:
        return self.pages * self.allocator.page_size

    def match(self, tokens: Sequence[int], max_pages: int) -> list[int]:
        """The pages of the longest cached path that ``tokens`` begin with, at most ``max_pages``
        of them; each node on it counts as just used. The caller retains the pages it keeps."""
        size, node, out = self.allocator.page_size, self._root, []
        now = next(self._clock)
        while len(out) < max_pages:
            child = node.children.get(tuple(tokens[len(out) * size:(len(out) + 1) * size]))
            if child is None:
                break
            child.used = now
            out.append(child.page)
            node = child
        self.stats["matched_tokens"] += len(out) * size
        return out

    def insert(self, tokens: Sequence[int], pages: Sequence[int]) -> int:
        """Cache ``pages``, which hold the first ``len(pages)`` whole pages of ``tokens`` (written).
        Where the cache has a path's page already, that page stays and the given one is not
        taken (its holder frees it); each new page is retained once. Returns the pages added."""
        size, node, added = self.allocator.page_size, self._root, 0
        now = next(self._clock)
        if len(tokens) < len(pages) * size:
            raise ValueError(f"{len(pages)} pages of {size} tokens need at least {len(pages) * size} tokens, "
                             f"got {len(tokens)}")
        for i, page in enumerate(pages):
            key = tuple(tokens[i * size:(i + 1) * size])
            child = node.children.get(key)
            if child is None:
                self.allocator.retain([page])
                child = _Node(key, page, node)
                node.children[key] = child
                self._leaves.discard(node)
                self._leaves.add(child)
                self.pages += 1
                added += 1
            child.used = now
            node = child
        self.stats["inserted_pages"] += added
        return added

    def evict(self, n: int) -> int:
        """Free up to ``n`` pages: the least recently used leaves that only the cache holds, a
        parent once its last child is gone. Returns the pages freed."""
        if n <= 0 or not self._leaves:
            return 0
        heap = [(leaf.used, id(leaf), leaf) for leaf in self._leaves if self.allocator.refcount(leaf.page) == 1]
        heapq.heapify(heap)
        freed = 0
        while heap and freed < n:
            _, _, node = heapq.heappop(heap)
            self._remove(node)
            freed += 1
            parent = node.parent
            if parent is not self._root and not parent.children and self.allocator.refcount(parent.page) == 1:
                heapq.heappush(heap, (parent.used, id(parent), parent))
        self.stats["evicted_pages"] += freed
        return freed

    def clear(self) -> int:
        """Drop every page (the weights changed, or the pool was reset). Returns the pages dropped."""
        pages = [node.page for node in self._nodes()]
        self.allocator.release(pages)
        dropped = len(pages)
        self._root.children.clear()
        self._leaves.clear()
        self.pages = 0
        self.stats["cleared_pages"] += dropped
        return dropped

    def held(self) -> set[int]:
        """The pages the cache holds."""
        return {node.page for node in self._nodes()}

    def check(self) -> None:
        """Raise if the tree, its leaf set, its page count and the pool's reference counts
        disagree (a test and debugging aid)."""
        nodes = list(self._nodes())
        if len(nodes) != self.pages or len({n.page for n in nodes}) != self.pages:
            raise AssertionError(f"{len(nodes)} nodes on {len({n.page for n in nodes})} pages, counted {self.pages}")
        if {n for n in nodes if not n.children} != self._leaves:
            raise AssertionError("the leaf set is not the nodes without children")
        if any(self.allocator.refcount(n.page) < 1 for n in nodes):
            raise AssertionError("the cache names a page nobody holds")

    def _nodes(self) -> Iterator[_Node]:
        """Every node but the root."""
        stack = list(self._root.children.values())
        while stack:
            node = stack.pop()
            stack += node.children.values()
            yield node

    def _remove(self, node: _Node) -> None:
        del node.parent.children[node.key]
        self._leaves.discard(node)
        if node.parent is not self._root and not node.parent.children:
            self._leaves.add(node.parent)
        self.allocator.release([node.page])
        self.pages -= 1
