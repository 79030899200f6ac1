"""``KvgateConnector``: a vLLM 0.32 KV connector (KVConnectorBase_V1) on the kvgate core.

Hooks, by side (each side opens what it needs from ``kv_connector_extra_config``; in one process
they share a backend, see ``backend.py``):

    scheduler  get_num_new_matched_tokens   lookup (chunk-aligned prefix, at least one token
                                            left to compute); no capability: 0, no lookup
               update_state_after_alloc     remember the blocks a hit loads into
               build_connector_meta         per request: one load, and one store once the
                                            prompt's full chunks are computed
               request_finished             kv_transfer_params {"kvgate": {hit_tokens}} out
    worker     register_kv_caches           the paged tensors, seen as blocks (``layout.py``)
               start_load_kv                retrieve into a compact buffer, scatter back only
                                            what authenticated; the rest is a load error
               wait_for_layer_load          nothing left to wait for (loads are synchronous)
               save_kv_layer                nothing (the core seals every layer of a chunk at once)
               wait_for_save                gather the request's blocks, store (encrypt, put)
               get_block_ids_with_load_errors  failed blocks; vLLM recomputes them with
                                            ``kv_load_failure_policy: "recompute"``

The tenant comes only from the capability in ``kv_transfer_params["kvgate_capability"]`` (set
by the tenant middleware); a refused capability, a miss, a failed tag or an unreachable gateway
never fails a request: fewer hit tokens, failed blocks, and vLLM computes them itself.
"""

from __future__ import annotations

import json
import logging
import os
import time
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
from kernels.layouts import KVGeometry, KVLayout

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

__all__ = ["CAPABILITY_PARAM", "KvgateConnector", "KvgateMetadata"]

log = logging.getLogger("kvgate.vllm")
CAPABILITY_PARAM = "kvgate_capability"


@dataclass
class _Op:
    req_id: str
    capability: str
    tokens: list[int]  # the tokens to load or store (chunk-aligned)
    block_ids: list[int]
    skip_blocks: int = 0  # load: blocks the engine computed itself, never written


@dataclass
class KvgateMetadata(KVConnectorMetadata):
    loads: list[_Op] = field(default_factory=list)
    stores: list[_Op] = field(default_factory=list)


@dataclass
class _Tracked:
    capability: str
    prompt: list[int]
    store_tokens: int
    block_ids: list[int] = field(default_factory=list)
    hit_tokens: int = 0
    done: bool = False


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
        self._backend: Backend = backend_for(extra)
        self._chunk = self._backend.chunk_tokens
        if self._chunk % self._block_size:
            raise ConnectorConfigError(
                f"chunk_tokens ({self._chunk}) must be a multiple of vLLM's block size ({self._block_size})"
            )
        mc = vllm_config.model_config
        self._model_name = str(extra.get("model_name") or mc.served_model_name or mc.model)
        self._model = self._scheduler_model(vllm_config) if role == KVConnectorRole.SCHEDULER else None
        # scheduler state
        self._tracked: dict[str, _Tracked] = {}
        self._load_plans: dict[str, tuple[int, list[int], int]] = {}
        self._local: dict[str, int] = {}  # locally computed tokens at the last lookup
        # worker state
        self._blocks: BlockView | None = None
        self._load_errors: set[int] = set()

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
        limit = (len(prompt) - 1) // self._chunk * self._chunk  # vLLM must compute one token
        if limit <= num_computed_tokens:
            return 0, False
        assert self._model is not None
        t0 = time.perf_counter()
        try:
            hit = self._backend.call(self._backend.lookup(cap, self._model, prompt[:limit])).hit_tokens
        except (GatewayError, ValueError) as exc:  # refused, expired, unreachable: a miss
            log.info("kvgate lookup for %s: %s", request.request_id, type(exc).__name__)
            hit = 0
        self._trace("lookup", req=request.request_id, hit_tokens=hit, ms=(time.perf_counter() - t0) * 1e3)
        hit -= hit % self._block_size
        self._local[request.request_id] = num_computed_tokens
        return max(0, hit - num_computed_tokens), False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        cap = _capability(request)
        if cap is None:
            return
        prompt = list(request.prompt_token_ids or [])
        tracked = self._tracked.setdefault(
            request.request_id, _Tracked(cap, prompt, len(prompt) // self._chunk * self._chunk)
        )
        local = self._local.pop(request.request_id, 0)
        if num_external_tokens > 0:
            total = local + num_external_tokens
            tracked.hit_tokens = total
            block_ids = list(blocks.get_block_ids()[0])
            self._load_plans[request.request_id] = (total, block_ids, local // self._block_size)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = KvgateMetadata()
        steps: dict[str, int] = {}
        for new in scheduler_output.scheduled_new_reqs:
            tracked = self._tracked.get(new.req_id)
            if tracked is None:
                continue
            tracked.block_ids = list(new.block_ids[0])
            steps[new.req_id] = new.num_computed_tokens
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            tracked = self._tracked.get(req_id)
            if tracked is None:
                continue
            ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                tracked.block_ids = list(ids[0]) if ids else []
            elif ids:
                tracked.block_ids.extend(ids[0])
            steps[req_id] = cached.num_computed_tokens[i]
        for req_id, computed in steps.items():
            tracked = self._tracked[req_id]
            plan = self._load_plans.pop(req_id, None)
            if plan is not None:
                total, block_ids, skip = plan
                meta.loads.append(_Op(req_id, tracked.capability, tracked.prompt[:total], block_ids, skip))
            done = computed + scheduler_output.num_scheduled_tokens.get(req_id, 0)
            if not tracked.done and tracked.store_tokens and done >= tracked.store_tokens:
                tracked.done = True
                if tracked.hit_tokens < tracked.store_tokens:
                    n_blocks = tracked.store_tokens // self._block_size
                    meta.stores.append(
                        _Op(req_id, tracked.capability, tracked.prompt[: tracked.store_tokens], tracked.block_ids[:n_blocks])
                    )
        return meta

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        tracked = self._tracked.pop(request.request_id, None)
        self._load_plans.pop(request.request_id, None)
        self._local.pop(request.request_id, None)
        if tracked is None:
            return False, None
        return False, {"kvgate": {"hit_tokens": tracked.hit_tokens}}

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
        meta = self._connector_metadata
        if not isinstance(meta, KvgateMetadata) or not meta.loads:
            return
        assert self._blocks is not None and self._model is not None
        bs = self._block_size
        for op in meta.loads:
            want = -(-len(op.tokens) // bs)
            t0 = time.perf_counter()
            loaded = failures = 0
            try:
                compact = self._blocks.empty(want)
                result = self._backend.call(
                    self._backend.retrieve(op.capability, self._model, op.tokens, compact, range(want))
                )
                loaded, failures = result.loaded_tokens // bs, result.integrity_failures
                self._blocks.scatter(compact, range(op.skip_blocks, min(loaded, want)), op.block_ids)
            except (GatewayError, ValueError) as exc:
                log.warning("kvgate load for %s failed: %s", op.req_id, type(exc).__name__)
                loaded = 0
            failed = set(op.block_ids[max(loaded, op.skip_blocks) : want])
            self._load_errors |= failed
            self._trace(
                "load", req=op.req_id, tokens=len(op.tokens), loaded_tokens=min(loaded, want) * bs,
                failed_blocks=len(failed), integrity_failures=failures, ms=(time.perf_counter() - t0) * 1e3,
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
            stored = 0
            try:
                compact = self._blocks.gather(op.block_ids)
                result = self._backend.call(
                    self._backend.store(op.capability, self._model, op.tokens, compact, range(len(op.block_ids)))
                )
                stored = result.stored
            except (GatewayError, ValueError) as exc:
                log.warning("kvgate store for %s failed: %s", op.req_id, type(exc).__name__)
            self._trace("store", req=op.req_id, tokens=len(op.tokens), stored_chunks=stored, ms=(time.perf_counter() - t0) * 1e3)

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self) -> None:
        backend, self._backend = self._backend, None  # type: ignore[assignment]
        if backend is not None:
            release(backend)
