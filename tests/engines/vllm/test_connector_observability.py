"""What the connector tells vLLM (stats, Prometheus, KV events) and what it never does (raise into vLLM's loop).

Stats go the way vLLM carries them (``SchedulerStats.kv_connector_stats``) into
vLLM's own ``KVConnectorLogging`` and the connector's Prometheus metrics; KV
events are read back from vLLM's own ZeroMQ publisher (its replay socket). A
broken metadata, garbage arguments and a dead Redis answer as misses or failed
jobs.
"""

from __future__ import annotations

import functools
import threading
import time
import uuid
from collections import Counter
from typing import Any

import msgspec
import zmq
from prometheus_client import CollectorRegistry, Gauge, Histogram
from prometheus_client import Counter as PromCounter
from support.vllm_connector import PROMPT, Instances, remote_written, request, tiers_of, totals
from support.vllm_parts import BLOCK, LAYERS, cpu_topology, redis_remote
from vllm.config import KVEventsConfig
from vllm.distributed.kv_events import BlockStored, KVEventBatch
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorLogging
from vllm.forward_context import ForwardContext
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash
from vllm.v1.outputs import KVConnectorOutput

from tiercache.integrations.vllm.connector import TierCacheConnector
from tiercache.integrations.vllm.connector.metadata import CopyJob, TierCacheConnectorMetadata, TierCacheWorkerMetadata
from tiercache.testing.redis_servers import RedisServer

END_SEQ = (-1).to_bytes(8, "big", signed=True)
WAIT_S = 20.0




def test_stats_reach_vllms_logger_and_prometheus(vllm: Instances, redis_server: RedisServer) -> None:
    remote = redis_remote(redis_server.url)
    first = vllm.new("first", cpu_topology(remotes=[remote]))
    first.serve(request("a", PROMPT))
    remote_written(first, "redis", 6)
    second = vllm.new("second", cpu_topology(remotes=[remote]))
    data = totals(second.serve(request("b", PROMPT)))
    assert data["loaded_blocks"] == 6 and data["hit_blocks:redis"] == 6 and data["lookups"] == 1
    logged: list[str] = []
    logging = KVConnectorLogging(second.config.kv_transfer_config)
    logging.observe(data)
    logging.log(log_fn=lambda fmt, *args: logged.append(fmt % args))
    assert "loaded_blocks=6" in logged[0]
    registry = CollectorRegistry()
    types = {kind: functools.partial(kind, registry=registry) for kind in (Gauge, PromCounter, Histogram)}
    metrics = TierCacheConnector.build_prom_metrics(second.config, types, ["model_name", "engine"],
                                                    {0: ["tiny", "0"]})
    metrics.observe(data, 0)
    labels = {"model_name": "tiny", "engine": "0"}
    assert registry.get_sample_value("vllm:tiercache_loaded_blocks_total", labels) == 6
    assert registry.get_sample_value("vllm:tiercache_hit_blocks_total", {**labels, "tier": "redis"}) == 6
    assert TierCacheConnector.build_kv_connector_stats(None).is_empty()


def replayed(endpoint: str, topic: str) -> list[Any]:
    """Every batch vLLM's publisher still buffers, through its replay socket."""
    context = zmq.Context.instance()
    socket = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.connect(endpoint)
    decoder = msgspec.msgpack.Decoder(KVEventBatch)
    batches = []
    try:
        socket.send_multipart([b"", (0).to_bytes(8, "big")])
        while socket.poll(int(WAIT_S * 1000)):
            _, _, seq, payload = socket.recv_multipart()
            if seq == END_SEQ:
                return batches
            batches.append(decoder.decode(payload))
        raise AssertionError("vLLM's publisher never answered the replay")
    finally:
        socket.close()


def test_take_events_reports_blocks_stored_by_vllms_hashes(vllm: Instances) -> None:
    name = f"/tmp/tc-{uuid.uuid4().hex[:8]}"
    events = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=f"ipc://{name}-pub",
                            replay_endpoint=f"ipc://{name}-replay", topic="kv")
    instance = vllm.new("events", cpu_topology(), events=events)
    served = instance.add(request("a", PROMPT))
    instance.run(served.is_finished)
    expected = [maybe_convert_block_hash(block_hash) for block_hash in served.block_hashes[:6]]
    deadline = time.monotonic() + WAIT_S
    while True:
        stored = [event for batch in replayed(f"ipc://{name}-replay", "kv") for event in batch.events
                  if isinstance(event, BlockStored)]
        cpu = [event for event in stored if event.medium == "CPU"]
        if cpu or time.monotonic() > deadline:
            break
        time.sleep(0.01)
    assert [h for event in cpu for h in event.block_hashes] == expected
    assert cpu[0].parent_block_hash is None and cpu[0].ownership == "tiercache:cpu"
    assert [t for event in cpu for t in event.token_ids] == PROMPT[: 6 * BLOCK]
    gpu = [h for event in stored if event.medium != "CPU" for h in event.block_hashes]
    assert set(expected) <= set(gpu), "the same names vLLM gives the blocks in its own pool"


def test_no_events_when_vllms_kv_events_are_off(vllm: Instances) -> None:
    instance = vllm.new("quiet", cpu_topology())
    instance.serve(request("a", PROMPT))
    assert list(instance.connector.take_events()) == []


def test_scheduler_hooks_answer_garbage_with_misses(vllm: Instances) -> None:
    connector = vllm.new("garbage", cpu_topology()).connector
    assert connector.get_num_new_matched_tokens(None, 0) == (0, False)
    assert connector.update_state_after_alloc(None, None, 16) is None
    assert isinstance(connector.build_connector_meta(None), TierCacheConnectorMetadata)
    unknown = TierCacheWorkerMetadata(done=Counter({12345: 1}), failed=Counter({678: 1}))
    assert connector.update_connector_output(KVConnectorOutput(kv_connector_worker_meta=unknown)) is None
    assert connector.request_finished(None, []) == (False, None)


def run_worker_step(instance: Any, metadata: TierCacheConnectorMetadata) -> Any:
    """The model runner's connector calls for one step with a forward, around ``metadata``."""
    worker = instance.worker
    worker.bind_connector_metadata(metadata)
    context = ForwardContext(no_compile_layers={}, slot_mapping={}, attn_metadata=dict.fromkeys(LAYERS, metadata))
    worker.start_load_kv(context)
    for name in LAYERS:
        worker.wait_for_layer_load(name)
        worker.save_kv_layer(name, instance.kv[name], context.attn_metadata)
    worker.wait_for_save()
    errors = worker.get_block_ids_with_load_errors()
    report = worker.build_connector_worker_meta()
    worker.clear_connector_metadata()
    return errors, report


def test_a_broken_load_job_is_a_load_error_never_an_exception(vllm: Instances) -> None:
    instance = vllm.new("broken-load", cpu_topology())
    errors, report = run_worker_step(instance, TierCacheConnectorMetadata(loads=[CopyJob(1, (10**6,), (5,), (0,))]))
    assert errors == {5}, "vLLM recomputes the block: it is never served"
    assert report.failed == Counter({1: 1})


def test_a_broken_store_job_is_reported_failed_and_holds_no_slot(vllm: Instances) -> None:
    instance = vllm.new("broken-store", cpu_topology(blocks=8))
    instance.add(request("a", PROMPT))
    stores = instance.scheduler.schedule().kv_connector_metadata.stores
    assert [len(job.slots) for job in stores] == [6]
    broken = [CopyJob(job.job_id, job.slots, (*job.block_ids[:-1], 10**6), job.groups)  # not vLLM's block
              for job in stores]
    errors, report = run_worker_step(instance, TierCacheConnectorMetadata(stores=broken))
    assert errors == set() and report.failed == Counter({stores[0].job_id: 1}) and not report.done
    instance.connector.update_connector_output(KVConnectorOutput(kv_connector_worker_meta=report))
    occupancy = tiers_of(instance).stats()["tiers"]["cpu"]
    assert occupancy["free_blocks"] == 8 and occupancy["cached_blocks"] == 0, "the aborted write gave its slots back"
    assert instance.connector.get_kv_connector_stats().data["failed_stores"] == 1


def test_a_dead_redis_is_a_miss_and_the_instances_keep_serving(vllm: Instances, redis_server: RedisServer) -> None:
    remote = redis_remote(redis_server.url)
    first = vllm.new("first", cpu_topology(remotes=[remote]))
    first.serve(request("a", PROMPT))
    remote_written(first, "redis", 6)
    redis_server.kill()
    second = vllm.new("second", cpu_topology(remotes=[remote]))
    records = second.serve(request("b", PROMPT))
    assert second.new_request(records, "b").num_computed_tokens == 0
    assert not [wrong for record in records for wrong in record.wrong_pages]
    later = first.serve(request("c", list(range(500, 560))))  # stores to a dead server: dropped, not raised
    assert totals(later)["stored_blocks"] == 3
    again = second.serve(request("d", PROMPT))
    assert second.new_request(again, "d").num_computed_tokens == 6 * BLOCK, "it keeps serving"


def test_a_stopped_redis_delays_a_request_briefly_and_shutdown_stays_bounded(
    vllm: Instances, redis_server: RedisServer
) -> None:
    remote = redis_remote(redis_server.url)
    first = vllm.new("first", cpu_topology(remotes=[remote]))
    first.serve(request("a", PROMPT))
    remote_written(first, "redis", 6)
    redis_server.stop()
    try:
        second = vllm.new("second", cpu_topology(remotes=[remote]))
        records = second.serve(request("b", PROMPT))  # the presence check times out: a miss, within the serve's bound
        assert second.new_request(records, "b").num_computed_tokens == 0
        assert totals(records).get("lookups_pending", 0) >= 1
        vllm.built.remove(second)
        finished = threading.Event()
        threading.Thread(target=lambda: (second.shutdown(), finished.set()), daemon=True).start()
        assert finished.wait(WAIT_S), "shutdown hung on a stopped Redis"
    finally:
        redis_server.cont()
