"""RFC 9457 problem details: the one place where errors become HTTP responses.

``PROBLEMS`` is the one exception table (type -> status, title, type URI, detail, headers) and
``handle`` the one handler: it walks the exception's MRO through the table, as starlette's
``_lookup_exception_handler`` walks its handlers, so a subclass is answered as its nearest listed
base. Errors of the lower packages join the answer here, by type; anything not listed (a bug)
meets the ``Exception`` row: a 500 whose body names nothing, the traceback in the log only.

Bodies carry a type, a title, a status and a short generic detail; never a stack trace, an
internal name or the precise reason a token was refused (that goes to the audit log). Statuses
are chosen so no tenant can learn whether another tenant's chunk or namespace exists: a chunk of
another tenant is a 404 like any absent chunk (its storage key is unrelated), a request on
another tenant is a 403 whether or not that tenant exists.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from audit.errors import AuditSignerUnavailable, AuditStorageError, SpoolError
from crypto.errors import KekError
from gateway.chunks.service import KEYS_UNAVAILABLE, KeysUnavailable
from gateway.errors import (
    AccessDenied,
    BadFrame,
    ChunkMissing,
    Conflict,
    InvalidRequest,
    JsonTooDeep,
    KeyBudgetSpent,
    NamespaceChanged,
    NotReady,
    RateLimited,
    TenantExists,
    TenantUnavailable,
    TooLarge,
    Unauthenticated,
)
from gateway.server.shm import ReservationMissing, ShmUnavailable
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
    "PROBLEMS",
    "Conflict",
    "Problem",
    "ProblemType",
    "RateLimited",
    "TooLarge",
    "Unauthenticated",
    "handle",
    "install_problem_handlers",
    "lookup",
    "problem",
    "problem_responses",
]

log = logging.getLogger("kvgate.server")
PROBLEM = "application/problem+json"


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


def problem(status: int, title: str, detail: str | None = None, headers: Mapping[str, str] | None = None) -> JSONResponse:
    body: dict[str, Any] = {"type": "about:blank", "title": title, "status": status}
    if detail:
        body["detail"] = detail
    return JSONResponse(body, status_code=status, media_type=PROBLEM, headers=headers)


def _echo(exc: BaseException) -> str:
    """The exception's own message: only for types whose message is written for the caller."""
    return str(exc)[:300]


def _unavailable(exc: BaseException) -> str:
    return f"{getattr(exc, 'dependency', 'the key provider')} unavailable; retry later"


@dataclass(frozen=True)
class ProblemType:
    """How one exception type is answered. ``detail`` is fixed text, or a function of the exception
    for types whose message is written for the caller."""

    status: int
    title: str
    detail: str | Callable[[BaseException], str] | None = None
    headers: Mapping[str, str] | None = None
    type: str = "about:blank"
    warn: bool = False  # log it: an outage is worth a line (refusals are audited instead)

    def render(self, exc: BaseException) -> dict[str, Any]:
        detail = self.detail(exc) if callable(self.detail) else self.detail
        body: dict[str, Any] = {"type": self.type, "title": self.title, "status": self.status}
        if detail:
            body["detail"] = detail
        return body


_UNAUTHORIZED = ProblemType(401, "Unauthorized", "a valid bearer token is required", {"WWW-Authenticate": 'Bearer realm="kvgate"'})
_FORBIDDEN = ProblemType(403, "Forbidden", "not allowed")
_INVALID = ProblemType(422, "Unprocessable Content", _echo)
_CONFLICT = ProblemType(409, "Conflict", _echo)
# an outage, not a refusal and not a bug: 503 with Retry-After, on a connection that stays open
# (a 500 from an unhandled error makes the server drop keep-alive)
_DEPENDENCY = ProblemType(503, "Service Unavailable", _unavailable, {"Retry-After": "5"}, warn=True)
# an action whose audit event could be made durable neither in the database nor in the spool:
# refused (nothing was handed out), and the caller may retry
_AUDIT = ProblemType(
    503, "Service Unavailable", "the audit log cannot record this now; retry later", {"Retry-After": "5"}, warn=True,
)
INTERNAL = ProblemType(500, "Internal Server Error")


def _from_http_exception(exc: BaseException) -> ProblemType:
    """Starlette's and FastAPI's own ``HTTPException`` (a 404 route, a 405, the gatekeeper's 408
    and 413): its status, its detail as the title below 500."""
    assert isinstance(exc, StarletteHTTPException)
    title = str(exc.detail) if exc.status_code < 500 else "Error"
    return ProblemType(exc.status_code, title, None, exc.headers)


Entry = ProblemType | Callable[[BaseException], ProblemType]

# The one exception table. Order does not matter: the nearest class in an exception's MRO wins.
PROBLEMS: dict[type[Exception], Entry] = {
    Unauthenticated: _UNAUTHORIZED,
    AuthenticationFailed: _UNAUTHORIZED,
    AccessDenied: _FORBIDDEN,
    KeyBudgetSpent: ProblemType(
        403, "Forbidden", "this capability has had all the envelope keys it may have; mint a new one",
        type="urn:kvgate:problem:key-budget-spent",
    ),
    CapabilityDenied: _FORBIDDEN,
    PermissionDenied: _FORBIDDEN,
    TenantUnavailable: _FORBIDDEN,  # unknown or disabled: told like any refusal
    ChunkMissing: ProblemType(404, "Not Found", "no such chunk"),
    ReservationMissing: ProblemType(404, "Not Found", "no such reservation of this worker's (expired or given back): nothing was stored"),
    InvalidRequest: _INVALID,
    BadFrame: ProblemType(400, "Bad Request", _echo),
    JsonTooDeep: ProblemType(400, "Bad Request", _echo),
    CapabilityRequestInvalid: _INVALID,
    RequestValidationError: ProblemType(422, "Unprocessable Content", "the request does not match the schema"),
    Conflict: _CONFLICT,
    TenantExists: _CONFLICT,
    # an upload sealed for a namespace epoch a clear has ended: nothing stored; the worker seals
    # its next store under the new epoch (docs/server.md, "Stores that race a clear")
    NamespaceChanged: ProblemType(
        409, "Conflict", "the namespace was cleared since these envelopes were sealed; nothing was stored",
        type="urn:kvgate:problem:namespace-changed",
    ),
    TooLarge: ProblemType(413, "Content Too Large", "the body is larger than the configured limit"),
    RateLimited: ProblemType(429, "Too Many Requests", "too many failed authentications", {"Retry-After": "10"}),
    NotReady: ProblemType(503, "Service Unavailable", "not ready"),
    ShmUnavailable: ProblemType(503, "Service Unavailable", _echo),  # the worker loads through the socket
    TierError: ProblemType(503, "Service Unavailable", "no storage tier took the chunk", {"Retry-After": "1"}),
    DependencyUnavailable: _DEPENDENCY,
    KekError: _DEPENDENCY,
    # the KEK cannot unwrap the namespace's keys now: a worker makes it what it is in process (a
    # miss, a store of nothing), so it has a type of its own
    KeysUnavailable: ProblemType(
        503, "Service Unavailable", _unavailable, {"Retry-After": "5"}, type=KEYS_UNAVAILABLE, warn=True,
    ),
    AuditStorageError: _AUDIT,
    SpoolError: _AUDIT,
    AuditSignerUnavailable: _DEPENDENCY,  # the HSM or KMS of the signing key is away: a checkpoint or export waits
    StarletteHTTPException: _from_http_exception,
    # the client went away inside its body: nobody reads the answer, and it is no server error
    ClientDisconnect: ProblemType(400, "Bad Request", "the body ended before it was complete"),
    Exception: INTERNAL,
}


def lookup(exc: BaseException, table: Mapping[type[Exception], Entry] = PROBLEMS) -> ProblemType:
    """The answer for ``exc``: its nearest class in the table (``INTERNAL`` if none is)."""
    for cls in type(exc).__mro__:
        entry = table.get(cls)
        if entry is not None:
            return entry if isinstance(entry, ProblemType) else entry(exc)
    return INTERNAL


_NAME_FIELDS = frozenset({"tenant", "namespace"})


def _audit_refusal(request: Request, details: dict[str, Any]) -> None:
    """An ``authz.denied`` row for a refused body of an authenticated caller (who, the route,
    ``details``); nothing for a caller the gatekeeper has not verified."""
    from audit.types import Actions, AuditEvent, Target
    from gateway.server.deps import actor_of

    state = getattr(request.app.state, "kvgate", None)
    principal = request.scope.get("state", {}).get("kvgate_principal")
    if state is None or principal is None:
        return
    state.runtime.audit.emit(
        AuditEvent(
            Actions.AUTHZ_DENIED, outcome="denied", actor=actor_of(principal, request), target=Target(),
            details={"route": request.url.path[:200], **details},
        )
    )


def _audit_refused_names(request: Request, e: RequestValidationError) -> None:
    """A refused tenant or namespace name is a denial: audited (who, which field, the value
    escaped to printable ASCII), so names cannot be probed without a trace."""
    from tenancy.names import escape

    for err in e.errors()[:20]:
        loc = err.get("loc", ())
        if not loc or loc[-1] not in _NAME_FIELDS:
            continue
        _audit_refusal(request, {
            "reason": "invalid name", "field": ".".join(str(x) for x in loc)[:100], "value": escape(err.get("input")),
        })


async def handle(request: Request, exc: Exception) -> JSONResponse:
    """The one exception handler: the table's answer for ``exc`` as problem+json."""
    kind = lookup(exc)
    body = kind.render(exc)
    if kind is INTERNAL:
        log.exception("unhandled error", exc_info=exc)
    elif kind.warn:
        what = getattr(exc, "dependency", "the key provider")
        log.warning("dependency unavailable: %s (%s)", what, type(exc.__cause__ or exc).__name__)
    if isinstance(exc, JsonTooDeep):  # a body built to break the parser: a denial, audited
        _audit_refusal(request, {"reason": "JSON body too deep"})
    if isinstance(exc, RequestValidationError):  # which fields, never the values sent
        _audit_refused_names(request, exc)
        body["errors"] = [{"loc": list(err.get("loc", ())), "msg": err.get("msg", "")} for err in exc.errors()][:20]
    return JSONResponse(body, status_code=kind.status, media_type=PROBLEM, headers=kind.headers)


def install_problem_handlers(app: FastAPI) -> None:
    """``handle`` for every type in the table. Starlette routes each listed type to it (its own
    MRO walk finds the same row), ``Exception`` through its outermost server-error middleware."""
    for exc in PROBLEMS:
        app.add_exception_handler(exc, handle)
