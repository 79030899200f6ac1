"""Request dependencies: the server state, the authenticated principal and the tenant scope are
decided once per request here (as `Annotated` aliases), not in every route."""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Annotated, Any

from fastapi import Depends, Header, Path, Query, Request
from pydantic import BaseModel, ConfigDict, Field

from audit.types import Actions, Actor, AuditEvent, Target
from gateway.config import Settings
from gateway.envelopes import EnvelopePlane
from gateway.runtime import Runtime
from gateway.server.problems import RateLimited, Unauthenticated
from gateway.server.telemetry import Telemetry
from tenancy.errors import AuthenticationFailed, PermissionDenied
from tenancy.names import NAME_MAX, NAME_PATTERN
from tenancy.oidc import OidcVerifier
from tenancy.roles import Action, can_act_on
from tenancy.types import Principal

log = logging.getLogger("kvgate.server")

__all__ = [
    "ServerState",
    "StateDep",
    "PrincipalDep",
    "CapabilityDep",
    "authorize_action",
    "actor_of",
    "FailureLimiter",
    "authenticate",
    "Strict",
    "Name",
    "NamePath",
    "NameQuery",
]


class Strict(BaseModel):
    """Every request body: an unknown (say, misspelt) field is refused with 422, never ignored."""

    model_config = ConfigDict(extra="forbid")


_NAME_DOC = "lowercase ASCII letters, digits, '.', '_', '-'; starts and ends with a letter or digit"
# The one name rule (tenancy.names) as a body field, a path and a query parameter.
Name = Annotated[str, Field(min_length=1, max_length=NAME_MAX, pattern=NAME_PATTERN, description=_NAME_DOC)]
NamePath = Annotated[str, Path(min_length=1, max_length=NAME_MAX, pattern=NAME_PATTERN, description=_NAME_DOC)]
NameQuery = Annotated[str | None, Query(min_length=1, max_length=NAME_MAX, pattern=NAME_PATTERN, description=_NAME_DOC)]


class FailureLimiter:
    """A leaky bucket per key: ``limit`` failures per ``window_s`` (times ``factor`` where a caller
    asks for a looser bucket), then 429 until it drains."""

    def __init__(self, limit: int = 20, window_s: float = 60.0, max_keys: int = 10_000) -> None:
        self.limit, self.window_s, self.max_keys = limit, window_s, max_keys
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()

    def _level(self, key: str, now: float) -> float:
        level, at = self._buckets.get(key, (0.0, now))
        return max(0.0, level - (now - at) * self.limit / self.window_s)

    def blocked(self, key: str, factor: float = 1.0) -> bool:
        # "one more failure would overflow": with the bucket draining continuously, ``level >=
        # limit`` would let one extra failure through whenever a little time passed
        return self._level(key, time.monotonic()) + 1.0 > self.limit * factor

    def fail(self, key: str) -> None:
        now = time.monotonic()
        self._buckets[key] = (self._level(key, now) + 1.0, now)
        self._buckets.move_to_end(key)
        while len(self._buckets) > self.max_keys:
            self._buckets.popitem(last=False)


@dataclass
class ServerState:
    settings: Settings
    runtime: Runtime
    plane: EnvelopePlane
    verifier: OidcVerifier
    telemetry: Telemetry
    dev_issuer: Any = None
    limiter: FailureLimiter = field(default_factory=FailureLimiter)


def get_state(request: Request) -> ServerState:
    return request.app.state.kvgate


StateDep = Annotated[ServerState, Depends(get_state)]


async def authenticate(state: ServerState, authorization: str | None, client: str) -> Principal:
    """Verify the bearer token; ``Unauthenticated`` (401) or ``RateLimited`` (429) otherwise.

    The failure rate limit is keyed on the client address alone, never on anything a token
    claims before it is verified (anyone can forge a claim). And it only ever turns *failures*
    into 429: a token that verifies is served whatever its address's bucket holds, so no one can
    lock a tenant's valid users out by failing in their name or from their address."""
    token = None
    if authorization and authorization[:7].lower() == "bearer ":
        token = authorization[7:].strip()
    try:
        if not token:
            raise AuthenticationFailed("no bearer token")
        return await state.verifier.verify(token)
    except AuthenticationFailed as exc:
        # the operator's answer to "why 401?" (the reason names the check, never the token)
        log.info("401 from %s: %s", client, exc.reason[:200])
        key = f"a:{client}"
        state.telemetry.auth_denials.add(1, {"kind": "authentication"})
        if state.limiter.blocked(key):
            raise RateLimited() from None  # counted above; not one audit row per flooded request
        state.limiter.fail(key)
        state.runtime.audit.emit(
            AuditEvent(Actions.AUTHN_FAILED, outcome="denied", actor=Actor(source=client), details={"reason": exc.reason[:200]})
        )
        raise Unauthenticated() from None


async def get_principal(
    request: Request, state: StateDep, authorization: Annotated[str | None, Header()] = None
) -> Principal:
    """The principal the gatekeeper verified before the body was read (or verify it now)."""
    principal = request.scope.get("state", {}).get("kvgate_principal")
    if principal is not None:
        return principal
    client = request.client.host if request.client else "-"
    principal = await authenticate(state, authorization, client)
    request.scope.setdefault("state", {})["kvgate_principal"] = principal
    return principal


PrincipalDep = Annotated[Principal, Depends(get_principal)]


def actor_of(principal: Principal, request: Request | None = None) -> Actor:
    return Actor(
        subject=principal.subject,
        issuer=principal.issuer,
        tenant=principal.tenant,
        client_id=principal.client_id,
        token_id=principal.token_id,
        source=request.client.host if request is not None and request.client else None,
    )


def authorize_action(state: ServerState, principal: Principal, tenant: str, action: Action, request: Request | None = None) -> None:
    """The role check: raise PermissionDenied (403) and audit it unless allowed."""
    if can_act_on(principal, tenant, action):
        return
    state.telemetry.auth_denials.add(1, {"kind": "role"})
    state.runtime.audit.emit(
        AuditEvent(
            Actions.AUTHZ_DENIED,
            outcome="denied",
            actor=actor_of(principal, request),
            target=Target(tenant=tenant),
            details={"action": action.value},
        )
    )
    raise PermissionDenied(f"{action.value} not allowed")


async def get_capability(x_kv_capability: Annotated[str | None, Header()] = None) -> str:
    if not x_kv_capability:
        raise PermissionDenied("no capability")
    return x_kv_capability


CapabilityDep = Annotated[str, Depends(get_capability)]
