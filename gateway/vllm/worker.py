"""The connector's worker side: the KV cache, loads, stores, load errors.

    register(kv_caches, tp_rank, tp_size)   register_kv_caches: the tensors as ``BlockView`` blocks
    load(loads)                             start_load_kv: a CPU cache is decrypted into in place
                                            (never its last block); a GPU cache through a compact
                                            buffer, scattered back only where it authenticated;
                                            the rest is a load error (logged, counted)
    save(stores)                            wait_for_save: cut before any block whose load failed,
                                            gather into a pooled buffer, submit the store, return;
                                            past the in-flight cap it is dropped and counted
    wait_stores(timeout_s) / take_load_errors() / finished(req_ids)   shutdown, failed blocks, marks

Loads run synchronously on the backend's loop. A store's copy of the blocks (an
``inflight.StagingPool`` buffer) is its own, so vLLM may reuse the blocks at once; seal and put run
on the loop, every hook reaps ended stores, and the cut is ``ledger.WorkerLedger``'s rule."""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Awaitable, Iterable, Mapping, Sequence
from concurrent.futures import Future
from typing import Any

import torch

from gateway.datapath.gate import STEPS
from gateway.errors import GatewayError
from gateway.types import KVModel, RetrieveResult, StoreResult
from gateway.vllm.backend import Backend
from gateway.vllm.counters import LAYER_HOOKS_MISSED, OK, STORE_CUT, STORE_DROPPED, ConnectorCounters
from gateway.vllm.errors import ConnectorConfigError, GatewayTimeout
from gateway.vllm.handoff import HandoffStores, durable_store
from gateway.vllm.inflight import InFlight, StagingPool
from gateway.vllm.layers import LayerLoads
from gateway.vllm.ledger import LoadOp, StoreOp, WorkerLedger
from gateway.vllm.logs import Tracer, miss_reason
from kernels.errors import KVLayoutError
from kernels.layouts import BlockView

__all__ = ["WorkerSide"]

log = logging.getLogger("kvgate.vllm")


class WorkerSide:
    def __init__(
        self, backend: Backend, chunk_tokens: int, block_size: int, model_name: str, *, layout: str = "auto",
        stats: ConnectorCounters | None = None, trace: Tracer | None = None, max_in_flight_bytes: int = 1 << 30,
        layerwise: bool = True, store_finish_s: float = 0.0, store_wait_s: float = 0.0,
    ) -> None:
        self._backend = backend
        STEPS.finish_s = store_finish_s  # stores seal between this engine's steps (datapath/gate.py)
        self.block = block_size
        self._model_name = model_name
        self._layout = layout
        self.stats = ConnectorCounters() if stats is None else stats
        self._trace = trace or Tracer(None)
        self._copies: set[asyncio.Future[None]] = set()  # traced waits for write-behind copies
        self.ledger = WorkerLedger(chunk_tokens, block_size)
        self.blocks: BlockView | None = None
        self.model: KVModel | None = None
        self._load_errors: set[int] = set()
        self.in_flight: InFlight[StoreResult] = InFlight(max_in_flight_bytes)
        self.store_wait_s = store_wait_s  # how long a step's end waits for room in flight
        self._congested = False  # a wait found no room: stores past the cap drop until one fits
        self._per_chunk = chunk_tokens // block_size
        self.handoffs = HandoffStores()  # a producer's stores, reported to vLLM once durable
        self._pool: StagingPool | None = None
        self._layers = LayerLoads(layerwise, wait_s=backend.loop.timeout_s + backend.loop.settle_s + 5.0)

    def register(self, kv_caches: Mapping[str, torch.Tensor], tp_rank: int = 0, tp_size: int = 1) -> None:
        self._layers.register(list(kv_caches))
        try:
            self.blocks = BlockView.of(kv_caches, self.block, self._layout)
        except KVLayoutError as exc:
            raise ConnectorConfigError(str(exc)) from None
        self.model = KVModel(self._model_name, self.blocks.geometry, tp_rank=tp_rank, tp_size=tp_size)

    def _registered(self) -> tuple[BlockView, KVModel]:
        if self.blocks is None or self.model is None:
            raise RuntimeError("vLLM has not registered its KV caches with the connector")
        return self.blocks, self.model

    def load(self, loads: Sequence[LoadOp]) -> None:
        """One step's loads (every step starts here, with or without loads)."""
        self.finish_loads()  # a step that ended without the hooks that finish them (never, in vLLM 0.32)
        self._layers.new_step()
        self.ledger.new_step()
        self.in_flight.reap()
        if not loads:
            return
        blocks, model = self._registered()
        pool = self._staging(blocks)
        bs = self.block
        layerwise = self._layers.ready() and bool(getattr(self._backend, "layerwise", False))
        for op in loads:
            want = -(-len(op.tokens) // bs)  # blocks retrieved (and authenticated)
            upto = op.load_tokens // bs  # blocks the engine expects loaded (whole, a prefix of them)
            # chunks wholly inside what the engine computed itself (vLLM's own prefix cache) are
            # neither fetched nor opened: the compact buffer starts at the first chunk loaded
            first = op.skip_blocks * bs // self.ledger.chunk
            base = first * self.ledger.chunk // bs
            t0 = time.perf_counter()
            loaded = failures = 0
            reason = ""
            native = blocks.native and op.skip_blocks == base and len(op.block_ids) >= want
            if native and layerwise:
                # a layer-wise load: it runs on the backend's loop while the forward starts;
                # wait_for_layer_load holds each layer back until it is in place, and the step's
                # last hooks (finish_loads) take its outcome
                load = self._layers.start(op, upto, t0)
                load.future = self._backend.loop.submit(self._backend.retrieve(
                    op.capability, model, op.tokens, list(blocks.views), op.block_ids[base:want], first,
                    write_upto=upto * bs, on_layers=load.at,
                ))
                load.future.add_done_callback(load.ended)
                continue
            try:
                if native:
                    # a CPU cache is in the chunk format's own layout: decrypt straight into
                    # the request's blocks, no compact buffer and no second pass. Only blocks
                    # before ``upto`` are written (the last one is the engine's to compute);
                    # a chunk that fails authentication leaves nothing of itself there.
                    result = self._backend.loop.call(self._backend.retrieve(
                        op.capability, model, op.tokens, list(blocks.views), op.block_ids[base:want], first,
                        write_upto=upto * bs,
                    ))
                else:
                    result = self._load_compact(pool, op, blocks, model, want, upto, first, base)
                loaded, failures, reason = result.loaded_tokens // bs, result.integrity_failures, result.reason
            except GatewayTimeout as exc:
                loaded, reason = 0, miss_reason(exc)
            except (GatewayError, ValueError) as exc:
                loaded, reason = 0, miss_reason(exc)
            self._loaded(op, upto, t0, loaded, failures, reason)

    def _loaded(
        self, op: LoadOp, upto: int, t0: float, loaded: int, failures: int, reason: str, ms: float | None = None,
        lead_ms: float | None = None, **trace: Any,
    ) -> None:
        """A load's outcome (``loaded`` blocks): its failed blocks to vLLM, its trace line
        (``ms``: how long the load ran, by default until now; ``lead_ms``: how long the forward
        could use none of it, by default all of it)."""
        bs = self.block
        first_failed = max(loaded, op.skip_blocks)
        failed = self.ledger.load_failed(op.req_id, op.block_ids, first_failed, upto)
        self._load_errors |= failed
        self.stats.tokens("loaded", max(0, min(loaded, upto) - op.skip_blocks) * bs)
        if not failed:
            self.stats.count("load", OK)
        else:
            reason = reason or "miss"
            self.stats.count("load", reason)
            log.warning(
                "kvgate load for %s: %d of %d tokens loaded (%s); vLLM recomputes %d blocks, none of them "
                "is stored by this request", op.req_id, min(loaded, upto) * bs, upto * bs, reason, len(failed),
            )
        ms = (time.perf_counter() - t0) * 1e3 if ms is None else ms
        self._trace(
            "load", req=op.req_id, tokens=op.load_tokens, loaded_tokens=min(loaded, upto) * bs,
            failed_blocks=len(failed), integrity_failures=failures, reason=reason if failed else "",
            ms=ms, lead_ms=ms if lead_ms is None else min(ms, lead_ms), **trace, **self._backend.counters(),
        )

    # -- layer-wise loads ---------------------------------------------------------------------
    def wait_for_layer(self, layer_name: str) -> None:
        """wait_for_layer_load: until this layer of every load of the step is in place."""
        self._layers.wait(layer_name)

    def finish_loads(self) -> None:
        """The step's layer-wise loads, waited for to their end: their outcomes as a synchronous
        load's. Where the forward did not ask for every layer through wait_for_layer_load this
        step, it may have read a layer before it was in place: every block those loads wrote is
        then a load error (vLLM recomputes them and drops what the step computed from them)."""
        loads, complete, waited = self._layers.take()
        for load in loads:
            loaded, failures, reason = 0, 0, ""
            try:
                result = load.future.result(self._layers.wait_s) if load.future is not None else None
                if result is not None:
                    loaded, failures, reason = result.loaded_tokens // self.block, result.integrity_failures, result.reason
            except GatewayTimeout as exc:
                reason = miss_reason(exc)
            except TimeoutError:
                reason = "gateway_timeout"
                log.error("a layer-wise kvgate load for %s had not ended; its blocks are recomputed", load.op.req_id)
            except (GatewayError, ValueError) as exc:
                reason = miss_reason(exc)
            if not complete and loaded:  # counted and logged at WARNING as any failed load
                loaded, reason = 0, LAYER_HOOKS_MISSED
            end = load.t_end or time.perf_counter()
            self._loaded(load.op, load.upto, load.t0, loaded, failures, reason, ms=(end - load.t0) * 1e3,
                         lead_ms=((load.t_first or end) - load.t0) * 1e3, layerwise=True)
        if loads:
            self._trace("layer_wait", loads=len(loads), ms=waited * 1e3, hooks_complete=complete)

    def _load_compact(
        self, pool: StagingPool, op: LoadOp, blocks: BlockView, model: KVModel, want: int, upto: int, first: int,
        base: int,
    ) -> RetrieveResult:
        """A load through a pooled compact buffer, scattered into the cache after (a GPU cache, or
        a load whose first chunk is partly the engine's own). Its stale bytes are never
        scattered: only the prefix this retrieve authenticated and wrote is. After a timeout it is
        not given back: a cancelled call that outlived ``LoopThread.settle_s`` may still write
        into it."""
        compact = pool.take(want - base, room=self.in_flight.cap_bytes - self.in_flight.nbytes)
        try:
            result = self._backend.loop.call(
                self._backend.retrieve(op.capability, model, op.tokens, compact, range(want - base), first)
            )
        except GatewayTimeout:
            raise  # the buffer is left to the garbage collector
        except BaseException:
            self._pool_give(compact)
            raise
        loaded = result.loaded_tokens // self.block
        blocks.scatter(compact, range(op.skip_blocks - base, max(0, min(loaded, upto) - base)), op.block_ids[base:])
        self._pool_give(compact)
        return result

    def forward_begins(self, stores: Sequence[StoreOp] = ()) -> None:
        """bind_connector_metadata, before each forward step: stores' sealing waits for its end, and
        the backend gets ready for the ``stores`` at its end (``Backend.prepare``)."""
        STEPS.forward_begins()
        for cap in {op.capability for op in stores}:
            self._backend.prepare(cap)

    def save(self, stores: Sequence[StoreOp]) -> None:
        """wait_for_save: the forward step has ended (stores may seal until the next), then its stores."""
        try:
            self._save(stores)
        finally:
            STEPS.forward_ends()

    def _save(self, stores: Sequence[StoreOp]) -> None:
        """One step's stores, each cut before the first block whose load failed, its blocks after
        ``skip_tokens`` gathered now into a pooled compact buffer and submitted (sealed and put on
        the backend's loop, not waited for). A store past the in-flight cap waits for room, at
        most ``store_wait_s`` (stores in flight seal meanwhile: the forward has ended); one that
        finds none is dropped, and so is every store past the cap until one fits again."""
        self.finish_loads()  # a store is cut before blocks whose load failed: know them first
        self.in_flight.reap()
        if not stores:
            return
        blocks, model = self._registered()
        pool = self._staging(blocks)
        for op in stores:
            t0 = time.perf_counter()
            cut = self.ledger.store_cut(op)
            if cut < len(op.tokens):  # a load of this request (or of these blocks) failed
                self.stats.count("store", STORE_CUT)
                self._trace("store_cut", req=op.req_id, tokens=len(op.tokens), cut_tokens=cut)
            if op.store_id:  # a hand-off: until its store ends (or none is made), the blocks wait
                self.handoffs.submitted(op.req_id, None)
            if not cut:
                self._trace("store", req=op.req_id, tokens=0, stored_chunks=0, ms=0.0, reason="")
                continue
            skip = min(op.skip_tokens, cut) // self.block
            ids = op.block_ids[skip : cut // self.block]
            if not ids:  # every chunk is stored already: nothing submitted (a store of 0 tokens)
                self._trace("store", req=op.req_id, tokens=0, stored_chunks=0, ms=0.0, reason="")
                continue
            nbytes = pool.nbytes(len(ids))
            if not self._room(nbytes, op.req_id):
                self.stats.count("store", STORE_DROPPED)
                log.debug(
                    "kvgate store for %s dropped: %d bytes in flight, cap %d", op.req_id, self.in_flight.nbytes,
                    self.in_flight.cap_bytes,
                )
                self._trace("store_dropped", req=op.req_id, tokens=cut, in_flight_bytes=self.in_flight.nbytes)
                continue
            buf = pool.take(len(ids), room=self.in_flight.cap_bytes - self.in_flight.nbytes - nbytes)
            try:
                blocks.gather_into(ids, buf)
            except ValueError as exc:  # block ids outside the cache: nothing submitted
                self._pool_give(buf)
                self.stats.count("store", miss_reason(exc))
                log.warning("kvgate store for %s failed: %s", op.req_id, miss_reason(exc))
                continue
            compact = [b[: len(ids)] for b in buf]
            ready = _copied_event(buf[0])
            self._trace(  # before it can end; ``ms``: what this step waited for (cut and gather)
                "store_submit", req=op.req_id, tokens=cut, ms=(time.perf_counter() - t0) * 1e3,
                in_flight=len(self.in_flight) + 1, in_flight_bytes=self.in_flight.nbytes + nbytes,
            )
            # the skipped blocks' slots point into the buffer too: chained into the hashes, never sealed
            slots = [0] * skip + list(range(len(ids)))
            store = self._backend.store(op.capability, model, op.tokens[:cut], compact, slots, skip // self._per_chunk)
            if op.store_id:
                store = durable_store(self._backend, store)
            future = self._backend.loop.submit(self._traced(op.req_id, cut, t0, store, ready))
            self.in_flight.add(future, nbytes, functools.partial(self._store_ended, op.req_id, buf))
            if op.store_id:
                self.handoffs.submitted(op.req_id, future)

    def _room(self, nbytes: int, req_id: str) -> bool:
        """Whether a store of ``nbytes`` fits in flight, after waiting for stores to end (at most
        ``store_wait_s``, and not while congested: the last wait found no room)."""
        if self.in_flight.admit(nbytes):
            self._congested = False
            return True
        if self._congested or self.store_wait_s <= 0:
            return False
        STEPS.forward_ends()  # the stores in flight seal while this step's end waits for them
        t0 = time.perf_counter()
        fits = self.in_flight.wait_for_room(nbytes, self.store_wait_s)
        self._congested = not fits
        self._trace("store_wait", req=req_id, ms=(time.perf_counter() - t0) * 1e3, admitted=fits)
        return fits

    async def _traced(
        self, req_id: str, tokens: int, t0: float, store: Awaitable[StoreResult], ready: Any = None,
    ) -> StoreResult:
        """The store (once the gather's copy has run, on CUDA), and on the loop's thread as it
        ends its trace line (``ms`` from submit; ``gate_wait_ms`` and ``gate_forced``: what store slices
        waited for forward steps, and how many ran at their deadline, while it ran)."""
        stored, reason = 0, ""
        waited, forced = STEPS.waited_s, STEPS.forced  # the gate's, while this store runs
        try:
            if ready is not None:
                await asyncio.to_thread(ready.synchronize)
            result = await store
            stored = result.stored
            return result
        except asyncio.CancelledError:  # by its timeout, or the loop stopping
            reason = "cancelled"
            raise
        except Exception as exc:
            reason = _reason(exc)
            raise
        finally:
            behind = bool(stored) and self._trace.path is not None and self._backend.copies_behind()
            self._trace("store", req=req_id, tokens=tokens, stored_chunks=stored,
                        ms=(time.perf_counter() - t0) * 1e3, reason=reason, copies_behind=behind,
                        gate_wait_ms=round((STEPS.waited_s - waited) * 1e3, 1), gate_forced=STEPS.forced - forced,
                        **self._backend.counters())
            if behind:  # traced only: when the shared tiers (the scheduler's lookups) hold it too
                self._copies.add(task := asyncio.ensure_future(self._copies_traced(req_id, t0)))
                task.add_done_callback(self._copies.discard)

    async def _copies_traced(self, req_id: str, t0: float) -> None:
        await self._backend.copies_written()
        self._trace("store_copies", req=req_id, ms=(time.perf_counter() - t0) * 1e3)

    def _store_ended(self, req_id: str, buf: list[torch.Tensor], future: Future[StoreResult]) -> None:
        """On the engine's thread, at a hook after the store ended: count it, reuse its buffer
        (unless it timed out or was cancelled: a seal job may still read it, see ``inflight``)."""
        result, reason = _outcome(future)
        if reason not in ("gateway_timeout", "cancelled"):
            self._pool_give(buf)
        self.stats.count("store", reason or OK)
        if result is not None:
            self.stats.tokens("stored", result.tokens)
        if reason:
            log.warning("kvgate store for %s failed: %s", req_id, reason)

    def _staging(self, blocks: BlockView) -> StagingPool:
        if self._pool is None:
            self._pool = StagingPool(blocks)
        return self._pool

    def _pool_give(self, buf: list[torch.Tensor]) -> None:
        if self._pool is not None:
            self._pool.give(buf, room=self.in_flight.cap_bytes - self.in_flight.nbytes)

    def wait_stores(self, timeout_s: float) -> bool:
        """Wait (bounded) for the stores in flight; True if none is left (shutdown, tests)."""
        return self.in_flight.wait(timeout_s)

    def take_load_errors(self) -> set[int]:
        self.finish_loads()
        errors, self._load_errors = self._load_errors, set()
        return errors

    def finished(self, req_ids: Iterable[str]) -> None:
        self.finish_loads()
        self.in_flight.reap()
        self.ledger.finished(req_ids)


def _outcome(future: Future[StoreResult]) -> tuple[StoreResult | None, str]:
    """(the store's result, or None and its failure reason) of a store that ended."""
    if future.cancelled():
        return None, "cancelled"
    exc = future.exception()
    return (future.result(), "") if exc is None else (None, _reason(exc))


def _copied_event(buf: torch.Tensor) -> Any:
    """On CUDA, an event recorded after the gather on the engine's stream: the seal runs on other
    threads (other streams) and must not read the buffer before the copy into it has run."""
    if buf.device.type != "cuda":
        return None
    event = torch.cuda.Event()  # type: ignore[no-untyped-call]  # torch leaves the CUDA Event constructor unannotated
    event.record(torch.cuda.current_stream(buf.device))
    return event


def _reason(exc: BaseException) -> str:
    if isinstance(exc, (GatewayError, ValueError)):
        return miss_reason(exc)
    return f"error_{type(exc).__name__}"
