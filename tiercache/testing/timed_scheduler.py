"""vLLM's own scheduler, timed: each step's ``schedule`` and ``update_from_output``, and the KV connector's hooks.

A benchmark names it with ``--scheduler-cls tiercache.testing.timed_scheduler.TimedScheduler`` and the file
``$TC_SCHEDULER_STEP_TIMES`` (``step_times``, which reads them back); the engine-core process then appends one JSON
line per step: the microseconds of ``schedule`` and of ``update_from_output``, of the connector's scheduler-side
hooks inside each and per hook (``CONNECTOR_HOOKS``, timed on the connector instance vLLM built), of the whole
step (the model's forward between them included), and the request counts. vLLM's CPU build schedules
synchronously (it turns async scheduling off), so this subclasses the scheduler it would use; nothing else
changes. Without the variable nothing is written.
"""

from __future__ import annotations

import functools
import json
import os
import time
from collections.abc import Callable
from typing import Any

from vllm.v1.core.sched.scheduler import Scheduler

from tiercache.testing.step_times import STEP_TIMES_ENV

CONNECTOR_HOOKS = ("get_num_new_matched_tokens", "update_state_after_alloc", "get_external_cache_hit_sources",
                   "get_loaded_kv_cache_group_ids", "has_pending_block_frees", "build_connector_meta",
                   "update_connector_output", "request_finished", "request_finished_all_groups",
                   "register_finished_partial_tail", "get_kv_connector_stats", "take_events",
                   "has_pending_push_work")
"""The connector's methods vLLM's scheduler calls (those a connector lacks are left alone)."""
NS_PER_US = 1000


class TimedScheduler(Scheduler):
    """``Scheduler`` writing each step's times to ``$TC_SCHEDULER_STEP_TIMES`` (see the module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        path = os.environ.get(STEP_TIMES_ENV)
        self._step_file = open(path, "a", buffering=1) if path else None  # noqa: SIM115  (open while vLLM runs)
        self._connector_ns = 0
        self._hook_ns: dict[str, int] = {}
        """This step's time in each hook, ``schedule`` and ``update_from_output`` together."""
        self._hook_depth = 0
        """Hooks running now (one calling another is timed once)."""
        self._step: dict[str, int] = {}
        self._step_started = 0
        if self.connector is not None:
            for name in CONNECTOR_HOOKS:
                hook = getattr(self.connector, name, None)
                if callable(hook):
                    setattr(self.connector, name, self._timed(name, hook))

    def _timed(self, name: str, hook: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(hook)
        def run(*args: Any, **kwargs: Any) -> Any:
            self._hook_depth += 1
            started = time.perf_counter_ns()
            try:
                return hook(*args, **kwargs)
            finally:
                self._hook_depth -= 1
                if not self._hook_depth:
                    elapsed = time.perf_counter_ns() - started
                    self._connector_ns += elapsed
                    self._hook_ns[name] = self._hook_ns.get(name, 0) + elapsed

        return run

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        self._connector_ns = 0
        self._hook_ns = {}
        self._step_started = started = time.perf_counter_ns()
        output = super().schedule(*args, **kwargs)
        ended = time.perf_counter_ns()
        self._step = {"schedule_us": (ended - started) // NS_PER_US,
                      "schedule_connector_us": self._connector_ns // NS_PER_US,
                      "scheduled_requests": len(output.num_scheduled_tokens),
                      "scheduled_tokens": output.total_num_scheduled_tokens}
        return output

    def update_from_output(self, *args: Any, **kwargs: Any) -> Any:
        self._connector_ns = 0
        started = time.perf_counter_ns()
        outputs = super().update_from_output(*args, **kwargs)
        ended = time.perf_counter_ns()
        if self._step_file is not None and self._step:
            running, waiting = self.get_request_counts()
            self._step_file.write(json.dumps({
                **self._step, "update_us": (ended - started) // NS_PER_US,
                "update_connector_us": self._connector_ns // NS_PER_US,
                "step_us": (ended - self._step_started) // NS_PER_US, "running": running, "waiting": waiting,
                "hooks_us": {name: ns // NS_PER_US for name, ns in self._hook_ns.items()},
            }) + "\n")
        self._step = {}
        return outputs

    def shutdown(self) -> None:
        super().shutdown()
        if self._step_file is not None:
            self._step_file.close()
            self._step_file = None
