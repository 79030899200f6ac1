"""Audit events and rows for tests of the audit log."""

from __future__ import annotations

import json
from collections import defaultdict
from typing import Any

from audit.db import create_audit_engine, create_audit_schema
from audit.store import AuditStore
from audit.types import Actor, AuditEvent, Target
from audit.verify import verify_database


def event(tag: str, i: int) -> AuditEvent:
    return AuditEvent(
        "capability.mint", actor=Actor(subject=tag, tenant="t1"), target=Target(tenant="t1"), details={"i": i}
    )

async def schema(url: str) -> None:
    engine = create_audit_engine(url)
    try:
        await create_audit_schema(engine)
    finally:
        await engine.dispose()

async def rows_by_tag(url: str) -> tuple[dict[str, list[int]], int]:
    """{subject: [details.i in chain order]} and the row count, after checking the whole chain."""
    engine = create_audit_engine(url)
    try:
        store = AuditStore(engine)
        report = await verify_database(store)
        assert report.ok, report.problems
        seen: dict[str, list[int]] = defaultdict(list)
        async for rec in store.iter_records():
            seen[rec.event.actor.subject or ""].append(int(rec.event.details.split(":")[1].rstrip("}")))
        return seen, report.rows
    finally:
        await engine.dispose()


async def live_rows(live: Any, action: str) -> list[dict[str, Any]]:
    """A live server's audit events of ``action`` (``tests.support.server_fixture.LiveServer``),
    read from its database after a flush: each event's tenant, outcome and details."""
    await live.call(live.runtime.audit.flush, 10)
    engine = create_audit_engine(live.settings.db_url)
    try:
        out = []
        async for rec in AuditStore(engine).iter_records():
            e = rec.event
            if e.action == action:
                details = json.loads(e.details) if isinstance(e.details, str) else dict(e.details)
                out.append({"tenant": e.target.tenant, "outcome": e.outcome, "details": details})
        return out
    finally:
        await engine.dispose()
