"""``KvgateConnector``: a vLLM 0.32 KV connector (KVConnectorBase_V1) on the kvgate core.

Hooks, by side (each side opens what it needs from ``kv_connector_extra_config``; in one process
they share a backend, see ``backend.py``). The bookkeeping of both sides lives in ``ledger.py``
(no vLLM needed there, unit-tested on its own); this module adapts vLLM's types to it and does
the I/O:

    scheduler  get_num_new_matched_tokens   lookup (chunk-aligned prefix, at least one token
                                            left to compute); no capability: 0, no lookup
               update_state_after_alloc     remember the blocks a hit loads into
               build_connector_meta         per request: one load, and one store once the
                                            prompt's full chunks are computed
               update_connector_output      blocks whose load failed: their requests never
                                            store them, nor anything after them
               request_finished             kv_transfer_params {"kvgate": {hit_tokens}} out
    worker     register_kv_caches           the paged tensors, seen as blocks (``layout.py``)
               start_load_kv                retrieve into a compact buffer, scatter back only
                                            what authenticated; the rest is a load error,
                                            logged at WARNING with its reason and counted
               wait_for_layer_load          nothing left to wait for (loads are synchronous)
               save_kv_layer                nothing (the core seals every layer of a chunk at once)
               wait_for_save                gather the request's blocks, store (encrypt, put),
                                            cut before any block whose load failed
               get_block_ids_with_load_errors  failed blocks; vLLM recomputes them with
                                            ``kv_load_failure_policy: "recompute"``
               get_finished                 forget finished requests' failed-load marks

A chunk is stored only from KV the engine computed or kvgate authenticated for that request
(DESIGN section 2, rule 9): never from blocks whose load failed or was partial, nor from blocks
computed over them in the same step (``ledger.py`` says why that matters and where it is cut).

The tenant comes only from the capability in ``kv_transfer_params["kvgate_capability"]`` (set
by the tenant middleware); a refused capability, a miss, a failed tag or an unreachable gateway
never fails a request: fewer hit tokens, failed blocks, and vLLM computes them itself.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from gateway.core import KVModel
from gateway.errors import GatewayError
from gateway.vllm.backend import Backend, backend_for, release
from gateway.vllm.errors import ConnectorConfigError
from gateway.vllm.layout import BlockView
from gateway.vllm.ledger import LoadOp, SchedulerLedger, StepRequest, StoreOp, WorkerLedger
from gateway.vllm.logs import RateLimitedLogger, ensure_visible_logging, miss_reason
from kernels.layouts import KVGeometry, KVLayout

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = ["CAPABILITY_PARAM", "KvgateConnector", "KvgateMetadata"]

log = logging.getLogger("kvgate.vllm")
_LOOKUP_LOG = RateLimitedLogger(log, interval_s=10.0)  # an outage degrades every lookup: say so, not each
CAPABILITY_PARAM = "kvgate_capability"


@dataclass
class KvgateMetadata(KVConnectorMetadata):
    loads: list[LoadOp] = field(default_factory=list)
    stores: list[StoreOp] = field(default_factory=list)


def _capability(request: Request) -> str | None:
    params = getattr(request, "kv_transfer_params", None) or {}
    cap = params.get(CAPABILITY_PARAM) if isinstance(params, dict) else None
    return cap if isinstance(cap, str) and 0 < len(cap) <= 8192 else None


class KvgateConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        self._block_size = vllm_config.cache_config.block_size
        self._layout = str(extra.get("layout", "auto"))
        self._trace_path = extra.get("trace_path")
        ensure_visible_logging()
        self._backend: Backend = backend_for(extra)
        self._chunk = self._backend.chunk_tokens
        if self._chunk % self._block_size:
            raise ConnectorConfigError(
                f"chunk_tokens ({self._chunk}) must be a multiple of vLLM's block size ({self._block_size})"
            )
        mc = vllm_config.model_config
        self._model_name = str(extra.get("model_name") or mc.served_model_name or mc.model)
        self._model = self._scheduler_model(vllm_config) if role == KVConnectorRole.SCHEDULER else None
        self.stats: Counter[str] = Counter()  # miss and failure reasons, loads and stores
        self._sched = SchedulerLedger(self._chunk, self._block_size)
        self._work = WorkerLedger(self._chunk, self._block_size)
        self._blocks: BlockView | None = None
        self._load_errors: set[int] = set()
        self._mismatch_said = False

    # -- identity -----------------------------------------------------------------------------
    def _scheduler_model(self, cfg: VllmConfig) -> KVModel:
        from vllm.utils.torch_utils import kv_cache_dtype_str_to_dtype

        mc, pc = cfg.model_config, cfg.parallel_config
        geometry = KVGeometry(
            num_layers=mc.get_num_layers(pc), num_kv_heads=mc.get_num_kv_heads(pc), head_size=mc.get_head_size(),
            dtype=kv_cache_dtype_str_to_dtype(cfg.cache_config.cache_dtype, mc), block_size=self._block_size,
            layout=KVLayout.BLOCK_FIRST,
        )
        return KVModel(self._model_name, geometry, tp_rank=0, tp_size=pc.tensor_parallel_size)

    def _trace(self, event: str, **fields: Any) -> None:
        if not self._trace_path:
            return
        line = json.dumps({"event": event, "t": time.time(), "pid": os.getpid(), **fields})
        with open(self._trace_path, "a", encoding="utf-8") as f:
            f.write(line + "\n")

    # -- scheduler side -----------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        cap = _capability(request)
        prompt = list(request.prompt_token_ids or [])
        if cap is None or not prompt:
            return 0, False
        limit = self._sched.lookup_limit(len(prompt))
        if limit <= num_computed_tokens:
            return 0, False
        assert self._model is not None
        t0 = time.perf_counter()
        reason = ""
        try:
            result = self._backend.call(self._backend.lookup(cap, self._model, prompt[:limit]))
            hit, reason = result.hit_tokens, result.degraded
        except (GatewayError, ValueError) as exc:  # refused, expired, unreachable: a miss
            hit, reason = 0, miss_reason(exc)
            self._state_mismatch(exc)
        if reason:
            self.stats[f"lookup_{reason}"] += 1
            _LOOKUP_LOG.warning("kvgate lookup for %s degraded to %d hit tokens: %s", request.request_id, hit, reason)
        self._trace("lookup", req=request.request_id, hit_tokens=hit, reason=reason, ms=(time.perf_counter() - t0) * 1e3)
        hit -= hit % self._block_size
        self._sched.looked_up(request.request_id, num_computed_tokens)
        return max(0, hit - num_computed_tokens), False

    def _state_mismatch(self, exc: BaseException) -> None:
        """A capability whose MAC does not verify here was minted against other kvgate state:
        say so once, loudly, with the fix (every request of that deployment is a miss)."""
        if self._mismatch_said or getattr(exc, "reason", None) not in ("bad tag", "bad key id"):
            return
        self._mismatch_said = True
        log.error(
            "kvgate: a capability from this engine's requests does not verify against the connector's "
            "kvgate state, so every request is a miss. The connector (embedded mode) and whoever mints "
            "capabilities (the middleware or `kvgate serve`) must share one database and state directory "
            "(KVGATE_DATABASE_URL, KVGATE_STATE_DIR), or use remote mode."
        )

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        cap = _capability(request)
        if cap is None:
            return
        block_ids = list(blocks.get_block_ids()[0]) if num_external_tokens > 0 else []
        self._sched.allocated(request.request_id, cap, list(request.prompt_token_ids or []), block_ids, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        n_sched = scheduler_output.num_scheduled_tokens
        step = [
            StepRequest(new.req_id, new.num_computed_tokens, n_sched.get(new.req_id, 0), list(new.block_ids[0]), new=True)
            for new in scheduler_output.scheduled_new_reqs
            if self._sched.tracked(new.req_id)
        ]
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            if not self._sched.tracked(req_id):
                continue
            ids = cached.new_block_ids[i]
            step.append(StepRequest(
                req_id, cached.num_computed_tokens[i], n_sched.get(req_id, 0), list(ids[0]) if ids else [],
                resumed=req_id in cached.resumed_req_ids,
            ))
        loads, stores = self._sched.build(step)
        return KvgateMetadata(loads=loads, stores=stores)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """vLLM's report of the step: blocks whose load failed keep their requests from storing
        them (and anything after them) at any later step; see ``ledger.py``."""
        hit = self._sched.load_errors(connector_output.invalid_block_ids or ())
        if hit:
            self._trace("load_errors_reported", reqs=sorted(hit), blocks=len(connector_output.invalid_block_ids))

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        hit = self._sched.finished(request.request_id)
        return (False, None) if hit is None else (False, {"kvgate": {"hit_tokens": hit}})

    # -- worker side --------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        self._blocks = BlockView.of(kv_caches, self._block_size, self._layout)
        pc = self._vllm_config.parallel_config
        self._model = KVModel(
            self._model_name, self._blocks.geometry, tp_rank=get_tensor_model_parallel_rank(),
            tp_size=pc.tensor_parallel_size,
        )

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self._work.new_step()
        meta = self._connector_metadata
        if not isinstance(meta, KvgateMetadata) or not meta.loads:
            return
        assert self._blocks is not None and self._model is not None
        bs = self._block_size
        for op in meta.loads:
            want = -(-len(op.tokens) // bs)
            t0 = time.perf_counter()
            loaded = failures = 0
            reason = ""
            try:
                compact = self._blocks.empty(want)
                result = self._backend.call(
                    self._backend.retrieve(op.capability, self._model, op.tokens, compact, range(want))
                )
                loaded, failures, reason = result.loaded_tokens // bs, result.integrity_failures, result.reason
                self._blocks.scatter(compact, range(op.skip_blocks, min(loaded, want)), op.block_ids)
            except (GatewayError, ValueError) as exc:
                loaded, reason = 0, miss_reason(exc)
            first_failed = max(loaded, op.skip_blocks)
            failed = self._work.load_failed(op.req_id, op.block_ids, first_failed, want)
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

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return None

    def wait_for_save(self) -> None:
        meta = self._connector_metadata
        if not isinstance(meta, KvgateMetadata) or not meta.stores:
            return
        assert self._blocks is not None and self._model is not None
        for op in meta.stores:
            t0 = time.perf_counter()
            cut = self._work.store_cut(op)
            stored = 0
            if cut < len(op.tokens):  # a load of this request (or of these blocks) failed
                self.stats["store_cut_after_failed_load"] += 1
                self._trace("store_cut", req=op.req_id, tokens=len(op.tokens), cut_tokens=cut)
            if cut:
                blocks = op.block_ids[: cut // self._block_size]
                try:
                    compact = self._blocks.gather(blocks)
                    result = self._backend.call(
                        self._backend.store(op.capability, self._model, op.tokens[:cut], compact, range(len(blocks)))
                    )
                    stored = result.stored
                except (GatewayError, ValueError) as exc:
                    self.stats[f"store_{miss_reason(exc)}"] += 1
                    log.warning("kvgate store for %s failed: %s", op.req_id, miss_reason(exc))
            self._trace("store", req=op.req_id, tokens=cut, stored_chunks=stored, ms=(time.perf_counter() - t0) * 1e3)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        self._work.finished(finished_req_ids)
        return None, None

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self) -> None:
        backend, self._backend = self._backend, None  # type: ignore[assignment]
        if backend is not None:
            release(backend)
