"""The ``tiercache`` command: demo, simulate, inspect, stats and tables.

* ``demo``: a trained chat model (SmolLM2-135M-Instruct, built from the installed
  GGUF) answering ShareGPT conversations turn by turn, its KV reused through a
  topology (default: the embedded one) with the model's layout; ``--synthetic``:
  the toy engine's multi-turn workload instead, every block checked against
  recompute.
* ``simulate``: a timed multi-turn chat workload through a topology, with a
  progress bar, a summary table, a TTFT model, JSON and (with matplotlib) plots.
* ``inspect``: the validated topology, capacities, and a reachability check of
  every remote tier and of each of its servers (``tiercache.remote.inspect``;
  never raises on an unreachable store).
* ``stats``: the metrics of a running manager, read from its loopback
  ``StatsServer`` (``simulate --stats-port`` starts one; an engine can too), or
  from a JSON file that ``simulate --stats-out`` wrote.
* ``tables``: the compact level's entropy tables for a model (a Hugging Face
  checkpoint directory), learned on its own K/V over ShareGPT conversations
  (``tiercache.codecs.tables.learn_tables``), written where a tier's
  ``codec.tables`` names them.

The simulation core lives in ``tiercache.tools.simulate``.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tiercache.common.packaged import MissingPackage
from tiercache.config import ConfigError, config_from_dict, default_config_path, load_config
from tiercache.config.topology import read_yaml
from tiercache.manager.tier_manager import TierManager
from tiercache.remote.inspect import CHECK_TIMEOUT_S, inspect_topology
from tiercache.telemetry.prometheus import render_prometheus
from tiercache.telemetry.stats_server import FETCH_TIMEOUT_S, StatsServer, fetch_stats
from tiercache.tools.chat_demo import run_chat_demo, summary
from tiercache.tools.conversations import ChatSegments, followup_chats
from tiercache.tools.demo import format_report, run_workload
from tiercache.tools.real_kv import TRAINING_CONTEXTS, TRAINING_TOKENS
from tiercache.tools.sharegpt import read_conversations
from tiercache.tools.simulate import (
    PRESETS,
    Progress,
    load_workload,
    measure_prefill_cost,
    simulate,
    summary_table,
    timed_requests,
    write_plots,
)
from tiercache.tools.workload import ChatWorkload

EXIT_CONFIG_ERROR = 2
EXIT_UNAVAILABLE = 3
SYNTHETIC_USERS, SYNTHETIC_ROUNDS = 16, 5
CHAT_USERS, CHAT_ROUNDS = 3, 4
"""The chat demo's default size: three conversations of four turns, about a minute on 2 cores."""
CHAT_QUESTION_TOKENS = (16, 400)
"""The chat demo's questions: this many tokens each (with the template), from conversations whose questions all are."""
CHAT_ANSWER_TOKENS = 32
WARM_UP_SALT = "tiercache-demo-warm-up"
"""Mixed into the warm-up request's keys, so no turn reuses its blocks."""
CHAT_GPU_BLOCKS = 32
"""The chat demo's GPU pool (blocks): room for the request being served, so the other chats live in the CPU tier."""


# ---- commands ---------------------------------------------------------------------------
def _demo(args: argparse.Namespace) -> int:
    return _synthetic_demo(args) if args.synthetic else _chat_demo(args)


def _chat_demo(args: argparse.Namespace) -> int:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tiercache.blocks.layout import KVLayout
    from tiercache.integrations.transformers import CachedModel, FirstTokenClock
    from tiercache.testing.real_model import build_smollm2

    try:
        model_dir = build_smollm2()
        conversations = read_conversations()
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        chats = followup_chats(conversations, ChatSegments(tokenizer), users=args.users or CHAT_USERS,
                               rounds=args.rounds or CHAT_ROUNDS, question_tokens=CHAT_QUESTION_TOKENS)
    except MissingPackage as error:
        print(f"tiercache demo: {error}", file=sys.stderr)
        return EXIT_UNAVAILABLE
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    config_path = args.config or default_config_path()
    data = read_yaml(config_path)
    layout = KVLayout.from_hf_config(model.config, dtype="float32", block_size=data["layout"]["block_size"])
    data["layout"].update(num_layers=layout.num_layers, num_kv_heads=layout.num_kv_heads, head_dim=layout.head_dim,
                          dtype=layout.dtype)
    data["model"] = {"id": model_dir.name}
    gpu_blocks = args.gpu_blocks or CHAT_GPU_BLOCKS
    data["tiers"][0]["capacity_blocks"] = gpu_blocks
    config = config_from_dict(data, str(config_path))
    print(f"tiercache demo: SmolLM2-135M-Instruct (weights dequantized from a 4-bit GGUF), float32, {model_dir}")
    print(f"topology: {config_path}, with the model's layout ({layout.num_layers} layers x {layout.num_kv_heads} kv "
          f"heads x {layout.head_dim} dims, {layout.dtype}: {layout.bytes_per_block // 1024} KiB per block of "
          f"{layout.block_size} tokens), the first tier cut to {gpu_blocks} blocks so the chats spill below it; "
          "tiers: " + " -> ".join(f"{t.name} ({t.type}, {t.capacity_blocks} blocks)" for t in config.tiers))
    print(f"ShareGPT conversations {', '.join(ids[0] for ids in chats.ids)}: {chats.users} users x {chats.rounds} "
          f"turns, each prompt the chat so far (the model's own answers) and the next question; greedy answers of "
          f"up to {CHAT_ANSWER_TOKENS} tokens\n")

    def recompute(prompt: torch.Tensor) -> tuple[float, int]:
        clock = FirstTokenClock()
        output = model.generate(prompt, max_new_tokens=1, do_sample=False, streamer=clock)
        return clock.seconds or 0.0, int(output[0, -1])

    with TierManager(config) as manager, torch.no_grad():
        cached = CachedModel(model.to(manager.gpu.device), manager)
        warm_up = torch.tensor([chats.system])  # the first forwards pay one-time set-up: not a turn's
        recompute(warm_up)
        cached.generate(warm_up, max_new_tokens=1, extra=WARM_UP_SALT)  # its own keys: nothing a turn reuses
        stops = model.generation_config.eos_token_id
        turns = run_chat_demo(chats, cached, recompute, lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
                              CHAT_ANSWER_TOKENS, {stops} if isinstance(stops, int) else set(stops or ()))
    print("\n" + summary(turns))
    return 0 if all(turn.same_first_token for turn in turns) else 1


def _synthetic_demo(args: argparse.Namespace) -> int:
    config_path = args.config or default_config_path()
    config = load_config(config_path)
    workload = ChatWorkload(users=args.users or SYNTHETIC_USERS, rounds=args.rounds or SYNTHETIC_ROUNDS,
                            seed=args.seed)
    print(f"tiercache demo: {config_path}")
    print(
        f"layout: {config.layout.num_layers} layers x {config.layout.num_kv_heads} kv heads x "
        f"{config.layout.head_dim} dims, {config.layout.dtype}, {config.layout.block_size} tokens/block "
        f"= {config.layout.bytes_per_block // 1024} KiB per block"
    )
    print("tiers: " + " -> ".join(f"{t.name} ({t.type})" for t in config.tiers))
    print(f"workload: {workload.users} users x {workload.rounds} rounds, shared system prompts\n")
    with TierManager(config) as manager:
        report = run_workload(manager, workload)
        print(format_report(manager, report))
    return 0 if report.mismatched_blocks == 0 else 1


def _simulate(args: argparse.Namespace) -> int:
    config_path = args.config or default_config_path()
    config = load_config(config_path)
    workload = load_workload(args.workload)
    requests = timed_requests(workload)
    print(f"tiercache simulate: {config_path}, workload {args.workload}: {len(requests)} requests")
    name = Path(str(config_path)).stem
    with TierManager(config) as manager:
        server = (
            StatsServer(manager.stats, manager.metrics, port=args.stats_port)
            if args.stats_port is not None
            else None
        )
        if server is not None:  # from the start, so `tiercache stats` answers during the prefill measurement too
            server.start()
            print(f"serving stats at {server.url}/stats and {server.url}/metrics", flush=True)
        try:
            prefill = measure_prefill_cost(config.layout)
            progress = Progress(len(requests), name)
            result = simulate(manager, requests, name=name, prefill_s_per_token=prefill, progress=progress.update)
        finally:
            if server is not None:
                server.close()
    print(summary_table([result]))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    document = {"config": str(config_path), "workload": args.workload, "runs": [result.to_json()]}
    out.with_suffix(".json").write_text(json.dumps(document, indent=1))
    print(f"wrote {out.with_suffix('.json')}")
    if args.stats_out:
        Path(args.stats_out).write_text(json.dumps(result.stats, indent=1))
        print(f"wrote {args.stats_out}")
    if not args.no_plots:
        for path in write_plots([result], out):
            print(f"wrote {path}")
    return 0 if result.mismatched_blocks == 0 else 1


def _inspect(args: argparse.Namespace) -> int:
    config = load_config(args.config or default_config_path())
    report, ok = inspect_topology(config, args.timeout)
    print(report)
    return 0 if ok else EXIT_UNAVAILABLE


def _text(value: Any) -> str:
    """One stats value on one line: nested mappings (latencies, a tier's own counters, the MRC) inline."""
    if isinstance(value, Mapping):
        return ", ".join(f"{key} {_text(inner)}" for key, inner in value.items())
    return f"{value:.3g}" if isinstance(value, float) else str(value)


def format_stats(stats: Mapping[str, Any]) -> str:
    """A table of ``TierManager.stats()``: one row per tier and counter, then queue depths."""
    lines = [f"{'tier':<12}{'metric':<32}value"]
    for tier, values in stats.get("tiers", {}).items():
        for name, value in sorted(values.items()):
            lines.append(f"{tier:<12}{name:<32}{_text(value)}")
    for name, value in stats.get("queues", {}).items():
        lines.append(f"{'queues':<12}{name:<32}{value}")
    return "\n".join(lines)


def _unusable(path: str, cause: str) -> int:
    print(
        f"tiercache: cannot read stats from {path}: {cause} (expected a JSON file from `simulate --stats-out`)",
        file=sys.stderr,
    )
    return EXIT_UNAVAILABLE


def _stats(args: argparse.Namespace) -> int:
    if args.file:
        try:
            stats = json.loads(Path(args.file).read_text())
        except OSError as error:
            return _unusable(args.file, error.strerror or str(error))
        except ValueError as error:
            return _unusable(args.file, f"not JSON ({error})")
        if not isinstance(stats, Mapping):
            return _unusable(args.file, f"not a stats mapping (a JSON {type(stats).__name__})")
    else:
        try:
            stats = fetch_stats(args.url, timeout=args.timeout)
        except OSError as error:
            print(f"tiercache: no stats server at {args.url}: {error}", file=sys.stderr)
            return EXIT_UNAVAILABLE
    print(render_prometheus(stats) if args.prometheus else format_stats(stats))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tiercache", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="a chat model on ShareGPT turns through a topology (default: embedded)")
    demo.add_argument("--config", help="YAML topology (default: the embedded configs/default.yaml)")
    demo.add_argument("--synthetic", action="store_true",
                      help="the toy engine's synthetic workload, every reused block checked against recompute")
    demo.add_argument("--users", type=int, help=f"default {CHAT_USERS} ({SYNTHETIC_USERS} with --synthetic)")
    demo.add_argument("--rounds", type=int, help=f"default {CHAT_ROUNDS} ({SYNTHETIC_ROUNDS} with --synthetic)")
    demo.add_argument("--seed", type=int, default=0, help="the synthetic workload's seed")
    demo.add_argument("--gpu-blocks", type=int, help=f"the chat demo's GPU pool (default {CHAT_GPU_BLOCKS} blocks)")
    demo.set_defaults(handler=_demo)

    sim = commands.add_parser("simulate", help="a timed chat workload: summary table, TTFT model, JSON and plots")
    sim.add_argument("--config", help="YAML topology (default: the embedded one)")
    sim.add_argument(
        "--workload", default="chat", help=f"a preset ({', '.join(PRESETS)}) or a YAML/JSON file of ChatWorkload fields"
    )
    sim.add_argument("--out", default="tiercache-simulate", help="path prefix of the JSON and PNG outputs")
    sim.add_argument("--no-plots", action="store_true", help="write no PNG files")
    sim.add_argument("--stats-port", type=int, help="serve /stats and /metrics on 127.0.0.1:PORT while running")
    sim.add_argument("--stats-out", help="write the manager's final stats() as JSON here (for `tiercache stats`)")
    sim.set_defaults(handler=_simulate)

    inspect = commands.add_parser("inspect", help="validated topology, capacities, remote reachability")
    inspect.add_argument("--config", help="YAML topology (default: the embedded one)")
    inspect.add_argument("--timeout", type=float, default=CHECK_TIMEOUT_S, help="seconds per remote operation")
    inspect.set_defaults(handler=_inspect)

    stats = commands.add_parser("stats", help="metrics of a running manager (its StatsServer) or a stats JSON file")
    source = stats.add_mutually_exclusive_group(required=True)
    source.add_argument("--url", help="e.g. http://127.0.0.1:9400 (a StatsServer)")
    source.add_argument("--file", help="a JSON file written by `simulate --stats-out`")
    stats.add_argument("--prometheus", action="store_true", help="print the Prometheus text exposition")
    stats.add_argument("--timeout", type=float, default=FETCH_TIMEOUT_S)
    stats.set_defaults(handler=_stats)

    serve = commands.add_parser("serve", help="the host cache server: one CPU tier and its remotes for every engine "
                                "on this host, over a Unix socket")
    serve.add_argument("--config", required=True, help="YAML topology whose first tier is the CPU tier (without "
                       "model and layout: the first engine to attach gives them)")
    serve.add_argument("--socket", required=True, help="the Unix socket engines attach to")
    serve.add_argument("--shared-dir", default="/dev/shm", help="where the CPU tier's shared-memory file goes")
    serve.add_argument("--group", help="the group that may attach (default: the server's own)")
    serve.add_argument("--stats-port", type=int, help="serve /stats and /metrics on 127.0.0.1:PORT (0: a free one)")
    serve.add_argument("--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"),
                       help="what the server logs to stderr (engines attaching and going away, leases taken back)")
    serve.set_defaults(handler=_serve)

    tables = commands.add_parser("tables", help="the compact level's tables, learned on a model's own K/V")
    tables.add_argument("model", help="a Hugging Face checkpoint directory (transformers loads it, float32)")
    tables.add_argument("--out", required=True, help="the tables file to write (a tier's codec.tables)")
    tables.add_argument("--contexts", type=int, default=TRAINING_CONTEXTS,
                        help="ShareGPT conversations to learn on (the default set is benchmarks/codec.py's)")
    tables.add_argument("--tokens", type=int, default=TRAINING_TOKENS, help="tokens of each conversation")
    tables.add_argument("--skip", type=int, default=0, help="usable conversations to skip first (to hold some apart)")
    tables.set_defaults(handler=_tables)
    return parser


def _serve(args: argparse.Namespace) -> int:
    from tiercache.host.server import HostServer

    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    server = HostServer(read_yaml(args.config), Path(args.socket), source=args.config,
                        shared_dir=Path(args.shared_dir), group=args.group)
    for stop in (signal.SIGTERM, signal.SIGINT):
        signal.signal(stop, lambda *_: server.close())
    server.start()
    stats = None
    if args.stats_port is not None:
        stats = StatsServer(server.stats, port=args.stats_port).start()
        print(f"serving stats at {stats.url}/stats and {stats.url}/metrics", flush=True)
    print(f"tiercache serve: {args.config} on {args.socket}", flush=True)
    try:
        server.wait()
    finally:
        server.close()
        if stats is not None:
            stats.close()
    return 0


def _tables(args: argparse.Namespace) -> int:
    from tiercache.codecs.tables import learn_tables
    from tiercache.tools.real_kv import context_kv, load_model, training_contexts

    try:
        tokenizer, model = load_model(Path(args.model))
        contexts = training_contexts(tokenizer, args.contexts, args.tokens, skip=args.skip)
    except (MissingPackage, ImportError, OSError, ValueError) as error:
        print(f"tiercache tables: {error}", file=sys.stderr)
        return EXIT_UNAVAILABLE
    tables = learn_tables(context_kv(model, context.ids) for context in contexts)
    written = tables.save(args.out)
    print(f"{written}: tables for {tables.layers} layers x {tables.channels} channels (digest "
          f"{tables.digest.hex()}), learned on {len(contexts)} conversations of {args.tokens} tokens")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.handler(args)
    except ConfigError as error:
        print(f"tiercache: configuration error: {error}", file=sys.stderr)
        return EXIT_CONFIG_ERROR


if __name__ == "__main__":
    sys.exit(main())
