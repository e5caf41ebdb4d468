"""What a block's ``BlockStored`` event said when it was computed, for the copies made of it later.

The engine hands tiercache a block's tokens and its parent once, when it stores
the block on the GPU. A demotion (GPU to CPU, CPU to a remote) or a promotion
moves the block by key alone, yet its ``BlockStored`` in the new tier should say
the same parent and tokens (routers that rebuild hashes from tokens need them).
This remembers them, per key, for a bounded number of recently stored blocks,
oldest forgotten first; it runs on the event sink's background thread only.

A copy moved by key hands its blocks over in whatever order the move made
(a demotion: tail first, several chains mixed); ``chains`` puts them back into
chains, head first, each with the parent of its first block, as a ``BlockStored``
describes one.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Chain:
    """Consecutive blocks of one chain, head first: what one ``BlockStored`` says."""

    keys: list[bytes]
    parent: bytes | None
    tokens: list[int]


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

    def chains(self, keys: Sequence[bytes]) -> tuple[list[Chain], list[bytes]]:
        """``keys`` (any order) as chains of known blocks, head first, and the keys not known.

        A chain runs from a block whose parent is not among ``keys`` through its
        children; where two children share a parent, the first given continues the
        chain and the other starts a chain of its own after that parent.
        """
        blocks = self._blocks
        given = list(dict.fromkeys(keys))
        known = [key for key in given if key in blocks]
        present = set(known)
        children: dict[bytes, list[bytes]] = {}
        heads: deque[bytes] = deque()
        for key in known:
            parent = blocks[key][0]
            if parent in present:
                children.setdefault(parent, []).append(key)  # type: ignore[arg-type]
            else:
                heads.append(key)
        chains = []
        while heads:
            run = [heads.popleft()]
            while next_keys := children.get(run[-1]):
                run.append(next_keys[0])
                heads.extend(next_keys[1:])
            tokens = [token for key in run for token in blocks[key][1]]
            chains.append(Chain(run, blocks[run[0]][0], tokens))
        return chains, [key for key in given if key not in present]
