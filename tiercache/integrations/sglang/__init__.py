"""tiercache as SGLang's HiCache L3 storage backend (the ``sglang`` extra: ``pip install '.[sglang]'``).

Written for and tested against SGLang 0.5.23 (its ``HiCacheStorage`` interface, host KV pools and
``dynamic`` backend loading); importing it under another SGLang version fails with a message saying so.
SGLang loads it with::

    --hicache-storage-backend dynamic --hicache-storage-backend-extra-config '{"backend_name": "tiercache",
      "module_path": "tiercache.integrations.sglang", "class_name": "TierCacheStorage", "interface_v1": 1,
      "topology": "/etc/tiercache/redis.yaml"}'
"""

from __future__ import annotations

from importlib import metadata

SGLANG_VERSION = "0.5.23"
"""The SGLang release this adapter was written for and tested with."""


def _check_sglang() -> None:
    try:
        found = metadata.version("sglang")
    except metadata.PackageNotFoundError:
        message = f"tiercache.integrations.sglang needs SGLang {SGLANG_VERSION}; SGLang is not installed"
        raise ImportError(message) from None
    if found.split("+")[0] != SGLANG_VERSION and not found.startswith(f"{SGLANG_VERSION}.post"):
        raise ImportError(
            f"tiercache.integrations.sglang was written for SGLang {SGLANG_VERSION} (its HiCacheStorage interface); "
            f"found SGLang {found}"
        )


_check_sglang()

from tiercache.integrations.sglang.backend import TierCacheStorage  # noqa: E402  (after the version check)

__all__ = ["SGLANG_VERSION", "TierCacheStorage"]
