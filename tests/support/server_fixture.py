"""A live kvgate server for tests: the real app under a real uvicorn server on 127.0.0.1.

``running_server(state_dir, db_url=None, **settings)`` migrates the database, starts uvicorn in a
thread of its own (its own event loop, so the server verifies the development issuer's tokens by
fetching its own JWKS over real HTTP, exactly as in production) and yields a ``LiveServer``:

    with running_server(tmp_path) as live:
        op = live.operator_token()
        async with live.client() as http:
            await live.create_tenant(http, "acme")
            cap = await live.capability(http, "acme")
            r = await http.post("/v1/lookup", json=..., headers=live.headers(live.worker_token("acme"), cap))

``live.call(coro_fn, *args)`` runs a coroutine on the server's own loop (where ``live.runtime``,
the server's services, lives), awaitable from the test's loop; ``live.gateway`` runs data
operations in process over those services (the server itself holds no Gateway). ``live.stop()`` is uvicorn's graceful
shutdown (requests drained, lifespan closed, audit queue flushed); the context manager calls it.

Also fixtures: ``live_server`` (SQLite, function scope) and ``live_server_pg`` (Postgres).
"""

from __future__ import annotations

import asyncio
import secrets
import threading
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest
import uvicorn

from gateway.config import Settings
from gateway.server.app import DEV_ISSUER_PATH, create_app
from gateway.server.deps import FailureLimiter, ServerState
from gateway.server.gatekeeper import uvicorn_options
from gateway.services import dbschema
from gateway.services.core import Gateway
from gateway.services.runtime import Runtime, gateway_over
from tenancy.devissuer import DevIssuer
from tests.support.services import free_port

__all__ = [
    "ADMIN",
    "ALL_OPS",
    "OPERATOR",
    "WORKER",
    "LiveServer",
    "running_server",
    "server_settings",
]

T = TypeVar("T")

WORKER = ("kv.worker",)
ADMIN = ("kv.admin",)
OPERATOR = ("kv.operator",)
ALL_OPS = ["lookup", "get", "put", "pin"]


def server_settings(state_dir: Path, port: int, db_url: str | None = None, **kw: Any) -> Settings:
    """Small, fast settings for a test server on ``port``."""
    kw.setdefault("tiers", ["memory", "disk"])
    kw.setdefault("memory_bytes", 256 << 20)
    kw.setdefault("chunk_tokens", 16)
    kw.setdefault("segment_bytes", 4096)
    kw.setdefault("cpu_threads", 1)
    kw.setdefault("disk_fsync", False)
    return Settings(
        state_dir=state_dir, database_url=db_url, public_url=f"http://127.0.0.1:{port}", port=port, **kw
    )


class LiveServer:
    """A started server: its URL, settings, app state and token minting helpers."""

    def __init__(self, settings: Settings, server: uvicorn.Server, thread: threading.Thread) -> None:
        self.settings = settings
        self.base_url = settings.public_url
        self.issuer = DevIssuer(settings.state_dir, issuer_url=self.base_url + DEV_ISSUER_PATH)
        self._server = server
        self._thread = thread
        self.loop: asyncio.AbstractEventLoop | None = None
        self._gateway: Gateway | None = None

    # -- identity ---------------------------------------------------------------------------
    def token(self, tenant: str, roles: Iterable[str] = WORKER, **kw: Any) -> str:
        return self.issuer.mint(tenant, roles, **kw)

    def worker_token(self, tenant: str) -> str:
        return self.token(tenant, WORKER)

    def admin_token(self, tenant: str) -> str:
        return self.token(tenant, ADMIN)

    def operator_token(self, tenant: str = "platform") -> str:
        return self.token(tenant, OPERATOR)

    @staticmethod
    def headers(token: str | None = None, capability: str | None = None) -> dict[str, str]:
        out: dict[str, str] = {}
        if token is not None:
            out["Authorization"] = f"Bearer {token}"
        if capability is not None:
            out["X-KV-Capability"] = capability
        return out

    # -- the server's insides (same process) -------------------------------------------------
    @property
    def state(self) -> ServerState:
        return self._server.config.app.state.kvgate  # type: ignore[union-attr]

    @property
    def runtime(self) -> Runtime:
        return self.state.runtime

    @property
    def gateway(self) -> Gateway:
        """Data operations in this process over the server's services (run them with ``call``)."""
        if self._gateway is None:
            self._gateway = gateway_over(self.runtime)
        return self._gateway

    def set_auth_failure_limit(self, limit: int, window_s: float = 60.0) -> None:
        self.state.limiter = FailureLimiter(limit=limit, window_s=window_s)

    async def call(self, fn: Callable[..., Awaitable[T]], *args: Any, **kw: Any) -> T:
        """Run ``fn(*args, **kw)`` on the server's event loop (where its runtime lives)."""
        assert self.loop is not None
        fut = asyncio.run_coroutine_threadsafe(fn(*args, **kw), self.loop)
        return await asyncio.wrap_future(fut)

    # -- REST helpers ------------------------------------------------------------------------
    def client(self, **kw: Any) -> httpx.AsyncClient:
        kw.setdefault("timeout", 30.0)
        return httpx.AsyncClient(base_url=self.base_url, **kw)

    async def create_tenant(self, http: httpx.AsyncClient, tenant: str | None = None) -> str:
        tenant = tenant or f"t-{secrets.token_hex(4)}"
        r = await http.post("/v1/admin/tenants", json={"tenant": tenant}, headers=self.headers(self.operator_token()))
        if r.status_code != 201:
            raise AssertionError(f"creating tenant {tenant}: {r.status_code} {r.text}")
        return tenant

    async def capability(
        self, http: httpx.AsyncClient, tenant: str, namespace: str = "default",
        ops: Iterable[str] = ("lookup", "get", "put"), token: str | None = None, ttl: int = 600,
    ) -> str:
        token = token or self.token(tenant, ("kv.worker", "kv.admin"))
        r = await http.post(
            "/v1/capabilities", json={"namespace": namespace, "ops": list(ops), "ttl": ttl}, headers=self.headers(token)
        )
        if r.status_code != 201:
            raise AssertionError(f"minting a capability: {r.status_code} {r.text}")
        return r.json()["capability"]

    # -- lifecycle ---------------------------------------------------------------------------
    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def stop(self, timeout: float = 30.0) -> None:
        """Graceful shutdown: uvicorn drains, the lifespan closes the runtime (audit flushed)."""
        if self._gateway is not None and self.loop is not None and self.running:
            asyncio.run_coroutine_threadsafe(self._gateway.aclose(), self.loop).result(timeout)
            self._gateway = None
        self._server.should_exit = True
        self._thread.join(timeout)
        if self._thread.is_alive():
            self._server.force_exit = True
            self._thread.join(5)
            raise AssertionError("the server did not shut down in time")


def _off_loop(fn: Callable[[], Any]) -> None:
    """Run ``fn`` in a thread of its own (it may run its own event loop) and re-raise its error."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            fn()
        except BaseException as exc:
            errors.append(exc)

    t = threading.Thread(target=run)
    t.start()
    t.join()
    if errors:
        raise errors[0]


def _migrate(url: str) -> None:
    """Alembic's env runs its own event loop: keep it off any loop already running here."""
    _off_loop(lambda: dbschema.upgrade(url))


@contextmanager
def running_server(
    state_dir: Path, db_url: str | None = None, *, auth_failure_limit: int | None = 10_000, **kw: Any
) -> Iterator[LiveServer]:
    """Start a migrated server; stop it gracefully on exit. ``auth_failure_limit``: the failed-
    authentication budget per key (high by default, so 401 tests do not run into 429s)."""
    port = free_port()
    settings = server_settings(state_dir, port, db_url, **kw)
    settings.state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    _migrate(settings.db_url)
    app = create_app(settings)
    config = uvicorn.Config(
        app, host="127.0.0.1", port=port, log_level="warning", lifespan="on",
        timeout_graceful_shutdown=10, **uvicorn_options(settings),
    )
    server = uvicorn.Server(config)
    holder: dict[str, Any] = {}

    def run() -> None:
        loop = asyncio.new_event_loop()
        holder["loop"] = loop
        try:
            loop.run_until_complete(server.serve())
        except BaseException as exc:
            holder["error"] = exc
        finally:
            loop.close()

    thread = threading.Thread(target=run, name=f"kvgate-server-{port}", daemon=True)
    live = LiveServer(settings, server, thread)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            server.should_exit = True
            raise RuntimeError(f"the test server did not start: {holder.get('error')!r}")
        time.sleep(0.02)
    live.loop = holder["loop"]
    if auth_failure_limit is not None:
        live.set_auth_failure_limit(auth_failure_limit)
    try:
        yield live
    finally:
        if live.running:
            live.stop()


@pytest.fixture
def live_server(tmp_path: Path) -> Iterator[LiveServer]:
    """A live server on SQLite, memory and disk tiers."""
    with running_server(tmp_path / "state") as live:
        yield live


@pytest.fixture
def live_server_pg(tmp_path: Path, fresh_pg_url: str) -> Iterator[LiveServer]:
    """A live server on a fresh Postgres database."""
    with running_server(tmp_path / "state", fresh_pg_url) as live:
        yield live


@contextmanager
def scratch_pg_database() -> Iterator[str]:
    """A Postgres database of its own (a server's KEK-wrapped secrets live in it, so two servers
    with different state directories must not share one)."""
    from tests.support.services import scratch_database

    with scratch_database("kvgate_srv") as url:
        yield url


@pytest.fixture(scope="module", params=["sqlite", "postgres"])
def live_any(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """One live server per test module and database (SQLite, Postgres); tests use fresh tenants."""
    state = tmp_path_factory.mktemp("kvgate-server")
    if request.param == "sqlite":
        with running_server(state) as live:
            yield live
        return
    with scratch_pg_database() as url, running_server(state, url) as live:
        yield live


# -- assertions and small builders shared by the server tests ----------------------------------
PROBLEM = "application/problem+json"


def assert_problem(r: httpx.Response, status: int) -> dict[str, Any]:
    """``r`` is an RFC 9457 problem of ``status`` (type, title, status; no body for HEAD)."""
    assert r.status_code == status, (r.status_code, r.text[:500])
    assert r.headers["content-type"].startswith(PROBLEM), r.headers.get("content-type")
    if r.request.method == "HEAD":
        return {}
    body = r.json()
    assert isinstance(body.get("type"), str) and body["type"]
    assert isinstance(body.get("title"), str) and body["title"]
    assert body.get("status") == status
    if status == 401:
        assert r.headers.get("www-authenticate", "").lower().startswith("bearer")
    return body


def fake_envelope(size: int = 256) -> bytes:
    """A well-formed envelope (the server checks only the header; it cannot decrypt)."""
    import os

    from crypto.envelope import ChunkCipher, DataKey, EnvelopeContext

    ctx = EnvelopeContext("t", "n", "k" * 64, "f" * 64, 1)
    return bytes(ChunkCipher(segment_bytes=4096).seal(DataKey(os.urandom(32), os.urandom(32)), ctx, os.urandom(size)))


def random_hash() -> str:
    return secrets.token_hex(32)
