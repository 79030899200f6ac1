"""The three ways a chunk is sealed and opened, one chosen per KV cache (``DataPath.sealer_for``):

``CpuSealer``  (a CPU cache) the fused path (``kernels.pieces``): store reads the chunk's runs
    straight out of the paged layer tensors into the AES-GCM stream, with no staging copy; load
    decrypts each segment straight into the chunk's blocks (``ChunkCipher.iter_segments_into``),
    so every byte is written once. A segment's plaintext lands before its tag is known, and is
    counted in (``on_layers``, or the return) only after it checked: nothing reads a layer before
    then. If segment ``k`` fails it is zeroed, and so are segments ``< k``, so a chunk that fails
    leaves nothing of itself in the cache.
``DeviceSealer``  (a CUDA cache, or ``device_cipher="always"``) encrypt where the KV lives (torch
    ops in a staging buffer, or the Triton gather-encrypt); only ciphertext crosses to the host.
``HostSealer``  (a CUDA cache with ``device_cipher="host"``, the explicit, logged switch, or a
    codec without a device cipher) pack on the device, copy to host staging, seal there.

Each chunk's envelope uses the codec's segment size rounded down to whole layers
(``layer_bytes * max(1, segment_bytes // layer_bytes)``), so a segment is a layer range."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from crypto.aead import wipe
from crypto.envelope import ChunkCipher, EnvelopeContext, EnvelopeKeys, plaintext_length
from crypto.errors import DecryptionFailed
from gateway.datapath.buffers import BufferPool, empty
from gateway.datapath.codec import EnvelopeCodec, layer_segment_bytes
from kernels.layouts import KVLayout
from kernels.pack import chunk_rows, pack, unpack
from kernels.paged import PagedKV
from kernels.pieces import ChunkPieces, FlatKV

__all__ = ["CpuSealer", "DeviceSealer", "HostSealer", "OnLayers", "OpenJob", "SealJob", "Sealer"]


@dataclass(slots=True)
class SealJob:
    slots: torch.Tensor
    keys: EnvelopeKeys  # a DataKey (embedded) or the envelope's IssuedKey (remote)
    ctx: EnvelopeContext
    out: memoryview | None = None  # seal straight into this (a tier's slot) instead of a new buffer


def _out(job: SealJob, pool: BufferPool, nbytes: int) -> memoryview:
    if job.out is None:
        return pool.envelope(nbytes)
    if job.out.nbytes != nbytes:
        raise ValueError(f"the slot holds {job.out.nbytes} bytes, the envelope is {nbytes}")
    return job.out


@dataclass(slots=True)
class OpenJob:
    envelope: memoryview
    slots: torch.Tensor
    keys: EnvelopeKeys
    ctx: EnvelopeContext
    write_tokens: int | None = None  # scatter only the chunk's first that many tokens (all are authenticated)


OnLayers = Callable[[int], None]
"""``on_layers(n)``: layers ``[0, n)`` of every chunk of the batch that is still loading are in
the cache (authenticated); a layer-wise load lets the engine's forward go that far."""


class Sealer(Protocol):
    name: str

    def seal(self, kv: PagedKV, jobs: Sequence[SealJob]) -> list[memoryview]:
        """Seal each chunk's KV into a new envelope (the tier keeps it)."""

    def open(self, kv: PagedKV, jobs: Sequence[OpenJob], on_layers: OnLayers | None = None) -> tuple[int, bool]:
        """Authenticate, decrypt and scatter each chunk into the paged KV. Returns (chunks loaded,
        whether the next one failed authentication); it stops at the first failure, and a chunk
        that failed leaves nothing of itself in the cache. ``on_layers``: open layer by layer
        across the chunks and say how far it got (a sealer that cannot says nothing: its caller
        counts every layer in once it returns)."""


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


class CpuSealer:
    name = "cpu-fused"

    def __init__(self, codec: EnvelopeCodec, pool: BufferPool) -> None:
        self.codec = codec
        self.pool = pool

    def seal(self, kv: PagedKV, jobs: Sequence[SealJob]) -> list[memoryview]:
        flat = FlatKV(kv)
        out: list[memoryview] = []
        for job in jobs:
            chunk = ChunkPieces(flat, job.slots)
            seg = layer_segment_bytes(self.codec.segment_bytes, chunk.layer_nbytes)
            env = _out(job, self.pool, self.codec.envelope_size(chunk.nbytes, seg))
            self.codec.seal_pieces_into(job.keys, job.ctx, chunk.pieces(), chunk.nbytes, env, segment_bytes=seg)
            out.append(env)
        return out

    def open(self, kv: PagedKV, jobs: Sequence[OpenJob], on_layers: OnLayers | None = None) -> tuple[int, bool]:
        flat = FlatKV(kv)
        if on_layers is not None:
            return self._open_layers(flat, jobs, on_layers)
        for i, job in enumerate(jobs):
            chunk = ChunkPieces(flat, job.slots, unique=True, write_tokens=job.write_tokens)
            try:
                self._open_one(chunk, job)
            except DecryptionFailed:
                return i, True
        return len(jobs), False

    def _open_layers(self, flat: FlatKV, jobs: Sequence[OpenJob], on_layers: OnLayers) -> tuple[int, bool]:
        """``open``, layer-major: the segments of every chunk up to layer 1, then up to layer 2,
        and so on (a chunk's plaintext is layer after layer, and its segments are whole layer
        ranges), saying after each layer how far the batch is. A chunk that fails ends the prefix
        there: it and every chunk after it (their first layers were written already) are zeroed
        where anything of them landed, and the chunks before it are opened to the end."""
        chunks = [ChunkPieces(flat, job.slots, unique=True, write_tokens=job.write_tokens) for job in jobs]
        live = len(jobs)  # chunks [0, live) are still the prefix
        for i, (chunk, job) in enumerate(zip(chunks, jobs, strict=True)):
            if self.codec.plaintext_length(job.envelope) != chunk.nbytes:
                live = i
                break
        failed = live < len(jobs)
        if live == 0:
            return 0, failed
        scratch = self.pool.scratch(max(self.codec.scratch_bytes(job.envelope) for job in jobs[:live]))
        delivered = [0] * live
        steps: list[Any] = []
        try:
            for i in range(live):
                try:
                    steps.append(self.codec.iter_segments_into(
                        jobs[i].keys, jobs[i].ctx, jobs[i].envelope, chunks[i].targets, scratch))
                except DecryptionFailed:
                    live, failed = i, True
                    break
            for layer in range(1, flat.kv.geometry.num_layers + 1):
                i = 0
                while i < live:
                    want = layer * chunks[i].layer_nbytes
                    try:
                        while delivered[i] < want:
                            _start, delivered[i] = next(steps[i])
                    except DecryptionFailed:
                        live, failed = i, True
                    i += 1
                on_layers(layer)
        finally:
            for step in steps:
                step.close()
        for i in range(live, len(delivered)):  # the failed chunk and those after it: nothing of them stays
            self._zero(chunks[i], delivered[i])
        return live, failed

    def _open_one(self, chunk: ChunkPieces, job: OpenJob) -> None:
        if self.codec.plaintext_length(job.envelope) != chunk.nbytes:  # also bounds the scratch below
            raise DecryptionFailed
        scratch = self.pool.scratch(self.codec.scratch_bytes(job.envelope))
        delivered = 0
        try:
            for _start, end in self.codec.iter_segments_into(job.keys, job.ctx, job.envelope, chunk.targets, scratch):
                delivered = end
        except DecryptionFailed:
            # Segments before the bad one were authentic, but a chunk loads whole or not at all:
            # zero them too (the bad one zeroed itself), so no part of it is left in the cache.
            self._zero(chunk, delivered)
            raise

    @staticmethod
    def _zero(chunk: ChunkPieces, end: int) -> None:
        """Zero bytes ``[0, end)`` of the chunk in the cache."""
        for t in chunk.targets(0, end):
            if not isinstance(t, int):
                wipe(t)


class HostSealer:
    """A device cache whose plaintext may cross to the host (``device_cipher=host``)."""

    name = "host"

    def __init__(self, codec: EnvelopeCodec, pool: BufferPool) -> None:
        self.codec = codec
        self.pool = pool

    def seal(self, kv: PagedKV, jobs: Sequence[SealJob]) -> list[memoryview]:
        out: list[memoryview] = []
        for job in jobs:
            staging = self.pool.staging(kv.geometry, job.slots.numel())
            staging.copy_(pack(kv, job.slots, kv.geometry))
            plain = _bytes(staging)
            size = self.codec.envelope_size(plain.nbytes)
            env = job.out if job.out is not None and job.out.nbytes == size else empty(size)
            self.codec.seal_into(job.keys, job.ctx, plain, env)
            out.append(env)
        return out

    def open(self, kv: PagedKV, jobs: Sequence[OpenJob], on_layers: OnLayers | None = None) -> tuple[int, bool]:
        geometry = kv.geometry
        for i, job in enumerate(jobs):
            staging = self.pool.staging(geometry, job.slots.numel())
            try:
                self.codec.open_into(job.keys, job.ctx, job.envelope, _bytes(staging))
            except DecryptionFailed:
                return i, True
            unpack(staging.to(kv.device), kv, job.slots, geometry, write_tokens=job.write_tokens)
        return len(jobs), False


AeadFactory = Callable[[bytes], Any]


class DeviceSealer:
    """Encrypt where the KV lives: only ciphertext is copied to the host."""

    def __init__(self, cipher: ChunkCipher, aead: tuple[str, AeadFactory], pool: BufferPool, segment_bytes: int) -> None:
        self.name = f"device-{aead[0]}"
        self.fused = aead[0] == "triton"
        self.factory = aead[1]
        self.cipher = cipher
        self.pool = pool
        self.segment_bytes = segment_bytes

    def _fused_for(self, kv: PagedKV) -> bool:
        """The Triton kernels move whole rows (every head of a token): the GPU layouts. A cache
        in the CPU layout on a device (possible through the core's API) takes the torch path."""
        return self.fused and kv.geometry.layout is not KVLayout.CPU

    def seal(self, kv: PagedKV, jobs: Sequence[SealJob]) -> list[memoryview]:
        if self._fused_for(kv):
            return self._seal_fused(kv, jobs)
        out: list[memoryview] = []
        for job in jobs:
            staging = self.pool.staging(kv.geometry, job.slots.numel(), kv.device)
            pack(kv, job.slots, kv.geometry, out=staging)
            plain = staging.view(-1).view(torch.uint8)
            seg = layer_segment_bytes(self.segment_bytes, plain.numel() // kv.geometry.num_layers)  # as the CPU path
            env = _out(job, self.pool, self.cipher.envelope_size(plain.numel(), seg))
            self.cipher.seal_device_into(
                job.keys, job.ctx, plain, plain.numel(), env, to_host=_to_host, segment_bytes=seg
            )
            out.append(env)
        return out

    def _seal_fused(self, kv: PagedKV, jobs: Sequence[SealJob]) -> list[memoryview]:
        """The Triton kernels read every layer's rows and write ciphertext into the staging buffer
        in one pass; each segment's copy to the host starts as soon as its kernels are queued."""
        factory = self.factory
        out: list[memoryview] = []
        for job in jobs:
            _, rows = chunk_rows(kv, job.slots, kv.geometry)
            staging = self.pool.staging(kv.geometry, job.slots.numel(), kv.device)
            plain = staging.view(-1).view(torch.uint8)
            n = plain.numel()
            seg = layer_segment_bytes(self.segment_bytes, n // kv.geometry.num_layers)
            copier = self.pool.copier(kv.device, n)
            env = _out(job, self.pool, self.cipher.envelope_size(n, seg))

            def encrypt(key: bytes, segments: list[Any], rows: torch.Tensor = rows, plain: torch.Tensor = plain) -> list[bytes]:
                def on_segment(s: int, e: int) -> None:
                    copier.issue_d2h(plain, s, e)

                result: list[bytes] = factory(key).gather_encrypt_(kv, rows, plain, segments, on_segment=on_segment)
                return result

            def to_host(s: int, e: int, dst: memoryview, plain: torch.Tensor = plain) -> None:
                copier.fetch_d2h(plain, s, e, dst)

            self.cipher.seal_device_fused(
                job.keys, job.ctx, n, env, encrypt=encrypt, to_host=to_host, segment_bytes=seg,
            )
            out.append(env)
        return out

    def open(self, kv: PagedKV, jobs: Sequence[OpenJob], on_layers: OnLayers | None = None) -> tuple[int, bool]:
        if self._fused_for(kv):
            return self._open_fused(kv, jobs)
        for i, job in enumerate(jobs):
            if not self._open_staged(kv, job):
                return i, True
        return len(jobs), False

    def _open_staged(self, kv: PagedKV, job: OpenJob) -> bool:
        """Ciphertext to the device, decrypted in place (every tag checked), then unpacked;
        False if it failed authentication (nothing written)."""
        staging = self.pool.staging(kv.geometry, job.slots.numel(), kv.device)
        plain = staging.view(-1).view(torch.uint8)
        try:
            if plaintext_length(job.envelope) != plain.numel():
                raise DecryptionFailed
            self.cipher.open_device_into(job.keys, job.ctx, job.envelope, plain, to_device=_to_device, zero=_zero_)
        except DecryptionFailed:
            return False
        unpack(staging, kv, job.slots, kv.geometry, write_tokens=job.write_tokens)
        return True

    def _open_fused(self, kv: PagedKV, jobs: Sequence[OpenJob]) -> tuple[int, bool]:
        """Ciphertext to the device staging buffer; every segment's tag checked, then the Triton
        kernels decrypt and scatter into the layers in one pass. A chunk that fails writes nothing."""
        factory = self.factory
        for i, job in enumerate(jobs):
            if job.write_tokens is not None and job.write_tokens < job.slots.numel():
                # the kernels scatter every row they decrypt: a chunk written only in part
                # takes the staged path (decrypt in place, then a partial unpack)
                if not self._open_staged(kv, job):
                    return i, True
                continue
            staging = self.pool.staging(kv.geometry, job.slots.numel(), kv.device)
            plain = staging.view(-1).view(torch.uint8)
            try:
                _, rows = chunk_rows(kv, job.slots, kv.geometry, unique=True)
                if plaintext_length(job.envelope) != plain.numel():
                    raise DecryptionFailed
                copier = self.pool.copier(kv.device, plain.numel())
                def to_device(src: memoryview, s: int, e: int, plain: torch.Tensor = plain) -> None:
                    copier.h2d(src, plain, s, e)

                def decrypt(key: bytes, segs: list[Any], rows: torch.Tensor = rows, plain: torch.Tensor = plain) -> Any:
                    return factory(key).decrypt_scatter_(plain, kv, rows, segs)

                self.cipher.open_device_fused(
                    job.keys, job.ctx, job.envelope, to_device=to_device, decrypt=decrypt,
                )
            except DecryptionFailed:
                return i, True
        return len(jobs), False
