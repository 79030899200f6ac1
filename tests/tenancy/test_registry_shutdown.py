"""A Postgres server that is shutting down (``pg_ctl stop -m smart`` while a session is still
open: the postmaster refuses new connections with SQLSTATE 57P03 until that session ends) is an
outage of the registry, ``DependencyUnavailable`` (the server answers 503), not an unhandled
database error (a 500). The soak met this under load, between ``pg_ctl stop`` and the stop.

A throwaway cluster of this test's own (``pg_cluster``), never the machine's shared server."""

from __future__ import annotations

import asyncio
import subprocess

import asyncpg
import pytest

from gateway.services import dbschema
from tenancy.errors import DependencyUnavailable
from tenancy.registry import Registry, make_engine
from tests.support.postgres import PG_BIN, ThrowawayPostgres

pytestmark = [pytest.mark.postgres, pytest.mark.slow]


async def test_a_server_shutting_down_is_an_outage_not_an_error(pg_cluster: ThrowawayPostgres) -> None:
    await asyncio.to_thread(dbschema.upgrade, pg_cluster.url)
    registry = Registry(make_engine(pg_cluster.url))
    try:
        await registry.create_tenant("acme")
        assert await registry.list_keys("acme") == []  # the control: the registry answers
        holder = await asyncpg.connect(pg_cluster.url.replace("postgresql+asyncpg://", "postgresql://"))
        await registry.engine.dispose()  # the next query opens a new connection
        stop = subprocess.Popen([*pg_cluster.prefix, str(PG_BIN / "pg_ctl"), "-D", str(pg_cluster.data), "-m", "smart",
                                 "-w", "-t", "60", "stop"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            for _ in range(100):  # until the postmaster has begun its smart shutdown
                try:
                    probe = await asyncpg.connect(pg_cluster.url.replace("postgresql+asyncpg://", "postgresql://"))
                except asyncpg.CannotConnectNowError:
                    break
                await probe.close()
                await asyncio.sleep(0.05)
            else:
                pytest.fail("the server never began shutting down")
            with pytest.raises(DependencyUnavailable):
                await registry.list_keys("acme")
        finally:
            await holder.close()
            await asyncio.to_thread(stop.wait, 60)
    finally:
        await registry.engine.dispose()
