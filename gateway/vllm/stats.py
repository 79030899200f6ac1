"""The connector's counters in vLLM's own metrics.

``KvgateConnectorStats`` is the ``KVConnectorStats`` that ``get_kv_connector_stats`` returns on
either side: counts since the last call, summed across workers by vLLM, logged in its periodic
"KV Transfer metrics" line. ``KvgatePromMetrics`` exports them on vLLM's ``/metrics`` as
``vllm:kvgate_connector_events_total{event, outcome}`` and
``vllm:kvgate_connector_tokens_total{kind}`` (per engine, with vLLM's own labels).
``KvgateWorkerMeta`` carries the workers' measured loads of a step to the scheduler side's
``policy.LoadPolicy`` (vLLM's worker metadata, aggregated across workers).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from prometheus_client import Counter
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorWorkerMetadata
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

from gateway.vllm.counters import split_key
from gateway.vllm.policy import LoadSample

if TYPE_CHECKING:
    from vllm.config import VllmConfig

__all__ = ["KvgateConnectorStats", "KvgatePromMetrics", "KvgateWorkerMeta"]


@dataclass
class KvgateWorkerMeta(KVConnectorWorkerMetadata):
    """The loads the workers ran in one step (every worker's, for the same requests)."""

    loads: list[LoadSample]

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KvgateWorkerMeta:
        if isinstance(other, KvgateWorkerMeta):
            self.loads.extend(other.loads)
        return self


@dataclass
class KvgateConnectorStats(KVConnectorStats):
    """``data``: ``{"event/outcome" or "tokens/kind": count}`` since the last interval."""

    def reset(self) -> None:
        self.data: dict[str, Any] = {}

    def aggregate(self, other: KVConnectorStats) -> KvgateConnectorStats:
        for key, n in other.data.items():
            self.data[key] = self.data.get(key, 0) + int(n)
        return self

    def reduce(self) -> dict[str, int | float]:
        return {key: int(n) for key, n in sorted(self.data.items())}

    def is_empty(self) -> bool:
        return not any(self.data.values())


class KvgatePromMetrics(KVConnectorPromMetrics):
    def __init__(
        self, vllm_config: VllmConfig, metric_types: dict[type[Any], type[Any]], labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        counter: type[Counter] = self._counter_cls
        self._events = counter(
            name="vllm:kvgate_connector_events",
            documentation="kvgate connector lookups, loads and stores by outcome (ok, or the reason it fell short)",
            labelnames=[*labelnames, "event", "outcome"],
        )
        self._tokens = counter(
            name="vllm:kvgate_connector_tokens",
            documentation="tokens hit on lookup, loaded and stored by the kvgate connector",
            labelnames=[*labelnames, "kind"],
        )

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        engine = self.per_engine_labelvalues.get(engine_idx, [])
        for key, n in transfer_stats_data.items():
            if not n:
                continue
            head, tail = split_key(key)
            if head == "tokens":
                self._tokens.labels(*engine, tail).inc(n)
            elif tail:
                self._events.labels(*engine, head, tail).inc(n)
