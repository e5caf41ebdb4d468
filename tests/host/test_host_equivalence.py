"""The host server answers as the engine's own ``LowerTiers`` would: the same random calls made of both.

The reference is a ``LowerTiers`` in this process over the same topology; one
engine's calls reach the server's ``LowerTiers`` in the same order, so every
answer (which prefix each lookup finds and in which tier, which writes get a
slot, what a fetch's slots hold, what a reset drops) must be the same.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st
from support.host_helpers import host_config
from support.lower_tiers_helpers import block_bytes, chain

from tiercache.host.client import HostTiers
from tiercache.host.server import HostServer
from tiercache.manager.lower_tiers import LowerTiers

CHAINS = 4
"""Distinct prompts the calls pick from (their blocks: 1 to 5)."""
calls = st.lists(st.one_of(
    st.tuples(st.just("write"), st.integers(0, CHAINS - 1), st.integers(1, 5)),
    st.tuples(st.just("lookup"), st.integers(0, CHAINS - 1), st.integers(1, 5)),
    st.tuples(st.just("fetch"), st.integers(0, CHAINS - 1), st.integers(1, 5)),
    st.tuples(st.just("reset"), st.just(0), st.just(0)),
), min_size=1, max_size=25)


def play(tiers: LowerTiers | HostTiers, script: list[tuple[str, int, int]]) -> list[object]:
    """The answers to ``script``'s calls, as plain values (slots read as their bytes)."""
    answers: list[object] = []
    for call, salt, blocks in script:
        keys = chain(tiers, blocks, salt)  # type: ignore[arg-type]
        if call == "write":
            slots = tiers.begin_writes(keys)
            given_ = [(key, slot) for key, slot in zip(keys, slots, strict=True) if slot is not None]
            for key, slot in given_:
                tiers.buffer_view(slot)[:] = block_bytes(tiers, key)  # type: ignore[arg-type]
            tiers.end_writes([k for k, _ in given_], [s for _, s in given_], [True] * len(given_))
            answers.append([slot is not None for slot in slots])
        elif call == "reset":
            answers.append(tiers.reset_cpu_tier())
        else:
            hit = tiers.lookup(keys)
            assert hit is not None, "no remote: a lookup always answers"
            if call == "lookup":
                answers.append(list(hit.tiers))
                tiers.release(hit)  # type: ignore[arg-type]
            else:
                fetch = tiers.fetch(hit)  # type: ignore[arg-type]
                assert fetch.ready()
                answers.append([bytes(tiers.buffer_view(slot)) for slot in fetch.slots()])
                fetch.release()
    answers.append(tiers.stats()["tiers"]["cpu"]["cached_blocks"])
    return answers


@settings(max_examples=30, deadline=None)
@given(script=calls, capacity=st.integers(2, 8))
def test_the_server_answers_every_call_as_lower_tiers_does(script: list[tuple[str, int, int]], capacity: int) -> None:
    config = host_config(cpu_blocks=capacity)
    directory = Path(tempfile.mkdtemp(prefix="tch-eq-"))
    reference = LowerTiers(config)
    server = HostServer(config, directory / "host.sock", shared_dir=directory)
    engine = HostTiers(config, directory / "host.sock")
    try:
        reference.start()
        server.start()
        engine.start()
        assert play(engine, script) == play(reference, script)
    finally:
        engine.close()
        server.close()
        reference.close()
        shutil.rmtree(directory, ignore_errors=True)
