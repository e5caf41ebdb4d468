"""Loads beside a running batch (``vllm_serve.py``): what a long remote hit's load does to the requests decoding.

A writer server stores ``HITS`` long prompts in Redis and stops. A fresh reader
server (the README's Redis line, with ``loads`` set to ``sync`` or ``async``)
streams ``DECODE_TOKENS`` tokens of an unrelated prompt; once ``LEAD_TOKENS``
have arrived, a client sends the stored prompts one after the other (one token
each, non-streamed), each a load of the whole prompt from Redis. Per mode: the
decode's inter-token gaps before the first hit was sent (the baseline) and
while the hits were being served (their median, p90 and largest), and the hits'
own time to first token. A synchronous load copies a hit's pages into vLLM's
blocks in the step that schedules it, before that step's forward, so the
decode's token of that step waits for the copy; an asynchronous one is copied
after the step's forward was launched and joins the batch a step later.
"""

from __future__ import annotations

import itertools
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from restart_rows import connector_line, written_down

from tiercache.testing.redis_servers import RedisServer
from tiercache.testing.vllm_server import Streamed, VllmServer

MODES = ("sync", "async")
DECODE_TOKENS = 160
"""The running request's length (streamed)."""
LEAD_TOKENS = 20
"""Tokens of the running request before the first hit is sent (its baseline gaps)."""
HITS = 3
"""Stored prompts sent while it decodes."""


def _gaps(arrivals: list[float], start: float, end: float) -> list[float]:
    """Inter-token gaps (seconds) of the chunks that arrived between ``start`` and ``end`` (seconds from the
    stream's request)."""
    return [later - earlier for earlier, later in itertools.pairwise(arrivals) if start <= later <= end]


def measure_mode(model: Path, hits: list[list[int]], decode_prompt: list[int], mode: str,
                 make_server: Callable[..., VllmServer], base: dict[str, Any], cpu_bytes: str,
                 args: list[str]) -> dict[str, Any]:
    """One mode: the decode's gaps before and while the hits load, and the hits' TTFTs."""
    with tempfile.TemporaryDirectory() as files, RedisServer(Path(files) / "redis", maxmemory="4gb").start() as redis:
        line = connector_line([{"type": "redis", "options": {"url": redis.url}}], base, cpu_bytes)
        with make_server(model, f"beside_writer_{mode}", line, args) as writer:
            writer.warm_up()
            for prompt in hits:
                writer.complete(prompt, max_tokens=1)
            written_down(redis)
        reader_line = {**line, "kv_connector_extra_config": {**line["kv_connector_extra_config"], "loads": mode}}
        with make_server(model, f"beside_reader_{mode}", reader_line, args) as reader:
            reader.warm_up()
            streamed: list[Streamed] = []
            started = time.perf_counter()
            decode = threading.Thread(target=lambda: streamed.append(reader.stream(decode_prompt, DECODE_TOKENS)))
            decode.start()
            while reader.metrics().total("vllm:generation_tokens_total") < LEAD_TOKENS:
                time.sleep(0.05)
            sent = time.perf_counter() - started
            answers = [reader.complete(prompt, max_tokens=1) for prompt in hits]
            served = time.perf_counter() - started
            decode.join()
    arrivals = streamed[0].arrivals
    before, during = _gaps(arrivals, 0.0, sent), _gaps(arrivals, sent, served)
    ordered = sorted(during)
    return {
        "baseline_gap_ms": 1000 * statistics.median(before),
        "gap_median_ms": 1000 * statistics.median(during), "gap_p90_ms": 1000 * ordered[int(0.9 * (len(ordered) - 1))],
        "gap_max_ms": 1000 * ordered[-1], "hit_ttft_ms": [round(1000 * a.seconds, 1) for a in answers],
        "decode_tokens": len(streamed[0].token_ids),
    }


def print_rows(label: str, result: dict[str, dict[str, Any]]) -> None:
    print(f"{label}: a decode's inter-token gaps while {HITS} long Redis hits load (ms)")
    for mode, row in result.items():
        print(f"  {mode:5}: baseline {row['baseline_gap_ms']:.0f}, while loading median {row['gap_median_ms']:.0f} "
              f"p90 {row['gap_p90_ms']:.0f} max {row['gap_max_ms']:.0f}; hits' TTFT {row['hit_ttft_ms']}")
