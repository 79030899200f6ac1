"""The access service: a capability (a grant) is handed back only once its ``capability.mint``
event is durable, concurrent mints share commits, and denials stay batched."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

from audit.store import AppendResult
from tenancy.capabilities import read_unverified
from tests.support.gw import gateway_runtime


async def _minted_ids(rt: Any) -> list[str]:
    return [
        json.loads(r.event.details)["cap_id"]
        async for r in rt.audit.store.iter_records()
        if r.event.action == "capability.mint"
    ]


async def test_a_capability_is_returned_only_once_its_event_is_durable(tmp_path: Path) -> None:
    async with gateway_runtime(tmp_path / "state") as rt:
        await rt.admin.create_tenant("acme")
        token = await rt.gateway.mint_capability("acme", "default", ["lookup", "get"])
        assert rt.audit.queue_depth == 0  # nothing left in memory when the grant is handed out
        assert await _minted_ids(rt) == [read_unverified(token).cap_id]
        # the control: a denial is emitted and batched, so the same probe sees it still queued
        rt.gateway.access.denied("get", "expired")
        assert rt.audit.queue_depth == 1


async def test_concurrent_mints_share_commits(tmp_path: Path) -> None:
    async with gateway_runtime(tmp_path / "state") as rt:
        await rt.admin.create_tenant("acme")
        await rt.gateway.mint_capability("acme", "default", ["lookup"])  # the namespace exists now
        store = rt.audit.store
        append = store.append
        commits: list[int] = []

        async def counted(events: Any) -> AppendResult:
            commits.append(len(events))
            return await append(events)

        store.append = counted
        tokens = await asyncio.gather(*(rt.gateway.mint_capability("acme", "default", ["get"]) for _ in range(32)))
        assert rt.audit.queue_depth == 0
        assert sum(commits) == 32 and len(commits) <= 16, commits  # grouped, not one commit per grant
        ids = await _minted_ids(rt)
        assert {read_unverified(t).cap_id for t in tokens} <= set(ids) and len(ids) == 33
