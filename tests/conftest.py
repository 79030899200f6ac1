"""Shared fixtures: real Postgres and Redis on 127.0.0.1, a fresh database and key prefix per run.

KVGATE_TEST_POSTGRES_URL / KVGATE_TEST_REDIS_URL override the servers. With CI=true a test that
needs an unreachable server fails; elsewhere it is skipped with the reason.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import AsyncIterator, Iterator

import pytest

from tests.support.services import (
    REDIS_URL,
    _need,
    scratch_database,
)

# fixtures of their own servers, for every test module that names them
pytest_plugins = ["tests.support.postgres", "tests.support.redis_server", "tests.support.redis_cluster"]


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


def pytest_collection_modifyitems(config, items):
    """Deselect the exhaustive sweeps (``@pytest.mark.exhaustive``) unless KVGATE_EXHAUSTIVE=1:
    they repeat, at ten times the cost, what their subsets already check in every run."""
    if os.environ.get("KVGATE_EXHAUSTIVE") == "1":
        return
    keep = [it for it in items if it.get_closest_marker("exhaustive") is None]
    if len(keep) != len(items):
        config.hook.pytest_deselected(items=[it for it in items if it.get_closest_marker("exhaustive") is not None])
        items[:] = keep
