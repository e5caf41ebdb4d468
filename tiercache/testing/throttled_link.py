"""ThrottledLink: a TCP proxy that gives a loopback store the bandwidth and round trip of a slower link.

The codec benchmark's link table and the served suite's throttled restart put it
between an engine and ``redis-server``: each direction is one queue at the
link's rate (a piece leaves when the link has sent the ones before it), plus
half the round trip of delay.
"""

from __future__ import annotations

import asyncio
import socket
import threading

BITS_PER_BYTE = 8
PROXY_CHUNK = 64 << 10
"""Bytes the proxy reads and forwards at a time."""


class ThrottledLink:
    """A TCP proxy from a local port to ``upstream`` at ``bits_per_s`` each way with ``round_trip_s`` of delay."""

    def __init__(self, upstream: tuple[str, int], bits_per_s: float, round_trip_s: float) -> None:
        self.upstream = upstream
        self.bytes_per_s = bits_per_s / BITS_PER_BYTE
        self.one_way_s = round_trip_s / 2
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._server: asyncio.Server | None = None
        self._free_at = {"up": 0.0, "down": 0.0}
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> ThrottledLink:
        self._thread.start()
        self._ready.wait()
        return self

    def __exit__(self, *exc: object) -> None:
        asyncio.run_coroutine_threadsafe(self._shut(), self._loop).result()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._server = self._loop.run_until_complete(asyncio.start_server(self._serve, "127.0.0.1", 0))
        self.port = self._server.sockets[0].getsockname()[1]
        self._ready.set()
        self._loop.run_forever()

    async def _shut(self) -> None:
        """Stop accepting, and end every connection's pumps."""
        if self._server is not None:
            self._server.close()
        tasks = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection(*self.upstream)
        for stream in (writer, up_writer):
            stream.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            await asyncio.gather(self._pump(reader, up_writer, "up"), self._pump(up_reader, writer, "down"))
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.CancelledError):
            pass  # the client left, or the link is shutting down: the connection simply ends
        finally:
            for stream in (writer, up_writer):
                stream.close()

    async def _pump(self, source: asyncio.StreamReader, sink: asyncio.StreamWriter, direction: str) -> None:
        """Forward each piece when the link has sent it (bandwidth, one queue per direction) plus the delay."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

        async def deliver() -> None:
            while True:
                at, data = await queue.get()
                if not data:
                    return
                await asyncio.sleep(max(0.0, at - loop.time()))
                sink.write(data)
                await sink.drain()

        delivering = asyncio.ensure_future(deliver())
        try:
            while data := await source.read(PROXY_CHUNK):
                sent = max(loop.time(), self._free_at[direction]) + len(data) / self.bytes_per_s
                self._free_at[direction] = sent
                queue.put_nowait((sent + self.one_way_s, data))
            queue.put_nowait((0.0, b""))
            await delivering
        finally:
            delivering.cancel()
        sink.close()
