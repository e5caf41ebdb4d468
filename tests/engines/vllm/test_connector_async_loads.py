"""Asynchronous loads under vLLM 0.33's own scheduler: the request waits in WAITING_FOR_REMOTE_KVS while the batch
runs on, is scheduled once every worker reported its copy, and a failed one is recomputed per request."""

from __future__ import annotations

from support.vllm_connector import PROMPT, Instance, Instances, remote_written, request, totals
from support.vllm_groups import kv_config_of
from support.vllm_parts import BLOCK, cpu_topology, simulated_remote
from vllm.v1.request import RequestStatus

OTHER = list(range(600, 700))
"""A prompt no store holds."""
SECOND = list(range(1000, 1100))
"""Another prompt the remote holds (6 blocks)."""
LONG = list(range(2000, 2400))


def reader(vllm: Instances, loads: str) -> Instance:
    """A second instance over a remote that holds ``PROMPT``'s and ``SECOND``'s blocks, loading as ``loads``."""
    remote = simulated_remote()
    writer = vllm.new("writer", cpu_topology(remotes=[remote]))
    writer.serve(request("w", PROMPT))
    writer.serve(request("w2", SECOND))
    remote_written(writer, "sim", 12)
    return vllm.new("reader", cpu_topology(remotes=[remote]), options={"loads": loads})


def load_steps(records: list) -> list:
    """The steps whose metadata carried a load job."""
    return [record for record in records if record.output.kv_connector_metadata.loads]


def test_an_asynchronous_load_waits_for_remote_kvs_then_serves_exact_pages(vllm: Instances) -> None:
    instance = reader(vllm, "async")
    waiting = instance.add(request("r", PROMPT))
    statuses, records = set(), []
    while not waiting.is_finished():
        records.append(instance.step())
        statuses.add(waiting.status)
    [load] = load_steps(records)
    job = load.output.kv_connector_metadata.loads[0]
    assert job.asynchronous and job.request_id == "r"
    assert not load.output.has_sync_kv_loads, "vLLM does not hold the step for it"
    assert RequestStatus.WAITING_FOR_REMOTE_KVS in statuses
    assert "r" not in load.output.num_scheduled_tokens, "scheduled only once the workers reported it"
    assert sum(record.external_hits for record in records) == 6 * BLOCK
    assert totals(records)["async_loads"] == 1
    assert not [wrong for record in records for wrong in record.wrong_pages]


def test_auto_loads_synchronously_when_idle_and_asynchronously_beside_a_running_batch(vllm: Instances) -> None:
    instance = reader(vllm, "auto")
    idle = instance.serve(request("alone", PROMPT))
    assert [record.output.has_sync_kv_loads for record in load_steps(idle)] == [True], "nothing else ran: sync"
    decoding = instance.add(request("decoding", OTHER, max_tokens=100))
    instance.until_scheduled("decoding")
    second = instance.add(request("beside", SECOND))
    records = instance.run(lambda: second.is_finished())
    [load] = load_steps(records)
    assert load.output.kv_connector_metadata.loads[0].asynchronous
    assert "decoding" in load.output.num_scheduled_tokens, "the batch ran on in the load's step"
    assert not decoding.is_finished()
    assert not [wrong for record in records for wrong in record.wrong_pages]


def test_a_model_of_several_groups_loads_asynchronously_and_a_failed_load_is_recomputed(vllm: Instances) -> None:
    remote = simulated_remote()
    first = vllm.new("first", cpu_topology(blocks=200, remotes=[remote]), kv_config=kv_config_of("SSSF"))
    second = vllm.new("second", cpu_topology(blocks=200, remotes=[remote]), kv_config=kv_config_of("SSSF"),
                      options={"loads": "sync"})
    remote_written(first, "sim", totals(first.serve(request("a", LONG)))["stored_blocks"])
    second.skip_loads = True  # a broken runner: the load is never copied
    failing = second.add(request("b", LONG))
    records = second.run(lambda: failing.is_finished())
    assert all(job.asynchronous for record in load_steps(records) for job in
               record.output.kv_connector_metadata.loads), "several KV-cache groups: asynchronous whatever asked"
    assert totals(records)["failed_loads"] == 1
    assert not any(record.invalid_blocks for record in records), "no block error vLLM cannot map to a request"
    assert not [wrong for record in records for wrong in record.wrong_pages], "recomputed, never served wrong"
