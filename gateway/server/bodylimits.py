"""How many body bytes each route takes, declared by the route itself.

A route's endpoint says what body it takes with ``@takes(BodySize.X)`` (under its router decorator);
a route that says nothing takes a small JSON body if its method is POST, and none otherwise.
``BodyLimits`` is the table the gatekeeper reads before a byte of the body arrives: it is built
once, from the routers' own routes (their paths and methods, as the router matches them), so
no route's limit is written anywhere but beside the route.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Callable, Iterable
from typing import TypeVar

from fastapi.routing import APIRoute
from starlette.routing import BaseRoute

from gateway.config import Settings
from gateway.protocol import frames

__all__ = ["BodyLimits", "BodySize", "takes"]

F = TypeVar("F", bound=Callable[..., object])
_ATTRIBUTE = "__kvgate_body__"


class BodySize(enum.Enum):
    """The bodies a route takes; ``bytes`` says how many bytes that is under ``settings``."""

    NONE = "none"  # GET, HEAD, DELETE, and a POST whose input is all in its path
    JSON = "json"  # a small JSON body (settings.max_json_body_bytes)
    HASHES = "hashes"  # a list of up to 4,096 chained hashes (a lookup, a fetch)
    KEYS = "keys"  # up to 4,096 chained hashes to seal envelopes for
    BULK = "bulk"  # a clear or move of up to 100,000 hashes
    BATCH = "batch"  # an upload frame (gateway.protocol.frames): at least one whole chunk

    def bytes(self, settings: Settings) -> int:
        if self is BodySize.JSON:
            return settings.max_json_body_bytes
        if self is BodySize.BATCH:
            return max(settings.max_batch_bytes, settings.max_chunk_bytes + frames.HEAD + frames.SEALED_INDEX_ITEM)
        return _FIXED[self]


_FIXED = {BodySize.NONE: 0, BodySize.HASHES: 512 << 10, BodySize.KEYS: 1 << 20, BodySize.BULK: 8 << 20}


def takes(body: BodySize) -> Callable[[F], F]:
    """Declare the body the decorated endpoint's route takes (put it below ``@router.post``)."""

    def mark(endpoint: F) -> F:
        setattr(endpoint, _ATTRIBUTE, body)
        return endpoint

    return mark


def _default(method: str) -> BodySize:
    return BodySize.JSON if method == "POST" else BodySize.NONE


class BodyLimits:
    """The most body bytes a request may carry, by the route the router will match it to."""

    def __init__(self, routes: Iterable[BaseRoute], settings: Settings) -> None:
        self._exact: dict[tuple[str, str], int] = {}
        self._patterns: list[tuple[str, re.Pattern[str], int]] = []
        for route in routes:
            if not isinstance(route, APIRoute):
                continue
            for method in route.methods or ():
                body: BodySize = getattr(route.endpoint, _ATTRIBUTE, None) or _default(method)
                limit = body.bytes(settings)
                if route.param_convertors:
                    self._patterns.append((method, route.path_regex, limit))
                else:
                    self._exact.setdefault((method, route.path), limit)
        self._settings = settings

    def of(self, method: str, path: str) -> int:
        """The limit of the route ``method path`` goes to; a path no route takes: a POST's small
        JSON body, none otherwise (the router answers 404 or 405 without reading it)."""
        limit = self._exact.get((method, path))
        if limit is not None:
            return limit
        for m, pattern, limit in self._patterns:
            if m == method and pattern.match(path):
                return limit
        return _default(method).bytes(self._settings)
