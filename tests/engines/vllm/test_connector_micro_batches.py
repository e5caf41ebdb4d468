"""Stores under vLLM's micro-batching (dual-batch overlap, issue 53 #8), under vLLM 0.33's own scheduler.

Each micro-batch runs every layer and its save hook in turn (vLLM's
``gpu_ubatch_wrapper``: a forward context per micro-batch), so at a layer's
first ``save_kv_layer`` the other micro-batch has not written that layer yet.
The harness runs the step's requests in two halves, a save hook after each; a
second instance then reads what was stored, every page checked bit for bit.
"""

from __future__ import annotations

from support.vllm_connector import PROMPT, Instances, remote_written, request, totals
from support.vllm_parts import cpu_topology, simulated_remote


def test_under_micro_batching_stores_are_copied_once_every_micro_batch_wrote_them(vllm: Instances) -> None:
    remote = simulated_remote()
    first = vllm.new("first", cpu_topology(remotes=[remote]), micro_batched=True)
    assert not first.worker._worker.per_layer_saves, "vLLM's use_ubatching: copied at wait_for_save"
    first.micro_batched = True
    other = [token + 5000 for token in PROMPT]
    first.add(request("a", PROMPT))
    first.add(request("b", other))
    records = first.run(lambda: not first.scheduler.has_requests())
    assert totals(records)["stored_blocks"] == 12
    remote_written(first, "sim", 12)
    second = vllm.new("second", cpu_topology(remotes=[remote]))
    for req_id, tokens in (("c", PROMPT), ("d", other)):
        served = second.serve(request(req_id, tokens))
        assert second.new_request(served, req_id).num_computed_tokens == 6 * 16
        assert not [wrong for record in served for wrong in record.wrong_pages], "the second micro-batch's pages"
