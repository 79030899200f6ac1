"""Shared fixtures: real Postgres and Redis on 127.0.0.1, a fresh database and key prefix per run.

KVGATE_TEST_POSTGRES_URL / KVGATE_TEST_REDIS_URL override the servers. With CI=true a test that
needs an unreachable server fails; elsewhere it is skipped with the reason.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import socket
import threading
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from urllib.parse import urlparse

import pytest

IN_CI = os.environ.get("CI", "").lower() in {"1", "true", "yes"}

# An admin URL on a database that exists; a fresh database is created next to it per test session.
PG_ADMIN_URL = os.environ.get(
    "KVGATE_TEST_POSTGRES_URL", "postgresql+asyncpg://postgres@127.0.0.1:5432/postgres"
)
REDIS_URL = os.environ.get("KVGATE_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")


def _reachable(url: str, default_port: int) -> bool:
    u = urlparse(url)
    try:
        with socket.create_connection((u.hostname or "127.0.0.1", u.port or default_port), 2):
            return True
    except OSError:
        return False


def _need(service: str, url: str, port: int) -> None:
    if _reachable(url, port):
        return
    msg = f"{service} is not reachable at {url}"
    if IN_CI:
        pytest.fail(msg + " (CI=true: services are required)")
    pytest.skip(msg)


def missing(what: str) -> None:
    """A tool a test needs is absent: fail under CI=true (CI must install it), skip elsewhere."""
    if IN_CI:
        pytest.fail(f"{what} (CI=true: required)")
    pytest.skip(what)


def _with_db(url: str, dbname: str) -> str:
    u = urlparse(url)
    return u._replace(path="/" + dbname).geturl()


def _admin_sql(sql: str) -> None:
    """Run one statement on the admin database, in a thread of its own (callers may be inside a
    running event loop)."""
    import asyncpg

    plain = PG_ADMIN_URL.replace("postgresql+asyncpg://", "postgresql://")
    errors: list[BaseException] = []

    async def run() -> None:
        conn = await asyncpg.connect(plain)
        try:
            await conn.execute(sql)
        finally:
            await conn.close()

    def target() -> None:
        try:
            asyncio.run(run())
        except BaseException as exc:  # re-raised below
            errors.append(exc)

    t = threading.Thread(target=target)
    t.start()
    t.join()
    if errors:
        raise errors[0]


@contextmanager
def scratch_database(prefix: str = "kvgate_t") -> Iterator[str]:
    """A Postgres database of its own, dropped afterwards; yields its SQLAlchemy async URL."""
    _need("PostgreSQL", PG_ADMIN_URL, 5432)
    name = f"{prefix}_{os.getpid()}_{secrets.token_hex(4)}"
    _admin_sql(f'CREATE DATABASE "{name}"')
    try:
        yield _with_db(PG_ADMIN_URL, name)
    finally:
        _admin_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture(scope="session")
def pg_database_url() -> Iterator[str]:
    """A Postgres database created for this test session and dropped after it (an SQLAlchemy
    async URL, postgresql+asyncpg://...)."""
    with scratch_database("kvgate_test") as url:
        yield url


@pytest.fixture
def fresh_pg_url(pg_database_url: str) -> Iterator[str]:
    """A Postgres database of its own for one test (for schema and migration tests)."""
    with scratch_database() as url:
        yield url


@pytest.fixture
def sqlite_url(tmp_path) -> str:
    return f"sqlite+aiosqlite:///{tmp_path / 'kvgate.db'}"


@pytest.fixture(params=["sqlite", "postgres"])
def db_url(request, tmp_path) -> str:
    """Parametrises a test over SQLite and a fresh Postgres database."""
    if request.param == "sqlite":
        return f"sqlite+aiosqlite:///{tmp_path / 'kvgate.db'}"
    return request.getfixturevalue("fresh_pg_url")


@pytest.fixture
def redis_url() -> str:
    _need("Redis", REDIS_URL, 6379)
    return REDIS_URL


@pytest.fixture
async def redis_prefix(redis_url: str) -> AsyncIterator[str]:
    """A key prefix of this test's own; every key under it is removed afterwards."""
    import redis.asyncio as aioredis

    prefix = f"kvgate-test:{os.getpid()}:{secrets.token_hex(4)}:"
    yield prefix
    client = aioredis.from_url(redis_url)
    try:
        async for key in client.scan_iter(match=prefix + "*", count=1000):
            await client.unlink(key)
    finally:
        await client.aclose()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pytest_collection_modifyitems(config, items):
    """Deselect the exhaustive sweeps (``@pytest.mark.exhaustive``) unless KVGATE_EXHAUSTIVE=1:
    they repeat, at ten times the cost, what their subsets already check in every run."""
    if os.environ.get("KVGATE_EXHAUSTIVE") == "1":
        return
    keep = [it for it in items if it.get_closest_marker("exhaustive") is None]
    if len(keep) != len(items):
        config.hook.pytest_deselected(items=[it for it in items if it.get_closest_marker("exhaustive") is not None])
        items[:] = keep
