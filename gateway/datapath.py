"""The CPU side of the data path: gather + seal, open + scatter, in batches on a small thread pool.

CPU caches take the fused path (``kernels.pieces``, ``ChunkCipher.seal_pieces_into`` /
``open_segments``):

- store: the chunk's contiguous runs are read straight out of the paged layer tensors by the
  AES-GCM stream into the envelope; no staging copy (the copy cost more than AES-GCM itself).
- load: one segment at a time is verified and decrypted into a per-thread scratch buffer of one
  segment (it stays in cache), then scattered into the paged KV. Nothing reaches the cache before
  its segment's tag checked. If segment ``k`` fails, segments ``< k`` (authentic) had already been
  scattered: they are zeroed again, so a chunk that fails leaves nothing of itself in the cache
  (its slots end the loaded prefix; the engine recomputes them).
- segments: each chunk's envelope uses the cipher's segment size rounded down to whole layers
  (``layer_bytes * max(1, segment_bytes // layer_bytes)``), so a segment is a layer range.

The plaintext benchmark baseline (``encrypt=False``) runs the same gather and segment scatter
with a plain copy in place of AES-GCM, so encrypted/plaintext is a fair ratio. CUDA caches keep
the torch ``pack``/``unpack`` path through a staging buffer (the device cipher is another path).

Work is handed to the pool a batch of chunks at a time, so the executor hop (~0.1 ms measured here)
is paid per batch. cryptography's AES-GCM releases the GIL, so two threads use both cores.
``threads=0`` runs inline on the calling (event-loop) thread.

Envelope memory. The memory tier keeps each envelope, so each is a new buffer, and fresh pages
fault in while the cipher writes them. Measured here (steady state, envelopes replacing older
ones, one worker thread, GB/s of a 2 MiB / 32 MiB AES-GCM seal into the new buffer; 14 / 10 into a
reused one): numpy with transparent huge pages (its default ``madvise``) 7 / 4, numpy with 4 KiB
pages 8.8-9.5 / 2.0, ``bytearray`` (zero-filled first) 6.5 / 1.6; ``mmap`` with ``MAP_POPULATE``
or ``MADV_POPULATE_WRITE`` 2.3 / 2.4 (the kernel still zeroes every page). malloc recycles most
2 MiB buffers by itself, but anything over its 32 MiB mmap threshold (a 32 MiB chunk's envelope)
goes back to the kernel on free. So envelopes come from ``_Recycler``: ``np.empty`` (huge pages
win for the fresh ones), and up to ``reserve_bytes`` of them are handed out again once the tier
has let go of them (replaced or evicted): 32 MiB stores went from 0.55-2 to 3.6 GB/s here.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import threading
import warnings
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import torch

from crypto.envelope import (
    MAX_SEGMENT_BYTES,
    ChunkCipher,
    EnvelopeContext,
    peek_key_version,
    plaintext_length,
    segment_scratch_bytes,
)
from crypto.errors import DecryptionFailed
from kernels.device_aead import device_aead_factory
from kernels.layouts import KVGeometry
from kernels.pack import chunk_rows, pack, unpack
from kernels.paged import PagedKV
from kernels.pieces import ChunkPieces, FlatKV

log = logging.getLogger("kvgate.datapath")

__all__ = ["DataPath", "OpenJob", "SealJob"]

T = TypeVar("T")


@dataclass(slots=True)
class SealJob:
    slots: torch.Tensor
    dek: bytes
    ctx: EnvelopeContext


@dataclass(slots=True)
class OpenJob:
    envelope: memoryview
    slots: torch.Tensor
    dek: bytes
    ctx: EnvelopeContext


def _empty(nbytes: int) -> memoryview:
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
    allocated until ``clear`` (``DataPath.close``): at most ``reserve_bytes`` beyond what tiers hold."""

    _IDLE_REFS = 3  # the list slot, the loop variable, getrefcount's argument

    def __init__(self, reserve_bytes: int) -> None:
        self._reserve = reserve_bytes
        self._held = 0
        self._bufs: dict[int, list[np.ndarray]] = {}
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


def _to_host(part: torch.Tensor, dst: memoryview) -> None:
    torch.from_numpy(np.frombuffer(dst, dtype=np.uint8)).copy_(part)


def _to_device(src: memoryview, part: torch.Tensor) -> None:
    with warnings.catch_warnings():  # a read-only envelope: torch only reads it here
        warnings.simplefilter("ignore", UserWarning)
        part.copy_(torch.from_numpy(np.frombuffer(src, dtype=np.uint8)))


def _zero_(t: torch.Tensor) -> None:
    t.zero_()


def _bytes(t: torch.Tensor) -> memoryview:
    return t.view(-1).view(torch.uint8).numpy().data


class DataPath:
    def __init__(
        self,
        cipher: ChunkCipher,
        threads: int = 2,
        *,
        encrypt: bool = True,
        reserve_bytes: int = 256 << 20,
        device_cipher: str = "auto",
        device_aes: str = "auto",
    ) -> None:
        """``device_cipher``: ``auto`` encrypts on the device where the KV lives (CUDA: torch
        AES-GCM in place, only ciphertext is copied to the host); ``host`` is the explicit switch
        that lets plaintext KV cross to the host to be encrypted there (logged at start);
        ``always`` takes the device path even for CPU tensors (tests and the device check).
        ``device_aes``: which AES-GCM the device path runs (``kernels.device_aead``): ``auto``
        (the fused Triton kernels on CUDA when triton is installed, else the torch-ops cipher),
        ``triton`` or ``torch``."""
        if device_cipher not in ("auto", "host", "always"):
            raise ValueError("device_cipher must be auto, host or always")
        self.cipher = cipher
        self.threads = threads
        self.encrypt = encrypt  # False only for the benchmark's plaintext baseline
        self.device_cipher = device_cipher
        self._device_ciphers: dict[str, ChunkCipher] = {}
        self.device_aes = device_aes
        self._device_aes: dict[str, tuple[str, Callable[[bytes], Any]]] = {}
        self._local_copiers = threading.local()
        if device_cipher == "host":
            log.warning("device_cipher=host: plaintext KV of CUDA caches is copied to the host and encrypted there")
        self._envelopes = _Recycler(reserve_bytes)
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="kvgate-cpu") if threads else None
        self._local = threading.local()

    def close(self) -> None:
        self._envelopes.clear()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        if self._pool is None:
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def key_version(self, envelope: memoryview) -> int:
        """The data-key version an envelope was sealed with (0 for the plaintext baseline)."""
        return peek_key_version(envelope) if self.encrypt else 0

    def segment_bytes(self, layer_nbytes: int) -> int:
        """A chunk's segment size: the cipher's, rounded down to whole layers (at least one)."""
        return min(MAX_SEGMENT_BYTES, layer_nbytes * max(1, self.cipher.segment_bytes // layer_nbytes))

    # -- per-thread buffers ------------------------------------------------------------------

    def _scratch(self, nbytes: int) -> memoryview:
        """This thread's segment scratch (kept, so it stays warm in cache), at least ``nbytes``."""
        buf: memoryview | None = getattr(self._local, "scratch", None)
        if buf is None or buf.nbytes < nbytes:
            buf = self._local.scratch = _empty(nbytes)
        return buf[:nbytes]

    def _staging(self, geometry: KVGeometry, n: int) -> torch.Tensor:
        bufs: dict | None = getattr(self._local, "bufs", None)
        if bufs is None:
            bufs = self._local.bufs = {}
        key = (geometry.chunk_shape(n), geometry.dtype)
        buf = bufs.get(key)
        if buf is None:
            if len(bufs) >= 8:
                bufs.pop(next(iter(bufs)))
            buf = bufs[key] = torch.empty(key[0], dtype=geometry.dtype)
        return buf

    # -- store -------------------------------------------------------------------------------

    def seal_batch(self, kv: PagedKV, binding: bytes, jobs: Sequence[SealJob]) -> list[memoryview]:
        """Seal each chunk's KV into a new envelope (the tier keeps it)."""
        if self.encrypt and self._on_device(kv):
            return self._seal_device(kv, binding, jobs)
        if kv.device.type != "cpu":  # device_cipher=host (the explicit switch) or the plaintext baseline
            return self._seal_packed(kv, binding, jobs)
        flat = FlatKV(kv)
        out: list[memoryview] = []
        for job in jobs:
            chunk = ChunkPieces(flat, job.slots)
            pieces, n = chunk.pieces(), chunk.nbytes
            if self.encrypt:
                seg = self.segment_bytes(chunk.layer_nbytes)
                env = self._envelopes.take(self.cipher.envelope_size(n, seg))
                self.cipher.seal_pieces_into(job.dek, binding, job.ctx, pieces, n, env, segment_bytes=seg)
            else:
                env = self._envelopes.take(n)
                pos = 0
                for p in pieces:
                    env[pos : pos + p.nbytes] = p
                    pos += p.nbytes
            out.append(env)
        return out

    # -- the device path: encrypt where the KV lives, only ciphertext crosses --------------------

    def _on_device(self, kv: PagedKV) -> bool:
        return self.device_cipher == "always" or (kv.device.type != "cpu" and self.device_cipher == "auto")

    def _device_aead(self, device: torch.device) -> tuple[str, Callable[[bytes], Any]]:
        """``(name, key -> AEAD)`` of the device cipher chosen for ``device`` (once per device)."""
        chosen = self._device_aes.get(str(device))
        if chosen is None:
            chosen = self._device_aes[str(device)] = device_aead_factory(device, self.device_aes, failure=DecryptionFailed)
            log.info("device AES-GCM on %s: %s", device, chosen[0])
        return chosen

    def _device_cipher(self, device: torch.device) -> ChunkCipher:
        cipher = self._device_ciphers.get(str(device))
        if cipher is None:
            cipher = ChunkCipher(self._device_aead(device)[1], segment_bytes=self.cipher.segment_bytes)
            self._device_ciphers[str(device)] = cipher
        return cipher

    def _copier(self, device: torch.device, nbytes: int) -> Any:
        """This thread's ``SegmentCopier`` for ``device`` (pinned buffer of at least ``nbytes``)."""
        from kernels.transfer import SegmentCopier

        copiers: dict | None = getattr(self._local_copiers, "by_device", None)
        if copiers is None:
            copiers = self._local_copiers.by_device = {}
        copier = copiers.get(str(device))
        if copier is None or copier.capacity < nbytes:
            copier = copiers[str(device)] = SegmentCopier(device, nbytes)
        return copier

    def _device_staging(self, geometry: KVGeometry, n: int, device: torch.device) -> torch.Tensor:
        bufs: dict | None = getattr(self._local, "dev", None)
        if bufs is None:
            bufs = self._local.dev = {}
        key = (geometry.chunk_shape(n), geometry.dtype, str(device))
        buf = bufs.get(key)
        if buf is None:
            if len(bufs) >= 4:
                bufs.pop(next(iter(bufs)))
            buf = bufs[key] = torch.empty(key[0], dtype=geometry.dtype, device=device)
        return buf

    def _seal_device(self, kv: PagedKV, binding: bytes, jobs: Sequence[SealJob]) -> list[memoryview]:
        """Pack into a device staging buffer, encrypt it there in place, copy ciphertext out (the
        Triton cipher: gather and encrypt in one pass, see ``_seal_fused``)."""
        cipher = self._device_cipher(kv.device)
        if self._device_aead(kv.device)[0] == "triton":
            return self._seal_fused(kv, binding, jobs, cipher)
        out: list[memoryview] = []
        for job in jobs:
            staging = self._device_staging(kv.geometry, job.slots.numel(), kv.device)
            pack(kv, job.slots, kv.geometry, out=staging)
            plain = staging.view(-1).view(torch.uint8)
            seg = self.segment_bytes(plain.numel() // kv.geometry.num_layers)  # as the CPU path
            env = self._envelopes.take(cipher.envelope_size(plain.numel(), seg))
            cipher.seal_device_into(
                job.dek, binding, job.ctx, plain, plain.numel(), env, to_host=_to_host, segment_bytes=seg
            )
            out.append(env)
        return out

    def _seal_fused(self, kv: PagedKV, binding: bytes, jobs: Sequence[SealJob], cipher: ChunkCipher) -> list[memoryview]:
        """The Triton kernels read every layer's rows and write ciphertext into the staging buffer
        in one pass; each segment's copy to the host starts as soon as its kernels are queued."""
        factory = self._device_aead(kv.device)[1]
        out: list[memoryview] = []
        for job in jobs:
            _, rows = chunk_rows(kv, job.slots, kv.geometry)
            staging = self._device_staging(kv.geometry, job.slots.numel(), kv.device)
            plain = staging.view(-1).view(torch.uint8)
            n = plain.numel()
            seg = self.segment_bytes(n // kv.geometry.num_layers)
            copier = self._copier(kv.device, n)
            env = self._envelopes.take(cipher.envelope_size(n, seg))

            def encrypt(key: bytes, segments: list, rows: torch.Tensor = rows, plain: torch.Tensor = plain) -> list[bytes]:
                on_segment = lambda s, e: copier.issue_d2h(plain, s, e)  # noqa: E731
                return factory(key).gather_encrypt_(kv, rows, plain, segments, on_segment=on_segment)

            cipher.seal_device_fused(
                job.dek, binding, job.ctx, n, env, encrypt=encrypt,
                to_host=lambda s, e, dst, plain=plain: copier.fetch_d2h(plain, s, e, dst), segment_bytes=seg,
            )
            out.append(env)
        return out

    def _open_fused(self, kv: PagedKV, binding: bytes, jobs: Sequence[OpenJob], cipher: ChunkCipher) -> tuple[int, bool]:
        """Ciphertext to the device staging buffer; every segment's tag checked, then the Triton
        kernels decrypt and scatter into the layers in one pass. A chunk that fails writes nothing."""
        factory = self._device_aead(kv.device)[1]
        for i, job in enumerate(jobs):
            staging = self._device_staging(kv.geometry, job.slots.numel(), kv.device)
            plain = staging.view(-1).view(torch.uint8)
            try:
                _, rows = chunk_rows(kv, job.slots, kv.geometry, unique=True)
                if plaintext_length(job.envelope) != plain.numel():
                    raise DecryptionFailed
                copier = self._copier(kv.device, plain.numel())
                cipher.open_device_fused(
                    job.dek, binding, job.ctx, job.envelope,
                    to_device=lambda src, s, e, plain=plain: copier.h2d(src, plain, s, e),
                    decrypt=lambda key, segs, rows=rows, plain=plain: factory(key).decrypt_scatter_(plain, kv, rows, segs),
                )
            except DecryptionFailed:
                return i, True
        return len(jobs), False

    def _open_device(self, kv: PagedKV, binding: bytes, jobs: Sequence[OpenJob]) -> tuple[int, bool]:
        """Copy ciphertext to a device staging buffer, check every tag and decrypt there, then
        unpack on the device (the Triton cipher: see ``_open_fused``)."""
        cipher = self._device_cipher(kv.device)
        if self._device_aead(kv.device)[0] == "triton":
            return self._open_fused(kv, binding, jobs, cipher)
        for i, job in enumerate(jobs):
            staging = self._device_staging(kv.geometry, job.slots.numel(), kv.device)
            plain = staging.view(-1).view(torch.uint8)
            try:
                if plaintext_length(job.envelope) != plain.numel():
                    raise DecryptionFailed
                cipher.open_device_into(job.dek, binding, job.ctx, job.envelope, plain, to_device=_to_device, zero=_zero_)
            except DecryptionFailed:
                return i, True
            unpack(staging, kv, job.slots, kv.geometry)
        return len(jobs), False

    def _seal_packed(self, kv: PagedKV, binding: bytes, jobs: Sequence[SealJob]) -> list[memoryview]:
        """A CUDA cache without the device cipher: pack, copy to the host, seal the copy."""
        out: list[memoryview] = []
        for job in jobs:
            staging = self._staging(kv.geometry, job.slots.numel())
            staging.copy_(pack(kv, job.slots, kv.geometry))
            plain = _bytes(staging)
            if self.encrypt:
                env = _empty(self.cipher.envelope_size(plain.nbytes))
                self.cipher.seal_into(job.dek, binding, job.ctx, plain, env)
            else:
                env = _empty(plain.nbytes)
                env[:] = plain
            out.append(env)
        return out

    # -- load --------------------------------------------------------------------------------

    def open_batch(self, kv: PagedKV, binding: bytes, jobs: Sequence[OpenJob]) -> tuple[int, bool]:
        """Authenticate, decrypt and scatter each chunk into the paged KV, segment by segment.

        Returns (chunks loaded, whether the next one failed authentication); it stops at the
        first failure. Nothing of a segment reaches ``kv`` before its tag was checked, and the
        slots of a chunk that failed are left zeroed where earlier segments had landed."""
        if self.encrypt and self._on_device(kv):
            return self._open_device(kv, binding, jobs)
        if kv.device.type != "cpu":
            return self._open_packed(kv, binding, jobs)
        flat = FlatKV(kv)
        for i, job in enumerate(jobs):
            chunk = ChunkPieces(flat, job.slots, unique=True)
            try:
                if self.encrypt:
                    self._open_one(chunk, binding, job)
                else:
                    self._copy_one(chunk, job.envelope)
            except DecryptionFailed:
                return i, True
        return len(jobs), False

    def _open_one(self, chunk: ChunkPieces, binding: bytes, job: OpenJob) -> None:
        if plaintext_length(job.envelope) != chunk.nbytes:  # also bounds the scratch below
            raise DecryptionFailed
        scratch = self._scratch(segment_scratch_bytes(job.envelope))
        delivered = [0]

        def on_segment(start: int, end: int, view: memoryview) -> None:
            chunk.scatter(view, start, end)
            delivered[0] = end

        try:
            self.cipher.open_segments(job.dek, binding, job.ctx, job.envelope, scratch, on_segment)
        except DecryptionFailed:
            # Segments before the bad one were authentic, but a chunk loads whole or not at all:
            # zero what landed (the scratch was just wiped) so no part of it is left in the cache.
            self._zero(chunk, delivered[0], scratch)
            raise

    @staticmethod
    def _zero(chunk: ChunkPieces, end: int, zeros: memoryview) -> None:
        """Zero bytes ``[0, end)`` of the chunk in the cache, ``zeros.nbytes`` at a time."""
        step = zeros.nbytes
        for a in range(0, end, step):
            b = min(a + step, end)
            chunk.scatter(zeros[: b - a], a, b)

    def _copy_one(self, chunk: ChunkPieces, envelope: memoryview) -> None:
        """The plaintext baseline: the same segment-wise scatter, a copy in place of AES-GCM."""
        n = chunk.nbytes
        if envelope.nbytes != n:
            raise DecryptionFailed
        seg = self.segment_bytes(chunk.layer_nbytes)
        scratch = self._scratch(min(seg, n))
        for a in range(0, n, seg):
            b = min(a + seg, n)
            part = scratch[: b - a]
            part[:] = envelope[a:b]
            chunk.scatter(part, a, b)

    def _open_packed(self, kv: PagedKV, binding: bytes, jobs: Sequence[OpenJob]) -> tuple[int, bool]:
        """A CUDA cache: open the whole chunk into host staging, then unpack it to the device."""
        geometry = kv.geometry
        for i, job in enumerate(jobs):
            staging = self._staging(geometry, job.slots.numel())
            out = _bytes(staging)
            try:
                if self.encrypt:
                    self.cipher.open_into(job.dek, binding, job.ctx, job.envelope, out)
                elif job.envelope.nbytes != out.nbytes:
                    raise DecryptionFailed()
                else:
                    out[:] = job.envelope
            except DecryptionFailed:
                return i, True
            unpack(staging.to(kv.device), kv, job.slots, geometry)
        return len(jobs), False
