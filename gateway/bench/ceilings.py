"""The ceilings of `kvgate bench`, measured in the same run on the same bytes with the same
number of threads as the figure they bound.

- ``aes_gcm``: cryptography's AESGCM ``encrypt_into`` / ``decrypt_into`` into preallocated output,
  the irreducible cost of an encrypted store / load.
- ``memcpy``: a plain copy of the same bytes (torch ``copy_`` into a preallocated tensor); bounds
  the plaintext results.
- ``single_pass``: ``min(aes_gcm, memcpy)`` for each direction: the most a store or load
  can reach when every byte is read once from the paged KV and written once into its place, with
  the encryption fused into that pass. Every encrypted memory-tier result is reported against it.

Every ceiling runs over as many distinct buffers as the gateway run has chunks (the same bytes,
the same amount of memory streamed), never one buffer that stays hot in the CPU cache.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from gateway.bench.common import median_time

__all__ = ["Ceilings", "aes_ceiling", "measure_ceilings", "memcpy_ceiling"]


def parallel(threads: int, work: Callable[[int], None]) -> Callable[[], None]:
    """A callable that runs work(i) on ``threads`` threads at once (GIL released inside)."""

    def run() -> None:
        if threads == 1:
            work(0)
            return
        ts = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()

    return run


def aes_ceiling(total_bytes: int, chunk_bytes: int, threads: int, reps: int) -> tuple[float, float]:
    """GB/s of AES-256-GCM seal and open over ``total_bytes`` in ``chunk_bytes`` pieces."""
    aead = AESGCM(os.urandom(32))
    n_chunks = max(1, total_bytes // chunk_bytes)
    per_thread = [list(range(i, n_chunks, threads)) for i in range(threads)]
    rng = np.random.default_rng(0)
    src = [rng.integers(0, 256, chunk_bytes, dtype=np.uint8).data for _ in range(n_chunks)]
    sealed = [np.empty(chunk_bytes + 16, np.uint8).data for _ in range(n_chunks)]
    opened = [np.empty(chunk_bytes, np.uint8).data for _ in range(n_chunks)]
    nonce = os.urandom(12)

    def seal(i: int) -> None:
        for k in per_thread[i]:
            aead.encrypt_into(nonce, src[k], None, sealed[k])

    def open_(i: int) -> None:
        for k in per_thread[i]:
            aead.decrypt_into(nonce, sealed[k], None, opened[k])

    done = n_chunks * chunk_bytes
    return (
        done / median_time(parallel(threads, seal), reps) / 1e9,
        done / median_time(parallel(threads, open_), reps) / 1e9,
    )


def memcpy_ceiling(total_bytes: int, chunk_bytes: int, threads: int, reps: int) -> float:
    """GB/s of a plain copy of the same bytes (distinct buffers, as above)."""
    n_chunks = max(1, total_bytes // chunk_bytes)
    per_thread = [list(range(i, n_chunks, threads)) for i in range(threads)]
    src = [torch.randint(0, 255, (chunk_bytes,), dtype=torch.uint8) for _ in range(n_chunks)]
    dst = [torch.empty_like(s) for s in src]
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:

        def copy(i: int) -> None:
            for k in per_thread[i]:
                dst[k].copy_(src[k])

        return n_chunks * chunk_bytes / median_time(parallel(threads, copy), reps) / 1e9
    finally:
        torch.set_num_threads(old)


@dataclass(frozen=True, slots=True)
class Ceilings:
    """GB/s of each ceiling for one (chunk size, threads) configuration."""

    aes_gcm_seal: float
    aes_gcm_open: float
    memcpy: float

    def single_pass(self, op: str) -> float:
        """min(AES-256-GCM, memcpy) for a store (seal) or a load (open)."""
        return min(self.aes_gcm_seal if op == "store" else self.aes_gcm_open, self.memcpy)


def measure_ceilings(total_bytes: int, chunk_bytes: int, threads: int, reps: int) -> Ceilings:
    seal, open_ = aes_ceiling(total_bytes, chunk_bytes, threads, reps)
    return Ceilings(seal, open_, memcpy_ceiling(total_bytes, chunk_bytes, threads, reps))
