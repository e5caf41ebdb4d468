"""Loopback TCP proxies in front of a real redis-server, for the fault tests.

``TrickleProxy`` forwards the server's replies a few bytes at a time (a slow
remote, never silent long enough to trip a socket timeout). ``CutProxy`` cuts
connections in the middle of a value, the way a server killing a client at its
output-buffer limit, a load balancer or a NAT timeout does: each value-sized
stretch of reply bytes it forwards is, with probability ``fraction``, the one
its connection is reset in (at a random byte of it). ``CountingProxy`` counts
the bursts of request bytes the client sends (a client that waits for a reply
before it sends more sends one burst per round trip).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import socket
import threading
from typing import Any

TRICKLE_BYTES = 2
TRICKLE_PAUSE_S = 0.005
STOP_TIMEOUT_S = 5.0
READ_BYTES = 65536
CUT_MARGIN_BYTES = 64
"""A cut lands at least this far inside a value (past its reply line, before its end)."""


class LoopbackProxy:
    """A proxy on its own event-loop thread; subclasses decide how replies are forwarded."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.connections = 0
        self.request_bursts = 0
        """Reads of request bytes from clients (a burst sent at once is read at once, up to ``READ_BYTES``)."""
        self.loop = asyncio.new_event_loop()
        with socket.socket() as spare:
            spare.bind(("127.0.0.1", 0))
            self.port = spare.getsockname()[1]
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def __enter__(self) -> Any:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._listen(), self.loop).result(STOP_TIMEOUT_S)
        return self

    def __exit__(self, *exc_info: object) -> None:
        async def stop() -> None:
            self._server.close()
            tasks = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(stop(), self.loop).result(STOP_TIMEOUT_S)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(STOP_TIMEOUT_S)

    async def _listen(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", self.port)

    async def _serve(self, client_reader: Any, client_writer: Any) -> None:
        """Forward one connection both ways; ends quietly when the server is gone or the proxy stops
        (a handler ending in an exception or cancelled is logged by asyncio as unhandled)."""
        self.connections += 1
        try:
            server_reader, server_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            client_writer.close()
            return
        replies = self.replies(client_writer, server_writer)

        async def pump(reader: Any, writer: Any, forward: Any) -> None:
            try:
                while data := await reader.read(READ_BYTES):
                    if not await forward(data):
                        return
            except (ConnectionError, asyncio.CancelledError):
                pass
            finally:
                writer.close()

        async def requests(data: bytes) -> bool:
            self.request_bursts += 1
            server_writer.write(data)
            await server_writer.drain()
            return True

        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(
                pump(client_reader, server_writer, requests),
                pump(server_reader, client_writer, replies),
                return_exceptions=True,
            )

    def replies(self, client: Any, server: Any) -> Any:
        """A coroutine function forwarding one connection's reply bytes; False: stop (the connection is gone)."""

        async def forward(data: bytes) -> bool:
            client.write(data)
            await client.drain()
            return True

        return forward


class TrickleProxy(LoopbackProxy):
    """With ``trickle`` set, replies come ``TRICKLE_BYTES`` at a time."""

    def __init__(self, target_port: int) -> None:
        super().__init__(target_port)
        self.trickle = False

    def replies(self, client: Any, server: Any) -> Any:
        async def forward(data: bytes) -> bool:
            step = TRICKLE_BYTES if self.trickle else len(data)
            for start in range(0, len(data), step):
                client.write(data[start : start + step])
                await client.drain()
                if self.trickle:
                    await asyncio.sleep(TRICKLE_PAUSE_S)
            return True

        return forward


class CutProxy(LoopbackProxy):
    """Resets connections in the middle of a value (``cuts`` counts them); seeded, so runs repeat."""

    def __init__(self, target_port: int, fraction: float, value_bytes: int, seed: int = 0) -> None:
        super().__init__(target_port)
        self.fraction = fraction
        self.value_bytes = value_bytes
        self.cuts = 0
        self._rng = random.Random(seed)

    def _cut_point(self) -> int | None:
        """Reply bytes this connection carries before it is cut: whole values, then part of one."""
        if self.fraction <= 0:
            return None
        values = 0
        while self._rng.random() >= self.fraction:
            values += 1
        return values * self.value_bytes + self._rng.randrange(CUT_MARGIN_BYTES, self.value_bytes - CUT_MARGIN_BYTES)

    def replies(self, client: Any, server: Any) -> Any:
        cut_at = self._cut_point()
        sent = 0

        async def forward(data: bytes) -> bool:
            nonlocal sent
            if cut_at is not None and sent + len(data) >= cut_at:
                client.write(data[: cut_at - sent])
                await client.drain()
                self.cuts += 1
                client.transport.abort()
                server.transport.abort()
                return False
            client.write(data)
            await client.drain()
            sent += len(data)
            return True

        return forward


class CountingProxy(LoopbackProxy):
    """Forwards both ways unchanged; ``request_bursts`` says how often a client sent."""
