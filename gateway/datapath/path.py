"""The data path's CPU side: a sealer chosen once per KV cache, a small thread pool, one pool
of buffers.

Work is handed to the pool a batch of chunks at a time, so the executor hop (~0.1 ms measured here)
is paid per batch. cryptography's AES-GCM releases the GIL, so two threads use both cores.
``threads=0`` runs inline on the calling (event-loop) thread.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import torch

from crypto.envelope import ChunkCipher
from crypto.errors import DecryptionFailed
from gateway.datapath.buffers import BufferPool
from gateway.datapath.codec import EnvelopeCodec, KeyRef, codec_of, layer_segment_bytes
from gateway.datapath.sealers import (
    CpuSealer,
    DeviceSealer,
    HostSealer,
    OpenJob,
    Sealer,
    SealJob,
)
from kernels.device_aead import device_aead_factory
from kernels.paged import PagedKV

log = logging.getLogger("kvgate.datapath")

__all__ = ["DataPath"]

T = TypeVar("T")


class DataPath:
    def __init__(
        self,
        cipher: ChunkCipher | EnvelopeCodec,
        threads: int = 2,
        *,
        reserve_bytes: int = 256 << 20,
        device_cipher: str = "auto",
        device_aes: str = "auto",
    ) -> None:
        """``cipher``: the AES-GCM chunk cipher (or another ``EnvelopeCodec``).
        ``device_cipher``: ``auto`` encrypts on the device where the KV lives (CUDA: only
        ciphertext is copied to the host); ``host`` is the explicit switch that lets plaintext KV
        cross to the host to be encrypted there (logged at start); ``always`` takes the device
        path even for CPU tensors (tests and the device check). ``device_aes``: which AES-GCM the
        device path runs (``kernels.device_aead``): ``auto`` (the fused Triton kernels on CUDA
        when triton is installed, else the torch-ops cipher), ``triton`` or ``torch``."""
        if device_cipher not in ("auto", "host", "always"):
            raise ValueError("device_cipher must be auto, host or always")
        self.codec = codec_of(cipher)
        self.threads = threads
        self.device_aes = device_aes
        self.pool = BufferPool(reserve_bytes)
        self._sealers: dict[str, Sealer] = {}
        self._device_cipher = device_cipher
        if device_cipher == "host":
            log.warning("device_cipher=host: plaintext KV of CUDA caches is copied to the host and encrypted there")
        self._executor = ThreadPoolExecutor(threads, thread_name_prefix="kvgate-cpu") if threads else None

    @property
    def cipher(self) -> ChunkCipher | None:
        return self.codec.cipher

    @property
    def device_cipher(self) -> str:
        return self._device_cipher

    @device_cipher.setter
    def device_cipher(self, value: str) -> None:  # tests and the device check switch paths
        if value not in ("auto", "host", "always"):
            raise ValueError("device_cipher must be auto, host or always")
        self._device_cipher = value
        self._sealers.clear()

    def close(self) -> None:
        self.pool.clear()
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on a worker thread (inline without one). A thread cannot be stopped, and
        what it writes (an open scattering into an engine's cache, a seal into a reserved slot)
        must not outlive the call that asked for it: a cancelled ``run`` ends only once its
        thread has."""
        if self._executor is None:
            return fn(*args)
        fut = asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)
        try:
            return await asyncio.shield(fut)
        except asyncio.CancelledError:
            await asyncio.wait([fut])
            raise

    def key_ref(self, envelope: memoryview) -> KeyRef | None:
        """The data-key version and salt an envelope was sealed with (None: a codec without keys;
        ``DecryptionFailed``: a malformed header)."""
        return self.codec.key_ref(envelope)

    def segment_bytes(self, layer_nbytes: int) -> int:
        """A chunk's segment size: the codec's, rounded down to whole layers (at least one)."""
        return layer_segment_bytes(self.codec.segment_bytes, layer_nbytes)

    def envelope_nbytes(self, kv: PagedKV, num_tokens: int) -> int:
        """The size of the envelope a chunk of ``num_tokens`` tokens of ``kv`` seals into (to
        reserve its slot before sealing)."""
        g = kv.geometry
        n = g.chunk_nbytes(num_tokens)
        sealer = self.sealer_for(kv)
        if isinstance(sealer, HostSealer):
            return self.codec.envelope_size(n)
        return self.codec.envelope_size(n, self.segment_bytes(n // g.num_layers))

    # -- the sealer of a KV cache: chosen once ----------------------------------------------
    def _on_device(self, kv: PagedKV) -> bool:
        if self.codec.cipher is None:
            return False
        return self._device_cipher == "always" or (kv.device.type != "cpu" and self._device_cipher == "auto")

    def device_aes_name(self, device: torch.device) -> str:
        """Which AES-GCM the device path runs on ``device`` (``triton`` or ``torch``)."""
        return device_aead_factory(device, self.device_aes, failure=DecryptionFailed)[0]

    def sealer_for(self, kv: PagedKV) -> Sealer:
        """The sealer of a KV cache on ``kv.device`` (chosen at its first use, kept after)."""
        where = str(kv.device)
        sealer = self._sealers.get(where)
        if sealer is None:
            sealer = self._sealers[where] = self._choose(kv.device)
            log.info("data path for KV on %s: %s", where, sealer.name)
        return sealer

    def _choose(self, device: torch.device) -> Sealer:
        cipher = self.codec.cipher
        on_device = cipher is not None and (
            self._device_cipher == "always" or (device.type != "cpu" and self._device_cipher == "auto")
        )
        if on_device and cipher is not None:
            aead = device_aead_factory(device, self.device_aes, failure=DecryptionFailed)
            device_cipher = cipher.with_aead(aead[1])
            return DeviceSealer(device_cipher, aead, self.pool, cipher.segment_bytes)
        if device.type != "cpu":
            return HostSealer(self.codec, self.pool)
        return CpuSealer(self.codec, self.pool)

    # -- batches ----------------------------------------------------------------------------
    def seal_batch(self, kv: PagedKV, jobs: Sequence[SealJob]) -> list[memoryview]:
        """Seal each chunk's KV into a new envelope (the tier keeps it), with its job's keys."""
        return self.sealer_for(kv).seal(kv, jobs)

    def open_batch(self, kv: PagedKV, jobs: Sequence[OpenJob]) -> tuple[int, bool]:
        """Authenticate, decrypt and scatter each chunk into the paged KV, segment by segment.

        Returns (chunks loaded, whether the next one failed authentication); it stops at the
        first failure. Nothing of a segment reaches ``kv`` before its tag was checked, and the
        slots of a chunk that failed are left zeroed where earlier segments had landed."""
        return self.sealer_for(kv).open(kv, jobs)
