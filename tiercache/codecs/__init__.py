"""Lossy encodings of KV for the remote tiers: what crosses the network compressed, and at which level.

``levels`` (the levels a tier stores and reads, ``CodecConfig``: a tier's ``codec``
in YAML), ``geometry`` (a block's bytes seen as K and V per layer, from a
``KVLayout``; anything it cannot interpret is refused, never quantized),
``int8`` (8 bits per value, a scale per token's head), ``compact`` and ``tables``
(CacheGen's encoding: chunks of tokens with an anchor and deltas, bits by layer
depth, entropy-coded with fixed per-model tables learned once), ``coding``
(``KVCoding``: the levels a reader opted into, encoding and decoding straight
into a slot), ``choice`` (which level each chunk of a fetch is read at, from the
link's measured cost and each level's decode time, or recompute).

Imports from: ``common``, ``blocks``.
"""
