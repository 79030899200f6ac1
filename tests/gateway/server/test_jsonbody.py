"""The JSON depth check (``gateway.server.jsonbody``): the parser's own depth, whatever the
strings, escapes and encoding; and every route of the app with a body goes through it."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.routing import APIRoute

from gateway.config import Settings
from gateway.errors import JsonTooDeep
from gateway.server.app import create_app
from gateway.server.jsonbody import MAX_DEPTH, JsonBodyRoute, check_depth, is_json, loads


def _nested(depth: int, open_: str = "[", close: str = "]") -> bytes:
    return (open_ * depth + close * depth).encode()


@pytest.mark.parametrize("depth", [1, MAX_DEPTH - 1, MAX_DEPTH])
def test_bodies_up_to_the_limit_pass(depth: int):
    check_depth(_nested(depth))
    check_depth(('{"a":' * depth + "1" + "}" * depth).encode())
    assert loads(_nested(depth)) is not None


@pytest.mark.parametrize("body", [
    _nested(MAX_DEPTH + 1),
    _nested(5000),  # deep enough to make json's own parser raise RecursionError
    ('{"a":' * 3000 + "1" + "}" * 3000).encode(),
    b'{"hashes": ' + _nested(MAX_DEPTH) + b"}",  # deep inside a real field
    b"[" * 5000,  # never closed: the parser still recurses before it fails
    _nested(MAX_DEPTH + 1).decode().encode("utf-16"),  # json.loads reads UTF-16 and UTF-32 too
    _nested(MAX_DEPTH + 1).decode().encode("utf-32-le"),
    b'["\\\\", ' + _nested(MAX_DEPTH) + b"]",  # an escaped backslash ends no string
])
def test_deeper_bodies_are_refused(body: bytes):
    with pytest.raises(JsonTooDeep, match=f"deeper than {MAX_DEPTH}"):
        check_depth(body)


@pytest.mark.parametrize("body", [
    json.dumps({"hashes": ["[" * 5000, "{" * 100]}).encode(),  # brackets inside strings are text
    json.dumps({"a": '\\"[[[[' * 100}).encode(),  # escaped quotes do not end a string
    json.dumps({"envelopes": [{"hash": "ab", "salt": "cd"}] * 4096}).encode(),  # many, all shallow
    json.dumps(["[" * 100]).encode("utf-16"),
])
def test_shallow_bodies_with_many_brackets_pass(body: bytes):
    check_depth(body)
    json.loads(body)


def test_invalid_bodies_are_left_to_the_parser():
    for body in (b"\xff\xfe\xff", b'"' + b"[" * 5000, b"]" * 5000 + b"[" * 10):
        check_depth(body)  # the parser refuses each before it recurses (or never recurses)
        with pytest.raises(ValueError):
            json.loads(body)


def test_content_types_read_as_json():
    assert is_json("application/json") and is_json("application/merge-patch+json; charset=utf-8")
    assert not is_json(None) and not is_json("text/plain") and not is_json("application/octet-stream")


def _all_routes(routes: list[Any]) -> Iterator[Any]:
    for route in routes:
        included = getattr(route, "original_router", None)  # FastAPI keeps an included router whole
        yield from _all_routes(included.routes) if included is not None else (route,)


def test_every_route_with_a_body_checks_its_depth():
    app = create_app(Settings(state_dir=Path("/nonexistent")))
    with_body = [r for r in _all_routes(app.routes) if isinstance(r, APIRoute) and r.body_field is not None]
    assert {r.path for r in with_body} >= {"/v1/lookup", "/v1/capabilities", "/v1/admin/clear", "/v1/keys/envelopes"}
    assert [r.path for r in with_body if not isinstance(r, JsonBodyRoute)] == []
