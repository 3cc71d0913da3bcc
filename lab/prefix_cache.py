"""A block-hash prefix cache with LRU eviction, counting hits the way vLLM does.

Tokens are grouped into full blocks; each block's hash chains its parent's, so a block is only found
when the whole prefix before it matches. As in vLLM, a sequence's blocks are touched tail first, so
eviction takes the ends of old conversations before their shared beginnings. Hits are whole blocks,
and the last prompt token is never a hit (the engine must compute at least one token to produce
logits), so a fully repeated prompt still reports fewer cached tokens than prompt tokens.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence

PACKED_WIDTH = array("q").itemsize


def block_hashes(tokens: Sequence[int], block_size: int) -> list[bytes]:
    """Chained hashes of every full block of `tokens`.

    The ids are packed as 64-bit integers in one go: the replica hashes every prompt twice (match, then
    insert) on its event loop, where a slow hash delays reading the other sessions' requests."""
    packed = array("q", tokens).tobytes()
    width = block_size * PACKED_WIDTH
    hashes: list[bytes] = []
    parent = b""
    for end in range(width, len(packed) + 1, width):
        parent = hashlib.blake2b(parent + packed[end - width : end], digest_size=16).digest()
        hashes.append(parent)
    return hashes


class PrefixCache:
    """Cached blocks of one replica, least recently used first."""

    def __init__(self, capacity_blocks: int, block_size: int = 16) -> None:
        if capacity_blocks < 1 or block_size < 1:
            raise ValueError("capacity_blocks and block_size must be positive")
        self.capacity_blocks = capacity_blocks
        self.block_size = block_size
        self._blocks: OrderedDict[bytes, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    @property
    def usage(self) -> float:
        """Fraction of the capacity holding cached blocks (0..1)."""
        return len(self._blocks) / self.capacity_blocks

    def match(self, prompt: Sequence[int]) -> int:
        """Number of prompt tokens served from the cache; touches the matched blocks."""
        matched = self._matched(prompt)
        self._touch(matched)
        return len(matched) * self.block_size

    def held(self, prompt: Sequence[int]) -> int:
        """Number of prompt tokens the cache would serve now, without touching anything: what a router
        with a perfect view of this replica would predict."""
        return len(self._matched(prompt)) * self.block_size

    def _matched(self, prompt: Sequence[int]) -> list[bytes]:
        max_hit_blocks = max(len(prompt) - 1, 0) // self.block_size
        matched: list[bytes] = []
        for block_hash in block_hashes(prompt[: max_hit_blocks * self.block_size], self.block_size):
            if block_hash not in self._blocks:
                break
            matched.append(block_hash)
        return matched

    def insert(self, tokens: Sequence[int]) -> None:
        """Cache every full block of `tokens`, evicting the least recently used beyond capacity."""
        self._touch(block_hashes(tokens, self.block_size))
        while len(self._blocks) > self.capacity_blocks:
            self._blocks.popitem(last=False)

    def _touch(self, chain: list[bytes]) -> None:
        for block_hash in reversed(chain):
            self._blocks[block_hash] = None
            self._blocks.move_to_end(block_hash)

    def clear(self) -> None:
        self._blocks.clear()
