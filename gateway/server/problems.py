"""RFC 9457 problem details: the one place where domain errors become HTTP responses.

Bodies carry a type, a title, a status and a short generic detail; never a stack trace, an
internal name or the precise reason a token was refused (that goes to the audit log). Statuses
are chosen so no tenant can learn whether another tenant's chunk or namespace exists: a chunk of
another tenant is a 404 like any absent chunk (its storage key is unrelated), a request on
another tenant is a 403 whether or not that tenant exists.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from crypto.errors import KekError
from gateway.errors import (
    AccessDenied,
    ChunkMissing,
    InvalidRequest,
    NotReady,
    TenantUnavailable,
)
from storage.types import TierError
from tenancy.errors import (
    AuthenticationFailed,
    CapabilityDenied,
    CapabilityRequestInvalid,
    DependencyUnavailable,
    PermissionDenied,
)

__all__ = [
    "COMMON_PROBLEMS",
    "Conflict",
    "Problem",
    "RateLimited",
    "TooLarge",
    "Unauthenticated",
    "install_problem_handlers",
    "problem",
    "problem_responses",
]

log = logging.getLogger("kvgate.server")
PROBLEM = "application/problem+json"


class Conflict(Exception):
    pass


class TooLarge(Exception):
    pass


class Unauthenticated(Exception):
    pass


class RateLimited(Exception):
    pass


class Problem(BaseModel):
    """An RFC 9457 problem document, as every error of this API is sent."""

    type: str
    title: str
    status: int
    detail: str | None = None
    errors: list[dict[str, Any]] | None = None


_TITLES = {
    400: "the body could not be parsed", 401: "a valid bearer token is required", 403: "not allowed", 404: "no such resource", 409: "conflict",
    413: "the body is larger than the configured limit", 422: "the request is invalid",
    429: "too many failed authentications", 503: "not ready, or no storage tier available",
}


def problem_responses(*codes: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI ``responses`` entries: each code answered with a problem+json document."""
    schema = Problem.model_json_schema()
    return {
        code: {"description": _TITLES.get(code, "error"), "content": {PROBLEM: {"schema": schema}}}
        for code in codes
    }


# What any authenticated route can answer.
COMMON_PROBLEMS = (400, 401, 403, 413, 422, 429, 503)


def problem(status: int, title: str, detail: str | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    body = {"type": "about:blank", "title": title, "status": status}
    if detail:
        body["detail"] = detail
    return JSONResponse(body, status_code=status, media_type=PROBLEM, headers=headers)


_UNAUTHORIZED = {"WWW-Authenticate": 'Bearer realm="kvgate"'}


_NAME_FIELDS = frozenset({"tenant", "namespace"})


def _audit_refused_names(request: Request, e: RequestValidationError) -> None:
    """A refused tenant or namespace name is a denial: audited (who, which field, the value
    escaped to printable ASCII), so names cannot be probed without a trace."""
    from audit.types import Actions, AuditEvent, Target
    from gateway.server.deps import actor_of
    from tenancy.names import escape

    state = getattr(request.app.state, "kvgate", None)
    principal = request.scope.get("state", {}).get("kvgate_principal")
    if state is None or principal is None:
        return
    for err in e.errors()[:20]:
        loc = err.get("loc", ())
        if not loc or loc[-1] not in _NAME_FIELDS:
            continue
        state.runtime.audit.emit(
            AuditEvent(
                Actions.AUTHZ_DENIED, outcome="denied", actor=actor_of(principal, request), target=Target(),
                details={
                    "reason": "invalid name", "route": request.url.path[:200],
                    "field": ".".join(str(x) for x in loc)[:100], "value": escape(err.get("input")),
                },
            )
        )


def install_problem_handlers(app: FastAPI) -> None:
    async def unauthenticated(_r: Request, _e: Exception) -> JSONResponse:
        return problem(401, "Unauthorized", "a valid bearer token is required", _UNAUTHORIZED)

    async def forbidden(_r: Request, _e: Exception) -> JSONResponse:
        return problem(403, "Forbidden", "not allowed")

    async def not_found(_r: Request, _e: Exception) -> JSONResponse:
        return problem(404, "Not Found", "no such chunk")

    async def invalid(_r: Request, e: Exception) -> JSONResponse:
        return problem(422, "Unprocessable Content", str(e)[:300])

    async def conflict(_r: Request, e: Exception) -> JSONResponse:
        return problem(409, "Conflict", str(e)[:300])

    async def too_large(_r: Request, _e: Exception) -> JSONResponse:
        return problem(413, "Content Too Large", "the body is larger than the configured limit")

    async def rate_limited(_r: Request, _e: Exception) -> JSONResponse:
        return problem(429, "Too Many Requests", "too many failed authentications", {"Retry-After": "10"})

    async def not_ready(_r: Request, _e: Exception) -> JSONResponse:
        return problem(503, "Service Unavailable", "not ready")

    async def tier_unavailable(_r: Request, _e: Exception) -> JSONResponse:
        return problem(503, "Service Unavailable", "no storage tier took the chunk", {"Retry-After": "1"})

    async def dependency_unavailable(_r: Request, e: Exception) -> JSONResponse:
        # an outage, not a refusal and not a bug: 503 with Retry-After, on a connection that stays
        # open (a 500 from an unhandled error makes the server drop keep-alive)
        what = getattr(e, "dependency", "the key provider")
        log.warning("dependency unavailable: %s (%s)", what, type(e.__cause__ or e).__name__)
        return problem(503, "Service Unavailable", f"{what} unavailable; retry later", {"Retry-After": "5"})

    async def validation(r: Request, e: RequestValidationError) -> JSONResponse:
        _audit_refused_names(r, e)
        errors = [{"loc": list(err.get("loc", ())), "msg": err.get("msg", "")} for err in e.errors()][:20]
        resp = problem(422, "Unprocessable Content", "the request does not match the schema")
        import json

        body = json.loads(resp.body)
        body["errors"] = errors
        return JSONResponse(body, status_code=422, media_type=PROBLEM)

    async def http_exc(_r: Request, e: StarletteHTTPException) -> JSONResponse:
        return problem(e.status_code, str(e.detail) if e.status_code < 500 else "Error", None, getattr(e, "headers", None))

    async def unexpected(_r: Request, e: Exception) -> JSONResponse:
        log.exception("unhandled error", exc_info=e)
        return problem(500, "Internal Server Error")

    for exc, handler in (
        (Unauthenticated, unauthenticated),
        (AuthenticationFailed, unauthenticated),
        (AccessDenied, forbidden),
        (CapabilityDenied, forbidden),
        (PermissionDenied, forbidden),
        (TenantUnavailable, forbidden),
        (ChunkMissing, not_found),
        (InvalidRequest, invalid),
        (CapabilityRequestInvalid, invalid),
        (Conflict, conflict),
        (TooLarge, too_large),
        (RateLimited, rate_limited),
        (NotReady, not_ready),
        (TierError, tier_unavailable),
        (DependencyUnavailable, dependency_unavailable),
        (KekError, dependency_unavailable),
        (RequestValidationError, validation),
        (StarletteHTTPException, http_exc),
        (Exception, unexpected),
    ):
        app.add_exception_handler(exc, handler)  # type: ignore[arg-type]
