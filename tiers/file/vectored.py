"""Vectored writes that finish: ``pwritev`` of many buffers, resumed however the kernel splits them."""

from __future__ import annotations

import errno
import os
from collections.abc import Sequence

IOV_MAX = os.sysconf("SC_IOV_MAX")
"""Most buffers one ``pwritev`` / ``preadv`` takes."""


def pwrite_all(fd: int, buffers: Sequence[memoryview | bytes], offset: int) -> None:
    """``pwritev`` every buffer at ``offset`` onwards, however the kernel splits it."""
    views = [memoryview(buffer).cast("B") for buffer in buffers]
    index = 0
    while index < len(views):
        count = os.pwritev(fd, views[index : index + IOV_MAX], offset)
        if count <= 0:
            raise OSError(errno.EIO, "pwritev wrote nothing")
        offset += count
        while index < len(views) and count >= len(views[index]):
            count -= len(views[index])
            index += 1
        if count:
            views[index] = views[index][count:]
