"""Roles and what they allow.

Three roles, read from the token's roles claim or its ``scope`` (see ``tenancy.oidc``):

- ``kv.worker``: chunk data and lookup for its own tenant (lookup, get, put, leasing the
  tenant's current data key in remote mode), and minting capabilities for those operations.
- ``kv.admin``: clear, pin, move, key rotation and audit export for its own tenant.
- ``kv.operator``: every action on any tenant, tenant lifecycle (create, disable), and sharing
  scopes and published prefixes (they reach every member tenant).

Roles do not imply one another except ``kv.operator``, which implies both others on every
tenant: an admin who also runs workers holds both roles. Unknown role strings are ignored.
"""

from __future__ import annotations

from collections.abc import Iterable
from enum import StrEnum

from tenancy.errors import PermissionDenied
from tenancy.types import Principal

__all__ = [
    "KV_ADMIN",
    "KV_OPERATOR",
    "KV_WORKER",
    "Action",
    "Role",
    "allowed_actions",
    "allowed_capability_ops",
    "can_act_on",
    "parse_roles",
    "require",
]


class Role(StrEnum):
    WORKER = "kv.worker"
    ADMIN = "kv.admin"
    OPERATOR = "kv.operator"


KV_WORKER = Role.WORKER
KV_ADMIN = Role.ADMIN
KV_OPERATOR = Role.OPERATOR


class Action(StrEnum):
    """Everything the gateway authorises by role. The first four are also capability ops."""

    LOOKUP = "lookup"
    GET = "get"
    PUT = "put"
    PIN = "pin"
    ENVELOPE_KEYS = "envelope_keys"  # per-envelope keys for a remote worker (its capability decides the op)
    CLEAR = "clear"
    MOVE = "move"
    ROTATE_KEYS = "rotate_keys"
    EXPORT_AUDIT = "export_audit"
    MANAGE_TENANTS = "manage_tenants"
    # sharing scopes and published prefixes: they reach every member tenant, so operators only
    MANAGE_PREFIXES = "manage_prefixes"


_BY_ROLE: dict[Role, frozenset[Action]] = {
    Role.WORKER: frozenset({Action.LOOKUP, Action.GET, Action.PUT, Action.ENVELOPE_KEYS}),
    Role.ADMIN: frozenset(
        {Action.PIN, Action.CLEAR, Action.MOVE, Action.ROTATE_KEYS, Action.EXPORT_AUDIT}
    ),
    Role.OPERATOR: frozenset(Action),
}
_CAPABILITY_OPS = frozenset({Action.LOOKUP, Action.GET, Action.PUT, Action.PIN})
_ROLE_VALUES = {r.value: r for r in Role}


def parse_roles(values: Iterable[str]) -> frozenset[Role]:
    """The known roles among ``values`` (a principal's role and scope strings)."""
    return frozenset(_ROLE_VALUES[v] for v in values if v in _ROLE_VALUES)


def allowed_actions(principal: Principal, tenant: str) -> frozenset[Action]:
    """What ``principal`` may do on ``tenant``."""
    roles = parse_roles(principal.roles)
    if Role.OPERATOR in roles:
        return _BY_ROLE[Role.OPERATOR]
    if tenant != principal.tenant:
        return frozenset()
    out: frozenset[Action] = frozenset()
    for role in roles:
        out |= _BY_ROLE[role]
    return out - {Action.MANAGE_TENANTS}


def allowed_capability_ops(principal: Principal, tenant: str) -> frozenset[str]:
    """The capability operations ``principal`` may have minted for ``tenant``."""
    return frozenset(a.value for a in allowed_actions(principal, tenant) & _CAPABILITY_OPS)


def can_act_on(principal: Principal, tenant: str, action: Action | str) -> bool:
    """Whether ``principal`` may perform ``action`` on ``tenant``."""
    try:
        wanted = Action(action)
    except ValueError:
        return False
    return wanted in allowed_actions(principal, tenant)


def require(principal: Principal, tenant: str, action: Action | str) -> None:
    """Raise ``PermissionDenied`` unless ``principal`` may perform ``action`` on ``tenant``."""
    if not can_act_on(principal, tenant, action):
        raise PermissionDenied(f"{principal.subject} may not {action} on tenant {tenant}")
