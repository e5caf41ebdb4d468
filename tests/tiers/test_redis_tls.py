"""The Redis tier over TLS against a real redis-server with a test CA: verified, mutual, refused."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from tiercache.testing.redis_servers import _free_port, empty_dests, random_blocks, remote_context
from tiercache.tiers.redis import RedisOptions, RedisTier

BLOCK = 16 * 1024
SHORT = {"timeout_s": 0.5, "connect_timeout_s": 0.5, "breaker_failures": 100}
CERT_DAYS = "1"


def openssl(*args: str | Path) -> None:
    binary = shutil.which("openssl")
    if binary is None:
        raise RuntimeError("openssl is needed to make the test certificates (Debian package openssl)")
    subprocess.run([binary, *map(str, args)], check=True, capture_output=True)


def issue(directory: Path, name: str, ca: tuple[Path, Path] | None, extensions: str) -> tuple[Path, Path]:
    """A key and certificate for ``name``: self-signed when ``ca`` is None, else signed by it."""
    key, cert, request, ext = (directory / f"{name}.{s}" for s in ("key", "crt", "csr", "ext"))
    ext.write_text(extensions)
    if ca is None:
        openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", cert,
                "-days", CERT_DAYS, "-subj", f"/CN={name}", "-addext", "basicConstraints=critical,CA:TRUE")
        return key, cert
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", request, "-subj", f"/CN={name}")
    openssl("x509", "-req", "-in", request, "-CA", ca[1], "-CAkey", ca[0], "-CAcreateserial",
            "-out", cert, "-days", CERT_DAYS, "-extfile", ext)
    return key, cert


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    directory = tmp_path_factory.mktemp("pki")
    ca = issue(directory, "test-ca", None, "")
    other_ca = issue(directory, "other-ca", None, "")
    server = issue(directory, "server", ca, "subjectAltName=IP:127.0.0.1\n")
    client = issue(directory, "client", ca, "extendedKeyUsage=clientAuth\n")
    return {
        "ca": ca[1], "other_ca": other_ca[1],
        "server_key": server[0], "server_cert": server[1],
        "client_key": client[0], "client_cert": client[1],
    }


def tls_server(redis_factory, pki: dict[str, Path], mutual: bool):
    """A server with a plain port (for the fixture's readiness check) and a TLS port."""
    tls_port = _free_port()
    server = redis_factory(extra_args=[
        "--tls-port", str(tls_port),
        "--tls-cert-file", str(pki["server_cert"]),
        "--tls-key-file", str(pki["server_key"]),
        "--tls-ca-cert-file", str(pki["ca"]),
        "--tls-auth-clients", "yes" if mutual else "no",
    ])
    return server, f"rediss://127.0.0.1:{tls_port}"


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
