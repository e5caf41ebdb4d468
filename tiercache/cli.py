"""The ``tiercache`` command: demo, simulate, inspect and stats.

* ``demo``: a multi-turn chat workload on a topology (default: the embedded one).
* ``simulate``: a timed multi-turn chat workload through a topology, with a
  progress bar, a summary table, a TTFT model, JSON and (with matplotlib) plots.
* ``inspect``: the validated topology, capacities, and a reachability probe of
  every remote tier (never raises on an unreachable store).
* ``stats``: the metrics of a running manager, read from its loopback
  ``StatsServer`` (``simulate --stats-port`` starts one; an engine can too), or
  from a JSON file that ``simulate --stats-out`` wrote.

The simulation core (``timed_requests``, ``simulate``, ``summary_table``,
``write_plots``) is also what ``benchmarks/multiturn.py`` runs.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import numpy as np
import torch
import yaml

from tiercache.config import ConfigError, TierCacheConfig, build_dataclass, default_config_path, load_config
from tiercache.demo import block_kv, format_report, read_block, run_workload, write_block
from tiercache.keys import BlockHasher
from tiercache.layout import KVLayout
from tiercache.manager import CapacityError, TierManager
from tiercache.metrics import StatsServer, fetch_stats, render_prometheus
from tiercache.reference_model import ModelSpec, PagedKV, ReferenceModel, prefill_seconds_per_token
from tiercache.workload import ChatWorkload

LOOKUP_RETRY_SECONDS = 0.0005
"""Pause between lookups while a remote tier's answer is pending."""
ALLOCATE_ATTEMPTS = 200
ALLOCATE_RETRY_SECONDS = 0.001
"""A full GPU pool may be waiting for write-through copies to unpin blocks: retry a while, then reject."""
MS_PER_SECOND = 1000.0
PROGRESS_WIDTH = 30
PROGRESS_STEPS = 50
"""On a terminal the progress bar is redrawn about this many times per run."""
PROGRESS_LOG_LINES = 5
"""Off a terminal (a log), it prints about this many lines per run."""
TIME_BINS = 20
"""Windows of the hit-ratio-over-time series."""
PREFILL_PROBE_TOKENS = 256
"""Prompt length at which the reference model's prefill cost per token is measured."""
PROBE_TIMEOUT_S = 2.0
"""How long ``inspect`` waits for each remote operation before calling it unreachable."""
EXIT_CONFIG_ERROR = 2
EXIT_UNAVAILABLE = 3


@dataclass(frozen=True)
class SessionWorkload:
    """A ``ChatWorkload`` on a clock: sessions start spread out and users think between rounds.

    Each user's session starts at a uniform time in ``[0, arrival_spread_s)``; each
    next round arrives after an exponential think time of mean ``think_time_s``.
    A one-off document (``chat.document_every``) arrives just before the request it
    precedes in ``ChatWorkload`` order. Time is simulated (nothing sleeps): it orders
    arrivals, interleaving sessions as a real server sees them, and labels the
    hit-ratio-over-time series.
    """

    chat: ChatWorkload = field(default_factory=ChatWorkload)
    think_time_s: float = 20.0
    arrival_spread_s: float = 60.0


@dataclass(frozen=True)
class TimedRequest:
    """One prompt at its simulated arrival time (``user`` -1: a one-off document)."""

    arrival_s: float
    user: int
    tokens: np.ndarray


PRESETS: dict[str, SessionWorkload] = {
    "chat": SessionWorkload(ChatWorkload(users=32, rounds=4, system_prompts=4, document_every=0)),
    "chat-scan": SessionWorkload(ChatWorkload(users=32, rounds=4, system_prompts=4, document_every=8)),
    "agents": SessionWorkload(
        ChatWorkload(users=8, rounds=8, system_prompts=1, system_tokens=1024, user_tokens=32, reply_tokens=128),
        think_time_s=2.0,
        arrival_spread_s=10.0,
    ),
    "tiny": SessionWorkload(ChatWorkload(users=4, rounds=2, system_prompts=1, system_tokens=64, document_every=5)),
}
"""Named workloads for ``simulate --workload NAME``."""


def load_workload(spec: str) -> SessionWorkload:
    """A preset name, or a YAML/JSON file of ``ChatWorkload`` fields plus ``think_time_s``/``arrival_spread_s``."""
    if spec in PRESETS:
        return PRESETS[spec]
    path = Path(spec)
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except OSError as error:
        raise ConfigError(
            spec, "", f"a preset ({', '.join(PRESETS)}) or a readable YAML/JSON file", error.strerror
        ) from None
    except yaml.YAMLError as error:
        raise ConfigError(spec, "", "valid YAML or JSON", str(error)) from None
    if not isinstance(data, Mapping):
        raise ConfigError(spec, "", "a mapping of workload fields", data)
    timing = {name: data[name] for name in ("think_time_s", "arrival_spread_s") if name in data}
    chat = {k: v for k, v in data.items() if k not in timing}
    return build_dataclass(SessionWorkload, {**timing, "chat": chat}, spec, "")


def timed_requests(workload: SessionWorkload) -> list[TimedRequest]:
    """The workload's prompts in arrival order (deterministic for a given seed)."""
    rng = np.random.default_rng(workload.chat.seed + 1)
    clocks = rng.uniform(0.0, workload.arrival_spread_s, workload.chat.users)
    timed: list[TimedRequest] = []
    documents: list[np.ndarray] = []
    for user, tokens in workload.chat.requests():
        if user < 0:
            documents.append(tokens)
            continue
        arrival = float(clocks[user])
        clocks[user] += rng.exponential(workload.think_time_s) if workload.think_time_s > 0 else 0.0
        timed.extend(TimedRequest(arrival, -1, document) for document in documents)
        documents.clear()
        timed.append(TimedRequest(arrival, user, tokens))
    timed.sort(key=lambda request: request.arrival_s)
    return timed


@dataclass
class RequestRecord:
    """What one request reused (tokens per tier), computed, and how long its loads took."""

    arrival_s: float
    prompt_tokens: int
    reused: dict[str, int]
    computed_tokens: int
    load_s: float
    ttft_s: float = 0.0


@dataclass
class SimulationResult:
    """A run's per-request records, the fitted costs and the manager's final stats."""

    name: str
    records: list[RequestRecord]
    tiers: list[str]
    prefill_s_per_token: float
    transfer_s_per_block: dict[str, float]
    wall_s: float
    mismatched_blocks: int
    rejected: int
    stats: dict[str, Any]

    def totals(self) -> dict[str, Any]:
        """Aggregates for tables and JSON."""
        prompt = sum(r.prompt_tokens for r in self.records)
        reused = {tier: sum(r.reused.get(tier, 0) for r in self.records) for tier in self.tiers}
        saved = sum(reused.values())
        ttfts = sorted(r.ttft_s for r in self.records)
        total_ttft = sum(ttfts)
        return {
            "requests": len(self.records),
            "rejected": self.rejected,
            "prompt_tokens": prompt,
            "reused_tokens": reused,
            "reused_share": {tier: count / max(prompt, 1) for tier, count in reused.items()},
            "prefill_tokens_saved": saved,
            "prefill_saved_share": saved / max(prompt, 1),
            "ttft_ms": {
                "mean": MS_PER_SECOND * total_ttft / max(len(ttfts), 1),
                "p50": MS_PER_SECOND * _quantile(ttfts, 0.5),
                "p90": MS_PER_SECOND * _quantile(ttfts, 0.9),
                "p99": MS_PER_SECOND * _quantile(ttfts, 0.99),
            },
            "ttft_ms_without_cache_mean": MS_PER_SECOND * self.prefill_s_per_token * prompt / max(len(self.records), 1),
            "modeled_prefill_tokens_per_s": prompt / total_ttft if total_ttft else math.inf,
            "wall_s": self.wall_s,
            "wall_requests_per_s": len(self.records) / self.wall_s if self.wall_s else 0.0,
            "wall_prompt_tokens_per_s": prompt / self.wall_s if self.wall_s else 0.0,
            "mismatched_blocks": self.mismatched_blocks,
        }

    def hit_ratio_over_time(self, bins: int = TIME_BINS) -> dict[str, Any]:
        """Per time window: the share of prompt tokens reused from each tier."""
        if not self.records:
            return {"window_end_s": [], "share": {tier: [] for tier in self.tiers}}
        end = max(r.arrival_s for r in self.records) or 1.0
        edges = [end * (i + 1) / bins for i in range(bins)]
        prompt = [0] * bins
        reused = {tier: [0] * bins for tier in self.tiers}
        for record in self.records:
            index = min(int(record.arrival_s / end * bins), bins - 1)
            prompt[index] += record.prompt_tokens
            for tier in self.tiers:
                reused[tier][index] += record.reused.get(tier, 0)
        share = {
            tier: [r / p if p else 0.0 for r, p in zip(counts, prompt, strict=True)] for tier, counts in reused.items()
        }
        return {"window_end_s": edges, "share": share}

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "totals": self.totals(),
            "prefill_ms_per_token": MS_PER_SECOND * self.prefill_s_per_token,
            "transfer_ms_per_block": {t: MS_PER_SECOND * s for t, s in self.transfer_s_per_block.items()},
            "hit_ratio_over_time": self.hit_ratio_over_time(),
            "ttft_ms": [MS_PER_SECOND * r.ttft_s for r in self.records],
            "stats": self.stats,
        }


def _quantile(ordered: Sequence[float], fraction: float) -> float:
    if not ordered:
        return 0.0
    return ordered[min(len(ordered) - 1, max(0, math.ceil(fraction * len(ordered)) - 1))]


def measure_prefill_cost(layout: KVLayout, tokens: int = PREFILL_PROBE_TOKENS) -> float:
    """Seconds per token of a prefill by the reference model shaped like ``layout`` (this machine's CPU)."""
    model = ReferenceModel(ModelSpec.for_layout(layout))
    blocks = math.ceil(tokens / layout.block_size)
    kv = PagedKV(layout, layout.allocate_pool(blocks, "cpu"))
    return prefill_seconds_per_token(model, kv, list(range(blocks)), tokens)


class Progress:
    """A plain-text progress bar (no dependency): redrawn in place on a terminal, a few lines in a log."""

    def __init__(self, total: int, label: str, stream: TextIO | None = None) -> None:
        self.total = max(total, 1)
        self.label = label
        self.stream = stream or sys.stderr
        self._tty = self.stream.isatty()
        self._every = max(1, self.total // (PROGRESS_STEPS if self._tty else PROGRESS_LOG_LINES))
        self._started = time.perf_counter()

    def update(self, done: int) -> None:
        if done % self._every and done != self.total:
            return
        filled = PROGRESS_WIDTH * done // self.total
        bar = "#" * filled + "." * (PROGRESS_WIDTH - filled)
        end = "\r" if self._tty and done < self.total else "\n"
        elapsed = time.perf_counter() - self._started
        self.stream.write(f"{self.label} [{bar}] {done}/{self.total} {elapsed:6.1f}s{end}")
        self.stream.flush()


def _serve(manager: TierManager, tokens: np.ndarray) -> tuple[dict[str, int], int, float, int]:
    """One request as an engine serves it: (tokens reused per tier, computed tokens, load seconds, bad blocks)."""
    block_size = manager.block_size
    hit = manager.lookup(tokens)
    while hit.pending:
        time.sleep(LOOKUP_RETRY_SECONDS)
        hit = manager.lookup(tokens)
    held = list(hit.gpu_block_ids)
    for attempt in range(ALLOCATE_ATTEMPTS):
        try:
            fresh = manager.allocate(len(hit.keys) - len(held))
            break
        except CapacityError:
            if attempt == ALLOCATE_ATTEMPTS - 1:
                manager.release(held)
                raise
            time.sleep(ALLOCATE_RETRY_SECONDS)
    reused = {manager.gpu.name: len(held) * block_size}
    loaded_blocks, load_s = 0, 0.0
    if hit.num_lower_blocks:
        started = time.perf_counter()
        loaded_blocks = manager.load(hit, fresh[: hit.num_lower_blocks]).result() // block_size
        load_s = time.perf_counter() - started
        remaining = loaded_blocks
        for name, count in list(hit.tier_blocks.items())[1:]:
            take = min(count, remaining)
            reused[name] = take * block_size
            remaining -= take
    mismatched = 0
    for position, block in enumerate(held + fresh[:loaded_blocks]):
        if not torch.equal(read_block(manager, block), block_kv(manager, hit.keys[position])):
            mismatched += 1
    for offset, block in enumerate(fresh[loaded_blocks:]):
        write_block(manager, block, block_kv(manager, hit.keys[len(held) + loaded_blocks + offset]))
    manager.store(tokens, held + fresh)
    manager.release(held + fresh)
    computed = len(tokens) - (len(held) + loaded_blocks) * block_size
    return reused, computed, load_s, mismatched


def simulate(
    manager: TierManager,
    requests: Sequence[TimedRequest],
    *,
    name: str = "run",
    prefill_s_per_token: float,
    progress: Callable[[int], None] | None = None,
) -> SimulationResult:
    """Serve ``requests`` in arrival order through ``manager`` and model each one's TTFT.

    Every reused block is checked against recomputation (``mismatched_blocks``).
    The TTFT model: ``computed tokens x prefill cost per token + loaded blocks x that
    tier's transfer cost per block``, where a tier's cost is the measured wall time of
    this run's loads, split over the tiers in proportion to the blocks each supplied.
    A GPU hit costs nothing. A request that finds no room in the GPU pool (longer than it, or pinned by copies
    for longer than about ``ALLOCATE_ATTEMPTS x ALLOCATE_RETRY_SECONDS``) is counted as rejected.
    """
    tiers = [manager.gpu.name] + ([manager.cpu.name] if manager.cpu else []) + [t.name for t in manager.remotes]
    records: list[RequestRecord] = []
    mismatched = rejected = 0
    started = time.perf_counter()
    for done, request in enumerate(requests, start=1):
        try:
            reused, computed, load_s, bad = _serve(manager, request.tokens)
        except CapacityError:
            rejected += 1
            continue
        mismatched += bad
        records.append(RequestRecord(request.arrival_s, len(request.tokens), reused, computed, load_s))
        manager.poll()
        if progress is not None:
            progress(done)
    wall_s = time.perf_counter() - started
    block_size = manager.block_size
    seconds = dict.fromkeys(tiers, 0.0)
    blocks = dict.fromkeys(tiers, 0)
    for record in records:
        lower = {t: n // block_size for t, n in record.reused.items() if t != manager.gpu.name and n}
        total = sum(lower.values())
        for tier, count in lower.items():
            seconds[tier] += record.load_s * count / total
            blocks[tier] += count
    cost = {tier: (seconds[tier] / blocks[tier] if blocks[tier] else 0.0) for tier in tiers}
    for record in records:
        record.ttft_s = record.computed_tokens * prefill_s_per_token + sum(
            cost[t] * n / block_size for t, n in record.reused.items()
        )
    return SimulationResult(
        name, records, tiers, prefill_s_per_token, cost, wall_s, mismatched, rejected, _jsonable(manager.stats())
    )


def _jsonable(value: Any) -> Any:
    return json.loads(json.dumps(value, default=str))


def summary_table(results: Iterable[SimulationResult]) -> str:
    """One row per run: reuse per tier, prefill saved, modeled TTFT, measured costs and wall throughput."""
    results = list(results)
    tiers = list(dict.fromkeys(t for r in results for t in r.tiers))
    header = (
        f"{'run':<28}{'reqs':>6}{'prompt tok':>11}"
        + "".join(f"{'reuse ' + t:>13}" for t in tiers)
        + f"{'saved':>8}{'TTFT p50':>10}{'TTFT p99':>10}{'no-cache':>10}{'req/s':>8}{'bad':>5}"
    )
    lines = [header, "-" * len(header)]
    for result in results:
        totals = result.totals()
        reuse = "".join(
            f"{totals['reused_share'][t]:>13.1%}" if t in totals["reused_share"] else f"{'-':>13}" for t in tiers
        )
        lines.append(
            f"{result.name:<28}{totals['requests']:>6}{totals['prompt_tokens']:>11}{reuse}"
            f"{totals['prefill_saved_share']:>8.1%}{totals['ttft_ms']['p50']:>8.1f}ms{totals['ttft_ms']['p99']:>8.1f}ms"
            f"{totals['ttft_ms_without_cache_mean']:>8.1f}ms{totals['wall_requests_per_s']:>8.1f}"
            f"{totals['mismatched_blocks']:>5}"
        )
    if results:
        lines.append(
            f"model: prefill {MS_PER_SECOND * results[0].prefill_s_per_token:.3f} ms/token (reference model, this "
            "CPU); TTFT = computed tokens x prefill + loaded blocks x the tier's measured ms/block:"
        )
    for result in results:
        costs = ", ".join(f"{t} {MS_PER_SECOND * s:.3f}" for t, s in result.transfer_s_per_block.items() if s)
        lines.append(f"  {result.name:<26}{costs or 'no loads from lower tiers'}")
    return "\n".join(lines)


def write_plots(results: Sequence[SimulationResult], prefix: Path) -> list[Path]:
    """Hit ratio per tier over time (one panel per run) and the TTFT distribution; [] without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("note: matplotlib is not installed (pip install 'tiercache[bench]'); skipping the PNG plots")
        return []
    written = []
    columns = min(3, len(results))
    rows = math.ceil(len(results) / columns)
    figure, axes = plt.subplots(rows, columns, figsize=(5 * columns, 3.2 * rows), squeeze=False, sharey=True)
    for axis, result in zip(axes.flat, results, strict=False):
        series = result.hit_ratio_over_time()
        for tier, share in series["share"].items():
            axis.plot(series["window_end_s"], share, marker=".", label=tier)
        axis.set_title(result.name, fontsize=9)
        axis.set_xlabel("simulated time (s)")
        axis.set_ylabel("prompt tokens reused")
        axis.legend(fontsize=7)
    for axis in list(axes.flat)[len(results) :]:
        axis.set_visible(False)
    figure.tight_layout()
    path = prefix.with_name(prefix.name + "_hit_ratio.png")
    figure.savefig(path, dpi=100)
    plt.close(figure)
    written.append(path)
    figure, axis = plt.subplots(figsize=(7, 4))
    for result in results:
        ttfts = sorted(MS_PER_SECOND * r.ttft_s for r in result.records)
        if ttfts:
            axis.plot(ttfts, np.arange(1, len(ttfts) + 1) / len(ttfts), label=result.name)
    axis.set_xscale("symlog")
    axis.set_xlabel("modeled TTFT (ms)")
    axis.set_ylabel("fraction of requests")
    axis.set_title("TTFT distribution (CDF)")
    axis.legend(fontsize=7)
    figure.tight_layout()
    path = prefix.with_name(prefix.name + "_ttft.png")
    figure.savefig(path, dpi=100)
    plt.close(figure)
    written.append(path)
    return written


# ---- commands ---------------------------------------------------------------------------
def _demo(args: argparse.Namespace) -> int:
    config_path = args.config or default_config_path()
    config = load_config(config_path)
    workload = ChatWorkload(users=args.users, rounds=args.rounds, seed=args.seed)
    print(f"tiercache demo: {config_path}")
    print(
        f"layout: {config.layout.num_layers} layers x {config.layout.num_kv_heads} kv heads x "
        f"{config.layout.head_dim} dims, {config.layout.dtype}, {config.layout.block_size} tokens/block "
        f"= {config.layout.bytes_per_block // 1024} KiB per block"
    )
    print("tiers: " + " -> ".join(f"{t.name} ({t.type})" for t in config.tiers))
    print(f"workload: {workload.users} users x {workload.rounds} rounds, shared system prompts\n")
    with TierManager(config) as manager:
        report = run_workload(manager, workload)
        print(format_report(manager, report))
    return 0 if report.mismatched_blocks == 0 else 1


def _simulate(args: argparse.Namespace) -> int:
    config_path = args.config or default_config_path()
    config = load_config(config_path)
    workload = load_workload(args.workload)
    requests = timed_requests(workload)
    print(f"tiercache simulate: {config_path}, workload {args.workload}: {len(requests)} requests")
    prefill = measure_prefill_cost(config.layout)
    name = Path(str(config_path)).stem
    with TierManager(config) as manager:
        server = (
            StatsServer(manager.stats, manager.metrics, port=args.stats_port) if args.stats_port is not None else None
        )
        if server is not None:
            server.start()
            print(f"serving stats at {server.url}/stats and {server.url}/metrics")
        try:
            progress = Progress(len(requests), name)
            result = simulate(manager, requests, name=name, prefill_s_per_token=prefill, progress=progress.update)
        finally:
            if server is not None:
                server.close()
    print(summary_table([result]))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    document = {"config": str(config_path), "workload": args.workload, "runs": [result.to_json()]}
    out.with_suffix(".json").write_text(json.dumps(document, indent=1))
    print(f"wrote {out.with_suffix('.json')}")
    if args.stats_out:
        Path(args.stats_out).write_text(json.dumps(result.stats, indent=1))
        print(f"wrote {args.stats_out}")
    if not args.no_plots:
        for path in write_plots([result], out):
            print(f"wrote {path}")
    return 0 if result.mismatched_blocks == 0 else 1


def _capacity_text(blocks: int | None, block_bytes: int) -> str:
    if blocks is None:
        return "bounded by the store"
    return f"{blocks} blocks = {blocks * block_bytes / 2**20:.1f} MiB"


async def probe_remote(tier: Any, key: bytes, block_bytes: int, timeout: float = PROBE_TIMEOUT_S) -> tuple[bool, str]:
    """Start the tier, write, find and delete a probe block; (reachable, detail). Never raises."""
    started = time.perf_counter()
    try:
        await asyncio.wait_for(tier.start(), timeout)
        written = await asyncio.wait_for(tier.put([key], [memoryview(bytes(block_bytes))]), timeout)
        found = await asyncio.wait_for(tier.contains([key]), timeout)
        await asyncio.wait_for(tier.delete([key]), timeout)
    except (asyncio.TimeoutError, TimeoutError):
        return False, f"no answer within {timeout:.1f}s"
    except Exception as error:
        return False, f"{type(error).__name__}: {error}"
    finally:
        try:
            await asyncio.wait_for(tier.close(), timeout)
        except Exception as error:
            print(f"  (closing {tier.name} failed: {error})", file=sys.stderr)
    elapsed_ms = (time.perf_counter() - started) * MS_PER_SECOND
    if written == [True] and found == [True]:
        return True, f"put/contains/delete of a probe block ok in {elapsed_ms:.1f} ms"
    return (
        False,
        f"probe write {'ok' if written == [True] else 'failed'}, read back {'ok' if found == [True] else 'failed'}",
    )


def inspect_topology(config: TierCacheConfig, timeout: float = PROBE_TIMEOUT_S) -> tuple[str, bool]:
    """A report of the validated topology and remote reachability, and whether every remote answered."""
    from tiercache.codec import Codec
    from tiercache.keys import Namespace
    from tiercache.tiers import tier_class
    from tiercache.tiers.base import RemoteContext

    layout = config.layout
    model = config.model
    namespace = Namespace(model.id, layout.fingerprint(), model.tp_rank, model.tenant, model.lora)
    lines = [
        f"topology: {config.source}",
        f"model: {model.id} (tp rank {model.tp_rank}, tenant {model.tenant}, lora {model.lora})",
        f"layout: {layout.num_layers} layers x {layout.num_kv_heads} kv heads x {layout.head_dim} dims, "
        f"{layout.dtype}, {layout.block_size} tokens/block, {layout.memory.value}: "
        f"{layout.bytes_per_block} bytes per block; fingerprint {layout.fingerprint()}",
        f"exclusive: {config.exclusive}; queues: "
        + ", ".join(f"{k} {getattr(v, 'value', v)}" for k, v in dataclasses.asdict(config.queues).items()),
        f"{'tier':<12}{'type':<11}{'policy':<9}{'write policy':<25}capacity",
    ]
    for tier in config.tiers:
        blocks = tier.capacity_blocks
        if blocks is None:
            blocks = getattr(tier.options, "capacity_blocks", None) or None
        lines.append(
            f"{tier.name:<12}{tier.type:<11}{tier.policy:<9}{tier.write_policy.value:<25}"
            f"{_capacity_text(blocks, layout.bytes_per_block)}"
        )
    remotes = [t for t in config.tiers if t.type not in ("gpu", "cpu")]
    all_ok = True
    if remotes:
        probe_key = BlockHasher(namespace, layout.block_size).keys([0] * layout.block_size, "tiercache-inspect")[0]
        codec = Codec(namespace.root())
        lines.append("connectivity:")
        for tier_config in remotes:
            try:
                tier = tier_class(tier_config.type)(
                    RemoteContext(tier_config.name, codec, layout.bytes_per_block), tier_config.options
                )
                ok, detail = asyncio.run(probe_remote(tier, probe_key, layout.bytes_per_block, timeout))
            except Exception as error:
                ok, detail = False, f"could not build the tier: {type(error).__name__}: {error}"
            all_ok &= ok
            lines.append(f"  {tier_config.name:<12}{'reachable' if ok else 'UNREACHABLE':<13}{detail}")
    return "\n".join(lines), all_ok


def _inspect(args: argparse.Namespace) -> int:
    config = load_config(args.config or default_config_path())
    report, ok = inspect_topology(config, args.timeout)
    print(report)
    return 0 if ok else EXIT_UNAVAILABLE


def format_stats(stats: Mapping[str, Any]) -> str:
    """A table of ``TierManager.stats()``: one row per tier and counter, then queue depths."""
    lines = [f"{'tier':<12}{'metric':<32}value"]
    for tier, values in stats.get("tiers", {}).items():
        for name, value in sorted(values.items()):
            if isinstance(value, Mapping):
                value = ", ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}" for k, v in value.items())
            lines.append(f"{tier:<12}{name:<32}{value}")
    for name, value in stats.get("queues", {}).items():
        lines.append(f"{'queues':<12}{name:<32}{value}")
    return "\n".join(lines)


def _stats(args: argparse.Namespace) -> int:
    if args.file:
        stats = json.loads(Path(args.file).read_text())
    else:
        try:
            stats = fetch_stats(args.url, timeout=args.timeout)
        except OSError as error:
            print(f"tiercache: no stats server at {args.url}: {error}", file=sys.stderr)
            return EXIT_UNAVAILABLE
    print(render_prometheus(stats) if args.prometheus else format_stats(stats))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tiercache", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="multi-turn chat through a topology (default: embedded)")
    demo.add_argument("--config", help="YAML topology (default: the embedded configs/default.yaml)")
    demo.add_argument("--users", type=int, default=16)
    demo.add_argument("--rounds", type=int, default=5)
    demo.add_argument("--seed", type=int, default=0)
    demo.set_defaults(handler=_demo)

    sim = commands.add_parser("simulate", help="a timed chat workload: summary table, TTFT model, JSON and plots")
    sim.add_argument("--config", help="YAML topology (default: the embedded one)")
    sim.add_argument(
        "--workload", default="chat", help=f"a preset ({', '.join(PRESETS)}) or a YAML/JSON file of ChatWorkload fields"
    )
    sim.add_argument("--out", default="tiercache-simulate", help="path prefix of the JSON and PNG outputs")
    sim.add_argument("--no-plots", action="store_true", help="write no PNG files")
    sim.add_argument("--stats-port", type=int, help="serve /stats and /metrics on 127.0.0.1:PORT while running")
    sim.add_argument("--stats-out", help="write the manager's final stats() as JSON here (for `tiercache stats`)")
    sim.set_defaults(handler=_simulate)

    inspect = commands.add_parser("inspect", help="validated topology, capacities, remote reachability")
    inspect.add_argument("--config", help="YAML topology (default: the embedded one)")
    inspect.add_argument("--timeout", type=float, default=PROBE_TIMEOUT_S, help="seconds per remote operation")
    inspect.set_defaults(handler=_inspect)

    stats = commands.add_parser("stats", help="metrics of a running manager (its StatsServer) or a stats JSON file")
    source = stats.add_mutually_exclusive_group(required=True)
    source.add_argument("--url", help="e.g. http://127.0.0.1:9400 (a StatsServer)")
    source.add_argument("--file", help="a JSON file written by `simulate --stats-out`")
    stats.add_argument("--prometheus", action="store_true", help="print the Prometheus text exposition")
    stats.add_argument("--timeout", type=float, default=PROBE_TIMEOUT_S)
    stats.set_defaults(handler=_stats)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.handler(args)
    except ConfigError as error:
        print(f"tiercache: configuration error: {error}", file=sys.stderr)
        return EXIT_CONFIG_ERROR


if __name__ == "__main__":
    sys.exit(main())
