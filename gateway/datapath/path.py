"""The data path's CPU side: a sealer chosen once per KV cache, a small thread pool, one pool
of buffers.

Work is handed to the pool a batch of chunks at a time, so the executor hop is paid per batch.
cryptography's AES-GCM releases the GIL, so two threads use both cores. ``threads=0`` runs inline
on the calling (event-loop) thread.

``store_nice`` > 0 (Linux): stores seal on threads of their own whose nice value is that, so a
store in flight yields the CPU to the engine's forward steps; loads, which an engine waits for,
keep the normal priority. A thread can raise its own nice value without privileges but not lower
it again, hence a pool of its own rather than a switch per job. Design notes: docs/architecture.md,
section 5."""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import torch

from crypto.envelope import ChunkCipher
from crypto.errors import DecryptionFailed
from gateway.datapath.buffers import BufferPool
from gateway.datapath.codec import EnvelopeCodec, KeyRef, codec_of, layer_segment_bytes
from gateway.datapath.gate import STEPS, spread
from gateway.datapath.sealers import (
    CpuSealer,
    DeviceSealer,
    HostSealer,
    OnLayers,
    OpenJob,
    Sealer,
    SealJob,
)
from kernels.device_aead import device_aead_factory
from kernels.paged import PagedKV

log = logging.getLogger("kvgate.datapath")

__all__ = ["DataPath"]

T = TypeVar("T")


def _call_and_forget(held: list[Any]) -> Any:
    """``fn(*args)`` of ``held = [fn, args]``, keeping no reference to them once it returns. The
    pool's work item holds what it was given until its thread moves on, which can be after the
    awaiting coroutine has resumed: a load's envelopes (receive buffers) would then stay alive
    past their open, and the next chunk would get a fresh buffer instead of the one just freed
    (seen as a flaky ``test_a_loads_envelopes_are_let_go_as_they_are_opened``)."""
    fn, args = held
    held.clear()
    try:
        return fn(*args)
    finally:
        del fn, args


def _after_turn(latest: float, fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` once no forward step runs, or at ``latest`` (a store's slice)."""
    STEPS.wait_turn(latest)
    return fn(*args)


def _be_nice(nice: int) -> None:
    """A store thread's start: its own nice value (Linux: a thread's, not the process's), never
    below what it inherited (a process already niced stays as nice), on every CPU (``spread``)."""
    spread()
    tid = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, tid, max(nice, os.getpriority(os.PRIO_PROCESS, tid)))
    except OSError as exc:  # refused (a seccomp profile, say): stores run at the normal priority
        log.warning("kvgate store threads keep the normal priority: %s", exc)


class DataPath:
    def __init__(
        self,
        cipher: ChunkCipher | EnvelopeCodec,
        threads: int = 2,
        *,
        reserve_bytes: int = 256 << 20,
        device_cipher: str = "auto",
        device_aes: str = "auto",
        store_nice: int = 0,
        store_prefault: bool = True,
    ) -> None:
        """``cipher``: the AES-GCM chunk cipher (or another ``EnvelopeCodec``).
        ``device_cipher``: ``auto`` encrypts on the device where the KV lives (CUDA: only
        ciphertext is copied to the host); ``host`` is the explicit switch that lets plaintext KV
        cross to the host to be encrypted there (logged at start); ``always`` takes the device
        path even for CPU tensors (tests and the device check). ``device_aes``: which AES-GCM the
        device path runs (``kernels.device_aead``): ``auto`` (the fused Triton kernels on CUDA
        when triton is installed, else the torch-ops cipher), ``triton`` or ``torch``.
        ``store_nice``: the nice value of the threads that seal stores (the module says why; 0:
        stores share the load threads). ``store_prefault``: a store faults its reserved slots'
        pages in behind its seals (``DataPlane``; ``gateway.protocol.shmpages.prefault_behind``)."""
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
        if not 0 <= store_nice <= 19:
            raise ValueError("store_nice must lie in [0, 19]")
        self._executor = (
            ThreadPoolExecutor(threads, thread_name_prefix="kvgate-cpu", initializer=spread) if threads else None
        )
        self.store_prefault = store_prefault
        self.store_nice = store_nice if sys.platform == "linux" else 0  # elsewhere a nice value is the whole process's
        self._store_executor = (
            ThreadPoolExecutor(threads, thread_name_prefix="kvgate-store", initializer=_be_nice, initargs=(self.store_nice,))
            if threads and self.store_nice else None
        )

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
        for executor in (self._executor, self._store_executor):
            if executor is not None:
                executor.shutdown(wait=True)
        self._executor = self._store_executor = None

    async def run(self, fn: Callable[..., T], *args: Any, store: bool = False, latest: float | None = None) -> T:
        """``fn(*args)`` on a worker thread (inline without one); ``store``: on a store thread
        (``store_nice``) where there are, once the engine's forward step has ended or at
        ``latest`` (``gate.STEPS``). A thread cannot be stopped, and what it writes (an
        open scattering into an engine's cache, a seal into a reserved slot) must not outlive
        the call that asked for it: a cancelled ``run`` ends only once its thread has."""
        executor = self._store_executor if store and self._store_executor is not None else self._executor
        if executor is None:
            return fn(*args)
        if executor is self._store_executor and latest is not None:
            fn, args = _after_turn, (latest, fn, *args)
        fut = asyncio.get_running_loop().run_in_executor(executor, _call_and_forget, [fn, args])
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

    def open_batch(self, kv: PagedKV, jobs: Sequence[OpenJob], on_layers: OnLayers | None = None) -> tuple[int, bool]:
        """Authenticate, decrypt and scatter each chunk into the paged KV, segment by segment.

        Returns (chunks loaded, whether the next one failed authentication); it stops at the
        first failure. Nothing of a segment reaches ``kv`` before its tag was checked, and the
        slots of a chunk that failed are left zeroed where earlier segments had landed.
        ``on_layers``: layer by layer across the batch (``Sealer.open``), where the sealer can."""
        return self.sealer_for(kv).open(kv, jobs, on_layers)
