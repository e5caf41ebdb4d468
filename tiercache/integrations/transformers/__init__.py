"""Hugging Face ``transformers`` on tiercache (the ``hf`` extra: ``pip install '.[hf]'``).

``PagedCache`` is a ``transformers`` cache whose K/V live in a request's pool
blocks; ``CachedModel`` serves requests through tiercache the way an engine does,
each a ``Turn``, under the model's identity (``hf_model_identity``).
"""

from tiercache.integrations.transformers.driver import CachedModel
from tiercache.integrations.transformers.identity import hf_model_identity
from tiercache.integrations.transformers.paged_cache import PagedCache, PagedLayer, cache_argument
from tiercache.integrations.transformers.turn import FirstTokenClock, Turn

__all__ = ["CachedModel", "FirstTokenClock", "PagedCache", "PagedLayer", "Turn", "cache_argument", "hf_model_identity"]
