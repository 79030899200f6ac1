"""Each route's body limit comes from the route's own declaration (gateway.server.bodylimits),
as the gatekeeper reads it before a byte of the body arrives."""

from __future__ import annotations

from fastapi import APIRouter

from gateway.config import Settings
from gateway.protocol import frames
from gateway.server import admin_routes, data
from gateway.server.bodylimits import BodyLimits, BodySize, takes


def _limits(settings: Settings) -> BodyLimits:
    return BodyLimits([*data.router.routes, *admin_routes.router.routes], settings)


def test_the_servers_routes_take_what_they_declare() -> None:
    s = Settings(max_json_body_bytes=20 << 10, max_batch_bytes=300 << 20, max_chunk_bytes=70 << 20)
    limits = _limits(s)
    assert limits.of("PUT", "/v1/chunks") == 300 << 20
    assert limits.of("POST", "/v1/lookup") == 512 << 10
    assert limits.of("POST", "/v1/chunks/fetch") == 512 << 10
    assert limits.of("POST", "/v1/keys/envelopes") == 1 << 20
    assert limits.of("POST", "/v1/admin/clear") == limits.of("POST", "/v1/admin/move") == 8 << 20
    assert limits.of("POST", "/v1/admin/tenants/acme/keys/rotate") == 0  # its tenant is in the path
    assert limits.of("POST", "/v1/capabilities") == 20 << 10  # undeclared POST: a small JSON body
    assert limits.of("DELETE", "/v1/admin/tenants/acme") == 0  # undeclared, not a POST: none
    assert limits.of("GET", "/v1/admin/audit/export") == 0
    assert limits.of("POST", "/v1/nowhere") == 20 << 10 and limits.of("PATCH", "/v1/nowhere") == 0


def test_a_batch_always_takes_one_whole_chunk() -> None:
    s = Settings(max_batch_bytes=1 << 20, max_chunk_bytes=64 << 20)
    assert _limits(s).of("PUT", "/v1/chunks") == (64 << 20) + frames.HEAD + frames.SEALED_INDEX_ITEM


def test_a_declaration_on_a_new_route_is_its_limit() -> None:
    router = APIRouter(prefix="/x")

    @router.post("/bulk/{name}")
    @takes(BodySize.BULK)
    async def bulk(name: str) -> None:
        return None

    @router.post("/plain")
    async def plain() -> None:
        return None

    limits = BodyLimits(router.routes, Settings())
    assert limits.of("POST", "/x/bulk/a") == 8 << 20 and limits.of("POST", "/x/bulk/b") == 8 << 20
    assert limits.of("POST", "/x/bulk/a/b") == Settings().max_json_body_bytes  # no route: the default
    assert limits.of("POST", "/x/plain") == Settings().max_json_body_bytes
    assert limits.of("GET", "/x/bulk/a") == 0  # the route takes POST only
