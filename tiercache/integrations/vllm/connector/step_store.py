"""A worker's share of one step's store jobs: per KV-cache group the pages it copies, and the layers left.

Split from ``worker`` (which hands them to the transfer engine layer by layer).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tiercache.integrations.vllm.connector.metadata import CopyJob
from tiercache.integrations.vllm.connector.transfers import GroupCopy


@dataclass
class StepStore:
    """A store job of this step and the layers it still has to copy."""

    job: CopyJob
    copies: dict[int, GroupCopy]
    """Per KV-cache group this rank copies, its pages."""
    layers_left: set[int] = field(default_factory=set)
    failed: bool = False
    dropped: bool = False
    """Never handed to the transfer engine (past the step's staging budget, or slots of a region this worker has
    not mapped): reported failed by the worker."""


def group_copies(job: CopyJob, groups: set[int]) -> dict[int, GroupCopy]:
    """A job's pairs per KV-cache group, for the groups in ``groups``."""
    copies: dict[int, GroupCopy] = {}
    for group in sorted(set(job.groups) & groups):
        ours = [index for index, g in enumerate(job.groups) if g == group]
        copies[group] = GroupCopy(job.job_id, group, tuple(job.slots[i] for i in ours),
                                  tuple(job.block_ids[i] for i in ours))
    return copies
