"""Request dependencies: the server state, the authenticated principal and the tenant scope are
decided once per request here (as `Annotated` aliases), not in every route."""

from __future__ import annotations

import base64
import json
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Annotated, Any

from fastapi import Depends, Header, Request

from audit.types import Actions, Actor, AuditEvent, Target
from gateway.config import Settings
from gateway.envelopes import EnvelopePlane
from gateway.runtime import Runtime
from gateway.server.problems import RateLimited, Unauthenticated
from gateway.server.telemetry import Telemetry
from tenancy.errors import AuthenticationFailed, PermissionDenied
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
]


_ADDRESS_FACTOR = 5.0


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


def _claimed_tenant(token: str) -> str | None:
    """The tenant a token *claims* (unverified), only to key the failure rate limit."""
    try:
        payload = token.split(".")[1]
        claims = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
        value = claims.get("tenant")
        return value if isinstance(value, str) and len(value) <= 128 else None
    except Exception:
        return None


async def get_principal(
    request: Request, state: StateDep, authorization: Annotated[str | None, Header()] = None
) -> Principal:
    client = request.client.host if request.client else "-"
    token = None
    if authorization and authorization[:7].lower() == "bearer ":
        token = authorization[7:].strip()
    # Two buckets: the client address with the tenant the token claims (unverified), and the
    # address alone, looser (a client rotating made-up claims is still stopped). Never the claim
    # alone: anyone can forge one, and one client could lock a whole tenant out.
    claimed = (_claimed_tenant(token) if token else None) or "-"
    keys = (f"a:{client}|t:{claimed}", f"a:{client}")
    if state.limiter.blocked(keys[0]) or state.limiter.blocked(keys[1], _ADDRESS_FACTOR):
        raise RateLimited()
    try:
        if not token:
            raise AuthenticationFailed("no bearer token")
        return await state.verifier.verify(token)
    except AuthenticationFailed as exc:
        # the operator's answer to "why 401?" (the reason names the check, never the token)
        log.info("401 for %s %s from %s: %s", request.method, request.url.path, client, exc.reason[:200])
        for key in keys:
            state.limiter.fail(key)
        state.telemetry.auth_denials.add(1, {"kind": "authentication"})
        state.runtime.audit.emit(
            AuditEvent(Actions.AUTHN_FAILED, outcome="denied", actor=Actor(source=client), details={"reason": exc.reason[:200]})
        )
        raise Unauthenticated() from None


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
