"""Token ids as engines hold them (lists, numpy arrays, torch tensors, ``[1, T]`` input_ids) hash alike;
anything that is not an integer id in ``[0, 2**63)`` is refused, whatever form it comes in."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from support.manager_helpers import topology

from tiercache import TierManager
from tiercache.blocks.keys import BlockHasher, Namespace, token_array

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
    with pytest.raises(TypeError, match="tokens must be integer ids"):
        HASHER.keys(tokens)


FLOATS = [[1.9] * 32, [1.1] * 32, [1, 2.0, 3], [[1.9] * 32]]


@pytest.mark.parametrize("tokens", FLOATS, ids=["1.9s", "1.1s", "one-float", "1xT-floats"])
def test_float_lists_are_refused_not_truncated(tokens: object) -> None:
    """``[1.9]*32`` and ``[1.1]*32`` used to truncate to the same ids and so share KV."""
    with pytest.raises(TypeError, match="tokens must be integer ids"):
        HASHER.keys(tokens)


@pytest.mark.parametrize(
    "tokens",
    [
        [2**64 - 1] * 4,
        [2**63] * 4,
        [1, 2**70],
        [-1, 3],
        [[5, -7]],
        np.array([2**64 - 1] * 4, dtype=np.uint64),
        np.array([[2**63, 1]], dtype=np.uint64),
        np.array([1, -1], dtype=np.int32),
        np.array([-(2**63)], dtype=np.int64),
        torch.tensor([3, -1]),
        torch.tensor([[-2, 4]], dtype=torch.int16),
        torch.tensor([2**64 - 1], dtype=torch.uint64),
    ],
    ids=[
        "list-u64-max", "list-2^63", "list-2^70", "list-neg", "list-1xT-neg", "np-u64-max", "np-1xT-u64",
        "np-int32-neg", "np-int64-min", "torch-neg", "torch-1xT-int16-neg", "torch-u64-max",
    ],
)
def test_out_of_range_tokens_are_refused(tokens: object) -> None:
    """A uint64 ``2**64-1`` used to hash like ``-1``: ids outside ``[0, 2**63)`` are refused, not wrapped."""
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 2\*\*63\)"):
        HASHER.keys(tokens)


@pytest.mark.parametrize("tokens", [np.array([1.5, 2], dtype=object), ["1", "2"], [None, 1], "12"])
def test_other_non_integers_are_refused(tokens: object) -> None:
    with pytest.raises(TypeError, match="tokens must be integer ids"):
        HASHER.keys(tokens)


@pytest.mark.parametrize(
    "tokens",
    [
        np.array(TOKENS, dtype=np.uint64),
        torch.tensor(TOKENS, dtype=torch.uint64),
        torch.tensor(TOKENS, dtype=torch.int64).to(torch.uint32),
        [np.int64(t) for t in TOKENS],
    ],
    ids=["np-uint64", "torch-uint64", "torch-uint32", "list-of-np-int64"],
)
def test_every_integer_dtype_that_fits_is_accepted(tokens: object) -> None:
    assert HASHER.keys(tokens) == HASHER.keys(TOKENS)


SMALL_TOKENS = [7, 3, 9, 11, 2, 5, 1, 0, 42, 8, 127]


@pytest.mark.parametrize("dtype", [np.int8, np.uint8, np.int16, np.uint16, torch.int8, torch.uint8, torch.int16])
def test_narrow_integer_dtypes_are_widened(dtype: object) -> None:
    is_torch = isinstance(dtype, torch.dtype)
    tokens = torch.tensor(SMALL_TOKENS, dtype=dtype) if is_torch else np.array(SMALL_TOKENS, dtype=dtype)
    assert HASHER.keys(tokens) == HASHER.keys(SMALL_TOKENS)


def test_the_largest_id_is_accepted_and_distinct() -> None:
    top = [2**63 - 1] * 4
    assert HASHER.keys(top) == HASHER.keys(np.array(top, dtype=np.uint64)) != HASHER.keys([0] * 4)


def test_an_empty_prompt_has_no_keys() -> None:
    assert HASHER.keys([]) == HASHER.keys(np.array([], dtype=np.int64)) == []


def test_the_manager_refuses_bad_tokens_before_changing_anything() -> None:
    """``lookup`` and ``store`` raise on float tokens; the store indexes nothing and holds its blocks as before."""
    with TierManager(topology(gpu_blocks=8)) as manager:
        ids = manager.allocate(4)
        with pytest.raises(TypeError, match="tokens must be integer ids"):
            manager.store([1.9] * 8, ids)
        with pytest.raises(ValueError, match=r"token ids must be in \[0, 2\*\*63\)"):
            manager.lookup(np.full(8, 2**64 - 1, dtype=np.uint64))
        assert manager.lookup([1] * 8, local_only=True).num_blocks == 0
        manager.store([1] * 8, ids).result()
        manager.release(ids)
        assert manager.lookup([1] * 8, local_only=True).num_blocks == 4
