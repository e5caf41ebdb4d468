"""examples/hf_chat.py runs: a chat through the GPU and CPU tiers, then a restarted engine served from Redis."""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest
from support import REPO

pytest.importorskip("transformers")

EXAMPLE = REPO / "examples" / "hf_chat.py"
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def load_example() -> Any:
    spec = importlib.util.spec_from_file_location("hf_chat", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def rows(output: str) -> dict[tuple[str, str], dict[str, str]]:
    """The table's rows by (turn, user), cells by column name."""
    lines = output.splitlines()
    header = next(line for line in lines if line.split()[:2] == ["turn", "user"])
    names = header.replace("ttft ms", "ttft").replace("recompute ms", "recompute").replace("saved ms", "saved")
    names = names.replace("same 1st", "same").split()
    table = {}
    for line in lines[lines.index(header) + 1 :]:
        cells = line.split()
        if len(cells) == len(names):
            row = dict(zip(names, cells, strict=True))
            table[row["turn"], row["user"]] = row
    return table


SMALL = ["--reply-tokens", "2", "--system-tokens", "32"]


def test_chat_reuses_the_gpu_pool_and_spills_to_the_cpu_tier(capsys: pytest.CaptureFixture[str]) -> None:
    assert load_example().main([*SMALL, "--turns", "2", "--gpu-blocks", "16"]) == 0
    table = rows(capsys.readouterr().out)
    assert set(table) == {(str(turn), f"user{user}") for turn in (1, 2) for user in (0, 1)}
    assert table["1", "user0"]["computed"] == table["1", "user0"]["prompt"]  # nothing cached yet
    assert int(table["1", "user1"]["gpu"]) > 0  # the shared system prompt
    assert int(table["2", "user0"]["gpu"]) > int(table["1", "user1"]["gpu"])  # its own first turn
    assert any(int(row["cpu"]) > 0 for row in table.values())  # the small GPU pool spilled
    assert all(row["same"] == "yes" for row in table.values())


def test_a_restarted_engine_is_served_from_redis(redis_server: Any, capsys: pytest.CaptureFixture[str]) -> None:
    assert load_example().main([*SMALL, "--turns", "1", "--redis-url", redis_server.url]) == 0
    table = rows(capsys.readouterr().out)
    assert set(table) == {("1", "user0"), ("1", "user1"), ("restart", "user0"), ("restart", "user1")}
    restarted = table["restart", "user0"]
    assert restarted["gpu"] == restarted["cpu"] == "0"
    assert int(restarted["redis"]) == (int(table["1", "user0"]["prompt"]) + 1) // 16 * 16  # prompt + 1 reply token
    assert all(row["same"] == "yes" for row in table.values())
