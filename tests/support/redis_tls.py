"""A test CA, server and client certificates (made with openssl), and a redis-server that speaks TLS with them."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

from tiercache.testing.redis_servers import RedisServer, free_port

CERT_DAYS = "1"


def openssl(*args: str | Path) -> None:
    """Run ``openssl ARGS`` (raises on failure, or when openssl is missing)."""
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


def make_pki(directory: Path) -> dict[str, Path]:
    """A CA, another CA, a server certificate for 127.0.0.1 and a client certificate, all in ``directory``."""
    ca = issue(directory, "test-ca", None, "")
    other_ca = issue(directory, "other-ca", None, "")
    server = issue(directory, "server", ca, "subjectAltName=IP:127.0.0.1\n")
    client = issue(directory, "client", ca, "extendedKeyUsage=clientAuth\n")
    return {
        "ca": ca[1], "other_ca": other_ca[1],
        "server_key": server[0], "server_cert": server[1],
        "client_key": client[0], "client_cert": client[1],
    }


def tls_server(
    redis_factory: Callable[..., RedisServer], pki: dict[str, Path], mutual: bool
) -> tuple[RedisServer, str]:
    """A server with a plain port (for the fixture's readiness check) and a TLS port; the TLS URL."""
    tls_port = free_port()
    server = redis_factory(extra_args=[
        "--tls-port", str(tls_port),
        "--tls-cert-file", str(pki["server_cert"]),
        "--tls-key-file", str(pki["server_key"]),
        "--tls-ca-cert-file", str(pki["ca"]),
        "--tls-auth-clients", "yes" if mutual else "no",
    ])
    return server, f"rediss://127.0.0.1:{tls_port}"
