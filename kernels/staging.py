"""A bounded pool of reusable staging buffers, so chunk after chunk is packed without allocating.

Each buffer is a flat byte tensor of ``capacity_bytes`` on one device. A lease views its first
bytes as the shape and dtype asked for, so one pool serves full and partial chunks alike (a
partial last chunk is simply a shorter contiguous view). At most ``max_buffers`` are ever
allocated; when all are leased, ``acquire`` waits up to ``timeout`` seconds for one to come back,
then raises ``StagingExhausted``.

    pool = StagingPool.for_geometry(geometry, max_tokens=256, device="cuda:0", max_buffers=4)
    with pool.acquire_chunk(geometry, n) as lease:
        pack(kv_layers, slots, geometry, out=lease.tensor)
        ...  # encrypt in place, copy to host

A lease's tensor must not be used after the lease is released: the bytes go to the next caller.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from types import TracebackType
from typing import Self

import torch

from .errors import KVLayoutError, StagingClosed, StagingError, StagingExhausted
from .layouts import KVGeometry

__all__ = ["StagingLease", "StagingPool"]


class StagingLease:
    """One buffer of a ``StagingPool``, viewed as a tensor, until ``release()`` (or ``with`` exit)."""

    __slots__ = ("_buffer", "_pool", "_tensor")

    def __init__(self, pool: StagingPool, buffer: torch.Tensor, tensor: torch.Tensor) -> None:
        self._pool: StagingPool | None = pool
        self._buffer = buffer
        self._tensor = tensor

    @property
    def tensor(self) -> torch.Tensor:
        """The leased view; raises ``StagingError`` once the lease has been released."""
        if self._pool is None:
            raise StagingError("this staging lease has been released")
        return self._tensor

    @property
    def released(self) -> bool:
        return self._pool is None

    def release(self) -> None:
        """Give the buffer back to the pool. Releasing twice does nothing."""
        pool, self._pool = self._pool, None
        if pool is not None:
            pool._give_back(self._buffer)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()


class StagingPool:
    """At most ``max_buffers`` flat buffers of ``capacity_bytes`` each, on one device.

    Buffers are allocated on first need (or all at once with ``preallocate=True``, to fail at
    start-up rather than mid-flight) and reused afterwards. Thread-safe."""

    def __init__(
        self,
        capacity_bytes: int,
        *,
        device: torch.device | str = "cpu",
        max_buffers: int = 4,
        pin_memory: bool = False,
        preallocate: bool = False,
    ) -> None:
        for name, value in (("capacity_bytes", capacity_bytes), ("max_buffers", max_buffers)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise KVLayoutError(f"{name} must be a positive int, got {value!r}")
        try:
            self._device = torch.device(device)
        except (RuntimeError, TypeError) as exc:
            raise KVLayoutError(f"bad device {device!r}: {exc}") from None
        if pin_memory and (self._device.type != "cpu" or not torch.cuda.is_available()):
            raise KVLayoutError("pin_memory needs a CPU pool on a host with CUDA")
        self._capacity = capacity_bytes
        self._max = max_buffers
        self._pin = pin_memory
        self._free: list[torch.Tensor] = []
        self._allocated = 0
        self._closed = False
        self._cond = threading.Condition()
        if preallocate:
            with self._cond:
                while self._allocated < self._max:
                    self._free.append(self._allocate())

    @classmethod
    def for_geometry(
        cls,
        geometry: KVGeometry,
        max_tokens: int,
        *,
        device: torch.device | str = "cpu",
        max_buffers: int = 4,
        pin_memory: bool = False,
        preallocate: bool = False,
    ) -> StagingPool:
        """A pool whose buffers hold a chunk of up to ``max_tokens`` tokens of ``geometry``."""
        return cls(
            geometry.chunk_nbytes(max_tokens),
            device=device,
            max_buffers=max_buffers,
            pin_memory=pin_memory,
            preallocate=preallocate,
        )

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def capacity_bytes(self) -> int:
        return self._capacity

    @property
    def max_buffers(self) -> int:
        return self._max

    @property
    def allocated(self) -> int:
        """Buffers allocated so far (leased or free)."""
        with self._cond:
            return self._allocated

    @property
    def in_use(self) -> int:
        """Buffers currently leased."""
        with self._cond:
            return self._allocated - len(self._free)

    def acquire(
        self, shape: Sequence[int], dtype: torch.dtype, *, timeout: float | None = 0.0
    ) -> StagingLease:
        """Lease a buffer viewed as a contiguous ``shape``/``dtype`` tensor (contents undefined).

        ``timeout``: seconds to wait when every buffer is leased (``None``: wait for ever,
        ``0``: do not wait). Raises ``KVLayoutError`` if the request does not fit a buffer,
        ``StagingExhausted`` on timeout, ``StagingClosed`` after ``close()``."""
        dims = tuple(shape)
        if not isinstance(dtype, torch.dtype) or dtype.itemsize < 1:
            raise KVLayoutError(f"dtype must be a whole-byte torch.dtype, got {dtype!r}")
        if not dims or any(isinstance(d, bool) or not isinstance(d, int) or d <= 0 for d in dims):
            raise KVLayoutError(f"shape must be positive ints, got {dims!r}")
        nbytes = math.prod(dims) * dtype.itemsize
        if nbytes > self._capacity:
            raise KVLayoutError(
                f"{dims} of {dtype} needs {nbytes} bytes; staging buffers hold {self._capacity}"
            )
        with self._cond:
            if not self._cond.wait_for(self._ready, timeout=timeout):
                raise StagingExhausted(
                    f"all {self._max} staging buffers are leased (waited {timeout} s)"
                )
            if self._closed:
                raise StagingClosed("the staging pool is closed")
            buffer = self._free.pop() if self._free else self._allocate()
        return StagingLease(self, buffer, buffer[:nbytes].view(dtype).view(dims))

    def acquire_chunk(
        self, geometry: KVGeometry, num_tokens: int, *, timeout: float | None = 0.0
    ) -> StagingLease:
        """Lease a buffer viewed as a ``geometry.chunk_shape(num_tokens)`` chunk."""
        return self.acquire(geometry.chunk_shape(num_tokens), geometry.dtype, timeout=timeout)

    def close(self) -> None:
        """Drop every free buffer and refuse new leases; leased buffers are dropped on release."""
        with self._cond:
            self._closed = True
            self._allocated -= len(self._free)
            self._free.clear()
            self._cond.notify_all()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # -- internals (called with the condition held) ---------------------------------------------

    def _ready(self) -> bool:
        return self._closed or bool(self._free) or self._allocated < self._max

    def _allocate(self) -> torch.Tensor:
        try:
            buffer = torch.empty(
                self._capacity, dtype=torch.uint8, device=self._device, pin_memory=self._pin
            )
        except RuntimeError as exc:  # includes torch.OutOfMemoryError
            raise StagingError(
                f"could not allocate a {self._capacity}-byte staging buffer on {self._device}: "
                f"{exc}"
            ) from exc
        self._allocated += 1
        return buffer

    def _give_back(self, buffer: torch.Tensor) -> None:
        with self._cond:
            if self._closed:
                self._allocated -= 1
            else:
                self._free.append(buffer)
            self._cond.notify()
