"""The in-memory index of a tier directory: key -> where its newest record lies.

Built from this writer's own appends (added as they are written) and from
scanning the new tails of every other writer's segments (``refresh``), so it
sees what other processes and hosts committed. The newest version of a key
wins; a tombstone hides every value of its key up to its version (also one
scanned later from an older segment). Read descriptors of segments are cached
here and dropped when their segment is removed. Only segments are opened
(``entries``); a file that does not start like one is skipped from then on.
"""

from __future__ import annotations

import os
import threading
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from tiercache.tiers.file.capacity import SegmentSizes
from tiercache.tiers.file.entries import DirectoryEntries
from tiercache.tiers.file.records import Record, RecordKind, scan, starts_like_a_segment


@dataclass(frozen=True)
class Entry:
    """Where the newest known record of a key lies."""

    segment: str
    offset: int
    length: int
    version: int


class SegmentIndex:
    """Key -> ``Entry`` for one directory, plus cached read descriptors (thread-safe)."""

    def __init__(self, entries: DirectoryEntries, max_body: int, counts: Counter) -> None:
        self.entries = entries
        self.max_body = max_body
        self.counts = counts
        self._lock = threading.Lock()
        self._entries: dict[bytes, Entry] = {}
        self._tombstones: dict[bytes, int] = {}
        self._scanned: dict[str, int] = {}
        self._fds: dict[str, int] = {}
        self._own: set[str] = set()
        self._sizes = SegmentSizes(entries)
        self.on_dropped: Callable[[list[bytes]], None] | None = None
        """Told the keys whose records went with a removed segment (this writer's clean-up or another's)."""

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: bytes) -> bool:
        return key in self._entries

    def get(self, key: bytes) -> Entry | None:
        """The newest known record of ``key``, if any."""
        return self._entries.get(key)

    def add_own(self, name: str) -> None:
        """A segment this writer appends to: indexed as written, never scanned."""
        with self._lock:
            self._own.add(name)

    def apply_all(self, segment: str, records: Iterable[Record]) -> None:
        """Fold records of ``segment`` into the index."""
        with self._lock:
            for record in records:
                self._apply(segment, record)

    def tombstone(self, keys: Sequence[bytes], version: int) -> int:
        """Hide ``keys`` up to ``version``; return how many were indexed."""
        with self._lock:
            known = sum(key in self._entries for key in keys)
            for key in keys:
                self._apply("", Record(RecordKind.TOMBSTONE, key, version, 0, 0))
        return known

    def close(self) -> None:
        """Close every cached descriptor."""
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()

    def refresh(self) -> None:
        """Scan the new tails of other writers' segments; forget segments that are gone."""
        sizes = self._sizes.current()
        with self._lock:
            known = [*self._scanned, *self._own]
        self.forget([name for name in known if name not in sizes])
        self.counts["index_refreshes"] += 1
        for name, size in sizes.items():
            start = self._scanned.get(name, 0)
            if name in self._own or size <= start:
                continue
            fd = self.fd(name)
            if fd is None:
                continue
            try:
                records, stop = scan(fd, start, size, self.max_body)
                if stop == 0 and not starts_like_a_segment(fd):
                    self.entries.skip(name, "does not start with a record header")
                    self.forget([name])
                    continue
            except OSError:
                self.counts["scan_errors"] += 1
                continue
            with self._lock:
                for record in records:
                    self._apply(name, record)
                self._scanned[name] = stop

    def _apply(self, segment: str, record: Record) -> None:
        """Fold one record into the index (newest version wins; tombstones hide older values)."""
        key, version = record.key, record.version
        current = self._entries.get(key)
        if record.kind is RecordKind.TOMBSTONE:
            self._tombstones[key] = max(version, self._tombstones.get(key, 0))
            if current is not None and current.version <= version:
                del self._entries[key]
        elif self._tombstones.get(key, -1) < version and (current is None or current.version <= version):
            self._entries[key] = Entry(segment, record.offset, record.length, version)

    def forget(self, names: Sequence[str]) -> None:
        """Drop removed segments: their index entries and descriptors."""
        if not names:
            return
        gone = set(names)
        with self._lock:
            dropped = [key for key, entry in self._entries.items() if entry.segment in gone]
            for key in dropped:
                del self._entries[key]
            for name in gone:
                fd = self._fds.pop(name, None)
                if fd is not None:
                    os.close(fd)
                self._scanned.pop(name, None)
                self._own.discard(name)
        if dropped and self.on_dropped is not None:
            self.on_dropped(dropped)

    def fd(self, name: str) -> int | None:
        """A cached read descriptor of a segment (None if it is gone)."""
        fd = self._fds.get(name)
        if fd is not None:
            return fd
        fd = self.entries.open(name)
        if fd is None:
            self.forget([name])
            return None
        with self._lock:
            existing = self._fds.setdefault(name, fd)
        if existing != fd:
            os.close(fd)
        return existing
