"""A second server, a fresh process over the Redis the first one wrote, skips the prefill of what the first computed.

The first server (``first_server``: model 0, Redis topology, kv_both) answered
long prompts (2.5-3k tokens: chunked prefill, 2048 tokens a step) and stopped.
This module's server is a new process with the same config line, serving a
copy of the model from another directory (as another host would). Whole blocks
of 32 tokens are reusable, at most the prompt's length less one token; what
vLLM's own prefix cache holds is not loaded again. Every answer equals the
baseline's (float32, greedy).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.vllm_serving import (
    CHAT_MAX_TOKENS,
    CONCURRENT_PREFIX,
    PROMPTS,
    SECOND_TURN,
    Counted,
    ask,
    ask_together,
    log_problems,
    redis_config,
    reusable,
    send_and_hang_up,
    serving,
    settled,
    total,
)

from tiercache.testing.redis_servers import RedisServer
from tiercache.testing.vllm_server import VllmServer

FINISHED = "vllm:request_success_total"


@pytest.fixture(scope="module")
def second(model_dirs: dict[str, Path], logs: Path, first_server: object, shared_redis: RedisServer
           ) -> Iterator[VllmServer]:
    """Server 2: model 0 copied to another directory (another host's path), the first server's config line."""
    config = redis_config(shared_redis.url)
    with serving(model_dirs["copy"], logs / "second.log", kv_transfer_config=config) as server:
        yield server


def test_first_server_answers_and_stores(first_server, baseline, shared_redis):
    """Server 1 answered as the baseline, loaded nothing (Redis was empty), and every block it stored is in Redis."""
    assert first_server.answers == {name: baseline[name] for name in first_server.answers}
    assert first_server.metrics.total("vllm:external_prefix_cache_hits_total") == 0
    assert first_server.metrics.total("vllm:tiercache_stored_blocks_total") > 0
    assert first_server.landed
    assert first_server.problems == []


def test_same_prompt_loads_every_reusable_block(second, baseline):
    with Counted(second) as seen:
        answer = ask(second, "long_a")
    assert answer == baseline["long_a"]
    blocks = reusable(len(PROMPTS["long_a"])) // 32
    assert (seen.external, seen.local) == (blocks * 32, 0)
    assert seen.tiercache("loaded_blocks") == blocks
    assert seen.tiercache("hit_blocks", tier="redis") == blocks


@pytest.mark.parametrize(("name", "shared"), [("prefix_b", 2048), ("prefix_c", 1984)])
def test_shared_prefix_new_suffix_loads_the_shared_blocks(second, baseline, name, shared):
    """A 2k-token prefix of a prompt server 1 answered, then new tokens: the whole shared blocks load (prefix_c
    shares 2000 tokens: 62 whole blocks, the 63rd differs)."""
    with Counted(second) as seen:
        answer = ask(second, name)
    assert answer == baseline[name]
    assert (seen.external, seen.local) == (shared, 0)


def test_local_hit_then_external_load(second, baseline):
    """vLLM's own cache holds long_b's first 2048 tokens (from prefix_b, just served); tiercache loads the rest
    from Redis."""
    with Counted(second) as seen:
        answer = ask(second, "long_b")
    assert answer == baseline["long_b"]
    assert seen.local == 2048
    assert seen.external == reusable(len(PROMPTS["long_b"])) - 2048
    assert seen.tiercache("hit_blocks", tier="redis") == seen.external // 32
    assert seen.tiercache("hit_blocks", tier="cpu") == 0


def test_tenants_never_share(second, baseline):
    """Server 1 answered ``salted`` under cache_salt tenant-a: another salt, or none, loads nothing; tenant-a loads
    it all."""
    loads = {}
    for salt in ("tenant-b", None, "tenant-a"):
        extra = {"cache_salt": salt} if salt else {}
        with Counted(second) as seen:
            answer = ask(second, "salted", **extra)
        assert answer == baseline["salted"], salt
        assert seen.local == 0, salt
        loads[salt] = seen.external
    assert loads == {"tenant-b": 0, None: 0, "tenant-a": reusable(len(PROMPTS["salted"]))}


def test_concurrent_requests_sharing_prefixes(second, baseline):
    """8 requests at once, each beginning with a prefix of a prompt server 1 answered (two are the same prompt):
    they answer as sequential ones, and each has its whole shared prefix computed already when admitted, from vLLM's
    own cache (what a request admitted earlier loaded) or loaded by tiercache."""
    names = [f"concurrent_{k}" for k in range(8)]
    with Counted(second) as seen:
        answers = ask_together(second, names)
    assert {name: answer.token_ids for name, answer in answers.items()} == {name: baseline[name] for name in names}
    for name, shared in zip(names, CONCURRENT_PREFIX, strict=True):
        # the duplicate admitted second may also find its twin's own blocks in vLLM's cache
        allowed = {shared, reusable(len(PROMPTS[name]))} if PROMPTS[name] == PROMPTS["concurrent_0"] else {shared}
        assert answers[name].cached_tokens in allowed, name
    assert seen.external > 0
    assert seen.tiercache("loaded_blocks") * 32 == seen.external
    assert seen.tiercache("failed_loads") == 0


def test_block_aligned_prompt(second, baseline):
    """shared_full is 64 whole blocks: vLLM's own cache holds the 40 the concurrent prompts began with, tiercache
    loads the rest but the last block (a prompt token is always left to compute)."""
    assert len(PROMPTS["shared_full"]) == 64 * 32
    with Counted(second) as seen:
        answer = ask(second, "shared_full")
    assert answer == baseline["shared_full"]
    assert (seen.local, seen.external) == (max(CONCURRENT_PREFIX), 63 * 32 - max(CONCURRENT_PREFIX))


def test_second_chat_turn_loads_the_first_turns_answer(second, baseline):
    """Server 1 answered chat_1 (1000 tokens, 100 answered); chat_2 is chat_1, that answer and a new turn: the
    blocks of the answer load too (KV of 1099 tokens: 34 whole blocks)."""
    with Counted(second) as seen:
        answer = ask(second, SECOND_TURN)
    assert answer == baseline[SECOND_TURN]
    assert (seen.external, seen.local) == ((len(PROMPTS["chat_1"]) + CHAT_MAX_TOKENS - 1) // 32 * 32, 0)


def test_requests_aborted_while_loading(second, baseline):
    """Clients that hang up right after sending (their prompts' blocks are in Redis, so their admission waits for
    the load): vLLM aborts them, the server keeps serving, and the same prompts then answer as the baseline.

    vLLM counts only requests its engine finished in ``request_success``, not those its front end aborted: the
    three answers asked afterwards are the only ones counted. Wherever an abort lands (before the engine saw the
    request, while the connector fetched its blocks from Redis, or after they were loaded into vLLM's cache, which
    the answer asked afterwards then hits), each prompt's blocks are loaded into vLLM exactly once."""
    names = [f"aborted_{k}" for k in range(3)]
    with Counted(second) as seen:
        for name, after_s in zip(names, (0.0, 0.01, 0.03), strict=True):
            send_and_hang_up(second, name, after_s)
        answers = {name: ask(second, name) for name in names}
    assert answers == {name: baseline[name] for name in names}
    assert seen.delta(FINISHED) == 3
    whole = sum(reusable(len(PROMPTS[name])) for name in names)
    assert seen.external == whole
    assert seen.tiercache("loaded_blocks") == whole // 32
    assert seen.tiercache("failed_loads") == 0
    assert second.healthy()
    idle = settled(second)
    time.sleep(1.0)
    assert settled(second).samples == idle.samples  # nothing left asking (no request parked in the connector)


def test_server_stayed_clean(second):
    """No traceback or error in any of server 2's processes; it still answers."""
    assert second.healthy()
    assert log_problems(second) == []
    assert total(second, "vllm:tiercache_failed_loads_total") == 0

