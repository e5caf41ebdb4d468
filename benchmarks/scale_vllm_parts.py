"""vLLM 0.33's own ``Scheduler``, with tiercache's KV connector or without, in one process and no workers (needs vLLM).

``SchedulerOnly`` builds what vLLM's engine core builds for its scheduler: a real
``VllmConfig`` over a tiny Llama's ``config.json`` (vLLM reads no weights), one
full-attention layer of one KV head (``HEAD_SIZE`` float32 channels: a CPU slot of
a few hundred bytes, so millions of blocks fit in little memory), and, with a
``topology``, the CPU tier's shared region as a worker makes it at
``register_kv_caches`` before vLLM's ``Scheduler`` makes the SCHEDULER connector.
``step`` is one engine step with the scheduler alone: its ``ModelRunnerOutput``
samples a token for each request whose prompt is computed, and its
``KVConnectorOutput`` reports every job of the step's connector metadata done by
the one worker (``TierCacheWorkerMetadata``, asynchronous loads as received), as a
CPU worker that copied them by ``wait_for_save`` would: stores commit, loads'
pins go. No page is copied. Without ``topology`` it is vLLM's scheduler alone.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from vllm import SamplingParams
from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

from tiercache.integrations.vllm.connector.geometry import instance_geometry
from tiercache.integrations.vllm.connector.metadata import TierCacheConnectorMetadata, TierCacheWorkerMetadata
from tiercache.integrations.vllm.connector.region import SharedRegion, region_path
from tiercache.testing.tiny_llama import tiny_llama_config

BLOCK = 16
"""Tokens per vLLM block (vLLM's default)."""
LAYER = "model.layers.0.self_attn.attn"
HEAD_SIZE = 2
"""Channels per head of the KV cache: a page of ``BLOCK x 2 x HEAD_SIZE`` float32, 256 bytes."""
SAMPLED = 7
"""The token the "model" samples."""
CONNECTOR = {"kv_connector": "TierCacheConnector", "kv_connector_module_path": "tiercache.integrations.vllm.connector"}

init_none_hash(sha256)  # what vLLM's engine core does at start with its default hash (sha256)


def model_dir(root: Path, max_model_len: int) -> Path:
    """A model directory with a tiny Llama's ``config.json`` of ``max_model_len`` positions."""
    root.mkdir(parents=True, exist_ok=True)
    tiny_llama_config(hidden_size=64, num_layers=1, num_heads=2, num_kv_heads=1, vocab_size=512,
                      max_position_embeddings=max_model_len).save_pretrained(root)
    return root


def request(req_id: str, tokens: Sequence[int], max_tokens: int) -> Request:
    """A real vLLM request hashed by vLLM's block hasher (sha256, the engine's default)."""
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return Request(request_id=req_id, prompt_token_ids=list(tokens), sampling_params=params, pooling_params=None,
                   block_hasher=get_request_block_hasher(BLOCK, sha256))


@dataclass(frozen=True)
class Sizes:
    """What one scheduler holds: vLLM's pool, the batch's limits, the longest request."""

    num_blocks: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int


@dataclass(frozen=True)
class Step:
    """One step: vLLM's output, and the seconds ``schedule()`` and ``update_from_output()`` took."""

    output: SchedulerOutput
    schedule_s: float
    update_s: float


class SchedulerOnly:
    """vLLM's scheduler, with the connector over ``topology`` or alone (see the module docstring)."""

    def __init__(self, root: Path, engine_id: str, sizes: Sizes, topology: dict[str, Any] | None = None) -> None:
        model = ModelConfig(model=str(model_dir(root / "model", sizes.max_model_len)), dtype="float32", seed=0,
                            skip_tokenizer_init=True, max_model_len=sizes.max_model_len)
        transfer = None
        if topology is not None:
            extra = {"topology": topology, "shared_dir": str(root)}
            transfer = KVTransferConfig(**CONNECTOR, kv_role="kv_both", engine_id=engine_id,
                                        kv_connector_extra_config=extra)
        self.config = VllmConfig(
            model_config=model,
            scheduler_config=SchedulerConfig(max_num_seqs=sizes.max_num_seqs,
                                             max_num_batched_tokens=sizes.max_num_batched_tokens,
                                             max_model_len=sizes.max_model_len, enable_chunked_prefill=True,
                                             is_encoder_decoder=False),
            cache_config=CacheConfig(block_size=BLOCK, gpu_memory_utilization=0.9, enable_prefix_caching=True),
            kv_transfer_config=transfer, device_config=DeviceConfig("cpu"),
        )
        self.config.cache_config.num_gpu_blocks = sizes.num_blocks
        spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=HEAD_SIZE, dtype=torch.float32)
        self.kv_cache_config = KVCacheConfig(num_blocks=sizes.num_blocks, kv_cache_tensors=[],
                                             kv_cache_groups=[KVCacheGroupSpec([LAYER], spec)],
                                             kv_cache_layout="LBHNC")
        region = None if topology is None else self._worker_region(root, engine_id, topology)
        self.scheduler = Scheduler(vllm_config=self.config, kv_cache_config=self.kv_cache_config,
                                   structured_output_manager=StructuredOutputManager(self.config), block_size=BLOCK,
                                   log_stats=True)
        if region is not None:
            region.close()  # the scheduler side holds the region now, as after a worker's start
        self.connector: Any = self.scheduler.connector
        """vLLM's SCHEDULER connector (None without a topology)."""

    def _worker_region(self, root: Path, engine_id: str, topology: dict[str, Any]) -> SharedRegion:
        """The CPU tier's region, as the one worker makes and maps it in ``register_kv_caches``."""
        geometry = instance_geometry(self.config, self.kv_cache_config).slots
        assert geometry is not None
        path = region_path(root, engine_id, self.config.parallel_config.data_parallel_rank)
        return SharedRegion.for_worker(path, topology["tiers"][0]["capacity_blocks"], geometry.slot_bytes, rank=0)

    @property
    def tiers(self) -> Any:
        """The connector's ``LowerTiers`` (the CPU tier and the remotes)."""
        return self.connector._scheduler.tiers

    def add(self, req: Request) -> Request:
        self.scheduler.add_request(req)
        return req

    def step(self) -> Step:
        """One engine step (see the module docstring), timed."""
        started = time.perf_counter()
        output = self.scheduler.schedule()
        scheduled = time.perf_counter()
        model_output = self._model_output(output)
        updating = time.perf_counter()
        self.scheduler.update_from_output(output, model_output)
        return Step(output, scheduled - started, time.perf_counter() - updating)

    def _model_output(self, output: SchedulerOutput) -> ModelRunnerOutput:
        """A sampled token for every request whose prompt is computed; the worker's report of the step's jobs."""
        ids = list(output.num_scheduled_tokens)
        requests = self.scheduler.requests
        sampled = [[SAMPLED] if requests[r].num_computed_tokens >= requests[r].num_prompt_tokens else [] for r in ids]
        return ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                 sampled_token_ids=sampled, kv_connector_output=_worker_output(output))

    def finish(self, req_ids: Sequence[str]) -> None:
        """Abort ``req_ids``, as the API server does when a client goes."""
        self.scheduler.finish_requests(list(req_ids), RequestStatus.FINISHED_ABORTED)

    def shutdown(self) -> None:
        self.scheduler.shutdown()


def _worker_output(output: SchedulerOutput) -> KVConnectorOutput | None:
    """What one worker reports after running every job of the step's metadata (None: no job, as a runner sends)."""
    metadata = output.kv_connector_metadata
    if not isinstance(metadata, TierCacheConnectorMetadata):
        return None
    jobs = [*metadata.loads, *metadata.stores]
    if not jobs:
        return None
    received = {job.request_id for job in metadata.loads if job.asynchronous}
    return KVConnectorOutput(finished_recving=received or None,
                             kv_connector_worker_meta=TierCacheWorkerMetadata(Counter(job.job_id for job in jobs)))
