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
