"""The per-step times ``timed_scheduler.TimedScheduler`` writes in a vLLM server, read back (no vLLM import).

A benchmark starts the server with ``--scheduler-cls`` ``TIMED_SCHEDULER`` and ``STEP_TIMES_ENV`` naming a file,
takes ``StepLog.mark()`` before a pass and ``StepLog.since(mark)`` after it (the steps of that pass, one dict
each, microseconds), and ``summarize_steps`` gives their percentiles and the connector's share of the
scheduler's time.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

STEP_TIMES_ENV = "TC_SCHEDULER_STEP_TIMES"
"""The environment variable naming the file a server's ``TimedScheduler`` appends its steps to (not ``TIERCACHE_``:
tiercache reads those as overrides of its topology)."""
TIMED_SCHEDULER = "tiercache.testing.timed_scheduler.TimedScheduler"
"""What ``--scheduler-cls`` names."""
PERCENTILES = (50, 90, 99)
US_PER_MS = 1000.0
Step = dict[str, Any]
"""One step: ``schedule_us``, ``schedule_connector_us``, ``update_us``, ``update_connector_us``, ``step_us``,
``scheduled_requests``, ``scheduled_tokens``, ``running``, ``waiting``, and ``hooks_us``: per connector hook called,
its microseconds."""


class StepLog:
    """One server's step file (it may not exist yet: a server writes it once it steps)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def mark(self) -> int:
        """Where the file ends now."""
        return self.path.stat().st_size if self.path.exists() else 0

    def since(self, mark: int) -> list[Step]:
        """The steps written after ``mark`` (whole lines only)."""
        if not self.path.exists():
            return []
        with self.path.open("rb") as file:
            file.seek(mark)
            text = file.read().decode()
        return [json.loads(line) for line in text.splitlines(keepends=True) if line.endswith("\n")]


def percentile(values: Sequence[float], percent: float) -> float:
    """The nearest-rank ``percent``-th percentile of ``values`` (0.0 for none)."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(percent / 100 * (len(ordered) - 1)))]


def spread(values_us: Sequence[float]) -> dict[str, float]:
    """``p50_ms``, ``p90_ms``, ``p99_ms`` of microsecond values."""
    return {f"p{percent}_ms": percentile(values_us, percent) / US_PER_MS for percent in PERCENTILES}


def summarize_steps(steps: Sequence[Step]) -> dict[str, Any]:
    """Percentiles over every step (those that scheduled nothing, e.g. while every request waited for a lookup,
    counted in ``empty_steps`` too): ``schedule``, ``update`` (``update_from_output``), the scheduler's part of a
    step (both), the connector's hooks within it, the whole step; the connector's share of the scheduler's time and
    the scheduler's of the steps' (sums over the steps); each connector hook's mean per step; the requests running
    and waiting."""
    hooks: dict[str, int] = {}
    for step in steps:
        for name, micros in step.get("hooks_us", {}).items():
            hooks[name] = hooks.get(name, 0) + micros
    scheduler = [step["schedule_us"] + step["update_us"] for step in steps]
    connector = [step["schedule_connector_us"] + step["update_connector_us"] for step in steps]
    step_us = [step["step_us"] for step in steps]
    return {
        "steps": len(steps),
        "empty_steps": sum(not step["scheduled_tokens"] for step in steps),
        "schedule": spread([step["schedule_us"] for step in steps]),
        "update": spread([step["update_us"] for step in steps]),
        "scheduler": spread(scheduler),
        "connector": spread(connector),
        "schedule_connector": spread([step["schedule_connector_us"] for step in steps]),
        "step": spread(step_us),
        "connector_share_of_scheduler": sum(connector) / sum(scheduler) if sum(scheduler) else 0.0,
        "connector_hooks_mean_ms": {name: micros / len(steps) / US_PER_MS for name, micros in sorted(hooks.items())},
        "scheduler_share_of_step": sum(scheduler) / sum(step_us) if sum(step_us) else 0.0,
        "running_p50": percentile([step["running"] for step in steps], 50),
        "running_max": max((step["running"] for step in steps), default=0),
        "waiting_max": max((step["waiting"] for step in steps), default=0),
    }
