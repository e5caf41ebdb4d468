"""The stack: every part of one topology, wired from its config, with their start, close and stats.

The facade (``TierManager``) holds one and runs the API calls against it. The
parts: the GPU pool and CPU tier (``tiers/``), the remote tiers and their
transfer lanes and the presence cache, the pure bookkeeping (``MemoryTiers``,
``Hierarchy``, ``RemoteWrites``, the ``Outbox`` of their moves), the lookup
(``PrefixLookup``), the swap queue, the load runner, the mover, the cost
model's explorer, and the background runtime.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
from typing import Any

import torch

from tiercache.blocks.keys import BlockHasher, Namespace
from tiercache.bookkeeping.admission import FillRule, HitCounts
from tiercache.bookkeeping.hierarchy import Hierarchy
from tiercache.bookkeeping.load_plan import LoadItem, LoadPlanner
from tiercache.bookkeeping.memory_tiers import MemoryTiers
from tiercache.bookkeeping.moves import Outbox
from tiercache.bookkeeping.remote_writes import RemoteWrites
from tiercache.config import TierCacheConfig, TierConfig
from tiercache.manager.books import Books
from tiercache.manager.cost import CostModel
from tiercache.manager.lookup import PrefixLookup, TierNames
from tiercache.movement.explorer import Explorer
from tiercache.movement.loads import LoadRunner
from tiercache.movement.mover import Mover
from tiercache.movement.presence import PresenceCache
from tiercache.movement.reads import RemoteReader
from tiercache.movement.runtime import CLOSE_DRAIN_SECONDS, Runtime
from tiercache.movement.swap import make_swapper
from tiercache.movement.swap.queue import SwapQueue
from tiercache.movement.transfers import Transfer
from tiercache.policies import make_policy
from tiercache.remote.build import build_remotes, close_remotes, lane_stats, model_namespace, topology_namespace
from tiercache.telemetry.counters import Metrics
from tiercache.telemetry.mrc import MissRatioCurve
from tiercache.telemetry.observer import FleetObserver, NullObserver, TierObserver
from tiercache.tiers.coded import CodedTier
from tiercache.tiers.cpu import CpuTier
from tiercache.tiers.gpu import GpuTier

ENGINE_POOL = "engine"
"""Counters' name for the engine's own GPU pool when tiercache does not manage it (``LowerTiers``)."""
REMEMBER_FACTOR = 8
"""Keys remembered (hit counts, written to a remote) per local slot."""


def _rule(tier: TierConfig) -> FillRule:
    return FillRule(tier.name or tier.type, tier.write_policy, tier.admit_after_hits)


def _policy(tier: TierConfig, slots: int):
    """The tier's policy, ordering its ``slots`` (an engine's own pool may hold more than the YAML says)."""
    return make_policy(tier.policy, slots, **tier.policy_options)


class Stack:
    """The parts of one topology (see the module docstring)."""

    def __init__(
        self, config: TierCacheConfig, gpu_tensors: list[torch.Tensor] | None = None,
        cpu_buffer: torch.Tensor | None = None,
    ) -> None:
        """``gpu_tensors``: the engine's own pool for the GPU tier; ``cpu_buffer``: the CPU tier's memory
        (``[slots, bytes_per_block]`` uint8, e.g. shared with the engine's workers). A topology whose first
        tier is the CPU tier has no GPU tier: the engine keeps its pool (``LowerTiers``)."""
        self.config, self.layout = config, config.layout
        self.block_size = config.layout.block_size
        model = config.model
        self.namespace, codec = model_namespace(config)
        self.hasher = BlockHasher(self.namespace, self.block_size)
        self._hashers: dict[Namespace, BlockHasher] = {}
        self.metrics = Metrics()
        lower = list(config.tiers)
        first = lower.pop(0) if lower[0].type == "gpu" else None
        if first is None:
            self.gpu = None
        else:
            slots = first.capacity_blocks if gpu_tensors is None else self.layout.validate_pool(gpu_tensors)
            self.gpu = GpuTier(first.name, self.layout, slots, _policy(first, slots), first.options, gpu_tensors)
        cpu_config = lower.pop(0) if lower and lower[0].type == "cpu" else None
        self.cpu = None if cpu_config is None else CpuTier(
            cpu_config.name, self.layout, cpu_config.capacity_blocks, _policy(cpu_config, cpu_config.capacity_blocks),
            cpu_config.options,
            buffer=cpu_buffer,
        )
        queues = config.queues
        self.remotes, self.lanes = build_remotes(lower, codec, self.layout.bytes_per_block, queues, self.metrics,
                                                 self.layout, config.source)
        self.runtime = Runtime()
        self.presence_cache = PresenceCache(self.lanes, self.runtime)
        self.local = MemoryTiers(self.gpu.table if self.gpu else None, self.cpu.table if self.cpu else None)
        self.events = _event_sink(config)
        self.curves = {
            tier.name: MissRatioCurve(config.mrc.sample_rate, config.mrc.max_samples)
            for tier in config.tiers
            if config.mrc.enabled
        }
        self.cost = CostModel(config.cost) if config.cost.enabled else None
        lora_id = int(model.lora) if model.lora and model.lora.isdigit() else None
        remember = REMEMBER_FACTOR * (
            (self.gpu.num_blocks if self.gpu else 0) + (self.cpu.num_slots if self.cpu else 0)
        )
        observer: TierObserver = FleetObserver(
            self.events, self.curves, self.block_size, lora_id, [t.name for t in self.remotes]
        ) if self.events is not None or self.curves else NullObserver()
        cpu_rule = _rule(cpu_config) if cpu_config else None
        hits, outbox = HitCounts(remember), Outbox()
        self.remote_writes = RemoteWrites(
            self.local.cpu, [_rule(t) for t in lower], hits, outbox, self.metrics, observer,
            cpu_name=cpu_rule.name if cpu_rule else "cpu", bytes_per_block=self.layout.bytes_per_block,
            max_pending_stores=queues.max_pending_stores, remember_keys=remember,
        )
        self.hierarchy = Hierarchy(
            self.local, cpu_rule, self.remote_writes, hits, outbox, self.metrics, observer,
            gpu_name=self.gpu.name if self.gpu else ENGINE_POOL, block_size=self.block_size,
            exclusive=config.exclusive,
        )
        self.tier_names = TierNames(
            self.gpu.name if self.gpu else None, self.cpu.name if self.cpu else None,
            tuple(tier.name for tier in self.remotes),
        )
        views = self.cpu.view if self.cpu else _no_cpu
        self.swap = None if self.cpu is None or self.gpu is None else SwapQueue(
            make_swapper(self.layout, self.gpu.tensors, self.cpu.buffer), self.gpu.tensors, self.runtime
        )
        self.mover = Mover(outbox, self.swap, self.lanes, self.runtime, views)
        planner = None if self.cpu is None else LoadPlanner(
            self.local, self.hierarchy, self.remote_writes, self.metrics, has_remotes=bool(self.lanes),
            versioned_remotes=any(lane.tier.capabilities.versioned for lane in self.lanes),
        )
        self.lookup = PrefixLookup(self.local, self.presence_cache, self.hierarchy, self.remote_writes, self.cost,
                                   self.tier_names, self.block_size)
        self.books = Books(self.local, self.hierarchy, self.remote_writes, planner, self.lookup, self.cost,
                           self.mover, self.metrics)
        for remote in self.remotes:
            if isinstance(remote, CodedTier) and self.cost is not None:  # an adaptive read may leave a chunk to prefill
                remote.recompute_seconds = self.books.recompute_seconds  # under the books' lock, from the tiers' loop
        self.reader = RemoteReader(self.lanes, self.layout.bytes_per_block, self.books)
        self.loads = None if self.cpu is None else LoadRunner(
            self.books, self.swap, self.reader, views, self.metrics, batch_blocks=queues.batch_blocks
        )
        self.explorer = None if self.cost is None or self.cpu is None or not self.lanes else Explorer(
            self.books, self.reader, self.books, self.runtime, views, self.metrics,
            bytes_per_block=self.layout.bytes_per_block, batch_blocks=queues.batch_blocks,
        )
        self.lookup.explore = self.explorer.start if self.explorer else None
        for lane in self.lanes:
            lane.link = self.books
            lane.tier.on_evicted(functools.partial(self.books.evicted, lane.index))

        self.names = list(self.tier_names.all)
        """Every tier's name, fastest first."""

    async def start_remotes(self) -> None:
        if self.events is not None:
            self.events.start()
            self.events.cleared()
        await asyncio.gather(*(tier.start() for tier in self.remotes))


    def hasher_of(self, namespace: Namespace | None) -> BlockHasher:
        """The keys of an engine's own namespace (``engine_namespace``), keyed with the topology's secret like the
        topology's; None: the topology's own (``model.id``)."""
        if namespace is None:
            return self.hasher
        hasher = self._hashers.get(namespace)
        if hasher is None:
            keyed, _ = topology_namespace(namespace, self.config.model.secret_env, self.config.source)
            hasher = self._hashers[namespace] = BlockHasher(keyed, self.block_size)
        return hasher
    def close(self) -> None:
        """Cancel explorations, finish or drop other work in flight within ``CLOSE_DRAIN_SECONDS``, close the
        remotes, stop the loop."""
        if self.explorer is not None:
            self.explorer.close()
        self.runtime.submit(self.runtime.drain(CLOSE_DRAIN_SECONDS), track=False).result()
        if self.swap is not None:
            self.swap.close()
        self.runtime.submit(close_remotes(self.runtime, self.remotes), track=False).result()
        self.runtime.stop()
        if self.events is not None:
            self.events.close()

    def run_load(
        self, transfer: Transfer, plan: list[LoadItem], force_latest: bool, deadline_s: float | None
    ) -> concurrent.futures.Future[int]:
        """Run a planned load on the background loop (a plan exists only where the topology has a CPU tier)."""
        if self.loads is None:
            raise RuntimeError("a load plan without a CPU tier")
        return self.runtime.submit(self.loads.run(transfer, plan, force_latest, deadline_s))

    def level_blocks(self) -> dict[str, int]:
        """Per codec level, the blocks the coded remote tiers' reads have filled so far (summed over tiers)."""
        served: dict[str, int] = {}
        for remote in self.remotes:
            if isinstance(remote, CodedTier):
                for level, blocks in remote.level_blocks().items():
                    served[level] = served.get(level, 0) + blocks
        return served

    def stats(self) -> dict[str, Any]:
        """See ``TierManager.stats``."""
        with self.books.lock:
            return self._stats()

    def _stats(self) -> dict[str, Any]:
        tiers: dict[str, Any] = {}
        for local in (self.gpu, self.cpu):  # the engine's own pool, when it keeps it, is not counted here
            if local is not None:
                tiers[local.name] = local.table.occupancy()
        for lane in self.lanes:
            tiers[lane.name] = lane_stats(lane)
        for name, values in self.metrics.snapshot().items():
            tiers.setdefault(name, {}).update(values)
        capacities = {tier.name: tier.capacity_blocks for tier in self.config.tiers}
        for name, curve in self.curves.items():
            tiers[name]["mrc"] = curve.summary(capacities[name] or curve.stats()["tracked_keys"] or 1)
        if self.cost is not None:
            for name, values in self.cost.stats()["tiers"].items():
                tiers.setdefault(name, {}).update(values)
        extra = {"events": self.events.stats()} if self.events is not None else {}
        return {
            **extra,
            "tiers": tiers,
            "queues": {
                "pending_stores": self.remote_writes.pending_stores,
                "waiting": {lane.name: lane.limiter.waiting for lane in self.lanes},
                "active": {lane.name: lane.limiter.active for lane in self.lanes},
                "in_flight_cpu_writes": len(self.books.waiters),
                "in_flight_copies": self.swap.in_flight if self.swap else 0,
            },
        }


def _event_sink(config: TierCacheConfig) -> Any:
    """The EventSink of an ``events: {enabled: true}`` topology (the ``events`` extra), else None."""
    if not config.events.enabled:
        return None
    from tiercache.telemetry.events.sink import EventSink  # msgspec (and pyzmq for an endpoint): the 'events' extra

    return EventSink.from_config(config.events, lora_name=config.model.lora)


def _no_cpu(slot: int) -> memoryview:
    raise RuntimeError("no CPU tier: remote tiers need one (the configuration requires it)")
