"""What a memfd or a mapping holds in memory, read as the kernel reports it."""

from __future__ import annotations

import ctypes
import mmap
import os
from typing import Any

import numpy as np

from gateway.libc import libc

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


def resident_pages(view: np.ndarray[Any, Any]) -> tuple[int, int]:
    """Of the whole pages the uint8 ``view`` spans (a mapping's), how many are in memory
    (``mincore``), and how many there are."""
    mincore = libc().mincore
    mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    start = int(view.ctypes.data) // PAGE * PAGE
    length = int(view.ctypes.data) + int(view.nbytes) - start
    pages = -(-length // PAGE)
    vec = (ctypes.c_ubyte * pages)()
    if mincore(start, length, vec) != 0:
        raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
    return sum(b & 1 for b in vec), pages
