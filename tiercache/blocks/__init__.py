"""A block's identity and shape: what a cached block is, on any tier.

``keys`` (the namespace and the chained block keys, stable across processes and
hosts), ``model_identity`` (``ModelIdentity``: when two models' KV is interchangeable,
the one rule every adapter uses), ``namespaces`` (``engine_namespace``: the one rule for
"same namespace", model, page format, rank, tenant and LoRA, that every adapter and
topology builds its namespace with), ``layout`` (``KVLayout``: the bytes of a block and
how a pool holds them; ``PageLayout``: an engine's opaque pages; ``token_map``:
where a token's K and V lie in such pages, for a codec), ``paged``
(``PagedKV``: the paged view attention reads), ``value_format`` (a stored value's
header and what a reader makes of a value) and ``codec`` (writing and checking
values: checksum or keyed MAC, optional compression, coded lossy payloads).

Imports from: ``common``.
"""
