"""``POST /v1/lookup`` as a raw ASGI endpoint, mounted ahead of its FastAPI route.

A remote worker asks this once per request before its fetch, so its latency is on every remote
load's critical path, and most of a FastAPI lookup's server CPU is dependency resolution and
response validation rather than the lookup. ``RawLookup`` is a starlette ``Route`` endpoint (the
router matches it; ``data.lookup``, the FastAPI route behind it, is its OpenAPI description and
serves when the raw paths are off). It keeps, in the route's order and with its answers: the
gatekeeper's bearer-token check and body bounds; the role check on the tenant
``X-KV-Capability`` names (``deps.authorize_action``, 403 audited); the body parsed past the same
depth check (``jsonbody``, 400) and validated by the route's own model (``data.LookupRequest``, 422
with FastAPI's error shape); then ``data.answer_lookup``, whose errors meet the one exception
table (``problems.handle``). docs/server.md ("Raw paths") says when this pays.
"""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError
from starlette.exceptions import HTTPException
from starlette.requests import Request

from gateway.errors import JsonTooDeep, NotReady
from gateway.server import jsonbody, problems
from gateway.server.data import SHARED_READS, LookupRequest, answer_lookup
from gateway.server.deps import ServerState, authorize_action
from tenancy.capabilities import read_unverified
from tenancy.errors import CapabilityDenied, PermissionDenied
from tenancy.roles import Action
from tenancy.types import Principal

__all__ = ["PATH", "RawLookup"]

PATH = "/v1/lookup"
# what ``_Observe`` labels the request's metrics with (a route object's ``path``)
_ROUTE = SimpleNamespace(path=PATH)
_JSON_HEADERS = [(b"content-type", b"application/json")]


async def _read_body(receive: Any) -> bytes | None:
    """The whole body; None where the client went away first."""
    parts: list[bytes] = []
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return None
        parts.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(parts)


def _parse(body: bytes, content_type: str | None) -> Any:
    """The body as FastAPI hands it to a route's model: no body is a missing field; a JSON one
    is parsed with ``json`` once its depth is known to be bounded (``jsonbody.loads``: 400 past
    it; a decode error names its position); any other is the bytes as they are (which the model
    refuses)."""
    if not body:
        raise RequestValidationError([{"type": "missing", "loc": ("body",), "msg": "Field required", "input": None}])
    value: Any = body
    if jsonbody.is_json(content_type):
        try:
            value = jsonbody.loads(body)
        except JsonTooDeep:
            raise
        except json.JSONDecodeError as e:
            raise RequestValidationError(
                [{"type": "json_invalid", "loc": ("body", e.pos), "msg": "JSON decode error", "input": {}}]
            ) from None
        except ValueError:  # bytes that are not UTF-8 (FastAPI: any other parse failure is a 400)
            raise HTTPException(400, "There was an error parsing the body") from None
    try:
        return LookupRequest.model_validate(value, from_attributes=True)  # as FastAPI validates a body
    except ValidationError as exc:
        raise RequestValidationError([{**e, "loc": ("body", *e["loc"])} for e in exc.errors(include_url=False)]) from None


class RawLookup:
    """The ASGI endpoint of ``POST /v1/lookup`` (see the module docstring)."""

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        state: ServerState | None = getattr(scope["app"].state, "kvgate", None)
        principal: Principal | None = scope.get("state", {}).get("kvgate_principal")
        await _serve(state, principal, scope, receive, send)


async def _serve(
    state: ServerState | None, principal: Principal | None, scope: dict[str, Any], receive: Any, send: Any,
) -> None:
    scope["route"] = _ROUTE
    request = Request(scope, receive, send)
    try:
        if state is None or principal is None:  # no lifespan ran: nothing verified the caller
            raise NotReady("the server is not open")
        body = await _read_body(receive)
        if body is None:
            return  # the client is gone: nobody to answer
        capability = request.headers.get("x-kv-capability")
        if not capability:
            raise PermissionDenied("no capability")
        try:
            tenant = read_unverified(capability).tenant
        except CapabilityDenied:
            tenant = principal.tenant  # a garbled token: the capability check itself denies it
        authorize_action(state, principal, tenant, Action.LOOKUP, request)
        answer = await answer_lookup(
            state, capability, _parse(body, request.headers.get("content-type")),
            shared=request.headers.get(SHARED_READS) == "1",
        )
    except Exception as exc:  # a refusal, a bad body (HTTPException 408/413 included), or a bug
        response = await problems.handle(request, exc)
        await response(scope, receive, send)
        return
    out = json.dumps(answer, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()
    await send({"type": "http.response.start", "status": 200,
                "headers": [*_JSON_HEADERS, (b"content-length", str(len(out)).encode())]})
    await send({"type": "http.response.body", "body": out})
