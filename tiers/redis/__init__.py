"""Redis / Valkey / Redis Cluster tier: one key per block, value = codec header + payload.

Why its own RESP client. A block is tens of KiB to MiBs; redis-py builds a
Python ``bytes`` per reply and the caller copies it again, which on loopback
reads at a fraction of what the server can send. Here each node has
``connections`` lanes (``pipelined.py``): a blocking socket driven by one long-lived
I/O thread fed by a job queue, which pipelines requests continuously across
calls (up to ``pipeline_bytes`` / at most 32 requests in flight, topped up as
replies come in) and parses replies in place; coroutines await a future the
thread completes with ``call_soon_threadsafe`` (the event loop never blocks).
The modules: ``resp`` (RESP connection and parsing), ``pipelined`` (the I/O thread),
``commands`` (GET/SET/EXISTS/UNLINK as jobs), ``node`` (one server: lanes,
TLS/AUTH, capacity check, a cluster node's breaker; the regional tier's data path too), ``cluster``
(slot routing), ``control`` (a redis-py client for what the data path does not
speak: CONFIG, pub/sub, Lua), ``evictions`` (the server's own evictions and
expiries, heard as keyspace notifications), ``tier``.

* ``SET`` sends ``header`` and ``payload`` with one ``sendmsg`` of the caller's
  buffers (no concatenation), as ONE command, so a reader sees either the old
  or the new complete value, never a separate metadata key out of step. Values
  are checksummed and sent in groups of up to 8, so the server stores one
  group while the next is checksummed. A ``put`` batch goes to one connection
  per node (calls take the connections in turn): the server stores MiB-sized
  values faster from one socket at a time than from several at once.
* ``GET`` fast path: when the buffered reply line is the expected length line,
  one ``recvmsg_into`` receives the header, the payload straight into the
  destination and the next reply's line; ``Codec.check_in_place`` compares the
  header with precomputed bytes and verifies the payload (xxh3 checksum, or the
  keyed MAC when the namespace has a secret) before the block is reported
  filled. Misses, error replies, other lengths and lz4 values take the general
  path (header validated field by field, bad values skipped). A value that
  fails any check is a miss; per the ``RemoteTier`` contract the destination of
  a miss is unspecified. ``stage_reads: true`` instead receives the whole value
  into a per-connection staging buffer and lets ``Codec.decode_into`` validate
  it before a single byte is copied to the destination (one more memcpy).
* A value that failed validation (bad header, checksum or MAC, wrong key,
  namespace or length) is deleted in the background (``UNLINK``, off the read's
  path; ``invalid_deleted`` counts them), so the next store of that block
  rewrites it instead of the bad value failing every read forever.

Capacity: the tier relies on the server's ``maxmemory`` and eviction policy and
checks them on every new connection (``CONFIG GET``, falling back to ``INFO
memory``). With ``maxmemory`` 0 (or unknown) the server would grow without
bound, so the tier refuses writes (reads still work; refused puts are counted
as ``put_refused_unbounded``, or ``put_refused_noperm`` when an ACL hides the
setting) unless ``allow_unbounded: true``. With a bound but a policy that does
not evict our keys (``noeviction``, or ``volatile-*`` with no ``ttl_s``) it logs
a warning once: when the server is full, writes fail with OOM (counted as
``put_server_oom``) and the cache stops admitting.

Failures never raise on the data path: a refused connection, a reset, a
per-operation timeout (``timeout_s`` without progress, enforced by the kernel
on the socket), garbage, a truncated value or one from another namespace turns
the affected blocks into misses, counted in ``stats()`` as ``<op>_<outcome>``.
Authentication is diagnosed by cause: ``auth_noauth`` (the server wants
credentials we did not send), ``auth_wrongpass``, ``auth_noperm`` (an ACL denies
the command or key); ``stats()["last_error"]`` holds the latest error text and
each new cause is logged once. Blocks finished before a failure in a batch keep
their result, so the longest valid prefix is still served.

Breakers: one per tier on a read's path. The engine reaches the tier through
its transfer lane, whose breaker sees every call and its deadline, so it is the
tier's: ``breaker_settings`` sets it from the ``breaker_*`` options, and a call
whose server failed (refused, reset, timed out: ``server_failed``) counts
against it like a call past its deadline. After ``breaker_failures`` such calls
the lane answers misses at once; after ``breaker_backoff_s`` (doubling per
failed trial call up to ``breaker_backoff_max_s``) one trial call asks the server, and a
server that answers is used again without a restart. A single server has no
breaker of its own: a second one on the same calls would count their failures
again on its own back-off, and could refuse the one trial call the lane lets through
(the lane then closing on an answer the server never gave). Only a cluster's
nodes keep one each (set by the same options), because the tier must skip a
dead node's slots while it still serves the others; the lane counts a cluster
call as failed only when no node answered. A tier used without a lane (a test, the
conformance suite) therefore has no breaker on a single server.

Cluster (``cluster: true``): the slot map comes from ``CLUSTER SLOTS`` of any
reachable node; keys are grouped per owning node (CRC16 of the key, with hash
tags honoured) and the groups run concurrently. A ``MOVED``/``ASK`` answer is a
miss that triggers a slot-map refresh; a node that is down costs only its own
slots (run the cluster with ``cluster-require-full-coverage no`` for that).

Options (``RedisOptions``): see ``options.py``; ``connections`` defaults by block
size (1 below 1 MiB, 2 from there), ``pipeline_bytes`` to 6 MiB.
"""

from tiercache.tiers.redis.cluster import key_slot
from tiercache.tiers.redis.options import RedisOptions
from tiercache.tiers.redis.tier import RedisTier

__all__ = ["RedisOptions", "RedisTier", "key_slot"]
