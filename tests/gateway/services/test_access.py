"""The access service (gateway/services/access.py), directly: a capability that is expired,
revoked, used for an operation or a chunk it does not grant, or not made by this gateway is
refused, counted and audited as ``authz.denied``, each beside a positive control that the same
tenant's valid capability passes; a grant is handed back only once its ``capability.mint`` event
is durable, concurrent mints share commits, and denials stay batched."""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from audit.store import AppendResult
from gateway.errors import AccessDenied, TenantUnavailable
from gateway.services.access import Access
from gateway.services.runtime import Runtime
from tenancy.capabilities import CapabilityAuthority, RevocationList, attenuate, read_unverified
from tests.support.gw import gateway_runtime

H1, H2 = "11" * 32, "22" * 32


class Clock:
    def __init__(self) -> None:
        self.now = time.time()

    def __call__(self) -> float:
        return self.now


@dataclass
class Svc:
    rt: Runtime
    access: Access
    clock: Clock


@pytest.fixture
async def svc(tmp_path: Path) -> AsyncIterator[Svc]:
    """An Access over the runtime's registry and audit log, with an authority on a clock the test
    moves (the runtime's own authority reads the wall clock)."""
    async with gateway_runtime(tmp_path / "state") as rt:
        await rt.admin.create_tenant("acme")
        await rt.admin.create_tenant("globex")
        clock = Clock()
        authority = CapabilityAuthority(
            {"k1": os.urandom(32)}, "k1", max_ttl=600, clock=clock, revocations=RevocationList(clock=clock)
        )
        yield Svc(rt, Access(authority, rt.registry, rt.audit, rt.metrics), clock)


async def _events(rt: Runtime, action: str) -> list[dict[str, Any]]:
    await rt.audit.flush(10)
    return [json.loads(r.event.details) async for r in rt.audit.store.iter_records() if r.event.action == action]


async def _denials(rt: Runtime) -> list[tuple[str, str]]:
    return [(d["op"], d["reason"]) for d in await _events(rt, "authz.denied")]


def _refused(access: Access, token: str, op: str, reason: str, **kw: Any) -> None:
    with pytest.raises(AccessDenied) as info:
        access.authorize(token, op, **kw)
    assert info.value.reason == reason


async def test_an_expired_capability_is_refused_and_audited(svc: Svc) -> None:
    token = await svc.access.mint("acme", "default", ["get"], 60)
    assert svc.access.authorize(token, "get").tenant == "acme"  # the control: valid until it expires
    svc.clock.now += 61
    _refused(svc.access, token, "get", "expired")
    fresh = await svc.access.mint("acme", "default", ["get"], 60)
    assert svc.access.authorize(fresh, "get").tenant == "acme"  # the tenant itself is not refused
    assert await _denials(svc.rt) == [("get", "expired")]
    assert svc.rt.metrics.denials == 1


async def test_a_revoked_capability_is_refused_and_another_tenant_is_not(svc: Svc) -> None:
    acme = await svc.access.mint("acme", "default", ["lookup", "get"], 600)
    globex = await svc.access.mint("globex", "default", ["lookup", "get"], 600)
    svc.clock.now += 1
    before = await svc.access.revoke_tenant("acme", None)
    _refused(svc.access, acme, "get", "revoked")
    _refused(svc.access, acme, "lookup", "revoked")
    assert svc.access.authorize(globex, "get").tenant == "globex"  # the control: another tenant's
    svc.clock.now += 1
    fresh = await svc.access.mint("acme", "default", ["get"], 600)
    assert svc.access.authorize(fresh, "get").tenant == "acme"  # minted after the revocation
    # recorded for other processes and restarts, and in the audit log
    live = await svc.rt.registry.live_revocations(svc.clock.now)
    assert [(t, c, nb) for t, c, nb, _ in live] == [("acme", None, before)]
    assert [e["scope"] for e in await _events(svc.rt, "capability.revoke")] == ["tenant"]
    assert await _denials(svc.rt) == [("get", "revoked"), ("lookup", "revoked")]


async def test_an_operation_the_capability_does_not_grant_is_refused(svc: Svc) -> None:
    token = await svc.access.mint("acme", "default", ["lookup"], 600)
    assert svc.access.authorize(token, "lookup").ops == frozenset({"lookup"})  # the control
    for op in ("get", "put", "pin"):
        _refused(svc.access, token, op, "operation not granted")
    assert await _denials(svc.rt) == [(op, "operation not granted") for op in ("get", "put", "pin")]
    assert svc.rt.metrics.denials == 3


async def test_a_chunk_outside_the_holders_allowlist_is_refused(svc: Svc) -> None:
    token = attenuate(await svc.access.mint("acme", "default", ["get"], 600), chunks=[H1])
    assert svc.access.authorize(token, "get", chunks=[H1]).chunks == frozenset({H1})  # the control
    _refused(svc.access, token, "get", "chunk not granted", chunks=[H2])
    _refused(svc.access, token, "get", "chunk not granted", chunks=[H1, H2])  # one outside is enough
    _refused(svc.access, token, "get", "chunk not granted")  # naming no chunk is not all of them
    assert await _denials(svc.rt) == [("get", "chunk not granted")] * 3


async def test_a_capability_this_gateway_did_not_make_is_refused(svc: Svc) -> None:
    token = await svc.access.mint("acme", "default", ["get"], 600)
    assert svc.access.authorize(token, "get").tenant == "acme"  # the control
    other = CapabilityAuthority({"k1": os.urandom(32)}, "k1", max_ttl=600)  # another gateway's key
    forged, _ = other.issue("acme", "default", ["get"], 600)
    _refused(svc.access, forged, "get", "bad tag")
    head, _, tag = token.rpartition(".")
    tampered = f"{head}.{'A' if tag[0] != 'A' else 'B'}{tag[1:]}"
    _refused(svc.access, tampered, "get", "bad tag")
    assert await _denials(svc.rt) == [("get", "bad tag")] * 2


async def test_minting_for_an_unknown_or_disabled_tenant_grants_nothing(svc: Svc) -> None:
    await svc.rt.admin.disable_tenant("globex")
    minted = len(await _events(svc.rt, "capability.mint"))
    for tenant in ("nobody", "globex"):
        with pytest.raises(TenantUnavailable):
            await svc.access.mint(tenant, "default", ["get"], 600)
    assert len(await _events(svc.rt, "capability.mint")) == minted  # nothing granted, nothing recorded
    await svc.access.mint("acme", "default", ["get"], 600)  # the control
    assert len(await _events(svc.rt, "capability.mint")) == minted + 1


async def _minted_ids(rt: Any) -> list[str]:
    return [
        json.loads(r.event.details)["cap_id"]
        async for r in rt.audit.store.iter_records()
        if r.event.action == "capability.mint"
    ]


async def test_a_capability_is_returned_only_once_its_event_is_durable(tmp_path: Path) -> None:
    async with gateway_runtime(tmp_path / "state") as rt:
        await rt.admin.create_tenant("acme")
        token = await rt.access.mint("acme", "default", ["lookup", "get"])
        assert rt.audit.queue_depth == 0  # nothing left in memory when the grant is handed out
        assert await _minted_ids(rt) == [read_unverified(token).cap_id]
        # the control: a denial is emitted and batched, so the same probe sees it still queued
        rt.access.denied("get", "expired")
        assert rt.audit.queue_depth == 1


async def test_concurrent_mints_share_commits(tmp_path: Path) -> None:
    async with gateway_runtime(tmp_path / "state") as rt:
        await rt.admin.create_tenant("acme")
        await rt.access.mint("acme", "default", ["lookup"])  # the namespace exists now
        store = rt.audit.store
        append = store.append
        commits: list[int] = []

        async def counted(events: Any) -> AppendResult:
            commits.append(len(events))
            return await append(events)

        store.append = counted
        tokens = await asyncio.gather(*(rt.access.mint("acme", "default", ["get"]) for _ in range(32)))
        assert rt.audit.queue_depth == 0
        assert sum(commits) == 32 and len(commits) <= 16, commits  # grouped, not one commit per grant
        ids = await _minted_ids(rt)
        assert {read_unverified(t).cap_id for t in tokens} <= set(ids) and len(ids) == 33
