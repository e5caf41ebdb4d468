"""Chained block keys: stable across processes, separated by namespace, full blocks only."""

from __future__ import annotations

import hashlib
import subprocess
import sys

import numpy as np

from tiercache.keys import KEY_BYTES, BlockHasher, Namespace

NS = Namespace("llama-3-8b", "abcd1234", tp_rank=1, tenant_salt="acme", lora_id="sql-adapter")


def test_keys_are_identical_in_another_process() -> None:
    tokens = list(range(1000, 1000 + 16 * 5 + 3))
    script = (
        "from tiercache.keys import BlockHasher, Namespace\n"
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
