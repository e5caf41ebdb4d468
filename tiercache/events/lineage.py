"""What a block's ``BlockStored`` event said when it was computed, for the copies made of it later.

The engine hands tiercache a block's tokens and its parent once, when it stores
the block on the GPU. A demotion (GPU to CPU, CPU to a remote) or a promotion
moves the block by key alone, yet its ``BlockStored`` in the new tier should say
the same parent and tokens (routers that rebuild hashes from tokens need them).
This remembers them, per key, for a bounded number of recently stored blocks,
oldest forgotten first; it runs on the event sink's background thread only.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


class BlockLineage:
    """key -> (parent key, the block's token ids), for the ``capacity`` most recently computed blocks."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._blocks: OrderedDict[bytes, tuple[bytes | None, list[int]]] = OrderedDict()

    def remember(self, keys: Sequence[bytes], parent: bytes | None, tokens: list[int], block_size: int) -> None:
        """Record a chain of computed blocks (``tokens`` holds ``block_size`` per key; else nothing is kept)."""
        if not self.capacity or len(tokens) != len(keys) * block_size:
            return
        blocks = self._blocks
        previous = parent
        for index, key in enumerate(keys):
            blocks[key] = (previous, tokens[index * block_size : (index + 1) * block_size])
            blocks.move_to_end(key)
            previous = key
        while len(blocks) > self.capacity:
            blocks.popitem(last=False)

    def recall(self, keys: Sequence[bytes]) -> tuple[bytes | None, list[int]] | None:
        """The parent of ``keys[0]`` and the tokens of all of ``keys``; None unless every key is known."""
        tokens: list[int] = []
        parent = None
        for index, key in enumerate(keys):
            known = self._blocks.get(key)
            if known is None:
                return None
            if index == 0:
                parent = known[0]
            tokens.extend(known[1])
        return parent, tokens
