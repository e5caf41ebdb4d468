"""The served-engine tests' parts (``tests/engines/vllm_serve``): prompts, the connector's config lines, requests
and what a server's metrics and log say.

Every prompt any of those tests sends is in ``PROMPTS`` (token ids, built from
fixed seeds), with the number of tokens it is asked for in ``MAX_TOKENS``: the
session's baseline (a server without the connector and without vLLM's own
prefix cache) answers each once, and every served answer is compared with it.
Prompts share prefixes on purpose; ``BLOCK`` is the servers' block size. One
prompt is made from an answer: ``chat_2`` (``add_second_turn``), which the
baseline adds once it has answered ``chat_1``.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import socket
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from tiercache.testing.redis_servers import RedisServer
from tiercache.testing.server_formats import ServerMetrics
from tiercache.testing.tiny_llama import random_prompt_ids
from tiercache.testing.vllm_server import Completion, VllmServer

BLOCK = 32
"""The servers' ``--block-size`` (the CPU attention backend needs a multiple of 32)."""
DEFAULT_MAX_TOKENS = 8
CONNECTOR = "TierCacheConnector"
CONNECTOR_MODULE = "tiercache.integrations.vllm.connector"
CPU_CAPACITY = "512MB"
"""The CPU tier of the tests' config lines (README's say 4GB; the tests keep memory for vLLM's own KV)."""
EXTERNAL_HITS = "vllm:external_prefix_cache_hits_total"
LOCAL_HITS = "vllm:prefix_cache_hits_total"
TIERCACHE = "vllm:tiercache_{}_total"
SETTLE_S = 0.3
SETTLE_LIMIT_S = 10.0
CONCURRENT_PREFIX = [512 + 128 * (k % 7) for k in range(8)]
"""How much of the prompt ``shared_full`` begins with each ``concurrent_<k>`` prompt (whole blocks)."""


def _ids(count: int, seed: int) -> list[int]:
    return random_prompt_ids(count, seed=seed)


def _prompts() -> dict[str, list[int]]:
    prompts: dict[str, list[int]] = {}
    # Served by a first server, then by a fresh one (test_second_instance).
    prompts["long_a"] = _ids(2500, 101)
    prompts["long_b"] = _ids(3000, 102)
    prompts["prefix_b"] = prompts["long_b"][:2048] + _ids(300, 103)  # a 2k-token prefix of long_b, a new suffix
    prompts["long_c"] = _ids(2600, 104)
    prompts["prefix_c"] = prompts["long_c"][:2000] + _ids(500, 105)  # shares 62 whole blocks and half of the 63rd
    prompts["salted"] = _ids(2200, 106)
    shared = _ids(1536, 107)
    prompts["shared_full"] = shared + _ids(512, 108)
    for k in range(8):  # 8 concurrent requests sharing prefixes of `shared`, two of them the same prompt
        prompts[f"concurrent_{k}"] = shared[: CONCURRENT_PREFIX[k]] + _ids(160, 110 + k % 7)
    for k in range(3):
        prompts[f"aborted_{k}"] = _ids(1200, 120 + k)
    prompts["chat_1"] = _ids(1000, 125)  # its second turn, chat_2, is made from its answer (add_second_turn)
    # Written by a producer, read by a consumer while Redis is in trouble (test_store_trouble).
    for k, name in enumerate(("pd", "stopped", "killed", "corrupted", "writer_stopped", "writer_killed")):
        prompts[name] = _ids(1500, 130 + k)
    # Written in one region, read in another (test_regional).
    prompts["regional"] = _ids(2000, 145)
    # Two tensor-parallel workers (test_tensor_parallel).
    prompts["tp"] = _ids(1500, 146)
    # The CPU tier alone (test_cpu_tier).
    prompts["repeated"] = _ids(2000, 140)
    for k in range(4):
        prompts[f"preempted_{k}"] = _ids(1200, 150 + k)
    return prompts


PROMPTS = _prompts()
PREEMPTED_MAX_TOKENS = 200
CHAT_MAX_TOKENS = 100
"""The first chat turn's answer fills blocks of its own (1000 + 100 tokens: 34 whole blocks of KV)."""
MAX_TOKENS = {name: PREEMPTED_MAX_TOKENS if name.startswith("preempted_") else DEFAULT_MAX_TOKENS for name in PROMPTS}
MAX_TOKENS["chat_1"] = CHAT_MAX_TOKENS
SECOND_TURN = "chat_2"


def add_second_turn(first_answer: list[int]) -> str:
    """Add ``chat_2`` to the prompts: ``chat_1``, the answer to it, and a new user turn (greedy float32 answers are
    the same everywhere, so every server and the baseline make the same one)."""
    PROMPTS[SECOND_TURN] = PROMPTS["chat_1"] + list(first_answer) + _ids(200, 126)
    MAX_TOKENS[SECOND_TURN] = DEFAULT_MAX_TOKENS
    return SECOND_TURN


def reusable(tokens: int) -> int:
    """The most prompt tokens a connector may supply for a prompt of ``tokens``: whole blocks, leaving one token to
    compute."""
    return (tokens - 1) // BLOCK * BLOCK


# ---- the connector's config: README's lines, the Redis URLs being the tests' servers' ------------------
def connector_config(tiers: list[dict[str, Any]], *, role: str = "kv_both", **extra: Any) -> dict[str, Any]:
    return {
        "kv_connector": CONNECTOR,
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": role,
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"topology": {"tiers": tiers}, **extra},
    }


def cpu_tier() -> dict[str, Any]:
    return {"type": "cpu", "capacity_bytes": CPU_CAPACITY}


def redis_config(url: str, *, role: str = "kv_both", codec: dict[str, Any] | None = None) -> dict[str, Any]:
    """README's Redis line (with the connector's ``codec`` when given)."""
    config = connector_config([cpu_tier(), {"type": "redis", "options": {"url": url}}], role=role)
    if codec is not None:
        config["kv_connector_extra_config"]["codec"] = codec
    return config


def regional_config(region_url: str, central_url: str) -> dict[str, Any]:
    """README's regional line: loads ask central for the newest version (``force_latest``)."""
    regional = {"type": "regional", "options": {"region_url": region_url, "central_url": central_url}}
    return connector_config([cpu_tier(), regional], force_latest=True)


# ---- requests ---------------------------------------------------------------------------------------------
def ask(server: VllmServer, name: str, **extra: Any) -> list[int]:
    """The greedy answer to prompt ``name`` (``extra`` joins the request body, e.g. ``cache_salt``)."""
    return server.complete(PROMPTS[name], max_tokens=MAX_TOKENS[name], **extra).token_ids


def ask_together(server: VllmServer, names: Sequence[str]) -> dict[str, Completion]:
    """The completions of ``names``, all sent at once (one thread each)."""

    def complete(name: str) -> Completion:
        return server.complete(PROMPTS[name], max_tokens=MAX_TOKENS[name])

    with concurrent.futures.ThreadPoolExecutor(len(names)) as pool:
        futures = {name: pool.submit(complete, name) for name in names}
        return {name: future.result() for name, future in futures.items()}


def send_and_hang_up(server: VllmServer, name: str, after_s: float = 0.0) -> None:
    """Send a completion request for ``name`` and close the connection ``after_s`` later, before any answer."""
    body = json.dumps({"model": server.served_name, "prompt": PROMPTS[name], "max_tokens": MAX_TOKENS[name],
                       "temperature": 0.0, "ignore_eos": True}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {server.host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    with socket.create_connection((server.host, server.port), timeout=10) as conn:
        conn.sendall(head + body)
        time.sleep(after_s)
        with contextlib.suppress(OSError):
            conn.shutdown(socket.SHUT_RDWR)


# ---- what the server says -----------------------------------------------------------------------------------
def settled(server: VllmServer) -> ServerMetrics:
    """vLLM's counters (``vllm:*``) once two scrapes ``SETTLE_S`` apart agree (its front end records an engine
    step's stats after the step's outputs)."""
    deadline = time.monotonic() + SETTLE_LIMIT_S
    before = _vllm_samples(server)
    while True:
        time.sleep(SETTLE_S)
        now = _vllm_samples(server)
        if now.samples == before.samples:
            return now
        changed = sorted({key[0] for key in now.samples.keys() | before.samples.keys()
                          if now.samples.get(key) != before.samples.get(key)})
        assert time.monotonic() < deadline, f"vLLM's counters still change after {SETTLE_LIMIT_S} s: {changed}"
        before = now


def _vllm_samples(server: VllmServer) -> ServerMetrics:
    """vLLM's own samples of a scrape (not the process' CPU time, memory, ... which change by themselves)."""
    samples = server.metrics().samples
    return ServerMetrics({key: value for key, value in samples.items() if key[0].startswith("vllm:")})


class Counted:
    """What a block of requests added to a server's counters: ``with Counted(server) as seen: ...``, then
    ``seen.external``, ``seen.local``, ``seen.tiercache("loaded_blocks")``, ``seen.delta(name, **labels)``."""

    def __init__(self, server: VllmServer) -> None:
        self.server = server
        self.before: ServerMetrics | None = None
        self.after: ServerMetrics | None = None

    def __enter__(self) -> Counted:
        self.before = settled(self.server)
        return self

    def __exit__(self, *exc: object) -> None:
        if exc[0] is None:
            self.after = settled(self.server)

    def delta(self, name: str, **labels: str) -> int:
        assert self.before is not None and self.after is not None
        return round(self.after.since(self.before, name, **labels))

    @property
    def external(self) -> int:
        return self.delta(EXTERNAL_HITS)

    @property
    def local(self) -> int:
        return self.delta(LOCAL_HITS)

    def tiercache(self, name: str, **labels: str) -> int:
        return self.delta(TIERCACHE.format(name), **labels)


def total(server: VllmServer, name: str, **labels: str) -> int:
    return round(settled(server).total(name, **labels))


SHUTDOWN_TRIGGERED = "[shutdown] API server: shutdown triggered"
ENGINE_KILLED = "EngineDeadError"
"""vLLM's front end may report the engine core it has just killed as dead (``--shutdown-timeout 0``, the default,
kills it at once): a race of vLLM's own shutdown, not a problem of the run."""


def log_problems(server: VllmServer) -> list[str]:
    """Tracebacks and errors in the server's log (every vLLM process writes there), one entry each; after the
    server was told to stop, vLLM's report of the engine core it killed is not one."""
    lines = server.log_path.read_text(errors="replace").splitlines()
    stopping = next((i for i, line in enumerate(lines) if SHUTDOWN_TRIGGERED in line), len(lines))
    problems = []
    for i, line in enumerate(lines):
        if "Traceback" in line or ("tiercache connector:" in line and "failed" in line) or " ERROR " in line:
            problem = "\n".join(lines[i : i + 30])
            if i < stopping or ENGINE_KILLED not in problem:
                problems.append(problem)
    return problems


def wait_until(condition: Callable[[], bool], *, timeout_s: float, pause_s: float = 0.2) -> bool:
    """Whether ``condition()`` became true within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(pause_s)
    return True


def retry(attempt: Callable[[], int], *, tries: int, pause_s: float) -> list[int]:
    """Call ``attempt`` until it returns a positive count (at most ``tries`` times); every result, in order."""
    results = []
    for _ in range(tries):
        results.append(attempt())
        if results[-1] > 0:
            break
        time.sleep(pause_s)
    return results


# ---- processes: one engine at a time --------------------------------------------------------------------
KV_MEMORY_FRACTION = 0.15
"""The share of host memory vLLM's CPU engine takes for its own KV cache."""
_running: list[VllmServer] = []


@contextlib.contextmanager
def serving(model: Path, log: Path, *, kv_transfer_config: dict[str, Any] | None = None,
            args: Sequence[str] = (), env: dict[str, str] | None = None) -> Iterator[VllmServer]:
    """A started server, stopped (its whole process group) on leaving, whatever happened; refuses to start a second
    engine while one runs (two cores)."""
    assert not _running, f"a second engine while {_running[0].log_path.name} runs: one at a time on this machine"
    server = VllmServer(model, kv_transfer_config=kv_transfer_config, block_size=BLOCK,
                        kv_memory_fraction=KV_MEMORY_FRACTION, args=list(args), log_path=log, env=env)
    _running.append(server)
    try:
        yield server.start()
    finally:
        server.stop()
        _running.remove(server)


@contextlib.contextmanager
def redis_store(workdir: Path) -> Iterator[RedisServer]:
    """A ``redis-server`` (512 MB, allkeys-lru) keeping its files in ``workdir``, gone on leaving."""
    server = RedisServer(workdir)
    try:
        yield server.start()
    finally:
        server.close()


# ---- lossy levels ------------------------------------------------------------------------------------------
TABLE_PROMPTS = [random_prompt_ids(256, seed=seed) for seed in (911, 912, 913)]
"""Prompts whose K/V the compact tables of a served test are learned on (no served test sends them)."""


def compact_tables(model: Path, path: Path) -> Path:
    """The compact level's tables of ``model``'s own K/V over ``TABLE_PROMPTS`` (transformers), saved at ``path``."""
    from tiercache.codecs.tables import learn_tables
    from tiercache.tools.real_kv import context_kv, load_model

    _, transformer = load_model(model)
    learn_tables([context_kv(transformer, ids) for ids in TABLE_PROMPTS]).save(path)
    return path
