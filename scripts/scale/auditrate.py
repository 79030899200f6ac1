"""Audit rows/s sustained into Postgres, beside raw INSERTs of the same rows in the same database.

``emitted``: the data plane's path, ``AuditWriter.emit`` kept ahead of the writer (its queue
topped up to a few batches) for the whole window, then one flush: rows committed per second.
``recorded``: the control actions' durable path, ``AuditWriter.record`` (each returns once
committed), from one caller and from 16 at once. The writer has the server's defaults (batch
size, flush interval). Ceilings, on the same rows in a copy of the table without the chain (no
lock, no head read, no duplicate check): SQLAlchemy executemany of one writer batch per
transaction, and one row per transaction from 1 and from 16 connections at once. Every committed
row is counted in the table afterwards.
"""

from __future__ import annotations

import asyncio
import inspect
import tempfile
import time
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import MetaData, func, insert, select, text
from sqlalchemy.ext.asyncio import AsyncEngine

from audit import AuditWriter, create_audit_engine, create_audit_schema
from audit.models import TABLE, audit_events
from audit.record import AuditRecord, PendingEvent
from audit.types import Actor, AuditEvent, Target

__all__ = ["audit_figures"]

_RAW = "kv_scale_raw_rows"
_RECORDERS = 16


def _event(i: int) -> AuditEvent:
    """A data-plane shaped event: one fetch's envelope keys."""
    return AuditEvent(
        "key.issue", actor=Actor(subject="scale-worker", tenant="scale", token_id=f"cap-{i % 64}"),
        target=Target(tenant="scale", namespace="default", chunk_count=16), details={"purpose": "open", "n": 16, "i": i},
    )


async def _emitted(writer: AuditWriter, seconds: float, batch: int) -> tuple[int, float]:
    n = 0
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        while writer.queue_depth < 4 * batch:
            writer.emit(_event(n))
            n += 1
        await asyncio.sleep(0.002)
    await writer.flush(300)
    return n, time.perf_counter() - t0


async def _recorded(writer: AuditWriter, seconds: float, callers: int) -> tuple[int, float]:
    counts = [0] * callers
    t0 = time.perf_counter()

    async def caller(c: int) -> None:
        while time.perf_counter() - t0 < seconds:
            await writer.record(_event(c))
            counts[c] += 1

    await asyncio.gather(*(caller(c) for c in range(callers)))
    return sum(counts), time.perf_counter() - t0


async def _raw(engine: AsyncEngine, seconds: float, batch: int, callers: int = 1) -> tuple[int, float]:
    """Rows of the writer's shape into the chain-less copy: ``batch`` per transaction, from
    ``callers`` connections at once."""
    raw = audit_events.to_metadata(MetaData(), name=_RAW)
    now = datetime.now(UTC)
    template = [
        AuditRecord.chain(PendingEvent.from_event(_event(i), now), seq=i + 1, recorded_at=now, prev_hash="0" * 64).to_row()
        for i in range(batch)
    ]
    counts = [0] * callers
    t0 = time.perf_counter()

    async def caller(c: int) -> None:
        while time.perf_counter() - t0 < seconds:
            first = (counts[c] * callers + c) * batch  # distinct seq and event ids across callers
            rows = [{**row, "seq": first + i + 1, "event_id": f"{first + i:036d}"} for i, row in enumerate(template)]
            async with engine.begin() as conn:
                await conn.execute(insert(raw), rows)
            counts[c] += 1

    await asyncio.gather(*(caller(c) for c in range(callers)))
    return sum(counts) * batch, time.perf_counter() - t0


async def _count(engine: AsyncEngine, table: str) -> int:
    async with engine.connect() as conn:
        got: int = (await conn.execute(select(func.count()).select_from(text(table)))).scalar_one()
        return got


async def audit_figures(db_url: str, seconds: float) -> dict[str, Any]:
    """Rows/s of each path for ``seconds`` (recorded paths and one-row INSERTs a third of it)."""
    engine = create_audit_engine(db_url)
    raw_engine = create_audit_engine(db_url, pool_size=_RECORDERS)  # a connection for each raw caller
    await create_audit_schema(engine)
    async with engine.begin() as conn:
        await conn.execute(text(f"CREATE TABLE {_RAW} (LIKE {TABLE} INCLUDING ALL)"))
    out: dict[str, Any] = {}
    try:
        with tempfile.TemporaryDirectory(prefix="kvgate-scale-spool-") as spool:
            writer = AuditWriter(engine, spool_dir=spool)  # the defaults a server's writer has
            await writer.start()
            batch: int = inspect.signature(AuditWriter).parameters["batch_size"].default
            try:
                n, s = await _emitted(writer, seconds, batch)
                out["emitted"] = {"rows": n, "seconds": round(s, 2), "rows_per_s": round(n / s, 1)}
                for callers in (1, _RECORDERS):
                    n, s = await _recorded(writer, seconds / 3, callers)
                    out[f"recorded_{callers}"] = {"rows": n, "seconds": round(s, 2), "rows_per_s": round(n / s, 1)}
            finally:
                await writer.aclose()
        written = await _count(engine, TABLE)
        expected = sum(v["rows"] for v in out.values())
        if written != expected:
            raise RuntimeError(f"the audit table holds {written} rows, {expected} were made durable")
        raws = (("raw_batch", batch, 1, 1.0), ("raw_row_1", 1, 1, 1 / 3), (f"raw_row_{_RECORDERS}", 1, _RECORDERS, 1 / 3))
        for name, per_tx, callers, share in raws:
            async with engine.begin() as conn:
                await conn.execute(text(f"TRUNCATE {_RAW}"))
            n, s = await _raw(raw_engine, seconds * share, per_tx, callers)
            if await _count(engine, _RAW) != n:
                raise RuntimeError(f"{_RAW} does not hold the {n} rows inserted")
            out[name] = {"rows": n, "seconds": round(s, 2), "rows_per_s": round(n / s, 1), "rows_per_tx": per_tx,
                         "callers": callers}
        out["batch_size"] = batch
        out["emitted"]["vs_raw_batch"] = round(out["emitted"]["rows_per_s"] / out["raw_batch"]["rows_per_s"], 3)
        for callers in (1, _RECORDERS):
            rec = out[f"recorded_{callers}"]
            rec["vs_raw_row"] = round(rec["rows_per_s"] / out[f"raw_row_{callers}"]["rows_per_s"], 3)
    finally:
        await raw_engine.dispose()
        await engine.dispose()
    return out
