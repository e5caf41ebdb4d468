"""The connector's two sides under vLLM 0.33's own scheduler: the shared region, save -> load across instances.

Each instance is vLLM's ``Scheduler`` with the SCHEDULER connector and a WORKER
connector over real CPU KV tensors (``support.vllm_connector``); a second
instance (another ``engine_id``) reads what the first saved through the same
Redis or simulated store. Every page the attention would read is checked bit for
bit at the moment it reads it.
"""

from __future__ import annotations

import time

import pytest
from support.vllm_connector import PROMPT, Instance, Instances, page_bytes, remote_written, request, tiers_of, totals
from support.vllm_parts import (
    BLOCK,
    LAYERS,
    cpu_topology,
    fresh_store,
    kv_cache_config,
    redis_remote,
    simulated_remote,
    vllm_config,
)
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

from tiercache.integrations.vllm.connector.region import RegionError
from tiercache.testing.redis_servers import RedisServer


@pytest.fixture(params=["redis", "simulated"])
def shared_remote(request: pytest.FixtureRequest) -> tuple[str, dict]:
    """A remote two instances share: a real Redis, or a named simulated store."""
    if request.param == "redis":
        server: RedisServer = request.getfixturevalue("redis_server")
        return "redis", redis_remote(server.url)
    return "sim", simulated_remote()


def test_the_worker_maps_the_region_first_and_the_scheduler_shares_it(vllm: Instances) -> None:
    one = vllm.new("one", cpu_topology())
    assert not list(vllm.root.glob("tiercache-one-*")), "the scheduler unlinks the region's name once mapped"
    one.serve(request("r", PROMPT))
    tiers = tiers_of(one)
    keys = tiers.hasher.keys(PROMPT[: 6 * BLOCK], None)
    hit = tiers.lookup(keys, local_only=True)
    assert hit is not None and hit.num_blocks == 6
    fetch = tiers.fetch(hit)
    for position, slot in enumerate(fetch.slots()):
        expected = b"".join(bytes(page_bytes(layer, PROMPT[: (position + 1) * BLOCK]).numpy()) for layer in
                            range(len(LAYERS)))
        assert bytes(tiers.buffer_view(slot)) == expected, "the scheduler's slot holds what the worker copied"
    fetch.release()


def test_the_scheduler_refuses_a_region_no_worker_made(vllm: Instances) -> None:
    config = vllm_config(vllm.model, "alone", vllm.extra(cpu_topology()))
    with pytest.raises(RegionError, match="missing"):
        Scheduler(vllm_config=config, kv_cache_config=kv_cache_config(), block_size=BLOCK,
                  structured_output_manager=StructuredOutputManager(config))


def test_the_scheduler_refuses_a_region_a_rank_did_not_map(vllm: Instances) -> None:
    config = vllm_config(vllm.model, "tp2", vllm.extra(cpu_topology()), tensor_parallel_size=2)
    with pytest.raises(RegionError, match=r"ranks \[1\] of 2"):
        Instance(config)  # one worker (rank 0) of two registers


def test_a_saved_prompt_comes_back_bit_exact_into_other_blocks_on_a_second_instance(
    vllm: Instances, shared_remote: tuple[str, dict]
) -> None:
    name, remote = shared_remote
    first = vllm.new("first", cpu_topology(remotes=[remote]))
    occupy = first.serve(request("warm", list(range(400, 440))))  # moves the first free blocks along
    saved = first.serve(request("a", PROMPT))
    assert totals(occupy + saved)["stored_blocks"] == 2 + 6
    remote_written(first, name, 8)
    second = vllm.new("second", cpu_topology(remotes=[remote]))
    records = second.serve(request("b", PROMPT))
    new = second.new_request(records, "b")
    assert new.num_computed_tokens == 6 * BLOCK, "every full block but none of the partial tail"
    assert sum(record.external_hits for record in records) == 6 * BLOCK
    assert not [wrong for record in records for wrong in record.wrong_pages]
    assert not any(record.invalid_blocks for record in records)
    assert set(new.block_ids[0][:6]) != set(first.new_request(saved, "a").block_ids[0][:6]), "other block ids"
    counts = totals(records)
    assert counts["loaded_blocks"] == 6 and counts[f"hit_blocks:{name}"] == 6
    assert counts.get("failed_loads", 0) == 0


def test_the_answer_leaves_a_token_to_compute_and_adds_whole_blocks_to_the_local_hit(vllm: Instances) -> None:
    remote = simulated_remote()
    first = vllm.new("first", cpu_topology(remotes=[remote]))
    aligned = PROMPT[: 6 * BLOCK]
    first.serve(request("a", aligned))
    remote_written(first, "sim", 6)
    second = vllm.new("second", cpu_topology(remotes=[remote]))
    records = second.serve(request("b", aligned))
    assert second.new_request(records, "b").num_computed_tokens == 5 * BLOCK, "a sync load leaves one token"
    local = second.serve(request("c", aligned[: 3 * BLOCK] + list(range(600, 620))))
    assert second.new_request(local, "c").num_computed_tokens == 3 * BLOCK
    third = vllm.new("third", cpu_topology(remotes=[remote]))
    third.serve(request("head", aligned[: 2 * BLOCK] + [900] * 5))  # vLLM's own cache: 2 blocks
    records = third.serve(request("whole", PROMPT))
    assert third.new_request(records, "whole").num_computed_tokens == 6 * BLOCK, "local 2 + 4 loaded"
    assert sum(record.external_hits for record in records) == 4 * BLOCK
    assert not [wrong for record in records for wrong in record.wrong_pages]


def test_none_while_a_remote_presence_check_is_pending_then_a_number(vllm: Instances) -> None:
    remote = simulated_remote()
    first = vllm.new("first", cpu_topology(remotes=[remote]))
    first.serve(request("a", PROMPT))
    remote_written(first, "sim", 6)
    for held in ("contains", "get"):  # the presence check, then the read of a wait_complete fetch
        # no idle wait: this is the protocol of a busy engine (an idle one waits for the remote, up to its give-up)
        second = vllm.new(f"second-{held}", cpu_topology(remotes=[remote]), options={"idle_wait_ms": 0})
        tier = tiers_of(second).parts.remotes[0]
        tier.hold(held)
        asked = request(f"b-{held}", PROMPT)
        second.add(asked)
        try:
            for _ in range(3):
                assert not second.step().output.num_scheduled_tokens, "the request waits while the remote answers"
                assert second.connector.get_num_new_matched_tokens(asked, 0) == (None, False)
        finally:
            tier.unhold(held)
        scheduled = second.until_scheduled(asked.request_id)
        assert second.new_request([scheduled], asked.request_id).num_computed_tokens == 6 * BLOCK
        second.run(lambda asked=asked: asked.is_finished())


def test_a_load_never_started_is_reported_and_recomputed_never_served(vllm: Instances) -> None:
    remote = simulated_remote()
    first = vllm.new("first", cpu_topology(remotes=[remote]))
    first.serve(request("a", PROMPT))
    remote_written(first, "sim", 6)
    second = vllm.new("second", cpu_topology(remotes=[remote]))
    second.skip_loads = True  # a runner that calls neither start_load_kv nor wait_for_layer_load
    asked = second.add(request("b", PROMPT))
    loading = second.until_scheduled("b")
    loaded = second.new_request([loading], "b").block_ids[0][:6]
    assert loading.invalid_blocks == set(loaded)
    assert {wrong[1] for wrong in loading.wrong_pages} == set(LAYERS), "every layer read pages never loaded"
    assert asked.num_computed_tokens == 0, "vLLM rewinds to the first invalid block (kv_load_failure_policy)"
    second.skip_loads = False
    rest = second.run(asked.is_finished)
    assert rest[0].output.num_scheduled_tokens["b"] == len(PROMPT), "recomputed from the start"
    assert not [wrong for record in rest for wrong in record.wrong_pages]
    assert totals([loading, *rest]).get("failed_loads") == 1


def test_a_producer_never_loads_and_a_consumer_never_stores(vllm: Instances) -> None:
    store = fresh_store()
    first = vllm.new("first", cpu_topology(remotes=[simulated_remote(store)]))
    first.serve(request("a", PROMPT))
    remote_written(first, "sim", 6)
    producer = vllm.new("producer", cpu_topology(remotes=[simulated_remote(store)]), kv_role="kv_producer")
    produced = producer.serve(request("p", PROMPT))
    assert producer.new_request(produced, "p").num_computed_tokens == 0
    assert totals(produced).get("stored_blocks") == 6 and "lookups" not in totals(produced)
    consumer = vllm.new("consumer", cpu_topology(remotes=[simulated_remote(store)]), kv_role="kv_consumer")
    consumed = consumer.serve(request("c", PROMPT))
    assert consumer.new_request(consumed, "c").num_computed_tokens == 6 * BLOCK
    fresh = consumer.serve(request("n", list(range(700, 760))))
    assert "stored_blocks" not in totals(consumed + fresh)
    tiers = tiers_of(consumer)
    assert tiers.stats()["tiers"]["cpu"]["cached_blocks"] == 6, "only what it loaded (read through its CPU tier)"
    miss = tiers.lookup(tiers.hasher.keys(list(range(700, 748)), None), local_only=True)
    assert miss is not None and miss.num_blocks == 0
    tiers.release(miss)


def test_a_long_prompt_saved_over_chunked_prefill_steps_loads_whole(vllm: Instances) -> None:
    remote = simulated_remote()
    long_prompt = list(range(1000, 1300))  # 18 full blocks; 256 tokens a step at most
    first = vllm.new("first", cpu_topology(remotes=[remote]))
    saved = first.serve(request("a", long_prompt))
    assert [r.output.num_scheduled_tokens.get("a") for r in saved if r.output.num_scheduled_tokens][:2] == [256, 44]
    stores = [len(job.slots) for record in saved for job in record.output.kv_connector_metadata.stores]
    assert stores == [16, 2], "each step stores the blocks it filled"
    remote_written(first, "sim", 18)
    second = vllm.new("second", cpu_topology(remotes=[remote]))
    records = second.serve(request("b", long_prompt))
    assert second.new_request(records, "b").num_computed_tokens == 18 * BLOCK
    assert not [wrong for record in records for wrong in record.wrong_pages]


def test_a_request_aborted_while_its_blocks_are_read_gives_every_pin_back(vllm: Instances) -> None:
    remote = simulated_remote()
    first = vllm.new("first", cpu_topology(remotes=[remote]))
    first.serve(request("a", PROMPT))
    remote_written(first, "sim", 6)
    second = vllm.new("second", cpu_topology(remotes=[remote]))
    tiers = tiers_of(second)
    tiers.parts.remotes[0].hold("get")
    second.add(request("b", PROMPT))
    try:
        assert not second.step().output.num_scheduled_tokens
        assert not second.step().output.num_scheduled_tokens
        second.scheduler.finish_requests("b", RequestStatus.FINISHED_ABORTED)
    finally:
        tiers.parts.remotes[0].unhold("get")
    second.step()
    deadline = time.monotonic() + 20
    while (occupancy := tiers.stats()["tiers"]["cpu"])["free_blocks"] + occupancy["evictable_blocks"] < 48:
        assert time.monotonic() < deadline, f"pins left behind: {occupancy}"
        time.sleep(0.002)
    assert not second.connector._scheduler.requests
