"""The ``tiercache`` command: ``demo`` runs a multi-turn chat workload on a topology."""

from __future__ import annotations

import argparse
import sys

from tiercache.config import ConfigError, default_config_path, load_config
from tiercache.demo import format_report, run_workload
from tiercache.manager import TierManager
from tiercache.workload import ChatWorkload


def _demo(args: argparse.Namespace) -> int:
    config_path = args.config or default_config_path()
    config = load_config(config_path)
    workload = ChatWorkload(users=args.users, rounds=args.rounds, seed=args.seed)
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tiercache", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="multi-turn chat through a topology (default: embedded)")
    demo.add_argument("--config", help="YAML topology (default: the embedded configs/default.yaml)")
    demo.add_argument("--users", type=int, default=16)
    demo.add_argument("--rounds", type=int, default=5)
    demo.add_argument("--seed", type=int, default=0)
    demo.set_defaults(handler=_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.handler(args)
    except ConfigError as error:
        print(f"tiercache: configuration error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
