"""Issue 5: schemathesis against the live server's own OpenAPI document (``/openapi.json``), with
valid credentials (an operator bearer token and a capability of an existing tenant): no 5xx, and
every response conforms to the schema (status code, content type, headers, body)."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis import checks as st_checks

from tests.support.server_fixture import LiveServer, running_server

MAX_EXAMPLES = 25  # per operation; the whole test stays well under the 60 s CI budget


@pytest.fixture(scope="module")
def schema_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LiveServer, dict[str, str]]]:
    with running_server(tmp_path_factory.mktemp("schema")) as live:
        op = live.operator_token()
        with httpx.Client(base_url=live.base_url, timeout=30) as http:
            r = http.post("/v1/admin/tenants", json={"tenant": "acme"}, headers=live.headers(op))
            assert r.status_code == 201
            r = http.post(
                "/v1/capabilities", json={"namespace": "default", "ops": ["lookup", "get", "put", "pin"], "tenant": "acme"},
                headers=live.headers(op),
            )
            assert r.status_code == 201
        yield live, live.headers(op, r.json()["capability"])


def _document() -> dict:
    """The app's OpenAPI document, built without starting it (no I/O); the test checks that the
    live server serves the same one."""
    from pathlib import Path

    from gateway.config import Settings
    from gateway.server import create_app

    return create_app(Settings(state_dir=Path("/nonexistent"))).openapi()


DOCUMENT = _document()
schema = schemathesis.openapi.from_dict(DOCUMENT)

CHECKS = [
    st_checks.not_a_server_error,
    st_checks.status_code_conformance,
    st_checks.content_type_conformance,
    st_checks.response_headers_conformance,
    st_checks.response_schema_conformance,
]


@schema.parametrize()
@settings(max_examples=MAX_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), database=None)
def test_api_conforms_to_its_openapi(case, schema_server):
    live, auth = schema_server
    case.headers = {**(case.headers or {}), **auth}
    case.call_and_validate(base_url=live.base_url, checks=CHECKS)


def test_the_live_server_serves_that_document(schema_server):
    live, _ = schema_server
    assert httpx.get(live.base_url + "/openapi.json").json() == DOCUMENT
