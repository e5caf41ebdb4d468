"""Token ids as engines hold them (lists, numpy arrays, torch tensors, ``[1, T]`` input_ids) hash alike."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tiercache.keys import BlockHasher, Namespace, token_array

HASHER = BlockHasher(Namespace("model", "layout"), 4)
TOKENS = [7, 150_000, 3, 9, 11, 2, 5, 1, 0, 42, 8]


@pytest.mark.parametrize(
    "tokens",
    [
        np.array(TOKENS, dtype=np.int64),
        np.array(TOKENS, dtype=np.int32),
        np.array(TOKENS, dtype=np.uint32),
        np.array([TOKENS], dtype=np.int64),
        torch.tensor(TOKENS),
        torch.tensor(TOKENS, dtype=torch.int32),
        torch.tensor([TOKENS]),
        torch.tensor([TOKENS, TOKENS]).t()[:, 0],
    ],
    ids=["np-int64", "np-int32", "np-uint32", "np-1xT", "torch", "torch-int32", "torch-1xT", "torch-strided"],
)
def test_every_input_type_gives_the_list_keys(tokens: object) -> None:
    assert HASHER.keys(tokens) == HASHER.keys(TOKENS)


def test_list_keys_are_the_documented_chain() -> None:
    """The widening above must not change what a plain list hashes to (keys are shared across engines)."""
    assert token_array(TOKENS).dtype == np.dtype("<i8")
    assert HASHER.keys(TOKENS) == BlockHasher(Namespace("model", "layout"), 4).keys(np.asarray(TOKENS, dtype="<i8"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_input_ids() -> None:
    assert HASHER.keys(torch.tensor([TOKENS], device="cuda")) == HASHER.keys(TOKENS)


@pytest.mark.parametrize(
    "tokens",
    [np.zeros((2, 8), dtype=np.int64), torch.zeros(2, 8, dtype=torch.long), np.zeros((1, 2, 4), dtype=np.int64)],
)
def test_batches_of_several_sequences_are_refused(tokens: object) -> None:
    with pytest.raises(ValueError, match=r"one-dimensional or \[1, T\]"):
        HASHER.keys(tokens)


@pytest.mark.parametrize("tokens", [np.array([1.5, 2.0]), torch.tensor([1.0, 2.0]), np.array([True, False])])
def test_non_integer_arrays_are_refused(tokens: object) -> None:
    with pytest.raises(TypeError, match="tokens must be integers"):
        HASHER.keys(tokens)
