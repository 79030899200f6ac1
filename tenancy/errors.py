"""Errors raised by the ``tenancy`` package. Library errors (joserfc, httpx, cryptography) are
translated into these at the package boundary; nothing outside ``tenancy`` catches a library's type.

    TenancyError
    ├── AuthenticationFailed        an OIDC token was rejected (any reason: see ``.reason``)
    ├── CapabilityDenied            a capability token was rejected or does not cover the request
    ├── CapabilityRequestInvalid    a mint request is malformed (bad ops, TTL over the maximum, ...)
    ├── PermissionDenied            an authenticated principal's roles do not allow the action
    ├── IssuerConfigError           an issuer or verifier configuration is invalid (also ValueError)
    ├── DependencyUnavailable       the registry database did not answer (an outage: retry later)
    └── DevIssuerError              the development issuer cannot run (production, unsafe key file)

``AuthenticationFailed`` and ``CapabilityDenied`` keep the precise reason in ``.reason`` for logs
and the audit trail; ``str()`` of either is a fixed, uninformative message, so that a handler that
echoes the exception to a client tells an attacker nothing about which check failed."""

from __future__ import annotations

__all__ = [
    "AuthenticationFailed",
    "CapabilityDenied",
    "CapabilityRequestInvalid",
    "DependencyUnavailable",
    "DevIssuerError",
    "IssuerConfigError",
    "PermissionDenied",
    "TenancyError",
]


class TenancyError(Exception):
    """Base class of every error raised by ``tenancy``."""


class _Denial(TenancyError):
    public_message = "denied"

    def __init__(self, reason: str) -> None:
        super().__init__(self.public_message)
        self.reason = reason

    def __repr__(self) -> str:
        return f"{type(self).__name__}(reason={self.reason!r})"


class AuthenticationFailed(_Denial):
    """An access token was rejected. ``reason`` says why (for logs and audit, not for clients)."""

    public_message = "authentication failed"


class CapabilityDenied(_Denial):
    """A capability token was rejected or does not cover the request. See ``reason``."""

    public_message = "capability denied"


class CapabilityRequestInvalid(TenancyError, ValueError):
    """A request to mint or attenuate a capability is malformed."""


class PermissionDenied(_Denial):
    """The principal is authenticated but its roles do not allow this action on this tenant."""

    public_message = "permission denied"


class IssuerConfigError(TenancyError, ValueError):
    """An issuer or verifier configuration is invalid."""


class DevIssuerError(TenancyError):
    """The development issuer refused to run (production configuration, unsafe key file, ...)."""


class DependencyUnavailable(TenancyError):
    """A dependency did not answer (``dependency``: "database"): an outage, not a refusal. The
    caller should retry later; nothing was decided about the request."""

    def __init__(self, dependency: str) -> None:
        super().__init__(f"{dependency} unavailable")
        self.dependency = dependency
