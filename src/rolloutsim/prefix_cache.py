"""A per-engine prefix cache of token blocks, LRU-evicted (vLLM's block hashing; SGLang's radix tree).

Theory of operation: a sequence is cut into blocks of `block_tokens`; block i is identified by a hash
chained over blocks 0..i, so a block id stands for the whole prefix that ends with it. A new prompt is
served from cache for as many leading blocks as are present. Blocks are touched suffix first, so the LRU end
always holds a prefix's tail before its head and eviction never orphans a cached suffix. A trailing partial
block is not cached (vLLM does the same; SGLang's page size 1 would match it too).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

__all__ = ("PrefixCache", "block_hashes")


def block_hashes(token_ids: Sequence[int], block_tokens: int) -> list[int]:
    """Chained hashes of the full blocks of `token_ids`."""
    hashes = []
    previous = 0
    for start in range(0, len(token_ids) - block_tokens + 1, block_tokens):
        previous = hash((previous, tuple(token_ids[start : start + block_tokens])))
        hashes.append(previous)
    return hashes


class PrefixCache:
    __slots__ = ("_blocks", "block_tokens", "hits_tokens", "queries_tokens")

    def __init__(self, block_tokens: int) -> None:
        self.block_tokens = block_tokens
        self._blocks: OrderedDict[int, None] = OrderedDict()
        self.queries_tokens = 0  # prompt tokens looked up (vllm:prefix_cache_queries)
        self.hits_tokens = 0  # of which found (vllm:prefix_cache_hits)

    @property
    def size_tokens(self) -> int:
        return len(self._blocks) * self.block_tokens

    def match(self, hashes: Sequence[int], query_tokens: int) -> int:
        """How many leading tokens of the sequence with these block hashes are cached; touches them."""
        found = 0
        for block in hashes:
            if block not in self._blocks:
                break
            found += 1
        for block in reversed(hashes[:found]):
            self._blocks.move_to_end(block)
        cached = found * self.block_tokens
        self.queries_tokens += query_tokens
        self.hits_tokens += cached
        return cached

    def insert(self, hashes: Sequence[int]) -> None:
        for block in reversed(hashes):
            self._blocks[block] = None
            self._blocks.move_to_end(block)

    def evict_to(self, capacity_tokens: int) -> None:
        """Drop least recently used blocks until at most `capacity_tokens` remain."""
        keep = max(0, capacity_tokens) // self.block_tokens
        while len(self._blocks) > keep:
            self._blocks.popitem(last=False)

    def clear(self) -> None:
        self._blocks.clear()

    def __repr__(self) -> str:
        return f"<PrefixCache {self.size_tokens} tokens>"
