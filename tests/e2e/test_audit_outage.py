"""A real database outage: a throwaway Postgres cluster of this test's own is stopped in the middle
of a stream of events and started again; every event ends up in the chain exactly once, in order.

The cluster runs as the ``postgres`` system user when the tests run as root (Postgres refuses to
run as root); its data directory is a fresh temporary directory owned by that user.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from audit.writer import AuditWriter
from tests.support.audit_events import event, rows_by_tag, schema
from tests.support.postgres import ThrowawayPostgres

pytestmark = [pytest.mark.postgres, pytest.mark.slow]


async def emit_paced(writer: AuditWriter, start: int, stop: int) -> None:
    for i in range(start, stop):
        writer.emit(event("stream", i))
        if i % 10 == 0:
            await asyncio.sleep(0.002)


async def test_outage_mid_stream_loses_and_doubles_nothing(pg_cluster: ThrowawayPostgres, tmp_path: Path) -> None:
    await schema(pg_cluster.url)
    writer = AuditWriter(
        pg_cluster.url, spool_dir=tmp_path / "spool", batch_size=50, flush_interval=0.01, retry_initial=0.1, retry_max=0.5
    )
    await writer.start()
    try:
        await emit_paced(writer, 0, 1000)
        stopping = asyncio.create_task(asyncio.to_thread(pg_cluster.stop, "immediate"))  # mid-stream
        await emit_paced(writer, 1000, 1500)
        await stopping
        await emit_paced(writer, 1500, 2000)
        await writer.flush(timeout=60)
        assert writer.spool_events > 0 and writer.spool_bytes > 0  # the outage went to the spool
        await asyncio.to_thread(pg_cluster.start)
        await emit_paced(writer, 2000, 3000)
        await writer.drain(timeout=120)
        assert writer.spool_events == 0 and writer.queue_depth == 0
    finally:
        await writer.aclose()
    assert writer.stats.db_errors > 0 and writer.stats.spooled > 0 and writer.stats.replayed > 0
    seen, rows = await rows_by_tag(pg_cluster.url)  # also checks the whole chain
    assert rows == 3000
    assert seen["stream"] == list(range(3000))
    assert not any((tmp_path / "spool").iterdir())
