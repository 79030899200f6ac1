"""The C library, for the few Linux calls the standard library has no function for.

``prctl(PR_SET_NAME)`` (a thread's kernel name: threadname), ``madvise(MADV_POPULATE_*)`` (faulting
a mapping in ahead of its writes: protocol.shmpages) and ``mincore`` (which pages are in memory:
the tests). ctypes because neither ``os`` nor ``mmap`` reaches them on the Python kvgate supports
(``mmap.madvise`` takes a whole ``mmap`` object, not a numpy view of one); one loader, cached, so
that every caller gets the same handle with ``errno`` kept for ``ctypes.get_errno``."""

from __future__ import annotations

import ctypes
import functools

__all__ = ["libc"]


@functools.cache
def libc() -> ctypes.CDLL:
    """The C library the process already has loaded (``dlopen(NULL)``: no search, no subprocess, as
    ``ctypes.util.find_library`` would run on the first call of a thread that names itself)."""
    return ctypes.CDLL(None, use_errno=True)
