"""Request dependencies: the server state, the authenticated principal and the verified scope of
an action are decided once per request here (as `Annotated` aliases), not in every route.

A route that acts on a tenant takes a ``Scope`` from ``Authorize(action, on=...)``: ``on`` says
where the tenant comes from (the capability's claim, the path, the caller's own tenant, every
tenant), the role check runs before the route does, and a refusal is a 403 with an audited
denial. A route whose tenant is in its JSON body takes ``AuthorizeBody(action, Model)``, which
owns the body (read and validated once) and returns it with its scope.
"""

from __future__ import annotations

import inspect
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Annotated, Any, Generic, Protocol, TypeVar

from fastapi import Depends, Header, Path, Query, Request
from pydantic import BaseModel, ConfigDict, Field

from audit.types import Actions, Actor, AuditEvent, Target
from gateway.chunks.envelopes import EnvelopePlane
from gateway.config import Settings
from gateway.errors import RateLimited, Unauthenticated
from gateway.server.listen import failure_key
from gateway.server.shm import Regions
from gateway.server.telemetry import Telemetry
from gateway.services.runtime import Runtime
from tenancy.capabilities import read_unverified
from tenancy.errors import AuthenticationFailed, CapabilityDenied, PermissionDenied
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
    "Authorize",
    "AuthorizeBody",
    "Scope",
    "Scoped",
    "TenantRef",
    "on_capability",
    "on_path",
    "on_own_tenant",
    "on_every_tenant",
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
    regions: Regions = field(default_factory=lambda: Regions(0))  # shared-memory loads (shm.py)


async def get_state(request: Request) -> ServerState:
    # async: FastAPI runs a plain ``def`` dependency in its thread pool, a thread hop per use
    state: ServerState = request.app.state.kvgate
    return state


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
        key = f"a:{failure_key(client)}"
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
    verified: Principal | None = request.scope.get("state", {}).get("kvgate_principal")
    if verified is not None:
        return verified
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


# -- the verified scope of an action --------------------------------------------------------------


@dataclass(frozen=True)
class Scope:
    """What a route may do, decided before it runs: ``principal`` may perform ``action`` on
    ``tenant``; ``actor`` names the caller in audit events; ``capability`` is the request's
    ``X-KV-Capability`` on data-plane routes (still to be checked by the core, against the
    namespace, operation and chunk)."""

    principal: Principal
    tenant: str
    action: Action
    actor: Actor
    capability: str | None = None


@dataclass(frozen=True)
class TenantRef:
    """The tenant an action is on, as a tenant source found it."""

    tenant: str
    capability: str | None = None


async def on_capability(principal: PrincipalDep, cap: CapabilityDep) -> TenantRef:
    """The tenant the capability names (read before its tag is checked): the caller's roles must
    allow the action there, so a capability never crosses tenants, whoever holds it."""
    try:
        tenant = read_unverified(cap).tenant
    except CapabilityDenied:
        tenant = principal.tenant  # a garbled token: the capability check itself will deny it
    return TenantRef(tenant, cap)


async def on_path(tenant: NamePath) -> TenantRef:
    return TenantRef(tenant)


async def on_own_tenant(principal: PrincipalDep) -> TenantRef:
    return TenantRef(principal.tenant)


async def on_every_tenant() -> TenantRef:
    """Every tenant at once: only an operator's roles allow an action on ``*``."""
    return TenantRef("*")


def _verify(state: ServerState, principal: Principal, request: Request, action: Action, target: TenantRef) -> Scope:
    authorize_action(state, principal, target.tenant, action, request)
    return Scope(principal, target.tenant, action, actor_of(principal, request), target.capability)


def _signature(fn: Callable[..., Any], **annotations: Any) -> inspect.Signature:
    """``fn``'s signature with its string annotations resolved and ``annotations`` put in
    (FastAPI reads a dependency's parameters from its signature)."""
    sig = inspect.signature(fn, eval_str=True)
    params = [p.replace(annotation=annotations.get(p.name, p.annotation)) for p in sig.parameters.values() if p.name != "self"]
    return sig.replace(parameters=params)


class Authorize:
    """``Annotated[Scope, Depends(Authorize(Action.GET, on=on_capability))]``: the verified scope
    of ``action`` on the tenant ``on`` finds, once per request."""

    def __init__(self, action: Action, on: Callable[..., Awaitable[TenantRef]]) -> None:
        self.action = action
        self.__signature__ = _signature(self.__call__, target=Annotated[TenantRef, Depends(on)])

    async def __call__(self, request: Request, state: StateDep, principal: PrincipalDep, target: TenantRef) -> Scope:
        return _verify(state, principal, request, self.action, target)


class _TenantBody(Protocol):
    @property
    def tenant(self) -> str: ...


B = TypeVar("B", bound=_TenantBody)


@dataclass(frozen=True)
class Scoped(Generic[B]):
    """A JSON body whose ``tenant`` field names the tenant of the action, with its verified scope."""

    body: B
    scope: Scope


class AuthorizeBody(Generic[B]):
    """``Annotated[Scoped[M], Depends(AuthorizeBody(Action.CLEAR, M))]``: the body of model ``M``,
    validated once (a bad body is a 422 before any role check, as a route's own body would be),
    and the verified scope of ``action`` on its ``tenant``."""

    def __init__(self, action: Action, model: type[B]) -> None:
        self.action = action
        self.__signature__ = _signature(self.__call__, body=model)

    async def __call__(self, body: Any, request: Request, state: StateDep, principal: PrincipalDep) -> Scoped[B]:
        return Scoped(body, _verify(state, principal, request, self.action, TenantRef(body.tenant)))
