"""A worker's map of the host cache server's region (the ``host`` option): KV copies go straight into it.

The worker attaches to the server itself (a ``HostTiers`` of its own, which makes
no other call) and maps the region the server announces, the first time the
server answers: at ``register_kv_caches``, or at a later step if the server was
not up yet. That region stays the worker's until the engine restarts. Every job
names the region its slots are in; a job of another region (the server
restarted and made a new one) is failed by the worker, never copied: its loads
are recomputed, its stores dropped. The host client is imported here, when the
option is set, so the worker runs with torch alone elsewhere.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tiercache.config import TierCacheConfig
    from tiercache.host.region import HostRegion

log = logging.getLogger(f"vllm.{__name__}")


class HostMapping:
    """The host server's region as one worker maps it (see the module docstring)."""

    def __init__(self, config: TierCacheConfig, socket_path: Path) -> None:
        from tiercache.host.client import HostTiers

        self._tiers = HostTiers(config, socket_path)
        self.socket_path = socket_path
        self.region: HostRegion | None = None
        self._said = False

    def start(self) -> None:
        self._tiers.start()

    @property
    def token(self) -> bytes:
        """The token of the region mapped (b"": none yet): the only region whose jobs this worker copies."""
        return self.region.token if self.region is not None else b""

    def mapped(self) -> HostRegion | None:
        """The region, from the first time the server has answered (None until then, said once)."""
        if self.region is None:
            region = self._tiers.region
            if region is not None:
                self.region = region
                log.info("tiercache connector: worker maps the host server's region %s", region.path)
            elif not self._said:
                self._said = True
                log.warning("tiercache connector: no host server at %s yet; this worker's loads and stores fail "
                            "(recomputed, dropped) until it answers", self.socket_path)
        return self.region

    def close(self) -> None:
        self._tiers.close()
