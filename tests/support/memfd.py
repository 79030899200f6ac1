"""What a memfd or a mapping holds in memory, read as the kernel reports it."""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
from typing import Any

import numpy as np

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
    resident, pages = _mincore(view)
    return len(resident), pages


def resident_indices(view: np.ndarray[Any, Any]) -> list[int]:
    """The indices of the whole pages the uint8 ``view`` spans that are in memory (``mincore``:
    for a shared mapping, whatever mapping put them there)."""
    return _mincore(view)[0]


def _mincore(view: np.ndarray[Any, Any]) -> tuple[list[int], int]:
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    start = int(view.ctypes.data) // PAGE * PAGE
    length = int(view.ctypes.data) + int(view.nbytes) - start
    pages = -(-length // PAGE)
    vec = (ctypes.c_ubyte * pages)()
    if libc.mincore(start, length, vec) != 0:
        raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
    return [i for i, b in enumerate(vec) if b & 1], pages


def mapped_pages(view: np.ndarray[Any, Any]) -> list[int]:
    """Of the whole pages the uint8 ``view`` spans, the indices of those this process's own page
    tables map (``/proc/self/pagemap``, bit 63: present), whatever the file behind them holds."""
    start = int(view.ctypes.data) // PAGE * PAGE
    pages = -(-(int(view.ctypes.data) + int(view.nbytes) - start) // PAGE)
    with open("/proc/self/pagemap", "rb") as f:
        f.seek(start // PAGE * 8)
        entries = np.frombuffer(f.read(pages * 8), dtype="<u8")
    return [int(i) for i in np.flatnonzero(entries >> np.uint64(63))]
