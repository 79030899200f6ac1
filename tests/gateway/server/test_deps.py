"""The scope dependency (``gateway.server.deps.Authorize`` / ``AuthorizeBody``): the verified scope
of an action, decided once per request before the route runs, on the real app and runtime.

Probe routes are mounted on ``create_app``'s app; the principal is put where the gatekeeper puts
a verified one (the live-server tests cover the bearer-token path), so each test names exactly
the roles and tenant it needs. Each refusal is checked beside a positive control, and for its
audited denial."""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import httpx
import pytest
from fastapi import APIRouter, Depends, FastAPI

from gateway.server.app import create_app
from gateway.server.deps import (
    Authorize,
    AuthorizeBody,
    Name,
    Scope,
    Scoped,
    ServerState,
    Strict,
    on_capability,
    on_every_tenant,
    on_own_tenant,
    on_path,
)
from tenancy.roles import Action
from tenancy.types import Principal
from tests.support.server_fixture import _migrate, server_settings
from tests.support.services import free_port


class ProbeBody(Strict):
    tenant: Name
    n: int


RotateScope = Annotated[Scope, Depends(Authorize(Action.ROTATE_KEYS, on=on_path))]
GetScope = Annotated[Scope, Depends(Authorize(Action.GET, on=on_capability))]
OwnAuditScope = Annotated[Scope, Depends(Authorize(Action.EXPORT_AUDIT, on=on_own_tenant))]
FleetScope = Annotated[Scope, Depends(Authorize(Action.MANAGE_TENANTS, on=on_every_tenant))]
ClearScope = Annotated[Scoped[ProbeBody], Depends(AuthorizeBody(Action.CLEAR, ProbeBody))]


def _out(scope: Scope) -> dict[str, Any]:
    return {
        "tenant": scope.tenant, "action": scope.action.value, "subject": scope.principal.subject,
        "actor": scope.actor.subject, "actor_tenant": scope.actor.tenant, "capability": scope.capability,
    }


probe = APIRouter(prefix="/probe")


@probe.post("/rotate/{tenant}")
async def rotate(scope: RotateScope) -> dict[str, Any]:
    return _out(scope)


@probe.get("/get")
async def get(scope: GetScope) -> dict[str, Any]:
    return _out(scope)


@probe.get("/own")
async def own(scope: OwnAuditScope) -> dict[str, Any]:
    return _out(scope)


@probe.get("/fleet")
async def fleet(scope: FleetScope) -> dict[str, Any]:
    return _out(scope)


@probe.post("/clear")
async def clear(call: ClearScope) -> dict[str, Any]:
    return {**_out(call.scope), "n": call.body.n}


@probe.post("/twice/{tenant}")
async def twice(a: RotateScope, b: RotateScope) -> dict[str, Any]:
    assert a is b  # one verification per request, shared by every parameter that asks
    return _out(a)


class _AsVerified:
    """Puts the principal named by the test's ``x-probe`` header where the gatekeeper puts the
    verified one."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            raw = dict(scope["headers"]).get(b"x-probe")
            if raw:
                p = json.loads(raw)
                scope.setdefault("state", {})["kvgate_principal"] = Principal(
                    subject=p["sub"], issuer="https://idp.test", tenant=p["tenant"], roles=frozenset(p["roles"]),
                    client_id=None, token_id=None, expires_at=time.time() + 600,
                )
        await self.app(scope, receive, send)


@dataclass
class Probe:
    app: FastAPI
    http: httpx.AsyncClient
    a: str
    b: str

    @property
    def state(self) -> ServerState:
        return self.app.state.kvgate

    @staticmethod
    def who(tenant: str, *roles: str, sub: str | None = None) -> dict[str, str]:
        return {"x-probe": json.dumps({"sub": sub or f"u-{secrets.token_hex(3)}", "tenant": tenant, "roles": roles})}

    async def denials(self, subject: str) -> list[dict[str, Any]]:
        await self.state.runtime.audit.flush(30)
        return [
            {"tenant": rec.event.target.tenant, **json.loads(rec.event.details)}
            async for rec in self.state.runtime.audit.store.iter_records()
            if rec.event.action == "authz.denied" and rec.event.actor.subject == subject
        ]


@pytest.fixture
async def probe_app(tmp_path: Path) -> AsyncIterator[Probe]:
    settings = server_settings(tmp_path / "s", free_port())
    settings.state_dir.mkdir(parents=True, mode=0o700)
    _migrate(settings.db_url)
    app = create_app(settings)
    app.include_router(probe)
    app.add_middleware(_AsVerified)
    async with app.router.lifespan_context(app):
        rt = app.state.kvgate.runtime
        a, b = f"a-{secrets.token_hex(3)}", f"b-{secrets.token_hex(3)}"
        for t in (a, b):
            await rt.admin.create_tenant(t)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://probe") as http:
            yield Probe(app, http, a, b)


def _refused(r: httpx.Response) -> None:
    assert r.status_code == 403, r.text
    assert r.headers["content-type"] == "application/problem+json"
    assert r.json()["detail"] == "not allowed"


async def test_wrong_tenant_is_refused_and_audited(probe_app: Probe) -> None:
    p = probe_app
    admin = p.who(p.a, "kv.admin", sub="admin-of-a")
    ok = await p.http.post(f"/probe/rotate/{p.a}", headers=admin)  # positive control: its own tenant
    assert ok.status_code == 200, ok.text
    assert ok.json() == {
        "tenant": p.a, "action": "rotate_keys", "subject": "admin-of-a", "actor": "admin-of-a",
        "actor_tenant": p.a, "capability": None,
    }
    _refused(await p.http.post(f"/probe/rotate/{p.b}", headers=admin))
    _refused(await p.http.post("/probe/rotate/no-such-tenant", headers=admin))  # same answer: nothing leaks
    assert await p.denials("admin-of-a") == [
        {"tenant": p.b, "action": "rotate_keys"}, {"tenant": "no-such-tenant", "action": "rotate_keys"},
    ]


async def test_a_capability_never_crosses_tenants(probe_app: Probe) -> None:
    p = probe_app
    access = p.state.runtime.access
    cap_a = await access.mint(p.a, "default", ["get"], 600)
    cap_b = await access.mint(p.b, "default", ["get"], 600)
    worker = p.who(p.a, "kv.worker", sub="worker-of-a")
    ok = await p.http.get("/probe/get", headers={**worker, "x-kv-capability": cap_a})
    assert ok.status_code == 200 and ok.json()["tenant"] == p.a and ok.json()["capability"] == cap_a
    _refused(await p.http.get("/probe/get", headers={**worker, "x-kv-capability": cap_b}))
    _refused(await p.http.get("/probe/get", headers=worker))  # no capability at all
    assert await p.denials("worker-of-a") == [{"tenant": p.b, "action": "get"}]


async def test_a_missing_role_is_refused(probe_app: Probe) -> None:
    p = probe_app
    worker = p.who(p.a, "kv.worker", sub="plain-worker")
    _refused(await p.http.post(f"/probe/rotate/{p.a}", headers=worker))  # workers do not rotate keys
    _refused(await p.http.get("/probe/own", headers=worker))
    _refused(await p.http.get("/probe/own", headers=p.who(p.a, "kv.unknown-role")))
    admin = p.who(p.a, "kv.admin", sub="admin-only")
    assert (await p.http.get("/probe/own", headers=admin)).json()["tenant"] == p.a  # positive control
    cap = await p.state.runtime.access.mint(p.a, "default", ["get"], 600)
    _refused(await p.http.get("/probe/get", headers={**admin, "x-kv-capability": cap}))  # admins hold no data role
    _refused(await p.http.get("/probe/fleet", headers=admin))  # and no fleet-wide one
    assert await p.denials("plain-worker") == [
        {"tenant": p.a, "action": "rotate_keys"}, {"tenant": p.a, "action": "export_audit"},
    ]
    assert await p.denials("admin-only") == [
        {"tenant": p.a, "action": "get"}, {"tenant": "*", "action": "manage_tenants"},
    ]


async def test_an_operator_acts_on_any_tenant(probe_app: Probe) -> None:
    p = probe_app
    op = p.who("platform", "kv.operator", sub="the-operator")
    for tenant in (p.a, p.b):
        r = await p.http.post(f"/probe/rotate/{tenant}", headers=op)
        assert r.status_code == 200 and r.json()["tenant"] == tenant and r.json()["actor_tenant"] == "platform"
    fleet = await p.http.get("/probe/fleet", headers=op)
    assert fleet.status_code == 200 and fleet.json()["tenant"] == "*"
    cap_b = await p.state.runtime.access.mint(p.b, "default", ["get"], 600)
    assert (await p.http.get("/probe/get", headers={**op, "x-kv-capability": cap_b})).status_code == 200
    assert (await p.http.post("/probe/clear", json={"tenant": p.b, "n": 1}, headers=op)).json()["n"] == 1
    assert await p.denials("the-operator") == []


async def test_a_body_scope_validates_first_and_once(probe_app: Probe) -> None:
    p = probe_app
    admin = p.who(p.a, "kv.admin", sub="body-admin")
    ok = await p.http.post("/probe/clear", json={"tenant": p.a, "n": 7}, headers=admin)
    assert ok.status_code == 200 and ok.json()["n"] == 7 and ok.json()["action"] == "clear"
    bad = await p.http.post("/probe/clear", json={"tenant": p.b, "n": "seven"}, headers=admin)
    assert bad.status_code == 422  # the body is checked before the role, as a route's own body is
    assert [e["loc"] for e in bad.json()["errors"]] == [["body", "n"]]  # once, not once per reader
    _refused(await p.http.post("/probe/clear", json={"tenant": p.b, "n": 7}, headers=admin))
    assert await p.denials("body-admin") == [{"tenant": p.b, "action": "clear"}]


async def test_the_scope_is_decided_once_per_request(probe_app: Probe) -> None:
    p = probe_app
    admin = p.who(p.a, "kv.admin", sub="twice-admin")
    assert (await p.http.post(f"/probe/twice/{p.a}", headers=admin)).status_code == 200
    _refused(await p.http.post(f"/probe/twice/{p.b}", headers=admin))
    assert await p.denials("twice-admin") == [{"tenant": p.b, "action": "rotate_keys"}]  # one row, not two
