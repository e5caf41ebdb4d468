"""vLLM engines over a tiercache topology for the vLLM tests (``tests/engines/vllm``), and their tiercache tier."""

from __future__ import annotations

from tiercache.integrations.vllm import TierCacheTier
from tiercache.testing.vllm_offloading import Engine, offloading_config, tier_config


def engine_over(engines: list[Engine], topology: dict, **config: object) -> Engine:
    """An engine whose secondary tier is tiercache over ``topology``, added to ``engines`` (the fixture)."""
    options = config.pop("tier_options", {})
    engine = Engine(offloading_config([tier_config(topology, **options)], **config))  # type: ignore[arg-type]
    engines.append(engine)
    return engine


def tier_of(engine: Engine) -> TierCacheTier:
    """The engine's one tiercache tier."""
    (tier,) = engine.tiers
    assert isinstance(tier, TierCacheTier)
    return tier
