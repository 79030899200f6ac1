"""The kvgate server: ``create_app(settings)`` builds a FastAPI app whose resources (the gateway
runtime, the OIDC verifier, telemetry) live in the lifespan; nothing happens at import time.

``kvgate serve`` runs it under uvicorn; on shutdown uvicorn drains requests in flight, then the
lifespan closes the runtime, which flushes the audit queue. CORS is off (no middleware added).
"""

from __future__ import annotations

import contextlib
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterable
from typing import TYPE_CHECKING, Annotated, Any

from fastapi import Depends, FastAPI, Response
from fastapi.responses import JSONResponse
from starlette.routing import Route

from gateway.chunks.envelopes import EnvelopePlane
from gateway.config import Settings
from gateway.metrics import ByLabel
from gateway.server import admin_routes, data, rawlookup
from gateway.server.bodylimits import BodyLimits
from gateway.server.deps import Authorize, Scope, ServerState, StateDep, on_every_tenant
from gateway.server.gatekeeper import HEAD_REFUSALS, Gatekeeper
from gateway.server.problems import install_problem_handlers, problem, problem_responses
from gateway.server.shm import Regions
from gateway.server.telemetry import Telemetry
from gateway.services.runtime import open_runtime
from storage.base import Tier
from storage.manager import TierManager
from tenancy.oidc import IssuerConfig, OidcVerifier
from tenancy.roles import Action

if TYPE_CHECKING:
    from tenancy.devissuer import DevIssuer

__all__ = ["create_app", "DEV_ISSUER_PATH"]

DEV_ISSUER_PATH = "/dev-issuer"
# /metrics spans every tenant: an operator's action on ``*``.
OperatorScope = Annotated[Scope, Depends(Authorize(Action.MANAGE_TENANTS, on=on_every_tenant))]


def _issuers(settings: Settings, dev: DevIssuer | None) -> list[IssuerConfig]:
    out = [
        IssuerConfig(
            issuer=i.issuer, audience=i.audience, tenant_claim=i.tenant_claim, roles_claim=i.roles_claim,
            algorithms=frozenset(i.algorithms), required_typ=i.required_typ, jwks_lifespan=i.jwks_lifespan_s,
            refetch_cooldown=i.refetch_cooldown_s, leeway=i.leeway_s,
            allow_http=settings.mode == "development",
        )
        for i in settings.issuers
    ]
    if dev is not None:
        out.append(dev.issuer_config(allow_http=True))
    return out


def dev_issuer_for(settings: Settings) -> DevIssuer:
    """The development issuer (development mode only; it refuses production itself)."""
    from tenancy.devissuer import DevIssuer

    return DevIssuer(
        settings.state_dir, issuer_url=settings.public_url.rstrip("/") + DEV_ISSUER_PATH,
        production=settings.mode == "production",
    )


def _no_native_telemetry() -> dict[str, Any]:
    """FastAPI >= 0.16x traces every request itself once a global tracer provider is set (the
    lifespan sets one): a second request span beside ``_Observe``'s, and a span per dependency,
    endpoint and serialization, about 0.2 ms of a 1 ms lookup on a 2-core box. ``_Observe`` and
    the core's spans are kvgate's telemetry; FastAPI's own is turned off where it exists."""
    import inspect

    if "telemetry" in inspect.signature(FastAPI.__init__).parameters:
        return {"telemetry": {"tracing": False, "metrics": False, "logs": False, "operation_spans": False}}
    return {}


def create_app(settings: Settings) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[dict[str, Any]]:
        telemetry = Telemetry()
        from opentelemetry import trace

        if isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider):  # settable once per process
            trace.set_tracer_provider(telemetry.tracer_provider)
        runtime = await open_runtime(settings)
        try:
            dev = dev_issuer_for(settings) if settings.dev_issuer else None
            verifier = OidcVerifier(_issuers(settings, dev))
            plane = EnvelopePlane(  # the chunk routes' data plane, over the runtime's services
                keyring=runtime.keyring, pins=runtime.pins, audit=runtime.audit, chunks=runtime.chunks,
                max_chunk_bytes=settings.max_chunk_bytes,
            )
            state = ServerState(settings, runtime, plane, verifier, telemetry, dev, regions=Regions(settings.shm_max_bytes, populate=settings.shm_populate))
            _observe(state)
            refused: Counter[int] = Counter()  # request heads the server's protocol refused (gatekeeper)
            telemetry.observe(
                "kvgate_http_heads_refused", "request heads refused before any route (400, 408, 431, 501), by status",
                lambda: [(n, {"status": str(k)}) for k, n in sorted(refused.items())] or [(0, {"status": "400"})],
                monotonic=True,
            )
            app.state.kvgate = state
            yield {HEAD_REFUSALS: refused}
        finally:
            with contextlib.suppress(Exception):
                await app.state.kvgate.verifier.aclose()
            with contextlib.suppress(Exception):
                app.state.kvgate.regions.close()
            await runtime.aclose()
            telemetry.shutdown()

    app = FastAPI(
        title="kvgate", version="0.1.0", lifespan=lifespan,
        description="A secure, multi-tenant KV-cache gateway: capabilities, chunk data plane, admin API.",
        **_no_native_telemetry(),
    )
    install_problem_handlers(app)
    if settings.raw_paths:  # ahead of data.lookup, its description, so the router finds it first
        app.router.routes.append(Route(rawlookup.PATH, rawlookup.RawLookup(), methods=["POST"], include_in_schema=False))
    app.include_router(data.router)
    app.include_router(admin_routes.router)

    # before anything reads the body (inside the telemetry middleware, so refusals are counted)
    limits = BodyLimits([*data.router.routes, *admin_routes.router.routes], settings)
    app.add_middleware(Gatekeeper, settings=settings, limits=limits)

    app.add_middleware(_Observe)  # outermost: every request is counted, refusals included

    @app.get("/healthz", include_in_schema=True)
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz", responses={503: {"description": "a dependency is unavailable"}})
    async def readyz(state: StateDep) -> JSONResponse:
        checks: dict[str, str] = {}
        try:
            await state.runtime.registry.ping()
            checks["database"] = "ok"
        except Exception:
            checks["database"] = "unavailable"
        for tier in state.runtime.tiers.tiers:
            if tier.name == "redis":
                ok = getattr(getattr(tier, "breaker", None), "state", "closed") != "open"
                checks["redis"] = "ok" if ok else "unavailable"
        ready = all(v == "ok" for v in checks.values())
        return JSONResponse({"ready": ready, "checks": checks}, status_code=200 if ready else 503)

    @app.get(
        "/metrics", response_class=Response,
        responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}}}, **problem_responses(401, 403, 429)},
    )
    async def metrics(_: OperatorScope, state: StateDep) -> Response:
        """Prometheus text format. Needs an operator token (it spans every tenant)."""
        return Response(state.telemetry.scrape(), media_type="text/plain; version=0.0.4")

    @app.get(DEV_ISSUER_PATH + "/.well-known/openid-configuration", include_in_schema=False)
    async def dev_discovery(state: StateDep) -> JSONResponse:
        if state.dev_issuer is None:
            return problem(404, "Not Found")
        return JSONResponse(state.dev_issuer.discovery_document())

    @app.get(DEV_ISSUER_PATH + "/.well-known/jwks.json", include_in_schema=False)
    async def dev_jwks(state: StateDep) -> JSONResponse:
        if state.dev_issuer is None:
            return problem(404, "Not Found")
        return JSONResponse(state.dev_issuer.jwks())

    return app


class _Observe:
    """A span, a request count and the latency to the response's start, per request. Plain ASGI
    (not ``BaseHTTPMiddleware``, which hands every body message through a task group and every
    streamed response part through a memory stream: a cost per 64 KiB of a chunk batch)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        state: ServerState | None = getattr(scope["app"].state, "kvgate", None) if scope["type"] == "http" else None
        if state is None:
            await self.app(scope, receive, send)
            return
        t0 = time.perf_counter()
        method = scope["method"]
        tel = state.telemetry
        with tel.tracer.start_as_current_span(f"{method} {scope['path'][:40]}") as span:

            async def observed(message: dict[str, Any]) -> None:
                if message["type"] == "http.response.start":
                    path = getattr(scope.get("route"), "path", "unmatched")
                    status = message["status"]
                    span.set_attribute("http.status_code", status)
                    tel.requests.add(1, {"method": method, "route": path, "status": str(status)})
                    tel.latency.record(time.perf_counter() - t0, {"method": method, "route": path})
                await send(message)

            await self.app(scope, receive, observed)


_Series = Callable[[], Iterable[tuple[float, dict[str, str]]]]


def _labelled(counts: ByLabel[Any], label: str) -> list[tuple[int, dict[str, str]]]:
    """Every label value, zero included (alert rules and dashboards need the series to exist)."""
    return [(n, {label: value}) for value, n in counts.items()]


def _timeouts(tiers: Iterable[Tier]) -> list[tuple[int, dict[str, str]]]:
    out: list[tuple[int, dict[str, str]]] = []
    for t in tiers:
        stats = getattr(t, "stats", None)
        timeouts = getattr(stats(), "timeouts", None) if callable(stats) else None
        if isinstance(timeouts, dict):
            out += [(n, {"tier": t.name, "op": op}) for op, n in timeouts.items()]
    return out or [(0, {"tier": "none", "op": "none"})]


def _stat(tiers: Iterable[Tier], field: str) -> list[tuple[int, dict[str, str]]]:
    out: list[tuple[int, dict[str, str]]] = []
    for t in tiers:
        stats = getattr(t, "stats", None)
        value = getattr(stats(), field, None) if callable(stats) else None
        if isinstance(value, int):
            out.append((value, {"tier": t.name}))
    return out or [(0, {"tier": "none"})]


def _breakers(tiers: Iterable[Tier]) -> list[tuple[int, dict[str, str]]]:
    """1 for a tier whose breaker (a cluster: any master's) is open or half-open."""
    out: list[tuple[int, dict[str, str]]] = []
    for t in tiers:
        is_open = getattr(t, "breaker_open", None)
        if isinstance(is_open, bool):
            out.append((int(is_open), {"tier": t.name}))
    return out or [(0, {"tier": "none"})]


def _behind(tiers: TierManager) -> list[tuple[float, dict[str, str]]]:
    """Write-behind copies by tier and outcome: a dropped copy is only a cache copy lost."""
    wb = tiers.behind
    out: list[tuple[float, dict[str, str]]] = []
    for outcome, counts in (("written", wb.written), ("dropped", wb.dropped), ("failed", wb.errors)):
        out += [(n, {"tier": name, "outcome": outcome}) for name, n in counts.items()]
    return out or [(0, {"tier": "none", "outcome": "written"})]


def _observe(state: ServerState) -> None:
    """Gauges read at scrape time from the core, the tiers and the audit writer."""
    m, tiers, audit, tel = state.runtime.metrics, state.runtime.tiers, state.runtime.audit, state.telemetry
    counters: tuple[tuple[str, str, _Series], ...] = (
        ("kvgate_lookups", "lookup calls by result", lambda: [(m.lookup_hits, {"result": "hit"}), (m.lookup_misses, {"result": "miss"})]),
        ("kvgate_loads", "retrieve calls by result", lambda: [(m.load_hits, {"result": "hit"}), (m.load_misses, {"result": "miss"})]),
        ("kvgate_chunks", "chunks stored and loaded", lambda: [(m.chunks_stored, {"op": "store"}), (m.chunks_loaded, {"op": "load"})]),
        ("kvgate_shared_chunks_loaded", "chunks of published prefixes read from their scope for a member", lambda: [(m.shared_chunks_loaded, {})]),
        ("kvgate_core_bytes", "bytes through the core", lambda: [(m.bytes_in, {"direction": "in"}), (m.bytes_out, {"direction": "out"})]),
        ("kvgate_integrity_failures", "envelopes that failed authentication", lambda: [(m.integrity_failures, {})]),
        ("kvgate_capability_denials", "capability checks denied", lambda: [(m.denials, {})]),
        ("kvgate_envelope_keys_issued", "per-envelope keys issued to remote workers, by purpose", lambda: _labelled(m.envelope_keys_issued, "purpose")),
        ("kvgate_tier_errors", "tier failures passed over as misses", lambda: [(n, {"tier": name}) for name, n in tiers.errors.items()] or [(0, {"tier": "none"})]),
        ("kvgate_load_failures", "loads that ended early, by reason", lambda: _labelled(m.load_failed, "reason")),
        ("kvgate_lookup_degraded", "lookups a tier or the KEK could not fully answer, by reason", lambda: _labelled(m.lookup_degraded, "reason")),
        ("kvgate_tier_timeouts", "tier deadlines missed, by tier and operation", lambda: _timeouts(tiers.tiers)),
        ("kvgate_load_degraded", "loads a slower tier served because a faster one failed, by reason", lambda: _labelled(m.load_degraded, "reason")),
        ("kvgate_tier_breaker_trips", "times a tier's circuit breaker opened (a cluster: any master's), by tier", lambda: _stat(tiers.tiers, "breaker_trips")),
        ("kvgate_stores_refused", "upload batches refused whole, by reason (namespace_changed: sealed for an epoch a clear ended)", lambda: [(m.stores_namespace_changed, {"reason": "namespace_changed"})]),
        ("kvgate_store_rollbacks", "envelopes of refused upload batches, removed or left in a tier that could not be reached", lambda: [(m.store_rollback_removed, {"outcome": "removed"}), (m.store_rollback_left, {"outcome": "left"})]),
        ("kvgate_tier_evictions", "chunks evicted for space or quota, by tier", lambda: _stat(tiers.tiers, "evictions")),
        ("kvgate_tier_rejected_puts", "puts a tier refused (full, over quota, too large), by tier", lambda: _stat(tiers.tiers, "rejected_puts")),
        ("kvgate_write_behind_copies", "copies queued behind the fastest tier, by tier and outcome (written, dropped, failed)", lambda: _behind(tiers)),
    )
    gauges: tuple[tuple[str, str, _Series], ...] = (
        ("kvgate_audit_queue_depth", "audit events waiting for the database", lambda: [(audit.queue_depth, {})]),
        ("kvgate_audit_spool_bytes", "audit spool size", lambda: [(audit.spool_bytes, {})]),
        ("kvgate_audit_spool_events", "audit events in the spool", lambda: [(audit.spool_events, {})]),
        ("kvgate_tier_used_bytes", "bytes held per tier", lambda: [(t.used_bytes, {"tier": t.name}) for t in tiers.tiers]),
        ("kvgate_tier_breaker_open", "1 while a tier's circuit breaker is open", lambda: _breakers(tiers.tiers)),
        ("kvgate_write_behind_queued_bytes", "bytes of copies waiting to be written behind the fastest tier", lambda: [(tiers.behind.queued_bytes, {})]),
    )
    for name, description, fn in counters:
        tel.observe(name, description, fn, monotonic=True)
    for name, description, fn in gauges:
        tel.observe(name, description, fn)
