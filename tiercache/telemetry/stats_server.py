"""A running manager's stats over HTTP on loopback (JSON and Prometheus text), and the client that reads them."""

from __future__ import annotations

import http.server
import json
import threading
import urllib.request
from collections.abc import Callable, Mapping
from http import HTTPStatus
from typing import Any

from tiercache.telemetry.counters import Metrics
from tiercache.telemetry.prometheus import PROMETHEUS_CONTENT_TYPE, render_prometheus

LOOPBACK = "127.0.0.1"
FETCH_TIMEOUT_S = 2.0
"""How long ``fetch_stats`` waits for a server's answer by default."""


class StatsServer:
    """Serves a running manager's stats on a loopback port, for ``tiercache stats`` and Prometheus.

    ``GET /stats`` answers ``stats()`` as JSON, ``GET /metrics`` the Prometheus
    text. It binds 127.0.0.1 only (the numbers are not secret, but a cache should
    not open a port to the network by default); port 0 picks a free one. Runs on
    a daemon thread; each request takes the manager's lock briefly through ``stats``.
    """

    def __init__(self, stats: Callable[[], Mapping[str, Any]], metrics: Metrics | None = None, port: int = 0) -> None:
        self._stats = stats
        self._metrics = metrics
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                route = self.path.split("?", 1)[0]
                if route == "/stats":
                    body, kind = json.dumps(server._stats(), default=str).encode(), "application/json"
                elif route == "/metrics":
                    body, kind = render_prometheus(server._stats(), server._metrics).encode(), PROMETHEUS_CONTENT_TYPE
                else:
                    self.send_error(HTTPStatus.NOT_FOUND, "try /stats or /metrics")
                    return
                self.send_response(HTTPStatus.OK)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                return None

        self._server = http.server.ThreadingHTTPServer((LOOPBACK, port), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, name="tiercache-stats", daemon=True)

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> StatsServer:
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop serving and free the port (safe whether or not it was started)."""
        if self._thread.is_alive():
            self._server.shutdown()
            self._thread.join()
        self._server.server_close()

    def __enter__(self) -> StatsServer:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def fetch_stats(url: str, timeout: float = FETCH_TIMEOUT_S) -> dict[str, Any]:
    """``GET {url}/stats`` from a ``StatsServer`` (raises ``OSError`` when unreachable)."""
    with urllib.request.urlopen(f"{url.rstrip('/')}/stats", timeout=timeout) as response:
        return json.loads(response.read())
