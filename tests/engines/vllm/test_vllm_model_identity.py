"""One rule for "same model" through both vLLM adapters: the KV connector and the secondary tier (vLLM 0.33).

Each case serves real vLLM classes over a checkpoint directory on disk: a fine-tune saved over the same
path (same config, same served path) and another model in a directory of the same name elsewhere get
nothing of the first's KV; the same checkpoint served again, or copied to another directory, shares it.
vLLM reads no weights here; the adapters digest them as they would under a real server.
"""

from __future__ import annotations

from pathlib import Path

from support.checkpoints import copy_checkpoint, write_weights
from support.vllm_connector import PROMPT, Instances, remote_written, request
from support.vllm_parts import BLOCK, cpu_topology, model_dir, simulated_remote
from support.vllm_tiers import engine_over

from tiercache.testing.redis_servers import RedisServer
from tiercache.testing.vllm_offloading import Engine, chunk_keys, payloads, redis_topology

PROMPT_BLOCKS = 6
CHUNKS = 4


def checkpoint(directory: Path, seed: int) -> Path:
    """A model directory vLLM's ``ModelConfig`` reads (a tiny Llama's config) with weights of ``seed``."""
    return write_weights(model_dir(directory.parent, directory.name), seed)


def served_tokens(vllm: Instances, engine_id: str, remote: dict, model: Path) -> int:
    """A fresh connector instance over ``model`` serves ``PROMPT``: the tokens it did not compute."""
    instance = vllm.new(engine_id, cpu_topology(remotes=[remote]), model=model)
    records = instance.serve(request(engine_id, PROMPT))
    return instance.new_request(records, engine_id).num_computed_tokens


def stored_by_connector(vllm: Instances, model: Path) -> dict:
    """A remote holding ``PROMPT``'s blocks, written by a connector instance serving ``model``."""
    remote = simulated_remote()
    writer = vllm.new("writer", cpu_topology(remotes=[remote]), model=model)
    writer.serve(request("first", PROMPT))
    remote_written(writer, "sim", PROMPT_BLOCKS)
    return remote


def test_connector_a_fine_tune_saved_over_the_same_path_gets_nothing(vllm: Instances, tmp_path: Path) -> None:
    path = checkpoint(tmp_path / "served" / "model", seed=0)
    remote = stored_by_connector(vllm, path)
    write_weights(path, seed=1)
    assert served_tokens(vllm, "updated", remote, path) == 0
    write_weights(path, seed=0)  # rolled back: the first weights' blocks are its again
    assert served_tokens(vllm, "rolled-back", remote, path) == PROMPT_BLOCKS * BLOCK


def test_connector_directories_of_one_name_stay_apart_and_a_copy_shares(vllm: Instances, tmp_path: Path) -> None:
    path = checkpoint(tmp_path / "team-a" / "model", seed=0)
    remote = stored_by_connector(vllm, path)
    assert served_tokens(vllm, "same-name", remote, checkpoint(tmp_path / "team-b" / "model", seed=1)) == 0
    copy = copy_checkpoint(path, tmp_path / "elsewhere" / "renamed")
    assert served_tokens(vllm, "copy", remote, copy) == PROMPT_BLOCKS * BLOCK
    assert served_tokens(vllm, "again", remote, path) == PROMPT_BLOCKS * BLOCK


def written_by_tier(redis_server: RedisServer, engines: list[Engine], model: Path) -> tuple[dict, list]:
    """A Redis holding ``CHUNKS`` chunks that a secondary tier of vLLM serving ``model`` cascaded down."""
    topology = redis_topology(redis_server)
    writer = engine_over(engines, topology, model=str(model))
    keys = chunk_keys(CHUNKS, "identity")
    writer.store(keys, payloads(CHUNKS, writer.row_bytes, seed=5))
    writer.settle()
    assert int(redis_server.cli("DBSIZE")) == CHUNKS
    return topology, keys


def hits(engines: list[Engine], topology: dict, keys: list, model: Path) -> int:
    """Chunks a fresh vLLM instance over ``model`` loads from the secondary tier."""
    return sum(chunk is not None for chunk in engine_over(engines, topology, model=str(model)).read(keys))


def test_tier_a_fine_tune_saved_over_the_same_path_gets_nothing(
    redis_server: RedisServer, engines: list[Engine], tmp_path: Path
) -> None:
    path = checkpoint(tmp_path / "served" / "model", seed=0)
    topology, keys = written_by_tier(redis_server, engines, path)
    write_weights(path, seed=1)
    assert hits(engines, topology, keys, path) == 0
    write_weights(path, seed=0)
    assert hits(engines, topology, keys, path) == CHUNKS


def test_tier_directories_of_one_name_stay_apart_and_a_copy_shares(
    redis_server: RedisServer, engines: list[Engine], tmp_path: Path
) -> None:
    path = checkpoint(tmp_path / "team-a" / "model", seed=0)
    topology, keys = written_by_tier(redis_server, engines, path)
    assert hits(engines, topology, keys, checkpoint(tmp_path / "team-b" / "model", seed=1)) == 0
    assert hits(engines, topology, keys, copy_checkpoint(path, tmp_path / "elsewhere" / "renamed")) == CHUNKS
    assert hits(engines, topology, keys, path) == CHUNKS
