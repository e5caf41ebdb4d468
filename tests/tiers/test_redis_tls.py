"""The Redis tier over TLS against a real redis-server with a test CA: verified, mutual, refused."""

from __future__ import annotations

from support.redis_tls import tls_server

from tiercache.testing.redis_servers import empty_dests, random_blocks, remote_context
from tiercache.tiers.redis import RedisOptions, RedisTier

BLOCK = 16 * 1024
SHORT = {"timeout_s": 0.5, "connect_timeout_s": 0.5, "breaker_failures": 100}


async def round_trip(url: str, **options: object) -> tuple[list[bool], list[bool], dict[str, float]]:
    tier = RedisTier(remote_context(BLOCK), RedisOptions(url=url, **{**SHORT, **options}))
    await tier.start()
    try:
        keys, payloads = random_blocks(8, BLOCK)
        written = await tier.put(keys, payloads)
        dests = empty_dests(8, BLOCK)
        read = await tier.get_into(keys, dests)
        if all(read):
            assert [bytes(d) for d in dests] == [bytes(p) for p in payloads]
        return written, read, tier.stats()
    finally:
        await tier.close()


async def test_tls_with_a_verified_server(redis_factory, pki) -> None:
    _, url = tls_server(redis_factory, pki, mutual=False)
    written, read, _ = await round_trip(url, ssl_ca=str(pki["ca"]))
    assert written == [True] * 8 and read == [True] * 8


async def test_mutual_tls_needs_the_client_certificate(redis_factory, pki) -> None:
    _, url = tls_server(redis_factory, pki, mutual=True)
    written, read, _ = await round_trip(
        url, ssl_ca=str(pki["ca"]), ssl_cert=str(pki["client_cert"]), ssl_key=str(pki["client_key"])
    )
    assert written == [True] * 8 and read == [True] * 8
    written, read, stats = await round_trip(url, ssl_ca=str(pki["ca"]))
    assert written == [False] * 8 and read == [False] * 8, "a client without a certificate must be refused"
    assert stats["put_connection"] == 8 and stats["get_connection"] == 8, stats


async def test_a_server_from_another_ca_is_a_miss_not_an_exception(redis_factory, pki) -> None:
    _, url = tls_server(redis_factory, pki, mutual=False)
    written, read, _ = await round_trip(url, ssl_ca=str(pki["other_ca"]))
    assert written == [False] * 8 and read == [False] * 8
    written, read, _ = await round_trip(url, ssl_ca=str(pki["other_ca"]), ssl_verify=False)
    assert written == [True] * 8 and read == [True] * 8, "ssl_verify: false accepts any server certificate"
