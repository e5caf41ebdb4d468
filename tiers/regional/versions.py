"""Central versions: where they live in a value, the central clock, and the Lua scripts that move them.

Every value carries its version in the ``tiercache.blocks.codec`` header (a u64, 0 for a
write not yet committed at central). The byte offsets of the version and of the
payload checksum are the codec's own (``codec.VERSION_OFFSET``,
``codec.CHECKSUM_OFFSET``), checked against an encoded header at import, so a
change of the header layout fails loudly instead of making the Lua scripts patch
the wrong bytes.

Versions come from a central clock (a hybrid logical clock): it starts at the
server's time in milliseconds times ``CLOCK_TICKS_PER_MS`` and then counts up, so
versions are monotonic per key even when a central store restarts empty (a new
clock starts above every version handed out before, unless more than
``CLOCK_TICKS_PER_MS`` writes per millisecond were sustained). Last-writer-wins
is the order of commits at central.
"""

from __future__ import annotations

import struct

from tiercache.blocks.codec import Codec
from tiercache.blocks.value_format import CHECKSUM_OFFSET, HEADER, HEADER_SIZE, VERSION_OFFSET

U64 = struct.Struct("<Q")
"""A version or checksum as stored in the header (little-endian u64)."""
MAX_VERSION = 2**64 - 1
"""The largest version a header can carry."""
CLOCK_TICKS_PER_MS = 1024
"""Versions per millisecond of the central clock's starting point."""
_DISTINCT_BYTES_VERSION = 0x0123456789ABCDEF
"""A version whose bytes are all distinct, to check the offset against a real header."""


def _check_offsets() -> None:
    """Fail at import if the offsets do not match what the codec writes."""
    header, _ = Codec(bytes(16)).encode(bytes(16), b"", version=_DISTINCT_BYTES_VERSION)
    if len(header) != HEADER_SIZE or U64.unpack_from(header, VERSION_OFFSET)[0] != _DISTINCT_BYTES_VERSION:
        raise RuntimeError(f"version offset {VERSION_OFFSET} does not match the codec header {HEADER.format!r}")
    if CHECKSUM_OFFSET + U64.size != HEADER_SIZE:
        raise RuntimeError(f"checksum offset {CHECKSUM_OFFSET} does not match the codec header {HEADER.format!r}")


_check_offsets()

_LUA_LE64 = """
local function le64(s)
  local v = 0
  for i = 8, 1, -1 do v = v * 256 + string.byte(s, i) end
  return v
end
local function pack64(v)
  local out = {}
  for i = 1, 8 do out[i] = string.char(v % 256); v = math.floor(v / 256) end
  return table.concat(out)
end
"""

COMMIT_SCRIPT = (
    _LUA_LE64
    + f"""
-- KEYS: clock, value, version. ARGV: value, channel, raw key, ticks per ms, TTL in ms (0: none).
if redis.call('EXISTS', KEYS[1]) == 0 then
  local t = redis.call('TIME')
  local ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  redis.call('SET', KEYS[1], string.format('%.0f', ms * tonumber(ARGV[4])))
end
local v = redis.call('INCR', KEYS[1])
local current = tonumber(redis.call('GET', KEYS[3]) or '0') or 0
if v <= current then
  v = current + 1
  redis.call('SET', KEYS[1], string.format('%.0f', v))
end
local packed = pack64(v)
redis.call('SET', KEYS[2], ARGV[1])
redis.call('SETRANGE', KEYS[2], {VERSION_OFFSET}, packed)
redis.call('SET', KEYS[3], string.format('%.0f', v))
if tonumber(ARGV[5]) > 0 then
  redis.call('PEXPIRE', KEYS[2], ARGV[5])
  redis.call('PEXPIRE', KEYS[3], ARGV[5])
end
redis.call('PUBLISH', ARGV[2], ARGV[3] .. packed)
return string.format('%.0f', v)
"""
)
"""Assign the next version, store the value with it patched in, record it (both with the TTL) and publish it."""

REFRESH_SCRIPT = (
    _LUA_LE64
    + f"""
-- KEYS: value. ARGV: value, version. Never replaces a newer copy or an unversioned one.
local current = redis.call('GETRANGE', KEYS[1], {VERSION_OFFSET}, {VERSION_OFFSET + 7})
if #current == 8 then
  local cv = le64(current)
  if cv == 0 or cv >= tonumber(ARGV[2]) then return 0 end
end
redis.call('SET', KEYS[1], ARGV[1])
return 1
"""
)
"""Store a copy read from central in a region unless the region holds a newer or unversioned one."""

PATCH_SCRIPT = (
    _LUA_LE64
    + f"""
-- KEYS: value. ARGV: checksum (8 bytes), version (8 bytes), version. Stamps our own copy only.
if redis.call('GETRANGE', KEYS[1], {CHECKSUM_OFFSET}, {CHECKSUM_OFFSET + 7}) ~= ARGV[1] then return 0 end
local cv = le64(redis.call('GETRANGE', KEYS[1], {VERSION_OFFSET}, {VERSION_OFFSET + 7}))
if cv ~= 0 and cv >= tonumber(ARGV[3]) then return 0 end
redis.call('SETRANGE', KEYS[1], {VERSION_OFFSET}, ARGV[2])
return 1
"""
)
"""Patch central's version into a region's own copy (same checksum) once it was replicated."""

DROP_OLDER_SCRIPT = (
    _LUA_LE64
    + f"""
-- KEYS: value. ARGV: version. Drops a versioned copy older than the published version.
local current = redis.call('GETRANGE', KEYS[1], {VERSION_OFFSET}, {VERSION_OFFSET + 7})
if #current == 8 then
  local cv = le64(current)
  if cv ~= 0 and cv < tonumber(ARGV[1]) then
    redis.call('DEL', KEYS[1])
    return 1
  end
end
return 0
"""
)
"""Drop a regional copy older than a version central published."""


DELETE_IF_SAME_SCRIPT = """
-- KEYS: value. ARGV: SHA-1 of the value as read. Deletes it only if nobody has rewritten it since.
local current = redis.call('GET', KEYS[1])
if current and redis.sha1hex(current) == ARGV[1] then
  redis.call('DEL', KEYS[1])
  return 1
end
return 0
"""
"""Delete a value that failed validation, unless it was replaced since it was read."""


def value_version(value: bytes) -> int | None:
    """The version in a value's header (0: not yet committed at central); None for a value shorter than a header."""
    if len(value) < HEADER_SIZE:
        return None
    return U64.unpack_from(value, VERSION_OFFSET)[0]


def parse_version(reply: object) -> int | None:
    """A version key's content as a version (absent: 0); None unless it is a decimal u64, as the scripts write it."""
    if reply is None:
        return 0
    if not isinstance(reply, bytes) or not reply.isdigit():
        return None
    version = int(reply)
    return version if version <= MAX_VERSION else None


def value_checksum(value: bytes) -> bytes:
    """The header's payload checksum bytes: identifies this node's own write in a region."""
    return bytes(value[CHECKSUM_OFFSET : CHECKSUM_OFFSET + U64.size])
