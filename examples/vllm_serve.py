"""Serve a small model with vLLM and tiercache's KV connector, restart the server, and see the prefill skipped.

    .venv-vllm-cpu/bin/python examples/vllm_serve.py                                 # Redis at 127.0.0.1:6379
    .venv-vllm-cpu/bin/python examples/vllm_serve.py --redis-url redis://127.0.0.1:6390
    .venv-vllm-cpu/bin/python examples/vllm_serve.py --cpu-only                      # no Redis at all

No model hub is needed: the model is a tiny random-weight Llama built in a local
directory (``tiercache.testing.tiny_llama``; prompts are token ids). The example
starts vLLM's OpenAI server (``python -m vllm.entrypoints.openai.api_server``:
the CPU build's ``vllm`` command is broken) with README's connector line, sends
a long prompt and stops the server; then it starts a second server, a fresh
process over the same Redis, and sends the prompt again. It prints both times to
first token, the external prefix-cache hits vLLM counted (tokens the connector
loaded instead of prefilling) and whether both servers produced the same tokens.
With ``--cpu-only`` the CPU tier lives in the server's memory and ends with it,
so instead of a restart the example empties vLLM's own prefix cache and asks the
same server again: the prompt then comes from tiercache's CPU tier.

The Redis server must bound its memory (``redis-server --maxmemory 1gb
--maxmemory-policy allkeys-lru``: without one tiercache refuses to write). Run it
with the python of a vLLM venv (``scripts/setup_vllm_cpu.sh`` makes one on a
machine without a GPU), or pass that python as ``--python``.
"""

from __future__ import annotations

import argparse
import http.client
import json
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tiercache.testing.tiny_llama import build_tiny_llama, random_prompt_ids
from tiercache.testing.vllm_server import VllmServer

DEFAULT_REDIS = "redis://127.0.0.1:6379"
EXTERNAL_HITS = "vllm:external_prefix_cache_hits_total"
"""vLLM's counter of prompt tokens a KV connector loaded."""
SETTLE_QUIET_S, SETTLE_LIMIT_S = 1.0, 30.0
"""Server 1's writes have landed once Redis's key count holds still this long (bounded)."""


def connector_config(redis_url: str | None) -> dict[str, Any]:
    """README's connector line: the CPU tier, with a Redis tier below it unless ``redis_url`` is None."""
    tiers: list[dict[str, Any]] = [{"type": "cpu", "capacity_bytes": "4GB"}]
    if redis_url is not None:
        tiers.append({"type": "redis", "options": {"url": redis_url}})
    return {
        "kv_connector": "TierCacheConnector",
        "kv_connector_module_path": "tiercache.integrations.vllm.connector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"topology": {"tiers": tiers}},
    }


@dataclass(frozen=True)
class Served:
    """One request's outcome on one server."""

    ttft_s: float
    external_hits: int
    token_ids: list[int]


@dataclass(frozen=True)
class Outcome:
    first: Served
    second: Served
    prompt_tokens: int

    @property
    def same_tokens(self) -> bool:
        return self.first.token_ids == self.second.token_ids


def ask(server: VllmServer, prompt: list[int], max_tokens: int) -> Served:
    """Time the prompt's first token (after a warm-up request) and count the external hits it got."""
    server.warm_up()
    before = server.metrics().total(EXTERNAL_HITS)
    streamed = server.stream(prompt, max_tokens=max_tokens)
    hits = server.metrics().total(EXTERNAL_HITS) - before
    return Served(streamed.ttft_s, int(hits), streamed.token_ids)


def started(server: VllmServer) -> float:
    """Start the server; the seconds until it answered ``/health``."""
    began = time.monotonic()
    server.start()
    return time.monotonic() - began


def wait_for_writes(redis_url: str) -> int:
    """Wait until the server's writes to Redis have landed (its key count holds still); that count."""
    import redis

    client = redis.Redis.from_url(redis_url)
    try:
        deadline = time.monotonic() + SETTLE_LIMIT_S
        count, still_since = client.dbsize(), time.monotonic()
        while time.monotonic() < deadline and time.monotonic() - still_since < SETTLE_QUIET_S:
            time.sleep(0.2)
            now = client.dbsize()
            if now != count:
                count, still_since = now, time.monotonic()
        return int(count)
    finally:
        client.close()


def reset_prefix_cache(server: VllmServer) -> None:
    """Empty vLLM's own prefix cache (a dev route: the server runs with ``VLLM_SERVER_DEV_MODE=1``)."""
    for _ in range(50):  # refused while blocks are still held; retried
        conn = http.client.HTTPConnection(server.host, server.port, timeout=30)
        try:
            conn.request("POST", "/reset_prefix_cache")
            response = conn.getresponse()
            answer = json.loads(response.read() or b"{}")
        finally:
            conn.close()
        if response.status == 200 and answer.get("success"):
            return
        time.sleep(0.2)
    raise RuntimeError("vLLM did not reset its prefix cache")


def run(
    model_dir: Path,
    redis_url: str | None,
    *,
    python: str = sys.executable,
    prompt_tokens: int = 2000,
    max_tokens: int = 16,
    out: Callable[[str], None] = print,
) -> Outcome:
    """Serve ``prompt_tokens`` once, then on a restarted server (or, without Redis, after emptying vLLM's own
    prefix cache); print what happened and return it."""
    model = build_tiny_llama(model_dir)
    prompt = random_prompt_ids(prompt_tokens, seed=2026)
    config = connector_config(redis_url)
    out(f"model {model} (a tiny random-weight Llama, float32, built locally); "
        f"tiercache: cpu 4GB{f' + redis {redis_url}' if redis_url else ' only'}")
    env = None if redis_url else {"VLLM_SERVER_DEV_MODE": "1"}
    server = VllmServer(model, python=python, kv_transfer_config=config, env=env)
    try:
        up = started(server)
        first = ask(server, prompt, max_tokens)
        out(f"server 1: up in {up:.1f} s; {prompt_tokens}-token prompt: TTFT {first.ttft_s:.3f} s, "
            f"external prefix-cache hits {first.external_hits} tokens")
        if redis_url is None:
            reset_prefix_cache(server)
            second = ask(server, prompt, max_tokens)
            out(f"server 1, vLLM's own prefix cache emptied: TTFT {second.ttft_s:.3f} s, "
                f"external prefix-cache hits {second.external_hits} tokens (tiercache's CPU tier)")
            return Outcome(first, second, prompt_tokens)
        keys = wait_for_writes(redis_url)
        out(f"server 1 stopped once its writes landed ({keys} keys in Redis)")
    finally:
        server.stop()
    server = VllmServer(model, python=python, kv_transfer_config=config)
    try:
        up = started(server)
        second = ask(server, prompt, max_tokens)
    finally:
        server.stop()
    out(f"server 2 (a fresh process, same Redis): up in {up:.1f} s; TTFT {second.ttft_s:.3f} s, "
        f"external prefix-cache hits {second.external_hits} tokens")
    return Outcome(first, second, prompt_tokens)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--redis-url", default=DEFAULT_REDIS, help=f"a Redis with a maxmemory [{DEFAULT_REDIS}]")
    parser.add_argument("--cpu-only", action="store_true", help="tiercache's CPU tier only, no Redis")
    parser.add_argument("--python", default=sys.executable, help="the python of vLLM's venv [this one]")
    parser.add_argument("--model-dir", type=Path, default=Path(tempfile.gettempdir()) / "tiercache-tiny-llama")
    parser.add_argument("--prompt-tokens", type=int, default=2000)
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens generated per request")
    args = parser.parse_args(argv)
    outcome = run(args.model_dir, None if args.cpu_only else args.redis_url, python=args.python,
                  prompt_tokens=args.prompt_tokens, max_tokens=args.max_tokens)
    print(f"TTFT {outcome.first.ttft_s:.3f} s -> {outcome.second.ttft_s:.3f} s; "
          f"same {args.max_tokens} tokens: {'yes' if outcome.same_tokens else 'NO'}")
    return 0 if outcome.same_tokens else 1


if __name__ == "__main__":
    sys.exit(main())
