"""Another model (other weights, same shape, same directory name and served name) never loads model 0's KV.

It serves over the Redis the first server (model 0) wrote: the connector's
namespace comes from the model's identity (its files, not its served name), so
every lookup is a miss, and the answers are the other model's own.
"""

from __future__ import annotations

from pathlib import Path

from support.vllm_serving import Counted, ask, log_problems, redis_config, serving

from tiercache.testing.redis_servers import RedisServer

PROMPT_NAMES = ("long_a", "prefix_b", "long_b")


def test_other_weights_get_no_external_hits(model_dirs: dict[str, Path], logs: Path, baseline: dict[str, list[int]],
                                            first_server: object, shared_redis: RedisServer):
    assert model_dirs["seed0"].name == model_dirs["seed1"].name
    keys = int(shared_redis.cli("DBSIZE"))
    config = redis_config(shared_redis.url)
    with serving(model_dirs["seed1"], logs / "other-model.log", kv_transfer_config=config) as server:
        assert server.served_name == Path(model_dirs["seed0"]).name
        with Counted(server) as seen:
            answers = {name: ask(server, name) for name in PROMPT_NAMES}
        problems = log_problems(server)
    assert seen.external == 0
    assert seen.tiercache("lookups") == len(PROMPT_NAMES)  # it asked, and Redis held nothing of its own
    assert seen.tiercache("offered_blocks") == 0
    assert seen.local == 2048  # long_b after prefix_b: vLLM's own cache, as without the connector
    assert all(answers[name] != baseline[name] for name in PROMPT_NAMES)  # other weights: a hit would have mattered
    assert int(shared_redis.cli("DBSIZE")) > keys  # it wrote its own blocks, beside model 0's
    assert problems == []
