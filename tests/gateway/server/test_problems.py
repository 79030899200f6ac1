"""The one exception table (``gateway.server.problems``): lookup by MRO, and the answers a real
app sends with it (problem+json, the table's headers, nothing internal in a 500)."""

from __future__ import annotations

import inspect
import logging
import re
from collections.abc import AsyncIterator

import httpx
import pytest
from fastapi import FastAPI, HTTPException

import gateway.errors as gerrors
from audit.errors import AuditError, AuditStorageError, SpoolError
from crypto.errors import KekError
from gateway.errors import (
    AccessDenied,
    ChunkMissing,
    Conflict,
    GatewayError,
    InvalidRequest,
    TenantExists,
    TenantUnavailable,
)
from gateway.server.problems import (
    INTERNAL,
    PROBLEMS,
    handle,
    install_problem_handlers,
    lookup,
)
from storage.types import TierError, TierFull, TierTimeout
from tenancy.errors import DependencyUnavailable, PermissionDenied


class _NameClash(Conflict):
    """A subclass the table does not list: answered as its nearest listed base."""


class _Both(AccessDenied, InvalidRequest):
    """Two listed bases: the first in the MRO wins, as in starlette's lookup."""


def test_the_nearest_class_in_the_mro_answers() -> None:
    assert lookup(TenantExists("tenant exists")).status == 409
    assert lookup(_NameClash("x")).status == 409
    assert lookup(_Both()).status == 403  # AccessDenied precedes InvalidRequest in _Both's MRO
    assert lookup(InvalidRequest("bad")).status == 422  # not the ValueError it also is
    assert lookup(TenantUnavailable()).status == 403  # unknown tenant told as a refusal
    assert lookup(ChunkMissing()).status == 404
    for tier_error in (TierError(), TierTimeout("redis"), TierFull("full")):
        kind = lookup(tier_error)
        assert (kind.status, dict(kind.headers or {})) == (503, {"Retry-After": "1"})
    assert lookup(KekError("hsm")).status == lookup(DependencyUnavailable("database")).status == 503
    # an event that could not be made durable (database and spool both failing): an outage to retry
    for audit_error in (AuditStorageError("no commit within 30 s"), SpoolError("disk full")):
        kind = lookup(audit_error)
        assert (kind.status, dict(kind.headers or {})) == (503, {"Retry-After": "5"})
    assert lookup(AuditError("other")) is INTERNAL  # the control: only those two are outages


def test_an_exception_the_table_does_not_name_is_the_internal_row() -> None:
    for exc in (RuntimeError("boom"), KeyError("k"), ValueError("v"), GatewayError("unlisted")):
        assert lookup(exc) is INTERNAL
    # positive control: a listed type is not
    assert lookup(Conflict("c")) is not INTERNAL
    # a table without the Exception row still answers 500
    assert lookup(RuntimeError(), table={Conflict: PROBLEMS[Conflict]}) is INTERNAL


def test_http_exceptions_keep_their_status_and_headers() -> None:
    kind = lookup(HTTPException(408, "the request body did not arrive in time", headers={"Connection": "close"}))
    assert (kind.status, kind.title, dict(kind.headers or {})) == (408, "the request body did not arrive in time", {"Connection": "close"})
    assert lookup(HTTPException(502, "upstream said something internal")).title == "Error"


def test_every_gateway_error_is_drawn_in_the_tree_and_answered() -> None:
    doc = gerrors.__doc__ or ""
    classes = [getattr(gerrors, n) for n in gerrors.__all__]
    for cls in classes:
        assert inspect.isclass(cls) and issubclass(cls, GatewayError), cls
        assert re.search(rf"^[ |]+(\+-- )?{cls.__name__}\b", doc, re.M), f"{cls.__name__} is not drawn in gateway/errors.py"
        if cls is not GatewayError:  # every gateway error a route can raise has its row
            assert lookup(cls.__new__(cls)) is not INTERNAL, cls


# -- through a real app -------------------------------------------------------------------------

SECRET = "/var/lib/kvgate/kek.key sk-live-4f2a"


def _app() -> FastAPI:
    app = FastAPI()
    install_problem_handlers(app)

    @app.get("/raise/{what}")
    async def raise_(what: str, n: int = 0) -> dict[str, str]:
        raise {
            "bug": RuntimeError(SECRET),
            "exists": TenantExists("tenant exists"),
            "subclass": _NameClash("a name clash"),
            "denied": PermissionDenied(f"precise reason {SECRET}"),
            "database": DependencyUnavailable("database"),
            "kek": KekError(SECRET),
        }[what]

    return app


@pytest.fixture
async def http() -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=_app(), raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
        yield client


def _problem(r: httpx.Response, status: int) -> dict[str, object]:
    assert r.status_code == status, r.text
    assert r.headers["content-type"] == "application/problem+json"
    body = r.json()
    assert body["status"] == status and body["type"] == "about:blank" and body["title"]
    return body


async def test_an_unknown_exception_is_a_500_that_names_nothing(http: httpx.AsyncClient, caplog) -> None:
    with caplog.at_level(logging.ERROR, logger="kvgate.server"):
        r = await http.get("/raise/bug")
    assert _problem(r, 500) == {"type": "about:blank", "title": "Internal Server Error", "status": 500}
    assert "kek" not in r.text and "RuntimeError" not in r.text and "Traceback" not in r.text
    assert SECRET in caplog.text  # the operator still has it, in the log


async def test_table_rows_through_the_app(http: httpx.AsyncClient) -> None:
    assert _problem(await http.get("/raise/exists"), 409)["detail"] == "tenant exists"
    assert _problem(await http.get("/raise/subclass"), 409)["detail"] == "a name clash"
    denied = await http.get("/raise/denied")
    assert _problem(denied, 403)["detail"] == "not allowed" and SECRET not in denied.text
    db = await http.get("/raise/database")
    assert _problem(db, 503)["detail"] == "database unavailable; retry later"
    assert db.headers["retry-after"] == "5"
    kek = await http.get("/raise/kek")
    assert _problem(kek, 503)["detail"] == "the key provider unavailable; retry later" and SECRET not in kek.text
    invalid = _problem(await http.get("/raise/exists?n=x"), 422)
    assert [e["loc"] for e in invalid["errors"]] == [["query", "n"]]  # type: ignore[attr-defined]
    assert _problem(await http.get("/nowhere"), 404)["title"] == "Not Found"


def test_every_row_is_installed_with_the_one_handler() -> None:
    app = _app()
    assert set(PROBLEMS) <= set(app.exception_handlers)
    assert {app.exception_handlers[t] for t in PROBLEMS} == {handle}
