"""``KvgateConnector``: a vLLM 0.32 KV connector (KVConnectorBase_V1) on the kvgate core.

A thin shell: it reads ``kv_connector_extra_config`` (``config.ConnectorConfig``), opens the process's
backend (``backend.SHARED.acquire``) and hands every hook to the side vLLM built it for:
``scheduler.SchedulerSide`` (lookups, load and store plans, failed-load bookkeeping) or
``worker.WorkerSide`` (the KV cache, loads, stores, load errors); stats and ``shutdown`` go to both,
worker metadata carries the step's measured loads to the load policy (``policy.py``), and every other hook
keeps vLLM's default. A chunk is stored only from KV the engine computed or kvgate authenticated for that
request (docs/architecture.md, section 1; ``ledger.py``), read from its own copy gathered before
``wait_for_save`` returns, so a finished or preempted request's blocks are freed at once. The tenant comes
only from ``kv_transfer_params["kvgate_capability"]``; a refused capability, a miss, a failed tag or an
unreachable gateway never fails a request: fewer hit tokens or failed blocks, which vLLM computes. Roles
follow ``kv_role`` (``handoff.py``): a kv_producer's finished request returns a receipt and keeps its
blocks until its store is durable; a kv_consumer given a receipt waits for it, bounded, without holding up
other requests. A published prefix's warm-up (the scope's write capability and ``kvgate_warm_up``) has
its whole chunks reported to the server, for every tensor-parallel rank, before it is stored. Each hook, and why stores copy: docs/architecture.md, section 5."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from gateway.datapath.gate import STEPS
from gateway.vllm.backend import SHARED, Backend
from gateway.vllm.config import ConnectorConfig
from gateway.vllm.counters import ConnectorCounters
from gateway.vllm.errors import ConnectorConfigError
from gateway.vllm.handoff import HandoffWaits, audit_refused_receipt, roles, submit_lookup
from gateway.vllm.ledger import LoadOp, StoreOp
from gateway.vllm.logs import Tracer, ensure_visible_logging
from gateway.vllm.policy import LoadPolicy, LoadTimings, step_work
from gateway.vllm.scheduler import (
    CAPABILITY_PARAM,
    SchedulerSide,
    request_view,
    step_requests,
)
from gateway.vllm.stats import KvgateConnectorStats, KvgatePromMetrics, KvgateWorkerMeta
from gateway.vllm.worker import WorkerSide

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

    from gateway.types import KVModel

__all__ = ["CAPABILITY_PARAM", "KvgateConnector", "KvgateMetadata"]


@dataclass
class KvgateMetadata(KVConnectorMetadata):
    loads: list[LoadOp] = field(default_factory=list)
    stores: list[StoreOp] = field(default_factory=list)
    forward: bool = True  # False: a step with nothing scheduled, which vLLM runs without a forward


def _scheduler_model(cfg: VllmConfig, name: str, block_size: int, layout: str) -> KVModel:
    """The model identity the scheduler looks up under. The workers derive theirs from their
    registered caches (``register_kv_caches`` checks they agree): the chunk format of a CPU
    engine's caches (vLLM's CPU layout, kept as it is) or of a GPU engine's (any of its layouts,
    one format whatever the block size)."""
    from vllm.platforms import current_platform
    from vllm.utils.torch_utils import kv_cache_dtype_str_to_dtype

    from gateway.types import KVModel
    from kernels.layouts import KVGeometry, KVLayout

    mc, pc = cfg.model_config, cfg.parallel_config
    cpu = layout == "cpu" or (layout == "auto" and current_platform.is_cpu())
    geometry = KVGeometry(
        num_layers=mc.get_num_layers(pc), num_kv_heads=mc.get_num_kv_heads(pc), head_size=mc.get_head_size(),
        dtype=kv_cache_dtype_str_to_dtype(cfg.cache_config.cache_dtype, mc), block_size=block_size,
        layout=KVLayout.CPU if cpu else KVLayout.BLOCK_FIRST,
    )
    return KVModel(name, geometry, tp_rank=0, tp_size=pc.tensor_parallel_size)


def _rank_models(model: KVModel) -> list[KVModel]:
    """The model identity of each tensor-parallel rank: each stores its chunks under its own
    fingerprint, so a warm-up reports the prefix for every rank."""
    return [dataclasses.replace(model, tp_rank=r) for r in range(model.tp_size)]


def _whole_chunks(model: KVModel, tokens: Sequence[int], chunk: int) -> list[str]:
    """The chained hashes (hex) of the whole chunks of ``tokens`` under ``model``."""
    from gateway.chunking import chain_hashes

    whole = len(tokens) - len(tokens) % chunk
    return [c.chained_hash.hex() for c in chain_hashes(list(tokens[:whole]), model.fingerprint, chunk)] if whole else []


class KvgateConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        kv_role = self._kv_transfer_config.kv_role
        config = ConnectorConfig.from_extra(self._kv_transfer_config.kv_connector_extra_config).for_role(kv_role)
        block_size = vllm_config.cache_config.block_size
        ensure_visible_logging()
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        self._drain_s = config.timeout_s
        self._backend: Backend | None = SHARED.acquire(config)
        chunk = self._backend.chunk_tokens
        if chunk % block_size:
            self.shutdown()
            raise ConnectorConfigError(f"chunk_tokens ({chunk}) must be a multiple of vLLM's block size ({block_size})")
        mc = vllm_config.model_config
        model_name = str(config.model_name or mc.served_model_name or mc.model)
        self.stats = ConnectorCounters()  # this side's lookups, loads and stores by outcome
        trace = Tracer(config.trace_path) if role == KVConnectorRole.SCHEDULER else LoadTimings(config.trace_path)
        self._load_timings = trace if isinstance(trace, LoadTimings) else None
        self._expected = _scheduler_model(vllm_config, model_name, block_size, config.layout)
        if role == KVConnectorRole.SCHEDULER:
            model = self._expected
            backend = self._backend

            def lookup(cap: str, tokens: Sequence[int]) -> tuple[int, str]:
                result = backend.loop.call(backend.lookup(cap, model, tokens))
                return result.hit_tokens, result.degraded

            def report(cap: str, prefix_id: str, tokens: Sequence[int]) -> int:
                return sum(
                    backend.loop.call(backend.report_warm(cap, prefix_id, m.fingerprint_digest, _whole_chunks(m, tokens, chunk)))
                    for m in _rank_models(model)
                )

            policy = LoadPolicy(config.load_policy, chunk, path=config.mode)
            loads, stores = roles(kv_role, producer_loads=config.producer_loads, consumer_stores=config.consumer_stores)
            self._scheduler = SchedulerSide(
                chunk, block_size, lookup, stats=self.stats, trace=trace, policy=policy, loads=loads, stores=stores,
                receipts=kv_role == "kv_producer", deny=functools.partial(audit_refused_receipt, backend), report=report,
                handoff=HandoffWaits(
                    functools.partial(submit_lookup, backend, model), config.handoff_wait_s, config.handoff_poll_s,
                ) if loads else None,
            )
        else:
            self._worker = WorkerSide(
                self._backend, chunk, block_size, model_name, layout=config.layout, stats=self.stats, trace=trace,
                max_in_flight_bytes=config.store_in_flight_bytes, layerwise=config.layerwise_loads,
                store_finish_s=config.store_finish_s, store_wait_s=config.store_wait_s,
            )

    @property
    def scheduler(self) -> SchedulerSide:
        if self._scheduler is None:
            raise RuntimeError("a scheduler-side hook was called on a worker-side kvgate connector")
        return self._scheduler

    @property
    def worker(self) -> WorkerSide:
        if self._worker is None:
            raise RuntimeError("a worker-side hook was called on a scheduler-side kvgate connector")
        return self._worker

    def _metadata(self) -> KvgateMetadata:
        meta = self._connector_metadata
        return meta if isinstance(meta, KvgateMetadata) else KvgateMetadata()

    # -- scheduler side -----------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self.scheduler.matched_tokens(request_view(request), num_computed_tokens), False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        view = request_view(request)
        if view.capability is None:
            return
        block_ids = list(blocks.get_block_ids()[0]) if num_external_tokens > 0 else []
        self.scheduler.allocated(view, block_ids, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        side = self.scheduler
        loads, stores = side.build(step_requests(scheduler_output, side.tracked))
        side.policy.step_built(step_work(scheduler_output, loads=bool(loads)))
        return KvgateMetadata(loads=loads, stores=stores, forward=scheduler_output.total_num_scheduled_tokens > 0)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self.scheduler.load_errors(connector_output.invalid_block_ids or ())
        meta = connector_output.kv_connector_worker_meta
        self.scheduler.policy.step_ended(meta.loads if isinstance(meta, KvgateWorkerMeta) else ())

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler.finish(request.request_id, getattr(request, "kv_transfer_params", None))

    # -- worker side --------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        pc = self._vllm_config.parallel_config
        self.worker.register(kv_caches, get_tensor_model_parallel_rank(), pc.tensor_parallel_size)
        have, want = self.worker.model, self._expected
        if have is not None and have.geometry.chunk_format != want.geometry.chunk_format:
            raise ConnectorConfigError(
                f"the KV caches vLLM registered hold chunks in format {have.geometry.chunk_format!r}, but the "
                f"scheduler looks them up in {want.geometry.chunk_format!r}: set kv_connector_extra_config.layout "
                "to the caches' layout (cpu, kv_first or block_first)"
            )

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if getattr(connector_metadata, "forward", True):
            stores = getattr(connector_metadata, "stores", [])
            self.worker.forward_begins(stores)  # before every forward step (start_load_kv may come after it)
        else:  # vLLM steps without pause while nothing is scheduled: the engine is idle, stores run
            STEPS.idle()

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self.worker.load(self._metadata().loads)

    def wait_for_layer_load(self, layer_name: str) -> None:
        self.worker.wait_for_layer(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return None

    def wait_for_save(self) -> None:
        self.worker.save(self._metadata().stores)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        self.worker.finished(finished_req_ids)
        sent = self.worker.handoffs.durable(finished_req_ids)  # a producer's blocks, freed now
        return sent or None, None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.take_load_errors()

    def build_connector_worker_meta(self) -> KvgateWorkerMeta | None:
        loads = self._load_timings.take() if self._load_timings is not None else []
        return KvgateWorkerMeta(loads=loads) if loads else None

    # -- both ---------------------------------------------------------------------------------
    def get_kv_connector_stats(self) -> KvgateConnectorStats | None:
        data = self.stats.take()
        return KvgateConnectorStats(data=data) if data else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KvgateConnectorStats:
        return KvgateConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls, vllm_config: VllmConfig, metric_types: dict[type[Any], type[Any]], labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KvgatePromMetrics:
        return KvgatePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self._worker is not None and self._backend is not None:
            self._worker.finish_loads()
            self._worker.wait_stores(self._drain_s)  # bounded: a store has this timeout too
        backend, self._backend = self._backend, None
        if backend is not None:
            SHARED.release(backend)
