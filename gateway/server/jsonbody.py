"""JSON request bodies with a bound on their nesting depth: one check for every route.

``json`` recurses once per nested array or object, so 5,000 ``[`` raise ``RecursionError``.
No body of this API nests more than a few levels: one nested deeper than ``MAX_DEPTH`` is
refused before it is parsed (``JsonTooDeep``, 400, audited by ``problems`` for an authenticated
caller). Body sizes are each route's own (``bodylimits``, 413). ``POST /v1/lookup`` (``rawlookup``)
parses with ``loads``; every FastAPI route with a body has ``route_class=JsonBodyRoute``.

The check uses bytes operations only: a body with at most ``MAX_DEPTH`` brackets passes at once;
otherwise strings are taken out (escapes first, then what lies between quotes) and the running
depth of the brackets left is measured, which over the body's valid JSON prefix (all the parser
reads) is the parser's own depth.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Coroutine
from itertools import accumulate
from typing import Any

from fastapi.routing import APIRoute
from starlette.requests import Request
from starlette.responses import Response

from gateway.errors import JsonTooDeep

__all__ = ["MAX_DEPTH", "JsonBodyRoute", "check_depth", "is_json", "loads"]

MAX_DEPTH = 32

_ESCAPE = re.compile(rb"\\.", re.DOTALL)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_STEPS = bytes.maketrans(b"[{]}", b"\x01\x01\xff\xff")  # +1 and -1 as signed bytes


def is_json(content_type: str | None) -> bool:
    """As FastAPI decides a JSON body: ``application/json`` or ``application/*+json``."""
    if not content_type:
        return False
    mime = content_type.split(";", 1)[0].strip().lower()
    return mime == "application/json" or (mime.startswith("application/") and mime.endswith("+json"))


def _utf8(body: bytes) -> bytes | None:
    """``body`` in UTF-8, as ``json.loads`` would read it (it also takes UTF-16 and UTF-32);
    None where it does not decode (the parser refuses it before it reads a bracket)."""
    encoding = json.detect_encoding(body)
    if encoding in ("utf-8", "utf-8-sig"):
        return body
    try:
        return body.decode(encoding, "surrogatepass").encode("utf-8", "surrogatepass")
    except UnicodeError:
        return None


def check_depth(body: bytes, limit: int = MAX_DEPTH) -> None:
    """``JsonTooDeep`` where the JSON in ``body`` nests arrays and objects deeper than ``limit``."""
    if body.count(b"[") + body.count(b"{") <= limit:
        return
    text = _utf8(body)
    if text is None:
        return
    if b"\\" in text:
        text = _ESCAPE.sub(b"", text)
    outside = b"".join(text.split(b'"')[::2])  # what lies outside the strings
    brackets = outside.translate(None, _NOT_BRACKETS)
    if brackets.count(b"[") + brackets.count(b"{") <= limit:
        return
    depth = max(accumulate(memoryview(brackets.translate(_STEPS)).cast("b")))
    if depth > limit:
        raise JsonTooDeep(f"the JSON body is nested deeper than {limit} levels")


def loads(body: bytes) -> Any:
    """``json.loads(body)`` for a body that passes ``check_depth`` (``JsonTooDeep`` otherwise)."""
    check_depth(body)
    return json.loads(body)


class JsonBodyRoute(APIRoute):
    """A FastAPI route whose JSON body passes ``check_depth`` before FastAPI parses it (the
    router's ``route_class``). Routes without a body field are left as they are."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()
        if self.body_field is None:
            return handler

        async def bounded(request: Request) -> Response:
            content_type = request.headers.get("content-type")
            if content_type is None or is_json(content_type):  # FastAPI parses a body without a type as JSON too
                check_depth(await request.body())  # read once: FastAPI's own read gets the same bytes
            return await handler(request)

        return bounded
