"""One vLLM instance with tiercache's KV connector, driven by vLLM's own scheduler, in one process (vLLM 0.33).

``Instance`` builds what vLLM builds: the WORKER connector through vLLM's factory,
registered with real CPU KV tensors (one storage, a view per layer, as vLLM's CPU
runner allocates them) before vLLM's ``Scheduler`` (which makes the SCHEDULER
connector). ``step`` runs one engine step the way vLLM's model runner does
(``kv_connector_model_runner_mixin``): bind the metadata, ``start_load_kv``
before the forward when the step has sync loads, per layer
``wait_for_layer_load`` -> attention -> ``save_kv_layer``, ``wait_for_save``,
then the connector's output into a ``ModelRunnerOutput`` for
``Scheduler.update_from_output``. The "model" writes, for each block it
computes, a page derived from the block's whole token prefix and the layer
(``page_bytes``), so a page loaded from elsewhere can be checked bit for bit;
right after each ``wait_for_layer_load`` the step records every page of the
prefix the attention is about to read that differs from that. Its configs, KV tensors and topologies are
``support.vllm_parts``'.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from vllm import SamplingParams
from vllm.config import VllmConfig
from vllm.distributed.kv_transfer import kv_transfer_state
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.forward_context import ForwardContext
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import KVCacheConfig
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager
from vllm.v1.worker.gpu.kv_connector import ActiveKVConnector

from support.vllm_parts import BLOCK, HEAD_SIZE, KV_HEADS, kv_cache_config, kv_tensors, model_dir, vllm_config

SAMPLED = 7
"""The token the "model" samples."""
WAIT_S = 20.0
"""Bound on steps spent waiting for background work: a hang detector, never a speed judgement."""
PROMPT = list(range(3, 103))
"""100 tokens: 6 full blocks and 4 tokens."""

init_none_hash(sha256)


def totals(records: Iterable[StepRecord]) -> dict[str, int]:
    """The connector's counts summed over ``records``."""
    summed: dict[str, int] = {}
    for record in records:
        for name, count in record.connector_stats.items():
            summed[name] = summed.get(name, 0) + count
    return summed


def page_bytes(layer: int, prefix: list[int], size: int = KV_HEADS * BLOCK * 2 * HEAD_SIZE * 4) -> torch.Tensor:
    """The page (``size`` bytes, vLLM's logical order) the "model" computes for a block whose token prefix (its own
    tokens included) is ``prefix``."""
    seed = hashlib.sha256(repr((layer, prefix)).encode()).digest()
    return torch.frombuffer(bytearray(hashlib.shake_256(seed).digest(size)), dtype=torch.uint8)


def request(req_id: str, tokens: list[int], *, max_tokens: int = 1, cache_salt: str | None = None) -> Request:
    """A real vLLM request with vLLM's block hasher (sha256, as the engine's default)."""
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return Request(request_id=req_id, prompt_token_ids=list(tokens), sampling_params=params, pooling_params=None,
                   cache_salt=cache_salt, block_hasher=get_request_block_hasher(BLOCK, sha256))


@dataclass
class StepRecord:
    """What one step did: vLLM's output, and the prefix pages the attention would have read wrong."""

    output: SchedulerOutput
    wrong_pages: list[tuple[str, str, int]] = field(default_factory=list)
    """(request id, layer, block position) of a prefix page unequal to the model's, at the layer's read."""
    invalid_blocks: set[int] = field(default_factory=set)
    connector_stats: dict[str, Any] = field(default_factory=dict)
    """vLLM's ``SchedulerStats.kv_connector_stats`` of the step (the counts the API server gets)."""
    external_hits: int = 0
    """Tokens vLLM counted as external prefix-cache hits in the step."""
    hits_by_source: dict[str, int] = field(default_factory=dict)
    """Those tokens by vLLM's ``CacheHitSource`` (what the connector's ``get_external_cache_hit_sources`` said)."""


class Instance:
    """One vLLM instance (see the module docstring)."""

    def __init__(self, config: VllmConfig, kv_config: KVCacheConfig | None = None,
                 kv: dict[str, torch.Tensor] | None = None, *, runner: str = "v1",
                 registered: dict[str, Any] | None = None, state_model: Any = None) -> None:
        self.config = config
        self.kv_cache_config = kv_config or kv_cache_config()
        groups = self.kv_cache_config.kv_cache_groups
        self.layers = [name for group in groups for name in group.layer_names]
        self.group_of = {name: index for index, group in enumerate(groups) for name in group.layer_names}
        self.windows = [getattr(group.kv_cache_spec, "sliding_window", None) for group in groups]
        """Per group, its attention window in tokens (None: full attention)."""
        self.state_groups = {index for index, group in enumerate(groups) if not hasattr(group.kv_cache_spec,
                                                                                        "num_kv_heads")}
        """Groups of state (Mamba), not pages of tokens: the "model" leaves them alone."""
        self.kv = kv if kv is not None else kv_tensors(self.kv_cache_config)
        """vLLM's KV views per layer (``kv``: another layout's, e.g. vLLM's own ``allocate_kv_cache``)."""
        self.state_model = state_model(self) if state_model is not None else None
        """The state layers' "model" (``support.vllm_mamba``): what vLLM's align mode does to their blocks."""
        self.worker: Any = KVConnectorFactory.create_connector(config, KVConnectorRole.WORKER, self.kv_cache_config)
        self.v2: Any = None
        """vLLM's V2 model runner's connector driver (``runner="v2"``: FULL CUDA graphs, no per-layer hook)."""
        if runner == "v2":
            kv_transfer_state._KV_CONNECTOR_AGENT = self.worker
            self.v2 = ActiveKVConnector(config, self.kv)  # registers the KV caches, as the V2 runner does
        else:
            self.worker.register_kv_caches(registered if registered is not None else self.kv)
        self.scheduler = Scheduler(vllm_config=config, kv_cache_config=self.kv_cache_config,
                                   structured_output_manager=StructuredOutputManager(config), block_size=BLOCK,
                                   log_stats=True)
        self.connector: Any = self.scheduler.connector
        self.skip_loads = False
        """The "engine" calls neither ``start_load_kv`` nor ``wait_for_layer_load`` (a broken runner)."""
        self.micro_batched = False
        """Each layer runs per micro-batch, its save hook after each (vLLM's dual-batch overlap: the step's requests
        in two halves)."""
        self.speculative = False
        """The runner collects the connector's output before ``wait_for_save``, which runs after the drafter: vLLM's
        order with speculative decoding (``defer_finalize``, V1 and V2 runners)."""
        self.worker_stats: list[Any] = []
        self.page_of: Callable[[int, list[int], int], torch.Tensor] = page_bytes
        """The "model": a block's page of a layer from its token prefix (``page_bytes``; a lossy test's: floats)."""
        self.same_page: Callable[[torch.Tensor, torch.Tensor], bool] = torch.equal
        """Whether a page read (bytes) is the model's (bit for bit; a lossy test's: within its level's bound)."""

    def add(self, req: Request) -> Request:
        self.scheduler.add_request(req)
        return req

    def step(self) -> StepRecord:
        """One engine step (see the module docstring)."""
        output = self.scheduler.schedule()
        if self.v2 is not None:
            return self._step_v2(output)
        record = StepRecord(output)
        worker = self.worker
        worker.bind_connector_metadata(output.kv_connector_metadata)
        forward = output.total_num_scheduled_tokens > 0
        context = ForwardContext(no_compile_layers={}, slot_mapping={},
                                 attn_metadata={name: output for name in self.layers} if forward else {})
        if self.state_model is not None:  # vLLM's preprocess_mamba runs before the connector's loads
            record.wrong_pages.extend(self.state_model.prepare(output))
        if output.has_sync_kv_loads and not self.skip_loads:
            worker.start_load_kv(context)
        if forward:
            for index, name in enumerate(self.layers):
                if not self.skip_loads:
                    worker.wait_for_layer_load(name)
                record.wrong_pages.extend(self._check_prefix(output, index, name))
                for batch in self._micro_batches(output):  # each runs the layer, then its save hook
                    self._compute(output, index, name, batch)
                    if self.state_model is not None:
                        self.state_model.compute(output, index, name, batch)
                    worker.save_kv_layer(name, self.kv[name], context.attn_metadata)
        if not output.has_sync_kv_loads and not self.skip_loads:
            worker.start_load_kv(context)
        if not self.speculative:
            worker.wait_for_save()
        results = worker.get_transfer_results(output.finished_req_ids)
        record.invalid_blocks = worker.get_block_ids_with_load_errors()
        stats = worker.get_kv_connector_stats()
        if stats is not None:
            self.worker_stats.append(stats)
        connector_output = KVConnectorOutput(
            finished_sending=results.finished_sending, finished_recving=results.finished_recving,
            failed_recving=results.failed_recving, invalid_block_ids=record.invalid_blocks, kv_connector_stats=stats,
            kv_connector_worker_meta=worker.build_connector_worker_meta(),
        )
        if self.speculative:  # the drafter's forward, then vLLM's finalize_kv_connector
            worker.wait_for_save()
        worker.clear_connector_metadata()
        return self._update(record, self._model_output(output, connector_output))

    def _step_v2(self, output: SchedulerOutput) -> StepRecord:
        """A step as vLLM 0.33's V2 runner drives the connector with FULL CUDA graphs (``vllm/v1/worker/gpu/
        model_runner.py``): ``pre_forward`` outside any forward context, the graph's replay (no per-layer hook),
        ``finish_forward``, ``post_forward``; a step with nothing scheduled goes through ``no_forward``."""
        record = StepRecord(output)
        if output.total_num_scheduled_tokens == 0:
            model_output = self.v2.no_forward(output)
        else:
            self.v2.pre_forward(output)
            for index, name in enumerate(self.layers):
                record.wrong_pages.extend(self._check_prefix(output, index, name))
                self._compute(output, index, name)
            self.v2.finish_forward()
            connector_output = self.v2.post_forward(output.finished_req_ids, defer_finalize=self.speculative)
            if self.speculative:  # the drafter's forward, then the V2 runner's finalize_step
                self.v2.finalize_step()
            model_output = self._model_output(output, connector_output)
        connector_output = model_output.kv_connector_output
        if connector_output is not None:
            record.invalid_blocks = set(connector_output.invalid_block_ids or ())
            if connector_output.kv_connector_stats is not None:
                self.worker_stats.append(connector_output.kv_connector_stats)
        return self._update(record, model_output)

    def _update(self, record: StepRecord, model_output: ModelRunnerOutput) -> StepRecord:
        """vLLM's scheduler takes the step's output; the record gets the stats the API server would."""
        outputs = self.scheduler.update_from_output(record.output, model_output)
        for engine_output in outputs.values():
            stats = engine_output.scheduler_stats
            if stats is not None:
                for name, count in (stats.kv_connector_stats or {}).items():
                    record.connector_stats[name] = record.connector_stats.get(name, 0) + count
                hits = stats.connector_prefix_cache_stats
                record.external_hits += hits.hits if hits is not None else 0
                for source, count in (hits.hits_by_source if hits is not None else {}).items():
                    record.hits_by_source[str(source.value)] = record.hits_by_source.get(source.value, 0) + count
        return record

    def run(self, done: Callable[[], bool], wait_s: float = WAIT_S) -> list[StepRecord]:
        """Step until ``done()`` (between steps, background work goes on); fail after ``wait_s``."""
        records = []
        deadline = time.monotonic() + wait_s
        while not done():
            assert time.monotonic() < deadline, "the instance never got there"
            records.append(self.step())
            time.sleep(0.001)
        return records

    def until_scheduled(self, req_id: str, wait_s: float = WAIT_S) -> StepRecord:
        """Step until a step schedules ``req_id``; that step's record."""
        deadline = time.monotonic() + wait_s
        while True:
            assert time.monotonic() < deadline, f"{req_id} was never scheduled"
            record = self.step()
            if req_id in record.output.num_scheduled_tokens:
                return record
            time.sleep(0.001)

    def serve(self, req: Request, wait_s: float = WAIT_S) -> list[StepRecord]:
        """Add ``req`` and step until it has finished."""
        self.add(req)
        return self.run(lambda: req.is_finished() or req.request_id not in self.scheduler.requests, wait_s)

    def new_request(self, records: Iterable[StepRecord], req_id: str) -> Any:
        """vLLM's ``NewRequestData`` of ``req_id`` in the step that first scheduled it."""
        return next(new for record in records for new in record.output.scheduled_new_reqs if new.req_id == req_id)

    def block_ids(self, req_id: str, group: int = 0) -> list[int]:
        return list(self.scheduler.kv_cache_manager.get_block_ids(req_id)[group])

    def page(self, layer: str, block: int) -> torch.Tensor:
        """The bytes of one block's page of ``layer``, in vLLM's logical order."""
        return self.kv[layer][block].contiguous().view(torch.uint8).flatten()

    def page_size(self, layer: str) -> int:
        return self.kv[layer][0].numel() * self.kv[layer].element_size()

    def shutdown(self) -> None:
        self.scheduler.shutdown()
        self.worker.shutdown()
        if self.v2 is not None:
            kv_transfer_state._KV_CONNECTOR_AGENT = None

    # ---- the "model" ------------------------------------------------------------------
    def _scheduled(self, output: SchedulerOutput) -> Iterable[tuple[Request, int, int]]:
        """Per scheduled request: the request, the first token computed this step, the end."""
        for req_id, count in output.num_scheduled_tokens.items():
            req = self.scheduler.requests[req_id]
            end = req.num_computed_tokens
            yield req, end - count, end

    def _check_prefix(self, output: SchedulerOutput, layer: int, name: str) -> list[tuple[str, str, int]]:
        """The full blocks before the step's first token that its attention reads (a window's only) and that differ
        from the model's (a null block where one is read counts as wrong)."""
        wrong: list[tuple[str, str, int]] = []
        group = self.group_of[name]
        window = self.windows[group]
        if group in self.state_groups:
            return wrong
        for req, start, _ in self._scheduled(output):
            tokens, blocks = list(req.all_token_ids), self.block_ids(req.request_id, group)
            first = 0 if window is None else max(0, start - window + 1) // BLOCK
            for position in range(first, start // BLOCK):
                expected = self.page_of(layer, tokens[: (position + 1) * BLOCK], self.page_size(name))
                if blocks[position] == 0 or not self.same_page(self.page(name, blocks[position]), expected):
                    wrong.append((req.request_id, name, position))
        return wrong

    def _micro_batches(self, output: SchedulerOutput) -> list[set[str] | None]:
        """The step's requests as the forward runs them: all at once (None), or in two halves."""
        if not self.micro_batched:
            return [None]
        ids = list(output.num_scheduled_tokens)
        return [set(ids[: len(ids) // 2]), set(ids[len(ids) // 2 :])]

    def _compute(self, output: SchedulerOutput, layer: int, name: str, requests: set[str] | None = None) -> None:
        """Write the pages of the blocks this step's tokens fall in (a partial block: its tokens so far), of
        ``requests`` only where given."""
        if self.group_of[name] in self.state_groups:
            return
        for req, start, end in self._scheduled(output):
            if requests is not None and req.request_id not in requests:
                continue
            tokens, blocks = list(req.all_token_ids), self.block_ids(req.request_id, self.group_of[name])
            for position in range(start // BLOCK, (end - 1) // BLOCK + 1):
                page = self.page_of(layer, tokens[: min((position + 1) * BLOCK, end)], self.page_size(name))
                target = self.kv[name][blocks[position]]
                target.copy_(page.view(target.dtype).view(target.shape))

    def _model_output(self, output: SchedulerOutput, connector_output: KVConnectorOutput) -> ModelRunnerOutput:
        """A sampled token for every request whose prompt is computed after this step."""
        ids = list(output.num_scheduled_tokens)
        sampled = []
        for req_id in ids:
            req = self.scheduler.requests[req_id]
            sampled.append([SAMPLED] if req.num_computed_tokens >= req.num_prompt_tokens else [])
        return ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                 sampled_token_ids=sampled, kv_connector_output=connector_output)


class Instances:
    """The instances a test builds over one model directory and one connector topology; all shut down at the end."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.model = model_dir(root / "models")
        self.built: list[Instance] = []

    def extra(self, topology: dict[str, Any], **options: Any) -> dict[str, Any]:
        """``kv_connector_extra_config`` with the region in this test's directory."""
        return {"topology": topology, "shared_dir": str(self.root), **options}

    def new(self, engine_id: str, topology: dict[str, Any], *, model: Path | None = None,
            kv_config: Callable[[VllmConfig], KVCacheConfig] | None = None,
            kv: Callable[[KVCacheConfig], dict[str, torch.Tensor]] | None = None, runner: str = "v1",
            options: dict[str, Any] | None = None, **kwargs: Any) -> Instance:
        """An instance called ``engine_id``; ``kv_config`` builds its KV cache config from its ``VllmConfig``
        (default: one full-attention group), ``kv`` its KV tensors from that (default: the CPU backend's);
        ``options``: the connector's other options (``idle_wait_ms``, ...); ``kwargs`` go to ``vllm_config``
        (``kv_role``, ``events``)."""
        config = vllm_config(model or self.model, engine_id, self.extra(topology, **(options or {})), **kwargs)
        kv_cache = kv_config(config) if kv_config is not None else kv_cache_config()
        instance = Instance(config, kv_cache, kv(kv_cache) if kv is not None else None, runner=runner)
        self.built.append(instance)
        return instance

    def close(self) -> None:
        for instance in self.built:
            instance.shutdown()


def tiers_of(instance: Instance) -> Any:
    """The scheduler side's ``LowerTiers`` (for a test that looks inside or plays with its remotes)."""
    return instance.connector._scheduler.tiers


def remote_written(instance: Instance, tier: str, blocks: int) -> None:
    """Wait until ``blocks`` blocks have been written down to the remote ``tier``."""
    tiers = tiers_of(instance)
    deadline = time.monotonic() + WAIT_S
    while tiers.stats()["tiers"].get(tier, {}).get("blocks_in", 0) < blocks:
        assert time.monotonic() < deadline, f"{blocks} blocks never reached {tier}"
        time.sleep(0.002)
