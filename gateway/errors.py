"""Errors of the gateway. Lower packages' errors are translated at the boundary: inside the core
(``InvalidRequest`` for a bad name, ``TenantUnavailable`` for an unknown tenant, ...) or, for the
REST server, by the one exception table in ``gateway.server.problems``.

``GatewayError`` and the HTTP status the server answers: ``AccessDenied`` 403 (and
``KeyBudgetSpent``), ``InvalidRequest`` 422 (also ValueError; ``BadFrame`` and ``JsonTooDeep``
400), ``TenantUnavailable`` 403 (wherever existence must not leak), ``ChunkMissing`` 404,
``NotReady`` 503, ``Conflict`` 409 (and ``TenantExists``), ``TooLarge`` 413, ``Unauthenticated``
401, ``RateLimited`` 429. ``InsecureStateFiles``, ``RemoteUnavailable`` and the vLLM integration's
tree are defined beside the code that raises them. Lower packages' errors the server answers by
type are in ``gateway.server.problems``; anything else is a 500 whose body names nothing.

Misses, failed authentication of a stored chunk and unreachable tiers are *results* (a shorter
hit, a miss counted and audited), never exceptions for the engine.
Design notes: docs/architecture.md, section 5.
"""

from __future__ import annotations

__all__ = [
    "GatewayError",
    "AccessDenied",
    "KeyBudgetSpent",
    "InvalidRequest",
    "BadFrame",
    "JsonTooDeep",
    "TenantUnavailable",
    "ChunkMissing",
    "NotReady",
    "Conflict",
    "TenantExists",
    "TooLarge",
    "Unauthenticated",
    "RateLimited",
]


class GatewayError(Exception):
    pass


class AccessDenied(GatewayError):
    def __init__(self, reason: str = "denied") -> None:
        super().__init__("access denied")
        self.reason = reason


class KeyBudgetSpent(AccessDenied):
    """A capability asked for more per-envelope keys than one capability may have over its life
    (remote mode, ``POST /v1/keys/envelopes``): a new capability gets a new budget."""

    def __init__(self) -> None:
        super().__init__("envelope key budget spent")


class InvalidRequest(GatewayError, ValueError):
    pass


class BadFrame(InvalidRequest):
    """A batched body that does not parse as its frame; ``str()`` is told to the caller."""


class JsonTooDeep(InvalidRequest):
    """A JSON body nested deeper than the server parses; ``str()`` is told to the caller."""


class TenantUnavailable(GatewayError):
    pass


class ChunkMissing(GatewayError):
    pass


class NotReady(GatewayError):
    pass


class Conflict(GatewayError):
    """The request contradicts what is stored; ``str()`` is told to the caller."""


class TenantExists(Conflict):
    pass


class TooLarge(GatewayError):
    pass


class Unauthenticated(GatewayError):
    pass


class RateLimited(GatewayError):
    pass
