"""RFC 9457 problem details: the one place where domain errors become HTTP responses.

Bodies carry a type, a title, a status and a short generic detail; never a stack trace, an
internal name or the precise reason a token was refused (that goes to the audit log). Statuses
are chosen so no tenant can learn whether another tenant's chunk or namespace exists: a chunk of
another tenant is a 404 like any absent chunk (its storage key is unrelated), a request on
another tenant is a 403 whether or not that tenant exists.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from gateway.errors import AccessDenied, ChunkMissing, InvalidRequest, NotReady, TenantUnavailable
from tenancy.errors import AuthenticationFailed, CapabilityDenied, CapabilityRequestInvalid, PermissionDenied

__all__ = ["problem", "install_problem_handlers", "Conflict", "TooLarge", "Unauthenticated", "RateLimited"]

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


def problem(status: int, title: str, detail: str | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    body = {"type": "about:blank", "title": title, "status": status}
    if detail:
        body["detail"] = detail
    return JSONResponse(body, status_code=status, media_type=PROBLEM, headers=headers)


_UNAUTHORIZED = {"WWW-Authenticate": 'Bearer realm="kvgate"'}


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

    async def validation(_r: Request, e: RequestValidationError) -> JSONResponse:
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
        (RequestValidationError, validation),
        (StarletteHTTPException, http_exc),
        (Exception, unexpected),
    ):
        app.add_exception_handler(exc, handler)  # type: ignore[arg-type]
