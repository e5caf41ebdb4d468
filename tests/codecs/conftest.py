"""Real KV for the codecs' tests: a few short ShareGPT contexts through SmolLM2 (cached after the first run), and
compact tables learned on other conversations than the ones checked."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tiercache.codecs.tables import CompactTables, learn_tables
from tiercache.testing.real_model import build_smollm2, model_cache
from tiercache.tools.real_kv import cached_kv

LEARN_CONTEXTS = 4
LEARN_TOKENS = 256
CHECK_CONTEXTS = 2
CHECK_TOKENS = 64
CHECK_SKIP = 40
"""The checked contexts come after the learned ones in the file (held apart)."""
KV_CACHE = "real-kv"
"""Folder of the model cache that keeps the computed K/V."""


def sample_kv(count: int, tokens: int, skip: int = 0) -> list[torch.Tensor]:
    return cached_kv(build_smollm2(), model_cache() / KV_CACHE, count, tokens, skip)


@pytest.fixture(scope="session")
def learned_kv() -> list[torch.Tensor]:
    return sample_kv(LEARN_CONTEXTS, LEARN_TOKENS)


@pytest.fixture(scope="session")
def real_kv() -> list[torch.Tensor]:
    """``[layers, 2, tokens, channels]`` float32 K/V of contexts apart from the learned ones."""
    return sample_kv(CHECK_CONTEXTS, CHECK_TOKENS, skip=CHECK_SKIP)


@pytest.fixture(scope="session")
def tables(learned_kv: list[torch.Tensor]) -> CompactTables:
    return learn_tables(learned_kv)


@pytest.fixture(scope="session")
def tables_file(tables: CompactTables, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tables") / "smollm2.npz"
    tables.save(path)
    return path
