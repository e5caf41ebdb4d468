"""Hugging Face ``transformers`` on tiercache (the ``hf`` extra: ``pip install 'tiercache[hf]'``).

``PagedCache`` is a ``transformers`` cache whose K/V live in a request's pool
blocks; ``CachedModel`` serves requests through tiercache the way an engine does.
"""

from tiercache.integrations.transformers.driver import CachedModel, FirstTokenClock, Turn
from tiercache.integrations.transformers.paged_cache import PagedCache, PagedLayer

__all__ = ["CachedModel", "FirstTokenClock", "PagedCache", "PagedLayer", "Turn"]
