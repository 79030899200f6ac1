"""The data path's one buffer pool: envelopes (recycled), per-thread segment scratch, host and
device staging for packed chunks, and pinned host buffers for device copies.

Envelope memory. The memory tier keeps each envelope, so each is a new buffer, and fresh pages
fault in while the cipher writes them. malloc recycles most 2 MiB buffers by itself, but anything
over its 32 MiB mmap threshold goes back to the kernel on free. So envelopes come from
``_Recycler``: ``np.empty`` (transparent huge pages make fresh ones cheapest to fault in), and up
to ``reserve_bytes`` of them are handed out again once the tier has let go of them (replaced or
evicted). Design notes: docs/architecture.md, section 5."""

from __future__ import annotations

import sys
import threading
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from kernels.layouts import KVGeometry

if TYPE_CHECKING:
    from kernels.transfer import SegmentCopier

__all__ = ["BufferPool"]


def empty(nbytes: int) -> memoryview:
    return np.empty(nbytes, dtype=np.uint8).data


class _Recycler:
    """Envelope buffers of the same size, handed out again once nobody references them.

    A tier that replaces or evicts an envelope drops its last view of it; malloc would return
    a 32 MiB buffer to the kernel and the next one would fault its pages in again (about half
    the cost of a store here). So up to ``reserve_bytes`` of envelope arrays stay tracked, and
    ``take`` reuses one whose only references are this pool's. Everything handed out is a
    ``memoryview`` of the array: every view, slice, cast, ``np.frombuffer`` or ``torch.frombuffer``
    made from it holds a reference to the array, so an array referenced only here is one nobody
    can read (and the next seal overwrites a reused envelope whole). The tracked arrays stay
    allocated until ``clear``: at most ``reserve_bytes`` beyond what tiers hold."""

    _IDLE_REFS = 3  # the list slot, the loop variable, getrefcount's argument

    def __init__(self, reserve_bytes: int) -> None:
        self._reserve = reserve_bytes
        self._held = 0
        self._bufs: dict[int, list[np.ndarray[Any, np.dtype[np.uint8]]]] = {}
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> memoryview:
        with self._lock:
            bufs = self._bufs.setdefault(nbytes, [])
            for arr in bufs:
                if sys.getrefcount(arr) == self._IDLE_REFS:
                    return arr.data
            arr = np.empty(nbytes, dtype=np.uint8)
            if self._held + nbytes <= self._reserve:
                bufs.append(arr)
                self._held += nbytes
            return arr.data

    def clear(self) -> None:
        with self._lock:
            self._bufs.clear()
            self._held = 0


class BufferPool:
    """Every buffer the data path writes through. Per-thread buffers are kept (they stay warm
    in cache) and bounded: a few staging shapes per thread, one scratch, one copier per device."""

    def __init__(self, reserve_bytes: int = 256 << 20) -> None:
        self._envelopes = _Recycler(reserve_bytes)
        self._local = threading.local()

    def envelope(self, nbytes: int) -> memoryview:
        """A buffer for a new envelope (a tier keeps it)."""
        return self._envelopes.take(nbytes)

    def scratch(self, nbytes: int) -> memoryview:
        """This thread's segment scratch, at least ``nbytes``."""
        buf: memoryview | None = getattr(self._local, "scratch", None)
        if buf is None or buf.nbytes < nbytes:
            buf = self._local.scratch = empty(nbytes)
        return buf[:nbytes]

    def staging(self, geometry: KVGeometry, n: int, device: torch.device | None = None) -> torch.Tensor:
        """This thread's staging tensor for a packed chunk of ``n`` tokens (host or ``device``)."""
        bufs: dict[tuple[Any, ...], torch.Tensor] | None = getattr(self._local, "staging", None)
        if bufs is None:
            bufs = self._local.staging = {}
        key = (geometry.chunk_shape(n), geometry.dtype, str(device) if device is not None else "cpu")
        buf = bufs.get(key)
        if buf is None:
            if len(bufs) >= 8:
                bufs.pop(next(iter(bufs)))
            buf = bufs[key] = torch.empty(key[0], dtype=geometry.dtype, device=device)
        return buf

    def copier(self, device: torch.device, nbytes: int) -> SegmentCopier:
        """This thread's ``SegmentCopier`` for ``device`` (pinned buffer of at least ``nbytes``)."""
        from kernels.transfer import SegmentCopier

        copiers: dict[str, SegmentCopier] | None = getattr(self._local, "copiers", None)
        if copiers is None:
            copiers = self._local.copiers = {}
        copier = copiers.get(str(device))
        if copier is None or copier.capacity < nbytes:
            copier = copiers[str(device)] = SegmentCopier(device, nbytes)
        return copier

    def clear(self) -> None:
        self._envelopes.clear()
