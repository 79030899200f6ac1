"""Errors of the gateway core. Lower packages' errors are translated here, at the boundary.

    GatewayError
     +-- AccessDenied       no valid capability for this tenant, namespace, operation or chunk
     +-- InvalidRequest     bad input: tokens, KV tensors, block ids, names (also ValueError)
     +-- TenantUnavailable  the tenant is unknown or disabled (told to callers as AccessDenied
     |                      where existence must not leak)
     +-- ChunkMissing       an admin operation named a chunk that is not stored
     +-- NotReady           the gateway is not open, or its schema is behind (`kvgate migrate`)

Misses, failed authentication of a stored chunk and unreachable tiers are *results* (a shorter
hit, a miss counted and audited), never exceptions for the engine.
"""

from __future__ import annotations

__all__ = [
    "GatewayError",
    "AccessDenied",
    "InvalidRequest",
    "TenantUnavailable",
    "ChunkMissing",
    "NotReady",
]


class GatewayError(Exception):
    pass


class AccessDenied(GatewayError):
    def __init__(self, reason: str = "denied") -> None:
        super().__init__("access denied")
        self.reason = reason


class InvalidRequest(GatewayError, ValueError):
    pass


class TenantUnavailable(GatewayError):
    pass


class ChunkMissing(GatewayError):
    pass


class NotReady(GatewayError):
    pass
