"""Chained block keys: stable across processes, separated by namespace, full blocks only."""

from __future__ import annotations

import hashlib
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tiercache.blocks.keys import KEY_BYTES, BlockHasher, Namespace

NS = Namespace("llama-3-8b", "abcd1234", tp_rank=1, tenant_salt="acme", lora_id="sql-adapter")


def test_keys_are_identical_in_another_process() -> None:
    tokens = list(range(1000, 1000 + 16 * 5 + 3))
    script = (
        "from tiercache.blocks.keys import BlockHasher, Namespace\n"
        "ns = Namespace('llama-3-8b', 'abcd1234', tp_rank=1, tenant_salt='acme', lora_id='sql-adapter')\n"
        f"print(','.join(k.hex() for k in BlockHasher(ns, 16).keys({tokens!r}, extra='img:42')))\n"
    )
    output = subprocess.run([sys.executable, "-c", script], check=True, capture_output=True, text=True)
    here = [k.hex() for k in BlockHasher(NS, 16).keys(tokens, extra="img:42")]
    assert output.stdout.strip().split(",") == here


def test_chain_matches_an_independent_definition() -> None:
    tokens = np.arange(48) * 7
    root = hashlib.blake2b(
        b"\x1f".join(s.encode() for s in ("tiercache-v1", "llama-3-8b", "abcd1234", "1", "acme", "sql-adapter")),
        digest_size=KEY_BYTES,
    ).digest()
    previous, expected = root, []
    for block in range(3):
        body = np.asarray(tokens[block * 16 : (block + 1) * 16], dtype="<i8").tobytes()
        previous = hashlib.blake2b(previous + body, digest_size=KEY_BYTES).digest()
        expected.append(previous)
    assert BlockHasher(NS, 16).keys(tokens) == expected


def test_only_full_blocks_get_keys_and_prefixes_share_keys() -> None:
    hasher = BlockHasher(NS, 16)
    tokens = list(range(16 * 4 + 15))
    keys = hasher.keys(tokens)
    assert len(keys) == 4
    assert hasher.keys(tokens[:40]) == keys[:2]
    assert hasher.keys(tokens[:15]) == []
    changed = list(tokens)
    changed[17] += 1
    other = hasher.keys(changed)
    assert other[0] == keys[0]
    assert all(a != b for a, b in zip(other[1:], keys[1:], strict=True)), "a change must propagate down the chain"


def test_namespaces_and_extra_separate_keys() -> None:
    tokens = list(range(32))
    variants = [
        NS,
        Namespace("llama-3-8b", "abcd1234", tp_rank=0, tenant_salt="acme", lora_id="sql-adapter"),
        Namespace("llama-3-8b", "abcd1234", tp_rank=1, tenant_salt="other", lora_id="sql-adapter"),
        Namespace("llama-3-8b", "abcd1234", tp_rank=1, tenant_salt="acme", lora_id=None),
        Namespace("llama-3-8b", "ffff0000", tp_rank=1, tenant_salt="acme", lora_id="sql-adapter"),
        Namespace("mistral-7b", "abcd1234", tp_rank=1, tenant_salt="acme", lora_id="sql-adapter"),
    ]
    first_keys = {BlockHasher(ns, 16).keys(tokens)[0] for ns in variants}
    first_keys.add(BlockHasher(NS, 16).keys(tokens, extra=b"image-hash")[0])
    assert len(first_keys) == len(variants) + 1


def test_numpy_and_list_inputs_agree() -> None:
    hasher = BlockHasher(NS, 8)
    tokens = [5, 150_000, 0, 2**31 + 3] * 8
    assert hasher.keys(tokens) == hasher.keys(np.array(tokens, dtype=np.int64)) == hasher.keys(
        np.array(tokens, dtype=np.uint32)
    )


SECRET = b"a namespace secret of 32 bytes.."


def test_a_keyed_namespace_matches_an_independent_definition_and_hides_its_secret() -> None:
    """scrypt of the secret salted with the unkeyed root; key id and MAC key under it; the root keyed by the id."""
    from tiercache.remote.secret import keyed_namespace

    keyed, codec = keyed_namespace(NS, SECRET)
    stretched = hashlib.scrypt(
        SECRET, salt=b"tiercache-namespace-secret\x1f" + NS.root(), n=2**15, r=8, p=1, maxmem=2**26, dklen=32
    )
    key_id = hashlib.blake2b(key=stretched, person=b"tiercache-ns-id", digest_size=16).digest()
    mac_key = hashlib.blake2b(key=stretched, person=b"tiercache-mac", digest_size=32).digest()
    fields = ("tiercache-v1", "llama-3-8b", "abcd1234", "1", "acme", "sql-adapter")
    root = hashlib.blake2b(b"\x1f".join(s.encode() for s in fields), digest_size=KEY_BYTES, key=key_id).digest()
    assert keyed.key_id == key_id and keyed.root() == root and codec.fingerprint == root and codec.secret == mac_key
    assert BlockHasher(keyed, 16).keys(range(32))[0] == hashlib.blake2b(
        root + np.arange(16, dtype="<i8").tobytes(), digest_size=KEY_BYTES
    ).digest()
    from tiercache.remote.secret import namespace_key

    shown = repr(keyed_namespace(NS, SECRET)) + repr(namespace_key(SECRET, NS))
    assert SECRET.hex() not in shown and mac_key.hex() not in shown and repr(mac_key) not in shown
    plain, plain_codec = keyed_namespace(NS, None)
    assert plain == NS and plain_codec.fingerprint == NS.root() and not plain_codec.keyed


def test_key_ids_separate_secrets_and_namespaces_and_agree_across_processes() -> None:
    from tiercache.remote.secret import keyed_namespace

    other_ns = Namespace("llama-3-8b", "abcd1234", tp_rank=0, tenant_salt="acme", lora_id="sql-adapter")
    roots = {
        keyed_namespace(NS, SECRET)[0].root(),
        keyed_namespace(NS, SECRET[::-1])[0].root(),
        keyed_namespace(other_ns, SECRET)[0].root(),
        NS.root(),
        other_ns.root(),
    }
    assert len(roots) == 5
    script = (
        "from tiercache.blocks.keys import Namespace\nfrom tiercache.remote.secret import keyed_namespace\n"
        "ns = Namespace('llama-3-8b', 'abcd1234', tp_rank=1, tenant_salt='acme', lora_id='sql-adapter')\n"
        f"print(keyed_namespace(ns, {SECRET!r})[0].root().hex())\n"
    )
    output = subprocess.run([sys.executable, "-c", script], check=True, capture_output=True, text=True)
    assert output.stdout.strip() == keyed_namespace(NS, SECRET)[0].root().hex()


def test_a_secret_of_the_wrong_length_is_refused() -> None:
    from tiercache.remote.secret import keyed_namespace

    for secret in (b"short", b"x" * 65):
        with pytest.raises(ValueError, match="16-64 bytes"):
            keyed_namespace(NS, secret)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5 * 16 + 7), st.integers(0, 3), st.sampled_from([None, "img:1", "img:2"]),
                          st.booleans()), min_size=1, max_size=12))
def test_a_reused_hasher_gives_a_fresh_one_s_keys(calls: list[tuple[int, int, str | None, bool]]) -> None:
    """The last call's shared blocks are reused: prompts that grow, shrink, change a token, a salt or a parent."""
    reused = BlockHasher(NS, 16)
    base = list(range(100, 100 + 5 * 16 + 7))
    for length, changed, extra, chained in calls:
        tokens = base[:length]
        if changed and length:
            tokens[-changed % length] += 1  # a token changed near the end: the blocks before it are shared
        parent = b"p" * KEY_BYTES if chained else None
        assert reused.keys(tokens, extra, parent=parent) == BlockHasher(NS, 16).keys(tokens, extra, parent=parent)
