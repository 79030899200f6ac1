"""Durable admin events vs the batched data path, into Postgres.

    PYTHONPATH=$PWD .venv/bin/python scripts/audit_durable_rate.py [--admin 300] [--data 20000]

- admin: ``await writer.record(event)`` one after another (each returns once committed): events/s
  and latency, which is what one admin action pays;
- data: ``emit`` x N then one flush (the data path, as tests/audit/test_writer.py throughput);
- mixed: the data path again while a task records one admin event every 10 ms beside it.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


async def main(admin: int, data: int) -> None:
    from audit import AuditWriter, create_audit_engine, create_audit_schema
    from audit.types import Actor, AuditEvent, Target
    from tests.support.services import scratch_database

    def ev(kind: str, i: int) -> AuditEvent:
        return AuditEvent(kind, actor=Actor(subject="bench", tenant="t1"), target=Target(tenant="t1"), details={"i": i})

    with scratch_database("kvgate_durable") as url:
        engine = create_audit_engine(url)
        await create_audit_schema(engine)
        writer = AuditWriter(engine, spool_dir=tempfile.mkdtemp(), batch_size=1000, flush_interval=0.01)
        await writer.start()
        try:
            lat = []
            t0 = time.perf_counter()
            for i in range(admin):
                s = time.perf_counter()
                await writer.record(ev("key.rotate", i))
                lat.append(time.perf_counter() - s)
            t1 = time.perf_counter()
            print(f"admin (record, sequential): {admin / (t1 - t0):,.0f} events/s; latency median "
                  f"{1e3 * statistics.median(lat):.2f} ms, p99 {1e3 * sorted(lat)[int(0.99 * len(lat))]:.2f} ms")

            async def data_path() -> float:
                s = time.perf_counter()
                for i in range(data):
                    writer.emit(ev("capability.mint", i))
                    if i % 1000 == 0:
                        await asyncio.sleep(0)
                await writer.flush(120)
                return data / (time.perf_counter() - s)

            print(f"data (emit + flush): {await data_path():,.0f} events/s")
            stop = asyncio.Event()

            async def admins() -> int:
                n = 0
                while not stop.is_set():
                    await writer.record(ev("key.rotate", n))
                    n += 1
                    await asyncio.sleep(0.01)
                return n

            task = asyncio.create_task(admins())
            rate = await data_path()
            stop.set()
            n = await task
            print(f"data with admin events beside it: {rate:,.0f} events/s ({n} durable admin events meanwhile)")
        finally:
            await writer.aclose()
            await engine.dispose()


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--admin", type=int, default=300)
    ap.add_argument("--data", type=int, default=20000)
    a = ap.parse_args()
    asyncio.run(main(a.admin, a.data))
