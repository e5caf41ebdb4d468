"""The vLLM release this adapter was written for, checked before anything of vLLM is imported.

The adapter implements interfaces that vLLM marks experimental (``SecondaryTierManager``,
``CachePolicy``) and reads vLLM's ``OffloadingConfig``; both change between minor
releases, so another minor version fails at import with a message that says what to do.
"""

from __future__ import annotations

from importlib import metadata

WRITTEN_FOR = "0.33.0"
"""The vLLM release the adapter was written and tested against."""
SUPPORTED_SERIES = "0.33."
"""Patch releases of this series keep the interfaces the adapter uses."""


class UnsupportedVllmError(ImportError):
    """vLLM is missing, or of a release this adapter was not written for."""


def require_vllm() -> str:
    """The installed vLLM version; ``UnsupportedVllmError`` unless it is a 0.33.x release."""
    try:
        version = metadata.version("vllm")
    except metadata.PackageNotFoundError:
        raise UnsupportedVllmError(
            f"tiercache.integrations.vllm needs vLLM {SUPPORTED_SERIES}x (written for {WRITTEN_FOR}); "
            "vLLM is not installed (in tiercache's checkout: pip install '.[vllm]')"
        ) from None
    if not version.startswith(SUPPORTED_SERIES):
        raise UnsupportedVllmError(
            f"tiercache.integrations.vllm was written for vLLM {WRITTEN_FOR} and supports {SUPPORTED_SERIES}x "
            f"only; this environment has vLLM {version}. Install vllm=={WRITTEN_FOR} (or another "
            f"{SUPPORTED_SERIES}x release) next to tiercache."
        )
    return version
