"""The worker's stores in flight: bounded, and the compact buffers they read, reused.

    StagingPool   compact buffers (BLOCK_FIRST, one tensor per layer) by power-of-two block
                  count; ``take`` hands out an idle one or a new one, ``give`` keeps it for the
                  next store, both within the ``room`` the caller leaves (the worker: the cap
                  less what is in flight, so staging memory stays under the cap but for one
                  store larger than it)
    InFlight      the stores submitted and not yet reaped: ``admit`` (one more of ``nbytes``
                  fits under the cap; one always fits when none is in flight), ``add`` its
                  future, ``reap`` the ended ones (on the engine's thread, at its next hook),
                  ``wait`` for all of them, bounded (shutdown, tests)

A buffer is reused only once its store returned or raised (every seal job ended), never after a
timeout: a timed-out store's job may still read it, so it is left to the garbage collector and the
next store's gather never overwrites KV being sealed under another request's keys."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass
from typing import Generic, TypeVar

import torch

from kernels.layouts import BlockView

__all__ = ["InFlight", "StagingPool", "Submitted"]

T = TypeVar("T")


class StagingPool:
    def __init__(self, blocks: BlockView) -> None:
        self._blocks = blocks
        self._idle: dict[int, list[list[torch.Tensor]]] = {}
        self.idle_bytes = 0
        self._lock = threading.Lock()

    def block_nbytes(self) -> int:
        v = self._blocks.views[0]
        return int(v[0].numel()) * v.element_size() * len(self._blocks.views)

    def nbytes(self, num_blocks: int) -> int:
        """Bytes of the buffer ``take(num_blocks)`` hands out."""
        return _capacity(num_blocks) * self.block_nbytes()

    def take(self, num_blocks: int, room: int) -> list[torch.Tensor]:
        """A buffer of at least ``num_blocks`` blocks; idle ones beyond ``room`` bytes are freed."""
        cap = _capacity(num_blocks)
        buf = None
        with self._lock:
            idle = self._idle.get(cap)
            if idle:
                buf = idle.pop()
                self.idle_bytes -= cap * self.block_nbytes()
            for size in sorted(self._idle, reverse=True):
                while self._idle[size] and self.idle_bytes > max(0, room):
                    self._idle[size].pop()
                    self.idle_bytes -= size * self.block_nbytes()
        if buf is not None:
            return buf
        v = self._blocks.views[0]
        shape = (cap, *v.shape[1:])
        return [torch.empty(shape, dtype=v.dtype, device=v.device) for _ in self._blocks.views]

    def give(self, buf: list[torch.Tensor], room: int) -> None:
        """Keep ``buf`` for a later store if the idle buffers stay within ``room`` bytes."""
        cap = int(buf[0].shape[0])
        nbytes = cap * self.block_nbytes()
        with self._lock:
            if self.idle_bytes + nbytes <= room:
                self._idle.setdefault(cap, []).append(buf)
                self.idle_bytes += nbytes


def _capacity(num_blocks: int) -> int:
    return 1 << max(0, num_blocks - 1).bit_length()


@dataclass
class Submitted(Generic[T]):
    """One store in flight: its future, the bytes it holds and what to do once it ended."""

    future: Future[T]
    nbytes: int
    on_end: Callable[[Future[T]], None]


class InFlight(Generic[T]):
    def __init__(self, cap_bytes: int) -> None:
        self.cap_bytes = cap_bytes
        self.nbytes = 0
        self._pending: list[Submitted[T]] = []
        self._lock = threading.Lock()

    def __len__(self) -> int:
        with self._lock:
            return len(self._pending)

    def admit(self, nbytes: int) -> bool:
        with self._lock:
            return not self._pending or self.nbytes + nbytes <= self.cap_bytes

    def add(self, future: Future[T], nbytes: int, on_end: Callable[[Future[T]], None]) -> None:
        with self._lock:
            self._pending.append(Submitted(future, nbytes, on_end))
            self.nbytes += nbytes

    def reap(self) -> int:
        """Run ``on_end`` of every ended store and forget it; how many there were."""
        with self._lock:
            ended: list[Submitted[T]] = []
            running: list[Submitted[T]] = []
            for s in self._pending:
                (ended if s.future.done() else running).append(s)
            self._pending = running
            self.nbytes -= sum(s.nbytes for s in ended)
        for s in ended:
            s.on_end(s.future)
        return len(ended)

    def wait_for_room(self, nbytes: int, timeout_s: float) -> bool:
        """Wait (at most ``timeout_s``) until ``nbytes`` more fit, reaping the stores that end;
        True if they fit."""
        deadline = time.monotonic() + timeout_s
        while not self.admit(nbytes):
            with self._lock:
                futures = [s.future for s in self._pending]
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            wait(futures, timeout=left, return_when=FIRST_COMPLETED)
            self.reap()
        return True

    def wait(self, timeout_s: float) -> bool:
        """Wait (at most ``timeout_s``) for every store in flight, then reap; True if none is left."""
        with self._lock:
            futures = [s.future for s in self._pending]
        if futures:
            wait(futures, timeout=timeout_s)
        self.reap()
        return len(self) == 0
