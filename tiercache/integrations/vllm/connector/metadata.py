"""What the scheduler side tells the workers each step, and what the workers tell it back: values, no objects.

Each step's ``TierCacheConnectorMetadata`` lists jobs: a load copies CPU slots into
vLLM blocks before the layers read them; a store copies vLLM blocks into CPU
slots once the step's forward has written them. Every worker runs every job on
its own rank's pages and reports the job ids it finished in its
``TierCacheWorkerMetadata`` (summed over the workers by vLLM); the scheduler side
acts on a job once every worker has reported it (a load's slots are unpinned, a
store's slots committed and written down), and on a failed one as failed.

Without vLLM (the GPU check's machine) these are plain dataclasses, so the
worker side (``worker``) imports and runs with torch alone.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata
except ModuleNotFoundError:  # the GPU check drives the worker on a machine with torch alone (no vLLM)
    KVConnectorMetadata = KVConnectorWorkerMetadata = object  # type: ignore[assignment,misc]


@dataclass(frozen=True)
class CopyJob:
    """One job: ``slots[i]``, ``block_ids[i]`` and ``groups[i]`` go together (a load copies slot -> block of that
    KV-cache group's layers, a store block -> slot)."""

    job_id: int
    slots: tuple[int, ...]
    block_ids: tuple[int, ...]
    groups: tuple[int, ...]
    invalid: tuple[int, ...] = ()
    """A load's blocks vLLM counts as loaded that no slot fills: the worker reports them failed (recomputed)."""
    request_id: str = ""
    """An asynchronous load's request: the workers report it to vLLM as received once copied (or failed)."""
    asynchronous: bool = False
    """A load copied while the batch runs on (its request waits in WAITING_FOR_REMOTE_KVS), not before the forward."""
    region: bytes = b""
    """The token of the host server's region its slots are in (b"": the connector's own region); a worker that has
    not mapped that region fails the job (a server restarted since has made another)."""


@dataclass
class TierCacheConnectorMetadata(KVConnectorMetadata):
    """One step's jobs."""

    loads: list[CopyJob] = field(default_factory=list)
    stores: list[CopyJob] = field(default_factory=list)


@dataclass
class TierCacheWorkerMetadata(KVConnectorWorkerMetadata):
    """Per job id, how many workers finished it, and how many failed it (summed over workers)."""

    done: Counter[int] = field(default_factory=Counter)
    failed: Counter[int] = field(default_factory=Counter)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if not isinstance(other, TierCacheWorkerMetadata):
            return self
        return TierCacheWorkerMetadata(self.done + other.done, self.failed + other.failed)
