"""A remote that is slow rather than dead: a trickling proxy in front of a real redis-server.

The proxy forwards the server's replies a few bytes at a time, never silent for
long enough to trip a socket timeout. Lookups then miss their deadline; the
transfer lane counts each as a failure, opens, answers misses at once while it
is open, and closes again by itself once the remote answers in time.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from typing import Any

import numpy as np
from manager_helpers import TINY_LAYOUT, block_kv, topology, write_block

from tiercache.manager import TierManager

BLOCK = TINY_LAYOUT["block_size"]
TRICKLE_BYTES = 2
TRICKLE_PAUSE_S = 0.005
WAIT_S = 20.0
"""Upper bound on waiting for background work (a hang detector, never a speed judgement)."""


class TrickleProxy:
    """A loopback TCP proxy; with ``trickle`` set, replies come ``TRICKLE_BYTES`` at a time."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.trickle = False
        self.loop = asyncio.new_event_loop()
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    def __enter__(self) -> TrickleProxy:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._listen(), self.loop).result(5)
        return self

    def __exit__(self, *exc_info: object) -> None:
        async def stop() -> None:
            self._server.close()
            tasks = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(stop(), self.loop).result(5)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)

    async def _listen(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", self.port)

    async def _serve(self, client_reader: Any, client_writer: Any) -> None:
        server_reader, server_writer = await asyncio.open_connection("127.0.0.1", self.target_port)

        async def pump(reader: Any, writer: Any, slow: bool) -> None:
            try:
                while data := await reader.read(65536):
                    if slow and self.trickle:
                        for start in range(0, len(data), TRICKLE_BYTES):
                            writer.write(data[start : start + TRICKLE_BYTES])
                            await writer.drain()
                            await asyncio.sleep(TRICKLE_PAUSE_S)
                    else:
                        writer.write(data)
                        await writer.drain()
            except (ConnectionError, asyncio.CancelledError):
                pass
            finally:
                writer.close()

        await asyncio.gather(
            pump(client_reader, server_writer, False), pump(server_reader, client_writer, True), return_exceptions=True
        )


def until(condition: Any) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.005)


def test_a_trickling_remote_opens_the_lane_and_it_recovers_by_itself(redis_server: Any) -> None:
    with TrickleProxy(redis_server.port) as proxy:
        remote = {
            "name": "redis",
            "type": "redis",
            "write_policy": "write_through",
            "options": {"url": f"redis://127.0.0.1:{proxy.port}", "allow_unbounded": True},
        }
        config = topology(8, 8, remotes=[remote], queues={"remote_lookup_timeout_ms": 40})
        with TierManager(config) as manager:
            wanted, other = np.arange(8 * BLOCK), np.arange(8 * BLOCK) + 10_000
            for tokens in (wanted, other):
                keys = manager.hasher.keys(tokens)
                ids = manager.allocate(8)
                for key, block in zip(keys, ids, strict=True):
                    write_block(manager, block, block_kv(manager, key))
                manager.store(tokens, ids).result(WAIT_S)
                manager.release(ids)
                until(lambda: manager.stats()["queues"]["pending_stores"] == 0)
            proxy.trickle = True
            for _ in range(8):
                manager.release(manager.lookup_wait(wanted, timeout_s=WAIT_S))
            lane = manager.stats()["tiers"]["redis"]
            assert lane["deadline_misses"] >= 3 and lane["lane_breaker_opened"] >= 1
            assert lane["lane_open_skips"] >= 1, "an open lane answers misses without asking the remote"
            proxy.trickle = False

            def recovered() -> bool:
                hit = manager.lookup_wait(wanted, timeout_s=WAIT_S)
                manager.release(hit)
                return hit.tier_blocks["redis"] == 8

            until(recovered)


RECOMPUTE_TOKENS_PER_S = 80.0
"""The engine's prefill rate in the cost-model test: a 4-block prompt (8 tokens) recomputes in 100 ms."""
SLOW_MS, FAST_MS = 300.0, 1.0
"""The simulated remote's round trip while slow (fetching is slower than recomputing) and once fast again:
a hundred times apart, so the machine's load cannot blur them."""
LOOKUP_TIMEOUT_MS = 2000.0
"""Long enough that a slow remote's probes are answered (the cost model, not the deadline, decides)."""
PROMPT_BLOCKS = 4


def test_the_cost_model_uses_a_remote_again_within_two_lookups_after_it_is_fast_again() -> None:
    """Through the manager: the lookups' probes carry the remote's round trip into the cost model.

    Each request asks for a prompt only the remote holds. While the remote is slow its part is
    recomputed (after one fetch that teaches the model); once it is fast again the second request
    loads from it, with no request made to wait on a slow fetch to find that out.
    """
    remote = {"name": "remote", "type": "simulated", "write_policy": "write_through", "options": {"latency_ms": 0}}
    cost = {"enabled": True, "prefill_tokens_per_s": RECOMPUTE_TOKENS_PER_S}
    queues = {"remote_lookup_timeout_ms": LOOKUP_TIMEOUT_MS}
    config = topology(PROMPT_BLOCKS, PROMPT_BLOCKS, remotes=[remote], cost=cost, queues=queues)
    prompts = [np.arange(PROMPT_BLOCKS * BLOCK) + 1000 * i for i in range(16)]
    with TierManager(config) as manager:
        for tokens in prompts + prompts[:2]:  # every prompt written through to the remote, then out of GPU and CPU
            keys = manager.hasher.keys(tokens)
            ids = manager.allocate(len(keys), tokens)
            for key, block in zip(keys, ids, strict=True):
                write_block(manager, block, block_kv(manager, key))
            manager.store(tokens, ids).result(WAIT_S)
            manager.release(ids)
            until(lambda: manager.stats()["queues"]["pending_stores"] == 0)

        def served_by_remote(tokens: np.ndarray) -> bool:
            hit = manager.lookup_wait(tokens, timeout_s=WAIT_S)
            ids = manager.allocate(PROMPT_BLOCKS - len(hit.gpu_block_ids), tokens)
            loaded = manager.load(hit, ids[: hit.num_lower_blocks]).result(WAIT_S)
            manager.release(hit.gpu_block_ids + ids)
            return loaded > 0 and hit.tier_blocks["remote"] == PROMPT_BLOCKS

        manager.remotes[0].options.latency_ms = SLOW_MS
        slow = [served_by_remote(tokens) for tokens in prompts[2:8]]
        assert slow[1:] == [False] * 5, "slower to fetch than to recompute: bypassed"
        manager.remotes[0].options.latency_ms = FAST_MS
        fast = [served_by_remote(tokens) for tokens in prompts[8:]]
        assert fast[2:] == [True] * 6, f"the remote is used again from the second or third lookup on: {fast}"
        stats = manager.stats()["tiers"]["remote"]
        assert stats["explored"] == 0 and stats["round_trip_s"] < SLOW_MS / 1000
