"""Plain types shared by every layer that deals with tenants, principals and capabilities.

This module imports nothing of the project and nothing outside the standard library, so any
package (the gateway, the audit log, tests) can name these types without pulling in JOSE,
HTTP or database code, as ``starlette/types.py`` does for ASGI.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, NewType

__all__ = [
    "ALL_OPERATIONS",
    "Capability",
    "Namespace",
    "Operation",
    "Principal",
    "TenantId",
]

TenantId = NewType("TenantId", str)
"""A tenant's identifier, as taken from the tenant claim of an authenticated token."""

Namespace = NewType("Namespace", str)
"""A namespace inside one tenant (cache isolation domain: model, application, ...)."""

Operation = Literal["lookup", "get", "put", "pin"]
"""A chunk operation a capability can grant."""

ALL_OPERATIONS: frozenset[str] = frozenset({"lookup", "get", "put", "pin"})


@dataclass(frozen=True, slots=True)
class Principal:
    """An authenticated caller, the result of verifying an OIDC access token.

    ``roles`` holds every role or scope value the token carried (known or not); use
    ``tenancy.roles`` to decide what they allow. ``expires_at`` is the token's ``exp``
    (seconds since the epoch).
    """

    subject: str
    issuer: str
    tenant: TenantId
    roles: frozenset[str]
    client_id: str | None
    token_id: str | None
    expires_at: float


@dataclass(frozen=True, slots=True)
class Capability:
    """The verified content of a capability token, with every attenuation folded in.

    ``ops`` is the intersection of the minted operations and every ``ops`` caveat;
    ``expires_at`` the earliest expiry; ``chunks`` the intersection of every chunk allowlist, or
    ``None`` when no caveat restricts chunks; ``scopes`` the sharing scopes whose published
    prefixes it may read (minted from the tenant's memberships, narrowed by caveats, and checked
    against the memberships again at use). Times are seconds since the epoch.
    """

    cap_id: str
    tenant: TenantId
    namespace: Namespace
    ops: frozenset[str]
    issued_at: float
    expires_at: float
    chunks: frozenset[str] | None
    key_id: str
    scopes: frozenset[str] = frozenset()

    def allows_chunk(self, chunk: str) -> bool:
        """Whether this capability covers the chunk with this (hex) chained hash."""
        return self.chunks is None or chunk in self.chunks
