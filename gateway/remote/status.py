"""What a remote worker makes of a kvgate server's answer: one table from HTTP status to error.

Every call of ``gateway.remote.client`` (over httpx or the data plane's own client) goes through
``check``: a 2xx is an answer, anything else the error of its row (``STATUS_ERRORS``, else
``RemoteUnavailable``: the server could not do it now, and a later call may succeed).
"""

from __future__ import annotations

from gateway.chunks.service import KEYS_UNAVAILABLE, KeysUnavailable
from gateway.errors import AccessDenied, GatewayError, InvalidRequest, NamespaceChanged
from gateway.remote.wire import RemoteUnavailable

__all__ = ["STATUS_ERRORS", "check", "error_for"]

STATUS_ERRORS: dict[int, type[GatewayError]] = {
    400: InvalidRequest,  # a body the server refused (a bad frame)
    401: AccessDenied,  # the bearer token
    403: AccessDenied,  # the capability (revoked by a clear, its key budget spent) or the roles
    409: NamespaceChanged,  # (the only 409 of a worker's calls) an upload sealed for an epoch a clear ended
    413: InvalidRequest,  # a body over the route's limit
    422: InvalidRequest,  # a field the server refused
}
"""The statuses that are the caller's fault, by error; every other non-2xx is ``RemoteUnavailable``."""


def error_for(status: int, what: str, detail: str = "") -> GatewayError | KeysUnavailable | None:
    """The error a ``status`` answer to ``what`` ("METHOD path") is; None for a 2xx. A 503 whose
    problem type is ``KEYS_UNAVAILABLE`` is ``KeysUnavailable``, as in process."""
    if 200 <= status < 300:
        return None
    if status == 503 and KEYS_UNAVAILABLE in detail:
        return KeysUnavailable(f"{what}: 503, the server's key provider cannot unwrap the namespace now")
    kind = STATUS_ERRORS.get(status, RemoteUnavailable)
    message = f"{what}: {status}"
    if kind is InvalidRequest and detail:
        message += f" {detail[:200]}"  # the server's problem detail names the field, never a secret
    return kind(message)


def check(status: int, what: str, detail: str = "") -> None:
    """Raise the error of a non-2xx ``status`` (``error_for``)."""
    error = error_for(status, what, detail)
    if error is not None:
        raise error
