"""A namespace's secret, stretched once into the two things a keyed namespace needs.

With ``model.secret_env`` a namespace is keyed: its values carry a keyed MAC,
and its block keys depend on the secret too, so engines with different secrets
(or none) address disjoint keys and never find (by a presence check), read, overwrite
or delete each other's values, while engines sharing the secret share entries. This module is
the one place that turns a secret into what that needs:

- the *stretched key*: scrypt (memory-hard; ``SCRYPT_*``) of the secret, salted
  with the unkeyed namespace root (model, layout, rank, tenant, LoRA), so a
  guess costs one scrypt and must be recomputed per namespace;
- the namespace's *key id* (16 bytes): a keyed BLAKE2b of a label under the
  stretched key, mixed into the namespace root (``Namespace.key_id``);
- the values' *MAC key* (32 bytes): another keyed BLAKE2b under the stretched
  key (another label), the codec's secret.

Why the key id is safe to expose (block keys in a store, KV events, ``tiercache
inspect`` all derive from it): it is a PRF output under a key only scrypt of
the secret yields, so it tells nothing of the secret or the MAC key, and
testing a guessed secret against it, against a block key of a known prompt, or
against a value's MAC costs a full scrypt per guess: every oracle an observer
has sits behind the stretch. The raw secret is used once per namespace, here,
and kept in no object this module returns (only as its cache's key, in this
process, whose environment holds it anyway). A random secret of 16 or more
bytes (what the README asks for) cannot be guessed at all; the stretch is what
protects a weak one.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
from dataclasses import dataclass

from tiercache.blocks.codec import Codec
from tiercache.blocks.keys import KEY_BYTES, Namespace
from tiercache.blocks.value_format import MAX_SECRET_BYTES, MIN_SECRET_BYTES

SCRYPT_N = 2**15
"""scrypt's CPU/memory cost: 32 MiB and about 0.1-0.2 s per derivation (once per namespace and process)."""
SCRYPT_R = 8
"""scrypt's block size (the usual 8)."""
SCRYPT_P = 1
"""scrypt's parallelism (1: the cost is all sequential)."""
SCRYPT_MAXMEM = 64 * 1024 * 1024
"""Memory scrypt may use: above the 32 MiB that ``SCRYPT_N`` x ``SCRYPT_R`` take (OpenSSL's default is 32 MiB)."""
STRETCHED_BYTES = 32
SALT_LABEL = b"tiercache-namespace-secret\x1f"
"""Prefix of the scrypt salt (then the unkeyed namespace root)."""
NAMESPACE_KEY_ID_PERSON = b"tiercache-ns-id"
"""BLAKE2b personalisation of the key id (at most 16 bytes), so it is never the MAC key or anything else."""
MAC_KEY_PERSON = b"tiercache-mac"
"""BLAKE2b personalisation of the MAC key."""
MAC_KEY_BYTES = 32


@dataclass(frozen=True)
class NamespaceKey:
    """What a secret gives one namespace: its key id (public) and its values' MAC key (secret, never shown)."""

    key_id: bytes
    mac_key: bytes = dataclasses.field(repr=False)


@functools.lru_cache(maxsize=16)
def namespace_key(secret: bytes, namespace: Namespace) -> NamespaceKey:
    """Stretch ``secret`` (16-64 bytes) for ``namespace`` (see the module docstring); cached, it is slow on purpose."""
    if not MIN_SECRET_BYTES <= len(secret) <= MAX_SECRET_BYTES:
        raise ValueError(f"secret must be {MIN_SECRET_BYTES}-{MAX_SECRET_BYTES} bytes")
    salt = SALT_LABEL + dataclasses.replace(namespace, key_id=b"").root()
    stretched = hashlib.scrypt(
        secret, salt=salt, n=SCRYPT_N, r=SCRYPT_R, p=SCRYPT_P, maxmem=SCRYPT_MAXMEM, dklen=STRETCHED_BYTES
    )
    key_id = hashlib.blake2b(key=stretched, person=NAMESPACE_KEY_ID_PERSON, digest_size=KEY_BYTES).digest()
    mac_key = hashlib.blake2b(key=stretched, person=MAC_KEY_PERSON, digest_size=MAC_KEY_BYTES).digest()
    return NamespaceKey(key_id, mac_key)


def keyed_namespace(namespace: Namespace, secret: bytes | None) -> tuple[Namespace, Codec]:
    """``namespace`` keyed with ``secret`` (its root then depends on it) and the codec of its values.

    Without a secret the namespace is returned as it is, with the plain codec
    (its keys and values are those of every earlier release).
    """
    if secret is None:
        return namespace, Codec(namespace.root())
    key = namespace_key(secret, namespace)
    keyed = dataclasses.replace(namespace, key_id=key.key_id)
    return keyed, Codec(keyed.root(), secret=key.mac_key)
