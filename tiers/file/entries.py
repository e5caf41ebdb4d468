"""What in a tier directory is a segment, and how it is opened without ever blocking.

A segment is a regular file named ``<writer>.<seq>.seg`` that this tier can open and whose first
bytes are a record header's magic (or the zeros of a reservation not yet written). Anything else in
the directory (a directory, a FIFO, a socket, a device, a symlink, a file it may not open, a name it
does not parse, a file that starts with something else) is skipped by every path: never scanned,
never counted in the capacity, never removed by GC. Each is counted (``skipped_entries``) and logged
once. Opening uses ``O_NONBLOCK | O_NOFOLLOW`` and checks the type of what was opened, so an entry
replaced between the listing and the open cannot block a call either.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import stat
import threading
from collections import Counter
from pathlib import Path

logger = logging.getLogger(__name__)

SEGMENT_SUFFIX = ".seg"
LOCK_NAME = ".lock"
SEGMENT_NAME = re.compile(r"[A-Za-z0-9_-]+\.[0-9]+" + re.escape(SEGMENT_SUFFIX))
"""``<writer>.<seq>.seg``: a writer id (host, pid and a random id, no dots) and a decimal sequence."""
NOT_A_SEGMENT_ERRNOS = frozenset({errno.ELOOP, errno.EACCES, errno.EPERM, errno.ENXIO, errno.ENODEV, errno.EISDIR})
"""Errors of ``open`` that say what an entry is (a symlink, a file it may not read, a socket, a device); any
other (too many open files, no memory, an interrupted call) may pass and leaves the entry to be tried again."""
OPEN_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC
"""Read-only, never waiting for a FIFO's writer, never following a symlink."""


def open_regular(path: str | Path) -> int:
    """A read descriptor of ``path`` if it is a regular file; raises ``OSError`` otherwise (never blocks)."""
    fd = os.open(path, OPEN_FLAGS)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(f"not a regular file: {path}")
    except BaseException:
        os.close(fd)
        raise
    return fd


class DirectoryEntries:
    """The segments of one directory, and the entries skipped (each counted and logged once)."""

    def __init__(self, root: Path, counts: Counter) -> None:
        self.root = root
        self.counts = counts
        self._skipped: set[str] = set()
        self._lock = threading.Lock()

    def segments(self) -> list[os.DirEntry]:
        """The directory's segment entries now (a missing directory has none)."""
        found, present = [], set()
        try:
            with os.scandir(self.root) as listing:
                for entry in listing:
                    name = entry.name
                    if name == LOCK_NAME:
                        continue
                    present.add(name)
                    if name in self._skipped:
                        continue
                    if not SEGMENT_NAME.fullmatch(name):
                        self.skip(name, "not named <writer>.<seq>.seg")
                    elif not entry.is_file(follow_symlinks=False):
                        self.skip(name, "not a regular file")
                    else:
                        found.append(entry)
        except FileNotFoundError:
            return []
        with self._lock:
            self._skipped &= present  # an entry removed and made again is judged again
        return found

    def skip(self, name: str, why: object) -> None:
        """Leave ``name`` alone from now on; count and log it the first time."""
        with self._lock:
            if name in self._skipped:
                return
            self._skipped.add(name)
        self.counts["skipped_entries"] += 1
        logger.warning("file tier %s: skipping %s, not a segment this tier can read (%s)", self.root, name, why)

    def open(self, name: str) -> int | None:
        """A read descriptor of segment ``name``; None if it is gone, not a segment (then skipped) or could not
        be opened now (``open_errors``; tried again next time)."""
        try:
            return open_regular(self.root / name)
        except FileNotFoundError:
            return None
        except OSError as error:
            if error.errno is None or error.errno in NOT_A_SEGMENT_ERRNOS:
                self.skip(name, error)
            else:
                self.counts["open_errors"] += 1
                logger.debug("file tier %s: cannot open %s now: %s", self.root, name, error)
            return None
