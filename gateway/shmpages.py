"""What the server's and the worker's sides of a shared-memory region (``gateway.server.shm``,
``gateway.shmclient``) agree on: where envelopes start in it, and how its pages are faulted in.

Alignment. Each envelope starts on a cache line (``ALIGN``): the server places them so, the
worker finds them so.

Populating. A fresh region is a memfd of holes: its pages are allocated as they are first
touched, and a load that touches them pays for it (an 8K-token prompt of bench-e2e's model,
393 MB, took about a second more on its first load through a new region than on later ones).
Allocating them all when the region is made held a tenant's first store back by as much, and
in bench-e2e's multi-tenant workload four new tenants' first stores by seconds. So neither:
``populate_behind`` faults the pages in on a thread of its own at nice 19, a step at a time, after
the region was handed over. It runs only when a core is otherwise idle, and a load that comes
before it is done faults in what it uses, as before.

- The server writes into the region: ``MADV_POPULATE_WRITE`` allocates each page (zeroed) and
  maps it writable in the server.
- The worker reads it: ``MADV_POPULATE_READ`` maps each page in the worker (a page the server
  did not allocate yet is allocated by that read: a memfd's hole read is a new page).

``madvise`` is called through ctypes, which lets go of the GIL for the call: ``mmap.madvise`` holds
it, and each step would then stop the event loop or the engine's thread for its length. The
thread keeps a numpy view of the mapping while it runs, so the mapping cannot be unmapped under
it (``mmap.close`` refuses while a view exists; the region's owner lets it go when the thread
ends). A kernel without these advices (before Linux 5.14) answers EINVAL: the region stays lazy.
"""

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
