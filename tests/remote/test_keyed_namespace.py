"""Keyed namespaces live apart: engines with different secrets never touch each other's values (issue 20, item 6).

A fleet writes with ``model.secret_env``'s secret A on a real Redis. Engines with
secret B and with none then serve the same prompts and store their own KV: their
lookups miss without reading a value (no GET in ``INFO commandstats``), their
stores leave A's values byte-for-byte as they were, and A's next reader serves
every block byte-exact. The same through ``RemoteStore``. Engines sharing a
secret share entries as before; routers see different block hashes for
differently keyed fleets; values written before keys depended on the secret
are misses and stay where they are.
"""

from __future__ import annotations

from typing import Any

import pytest
import redis
from support.manager_helpers import TINY_LAYOUT, WAIT_S, block_kv, compute_and_store, prompt, serve, settled, until

from tiercache.blocks.codec import Codec
from tiercache.blocks.keys import BlockHasher, Namespace
from tiercache.blocks.namespaces import engine_namespace
from tiercache.config import config_from_dict
from tiercache.config.remote import remote_topology_from_dict
from tiercache.manager.tier_manager import TierManager
from tiercache.remote.store import RemoteStore
from tiercache.telemetry.events.wire import block_hash
from tiercache.testing.redis_servers import NOTHING_READ, RedisServer, empty_dests, random_blocks, reads, stored_values
from tiercache.tiers.base import Presence

"""Environment variables of the two fleets' secrets (``model.secret_env`` names one)."""
PROMPTS = [prompt(4, salt) for salt in (1, 2, 3)]
BLOCKS = sum(len(tokens) // TINY_LAYOUT["block_size"] for tokens in PROMPTS)
READERS = ["TC_SECRET_B", None]
"""A reader with another secret, and one with none."""
BLOCK_BYTES = 4096
ENGINE_KEYS = [f"engine-block-{i}".encode() for i in range(8)]
STORE_NAMESPACE = Namespace("test-model", "fp16:4096:tp1")


pytestmark = pytest.mark.usefixtures("namespace_secrets")


def config(secret_env: str | None, *remotes: dict[str, Any], **top: Any):
    """A manager topology over ``remotes`` (write-through), keyed with ``$secret_env`` when given."""
    model = {"id": "test-model", **({"secret_env": secret_env} if secret_env else {})}
    tiers = [
        {"type": "gpu", "capacity_blocks": 16, "options": {"device": "cpu"}},
        {"type": "cpu", "capacity_blocks": 32},
        *remotes,
    ]
    return config_from_dict({"model": model, "layout": TINY_LAYOUT, "tiers": tiers, **top}, environ={})


def redis_tier(server: RedisServer) -> dict[str, Any]:
    return {"type": "redis", "name": "redis", "options": {"url": server.url, "allow_unbounded": True, "timeout_s": 2}}


def write_fleet_a(server: RedisServer, redis_client: redis.Redis) -> dict[bytes, bytes]:
    """Fleet A computes and stores every prompt; returns what the server then holds (all of it A's)."""
    with TierManager(config("TC_SECRET_A", redis_tier(server))) as writer:
        for tokens in PROMPTS:
            compute_and_store(writer, tokens)
        until(lambda: writer.stats()["queues"]["pending_stores"] == 0)
    values = stored_values(redis_client)
    assert len(values) == BLOCKS
    return values


def serve_all(manager: TierManager) -> list[int]:
    """Each prompt served the engine's way (``serve`` checks every reused block byte-exact): blocks reused."""
    reused = [serve(manager, tokens) for tokens in PROMPTS]
    until(lambda: manager.stats()["queues"]["pending_stores"] == 0)
    return reused


@pytest.mark.parametrize("secret_env", READERS, ids=["other-secret", "no-secret"])
def test_a_reader_without_the_secret_misses_without_reading_a_value(
    redis_server: RedisServer, redis_client: redis.Redis, secret_env: str | None
) -> None:
    """Old code: the reader's presence checks answered HELD and every load sent a GET that failed validation."""
    write_fleet_a(redis_server, redis_client)
    redis_client.config_resetstat()
    with TierManager(config(secret_env, redis_tier(redis_server))) as reader:
        found = []
        for tokens in PROMPTS:
            hit = settled(reader, tokens)
            found.append(hit.num_tokens)
            reader.release(hit)
        reused = serve_all(reader)
    assert reads(redis_client) == NOTHING_READ, "the reader checked, read or deleted fleet A's values"
    assert found == [0] * len(PROMPTS) and reused == [0] * len(PROMPTS)

    with TierManager(config("TC_SECRET_A", redis_tier(redis_server))) as owner:
        assert serve_all(owner) == [4] * len(PROMPTS)
    assert reads(redis_client)["get"] >= BLOCKS, "fleet A's reader reads its blocks (what GET counts here)"


@pytest.mark.parametrize("secret_env", READERS, ids=["other-secret", "no-secret"])
def test_stores_without_the_secret_leave_the_keyed_values_and_their_hits(
    redis_server: RedisServer, redis_client: redis.Redis, secret_env: str | None
) -> None:
    """Old code: the reader's own stores overwrote fleet A's values at the same keys (A then missed them all)."""
    written = write_fleet_a(redis_server, redis_client)
    with TierManager(config(secret_env, redis_tier(redis_server))) as other:
        assert serve_all(other) == [0] * len(PROMPTS)  # computes every block and stores it (write-through)
    after = stored_values(redis_client)
    assert {name: after.get(name) for name in written} == written, "fleet A's values were changed"
    assert len(after) == 2 * BLOCKS, "the other fleet's entries live beside A's"

    with TierManager(config("TC_SECRET_A", redis_tier(redis_server))) as owner:
        assert serve_all(owner) == [4] * len(PROMPTS), "fleet A's reader serves every block byte-exact"
    with TierManager(config(secret_env, redis_tier(redis_server))) as again:
        assert serve_all(again) == [4] * len(PROMPTS), "the other fleet shares its own entries as before"


def store_of(server: RedisServer, secret_env: str | None) -> RemoteStore:
    data: dict[str, Any] = {"tiers": [redis_tier(server)], "queues": {"remote_lookup_timeout_ms": 1000}}
    if secret_env:
        data["model"] = {"secret_env": secret_env}
    store = RemoteStore(remote_topology_from_dict(data), STORE_NAMESPACE, BLOCK_BYTES)
    store.start()
    return store


@pytest.mark.parametrize("secret_env", READERS, ids=["other-secret", "no-secret"])
def test_remote_stores_with_different_secrets_never_touch_each_others_values(
    redis_server: RedisServer, redis_client: redis.Redis, secret_env: str | None
) -> None:
    """Old code: the other store's presence checks said HELD for the writer's blocks, and its writes replaced them."""
    count = len(ENGINE_KEYS)
    _, payloads = random_blocks(count, BLOCK_BYTES, seed=20)
    _, others = random_blocks(count, BLOCK_BYTES, seed=21)
    writer = store_of(redis_server, "TC_SECRET_A")
    try:
        assert writer.write(writer.keys(ENGINE_KEYS), payloads).result(WAIT_S) == [True] * count
    finally:
        writer.close()
    written = stored_values(redis_client)
    redis_client.config_resetstat()

    other = store_of(redis_server, secret_env)
    try:
        keys = other.keys(ENGINE_KEYS)
        assert [found.presence for found in other.contains(keys).result(WAIT_S)] == [Presence.ABSENT] * count
        assert reads(redis_client) == NOTHING_READ, "the other store's presence checks found the writer's values"
        assert other.read(keys, empty_dests(count, BLOCK_BYTES)).result(WAIT_S) == [False] * count
        assert reads(redis_client)["keyspace_hits"] == 0, "a read the engine would not send touched nothing either"
        assert other.write(keys, others).result(WAIT_S) == [True] * count
        mine = empty_dests(count, BLOCK_BYTES)
        assert other.read(keys, mine).result(WAIT_S) == [True] * count
        assert [bytes(m) for m in mine] == [bytes(o) for o in others]
    finally:
        other.close()
    after = stored_values(redis_client)
    assert {name: after.get(name) for name in written} == written, "the writer's values were changed"

    owner = store_of(redis_server, "TC_SECRET_A")
    try:
        out = empty_dests(count, BLOCK_BYTES)
        assert owner.read(owner.keys(ENGINE_KEYS), out).result(WAIT_S) == [True] * count
        assert [bytes(o) for o in out] == [bytes(p) for p in payloads]
    finally:
        owner.close()


def stored_hashes(secret_env: str | None) -> list[int]:
    """The block hashes a router is told for the first prompt by an engine keyed with ``$secret_env``."""
    with TierManager(config(secret_env, events={"enabled": True})) as manager:
        seen: list[Any] = []
        manager.subscribe(lambda got: seen.extend(got.events))
        compute_and_store(manager, PROMPTS[0])
        assert manager.parts.events.flush()
    (stored,) = [event for event in seen if type(event).__name__ == "BlockStored" and event.medium == "gpu"]
    return list(stored.block_hashes)


def test_routers_see_differently_keyed_fleets_share_no_blocks() -> None:
    """Old code: fleets A and B announced the same hashes for the same prompt, as if they shared its KV."""
    fleet_a, fleet_b, plain = stored_hashes("TC_SECRET_A"), stored_hashes("TC_SECRET_B"), stored_hashes(None)
    assert not set(fleet_a) & set(fleet_b) and not set(fleet_a) & set(plain) and not set(fleet_b) & set(plain)
    assert stored_hashes("TC_SECRET_A") == fleet_a, "engines sharing a secret announce the same blocks"
    unkeyed = BlockHasher(engine_namespace("test-model", config(None).layout.page_format()), TINY_LAYOUT["block_size"])
    assert plain == [block_hash(key) for key in unkeyed.keys(PROMPTS[0])], "an unkeyed namespace's keys are unchanged"


def test_keyed_values_written_before_keys_depended_on_the_secret_are_misses_left_in_place(
    redis_server: RedisServer, redis_client: redis.Redis, namespace_secrets: dict[str, str]
) -> None:
    """The previous release keyed only the values: they sit at the unkeyed namespace's keys, never read now."""
    tokens = PROMPTS[0]
    layout = config(None).layout
    namespace = engine_namespace("test-model", layout.page_format())
    old_codec = Codec(namespace.root(), secret=namespace_secrets["TC_SECRET_A"].encode())
    with TierManager(config("TC_SECRET_A", redis_tier(redis_server))) as manager:
        tier = manager.parts.remotes[0]
        for key in BlockHasher(namespace, layout.block_size).keys(tokens):
            payload = block_kv(manager, key).contiguous().numpy().tobytes()
            redis_client.set(tier.redis_key(key), old_codec.encode_value(key, payload))
        old = stored_values(redis_client)
        redis_client.config_resetstat()
        assert serve(manager, tokens) == 0
        assert reads(redis_client) == NOTHING_READ
    after = stored_values(redis_client)
    assert {name: after.get(name) for name in old} == old, "an old value was changed or deleted"


def test_inspect_shows_the_key_id_never_the_secret(namespace_secrets: dict[str, str]) -> None:
    """Operators compare key ids to check two fleets share a secret; the secret itself is printed nowhere."""
    from tiercache.remote.inspect import inspect_topology

    keyed = config("TC_SECRET_A")
    with TierManager(keyed) as manager:
        key_id = manager.namespace.key_id
    report, _ = inspect_topology(keyed)
    assert f"keyed by TC_SECRET_A, key id {key_id.hex()}" in report
    assert namespace_secrets["TC_SECRET_A"] not in report and "key id" not in inspect_topology(config(None))[0]
