"""vLLM transfer jobs in flight on a ``RemoteStore``, each reported finished exactly once.

A job is the store's future for its keys plus what vLLM's ``JobResult`` needs.
The thread that finishes a job's future only stamps its end time and queues it
(its done callback); the scheduler thread collects the queued jobs in
``finished``, so every submitted id comes back once, and only once, whatever
the store answered, including a failure or a cancelled future at close. A step
costs the jobs that finished, never the jobs in flight.
"""

from __future__ import annotations

import concurrent.futures
import time
from collections import deque
from dataclasses import dataclass

from vllm.v1.kv_offload.base import OffloadKey


@dataclass
class Job:
    """One submitted store (cascade) or load (promotion)."""

    job_id: int
    keys: list[OffloadKey]
    is_promotion: bool
    future: concurrent.futures.Future[list[bool]]
    started: float
    ended: float = 0.0

    def outcome(self) -> list[bool]:
        """Per key, whether it moved; all False when the future failed or was cancelled."""
        try:
            oks = self.future.result(timeout=0)
        except BaseException:
            return [False] * len(self.keys)
        return oks if len(oks) == len(self.keys) else [False] * len(self.keys)


class JobBook:
    """Jobs in flight; ``finished`` hands each one back once."""

    def __init__(self) -> None:
        self._jobs: dict[int, Job] = {}
        self._ended: deque[Job] = deque()
        """Jobs whose futures are done, queued by their done callbacks (any thread)."""

    def add(
        self, job_id: int, keys: list[OffloadKey], is_promotion: bool, future: concurrent.futures.Future[list[bool]]
    ) -> None:
        if job_id in self._jobs:
            raise ValueError(f"job {job_id} is already in flight")
        job = Job(job_id, keys, is_promotion, future, time.monotonic())
        self._jobs[job_id] = job
        future.add_done_callback(lambda _: self._end(job))

    def _end(self, job: Job) -> None:
        job.ended = time.monotonic()
        self._ended.append(job)

    def finished(self) -> list[Job]:
        """Jobs that finished since the last call (never one twice)."""
        done = []
        while self._ended:
            job = self._ended.popleft()
            if self._jobs.pop(job.job_id, None) is job:
                done.append(job)
        return done

    def wait_all(self) -> None:
        """Block until every job in flight has finished (its result is then waiting in ``finished``)."""
        jobs = list(self._jobs.values())
        concurrent.futures.wait([job.future for job in jobs])
        for job in jobs:  # wait() may return before a future's callbacks ran: queue those (twice is harmless)
            if not job.ended:
                self._end(job)

    def __len__(self) -> int:
        return len(self._jobs)
