"""Timed multi-turn simulations through a topology: the core of ``tiercache simulate``.

``timed_requests`` puts a ``ChatWorkload`` on a clock, ``simulate`` serves it with
the toy engine of ``tiercache.tools.demo`` (every reused block checked against
recomputation) and models each request's time to first token, ``summary_table``
and ``write_plots`` report it. ``benchmarks/multiturn.py`` runs the same code.
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import numpy as np
import yaml

from tiercache.blocks.layout import KVLayout
from tiercache.common.units import MS_PER_SECOND
from tiercache.config import ConfigError, build_dataclass
from tiercache.manager.tier_manager import CapacityError, TierManager
from tiercache.tools.demo import serve
from tiercache.tools.reference_model import ModelSpec, PagedKV, ReferenceModel, prefill_seconds_per_token
from tiercache.tools.workload import ChatWorkload

ALLOCATE_ATTEMPTS = 200
"""A full GPU pool may be waiting for write-through copies to unpin blocks: retry a while, then reject."""
PROGRESS_WIDTH = 30
PROGRESS_STEPS = 50
"""On a terminal the progress bar is redrawn about this many times per run."""
PROGRESS_LOG_LINES = 5
"""Off a terminal (a log), it prints about this many lines per run."""
TIME_BINS = 20
"""Windows of the hit-ratio-over-time series."""
PREFILL_MEASURED_TOKENS = 256
"""Prompt length at which the reference model's prefill cost per token is measured."""


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


def measure_prefill_cost(layout: KVLayout, tokens: int = PREFILL_MEASURED_TOKENS) -> float:
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
    for longer than about ``ALLOCATE_ATTEMPTS`` retries) is counted as rejected.
    """
    tiers = manager.parts.names
    records: list[RequestRecord] = []
    mismatched = rejected = 0
    started = time.perf_counter()
    for done, request in enumerate(requests, start=1):
        try:
            served = serve(manager, request.tokens, allocate_attempts=ALLOCATE_ATTEMPTS)
        except CapacityError:
            rejected += 1
            continue
        mismatched += served.mismatched_blocks
        records.append(
            RequestRecord(
                request.arrival_s, len(request.tokens), served.reused, served.computed_tokens, served.load_seconds
            )
        )
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
        + f"{'saved':>8}{'TTFT p50':>10}{'TTFT p99':>10}{'uncached avg':>14}{'req/s':>8}{'bad':>5}"
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
            f"{totals['ttft_ms_without_cache_mean']:>12.1f}ms{totals['wall_requests_per_s']:>8.1f}"
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
        print("note: matplotlib is not installed (the bench extra: pip install '.[bench]'); skipping the PNG plots")
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
