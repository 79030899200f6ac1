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
answers EINVAL: the region stays lazy. The embedded memory tier's arena is populated the same way
(``memory_prefault: behind``, ``gateway.services.runtime``), and a server's per-namespace arenas
keep free pages populated ahead of their stores through ``prefault_behind`` (``storage.memory``,
``shm_arena_ahead_bytes``). Design notes: docs/architecture.md, section 5."""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from gateway.libc import libc
from gateway.threadname import name_thread

__all__ = ["ALIGN", "POPULATE_READ", "POPULATE_WRITE", "aligned", "populate", "populate_behind", "prefault_behind"]

log = logging.getLogger("kvgate.shm")

ALIGN = 64  # each envelope starts on a cache line of the region
POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)  # Linux 5.14 UAPI values (Python 3.12 names them)
POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)
_STEP = 4 << 20  # bytes per madvise: a closed region stops within one step
_NICE = 19
_PAGE = mmap.PAGESIZE

_madvise_fn: Any = None


def aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _madvise() -> Any:
    global _madvise_fn
    if _madvise_fn is None:
        fn = libc().madvise
        fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        fn.restype = ctypes.c_int
        _madvise_fn = fn
    return _madvise_fn


def _span(view: np.ndarray[Any, Any]) -> tuple[int, int]:
    """The start and length of the whole pages ``view`` spans."""
    start = int(view.ctypes.data)
    base = start // _PAGE * _PAGE
    return base, start + int(view.nbytes) - base


def populate(view: np.ndarray[Any, Any], advice: int, stop: Callable[[], bool] = lambda: False) -> int:
    """Fault in the pages ``view`` (a uint8 view) spans with ``advice``, whole pages, a step at a
    time, until done or ``stop()``. Returns the bytes populated, from the first page's start;
    stops quietly at the first refusal (an old kernel: EINVAL; no memory left: ENOMEM)."""
    madvise = _madvise()
    base, size = _span(view)
    done = 0
    while done < size and not stop():
        n = min(_STEP, size - done)
        if madvise(base + done, n, advice) != 0:
            err = ctypes.get_errno()
            log.debug("populating shared memory stopped at %d of %d bytes: %s", done, size, os.strerror(err))
            break
        done += n
    return done


def populate_behind(
    view: np.ndarray[Any, Any], advice: int, stop: Callable[[], bool], done: Callable[[int], None] | None = None
) -> threading.Thread:
    """``populate`` on a daemon thread of its own at nice 19 (Linux: the thread's own nice value);
    ``done(bytes)`` when it ends. The thread holds ``view`` until then."""

    def run() -> None:
        _nice_19()
        n = 0
        try:
            n = populate(view, advice, stop)
        finally:
            if done is not None:
                done(n)

    thread = threading.Thread(target=run, name="kvgate-shm-populate", daemon=True)
    thread.start()
    return thread


def prefault_behind(views: Sequence[memoryview], stop: Callable[[], bool]) -> threading.Thread | None:
    """Fault in, writable, the pages of each of ``views`` in turn (a store's reserved extents, in
    the order it seals them, or the free pages a server's arena keeps ahead of its next store) on
    a thread of its own at nice 19, until done or ``stop()``; None where there is nothing to do.
    A seal that comes to an extent after this thread writes into pages already there, so the
    faults (a fresh page is allocated and zeroed; on a virtual machine this costs more than
    sealing into it) are taken on this thread, as soon as the extents are reserved, and not inside
    the seal. The pages spanned are whole: ``MADV_POPULATE_WRITE`` changes no byte of a page already
    there, so a neighbour's bytes on a shared page are untouched. The thread holds the views
    until it ends."""
    arrays = [np.frombuffer(v, dtype=np.uint8) for v in views if v.nbytes and not v.readonly]
    if not arrays:
        return None

    def run() -> None:
        _nice_19()
        try:
            for a in arrays:  # one cut short (the store ended, or a refusal) ends them all
                if populate(a, POPULATE_WRITE, stop) < _span(a)[1]:
                    return
        finally:
            arrays.clear()

    thread = threading.Thread(target=run, name="kvgate-prefault", daemon=True)
    thread.start()
    return thread


def _nice_19() -> None:
    """This thread at nice 19 (Linux: a thread's own nice value), or as it is where refused, and
    named in the kernel (``gateway.threadname``)."""
    name_thread()
    tid = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, tid, max(_NICE, os.getpriority(os.PRIO_PROCESS, tid)))
    except OSError:  # refused (a seccomp profile): it runs at the normal priority
        pass
