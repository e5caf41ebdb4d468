"""Redis / Valkey / Redis Cluster tier: one key per block, value = codec header + payload.

Why its own RESP client. A block is tens of KiB to MiBs; redis-py builds a
Python ``bytes`` per reply and the caller copies it again, which on loopback
reads at a fraction of what the server can send. Here each node has a small
pool of blocking sockets, each driven by its own worker thread (coroutines
await the thread; the event loop never blocks), that pipelines requests and
parses replies in place:

* ``SET`` sends ``header`` and ``payload`` with one ``sendmsg`` of the caller's
  buffers (no concatenation), as ONE command, so a reader sees either the old
  or the new complete value, never a separate metadata key out of step.
* ``GET`` reads the reply line and the 72-byte header into a small buffer,
  validates the header (magic, format, namespace fingerprint, key, lengths)
  with ``Codec.parse_header`` and only then ``recv_into``s the payload straight
  into the destination buffer (``MSG_WAITALL``: one system call per block), and
  checks the xxh3 checksum before the block is reported filled. A value that
  fails any check is a miss; per the ``RemoteTier`` contract the destination
  of a miss is unspecified. ``stage_reads: true`` instead receives the whole
  value into a per-connection staging buffer and lets ``Codec.decode_into``
  validate it before a single byte is copied to the destination (one more
  memcpy per block). lz4-compressed values always take the staged path.
* Batches are split over ``connections`` sockets per node, each keeping up to
  ``pipeline_bytes`` of requests in flight.

Capacity: the tier relies on the server's ``maxmemory`` and eviction policy and
checks them on every new connection (``CONFIG GET``, falling back to ``INFO
memory``). With ``maxmemory`` 0 (or unknown) the server would grow without
bound, so the tier refuses writes (reads still work; refused puts are counted
as ``put_refused_unbounded``) unless ``allow_unbounded: true``. With a bound but
a policy that does not evict our keys (``noeviction``, or ``volatile-*`` with no
``ttl_s``) it logs a warning once: when the server is full, writes fail with
OOM (counted as ``put_server_oom``) and the cache stops admitting.

Failures never raise on the data path: a refused connection, a reset, a
per-operation timeout (``timeout_s`` without progress, enforced by the kernel
on the socket), garbage, a truncated value or one from another namespace turns
the affected blocks into misses, counted in ``stats()`` as ``<op>_<outcome>``.
Blocks finished before a failure in a batch keep their result, so the longest
valid prefix is still served. A per-node ``CircuitBreaker`` stops a dead node
from being hammered and lets the tier recover by itself when it returns.

Cluster (``cluster: true``): the slot map comes from ``CLUSTER SLOTS`` of any
reachable node; keys are grouped per owning node (CRC16 of the key, with hash
tags honoured) and the groups run concurrently. A ``MOVED``/``ASK`` answer is a
miss that triggers a slot-map refresh; a node that is down costs only its own
slots (run the cluster with ``cluster-require-full-coverage no`` for that).
"""

from tiercache.tiers.redis.cluster import key_slot
from tiercache.tiers.redis.options import RedisOptions
from tiercache.tiers.redis.tier import RedisTier

__all__ = ["RedisOptions", "RedisTier", "key_slot"]
