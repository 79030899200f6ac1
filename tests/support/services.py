"""Where the tests' services are, and helpers to need them: a real Postgres and Redis on
127.0.0.1 (KVGATE_TEST_POSTGRES_URL / KVGATE_TEST_REDIS_URL override), a scratch database per
use, a free port. With CI=true a test that needs an unreachable service or a missing tool fails;
elsewhere it is skipped with the reason."""

from __future__ import annotations

import asyncio
import os
import secrets
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from urllib.parse import urlparse

import pytest

__all__ = ["IN_CI", "PG_ADMIN_URL", "REDIS_URL", "free_port", "missing", "need", "scratch_database"]

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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


need = _need
