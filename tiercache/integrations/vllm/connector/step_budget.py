"""What one step's stores may stage on the device, and the scheduler's spending of it block by block (issue 53).

On CUDA a worker stages a step's stores in device memory before copying them to
the CPU tier (``staged``), at most ``store_budget_bytes`` a step: the blocks
``max_num_batched_tokens`` can fill, or ``staging_mib``. The scheduler plans the
step's stores within that budget (``StoreBudget``), so the worker never has to
drop what was planned: a full-attention block that does not fit waits for the
next step (its request still holds it), a sliding-window block that does not fit
is left out (counted), since its window may have slid past it by then. Pure
bookkeeping.
"""

from __future__ import annotations

from collections.abc import Sequence

from tiercache.integrations.vllm.connector.geometry import SlotGeometry


def step_blocks(max_num_batched_tokens: int, block_size: int) -> int:
    """The most blocks of one group a step can fill: its tokens' blocks, and one more (the first may have begun in
    an earlier step)."""
    return -(-max_num_batched_tokens // block_size) + 1


def store_budget_bytes(geometry: SlotGeometry, rank: int, max_num_batched_tokens: int) -> int:
    """Device memory a step's stores stage on rank ``rank``: every group it stores, for ``step_blocks`` blocks."""
    per_block = sum(group.layers_bytes for index, group in enumerate(geometry.groups) if geometry.writes(rank, index))
    return step_blocks(max_num_batched_tokens, geometry.block_size) * per_block


def staging_budget(geometry: SlotGeometry, rank: int, staging_bytes: int | None,
                   max_num_batched_tokens: int | None) -> int | None:
    """A step's store staging on ``rank``: ``staging_mib`` where given, else what a step fills (None: unbounded)."""
    if staging_bytes is not None:
        return staging_bytes
    if max_num_batched_tokens is None:
        return None
    return store_budget_bytes(geometry, rank, max_num_batched_tokens)


class StoreBudget:
    """One step's store staging as the scheduler spends it, on every rank (None: unbounded, as on CPU, where nothing
    is staged). Rank 0 stores every group and the others the groups not replicated, so ranks 0 and 1 stand for all."""

    def __init__(self, geometry: SlotGeometry, staging_bytes: int | None, max_num_batched_tokens: int | None,
                 *, bounded: bool = True) -> None:
        ranks = range(min(geometry.world, 2))
        budgets = [staging_budget(geometry, rank, staging_bytes, max_num_batched_tokens) for rank in ranks]
        self.step_bytes = budgets if bounded and None not in budgets else None
        """Per rank standing for others, its staging a step (None: unbounded)."""
        self._costs = [[group.layers_bytes if geometry.writes(rank, index) else 0
                        for index, group in enumerate(geometry.groups)] for rank in ranks]
        """Per rank, its staging bytes for one block of each group."""
        self.left = list(self.step_bytes) if self.step_bytes is not None else None

    def begin_step(self) -> None:
        self.left = list(self.step_bytes) if self.step_bytes is not None else None

    def fitting(self, groups: Sequence[int], start: int = 0) -> int:
        """How many of the blocks of ``groups[start:]`` (in order) fit in what is left on every rank, without
        spending it."""
        if self.left is None:
            return len(groups) - start
        spent = [0] * len(self.left)
        for position in range(start, len(groups)):
            for rank, costs in enumerate(self._costs):
                spent[rank] += costs[groups[position]]
                if spent[rank] > self.left[rank]:
                    return position - start
        return len(groups) - start

    def ever_fits(self, group: int) -> bool:
        """Whether a block of ``group`` fits in a whole step's budget (``staging_mib`` below one block: never)."""
        return self.step_bytes is None or all(costs[group] <= step for costs, step in zip(self._costs,
                                                                                          self.step_bytes,
                                                                                          strict=True))

    def spend(self, group: int) -> None:
        """A block of ``group`` got a slot: it is staged this step."""
        if self.left is not None:
            for rank, costs in enumerate(self._costs):
                self.left[rank] -= costs[group]
