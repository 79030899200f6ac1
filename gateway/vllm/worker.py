"""The connector's worker side: the KV cache, loads, stores, load errors.

    register(kv_caches, tp_rank, tp_size)   register_kv_caches: the paged tensors, seen as blocks
                                            (``kernels.layouts.BlockView``), and the model identity
    load(loads)                             start_load_kv: retrieve into a compact buffer, scatter
                                            back only what authenticated; the rest is a load
                                            error, logged at WARNING with its reason and counted
    save(stores)                            wait_for_save: gather the request's blocks, store
                                            (encrypt, put), cut before any block whose load failed
    take_load_errors()                      get_block_ids_with_load_errors: failed blocks (vLLM
                                            recomputes them with kv_load_failure_policy "recompute")
    finished(req_ids)                       get_finished: forget finished requests' failure marks

Loads and stores are synchronous on the backend's loop thread (``backend.LoopThread``); where a
failed load cuts a store is ``ledger.WorkerLedger``'s rule.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence

import torch

from gateway.errors import GatewayError
from gateway.types import KVModel
from gateway.vllm.backend import Backend
from gateway.vllm.errors import ConnectorConfigError
from gateway.vllm.ledger import LoadOp, StoreOp, WorkerLedger
from gateway.vllm.logs import Tracer, miss_reason
from kernels.errors import KVLayoutError
from kernels.layouts import BlockView

__all__ = ["WorkerSide"]

log = logging.getLogger("kvgate.vllm")


class WorkerSide:
    def __init__(
        self, backend: Backend, chunk_tokens: int, block_size: int, model_name: str, *, layout: str = "auto",
        stats: Counter[str] | None = None, trace: Tracer | None = None,
    ) -> None:
        self._backend = backend
        self.block = block_size
        self._model_name = model_name
        self._layout = layout
        self.stats: Counter[str] = Counter() if stats is None else stats
        self._trace = trace or Tracer(None)
        self.ledger = WorkerLedger(chunk_tokens, block_size)
        self.blocks: BlockView | None = None
        self.model: KVModel | None = None
        self._load_errors: set[int] = set()

    def register(self, kv_caches: Mapping[str, torch.Tensor], tp_rank: int = 0, tp_size: int = 1) -> None:
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
        self.ledger.new_step()
        if not loads:
            return
        blocks, model = self._registered()
        bs = self.block
        for op in loads:
            want = -(-len(op.tokens) // bs)
            t0 = time.perf_counter()
            loaded = failures = 0
            reason = ""
            try:
                compact = blocks.empty(want)
                result = self._backend.loop.call(self._backend.retrieve(op.capability, model, op.tokens, compact, range(want)))
                loaded, failures, reason = result.loaded_tokens // bs, result.integrity_failures, result.reason
                blocks.scatter(compact, range(op.skip_blocks, min(loaded, want)), op.block_ids)
            except (GatewayError, ValueError) as exc:
                loaded, reason = 0, miss_reason(exc)
            first_failed = max(loaded, op.skip_blocks)
            failed = self.ledger.load_failed(op.req_id, op.block_ids, first_failed, want)
            self._load_errors |= failed
            if failed:
                reason = reason or "miss"
                self.stats[f"load_{reason}"] += 1
                log.warning(
                    "kvgate load for %s: %d of %d tokens loaded (%s); vLLM recomputes %d blocks, none of them "
                    "is stored by this request", op.req_id, min(loaded, want) * bs, want * bs, reason, len(failed),
                )
            self._trace(
                "load", req=op.req_id, tokens=len(op.tokens), loaded_tokens=min(loaded, want) * bs,
                failed_blocks=len(failed), integrity_failures=failures, reason=reason if failed else "",
                ms=(time.perf_counter() - t0) * 1e3,
            )

    def save(self, stores: Sequence[StoreOp]) -> None:
        """One step's stores, each cut before the first block whose load failed."""
        if not stores:
            return
        blocks, model = self._registered()
        for op in stores:
            t0 = time.perf_counter()
            cut = self.ledger.store_cut(op)
            stored = 0
            if cut < len(op.tokens):  # a load of this request (or of these blocks) failed
                self.stats["store_cut_after_failed_load"] += 1
                self._trace("store_cut", req=op.req_id, tokens=len(op.tokens), cut_tokens=cut)
            if cut:
                ids = op.block_ids[: cut // self.block]
                try:
                    compact = blocks.gather(ids)
                    result = self._backend.loop.call(
                        self._backend.store(op.capability, model, op.tokens[:cut], compact, range(len(ids)))
                    )
                    stored = result.stored
                except (GatewayError, ValueError) as exc:
                    self.stats[f"store_{miss_reason(exc)}"] += 1
                    log.warning("kvgate store for %s failed: %s", op.req_id, miss_reason(exc))
            self._trace("store", req=op.req_id, tokens=cut, stored_chunks=stored, ms=(time.perf_counter() - t0) * 1e3)

    def take_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def finished(self, req_ids: Iterable[str]) -> None:
        self.ledger.finished(req_ids)
