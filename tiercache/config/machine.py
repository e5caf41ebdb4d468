"""What this machine can allocate: host memory available now, and free memory of a CUDA device.

Config validation checks the local tiers' sizes against these before anything
is allocated, so a capacity typo is a ``ConfigError`` at load time rather than
an allocator error (or the OOM killer) at start.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

MEMINFO = Path("/proc/meminfo")
"""Linux's memory report; its ``MemAvailable`` line is the kernel's estimate of allocatable memory."""
KIB = 1024
"""Bytes per kB as /proc/meminfo counts them."""


def host_memory_available() -> int:
    """Bytes of host memory that can be allocated now (``MemAvailable``; else free physical pages)."""
    try:
        for line in MEMINFO.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * KIB
    except (OSError, ValueError, IndexError):
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


HOST_MEMORY_SOURCE = "MemAvailable in /proc/meminfo"
"""How ``host_memory_available`` measures, for error messages."""


def cuda_memory_available(device: torch.device) -> int:
    """Free bytes on a CUDA device (``torch.cuda.mem_get_info``)."""
    import torch

    free, _total = torch.cuda.mem_get_info(device)
    return free
