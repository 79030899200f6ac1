"""OpenTelemetry for the server: a trace per request and spans inside the core, metrics exported
in Prometheus format at ``/metrics``.

Attributes never carry chunk contents, raw token ids or tenant names: a tenant appears as a
short keyed hash (``tenant_hash``), enough to correlate, useless to enumerate tenants.
Everything is built per app (``Telemetry(...)``), never at import time, so two apps in one
process (tests) keep separate registries.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Callable, Iterable
from typing import Any

from opentelemetry.exporter.prometheus import PrometheusMetricReader
from opentelemetry.metrics import CallbackOptions, Observation
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from prometheus_client import CollectorRegistry, generate_latest

__all__ = ["Telemetry"]


class Telemetry:
    def __init__(self, *, service_name: str = "kvgate") -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        resource = Resource.create({"service.name": service_name})
        self._reader = PrometheusMetricReader()
        # The reader registers a collector with prometheus_client's global registry; move it to ours.
        from prometheus_client import REGISTRY

        collector = self._collector = getattr(self._reader, "_collector", None)
        if collector is not None:
            try:
                REGISTRY.unregister(collector)
            except KeyError:
                pass
            self.registry.register(collector)
        self.meter_provider = MeterProvider(resource=resource, metric_readers=[self._reader], shutdown_on_exit=False)
        self.tracer_provider = TracerProvider(resource=resource)
        self.tracer = self.tracer_provider.get_tracer("kvgate")
        meter = self.meter_provider.get_meter("kvgate")
        self.requests = meter.create_counter("kvgate_http_requests", description="HTTP requests by route and status")
        buckets = [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0]
        self.latency = meter.create_histogram(
            "kvgate_http_request_duration", unit="s", description="HTTP request latency",
            explicit_bucket_boundaries_advisory=buckets,
        )
        self.auth_denials = meter.create_counter("kvgate_auth_denials", description="authentication and authorization denials")
        self.op_latency = meter.create_histogram(
            "kvgate_operation_duration", unit="s", description="core operation latency",
            explicit_bucket_boundaries_advisory=buckets,
        )
        self.bytes = meter.create_counter("kvgate_chunk_bytes", unit="By", description="chunk bytes in and out by tier")
        self._label_key = os.urandom(16)
        self._gauges: list[Any] = []
        self.meter = meter

    def tenant_hash(self, tenant: str | None) -> str:
        if not tenant:
            return "-"
        return hmac.new(self._label_key, tenant.encode(), hashlib.sha256).hexdigest()[:12]

    def observe(
        self, name: str, description: str, fn: Callable[[], Iterable[tuple[float, dict[str, str]]]],
        *, monotonic: bool = False,
    ) -> None:
        """An instrument whose values come from ``fn`` at scrape time: a counter (``_total`` in
        Prometheus, so ``rate()`` applies) where the value only grows, else a gauge."""

        def callback(_options: CallbackOptions) -> Iterable[Observation]:
            return [Observation(value, attrs) for value, attrs in fn()]

        create = self.meter.create_observable_counter if monotonic else self.meter.create_observable_gauge
        self._gauges.append(create(name, callbacks=[callback], description=description))

    def scrape(self) -> bytes:
        return generate_latest(self.registry)

    def shutdown(self) -> None:
        from prometheus_client import REGISTRY

        if self._collector is not None:  # the reader unregisters it from the global registry
            self.registry.unregister(self._collector)
            REGISTRY.register(self._collector)
        self.meter_provider.shutdown()
        self.tracer_provider.shutdown()
