"""What a memfd holds in memory, read as the kernel reports it."""

from __future__ import annotations

import mmap
import os

PAGE = mmap.PAGESIZE


def allocated_pages(fd: int) -> list[int]:
    """The pages of the memfd ``fd`` that hold memory (SEEK_DATA / SEEK_HOLE walk)."""
    pages, at = [], 0
    while True:
        try:
            start = os.lseek(fd, at, os.SEEK_DATA)
        except OSError:  # ENXIO: no data past ``at``
            return pages
        end = os.lseek(fd, start, os.SEEK_HOLE)
        pages.extend(range(start // PAGE, -(-end // PAGE)))
        at = end
