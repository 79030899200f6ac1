"""
    GatewayError          (the gateway's errors, by the status the server answers; lower packages' become these)
     +-- AccessDenied        403  no valid capability for this tenant, namespace, operation or chunk
     |    +-- KeyBudgetSpent 403  the capability has had all the envelope keys it may have (mint a new one)
     +-- InvalidRequest      422  bad input: tokens, KV tensors, block ids, names (also ValueError)
     |    +-- BadFrame       400  a batch body that is not a well-formed frame (gateway.protocol.frames)
     |    +-- JsonTooDeep    400  a JSON body nested deeper than the server parses (gateway.server.jsonbody)
     +-- TenantUnavailable   403  the tenant is unknown or disabled (a 403 wherever existence must not leak)
     +-- ChunkMissing        404  an operation named a chunk that is not stored
     +-- NotReady            503  the gateway is not open, or its schema is behind (`kvgate migrate`)
     +-- Conflict            409  the request contradicts the stored state
     |    +-- TenantExists   409  a tenant of that name is already registered
     |    +-- NamespaceChanged 409  a store sealed for a namespace epoch a clear has ended (nothing stored)
     +-- TooLarge            413  a body over the configured limit
     +-- Unauthenticated     401  no, or no valid, bearer token
     +-- RateLimited         429  too many failed authentications (anything unlisted: a 500 naming nothing)
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
    "NamespaceChanged",
    "TooLarge",
    "Unauthenticated",
    "RateLimited",
]


class GatewayError(Exception):
    """The root of the gateway's errors. Lower packages' errors are translated at the boundary:
    inside the core (``InvalidRequest`` for a bad name, ``TenantUnavailable`` for an unknown
    tenant, ...) or, for the REST server, by the one exception table in ``gateway.server.problems``;
    anything it does not list is a 500 whose body names nothing. ``InsecureStateFiles``,
    ``RemoteUnavailable`` and the vLLM integration's errors are defined beside the code that raises
    them. Misses, failed authentication of a stored chunk and unreachable tiers are *results* (a
    shorter hit, a miss counted and audited), never exceptions for the engine."""

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


class NamespaceChanged(Conflict):
    """A store's envelopes were sealed for a namespace epoch that a clear (of the namespace or
    its tenant) has ended since: their associated data binds storage keys the namespace no longer
    has, so none of them is kept. Not an integrity failure: a store that did not happen; the next
    store seals under the new epoch."""

    def __init__(self, detail: str = "the namespace was cleared since these envelopes were sealed; nothing was stored") -> None:
        super().__init__(detail)


class TooLarge(GatewayError):
    pass


class Unauthenticated(GatewayError):
    pass


class RateLimited(GatewayError):
    pass
