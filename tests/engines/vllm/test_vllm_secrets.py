"""Keyed namespaces under vLLM 0.33's real offloading manager: fleets with different secrets live apart.

Fleet A's vLLM stores chunks with ``model.secret_env``'s secret A. A vLLM with
secret B, and one with none, then look the same chunks up: they miss at the
presence check (no promotion that fails validation, no GET, no key found on the server)
and store their own chunks, which leave A's values byte-for-byte as they were,
so A's next vLLM promotes every chunk byte-identical (issue 20, item 6).
"""

from __future__ import annotations

import pytest
import redis
from support.vllm_tiers import engine_over, tier_of

from tiercache.testing.redis_servers import NOTHING_READ, RedisServer, reads, stored_values
from tiercache.testing.vllm_offloading import Engine, chunk_keys, payloads, redis_topology

pytestmark = pytest.mark.usefixtures("namespace_secrets")
COUNT = 6
"""Chunks each fleet stores."""


def keyed(server: RedisServer, secret_env: str | None) -> dict:
    topology = redis_topology(server)
    if secret_env:
        topology["model"] = {"secret_env": secret_env}
    return topology


@pytest.mark.parametrize("secret_env", ["TC_SECRET_B", None], ids=["other-secret", "no-secret"])
def test_a_vllm_without_the_secret_never_reads_or_overwrites_the_keyed_chunks(
    redis_server: RedisServer, redis_client: redis.Redis, engines: list[Engine], secret_env: str | None
) -> None:
    """Old code: its presence checks said held, each promotion failed validation, and its stores replaced A's values."""
    keys = chunk_keys(COUNT, "keyed-system-prompt")
    writer = engine_over(engines, keyed(redis_server, "TC_SECRET_A"))
    data = payloads(COUNT, writer.row_bytes, seed=11)
    writer.store(keys, data)
    writer.settle()
    written = stored_values(redis_client)
    assert len(written) == COUNT
    redis_client.config_resetstat()

    other = engine_over(engines, keyed(redis_server, secret_env))
    assert other.read(keys) == [None] * COUNT
    other.settle()
    assert reads(redis_client) == NOTHING_READ, "the other vLLM found, read or deleted fleet A's values"
    counters = tier_of(other).store.counters()
    assert counters.get("presence_held", 0) == 0 and counters.get("read_misses", 0) == 0, counters
    assert counters.get("presence_absent", 0) > 0, "its presence checks answered: absent"

    own = payloads(COUNT, other.row_bytes, seed=12)
    other.store(keys, own)
    other.settle()
    after = stored_values(redis_client)
    assert {name: after.get(name) for name in written} == written, "fleet A's values were changed"
    assert len(after) == 2 * COUNT, "the other vLLM's chunks live beside A's"

    assert engine_over(engines, keyed(redis_server, "TC_SECRET_A")).read(keys) == data
    assert engine_over(engines, keyed(redis_server, secret_env)).read(keys) == own, "its own fleet shares them"


def stored_ownership(server: RedisServer, engines: list[Engine], secret_env: str | None) -> set[str]:
    """The ``ownership`` of the events a vLLM keyed with ``$secret_env`` publishes for the same chunks."""
    options = {"enable_kv_events": True, "locality": "REMOTE"}
    engine = engine_over(engines, keyed(server, secret_env), events=True, tier_options=options)
    engine.store(chunk_keys(COUNT, "events"), payloads(COUNT, engine.row_bytes, seed=13))
    engine.settle()
    return {event.ownership for event in engine.manager.take_events() if event.ownership is not None}


def test_differently_keyed_fleets_never_look_like_they_share_chunks(
    redis_server: RedisServer, engines: list[Engine]
) -> None:
    """vLLM's events carry its own block hashes; the ownership names the tier and the keyed namespace.

    Old code: both fleets announced the same hashes as ``tiercache:redis``, as if either could load the other's.
    """
    (fleet_a,) = stored_ownership(redis_server, engines, "TC_SECRET_A")
    (fleet_b,) = stored_ownership(redis_server, engines, "TC_SECRET_B")
    (plain,) = stored_ownership(redis_server, engines, None)
    assert plain == "tiercache:redis", "an unkeyed namespace's events are unchanged"
    assert len({fleet_a, fleet_b, plain}) == 3 and fleet_a.startswith("tiercache:redis@")
    assert stored_ownership(redis_server, engines, "TC_SECRET_A") == {fleet_a}, "one fleet, one ownership"
