"""What the server's and the worker's sides of a shared-memory region (``gateway.server.shm``,
``gateway.remote.shm``) agree on: where envelopes start in it, and how its pages are faulted in.

Alignment. Each envelope starts on a cache line (``ALIGN``): the server places them so, the
worker finds them so.

Populating. A fresh region is a memfd of holes, its pages allocated as first touched.
``populate_behind`` faults them in on a thread of its own at nice 19, a step at a time, after the
region was handed over; a load that comes first faults in what it uses. The server side uses
``MADV_POPULATE_WRITE`` (allocates each page, zeroed, mapped writable), the worker side
``MADV_POPULATE_READ`` (maps each page; a hole read allocates it). ``madvise`` goes through ctypes,
which releases the GIL for the call; the thread keeps a numpy view of the mapping while it runs, so
the mapping cannot be unmapped under it. A kernel without these advices (before Linux 5.14)
answers EINVAL: the region stays lazy. Design notes: docs/architecture.md, section 5."""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import mmap
import os
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

__all__ = ["ALIGN", "POPULATE_READ", "POPULATE_WRITE", "aligned", "populate", "populate_behind"]

log = logging.getLogger("kvgate.shm")

ALIGN = 64  # each envelope starts on a cache line of the region
POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)  # Linux 5.14 UAPI values (Python 3.12 names them)
POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)
_STEP = 4 << 20  # bytes per madvise: a closed region stops within one step
_NICE = 19

_libc: Any = None


def aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _madvise() -> Any:
    global _libc
    if _libc is None:
        lib = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        fn = lib.madvise
        fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        fn.restype = ctypes.c_int
        _libc = fn
    return _libc


def populate(view: np.ndarray[Any, Any], advice: int, stop: Callable[[], bool] = lambda: False) -> int:
    """Fault in the pages of ``view`` (a uint8 view of a whole, page-aligned mapping) with
    ``advice``, a step at a time, until done or ``stop()``. Returns the bytes populated; stops
    quietly at the first refusal (an old kernel: EINVAL; no memory left: ENOMEM)."""
    madvise = _madvise()
    base, size = int(view.ctypes.data), int(view.nbytes)
    done = 0
    while done < size and not stop():
        n = min(_STEP, size - done)
        if madvise(base + done, n, advice) != 0:
            err = ctypes.get_errno()
            log.debug("populating a shared-memory region stopped at %d of %d bytes: %s", done, size, os.strerror(err))
            break
        done += n
    return done


def populate_behind(
    view: np.ndarray[Any, Any], advice: int, stop: Callable[[], bool], done: Callable[[int], None] | None = None
) -> threading.Thread:
    """``populate`` on a daemon thread of its own at nice 19 (Linux: the thread's own nice value);
    ``done(bytes)`` when it ends. The thread holds ``view`` until then."""

    def run() -> None:
        tid = threading.get_native_id()
        try:
            os.setpriority(os.PRIO_PROCESS, tid, max(_NICE, os.getpriority(os.PRIO_PROCESS, tid)))
        except OSError:  # refused (a seccomp profile): it runs at the normal priority
            pass
        n = 0
        try:
            n = populate(view, advice, stop)
        finally:
            if done is not None:
                done(n)

    thread = threading.Thread(target=run, name="kvgate-shm-populate", daemon=True)
    thread.start()
    return thread
